//! `megac plan`: search every valid layout of a model on N GPUs with the analytic cost model
//! and print the fastest that fit in memory.

use std::path::PathBuf;

use megac_sim::cluster::{Cluster, GIB};
use megac_sim::search::emit_model_toml;
use megac_sim::CostModel;

use crate::ModelArgs;

/// Options of `megac plan`.
#[derive(clap::Args)]
pub struct PlanArgs {
    /// The model and its `--set` overrides.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Number of GPUs the layout must use (tp·pp·dp·cp).
    #[arg(long, value_name = "N")]
    pub gpus: u64,
    /// A cluster.toml, or a preset: a100-80g, h100-sxm, h200 (default: model.toml's
    /// `[cluster]`, else h100-sxm).
    #[arg(long, value_name = "CLUSTER.toml|PRESET")]
    pub cluster: Option<String>,
    /// How many layouts to print (at least 1).
    #[arg(long, default_value_t = 10, value_name = "K")]
    pub top: usize,
    /// Write the best layout as a complete model.toml (missing folders are created).
    #[arg(long, value_name = "F.toml")]
    pub emit: Option<PathBuf>,
    /// `text` (a table) or `json`: `{"searched", "seconds", "layouts": [{"set": [--set
    /// arguments], "step_seconds", "peak_memory_bytes", "mfu", "tokens_per_s"}, ...]}`,
    /// best first.
    #[arg(long, default_value = "text", value_name = "text|json")]
    pub format: String,
}

/// The cluster: `--cluster`, else model.toml's `[cluster]` (a preset with its node count),
/// else h100-sxm.
fn cluster_for(args: &PlanArgs, spec: &megac_ir::ModelSpec) -> Result<Cluster, String> {
    let from = args.model.model.display().to_string();
    super::simulate::cluster_or(
        args.cluster.as_deref(),
        spec.cluster.as_ref().map(|c| (c, from)),
    )
}

/// Run `megac plan`.
pub fn run(args: &PlanArgs) -> Result<(), String> {
    if args.gpus == 0 {
        return Err("error: --gpus 0: the layout needs at least one GPU".into());
    }
    if args.format != "text" && args.format != "json" {
        return Err(format!(
            "error: --format {}: expected `text` or `json`",
            args.format
        ));
    }
    if args.top == 0 {
        return Err("error: --top 0: show at least one layout (--top 1 shows the fastest)".into());
    }
    if let Some(path) = &args.emit {
        super::output::check_file("--emit", path)?;
    }
    let spec = super::load_spec(&args.model)?;
    let cluster = cluster_for(args, &spec)?
        .fit(args.gpus)
        .map_err(|e| e.render())?;
    let cost = CostModel::new(cluster);
    let result = megac_sim::search(&spec, args.gpus, &cost, args.top).map_err(|e| e.render())?;
    if args.format == "json" {
        let layouts: Vec<serde_json::Value> = result
            .best
            .iter()
            .map(|c| {
                let e = &c.estimate;
                serde_json::json!({
                    "set": c.layout.set_args(),
                    "step_seconds": e.step_seconds,
                    "peak_memory_bytes": e.peak_memory_bytes.round() as u64,
                    "mfu": e.mfu,
                    "tokens_per_s": e.tokens_per_s,
                })
            })
            .collect();
        let v = serde_json::json!({
            "searched": result.searched,
            "fitting": result.fitting,
            "seconds": result.seconds,
            "cluster": cost.cluster.name,
            "layouts": layouts,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
        if let Some(path) = &args.emit {
            emit_best(args, &spec, &result, &cost)?;
            eprintln!("wrote {}", path.display());
        }
        return Ok(());
    }
    let tokens = (spec.train.global_batch * spec.model.seq_len) as f64;
    println!(
        "model        {}: {} layers, hidden {}, global batch {} × {} tokens ({:.3e} tokens per step)",
        spec.name,
        spec.model.layers,
        spec.model.hidden,
        spec.train.global_batch,
        spec.model.seq_len,
        tokens
    );
    println!("cluster      {}", cost.cluster.describe());
    println!(
        "{:>4}  {:>10}  {:>12}  {:>6}  {:>7}  {:>9}  layout",
        "rank", "step (s)", "tokens/s", "MFU", "bubble", "GiB/GPU"
    );
    for (i, c) in result.best.iter().enumerate() {
        let e = &c.estimate;
        println!(
            "{:>4}  {:>10.4}  {:>12.0}  {:>5.1}%  {:>6.1}%  {:>9.1}  {}",
            i + 1,
            e.step_seconds,
            e.tokens_per_s,
            100.0 * e.mfu,
            100.0 * e.bubble_fraction,
            e.peak_memory_bytes / GIB,
            c.layout.label()
        );
    }
    if let Some(path) = &args.emit {
        emit_best(args, &spec, &result, &cost)?;
        println!("wrote {}", path.display());
    }
    println!(
        "{} of {} layouts fit in memory",
        result.fitting, result.searched
    );
    println!(
        "searched {} layouts in {:.3} s",
        result.searched, result.seconds
    );
    Ok(())
}

/// Write the best layout of `result` as a complete model.toml to `--emit`.
fn emit_best(
    args: &PlanArgs,
    spec: &megac_ir::ModelSpec,
    result: &megac_sim::search::SearchResult,
    cost: &CostModel,
) -> Result<(), String> {
    if let Some(path) = &args.emit {
        let best = &result.best[0];
        let header = vec![
            format!(
                "Written by `megac plan {} --gpus {}`: the fastest of {} layouts that fit ({} searched).",
                args.model.model.display(),
                args.gpus,
                result.fitting,
                result.searched
            ),
            format!(
                "Predicted on {}: {:.4} s per step, {:.0} tokens/s, MFU {:.1}%, {:.1} GiB per GPU.",
                cost.cluster.name,
                best.estimate.step_seconds,
                best.estimate.tokens_per_s,
                100.0 * best.estimate.mfu,
                best.estimate.peak_memory_bytes / GIB
            ),
        ];
        let text = emit_model_toml(spec, &best.layout, &cost.cluster, &header);
        super::output::write_file(path, &text)?;
    }
    Ok(())
}
