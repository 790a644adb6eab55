//! `megac scope`: run a model forward and write the activations at named probe points.

use std::path::PathBuf;

use megac_runtime::infer::with_ranks;

use crate::ModelArgs;

/// Options of `megac scope`.
#[derive(clap::Args)]
pub struct ScopeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The weights (a Hugging Face safetensors file, save_pretrained layout).
    #[arg(long, value_name = "FILE.safetensors")]
    pub init: PathBuf,
    /// The input as text, tokenized byte by byte as `.txt` data is (docs/data.md).
    #[arg(
        long,
        value_name = "TEXT",
        conflicts_with = "tokens",
        required_unless_present = "tokens"
    )]
    pub prompt: Option<String>,
    /// The input as token ids, comma-separated (`1,2,3`).
    #[arg(long, value_name = "IDS")]
    pub tokens: Option<String>,
    /// A probe point or pattern (`*` matches any run of characters): `embed`,
    /// `layers.{i}.out`, `layers.{i}.attn.probs`, `layers.{i}.attn.out`, `layers.{i}.mlp.out`,
    /// `logits` (repeatable; docs/scope.md).
    #[arg(long = "probe", value_name = "PATTERN", required = true)]
    pub probes: Vec<String>,
    /// The safetensors file to write (one F32 tensor per probe point, named as the point).
    #[arg(short = 'o', long = "output", value_name = "OUT.safetensors")]
    pub output: PathBuf,
}

/// `megac scope`.
pub fn run(args: &ScopeArgs) -> Result<(), String> {
    super::output::check_file("-o", &args.output)?;
    let tokens = super::generate::prompt_tokens(args.prompt.as_deref(), args.tokens.as_deref())?;
    let plan = super::generate::compile_forward(&args.model)?;
    let probes = with_ranks(&plan, &args.init, |inf| inf.probe(&tokens, &args.probes))
        .map_err(|e| format!("error: {e}"))?;
    let tensors: Vec<(String, Vec<usize>, &[f32])> = probes
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone(), &p.values[..]))
        .collect();
    megac_runtime::hf::save_params(&args.output, &tensors).map_err(|e| format!("error: {e}"))?;
    println!(
        "wrote {}: {} probe(s) of {} token(s): {}",
        args.output.display(),
        probes.len(),
        tokens.len(),
        probes
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}
