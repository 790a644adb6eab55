//! `megac generate`: run a model forward from a prompt and print the new tokens.

use std::path::PathBuf;

use megac_ir::gate::CheckedPlan;
use megac_runtime::data::tokenizer::TextTokenizer;
use megac_runtime::infer::{with_ranks, Sampling};
use megac_runtime::kv::with_ranks_kv;

use crate::ModelArgs;

/// Options of `megac generate`.
#[derive(clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The weights: a Hugging Face safetensors file (save_pretrained layout), a sharded
    /// checkpoint's model.safetensors.index.json, or the folder holding either.
    #[arg(long, value_name = "FILE.safetensors|INDEX.json|DIR")]
    pub init: PathBuf,
    /// The prompt as text, tokenized byte by byte as `.txt` data is (docs/data.md), or with
    /// --tokenizer.
    #[arg(
        long,
        value_name = "TEXT",
        conflicts_with = "tokens",
        required_unless_present = "tokens"
    )]
    pub prompt: Option<String>,
    /// The prompt as token ids, comma-separated (`1,2,3`).
    #[arg(long, value_name = "IDS")]
    pub tokens: Option<String>,
    /// A Hugging Face tokenizer.json: encodes --prompt (with its special tokens) and decodes
    /// the new tokens (special tokens shown); its vocabulary must fit model.vocab.
    #[arg(long, value_name = "tokenizer.json")]
    pub tokenizer: Option<PathBuf>,
    /// How many tokens to generate (prompt + new tokens must fit model.seq_len).
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 (the default) is greedy decoding.
    #[arg(long, default_value_t = 0.0, value_name = "T")]
    pub temperature: f64,
    /// Sample among the K most likely tokens only (0: all).
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub top_k: usize,
    /// Sample among the most likely tokens whose probabilities reach P (1: all).
    #[arg(long, default_value_t = 1.0, value_name = "P")]
    pub top_p: f64,
    /// Seed of the sampler (the same seed gives the same tokens).
    #[arg(long, default_value_t = 0, value_name = "S")]
    pub seed: u64,
    /// `text` (the new text, byte-level decoded or with --tokenizer) or `json`
    /// (`{"prompt_tokens", "tokens", "text", "tokens_per_s"}`).
    #[arg(long, default_value = "text", value_name = "text|json")]
    pub format: String,
    /// Recompute the whole prefix for every new token instead of decoding with a KV cache
    /// (the default: the prompt once, then one token per step; docs/generate.md).
    #[arg(long)]
    pub no_kv_cache: bool,
}

/// Parse `--tokens 1,2,3`.
pub fn parse_tokens(text: &str) -> Result<Vec<u32>, String> {
    text.split(',')
        .enumerate()
        .map(|(i, t)| {
            t.trim().parse::<u32>().map_err(|_| {
                format!(
                    "error: --tokens {text}: item {} is `{}`, not a token id (expected comma-separated integers, e.g. 1,2,3)",
                    i + 1,
                    t.trim()
                )
            })
        })
        .collect()
}

/// The prompt's token ids, from `--tokens` or the bytes of `--prompt`.
pub fn prompt_tokens(prompt: Option<&str>, tokens: Option<&str>) -> Result<Vec<u32>, String> {
    match (prompt, tokens) {
        (_, Some(t)) => parse_tokens(t),
        (Some(p), None) => Ok(p.bytes().map(u32::from).collect()),
        (None, None) => Err("error: give the prompt with --prompt TEXT or --tokens IDS".into()),
    }
}

fn render_tokenizer_error(e: megac_runtime::data::tokenizer::TokenizerError) -> String {
    format!("error: {}", megac_runtime::error::RuntimeError::from(e))
}

/// Load `--tokenizer` (None without one).
pub fn open_tokenizer(path: Option<&std::path::Path>) -> Result<Option<TextTokenizer>, String> {
    path.map(|p| TextTokenizer::open(p, None).map_err(render_tokenizer_error))
        .transpose()
}

/// Check `--tokenizer` against the model's vocab: every id it produces must be an id of the
/// model.
pub fn check_tokenizer(tok: Option<&TextTokenizer>, plan: &CheckedPlan) -> Result<(), String> {
    match tok {
        Some(t) => t
            .check_vocab(plan.batch.vocab as u32)
            .map_err(render_tokenizer_error),
        None => Ok(()),
    }
}

/// The prompt's token ids as [`prompt_tokens`] reads them, `--prompt` encoded with `tok`
/// when there is one.
pub fn prompt_tokens_with(
    prompt: Option<&str>,
    tokens: Option<&str>,
    tok: Option<&TextTokenizer>,
) -> Result<Vec<u32>, String> {
    match (prompt, tokens, tok) {
        (Some(p), None, Some(t)) => t.encode(p).map_err(render_tokenizer_error),
        _ => prompt_tokens(prompt, tokens),
    }
}

/// Decode generated ids with `tok`, or byte by byte ([`decode`]) without one.
pub fn decode_with(tokens: &[u32], tok: Option<&TextTokenizer>) -> Result<String, String> {
    match tok {
        Some(t) => t.decode(tokens).map_err(render_tokenizer_error),
        None => Ok(decode(tokens)),
    }
}

/// Byte-level decoding: each id below 256 is one byte (invalid UTF-8 shows as U+FFFD).
pub fn decode(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens
        .iter()
        .map(|&t| u8::try_from(t).unwrap_or(b'?'))
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The `--set`s of a one-sample plan, before the user's: micro-batch 1, and one sample per
/// data-parallel replica (`train.global_batch` = dp; every replica runs the same tokens).
/// dp is read from `model` with its `--set`s (1 if they do not load: the compile then
/// reports why).
fn one_sample_sets(model: &ModelArgs) -> Vec<String> {
    let mb = "train.micro_batch=1".to_string();
    let dp = super::load_spec(&ModelArgs {
        model: model.model.clone(),
        sets: std::iter::once(mb.clone())
            .chain(model.sets.iter().cloned())
            .collect(),
    })
    .map_or(1, |s| s.parallel.dp);
    vec![mb, format!("train.global_batch={dp}")]
}

/// Compile `model` as a one-sample inference plan (micro-batch 1, one sample per
/// data-parallel replica: the forward only, no gradient or optimizer memory).
pub fn compile_forward(model: &ModelArgs) -> Result<CheckedPlan, String> {
    compile_with(model, &[])
}

/// [`compile_forward`] with `megac scope`'s probes and perturbations compiled in.
pub fn compile_forward_with(
    model: &ModelArgs,
    instrument: &megac_passes::Instrument,
) -> Result<CheckedPlan, String> {
    let mut sets = one_sample_sets(model);
    sets.extend(model.sets.iter().cloned());
    let args = ModelArgs {
        model: model.model.clone(),
        sets,
    };
    let plan =
        super::compile::build_plan_with(&args, megac_ir::plan::PlanKind::Inference, instrument)?;
    CheckedPlan::check(plan)
        .map_err(|e| format!("error: the compiled plan does not pass the plan gate: {e}"))
}

/// As [`compile_forward`], with `after` set after the user's `--set`s.
fn compile_with(model: &ModelArgs, after: &[String]) -> Result<CheckedPlan, String> {
    let mut sets = one_sample_sets(model);
    sets.extend(model.sets.iter().cloned());
    sets.extend(after.iter().cloned());
    let args = ModelArgs {
        model: model.model.clone(),
        sets,
    };
    let plan = super::compile::build_plan_of(&args, megac_ir::plan::PlanKind::Inference)?;
    CheckedPlan::check(plan)
        .map_err(|e| format!("error: the compiled plan does not pass the plan gate: {e}"))
}

/// The block plan of KV-cache decoding: the model of `window` (its one-sample forward)
/// compiled with `model.seq_len` = one token per tensor-parallel rank (sequence parallelism
/// splits the block's tokens over tp; the first is the real one).
pub fn compile_block(model: &ModelArgs, window: &CheckedPlan) -> Result<CheckedPlan, String> {
    compile_with(model, &megac_runtime::kv::block_sets(window)).map_err(|e| {
        format!("{e}\n(while compiling the KV cache's one-token plan; --no-kv-cache avoids it)")
    })
}

/// The KV-cache plan of `model` (`megac_codegen::kv::kv_plan` of its one-sample window
/// plan and its block plan), through the plan gate.
pub fn compile_kv(model: &ModelArgs, window: &CheckedPlan) -> Result<CheckedPlan, String> {
    let block = compile_block(model, window)?;
    let plan = megac_codegen::kv::kv_plan(window, &block).map_err(|e| format!("error: {e}"))?;
    CheckedPlan::check(plan)
        .map_err(|e| format!("error: the KV-cache plan does not pass the plan gate: {e}"))
}

/// `megac generate`.
pub fn run(args: &GenerateArgs) -> Result<(), String> {
    if !matches!(args.format.as_str(), "text" | "json") {
        return Err(format!(
            "error: --format {}: expected text or json",
            args.format
        ));
    }
    let bad = |flag: &str, v: f64, want: &str| Err(format!("error: {flag} {v}: {want}"));
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        return bad("--temperature", args.temperature, "expected a number >= 0");
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        return bad("--top-p", args.top_p, "expected a number in (0, 1]");
    }
    let tok = open_tokenizer(args.tokenizer.as_deref())?;
    let prompt = prompt_tokens_with(args.prompt.as_deref(), args.tokens.as_deref(), tok.as_ref())?;
    let plan = compile_forward(&args.model)?;
    check_tokenizer(tok.as_ref(), &plan)?;
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    // Tensor-parallel plans: every rank runs the forward; the logits are gathered, so each
    // chooses the same tokens.
    let out = if args.no_kv_cache {
        with_ranks(&plan, &args.init, |inf| {
            inf.generate(&prompt, args.max_new_tokens, &sampling)
        })
    } else {
        // The layout's own error first (the block plan may not compile where it is refused).
        megac_runtime::infer::Inference::supports_kv(&plan).map_err(|e| format!("error: {e}"))?;
        let kv = compile_kv(&args.model, &plan)?;
        with_ranks_kv(&kv, &args.init, |dec| {
            dec.generate(&prompt, args.max_new_tokens, &sampling)
        })
    }
    .map_err(|e| format!("error: {e}"))?;
    let text = decode_with(&out.tokens, tok.as_ref())?;
    let tokens_per_s = if out.seconds > 0.0 {
        out.tokens.len() as f64 / out.seconds
    } else {
        0.0
    };
    if args.format == "json" {
        let json = serde_json::json!({
            "prompt_tokens": prompt,
            "tokens": out.tokens,
            "text": text,
            "tokens_per_s": (tokens_per_s * 10.0).round() / 10.0,
        });
        println!("{json}");
    } else {
        println!("{text}");
    }
    Ok(())
}
