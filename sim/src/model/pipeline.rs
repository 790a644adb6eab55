//! The pipeline: each stage's phases with the pipeline send/receive, and the bubble of the
//! schedule, `m·t_max + (Σ t_i − t_max)/v` for 1F1B and GPipe (v = 1) and interleaved (v
//! chunks), and for ZB-H1 `Σ (F_i + B_i − W_i)` over the other stages (the schedule
//! formulas of megatron-lm.md §2.7 and parallel-compilers.md §3, which the model reproduces
//! exactly under unit costs).

use megac_ir::spec::Schedule;

use super::layer::{Geo, Phases};
use super::stage::Stage;
use super::ParallelLayout;
use crate::cost::{Coll, CostMode, Group};

/// The pipeline's time over one step.
pub(super) struct Pipeline {
    /// Phases of each computed stage for one micro-batch, with exposed send/receive (unit
    /// costs: one per chunk for each of F, B and W).
    pub(super) phases: Vec<Phases>,
    /// The slowest stage (the critical one) and its time per micro-batch.
    pub(super) imax: usize,
    pub(super) t_max: f64,
    /// The bubble, including exposed pipeline send/receive.
    pub(super) bubble: f64,
    /// Whether the schedule interleaves virtual chunks.
    pub(super) interleaved: bool,
}

/// The phases, critical stage and bubble of `stages` under `layout`'s schedule.
pub(super) fn pipeline(g: &Geo, layout: &ParallelLayout, stages: &[Stage]) -> Pipeline {
    let cost = g.cost;
    let gpn = cost.cluster.gpus_per_node;
    let (tp, pp, cp, dp) = (layout.tp, layout.pp.max(1), layout.cp, layout.dp);
    let v = layout.vpp.max(1);
    let params = cost.params();
    let unit = cost.mode == CostMode::Unit;
    // Pipeline send/receive of the boundary activation (sequence-sharded with sp).
    let pp_group = Group::strided(pp, tp * cp * dp, gpn);
    let t_p2p = if pp > 1 && !unit {
        cost.collective(Coll::SendRecv, g.tn * g.h * g.a, pp_group)
    } else {
        0.0
    };

    // Phases per stage (unit costs replace them: one per chunk for F, B and W).
    let mut phases: Vec<Phases> = stages
        .iter()
        .map(|st| {
            if unit {
                Phases {
                    f: v as f64,
                    b: v as f64,
                    w: v as f64,
                    comm: 0.0,
                }
            } else {
                st.ph
            }
        })
        .collect();
    let mut bubble_extra = 0.0;
    if pp > 1 && !unit {
        if params.pp_comm_overlap {
            bubble_extra += 2.0 * (pp - 1) as f64 * t_p2p;
        } else {
            for ph in &mut phases {
                ph.f += v as f64 * t_p2p;
                ph.b += v as f64 * t_p2p;
                ph.comm += 2.0 * v as f64 * t_p2p;
            }
            bubble_extra += 2.0 * (pp - 1) as f64 * t_p2p;
        }
    }
    let totals: Vec<f64> = phases.iter().map(Phases::total).collect();
    let (imax, t_max) = totals
        .iter()
        .copied()
        .enumerate()
        .fold((0, 0.0), |acc, (i, x)| if x > acc.1 { (i, x) } else { acc });
    let mult: Vec<f64> = stages.iter().map(|st| st.mult).collect();
    let sum: f64 = totals.iter().zip(&mult).map(|(x, k)| x * k).sum();
    let interleaved = v > 1 && matches!(layout.schedule, Schedule::Interleaved | Schedule::Dpp);
    let bubble = if pp == 1 {
        0.0
    } else {
        match layout.schedule {
            Schedule::ZbH1 => {
                let gsum: f64 = phases
                    .iter()
                    .zip(&mult)
                    .map(|(p, k)| (p.f + p.b - p.w) * k)
                    .sum();
                let gmax = phases[imax].f + phases[imax].b - phases[imax].w;
                (gsum - gmax).max(0.0)
            }
            _ if interleaved => (sum - t_max) / v as f64,
            _ => sum - t_max,
        }
    } + bubble_extra;
    Pipeline {
        phases,
        imax,
        t_max,
        bubble,
        interleaved,
    }
}
