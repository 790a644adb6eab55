//! `megac simulate`: predict a compiled plan's step time, throughput, MFU and memory on a
//! cluster, and optionally write its timeline.

use std::path::PathBuf;

use megac_sim::cluster::{Cluster, GIB};
use megac_sim::{simulate, CostModel};

/// Options of `megac simulate`.
#[derive(clap::Args)]
pub struct SimulateArgs {
    /// Plan directory written by `megac compile`.
    #[arg(value_name = "PLAN_DIR")]
    pub plan: PathBuf,
    /// A cluster.toml, or a preset: a100-80g, h100-sxm, h200 (default: the `[cluster]` the
    /// plan recorded from its model.toml, else h100-sxm with as many 8-GPU nodes as the
    /// plan needs).
    #[arg(long, value_name = "CLUSTER.toml|PRESET")]
    pub cluster: Option<String>,
    /// Output format.
    #[arg(long, default_value = "text", value_name = "text|json")]
    pub format: String,
    /// Write a Chrome-trace timeline (opens in Perfetto) of the simulated step (missing
    /// folders are created).
    #[arg(long, value_name = "F.json")]
    pub trace: Option<PathBuf>,
    /// Costs: `model` (roofline and alpha-beta) or `unit` (every F, B and W of a pipeline
    /// chunk and micro-batch takes 1, communication and the optimizer nothing: the schedule
    /// formulas).
    #[arg(long, default_value = "model", value_name = "model|unit")]
    pub costs: String,
    /// Slow each pipeline action by a random factor 1 + S·|z| (z standard normal, seeded per
    /// stage, as `--inject jitter:S:SEED` on a run): how much a schedule loses to noisy
    /// devices, and whether MegaDPP's dynamic order absorbs it.
    #[arg(long, value_name = "S[:SEED]", allow_hyphen_values = true)]
    pub jitter: Option<String>,
}

/// `--jitter S[:SEED]`, parsed by the rule of `--inject jitter:S:SEED`.
fn parse_jitter(arg: &str) -> Result<megac_sim::Jitter, String> {
    use megac_runtime::scan::inject::Inject;
    match Inject::parse(&format!("jitter:{arg}")) {
        Ok(Inject::Jitter { std, seed }) => Ok(megac_sim::Jitter { std, seed }),
        Ok(_) => Err(format!(
            "error: --jitter {arg}: expected S[:SEED], e.g. 0.2:7"
        )),
        Err(e) => Err(format!(
            "error: --jitter {arg}: {}\nhelp: expected S[:SEED], e.g. 0.2:7",
            e.message
        )),
    }
}

/// The cluster a command costs on: `--cluster` (`arg`), else the `[cluster]` a model.toml
/// names or a plan records (`named`: the section and where it came from, e.g.
/// `PLAN_DIR/plan.json [cluster]`), else the h100-sxm preset. `Cluster::source` says which.
pub fn cluster_or(
    arg: Option<&str>,
    named: Option<(&megac_ir::spec::ClusterSection, String)>,
) -> Result<Cluster, String> {
    if let Some(a) = arg {
        return Cluster::load(a).map_err(|e| e.render());
    }
    match named {
        Some((c, from)) => {
            let mut cl = Cluster::preset(&c.device).map_err(|e| {
                format!(
                    "error: {from}: cluster.device = \"{}\" is not a cluster preset\nhelp: {}; or pass --cluster CLUSTER.toml\n",
                    c.device,
                    e.help.unwrap_or_default()
                )
            })?;
            cl.nodes = Some(c.nodes);
            cl.gpus_per_node = c.gpus_per_node;
            cl.source = format!("{from} [cluster]");
            Ok(cl)
        }
        None => Cluster::preset("h100-sxm").map_err(|e| e.render()),
    }
}

/// The cluster for `plan` (read from `dir`): `--cluster`, else the plan's `[cluster]`, else
/// h100-sxm.
pub fn cluster_for_plan(
    arg: Option<&str>,
    plan: &megac_ir::plan::Plan,
    dir: &std::path::Path,
) -> Result<Cluster, String> {
    let from = dir.join("plan.json").display().to_string();
    cluster_or(arg, plan.cluster.as_ref().map(|c| (c, from)))
}

/// A warning for a role whose per-rank memory (`bytes`) exceeds one device of `cluster`,
/// None when it fits.
pub fn memory_warning(role: &str, bytes: f64, cluster: &Cluster) -> Option<String> {
    let cap = cluster.device.memory_bytes;
    (bytes > cap).then(|| {
        let size = |b: f64| {
            if b >= GIB {
                format!("{:.2} GiB", b / GIB)
            } else {
                format!("{:.2} MiB", b / (1u64 << 20) as f64)
            }
        };
        format!(
            "warning: role {role} needs {} per rank, more than the {} of one {} ({}): the plan \
             does not fit its cluster's memory (`megac plan` finds layouts that do)",
            size(bytes),
            size(cap),
            cluster.device.name,
            cluster.source
        )
    })
}

/// Run `megac simulate`.
pub fn run(args: &SimulateArgs) -> Result<(), String> {
    if args.format != "text" && args.format != "json" {
        return Err(format!(
            "error: --format {}: expected `text` or `json`",
            args.format
        ));
    }
    if args.costs != "model" && args.costs != "unit" {
        return Err(format!(
            "error: --costs {}: expected `model` or `unit`",
            args.costs
        ));
    }
    if let Some(path) = &args.trace {
        super::output::check_file("--trace", path)?;
    }
    let jitter = args.jitter.as_deref().map(parse_jitter).transpose()?;
    let plan = super::inspect::read_plan(&args.plan)?;
    let world = plan.mesh.world_size() as u64;
    let cluster = cluster_for_plan(args.cluster.as_deref(), &plan, &args.plan)?
        .fit(world)
        .map_err(|e| e.render())?;
    let mut cost = if args.costs == "unit" {
        CostModel::unit(cluster)
    } else {
        CostModel::new(cluster)
    };
    cost.jitter = jitter;
    let megac_sim::simulate::Simulation {
        report,
        events,
        streams,
    } = simulate(&plan, &cost, args.trace.is_some())
        .map_err(|e| format!("error: {}: {e}", args.plan.join("plan.json").display()))?;
    for r in &report.roles {
        if let Some(w) = memory_warning(&r.name, r.memory_bytes as f64, &cost.cluster) {
            eprintln!("{w}");
        }
    }
    if let Some(path) = &args.trace {
        super::output::write_file(
            path,
            &megac_sim::simulate::trace_json(&plan, &events, &streams),
        )?;
    }
    if args.format == "json" {
        let mut v = report.to_json();
        v["cluster"] = serde_json::json!({
            "name": cost.cluster.name,
            "source": cost.cluster.source,
            "nodes": cost.cluster.nodes,
            "gpus_per_node": cost.cluster.gpus_per_node,
            "device": cost.cluster.device.name,
            "memory_bytes": cost.cluster.device.memory_bytes,
        });
        if let Some(j) = &cost.jitter {
            v["jitter"] = serde_json::json!({"std": j.std, "seed": j.seed});
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    let b = &plan.batch;
    println!(
        "plan         {}: {} rank(s), {} role(s), {} micro-batch(es) of {} × {} tokens per step",
        plan.model,
        report.world,
        plan.roles.len(),
        b.microbatches,
        b.micro_batch,
        b.seq_len
    );
    println!("cluster      {}", cost.cluster.describe());
    if args.costs == "unit" {
        println!("costs        unit: F = B = W = 1 per chunk and micro-batch, communication and optimizer free (times in units)");
    }
    if let Some(j) = &cost.jitter {
        println!(
            "jitter       each pipeline action's compute × (1 + {}·|z|), seed {}",
            j.std, j.seed
        );
    }
    if let (Some(exec), Some(pipe)) = (
        &report.pipeline_execution,
        plan.roles.iter().find_map(|r| r.pipeline.as_ref()),
    ) {
        println!(
            "pipeline     {} schedule over {} stage(s), {} chunk(s), executed {}",
            pipe.schedule,
            plan.mesh.size(megac_ir::Axis::Pp),
            pipe.chunks_total,
            if exec == "dynamic" {
                "dynamically (highest-priority ready task, as the runtime)"
            } else {
                "in the plan's action order"
            }
        );
    }
    if let Some(phase) = &report.pipeline_phase {
        println!(
            "order bound  {:.4} s: no order of the pipeline's actions, at the durations they took, ends sooner (this one {:.4} s, {:.3}x it)",
            phase.bound_seconds,
            phase.seconds,
            phase.seconds / phase.bound_seconds.max(f64::MIN_POSITIVE)
        );
    }
    println!(
        "step         {:.4} s   ({:.0} tokens/s, MFU {:.1}%, bubble {:.1}%)",
        report.step_seconds,
        report.tokens_per_s,
        100.0 * report.mfu,
        100.0 * report.bubble_fraction
    );
    for r in &report.roles {
        println!(
            "role {:<7} {} rank(s): micro-batch {:.2} ms, optimizer {:.2} ms, compute {:.4} s, exposed communication {:.4} s, {} kernels",
            r.name,
            r.ranks,
            1e3 * r.microbatch_seconds,
            1e3 * r.optimizer_seconds,
            r.compute_seconds,
            r.exposed_comm_seconds,
            r.kernels
        );
        if let Some(stage) = r.stage {
            println!(
                "  stage {stage}     step {:.4} s, busy {:.4} s, bubble {:.1}%, peak in flight {} micro-batch(es)",
                r.step_seconds,
                r.compute_seconds,
                100.0 * r.bubble_fraction,
                r.peak_inflight
            );
        }
        for (axes, t) in &r.comm_seconds {
            println!("  comm {axes:<8} {t:.4} s per step (hidden or not)");
        }
        let cap = cost.cluster.device.memory_bytes;
        let fit = if (r.memory_bytes as f64) <= cap {
            "fits"
        } else {
            "does NOT fit"
        };
        println!(
            "  memory      {:.2} GiB per rank (static plan; live activations at least {:.2} GiB) of {:.0} GiB: {fit}",
            r.memory_bytes as f64 / GIB,
            r.activation_live_bytes as f64 / GIB,
            cap / GIB
        );
    }
    if let Some(path) = &args.trace {
        println!("trace        wrote {}", path.display());
    }
    Ok(())
}
