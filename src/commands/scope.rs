//! `megac scope`: run a model forward and write the activations at named probe points.

use std::path::PathBuf;

use megac_runtime::infer::{compare, with_ranks, Perturbation};

use crate::ModelArgs;

/// Options of `megac scope`.
#[derive(clap::Args)]
pub struct ScopeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The weights (a Hugging Face safetensors file, save_pretrained layout).
    #[arg(long, value_name = "FILE.safetensors")]
    pub init: PathBuf,
    /// The input as text, tokenized byte by byte as `.txt` data is (docs/data.md), or with
    /// --tokenizer.
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
    /// A Hugging Face tokenizer.json that encodes --prompt (with its special tokens); its
    /// vocabulary must fit model.vocab.
    #[arg(long, value_name = "tokenizer.json")]
    pub tokenizer: Option<PathBuf>,
    /// A probe point or pattern (`*` matches any run of characters): `embed`,
    /// `layers.{i}.out`, `layers.{i}.attn.probs`, `layers.{i}.attn.out`, `layers.{i}.mlp.out`,
    /// `layers.{i}.moe.router`, `layers.{i}.lens` (the logit lens: `.tokens` and `.probs`, top
    /// 5), `logits` (repeatable; docs/scope.md).
    #[arg(long = "probe", value_name = "PATTERN", required = true)]
    pub probes: Vec<String>,
    /// The safetensors file to write (one F32 tensor per probe point, named as the point;
    /// with --perturb, the perturbed run's).
    #[arg(short = 'o', long = "output", value_name = "OUT.safetensors")]
    pub output: PathBuf,
    /// Perturb a point or a weight: `POINT:KIND`, POINT a probe point (not attn.probs) or
    /// `weights.NAME` (a parameter's Hugging Face name), KIND `noise(SIGMA)` (Gaussian,
    /// SIGMA times the tensor's RMS), `scale(X)` or `bitflip(sign|exponent|mantissa, RATE)`
    /// (repeatable; one-device layouts; docs/scope.md).
    #[arg(long = "perturb", value_name = "POINT:KIND")]
    pub perturb: Vec<String>,
    /// Seed of the perturbations (the same seed gives the same bits).
    #[arg(long, default_value_t = 0, value_name = "S")]
    pub seed: u64,
    /// Write clean vs perturbed next-token loss, KL, top-1 agreement and per-position
    /// figures as JSON (needs --perturb).
    #[arg(long, value_name = "R.json", requires = "perturb")]
    pub report: Option<PathBuf>,
}

/// `megac scope`.
pub fn run(args: &ScopeArgs) -> Result<(), String> {
    let perturbations: Vec<Perturbation> = args
        .perturb
        .iter()
        .map(|p| Perturbation::parse(p).map_err(|e| format!("error: {e}")))
        .collect::<Result<_, _>>()?;
    super::output::check_file("-o", &args.output)?;
    if let Some(r) = &args.report {
        super::output::check_file("--report", r)?;
    }
    let tok = super::generate::open_tokenizer(args.tokenizer.as_deref())?;
    let tokens = super::generate::prompt_tokens_with(
        args.prompt.as_deref(),
        args.tokens.as_deref(),
        tok.as_ref(),
    )?;
    let plan = super::generate::compile_forward(&args.model)?;
    super::generate::check_tokenizer(tok.as_ref(), &plan)?;
    let (probes, report) = with_ranks(&plan, &args.init, |inf| {
        if perturbations.is_empty() {
            return Ok((inf.probe(&tokens, &args.probes)?, None));
        }
        inf.set_perturbations(&[], args.seed)?;
        let clean = inf.logits(&tokens)?;
        inf.set_perturbations(&perturbations, args.seed)?;
        let probes = inf.probe(&tokens, &args.probes)?;
        let perturbed = inf.logits(&tokens)?;
        Ok((
            probes,
            Some(compare(&tokens, &clean, &perturbed, inf.vocab())),
        ))
    })
    .map_err(|e| format!("error: {e}"))?;
    if let (Some(path), Some(r)) = (&args.report, &report) {
        let per: Vec<serde_json::Value> = r
            .per_position
            .iter()
            .enumerate()
            .map(|(t, (kl, a, b))| {
                serde_json::json!({"position": t, "kl": kl, "clean_top1": a, "perturbed_top1": b})
            })
            .collect();
        let json = serde_json::json!({
            "clean_loss": r.clean_loss,
            "perturbed_loss": r.perturbed_loss,
            "kl": r.kl,
            "top1_agreement": r.top1_agreement,
            "per_position": per,
        });
        super::output::write_file(path, &format!("{json}\n"))?;
    }
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
