//! The fit of the cost model's free constants to measured step times (issue 13 §3).
//!
//! **What is fitted.** A few [`Knob`]s of [`CostParams`] ([`knobs`]: the GEMM, attention
//! and memory-bound kernel efficiencies and the tensor-parallel overlap; [`all_knobs`] adds
//! the link efficiency and the kernel overhead), each searched inside physical bounds: an
//! efficiency in (0, 1] (so no effective FLOP rate or bandwidth above the datasheet's), an
//! overlap fraction in [0, 1], an overhead ≥ 0. The other constants stay as the cluster has
//! them (the GEMM shape terms, the link efficiency, the kernel overhead, the attention
//! backward/forward ratio of [`ATTENTION_BWD_RATIO`]).
//!
//! **The objective** is `mean |e| + ½ max |e|` over the rows, `e = predicted / measured − 1`
//! of the step time.
//!
//! **The search** is deterministic: a full grid of [`FitOptions::grid`] levels per knob over
//! its bounds, then from each of the [`FitOptions::starts`] best grid points a Nelder–Mead
//! simplex search (points clamped to the bounds; the first simplex one grid spacing wide),
//! restarted from its best vertex with a simplex half as wide until it stops improving. The
//! objective is not smooth (a max, and the fastest layout of a row can change) and its
//! valleys run diagonally (a faster GEMM against a slower attention): a search that moves
//! one constant at a time, or a fixed pattern of moves, stalls there (tried: it ended worse
//! than the cluster's own constants).
//!
//! **Cheap evaluations.** `calibrate` predicts a row as the fastest of every layout that
//! fits (micro-batch, vpp/schedule, recomputation). The fit instead collects, once, each
//! row's [`Sample::candidates`]: the `k` fastest fitting layouts under the starting
//! constants ([`samples`]); during the fit a row's prediction is the fastest of its
//! candidates under the trial constants. Whether a layout fits does not depend on the
//! fitted constants (memory reads none of them), so with `k` at least the number of fitting
//! layouts this is exactly `calibrate`'s prediction; with fewer, a layout outside the top
//! `k` under the starting constants could be missed. The reported errors (in-sample and
//! leave-one-out) are therefore always recomputed with the full layout search
//! ([`super::calibrate_rows`]) at the fitted constants.
//!
//! **Leave-one-out** ([`leave_one_out`]): for each row, fit on the others and predict the
//! held-out row with the full layout search.

use megac_ir::spec::ModelSpec;

use super::{calibrate_rows, layouts, row_cluster, TableRow};
use crate::cluster::Cluster;
use crate::cost::{CostModel, CostParams};
use crate::model::{estimate, ParallelLayout};

/// `attention_bwd_efficiency / attention_fwd_efficiency`, fixed: the step time sees the
/// two kernels only through their sum, so the table cannot separate them.
pub const ATTENTION_BWD_RATIO: f64 = 0.8;

/// One fitted constant: its name, its physical bounds and how to read and write it.
#[derive(Clone, Copy, Debug)]
pub struct Knob {
    /// The `[cost]` key (or keys) it sets.
    pub name: &'static str,
    /// Lower bound of the search (inclusive).
    pub lo: f64,
    /// Upper bound of the search (inclusive).
    pub hi: f64,
    /// Read it from the constants.
    pub get: fn(&CostParams) -> f64,
    /// Write it into the constants.
    pub set: fn(&mut CostParams, f64),
}

/// The constants the calibration fits, with their bounds: the GEMM, attention and
/// memory-bound efficiencies (searched in [0.2, 1] and [0.1, 1]: a lower bound above 0 keeps
/// the model finite) and the tensor-parallel overlap in [0, 1].
///
/// Not fitted: `link_efficiency` and `kernel_overhead_us`. On this table only the 70B row
/// (PP 2, the one whose data-parallel reduction is exposed) constrains them, so leaving that
/// row out lets them go anywhere (link 0.52, overhead 28 µs) and the held-out 70B row then
/// misses by 23% or 10% (docs/cluster-toml.md lists every knob set tried).
pub fn knobs() -> Vec<Knob> {
    knobs_named(&[
        "gemm_efficiency",
        "attention_fwd_efficiency",
        "memory_efficiency",
        "tp_comm_overlap",
    ])
}

/// Every constant the fit can move, with its bounds (the kernel overhead in [0, 40] µs).
pub fn all_knobs() -> Vec<Knob> {
    vec![
        Knob {
            name: "gemm_efficiency",
            lo: 0.2,
            hi: 1.0,
            get: |p| p.gemm_efficiency,
            set: |p, x| p.gemm_efficiency = x,
        },
        Knob {
            name: "attention_fwd_efficiency (bwd = 0.8 x fwd)",
            lo: 0.1,
            hi: 1.0,
            get: |p| p.attention_fwd_efficiency,
            set: |p, x| {
                p.attention_fwd_efficiency = x;
                p.attention_bwd_efficiency = ATTENTION_BWD_RATIO * x;
            },
        },
        Knob {
            name: "memory_efficiency",
            lo: 0.2,
            hi: 1.0,
            get: |p| p.memory_efficiency,
            set: |p, x| p.memory_efficiency = x,
        },
        Knob {
            name: "link_efficiency",
            lo: 0.2,
            hi: 1.0,
            get: |p| p.link_efficiency,
            set: |p, x| p.link_efficiency = x,
        },
        Knob {
            name: "tp_comm_overlap",
            lo: 0.0,
            hi: 1.0,
            get: |p| p.tp_comm_overlap,
            set: |p, x| p.tp_comm_overlap = x,
        },
        Knob {
            name: "kernel_overhead_us",
            lo: 0.0,
            hi: 40.0,
            get: |p| p.kernel_overhead_us,
            set: |p, x| p.kernel_overhead_us = x,
        },
    ]
}

/// The knobs of [`all_knobs`] whose names start with one of `names`.
pub fn knobs_named(names: &[&str]) -> Vec<Knob> {
    all_knobs()
        .into_iter()
        .filter(|k| names.iter().any(|n| k.name.starts_with(n)))
        .collect()
}

/// Whether `p` is physically plausible: every efficiency in (0, 1] (no kernel above the
/// device's peak FLOP/s or HBM bandwidth, no collective above the link's datasheet
/// bandwidth), the overlap in [0, 1], the overhead and the shape terms non-negative.
pub fn check_plausible(p: &CostParams) -> Result<(), String> {
    let eff = [
        ("gemm_efficiency", p.gemm_efficiency),
        ("attention_fwd_efficiency", p.attention_fwd_efficiency),
        ("attention_bwd_efficiency", p.attention_bwd_efficiency),
        ("memory_efficiency", p.memory_efficiency),
        ("link_efficiency", p.link_efficiency),
    ];
    for (name, x) in eff {
        if !(x > 0.0 && x <= 1.0) {
            return Err(format!("{name} = {x} is not in (0, 1]"));
        }
    }
    if !(0.0..=1.0).contains(&p.tp_comm_overlap) {
        return Err(format!(
            "tp_comm_overlap = {} is not in [0, 1]",
            p.tp_comm_overlap
        ));
    }
    for (name, x) in [
        ("kernel_overhead_us", p.kernel_overhead_us),
        ("gemm_half_k", p.gemm_half_k),
        ("gemm_fill_elements", p.gemm_fill_elements),
    ] {
        if x.is_nan() || x < 0.0 {
            return Err(format!("{name} = {x} is negative"));
        }
    }
    Ok(())
}

/// One measured row with the layouts the fit considers for it.
#[derive(Clone, Debug)]
pub struct Sample {
    /// The row (model, TP, PP, DP, batch).
    pub row: TableRow,
    /// The measured step time, seconds.
    pub measured: f64,
    /// The row's model.
    pub spec: ModelSpec,
    /// The cluster sized for the row (its constants are replaced by the trial ones).
    pub cluster: Cluster,
    /// The layouts whose fastest is the prediction (see the module documentation).
    pub candidates: Vec<ParallelLayout>,
}

impl Sample {
    /// The predicted step time under `params`: the fastest candidate that fits.
    pub fn predict(&self, params: &CostParams) -> f64 {
        let mut cluster = self.cluster.clone();
        cluster.cost = params.clone();
        let cost = CostModel::new(cluster);
        self.candidates
            .iter()
            .map(|l| estimate(&self.spec, l, &cost))
            .filter(|e| e.fits)
            .map(|e| e.step_seconds)
            .fold(f64::INFINITY, f64::min)
    }

    /// `predicted / measured − 1` under `params`.
    pub fn error(&self, params: &CostParams) -> f64 {
        self.predict(params) / self.measured - 1.0
    }
}

/// The samples of `rows` on `cluster`, measured as the table says (`measured_seconds`), each
/// with its `k` fastest fitting layouts under `cluster`'s constants.
pub fn samples(cluster: &Cluster, rows: &[TableRow], k: usize) -> Vec<Sample> {
    rows.iter()
        .map(|r| Sample {
            row: r.clone(),
            measured: r.measured_seconds(),
            spec: r.spec(),
            cluster: row_cluster(cluster, r),
            candidates: layouts(cluster, r)
                .into_iter()
                .take(k.max(1))
                .map(|(l, _)| l)
                .collect(),
        })
        .collect()
}

/// `mean |e| + ½ max |e|`.
pub fn objective(errors: &[f64]) -> f64 {
    if errors.is_empty() {
        return 0.0;
    }
    let mean = errors.iter().map(|e| e.abs()).sum::<f64>() / errors.len() as f64;
    let max = errors.iter().map(|e| e.abs()).fold(0.0, f64::max);
    mean + 0.5 * max
}

/// Search settings.
#[derive(Clone, Debug)]
pub struct FitOptions {
    /// Grid levels per knob (evenly spaced over its bounds, ends included).
    pub grid: usize,
    /// Grid points the simplex search starts from (the best ones).
    pub starts: usize,
    /// Stop when the simplex is narrower than this fraction of every knob's range.
    pub tol: f64,
}

impl Default for FitOptions {
    /// 5 levels per knob (625 grid points for four knobs), 3 starts, down to 0.1% of each
    /// range.
    fn default() -> FitOptions {
        FitOptions {
            grid: 5,
            starts: 3,
            tol: 1e-3,
        }
    }
}

/// The result of a fit.
#[derive(Clone, Debug)]
pub struct Fit {
    /// The fitted constants (the start's, with the knobs replaced).
    pub params: CostParams,
    /// The objective at them, over the candidate predictions.
    pub objective: f64,
    /// Objective evaluations spent.
    pub evaluations: usize,
}

fn score(samples: &[&Sample], p: &CostParams) -> f64 {
    let errs: Vec<f64> = samples.iter().map(|s| s.error(p)).collect();
    objective(&errs)
}

fn with(start: &CostParams, knobs: &[Knob], x: &[f64]) -> CostParams {
    let mut p = start.clone();
    for (k, &v) in knobs.iter().zip(x) {
        (k.set)(&mut p, v);
    }
    p
}

/// Fit `knobs` of `start` to `samples` (see the module documentation).
pub fn fit(samples: &[&Sample], start: &CostParams, knobs: &[Knob], opts: &FitOptions) -> Fit {
    let mut evaluations = 0usize;
    let mut eval = |x: &[f64]| {
        evaluations += 1;
        score(samples, &with(start, knobs, x))
    };
    let n = knobs.len();
    let levels = opts.grid.max(2);
    let level = |k: &Knob, i: usize| k.lo + (k.hi - k.lo) * i as f64 / (levels - 1) as f64;
    // The grid only: the start's own values of the knobs are not a starting point, so the
    // fit does not inherit them (leave-one-out must not see the held-out row through them).
    let mut points: Vec<(f64, Vec<f64>)> = Vec::new();
    let total = levels.pow(n as u32);
    for idx in 0..total {
        let mut rest = idx;
        let x: Vec<f64> = knobs
            .iter()
            .map(|k| {
                let i = rest % levels;
                rest /= levels;
                level(k, i)
            })
            .collect();
        points.push((eval(&x), x));
    }
    // Stable sort: ties keep the enumeration order (deterministic).
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut best: Option<(f64, Vec<f64>)> = None;
    for (f0, x0) in points.into_iter().take(opts.starts.max(1)) {
        // Nelder–Mead, restarted from its best vertex with a simplex half as wide, until
        // the simplex is narrower than `tol` of the ranges or (once below 1%) a restart
        // gains less than `tol`/100 in the objective.
        let (mut f, mut x) = (f0, x0);
        let mut size = 1.0 / (levels - 1) as f64;
        while size >= opts.tol {
            let (fy, y) = nelder_mead(&mut eval, knobs, &x, f, size, opts.tol);
            let gain = f - fy;
            if fy < f {
                (f, x) = (fy, y);
            }
            size *= 0.5;
            if size < 1e-2 && gain <= opts.tol * 1e-2 {
                break;
            }
        }
        if best.as_ref().is_none_or(|(bf, _)| f < *bf) {
            best = Some((f, x));
        }
    }
    let (objective, x) = best.expect("at least one start");
    Fit {
        params: with(start, knobs, &x),
        objective,
        evaluations,
    }
}

/// One held-out row.
#[derive(Clone, Debug)]
pub struct HeldOut {
    /// The row's name.
    pub name: &'static str,
    /// The constants fitted on the other rows.
    pub params: CostParams,
    /// `predicted / measured − 1` of the held-out row with those constants (full layout
    /// search).
    pub error: f64,
}

/// Leave-one-out over `samples`: for each, fit on the others (from `start`) and predict it
/// with the full layout search on `cluster` with the fitted constants. `progress` is called
/// after each row.
pub fn leave_one_out(
    cluster: &Cluster,
    samples: &[Sample],
    start: &CostParams,
    knobs: &[Knob],
    opts: &FitOptions,
    mut progress: impl FnMut(&HeldOut),
) -> Vec<HeldOut> {
    (0..samples.len())
        .map(|i| {
            let train: Vec<&Sample> = samples
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .map(|(_, s)| s)
                .collect();
            let f = fit(&train, start, knobs, opts);
            let mut c = cluster.clone();
            c.cost = f.params.clone();
            let held = &samples[i];
            let pred = calibrate_rows(&c, std::slice::from_ref(&held.row))[0]
                .estimate
                .step_seconds;
            let h = HeldOut {
                name: held.row.name,
                params: f.params,
                error: pred / held.measured - 1.0,
            };
            progress(&h);
            h
        })
        .collect()
}

/// One Nelder–Mead run from `x0` (objective `f0`), with an initial simplex of `size` times
/// each knob's range along each axis (stepping inward at an upper bound); points are clamped
/// to the bounds. Stops when the simplex's objective spread is below `tol²` and its extent
/// below `tol` of every range, or after 400·n evaluations.
fn nelder_mead(
    eval: &mut impl FnMut(&[f64]) -> f64,
    knobs: &[Knob],
    x0: &[f64],
    f0: f64,
    size: f64,
    tol: f64,
) -> (f64, Vec<f64>) {
    let n = knobs.len();
    let clamp = |y: &mut Vec<f64>| {
        for (v, k) in y.iter_mut().zip(knobs) {
            *v = v.clamp(k.lo, k.hi);
        }
    };
    let mut simplex: Vec<(f64, Vec<f64>)> = vec![(f0, x0.to_vec())];
    for i in 0..n {
        let mut y = x0.to_vec();
        let d = size * (knobs[i].hi - knobs[i].lo);
        y[i] = if y[i] + d <= knobs[i].hi {
            y[i] + d
        } else {
            y[i] - d
        };
        clamp(&mut y);
        simplex.push((eval(&y), y));
    }
    let mut evals = 0usize;
    while evals < 400 * n {
        simplex.sort_by(|a, b| a.0.total_cmp(&b.0));
        let spread = simplex[n].0 - simplex[0].0;
        let extent = (0..n)
            .map(|i| {
                let (lo, hi) = simplex.iter().fold((f64::MAX, f64::MIN), |(l, h), v| {
                    (l.min(v.1[i]), h.max(v.1[i]))
                });
                (hi - lo) / (knobs[i].hi - knobs[i].lo)
            })
            .fold(0.0, f64::max);
        if spread <= tol * tol && extent <= tol {
            break;
        }
        let centroid: Vec<f64> = (0..n)
            .map(|i| simplex[..n].iter().map(|v| v.1[i]).sum::<f64>() / n as f64)
            .collect();
        let along = |t: f64| -> Vec<f64> {
            let mut y: Vec<f64> = (0..n)
                .map(|i| centroid[i] + t * (simplex[n].1[i] - centroid[i]))
                .collect();
            clamp(&mut y);
            y
        };
        let xr = along(-1.0);
        let fr = eval(&xr);
        evals += 1;
        if fr < simplex[0].0 {
            let xe = along(-2.0);
            let fe = eval(&xe);
            evals += 1;
            simplex[n] = if fe < fr { (fe, xe) } else { (fr, xr) };
        } else if fr < simplex[n - 1].0 {
            simplex[n] = (fr, xr);
        } else {
            let xc = if fr < simplex[n].0 {
                along(-0.5)
            } else {
                along(0.5)
            };
            let fc = eval(&xc);
            evals += 1;
            if fc < fr.min(simplex[n].0) {
                simplex[n] = (fc, xc);
            } else {
                // Shrink towards the best vertex.
                let best = simplex[0].1.clone();
                for v in simplex.iter_mut().skip(1) {
                    let mut y: Vec<f64> =
                        (0..n).map(|i| best[i] + 0.5 * (v.1[i] - best[i])).collect();
                    clamp(&mut y);
                    *v = (eval(&y), y);
                    evals += 1;
                }
            }
        }
    }
    simplex.sort_by(|a, b| a.0.total_cmp(&b.0));
    simplex.swap_remove(0)
}
