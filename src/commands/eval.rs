//! `megac eval`: the loss and perplexity of weights on a data file.

use std::path::PathBuf;

use megac_ir::gate::CheckedPlan;
use megac_runtime::eval::{evaluate, EvalRun, Weights};

use crate::ModelArgs;

/// Options of `megac eval`.
#[derive(clap::Args)]
pub struct EvalArgs {
    /// A model.toml (compiled here, with any --set) or a plan directory written by
    /// `megac compile`.
    #[arg(value_name = "MODEL.toml|PLAN_DIR")]
    pub model: PathBuf,
    /// Override a model.toml key, e.g. `--set parallel.tp=2` (repeatable; model.toml only).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// The weights: Hugging Face safetensors (a file, a sharded checkpoint's
    /// model.safetensors.index.json, or the folder holding either), or a checkpoint written
    /// by `--save` (its folder, for the latest complete step, or a step folder), saved in
    /// any layout.
    #[arg(long, value_name = "FILE.safetensors|INDEX.json|DIR|CHECKPOINT")]
    pub init: PathBuf,
    /// The data: `synthetic`, a `.bin` file of little-endian u32 token ids, a `.txt` file
    /// (byte-level tokens, or paragraphs with --tokenizer), a `.jsonl` file (with
    /// --tokenizer), or a Megatron dataset PREFIX or blend (its validation split); see
    /// docs/data.md.
    #[arg(long, value_name = "synthetic|FILE|PREFIX|BLEND")]
    pub data: String,
    /// How the data is read (tokenizer, EOS, Megatron split).
    #[command(flatten)]
    pub reading: crate::DataReadArgs,
    /// Global batches to evaluate (samples 0 .. K·global_batch - 1) [default: every whole
    /// global batch of the file; needed with synthetic data].
    #[arg(long, value_name = "K")]
    pub iters: Option<u64>,
    /// `text` (one line) or `json` (`{"loss", "perplexity", "losses", "batches", "samples",
    /// "tokens", ...}`).
    #[arg(long, default_value = "text", value_name = "text|json")]
    pub format: String,
}

/// `megac eval`.
pub fn run(args: &EvalArgs) -> Result<(), String> {
    if !matches!(args.format.as_str(), "text" | "json") {
        return Err(format!(
            "error: --format {}: expected text or json",
            args.format
        ));
    }
    if args.iters == Some(0) {
        return Err("error: --iters 0: evaluate at least one batch".into());
    }
    let plan = if args.model.is_dir() {
        if !args.sets.is_empty() {
            return Err(format!(
                "error: --set applies to a model.toml; {} is a compiled plan directory",
                args.model.display()
            ));
        }
        super::inspect::read_plan(&args.model)?
    } else {
        let model = ModelArgs {
            model: args.model.clone(),
            sets: args.sets.clone(),
        };
        let plan = super::compile::build_plan(&model)?;
        CheckedPlan::check(plan)
            .map_err(|e| format!("error: the compiled plan does not pass the plan gate: {e}"))?
    };
    // A folder of Hugging Face weights (model.safetensors or a sharded checkpoint's index)
    // is safetensors; any other folder is a megac checkpoint.
    let weights = if args.init.is_dir() && !megac_runtime::hf::is_weights_dir(&args.init) {
        Weights::Checkpoint(args.init.clone())
    } else {
        Weights::Safetensors(args.init.clone())
    };
    let run = EvalRun {
        weights,
        data: args.data.clone(),
        iters: args.iters,
        data_options: args.reading.options(),
    };
    let report = evaluate(&plan, &run).map_err(|e| format!("error: {e}"))?;
    let batches = report.losses.len();
    if args.format == "json" {
        let mut json = serde_json::json!({
            "model": plan.model,
            "data": args.data,
            "weights": args.init.display().to_string(),
            "loss": report.loss,
            "perplexity": report.loss.exp(),
            "losses": report.losses,
            "batches": batches,
            "samples": report.samples,
            "tokens": report.tokens,
            "seconds": report.seconds,
        });
        if let Some(step) = report.checkpoint_step {
            json["checkpoint_step"] = serde_json::json!(step);
        }
        println!("{json}");
    } else {
        let from = match report.checkpoint_step {
            Some(step) => format!(" (checkpoint of step {step})"),
            None => String::new(),
        };
        println!(
            "eval {} on {}{from}: loss {:.4}, perplexity {:.3} ({batches} batch{}, {} tokens, {:.2} s)",
            plan.model,
            args.data,
            report.loss,
            report.loss.exp(),
            if batches == 1 { "" } else { "es" },
            report.tokens,
            report.seconds
        );
    }
    Ok(())
}
