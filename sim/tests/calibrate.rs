//! The calibration targets: Megatron-LM's H100 weak-scaling table (megatron-lm.md §10.1)
//! predicted within 10% per row and 5% on average (`bench/calibrate.sh` prints the table),
//! and the fitting code (`megac_sim::calibrate::fit`): it recovers known constants from
//! synthetic measurements and keeps fitted constants inside their physical bounds. The
//! leave-one-out run is left to `bash bench/calibrate.sh`.

use megac_sim::calibrate::{self, fit};
use megac_sim::{Cluster, CostModel, CostParams};

#[test]
fn megatron_weak_scaling_table_within_targets() {
    let cluster = Cluster::preset("h100-sxm").unwrap();
    let rows = calibrate::calibrate(&cluster);
    let report = calibrate::report(&rows);
    assert_eq!(rows.len(), 9);
    for r in &rows {
        assert!(
            r.error.abs() < 0.10,
            "{} off by {:.1}%\n{report}",
            r.row.name,
            100.0 * r.error
        );
    }
    let mean = rows.iter().map(|r| r.error.abs()).sum::<f64>() / rows.len() as f64;
    assert!(mean < 0.05, "mean {mean}\n{report}");
}

/// Every knob's search range lies inside its physical range, and `check_plausible` holds
/// for the preset's constants and rejects implausible ones.
#[test]
fn knob_bounds_are_physical() {
    for k in fit::all_knobs() {
        assert!(k.lo <= k.hi, "{}", k.name);
        if k.name.contains("efficiency") {
            assert!(
                k.lo > 0.0 && k.hi <= 1.0,
                "{}: [{}, {}]",
                k.name,
                k.lo,
                k.hi
            );
        } else if k.name == "tp_comm_overlap" {
            assert!(k.lo >= 0.0 && k.hi <= 1.0, "{}", k.name);
        } else {
            assert!(k.lo >= 0.0, "{}", k.name);
        }
        // The attention knob keeps the backward below the forward: both within (0, 1].
        let mut p = CostParams::default();
        (k.set)(&mut p, k.hi);
        fit::check_plausible(&p).unwrap_or_else(|e| panic!("{} at its upper bound: {e}", k.name));
        (k.set)(&mut p, k.lo);
        fit::check_plausible(&p).unwrap_or_else(|e| panic!("{} at its lower bound: {e}", k.name));
    }
    fit::check_plausible(&Cluster::preset("h100-sxm").unwrap().cost).unwrap();
    for bad in [
        CostParams {
            gemm_efficiency: 1.2,
            ..CostParams::default()
        },
        CostParams {
            link_efficiency: 1.01,
            ..CostParams::default()
        },
        CostParams {
            memory_efficiency: 0.0,
            ..CostParams::default()
        },
        CostParams {
            tp_comm_overlap: -0.1,
            ..CostParams::default()
        },
        CostParams {
            kernel_overhead_us: -1.0,
            ..CostParams::default()
        },
    ] {
        assert!(fit::check_plausible(&bad).is_err(), "{bad:?}");
    }
}

/// Synthetic measurements made with known constants (by the same candidate predictions the
/// fit uses) are fitted back to those constants.
#[test]
fn fit_recovers_known_constants() {
    let cluster = Cluster::preset("h100-sxm").unwrap();
    let truth = [0.70, 0.36, 0.70, 0.55]; // gemm, attention fwd, memory, tp overlap
    let knobs = fit::knobs();
    assert_eq!(knobs.len(), truth.len());
    let mut known = cluster.cost.clone();
    for (k, &v) in knobs.iter().zip(&truth) {
        (k.set)(&mut known, v);
    }
    // Few candidates keep the test cheap in a debug build; the truth is generated with the
    // same candidates, so it is exactly representable.
    let mut samples = fit::samples(&cluster, calibrate::MEGATRON_H100, 2);
    for s in &mut samples {
        s.measured = s.predict(&known);
    }
    let refs: Vec<&fit::Sample> = samples.iter().collect();
    let opts = fit::FitOptions {
        grid: 4,
        starts: 2,
        tol: 1e-4,
    };
    // Start from the preset's constants (not the truth).
    let f = fit::fit(&refs, &cluster.cost, &knobs, &opts);
    fit::check_plausible(&f.params).unwrap();
    assert!(f.objective < 2e-3, "objective {}", f.objective);
    for (k, &v) in knobs.iter().zip(&truth) {
        let got = (k.get)(&f.params);
        assert!(
            (got - v).abs() <= 0.02 * (k.hi - k.lo),
            "{}: fitted {got}, truth {v}",
            k.name
        );
    }
}

/// The fit on the real table stays inside the bounds, never above a datasheet rate, and is
/// at least as good (on its candidates) as the preset's constants.
#[test]
fn fitted_constants_are_plausible() {
    let cluster = Cluster::preset("h100-sxm").unwrap();
    let knobs = fit::knobs();
    let samples = fit::samples(&cluster, calibrate::MEGATRON_H100, 2);
    let refs: Vec<&fit::Sample> = samples.iter().collect();
    let opts = fit::FitOptions {
        grid: 3,
        starts: 1,
        tol: 1e-3,
    };
    let f = fit::fit(&refs, &cluster.cost, &knobs, &opts);
    fit::check_plausible(&f.params).unwrap();
    for k in &knobs {
        let v = (k.get)(&f.params);
        assert!(v >= k.lo && v <= k.hi, "{} = {v}", k.name);
    }
    // Effective rates never exceed the datasheet's.
    let mut c = cluster.fit(16).unwrap();
    c.cost = f.params.clone();
    let cost = CostModel::new(c.clone());
    for g in [
        megac_sim::cost::Group {
            size: 8,
            per_node: 8,
        },
        megac_sim::cost::Group {
            size: 16,
            per_node: 8,
        },
    ] {
        let (_, bw) = cost.link(g);
        assert!(bw <= c.intra_node.bytes_per_s, "{bw}");
    }
    let preset = fit::objective(
        &samples
            .iter()
            .map(|s| s.error(&cluster.cost))
            .collect::<Vec<_>>(),
    );
    assert!(
        f.objective <= preset + 1e-3,
        "fit {} preset {preset}",
        f.objective
    );
}
