//! `megac scope`: run a model forward and write the activations at named probe points.

use std::path::PathBuf;

use megac_runtime::infer::{compare, with_ranks_scope, Perturbation};

use crate::ModelArgs;

/// `megac scope`: a probe run, or `megac scope view` (no options may come before `view`).
#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct ScopeCli {
    #[command(subcommand)]
    pub action: Option<ScopeAction>,
    #[command(flatten)]
    pub args: Option<ScopeArgs>,
}

/// The subcommands of `megac scope`.
#[derive(clap::Subcommand)]
pub enum ScopeAction {
    /// Write one self-contained HTML page (no network access: everything inline) showing a
    /// probe file: the tokens, attention heads per layer, the logit lens, and with --report
    /// the clean vs perturbed next-token distributions.
    #[command(
        after_help = "Example:\n  megac scope tests/golden/llama/model.toml --init tests/golden/llama/init.safetensors --prompt 'Hello, world' --probe '*' -o probes.safetensors\n  megac scope view probes.safetensors -o view.html"
    )]
    View(super::scope_view::ViewArgs),
    /// Serve the files of one folder (viewer pages, probe files) on 127.0.0.1 only: GET and
    /// HEAD of files inside DIR, nothing executed, paths leaving DIR refused.
    #[command(
        after_help = "Example:\n  megac scope view probes.safetensors -o views/view.html\n  megac scope serve views --port 8000   # then open http://127.0.0.1:8000/view.html"
    )]
    Serve(super::scope_serve::ServeArgs),
}

/// `megac scope` or `megac scope view`.
pub fn run_cli(cli: &ScopeCli) -> Result<(), String> {
    match (&cli.action, &cli.args) {
        (Some(ScopeAction::View(view)), _) => super::scope_view::run(view),
        (Some(ScopeAction::Serve(serve)), _) => super::scope_serve::run(serve),
        (None, Some(args)) => run(args),
        (None, None) => Err("error: megac scope needs MODEL.toml and its options, or `view` (see megac scope --help)".into()),
    }
}

/// Options of `megac scope`.
#[derive(clap::Args)]
pub struct ScopeArgs {
    /// Path to the model description (see docs/model-toml.md).
    // ModelArgs's fields, not flattened: clap finds an optional flattened group
    // (ScopeCli::args) only when its own fields are plain arguments.
    #[arg(value_name = "MODEL.toml")]
    pub model: PathBuf,
    /// Override a model.toml key, e.g. `--set parallel.tp=2` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// The weights: a Hugging Face safetensors file (save_pretrained layout), a sharded
    /// checkpoint's model.safetensors.index.json, or the folder holding either.
    #[arg(long, value_name = "FILE.safetensors|INDEX.json|DIR")]
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
    /// Perturb a point or a weight: `POINT:KIND`, POINT a probe point (not attn.probs),
    /// `layers.{i}.attn` (the attention's per-head output, before the output projection) or
    /// `weights.NAME` (a parameter's Hugging Face name), KIND `noise(SIGMA)` (Gaussian,
    /// SIGMA times the tensor's RMS), `scale(X)`, `bitflip(sign|exponent|mantissa, RATE)`,
    /// `zero-head(HEAD)` (on layers.{i}.attn: attention knockout) or `patch(FILE)` (the
    /// point's tensor from a probe file of another input of the same length) (repeatable;
    /// docs/scope.md).
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
    // One sample per data-parallel replica (`compile_forward_with`): each runs the tokens.
    let model = ModelArgs {
        model: args.model.clone(),
        sets: args.sets.clone(),
    };
    // The probes and perturbations are compiled into the plan (the `perturb` and `probe`
    // passes); the clean run of the report is the plan without them.
    let instrument = megac_passes::Instrument {
        probes: args.probes.clone(),
        perturbations: perturbations
            .iter()
            .map(|p| megac_runtime::perturb::TrainPerturbation {
                perturbation: p.clone(),
                step: None,
            })
            .collect(),
        seed: args.seed,
        tokens: tokens.len() as u64,
        train: false,
    };
    let plan = super::generate::compile_forward_with(&model, &instrument)?;
    super::generate::check_tokenizer(tok.as_ref(), &plan)?;
    let clean = if perturbations.is_empty() {
        None
    } else {
        let clean_plan =
            super::generate::compile_forward_with(&model, &megac_passes::Instrument::default())?;
        Some(
            with_ranks_scope(&clean_plan, &args.init, |inf| inf.logits(&tokens))
                .map_err(|e| format!("error: {e}"))?,
        )
    };
    let (probes, report) = with_ranks_scope(&plan, &args.init, |inf| {
        if perturbations.is_empty() {
            return Ok((inf.probe(&tokens, &args.probes)?, None));
        }
        inf.set_patches(&perturbations)?;
        let probes = inf.probe(&tokens, &args.probes)?;
        let perturbed = inf.logits(&tokens)?;
        let clean = clean.as_deref().unwrap_or_default();
        let report = compare(&tokens, clean, &perturbed, inf.vocab());
        let tops = top_k_pairs(clean, &perturbed, inf.vocab(), REPORT_TOP_K);
        Ok((probes, Some((report, tops))))
    })
    .map_err(|e| format!("error: {e}"))?;
    if let (Some(path), Some((r, tops))) = (&args.report, &report) {
        let per: Vec<serde_json::Value> = r
            .per_position
            .iter()
            .zip(tops)
            .enumerate()
            .map(|(t, ((kl, a, b), (clean_top, perturbed_top)))| {
                serde_json::json!({"position": t, "kl": kl, "clean_top1": a, "perturbed_top1": b,
                    "clean_top": clean_top, "perturbed_top": perturbed_top})
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
    let mut metadata = vec![
        (
            "megac.tokens".to_string(),
            tokens
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(","),
        ),
        ("megac.model".to_string(), args.model.display().to_string()),
    ];
    if let Some(prompt) = &args.prompt {
        metadata.push(("megac.prompt".to_string(), prompt.clone()));
    }
    if !args.perturb.is_empty() {
        metadata.push(("megac.perturb".to_string(), args.perturb.join("\n")));
        metadata.push(("megac.seed".to_string(), args.seed.to_string()));
    }
    megac_runtime::hf::save_params_with_metadata(&args.output, &tensors, &metadata)
        .map_err(|e| format!("error: {e}"))?;
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

/// How many tokens the report lists per position, most likely first (`clean_top`,
/// `perturbed_top`).
pub const REPORT_TOP_K: usize = 10;

/// Per position, the `k` most likely next tokens of the clean and of the perturbed logits
/// (`n` rows of `vocab`; softmax in float64; the lowest id first on a tie), each entry with
/// both runs' probabilities of that token: `{"token", "clean", "perturbed"}`.
fn top_k_pairs(
    clean: &[f32],
    perturbed: &[f32],
    vocab: usize,
    k: usize,
) -> Vec<(Vec<serde_json::Value>, Vec<serde_json::Value>)> {
    let rows = clean.len() / vocab.max(1);
    (0..rows)
        .map(|t| {
            let range = t * vocab..(t + 1) * vocab;
            let (pc, pp) = (
                super::scope_view::softmax(&clean[range.clone()]),
                super::scope_view::softmax(&perturbed[range]),
            );
            let entries = |by: &[f64]| -> Vec<serde_json::Value> {
                super::scope_view::top_k(by, k)
                    .into_iter()
                    .map(|i| serde_json::json!({"token": i, "clean": pc[i], "perturbed": pp[i]}))
                    .collect()
            };
            (entries(&pc), entries(&pp))
        })
        .collect()
}
