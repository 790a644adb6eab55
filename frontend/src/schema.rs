//! The model.toml schema: typed reading of each section, with defaults and unknown-key
//! rejection. Every key is documented in docs/model-toml.md.

use std::collections::HashMap;

use megac_ir::spec::{
    Arch, ClusterSection, CosineSchedule, CpComm, DppPolicy, LossScaler, ModelSection, ModelSpec,
    MoeSpec, ParallelSection, Precision, Recompute, RopeScaling, Schedule, TrainSection,
};

use megac_ir::Axis;

use crate::error::{Origin, SpecError};
use crate::raw::{Entry, Raw, Table};

/// Where each setting (`section.key`) came from, for validation messages.
pub type Origins = HashMap<String, Origin>;

const MODEL_KEYS: &[&str] = &[
    "arch",
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "ffn_hidden",
    "vocab",
    "seq_len",
    "tie_embeddings",
    "norm_eps",
    "rope_theta",
    "moe",
    "head_dim",
    "qkv_bias",
    "qk_norm",
    "sliding_window",
    "rope_scaling",
];
const ROPE_SCALING_KEYS: &[&str] = &[
    "type",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
];
const MOE_KEYS: &[&str] = &[
    "experts",
    "top_k",
    "layer_freq",
    "aux_loss_coeff",
    "capacity_factor",
    "ffn_hidden",
    "shared_ffn_hidden",
    "shared_expert_gate",
    "norm_topk_prob",
    "first_dense_layers",
];
const TRAIN_KEYS: &[&str] = &[
    "micro_batch",
    "global_batch",
    "steps",
    "seed",
    "precision",
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "grad_clip",
    "recompute",
    "lr_schedule",
    "warmup_steps",
    "decay_steps",
    "min_lr",
    "loss_scale",
    "initial_loss_scale",
    "min_loss_scale",
    "loss_scale_window",
    "hysteresis",
];
const PARALLEL_KEYS: &[&str] = &[
    "tp",
    "pp",
    "vpp",
    "dp",
    "cp",
    "ep",
    "sequence_parallel",
    "distributed_optimizer",
    "schedule",
    "dpp_policy",
    "fbd",
    "cp_comm",
    "order",
    "stage_layers",
];
const CLUSTER_KEYS: &[&str] = &["device", "nodes", "gpus_per_node"];
const TOP_KEYS: &[&str] = &["model", "train", "parallel", "cluster"];

/// The largest size any key may have: far above any real model, and small enough that
/// products of two sizes cannot overflow.
pub const MAX_SIZE: u64 = 1_000_000_000;

/// One table being read: known keys are taken out, whatever is left is unknown.
struct Section<'a> {
    file: &'a str,
    name: String,
    table: Table,
    known: &'static [&'static str],
    origins: &'a mut Origins,
}

impl<'a> Section<'a> {
    fn new(
        file: &'a str,
        name: &str,
        table: Table,
        known: &'static [&'static str],
        origins: &'a mut Origins,
    ) -> Self {
        Section {
            file,
            name: name.to_string(),
            table,
            known,
            origins,
        }
    }

    fn full(&self, key: &str) -> String {
        format!("{}.{}", self.name, key)
    }

    fn take(&mut self, key: &str) -> Option<Entry> {
        let e = self.table.remove(key)?;
        self.origins.insert(self.full(key), e.origin.clone());
        Some(e)
    }

    fn type_error(&self, key: &str, e: &Entry, want: &str) -> SpecError {
        let err = SpecError::new(
            self.file,
            e.origin.clone(),
            format!(
                "{} must be {want}, found {}",
                self.full(key),
                describe(&e.value)
            ),
        );
        // The usual slips: a quoted number, `64.0` for an integer, `1` for a boolean.
        let number = want.contains("integer") || want == "a number";
        match &e.value {
            Raw::Str(s) if number && s.trim().parse::<f64>().is_ok() => err.with_help(format!(
                "write numbers without quotes: {} = {}",
                key,
                s.trim()
            )),
            Raw::Float(x) if want.contains("integer") && x.fract() == 0.0 && x.abs() < 1e15 => err
                .with_help(format!(
                    "write integers without a decimal point: {key} = {x:.0}"
                )),
            Raw::Int(0 | 1) if want == "true or false" => {
                err.with_help(format!("write {key} = true or {key} = false"))
            }
            _ => err,
        }
    }

    fn missing(&self, key: &str, what: &str) -> SpecError {
        // A misspelt required key is reported as the unknown key it is, not as missing.
        let typo = self
            .table
            .iter()
            .find(|(k, _)| !self.known.contains(&k.as_str()) && suggest(k, &[key]).is_some());
        if let Some((typo, e)) = typo {
            return SpecError::new(
                self.file,
                e.key_origin.clone(),
                format!("unknown key {}", self.full(typo)),
            )
            .with_help(format!(
                "did you mean `{key}`? {} is required ({what})",
                self.full(key)
            ));
        }
        // Point at the section's header, when the section is in the file.
        let at = match self.origins.get(&self.name) {
            Some(o @ Origin::File { .. }) => o.clone(),
            _ => Origin::Default,
        };
        SpecError::new(
            self.file,
            at,
            format!("missing required key {} ({what})", self.full(key)),
        )
        .with_help(format!("add `{key} = ...` under [{}]", self.name))
    }

    /// A positive integer; `default` applies when the key is absent (None = required).
    fn positive(&mut self, key: &str, default: Option<u64>, what: &str) -> Result<u64, SpecError> {
        match self.take(key) {
            None => default.ok_or_else(|| self.missing(key, what)),
            Some(e) => match e.value {
                Raw::Int(n) if n as u64 > MAX_SIZE && n > 0 => Err(SpecError::new(
                    self.file,
                    e.origin.clone(),
                    format!("{} = {n} is too large", self.full(key)),
                )
                .with_help(format!("{what}; use a value between 1 and {MAX_SIZE}"))),
                Raw::Int(n) if n >= 1 => Ok(n as u64),
                Raw::Int(n) => Err(SpecError::new(
                    self.file,
                    e.origin.clone(),
                    format!("{} = {n} must be a positive integer", self.full(key)),
                )
                .with_help(format!("{what}; use a value of 1 or more"))),
                _ => Err(self.type_error(key, &e, "a positive integer")),
            },
        }
    }

    /// A non-negative integer.
    fn natural(&mut self, key: &str, default: u64) -> Result<u64, SpecError> {
        match self.take(key) {
            None => Ok(default),
            Some(e) => match e.value {
                Raw::Int(n) if n >= 0 => Ok(n as u64),
                _ => Err(self.type_error(key, &e, "a non-negative integer")),
            },
        }
    }

    /// A finite number within `[min, max)` (or `[min, max]` when `max_inclusive`).
    fn number(
        &mut self,
        key: &str,
        default: f64,
        min: f64,
        min_exclusive: bool,
        max: Option<f64>,
    ) -> Result<f64, SpecError> {
        let Some(e) = self.take(key) else {
            return Ok(default);
        };
        let x = match e.value {
            Raw::Float(x) => x,
            Raw::Int(n) => n as f64,
            _ => return Err(self.type_error(key, &e, "a number")),
        };
        let low_ok = if min_exclusive { x > min } else { x >= min };
        let high_ok = max.is_none_or(|m| x < m);
        if !x.is_finite() || !low_ok || !high_ok {
            let range = match (min_exclusive, max) {
                (true, None) => format!("greater than {min}"),
                (false, None) => format!("at least {min}"),
                (true, Some(m)) => format!("in ({min}, {m})"),
                (false, Some(m)) => format!("in [{min}, {m})"),
            };
            return Err(SpecError::new(
                self.file,
                e.origin.clone(),
                format!(
                    "{} = {} is out of range",
                    self.full(key),
                    value_text(&e.value)
                ),
            )
            .with_help(format!("{} must be {range}", self.full(key))));
        }
        Ok(x)
    }

    /// An array of positive integers (empty when the key is absent).
    fn positive_list(&mut self, key: &str) -> Result<Vec<u64>, SpecError> {
        let Some(e) = self.take(key) else {
            return Ok(Vec::new());
        };
        let Raw::Array(items) = &e.value else {
            return Err(self.type_error(key, &e, "an array of positive integers or \"balanced\""));
        };
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            match item.value {
                Raw::Int(n) if n > 0 && (n as u64) <= MAX_SIZE => out.push(n as u64),
                _ => {
                    return Err(SpecError::new(
                        self.file,
                        item.origin.clone(),
                        format!(
                            "{} holds {}, not a positive integer",
                            self.full(key),
                            value_text(&item.value)
                        ),
                    )
                    .with_help(format!(
                        "{} lists the layers of every pipeline chunk, e.g. [7, 8, 8, 9]",
                        self.full(key)
                    )))
                }
            }
        }
        Ok(out)
    }

    fn boolean(&mut self, key: &str, default: bool) -> Result<bool, SpecError> {
        match self.take(key) {
            None => Ok(default),
            Some(e) => match e.value {
                Raw::Bool(b) => Ok(b),
                _ => Err(self.type_error(key, &e, "true or false")),
            },
        }
    }

    fn string(&mut self, key: &str) -> Result<Option<(String, Origin)>, SpecError> {
        match self.take(key) {
            None => Ok(None),
            Some(e) => match &e.value {
                Raw::Str(s) => Ok(Some((s.clone(), e.origin.clone()))),
                _ => Err(self.type_error(key, &e, "a string")),
            },
        }
    }

    /// One of `choices` (as spelled in model.toml).
    fn choice<T: Copy>(
        &mut self,
        key: &str,
        choices: &[(&str, T)],
    ) -> Result<Option<T>, SpecError> {
        let Some((s, origin)) = self.string(key)? else {
            return Ok(None);
        };
        match choices.iter().find(|(name, _)| *name == s) {
            Some((_, v)) => Ok(Some(*v)),
            None => {
                let names: Vec<String> = choices.iter().map(|(n, _)| format!("\"{n}\"")).collect();
                let mut help = format!("use one of {}", names.join(", "));
                if let Some((n, _)) = choices.iter().find(|(n, _)| n.eq_ignore_ascii_case(&s)) {
                    help = format!("did you mean \"{n}\"? (choices are lower-case); {help}");
                }
                Err(SpecError::new(
                    self.file,
                    origin,
                    format!("{} = \"{s}\" is not a valid choice", self.full(key)),
                )
                .with_help(help))
            }
        }
    }

    /// A sub-table, removed from this section.
    fn subtable(&mut self, key: &str) -> Result<Option<Table>, SpecError> {
        match self.take(key) {
            None => Ok(None),
            Some(e) => match e.value {
                Raw::Table(t) => Ok(Some(t)),
                _ => Err(self.type_error(key, &e, "a table")),
            },
        }
    }

    /// Reject whatever keys were not read.
    fn finish(self) -> Result<(), SpecError> {
        if let Some((key, e)) = self.table.iter().next() {
            let mut err = SpecError::new(
                self.file,
                e.key_origin.clone(),
                format!("unknown key {}", self.full(key)),
            );
            err = match suggest(key, self.known) {
                Some(s) => err.with_help(format!("did you mean `{s}`?")),
                None => err.with_help(format!(
                    "valid keys in [{}]: {}",
                    self.name,
                    self.known.join(", ")
                )),
            };
            return Err(err);
        }
        Ok(())
    }
}

fn describe(v: &Raw) -> String {
    match v {
        Raw::Int(_) => format!("the integer {}", value_text(v)),
        Raw::Float(_) => format!("the float {}", value_text(v)),
        Raw::Bool(_) => format!("the boolean {}", value_text(v)),
        Raw::Str(_) => format!("the string {}", value_text(v)),
        Raw::Array(_) => format!("the array {}", value_text(v)),
        other => other.type_name().to_string(),
    }
}

/// A value spelt roughly as in TOML: `64.0` stays `64.0`, `1e-5` stays `1e-5`, `nan` stays
/// `nan`, strings are quoted, arrays show their items.
fn value_text(v: &Raw) -> String {
    match v {
        Raw::Int(n) => n.to_string(),
        Raw::Float(x) if x.is_nan() => "nan".to_string(),
        Raw::Float(x) if x.is_infinite() => (if *x > 0.0 { "inf" } else { "-inf" }).to_string(),
        Raw::Float(x) if *x != 0.0 && (x.abs() < 1e-4 || x.abs() >= 1e16) => format!("{x:e}"),
        Raw::Float(x) if x.fract() == 0.0 => format!("{x:.1}"),
        Raw::Float(x) => x.to_string(),
        Raw::Bool(b) => b.to_string(),
        Raw::Str(s) => format!("{s:?}"),
        Raw::Array(items) => {
            let items: Vec<String> = items.iter().map(|e| value_text(&e.value)).collect();
            format!("[{}]", items.join(", "))
        }
        other => other.type_name().to_string(),
    }
}

/// The closest known key: within two edits, or one of the two a prefix of the other
/// (`training` -> `train`); ties go to the longer common prefix (`tpp` -> `tp`).
fn suggest<'k>(key: &str, known: &[&'k str]) -> Option<&'k str> {
    let prefix = |k: &str| {
        key.chars()
            .zip(k.chars())
            .take_while(|(a, b)| a == b)
            .count()
    };
    known
        .iter()
        .filter_map(|k| {
            let d = edit_distance(key, k);
            let p = prefix(k);
            let is_prefix = p >= 3 && p == key.len().min(k.len());
            (d <= 2 || is_prefix).then_some((d, std::cmp::Reverse(p), *k))
        })
        .min()
        .map(|(_, _, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Read the settings tree into a `ModelSpec` (types, ranges, defaults; cross-key rules
/// are checked afterwards by `validate`).
pub fn read_spec(
    file: &str,
    name: &str,
    mut root: Table,
    origins: &mut Origins,
) -> Result<ModelSpec, SpecError> {
    let mut top_section = |key: &str| -> Result<Option<Table>, SpecError> {
        match root.remove(key) {
            None => Ok(None),
            Some(e) => match e.value {
                Raw::Table(t) => {
                    origins.insert(key.to_string(), e.key_origin.clone());
                    Ok(Some(t))
                }
                other => Err(SpecError::new(
                    file,
                    e.origin.clone(),
                    format!(
                        "`{key}` must be a table ([{key}]), found {}",
                        describe(&other)
                    ),
                )),
            },
        }
    };
    let model_t = top_section("model")?;
    let train_t = top_section("train")?;
    let parallel_t = top_section("parallel")?;
    let cluster_t = top_section("cluster")?;
    if let Some((key, e)) = root.iter().next() {
        const SECTIONS: &str =
            "model.toml has the sections [model], [train], [parallel], [cluster]";
        let err = match e.value {
            Raw::Table(_) => {
                let err = SpecError::new(
                    file,
                    e.key_origin.clone(),
                    format!("unknown section [{key}]"),
                );
                match suggest(key, TOP_KEYS) {
                    Some(s) => err.with_help(format!("did you mean [{s}]? {SECTIONS}")),
                    None => err.with_help(SECTIONS),
                }
            }
            _ => SpecError::new(
                file,
                e.key_origin.clone(),
                format!("unknown top-level key {key}"),
            )
            .with_help("every key belongs under one of the sections [model], [train], [parallel], [cluster]"),
        };
        return Err(err);
    }
    let Some(model_t) = model_t else {
        return Err(
            SpecError::new(file, Origin::Default, "missing section [model]").with_help(
                "add [model] with at least arch, layers, hidden, heads, ffn_hidden, vocab, seq_len",
            ),
        );
    };

    let model = read_model(file, model_t, origins)?;
    let parallel = read_parallel(file, parallel_t.unwrap_or_default(), origins)?;
    let train = read_train(file, train_t.unwrap_or_default(), &parallel, origins)?;
    let cluster = match cluster_t {
        None => None,
        Some(t) => Some(read_cluster(file, t, origins)?),
    };
    Ok(ModelSpec {
        name: name.to_string(),
        model,
        train,
        parallel,
        cluster,
    })
}

fn read_model(file: &str, t: Table, origins: &mut Origins) -> Result<ModelSection, SpecError> {
    let mut s = Section::new(file, "model", t, MODEL_KEYS, origins);
    let arch = s
        .choice(
            "arch",
            &[
                ("llama", Arch::Llama),
                ("gpt", Arch::Gpt),
                ("mistral", Arch::Mistral),
                ("qwen2", Arch::Qwen2),
                ("qwen3", Arch::Qwen3),
                ("qwen2_moe", Arch::Qwen2Moe),
            ],
        )?
        .ok_or_else(|| {
            s.missing(
                "arch",
                "\"llama\", \"gpt\", \"mistral\", \"qwen2\", \"qwen3\" or \"qwen2_moe\"",
            )
        })?;
    let layers = s.positive("layers", None, "number of transformer layers")?;
    let hidden = s.positive("hidden", None, "hidden size")?;
    let heads = s.positive("heads", None, "attention heads")?;
    let kv_heads = s.positive("kv_heads", Some(heads), "key/value heads")?;
    let ffn_hidden = s.positive("ffn_hidden", None, "MLP intermediate size")?;
    let vocab = s.positive("vocab", None, "vocabulary size")?;
    let seq_len = s.positive("seq_len", None, "sequence length")?;
    let tie_embeddings = s.boolean("tie_embeddings", arch == Arch::Gpt)?;
    let norm_eps = s.number("norm_eps", 1e-5, 0.0, true, None)?;
    let rope_theta = s.number("rope_theta", 10000.0, 0.0, true, None)?;
    let moe_t = s.subtable("moe")?;
    // transformers' defaults per family: Qwen3Config's head_dim is 128, the others derive it.
    let head_dim_default = if arch == Arch::Qwen3 {
        128
    } else {
        (hidden / heads).max(1)
    };
    let head_dim = s.positive(
        "head_dim",
        Some(head_dim_default),
        "size of one attention head",
    )?;
    let qkv_bias = s.boolean("qkv_bias", matches!(arch, Arch::Qwen2 | Arch::Qwen2Moe))?;
    let qk_norm = s.boolean("qk_norm", arch == Arch::Qwen3)?;
    let sliding_window = match s.table.contains_key("sliding_window") {
        true => Some(s.positive(
            "sliding_window",
            None,
            "tokens each query attends to, itself included",
        )?),
        false => None,
    };
    let rope_t = s.subtable("rope_scaling")?;
    s.finish()?;
    let rope_scaling = match rope_t {
        None => None,
        Some(t) => Some(read_rope_scaling(file, t, origins)?),
    };
    let moe = match moe_t {
        None => None,
        Some(t) => {
            let mut m = Section::new(file, "model.moe", t, MOE_KEYS, origins);
            let experts = m.positive("experts", None, "experts per MoE layer")?;
            let top_k = m.positive("top_k", Some(2), "experts per token")?;
            let layer_freq = m.positive("layer_freq", Some(1), "every n-th layer is MoE")?;
            let aux_loss_coeff = m.number("aux_loss_coeff", 0.01, 0.0, false, None)?;
            let capacity_factor = m.number("capacity_factor", 0.0, 0.0, false, None)?;
            let expert_ffn = m.positive(
                "ffn_hidden",
                Some(ffn_hidden),
                "each routed expert's intermediate size",
            )?;
            let shared_ffn_hidden = m.natural("shared_ffn_hidden", 0)?;
            // Qwen2-MoE's shared expert is always gated; Mixtral has no shared expert.
            let shared_expert_gate = m.boolean(
                "shared_expert_gate",
                shared_ffn_hidden > 0 && arch == Arch::Qwen2Moe,
            )?;
            let norm_topk_prob = m.boolean("norm_topk_prob", arch != Arch::Qwen2Moe)?;
            let first_dense_layers = m.natural("first_dense_layers", 0)?;
            m.finish()?;
            Some(MoeSpec {
                ffn_hidden: expert_ffn,
                shared_ffn_hidden,
                shared_expert_gate,
                norm_topk_prob,
                first_dense_layers,
                experts,
                top_k,
                layer_freq,
                aux_loss_coeff,
                capacity_factor,
            })
        }
    };
    Ok(ModelSection {
        arch,
        layers,
        hidden,
        heads,
        kv_heads,
        ffn_hidden,
        vocab,
        seq_len,
        tie_embeddings,
        norm_eps,
        rope_theta,
        moe,
        head_dim,
        qkv_bias,
        qk_norm,
        sliding_window,
        rope_scaling,
    })
}

/// `[model.rope_scaling]`: `type = "linear"` (factor) or `"llama3"` (factor, low_freq_factor,
/// high_freq_factor, original_max_position_embeddings), each key required, as transformers'
/// rope validation requires them.
fn read_rope_scaling(
    file: &str,
    t: Table,
    origins: &mut Origins,
) -> Result<RopeScaling, SpecError> {
    let mut r = Section::new(file, "model.rope_scaling", t, ROPE_SCALING_KEYS, origins);
    let kind = r
        .choice("type", &[("linear", false), ("llama3", true)])?
        .ok_or_else(|| r.missing("type", "\"linear\" or \"llama3\""))?;
    let required = |r: &mut Section<'_>, key: &str, what: &str| -> Result<f64, SpecError> {
        if !r.table.contains_key(key) {
            return Err(r.missing(key, what));
        }
        r.number(key, 1.0, 0.0, true, None)
    };
    let factor = required(&mut r, "factor", "the divisor of the scaled frequencies")?;
    let scaling = if kind {
        let low_freq_factor = required(&mut r, "low_freq_factor", "low-frequency bound factor")?;
        let high_freq_factor = required(&mut r, "high_freq_factor", "high-frequency bound factor")?;
        let original_max_position_embeddings = required(
            &mut r,
            "original_max_position_embeddings",
            "the context length before scaling",
        )?;
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }
    } else {
        for key in &ROPE_SCALING_KEYS[2..] {
            if let Some(e) = r.take(key) {
                return Err(SpecError::new(
                    file,
                    e.key_origin.clone(),
                    format!("model.rope_scaling.{key} applies only to type = \"llama3\""),
                )
                .with_help("type = \"linear\" takes only factor"));
            }
        }
        RopeScaling::Linear { factor }
    };
    r.finish()?;
    Ok(scaling)
}

fn read_train(
    file: &str,
    t: Table,
    parallel: &ParallelSection,
    origins: &mut Origins,
) -> Result<TrainSection, SpecError> {
    let mut s = Section::new(file, "train", t, TRAIN_KEYS, origins);
    let micro_batch = s.positive("micro_batch", Some(1), "samples per micro-batch")?;
    let global_batch = s.positive(
        "global_batch",
        Some(micro_batch * parallel.dp),
        "samples per optimizer step",
    )?;
    let steps = s.positive("steps", Some(10), "optimizer steps")?;
    let seed = s.natural("seed", 1234)?;
    let precision = s
        .choice(
            "precision",
            &[
                ("fp32", Precision::Fp32),
                ("bf16", Precision::Bf16),
                ("fp16", Precision::Fp16),
            ],
        )?
        .unwrap_or(Precision::Fp32);
    let lr = s.number("lr", 3e-4, 0.0, true, None)?;
    let betas = match s.take("betas") {
        None => (0.9, 0.999),
        Some(e) => {
            let pair = match &e.value {
                Raw::Array(items) if items.len() == 2 => {
                    let get = |x: &Entry| match x.value {
                        Raw::Float(v) => Some(v),
                        Raw::Int(n) => Some(n as f64),
                        _ => None,
                    };
                    get(&items[0]).zip(get(&items[1]))
                }
                _ => None,
            };
            match pair {
                Some((b1, b2)) if (0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2) => (b1, b2),
                Some(_) => {
                    return Err(SpecError::new(
                        file,
                        e.origin.clone(),
                        format!("train.betas = {} is out of range", value_text(&e.value)),
                    )
                    .with_help("both betas must be in [0, 1), e.g. [0.9, 0.95]"))
                }
                None => {
                    return Err(s.type_error(
                        "betas",
                        &e,
                        "an array of two numbers, e.g. [0.9, 0.95]",
                    ))
                }
            }
        }
    };
    let eps = s.number("eps", 1e-8, 0.0, true, None)?;
    let weight_decay = s.number("weight_decay", 0.01, 0.0, false, None)?;
    let grad_clip = s.number("grad_clip", 1.0, 0.0, false, None)?;
    let recompute = s
        .choice(
            "recompute",
            &[
                ("none", Recompute::None),
                ("selective", Recompute::Selective),
                ("full", Recompute::Full),
            ],
        )?
        .unwrap_or(Recompute::None);
    let cosine = s
        .choice("lr_schedule", &[("constant", false), ("cosine", true)])?
        .unwrap_or(false);
    let lr_schedule = if cosine {
        let warmup_steps = s.natural("warmup_steps", 0)?;
        let decay_steps = s.positive("decay_steps", Some(steps), "step at which the decay ends")?;
        let min_lr = s.number("min_lr", 0.0, 0.0, false, None)?;
        if warmup_steps > decay_steps {
            return Err(SpecError::new(
                file,
                s.origins
                    .get("train.warmup_steps")
                    .cloned()
                    .unwrap_or(Origin::Default),
                format!(
                    "train.warmup_steps = {warmup_steps} exceeds train.decay_steps = {decay_steps}"
                ),
            )
            .with_help("the cosine decay runs from warmup_steps to decay_steps"));
        }
        if min_lr > lr {
            return Err(SpecError::new(
                file,
                s.origins
                    .get("train.min_lr")
                    .cloned()
                    .unwrap_or(Origin::Default),
                format!("train.min_lr = {min_lr} exceeds train.lr = {lr}"),
            )
            .with_help("min_lr is where the cosine decay ends; it must not exceed lr"));
        }
        Some(CosineSchedule {
            warmup_steps,
            decay_steps,
            min_lr,
        })
    } else {
        for key in ["warmup_steps", "decay_steps", "min_lr"] {
            if let Some(e) = s.take(key) {
                return Err(SpecError::new(
                    file,
                    e.key_origin.clone(),
                    format!("train.{key} is only used with train.lr_schedule = \"cosine\""),
                )
                .with_help("set lr_schedule = \"cosine\" or remove the key"));
            }
        }
        None
    };
    // fp16's loss scaler (Megatron's flags and defaults); the keys exist only for fp16.
    const SCALER_KEYS: [&str; 5] = [
        "loss_scale",
        "initial_loss_scale",
        "min_loss_scale",
        "loss_scale_window",
        "hysteresis",
    ];
    let loss_scaler = if precision == Precision::Fp16 {
        let fixed = s.take("loss_scale").map(|e| (e.clone(), e.value.clone()));
        let static_scale = match fixed {
            None => None,
            Some((e, Raw::Float(v))) if v.is_finite() && v > 0.0 => Some((v, e)),
            Some((e, Raw::Int(n))) if n > 0 => Some((n as f64, e)),
            Some((e, _)) => return Err(s.type_error("loss_scale", &e, "a positive number")),
        };
        let initial = s.number("initial_loss_scale", 2f64.powi(32), 0.0, true, None)?;
        let min_scale = s.number("min_loss_scale", 1.0, 0.0, true, None)?;
        let window = s.positive(
            "loss_scale_window",
            Some(1000),
            "clean steps before the scale doubles",
        )?;
        let hysteresis = s.positive(
            "hysteresis",
            Some(2),
            "overflowing steps before the scale halves",
        )?;
        Some(match static_scale {
            Some((v, _)) => LossScaler {
                initial_scale: v,
                min_scale: v,
                window,
                hysteresis,
                fixed: true,
            },
            None => LossScaler {
                initial_scale: initial,
                min_scale: min_scale.min(initial),
                window,
                hysteresis,
                fixed: false,
            },
        })
    } else {
        for key in SCALER_KEYS {
            if let Some(e) = s.take(key) {
                return Err(SpecError::new(
                    file,
                    e.key_origin.clone(),
                    format!(
                        "train.{key} is only used with train.precision = \"fp16\" (now \"{}\")",
                        precision.as_str()
                    ),
                )
                .with_help("bf16 and fp32 need no loss scaling; remove the key or set precision = \"fp16\""));
            }
        }
        None
    };
    s.finish()?;
    Ok(TrainSection {
        loss_scaler,
        lr_schedule,
        micro_batch,
        global_batch,
        steps,
        seed,
        precision,
        lr,
        betas,
        eps,
        weight_decay,
        grad_clip,
        recompute,
    })
}

fn read_parallel(
    file: &str,
    t: Table,
    origins: &mut Origins,
) -> Result<ParallelSection, SpecError> {
    let mut s = Section::new(file, "parallel", t, PARALLEL_KEYS, origins);
    let tp = s.positive("tp", Some(1), "tensor-parallel size")?;
    let pp = s.positive("pp", Some(1), "pipeline-parallel size")?;
    let vpp = s.positive("vpp", Some(1), "virtual pipeline chunks per pipeline rank")?;
    let dp = s.positive("dp", Some(1), "data-parallel size")?;
    let cp = s.positive("cp", Some(1), "context-parallel size")?;
    let ep = s.positive("ep", Some(1), "expert-parallel size")?;
    let sequence_parallel = s.boolean("sequence_parallel", false)?;
    let distributed_optimizer = s.boolean("distributed_optimizer", false)?;
    let schedule = s
        .choice(
            "schedule",
            &[
                ("gpipe", Schedule::Gpipe),
                ("1f1b", Schedule::OneFOneB),
                ("interleaved", Schedule::Interleaved),
                ("zb-h1", Schedule::ZbH1),
                ("dpp", Schedule::Dpp),
            ],
        )?
        .unwrap_or(if vpp > 1 {
            Schedule::Interleaved
        } else {
            Schedule::OneFOneB
        });
    let dpp_policy = s
        .choice("dpp_policy", &DppPolicy::ALL.map(|p| (p.as_str(), p)))?
        .unwrap_or(DppPolicy::Adaptive { cap: None });
    let fbd = s.boolean("fbd", false)?;
    let cp_comm = s
        .choice(
            "cp_comm",
            &[("ring", CpComm::Ring), ("all-gather", CpComm::AllGather)],
        )?
        .unwrap_or(CpComm::Ring);
    let order = match s.string("order")? {
        None => Axis::ALL.to_vec(),
        Some((text, origin)) => {
            let parsed: Option<Vec<Axis>> = text.split('-').map(Axis::from_name).collect();
            let valid = parsed.as_ref().is_some_and(|axes| {
                axes.len() == Axis::ALL.len() && Axis::ALL.iter().all(|a| axes.contains(a))
            });
            match parsed {
                Some(axes) if valid => axes,
                _ => {
                    return Err(SpecError::new(
                        file,
                        origin,
                        format!("parallel.order = \"{text}\" is not an order of the five mesh axes"),
                    )
                    .with_help(
                        "name each of tp, cp, ep, dp, pp once, innermost (fastest-varying rank) first, e.g. \"tp-cp-ep-dp-pp\" (Megatron's default) or \"tp-cp-ep-pp-dp\"",
                    ))
                }
            }
        }
    };
    let (stage_layers, balance_stages) = match s.table.get("stage_layers").map(|e| &e.value) {
        Some(Raw::Str(_)) => {
            if let Some((text, origin)) = s.string("stage_layers")? {
                if text != "balanced" {
                    return Err(SpecError::new(
                        file,
                        origin,
                        format!("parallel.stage_layers = \"{text}\" is not a split"),
                    )
                    .with_help(
                        "use \"balanced\" (split by a per-layer cost estimate) or list the layers of every chunk, e.g. [7, 9, 9, 7]",
                    ));
                }
            }
            (Vec::new(), true)
        }
        _ => (s.positive_list("stage_layers")?, false),
    };
    s.finish()?;
    Ok(ParallelSection {
        tp,
        pp,
        vpp,
        dp,
        cp,
        ep,
        sequence_parallel,
        distributed_optimizer,
        schedule,
        dpp_policy,
        fbd,
        cp_comm,
        order,
        stage_layers,
        balance_stages,
    })
}

fn read_cluster(file: &str, t: Table, origins: &mut Origins) -> Result<ClusterSection, SpecError> {
    let mut s = Section::new(file, "cluster", t, CLUSTER_KEYS, origins);
    let device = match s.string("device")? {
        Some((d, origin)) if d.trim().is_empty() => {
            return Err(SpecError::new(file, origin, "cluster.device is empty")
                .with_help("name an accelerator preset, e.g. \"h100-sxm\""))
        }
        Some((d, _)) => d,
        None => "h100-sxm".to_string(),
    };
    let nodes = s.positive("nodes", Some(1), "number of nodes")?;
    let gpus_per_node = s.positive("gpus_per_node", Some(8), "accelerators per node")?;
    s.finish()?;
    Ok(ClusterSection {
        device,
        nodes,
        gpus_per_node,
    })
}
