//! The analytic layout model: schedule formulas under unit costs, memory, FLOPs, search.

use megac_ir::flops::step_flops_at_tp;
use megac_ir::spec::{Recompute, Schedule};
use megac_sim::calibrate::MEGATRON_H100;
use megac_sim::model::{estimate, inflight, ParallelLayout};
use megac_sim::search::{enumerate, search};
use megac_sim::{Cluster, CostModel};

fn layout(pp: u64, vpp: u64, dp: u64, schedule: Schedule) -> ParallelLayout {
    ParallelLayout {
        tp: 8,
        pp,
        vpp,
        dp,
        cp: 1,
        ep: 1,
        micro_batch: 1,
        schedule,
        recompute: Recompute::None,
        sequence_parallel: true,
        distributed_optimizer: true,
    }
}

fn unit() -> CostModel {
    CostModel::unit(Cluster::preset("h100-sxm").unwrap().fit(1 << 16).unwrap())
}

/// Under unit costs (F = B = W = 1 per chunk and micro-batch) the model reproduces the
/// bubble formulas of megatron-lm.md §2.7 exactly.
#[test]
fn unit_costs_reproduce_the_schedule_formulas() {
    let spec = MEGATRON_H100[8].spec(); // 112 layers
    let cost = unit();
    for (p, m) in [(2u64, 8u64), (4, 4), (4, 16), (8, 32), (16, 64), (7, 5)] {
        let s = {
            let mut s = spec.clone();
            s.train.global_batch = m; // dp = 1, micro-batch 1: m micro-batches
            s
        };
        if 112 % p != 0 {
            continue;
        }
        let (pf, mf) = (p as f64, m as f64);
        let e = estimate(&s, &layout(p, 1, 1, Schedule::OneFOneB), &cost);
        assert_eq!(e.microbatches, m);
        assert_eq!(e.bubble_fraction, (pf - 1.0) / mf, "1f1b p={p} m={m}");
        assert_eq!(
            e.step_seconds,
            3.0 * (mf + pf - 1.0),
            "1f1b step p={p} m={m}"
        );
        let g = estimate(&s, &layout(p, 1, 1, Schedule::Gpipe), &cost);
        assert_eq!(g.bubble_fraction, (pf - 1.0) / mf, "gpipe p={p} m={m}");
        let z = estimate(&s, &layout(p, 1, 1, Schedule::ZbH1), &cost);
        assert_eq!(
            z.bubble_fraction,
            (pf - 1.0) / (3.0 * mf),
            "zb-h1 p={p} m={m}"
        );
        for v in [2u64, 4, 7] {
            if (112 / p) % v != 0 || m % p != 0 {
                continue;
            }
            let i = estimate(&s, &layout(p, v, 1, Schedule::Interleaved), &cost);
            let want = (pf - 1.0) / (v as f64 * mf);
            assert!(
                (i.bubble_fraction - want).abs() < 1e-12,
                "interleaved p={p} v={v} m={m}: {} vs {want}",
                i.bubble_fraction
            );
        }
    }
    // No pipeline, no bubble.
    let e = estimate(&spec, &layout(1, 1, 1, Schedule::OneFOneB), &cost);
    assert_eq!(e.bubble_fraction, 0.0);
}

#[test]
fn in_flight_micro_batches_follow_the_schedule() {
    let l = |pp, vpp, s| layout(pp, vpp, 1, s);
    assert_eq!(inflight(&l(8, 1, Schedule::OneFOneB), 32, 0), 8.0);
    assert_eq!(inflight(&l(8, 1, Schedule::OneFOneB), 32, 7), 1.0);
    assert_eq!(inflight(&l(8, 1, Schedule::OneFOneB), 4, 0), 4.0);
    assert_eq!(inflight(&l(8, 1, Schedule::Gpipe), 32, 0), 32.0);
    // Megatron's interleaving penalty p·(1 + (p−1)/(p·v)) on the first stage.
    let p = 8.0;
    let v = 2.0;
    assert_eq!(
        inflight(&l(8, 2, Schedule::Interleaved), 32, 0),
        p * (1.0 + (p - 1.0) / (p * v))
    );
}

#[test]
fn memory_responds_to_the_layout() {
    let spec = MEGATRON_H100[6].spec(); // 177B, TP8 PP6 DP48
    let cost = CostModel::new(Cluster::preset("h100-sxm").unwrap().fit(2304).unwrap());
    let base = layout(6, 1, 48, Schedule::OneFOneB);
    let e = estimate(&spec, &base, &cost);
    let no_dist = estimate(
        &spec,
        &ParallelLayout {
            distributed_optimizer: false,
            ..base.clone()
        },
        &cost,
    );
    assert!(no_dist.memory.optimizer > 40.0 * e.memory.optimizer);
    let full = estimate(
        &spec,
        &ParallelLayout {
            recompute: Recompute::Full,
            ..base.clone()
        },
        &cost,
    );
    assert!(full.memory.activations < 0.25 * e.memory.activations);
    assert!(full.step_seconds > e.step_seconds);
    let no_sp = estimate(
        &spec,
        &ParallelLayout {
            sequence_parallel: false,
            ..base.clone()
        },
        &cost,
    );
    // Sequence parallelism shards the saved norm outputs too (they are gathered again in
    // backward, as Megatron): at tp = 8 well under half of the unsharded activations.
    assert!(no_sp.memory.activations > 2.0 * e.memory.activations);
    // Parameters on the widest stage: about 177e9 / (8 · 6) bf16 working weights, within 10%.
    let p = e.memory.params / 2.0;
    assert!((p / (177e9 / 48.0) - 1.0).abs() < 0.1, "{p}");
}

/// Megatron's closed form for dense GPT, `72·B·s·l·h²·(1 + s/(12h) + V/(12·l·h))`.
#[test]
fn model_flops_match_megatron() {
    let r = &MEGATRON_H100[2];
    let spec = r.spec();
    let (b, s, l, h, v) = (
        r.batch as f64,
        4096.0,
        r.layers as f64,
        r.hidden as f64,
        131072.0,
    );
    let closed = 72.0 * b * s * l * h * h * (1.0 + s / (12.0 * h) + v / (12.0 * l * h));
    assert!((step_flops_at_tp(&spec, 4).total / closed - 1.0).abs() < 1e-12);
}

#[test]
fn search_ranks_layouts_that_fit() {
    let mut spec = MEGATRON_H100[1].spec(); // 7.1B
    spec.train.global_batch = 64;
    let all = enumerate(&spec, 64);
    assert!(all.iter().all(|l| l.world() == 64));
    assert!(all
        .iter()
        .all(|l| 30 % (l.pp * l.vpp) == 0 && 32 % l.tp == 0));
    assert!(all
        .iter()
        .all(|l| l.schedule != Schedule::Interleaved || l.microbatches(64) % l.pp == 0));
    let cost = CostModel::new(Cluster::preset("h100-sxm").unwrap().fit(64).unwrap());
    let r = search(&spec, 64, &cost, 5).unwrap();
    assert_eq!(r.searched, all.len());
    assert_eq!(r.best.len(), 5);
    assert!(r
        .best
        .windows(2)
        .all(|w| w[0].estimate.step_seconds <= w[1].estimate.step_seconds));
    assert!(r.best.iter().all(|c| c.estimate.fits));
}

#[test]
fn a_model_that_fits_nowhere_says_how_far_off_it_is() {
    let spec = MEGATRON_H100[8].spec(); // 462B on 8 GPUs
    let cost = CostModel::new(Cluster::preset("a100-80g").unwrap().fit(8).unwrap());
    let e = search(&spec, 8, &cost, 5).unwrap_err();
    assert!(
        e.message
            .starts_with("no layout of gpt-462B fits on 8 × a100-80g"),
        "{}",
        e.message
    );
    assert!(e.message.contains("the smallest needs"), "{}", e.message);
}
