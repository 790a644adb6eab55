//! `megac schedule`: the pipeline schedule of a layout, per rank, with its bubble.
//!
//! From a model.toml (its `[parallel]` pp, vpp, schedule and dpp_policy, and the
//! micro-batches per step) it shows the schedule the compiler will give each pipeline rank;
//! from a compiled plan directory, the action lists the plan's stage roles carry (for `dpp`
//! the reference order; FBD's forward roles are listed apart). Simulated with unit costs
//! (F = B = W = 1) or, with `--costs model` on a model.toml, with per-chunk costs from the
//! model's per-layer FLOPs ([`model_costs`]).

use std::path::Path;

use megac_ir::flops::{head_flops, layer_flops, LayerFlops};
use megac_ir::pipeline::{self, Action, Costs, ScheduleKind};
use megac_ir::spec::{ModelSpec, Recompute};

use crate::render::schedule as render;
use crate::ModelArgs;

/// Per-chunk durations of `F`, `B` and `W` for one microbatch.
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkCosts {
    /// Index = global chunk.
    pub per_chunk: Vec<Costs>,
}

impl ChunkCosts {
    /// The duration of a compute action (0 for transfers and unknown chunks).
    fn of(&self, a: &Action) -> f64 {
        self.per_chunk
            .get(a.chunk as usize)
            .map_or(0.0, |c| c.of(a))
    }
}

/// Per-chunk costs from a per-layer FLOPs estimate (Megatron's model FLOPs split by pass),
/// in units of the mean chunk forward, so that the time axis is comparable with unit costs.
///
/// Chunk `c` holds the contiguous layers `c·L/(pp·vpp) ..` (the even split the stage pass
/// will make). Per token and layer ([`megac_ir::flops::layer_flops`]): matmul FLOPs
/// `M = 2(h(q + 2kv) + qh) + 2·g·h·ffn` (`g` = 3 for gated llama MLPs, 2 for GPT; times `top_k`
/// for MoE layers) and causal core attention `C = 2·s·q`; `F = M + C`, input gradient `B = M + 2C`, weight gradient `W = M` (so
/// `B + W = 2F` for the matmuls, Megatron's 3-pass count). Full recomputation adds `F` to `B`,
/// selective adds `C`. The first chunk also holds the embedding (a gather: no FLOPs); the last
/// holds the head, `2·h·vocab` per token in each of F, B and W. Transfers are free.
pub fn model_costs(spec: &ModelSpec, pp: u32, vpp: u32) -> ChunkCosts {
    let m = &spec.model;
    let nc = u64::from(pp) * u64::from(vpp.max(1));
    let layer = |l: u64| {
        let LayerFlops { matmul: mm, core } = layer_flops(spec, l);
        let f = mm + core;
        let recompute = match spec.train.recompute {
            Recompute::None => 0.0,
            Recompute::Selective => core,
            Recompute::Full => f,
        };
        (f, mm + 2.0 * core + recompute, mm)
    };
    let head = head_flops(spec);
    let (per, extra) = (m.layers / nc.max(1), m.layers % nc.max(1));
    // The stage pass's split (stage_layers, balanced or even).
    let split = megac_ir::pipeline::stages::chunk_layers(spec);
    let mut start = 0;
    let mut raw: Vec<(f64, f64, f64)> = (0..nc)
        .map(|c| {
            let count = split
                .as_ref()
                .ok()
                .and_then(|s| s.get(c as usize).copied())
                .unwrap_or(per + u64::from(c < extra));
            let mut sum = (0.0, 0.0, 0.0);
            for l in start..start + count {
                let (f, b, w) = layer(l);
                sum = (sum.0 + f, sum.1 + b, sum.2 + w);
            }
            start += count;
            sum
        })
        .collect();
    if let Some(last) = raw.last_mut() {
        *last = (last.0 + head, last.1 + head, last.2 + head);
    }
    let mean_f = raw.iter().map(|c| c.0).sum::<f64>() / raw.len().max(1) as f64;
    let unit = if mean_f.is_finite() && mean_f > 0.0 {
        mean_f
    } else {
        1.0
    };
    ChunkCosts {
        per_chunk: raw
            .into_iter()
            .map(|(f, b, w)| Costs {
                f: f / unit,
                b: b / unit,
                w: w / unit,
                send: 0.0,
            })
            .collect(),
    }
}

/// A short description of per-chunk costs: `F/B/W per chunk: 1.02/1.51/0.96, ...`.
fn describe(costs: &ChunkCosts) -> String {
    // Runs of chunks with the same (printed) costs: `chunks 0-6 0.88/1.00/0.77`.
    let mut runs: Vec<(usize, usize, String)> = Vec::new();
    for (c, x) in costs.per_chunk.iter().enumerate() {
        let cell = format!("{:.2}/{:.2}/{:.2}", x.f, x.b, x.w);
        match runs.last_mut() {
            Some(run) if run.2 == cell => run.1 = c,
            _ => runs.push((c, c, cell)),
        }
    }
    let cells: Vec<String> = runs
        .iter()
        .map(|(a, b, cell)| {
            if a == b {
                format!("chunk {a} {cell}")
            } else {
                format!("chunks {a}-{b} {cell}")
            }
        })
        .collect();
    format!(
        "model costs (per-layer FLOPs, unit = mean chunk forward; F/B/W: {})",
        cells.join(", ")
    )
}

/// Options of `megac schedule` beyond the model.
pub struct Options<'a> {
    /// `text`, `json` or `svg`.
    pub format: &'a str,
    /// Show sends and receives (text).
    pub with_comm: bool,
    /// `unit` or `model`.
    pub costs: &'a str,
    /// Cluster for model costs of a plan directory.
    pub cluster: Option<&'a str>,
    /// Write here instead of stdout.
    pub output: Option<&'a Path>,
}

/// Print the schedule as text (one row per rank), JSON (DESIGN.md's contract) or SVG (a
/// Gantt chart), simulated with unit or model costs.
pub fn run(args: &ModelArgs, opts: &Options) -> Result<(), String> {
    let format = opts.format;
    if !matches!(format, "text" | "json" | "svg") {
        return Err(format!(
            "error: --format {format}: expected text, json or svg"
        ));
    }
    if let Some(path) = opts.output {
        super::output::check_file("-o", path)?;
    }
    if args.model.is_dir() {
        return run_plan(args, opts);
    }
    let spec = super::load_spec(args)?;
    let p = &spec.parallel;
    let kind = ScheduleKind::of(p);
    let (pp, vpp) = (p.pp as u32, p.vpp as u32);
    let m = spec.train.microbatches(p.dp) as u32;
    let lists = pipeline::schedule(kind, pp, vpp, m).map_err(|e| format!("error: {e}"))?;
    pipeline::validate(&lists, pp, vpp, m)
        .map_err(|e| format!("error: the schedule does not validate: {e}"))?;
    let (timeline, costs_line, costs_short) = match opts.costs {
        "unit" => (
            pipeline::simulate(&lists, Costs::unit()),
            "unit costs (F = B = W = 1)".to_string(),
            "unit costs".to_string(),
        ),
        "model" => {
            let costs = model_costs(&spec, pp, vpp);
            (
                pipeline::simulate_by(&lists, 0.0, |a| costs.of(a)),
                describe(&costs),
                "model costs (per-layer FLOPs)".to_string(),
            )
        }
        other => return Err(format!("error: --costs {other}: expected unit or model")),
    };
    let timeline = timeline.map_err(|e| format!("error: {e}"))?;
    let shown = Shown {
        lists: &lists,
        pp,
        vpp,
        m,
        schedule: p.schedule.as_str(),
        costs_line: &costs_line,
        costs_short: &costs_short,
        note: "",
    };
    emit(&shown, &timeline, opts)
}

/// What to render.
struct Shown<'a> {
    lists: &'a [Vec<Action>],
    pp: u32,
    vpp: u32,
    m: u32,
    schedule: &'a str,
    costs_line: &'a str,
    costs_short: &'a str,
    note: &'a str,
}

/// The schedule of a compiled plan directory: its stage roles' action lists.
fn run_plan(args: &ModelArgs, opts: &Options) -> Result<(), String> {
    if !args.sets.is_empty() {
        return Err("error: --set applies to a model.toml, not to a compiled plan".into());
    }
    if !matches!(opts.costs, "unit" | "model") {
        return Err(format!(
            "error: --costs {}: expected unit or model",
            opts.costs
        ));
    }
    let plan = super::inspect::read_plan(&args.model)?;
    let pp = plan.mesh.size(megac_ir::Axis::Pp) as u32;
    let stages: Vec<&megac_ir::plan::Pipeline> = plan
        .roles
        .iter()
        .take(pp as usize)
        .filter_map(|r| r.pipeline.as_ref())
        .collect();
    if pp < 2 || stages.len() != pp as usize {
        return Err(format!(
            "error: {} is not a pipelined plan (pp = {pp}); compile with parallel.pp >= 2",
            args.model.display()
        ));
    }
    let nc = stages[0].chunks_total;
    let vpp = (nc / pp).max(1);
    let m = plan.batch.microbatches as u32;
    let compute: Vec<Vec<Action>> = stages
        .iter()
        .map(|p| {
            p.actions
                .iter()
                .map(|a| {
                    use megac_ir::plan::PipeKind;
                    let kind = match a.kind {
                        PipeKind::F => pipeline::ActionKind::F,
                        PipeKind::B => pipeline::ActionKind::B,
                        PipeKind::W => pipeline::ActionKind::W,
                        PipeKind::BW => pipeline::ActionKind::BW,
                    };
                    Action::compute(kind, a.chunk, a.microbatch)
                })
                .collect()
        })
        .collect();
    let (compute, model) = if opts.costs == "model" {
        let (lists, timeline, cluster) = simulated(&plan, &args.model, pp, opts.cluster)?;
        (lists, Some((timeline, cluster)))
    } else {
        (compute, None)
    };
    let lists = pipeline::with_transfers(compute, pp, vpp);
    pipeline::validate(&lists, pp, vpp, m)
        .map_err(|e| format!("error: the plan's schedule does not validate: {e}"))?;
    let (timeline, costs_line, costs_short) = match model {
        None => (
            pipeline::simulate(&lists, Costs::unit()).map_err(|e| format!("error: {e}"))?,
            "unit costs (F = B = W = 1)".to_string(),
            "unit costs".to_string(),
        ),
        Some((times, cluster)) => (
            timeline_of(&lists, &times),
            format!("model costs (megac-sim on {cluster}, seconds)"),
            format!("model costs ({cluster}, s)"),
        ),
    };
    let fbd = plan.roles.len() > pp as usize;
    let note = if fbd {
        "FBD: each stage also has a forward role on its own ranks (forward only, one micro-batch at a time); the lanes show the backward roles\n"
    } else if stages[0].dpp.is_some() {
        "dpp runs dynamically: the lanes show the reference order; `megac run --report` records the order each run took\n"
    } else {
        ""
    };
    let shown = Shown {
        lists: &lists,
        pp,
        vpp,
        m,
        schedule: &stages[0].schedule,
        costs_line: &costs_line,
        costs_short: &costs_short,
        note,
    };
    emit(&shown, &timeline, opts)
}

/// Per stage, the compute actions in the order megac-sim ran them (for dpp, its dynamic
/// choice) with their (start, end) in seconds, and the cluster's name.
type SimTimes = Vec<Vec<(f64, f64)>>;

fn simulated(
    plan: &megac_ir::plan::Plan,
    dir: &std::path::Path,
    pp: u32,
    cluster: Option<&str>,
) -> Result<(Vec<Vec<Action>>, SimTimes, String), String> {
    let world = plan.mesh.world_size() as u64;
    let cluster = super::simulate::cluster_for_plan(cluster, plan, dir)?
        .fit(world)
        .map_err(|e| e.render())?;
    let name = format!("{} ({})", cluster.name, cluster.source);
    let cost = megac_sim::CostModel::new(cluster);
    let sim = megac_sim::simulate(plan, &cost, true).map_err(|e| format!("error: {e}"))?;
    let mut per_stage: Vec<Vec<(f64, f64, Action)>> = vec![Vec::new(); pp as usize];
    for ev in sim.events.iter().filter(|e| e.stream == 99) {
        let Some(stage) = (ev.role < pp as usize).then_some(ev.role) else {
            continue;
        };
        let Some(action) = parse_token(&ev.name) else {
            continue;
        };
        per_stage[stage].push((ev.start, ev.start + ev.dur, action));
    }
    let mut lists = Vec::new();
    let mut times = Vec::new();
    for mut evs in per_stage {
        evs.sort_by(|a, b| a.0.total_cmp(&b.0));
        lists.push(evs.iter().map(|e| e.2).collect());
        times.push(evs.iter().map(|e| (e.0, e.1)).collect());
    }
    Ok((lists, times, name))
}

/// `F3.0` -> the forward of chunk 3, micro-batch 0.
fn parse_token(t: &str) -> Option<Action> {
    use pipeline::ActionKind;
    let (kind, rest) = if let Some(r) = t.strip_prefix("BW") {
        (ActionKind::BW, r)
    } else if let Some(r) = t.strip_prefix('F') {
        (ActionKind::F, r)
    } else if let Some(r) = t.strip_prefix('B') {
        (ActionKind::B, r)
    } else if let Some(r) = t.strip_prefix('W') {
        (ActionKind::W, r)
    } else {
        return None;
    };
    let (c, j) = rest.split_once('.')?;
    Some(Action::compute(kind, c.parse().ok()?, j.parse().ok()?))
}

/// A timeline from simulated compute times: transfers take no time, placed at their
/// neighbours' ends.
fn timeline_of(lists: &[Vec<Action>], times: &SimTimes) -> pipeline::Timeline {
    let mut ranks = Vec::new();
    let makespan = times.iter().flatten().map(|t| t.1).fold(0.0f64, f64::max);
    for (list, t) in lists.iter().zip(times) {
        let mut spans = Vec::with_capacity(list.len());
        let (mut k, mut now) = (0usize, 0.0f64);
        let (mut busy, mut inflight, mut peak) = (0.0, 0u32, 0u32);
        for a in list {
            if a.is_compute() {
                let (s, e) = t.get(k).copied().unwrap_or((now, now));
                k += 1;
                spans.push((s, e));
                busy += e - s;
                now = e;
                match a.kind {
                    pipeline::ActionKind::F => {
                        inflight += 1;
                        peak = peak.max(inflight);
                    }
                    pipeline::ActionKind::B | pipeline::ActionKind::BW => {
                        inflight = inflight.saturating_sub(1)
                    }
                    _ => {}
                }
            } else {
                spans.push((now, now));
            }
        }
        let idle = (makespan - busy).max(0.0);
        ranks.push(pipeline::RankTimeline {
            spans,
            busy,
            idle,
            bubble_fraction: if makespan > 0.0 { idle / makespan } else { 0.0 },
            peak_inflight: peak,
        });
    }
    let n = ranks.len().max(1) as f64;
    let bubble = if makespan > 0.0 {
        ranks.iter().map(|r| r.idle).sum::<f64>() / (n * makespan)
    } else {
        0.0
    };
    pipeline::Timeline {
        ranks,
        makespan,
        bubble_fraction: bubble,
    }
}

/// Render and write.
fn emit(shown: &Shown, timeline: &pipeline::Timeline, opts: &Options) -> Result<(), String> {
    let Shown {
        lists,
        pp,
        vpp,
        m,
        schedule: name,
        costs_line,
        costs_short,
        note,
    } = *shown;
    let format = opts.format;
    let out = match format {
        "json" => format!("{}\n", render::render_json(lists, vpp, timeline)),
        "svg" => {
            let vpp_part = if vpp > 1 {
                format!(" vpp={vpp}")
            } else {
                String::new()
            };
            let title =
                format!("{name} schedule: pp={pp}{vpp_part}, {m} micro-batches, {costs_short}");
            render::render_svg(lists, vpp, timeline, &title)
        }
        _ => {
            let mut s = format!(
                "{name} schedule: pp={pp} vpp={vpp}, {m} micro-batches per step, {costs_line}\n{note}"
            );
            s.push_str(&render::render_text(lists, vpp, opts.with_comm));
            s.push_str(&format!(
                "bubble fraction {:.4} (idle over total time, all ranks)\n",
                timeline.bubble_fraction
            ));
            s
        }
    };
    match opts.output {
        None => print!("{out}"),
        Some(path) => super::output::write_file(path, &out)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use megac_ir::pipeline::ActionKind;

    #[test]
    fn unused_kinds_cost_nothing() {
        let c = ChunkCosts {
            per_chunk: vec![Costs::unit()],
        };
        let send = Action {
            kind: ActionKind::Send {
                payload: pipeline::Payload::Activation,
                peer: 1,
            },
            chunk: 0,
            microbatch: 0,
        };
        assert_eq!(c.of(&send), 0.0);
        assert_eq!(c.of(&Action::compute(ActionKind::BW, 0, 0)), 2.0);
        assert_eq!(c.of(&Action::compute(ActionKind::F, 5, 0)), 0.0);
    }
}
