//! Hugging Face `config.json` and model.toml's `[model]`: [`import_config`] writes the
//! `[model]` section of a transformers config (`megac import-hf`), [`export_config`] the
//! config.json that makes `from_pretrained` load a directory of megac's saved weights.
//!
//! Both layouts of transformers are read: 4's (`rope_theta` and `rope_scaling` at the top
//! level, `rope_scaling.type` or `rope_type`) and 5's (`rope_parameters` holding the theta and
//! the scaling). What megac cannot express (another attention bias, an MLP bias, a rope
//! type other than default, linear and llama3, Qwen's optional sliding window when it is
//! on, an activation other than the family's, ...) is refused, naming the key.

use megac_ir::spec::{Arch, ModelSection, ModelSpec, RopeScaling};
use serde_json::{json, Map, Value};

use crate::error::{Origin, SpecError};

fn err(file: &str, message: impl Into<String>) -> SpecError {
    SpecError::new(file, Origin::Default, message)
}

/// A config.json read for import: the object, and the file named in messages.
struct Config<'a> {
    file: &'a str,
    obj: &'a Map<String, Value>,
}

impl Config<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn int(&self, key: &str) -> Result<Option<u64>, SpecError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().filter(|&n| n > 0).map(Some).ok_or_else(|| {
                err(
                    self.file,
                    format!("config key `{key}` = {v} is not a positive integer"),
                )
            }),
        }
    }

    fn need_int(&self, key: &str) -> Result<u64, SpecError> {
        self.int(key)?
            .ok_or_else(|| err(self.file, format!("config.json lacks `{key}`")))
    }

    fn num(&self, key: &str) -> Result<Option<f64>, SpecError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                err(
                    self.file,
                    format!("config key `{key}` = {v} is not a number"),
                )
            }),
        }
    }

    fn flag(&self, key: &str) -> Result<bool, SpecError> {
        match self.get(key) {
            None => Ok(false),
            Some(v) => v.as_bool().ok_or_else(|| {
                err(
                    self.file,
                    format!("config key `{key}` = {v} is not true or false"),
                )
            }),
        }
    }

    fn text(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    fn refuse(&self, key: &str, why: &str) -> SpecError {
        let v = self.get(key).map_or("null".to_string(), Value::to_string);
        err(
            self.file,
            format!("config key `{key}` = {v}: {why}, which megac cannot express"),
        )
    }
}

/// The family of a config: its `model_type` (or first `architectures` entry).
fn family(c: &Config<'_>) -> Result<(Arch, bool), SpecError> {
    let model_type = c.text("model_type").map(str::to_string).or_else(|| {
        c.get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .map(|a| a.trim_end_matches("ForCausalLM").to_lowercase())
    });
    let Some(t) = model_type else {
        return Err(err(
            c.file,
            "config.json has neither `model_type` nor `architectures`",
        ));
    };
    Ok(match t.as_str() {
        "llama" => (Arch::Llama, false),
        "mixtral" => (Arch::Llama, true),
        "mistral" => (Arch::Mistral, false),
        "qwen2" => (Arch::Qwen2, false),
        "qwen3" => (Arch::Qwen3, false),
        "qwen2_moe" => (Arch::Qwen2Moe, true),
        "gpt2" => (Arch::Gpt, false),
        other => {
            return Err(err(
                c.file,
                format!(
                    "config key `model_type` = \"{other}\": megac has no such family \
                     (llama, mixtral, mistral, qwen2, qwen3, qwen2_moe, gpt2)"
                ),
            ))
        }
    })
}

/// The rope theta and scaling of a llama-like config (transformers 4 or 5 layout).
/// The `[model.moe]` header both MoE families share: expert count (under the family's key),
/// top-k (the family's default when absent), the router's auxiliary loss, no token dropping.
fn moe_header(
    lines: &mut Vec<String>,
    c: &Config<'_>,
    experts_key: &str,
    top_k_default: u64,
) -> Result<(), SpecError> {
    let experts = c.need_int(experts_key)?;
    let top_k = c.int("num_experts_per_tok")?.unwrap_or(top_k_default);
    let aux = c.num("router_aux_loss_coef")?.unwrap_or(0.001);
    lines.push(String::new());
    lines.push("[model.moe]".to_string());
    lines.push(format!("experts = {experts}"));
    lines.push(format!("top_k = {top_k}"));
    lines.push(format!("aux_loss_coeff = {}", fnum(aux)));
    lines.push("capacity_factor = 0.0".to_string());
    Ok(())
}

fn rope(c: &Config<'_>) -> Result<(f64, Option<RopeScaling>), SpecError> {
    // transformers 5: `rope_parameters` {rope_type, rope_theta, ...}; 4: `rope_theta` and
    // `rope_scaling` {type | rope_type, ...}.
    let (params, key) = match (c.get("rope_parameters"), c.get("rope_scaling")) {
        (Some(p), _) => (Some(p), "rope_parameters"),
        (None, Some(s)) => (Some(s), "rope_scaling"),
        (None, None) => (None, "rope_scaling"),
    };
    let obj = match params {
        None => None,
        Some(Value::Object(o)) => Some(o),
        Some(_) => return Err(c.refuse(key, "not an object")),
    };
    let theta = obj
        .and_then(|o| o.get("rope_theta"))
        .and_then(Value::as_f64)
        .or(c.num("rope_theta")?)
        .unwrap_or(10000.0);
    let Some(o) = obj else {
        return Ok((theta, None));
    };
    let kind = o
        .get("rope_type")
        .or_else(|| o.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let f = |k: &str| -> Result<f64, SpecError> {
        o.get(k).and_then(Value::as_f64).ok_or_else(|| {
            err(
                c.file,
                format!("config key `{key}.{k}` is missing or not a number"),
            )
        })
    };
    if let Some(p) = o.get("partial_rotary_factor").and_then(Value::as_f64) {
        if p != 1.0 {
            return Err(c.refuse(key, "a partial rotary factor"));
        }
    }
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: f("factor")?,
        }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: f("factor")?,
            low_freq_factor: f("low_freq_factor")?,
            high_freq_factor: f("high_freq_factor")?,
            original_max_position_embeddings: f("original_max_position_embeddings")?,
        }),
        other => {
            return Err(c.refuse(
                key,
                &format!("rope type \"{other}\" (megac implements default, linear and llama3)"),
            ))
        }
    };
    Ok((theta, scaling))
}

/// The `[model]` section of transformers config `text` (read from `file`), as model.toml
/// text, or the first key megac cannot express.
pub fn import_config(file: &str, text: &str) -> Result<String, SpecError> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| err(file, format!("config.json is not valid JSON: {e}")))?;
    let Value::Object(obj) = &value else {
        return Err(err(file, "config.json is not a JSON object"));
    };
    let c = Config { file, obj };
    let (arch, moe) = family(&c)?;
    let mut lines = vec![
        format!("# Imported by `megac import-hf` from {file}."),
        "# seq_len is the config's max_position_embeddings: set the length you train with."
            .to_string(),
        String::new(),
        "[model]".to_string(),
        format!("arch = \"{arch}\""),
    ];
    let mut push = |k: &str, v: String| lines.push(format!("{k} = {v}"));
    if arch == Arch::Gpt {
        let act = c.text("activation_function").unwrap_or("gelu_new");
        if act != "gelu_new" && act != "gelu_pytorch_tanh" {
            return Err(c.refuse(
                "activation_function",
                "an activation other than GELU's tanh form",
            ));
        }
        let hidden = c.need_int("n_embd")?;
        push("layers", c.need_int("n_layer")?.to_string());
        push("hidden", hidden.to_string());
        push("heads", c.need_int("n_head")?.to_string());
        push(
            "ffn_hidden",
            c.int("n_inner")?.unwrap_or(4 * hidden).to_string(),
        );
        push("vocab", c.need_int("vocab_size")?.to_string());
        push("seq_len", c.need_int("n_positions")?.to_string());
        push(
            "norm_eps",
            fnum(c.num("layer_norm_epsilon")?.unwrap_or(1e-5)),
        );
        let tie = c.get("tie_word_embeddings").is_none() || c.flag("tie_word_embeddings")?;
        push("tie_embeddings", tie.to_string());
        lines.push(String::new());
        return Ok(lines.join("\n"));
    }
    if let Some(act) = c.text("hidden_act") {
        if act != "silu" {
            return Err(c.refuse("hidden_act", "an activation other than SwiGLU's silu"));
        }
    }
    if c.flag("mlp_bias")? {
        return Err(c.refuse("mlp_bias", "biases in the MLP"));
    }
    if c.flag("attention_bias")? {
        return Err(c.refuse(
            "attention_bias",
            "biases on q, k, v and o (megac has Qwen2's q/k/v biases only)",
        ));
    }
    let hidden = c.need_int("hidden_size")?;
    let heads = c.need_int("num_attention_heads")?;
    push("layers", c.need_int("num_hidden_layers")?.to_string());
    push("hidden", hidden.to_string());
    push("heads", heads.to_string());
    let kv = c.int("num_key_value_heads")?.unwrap_or(heads);
    push("kv_heads", kv.to_string());
    push("ffn_hidden", c.need_int("intermediate_size")?.to_string());
    push("vocab", c.need_int("vocab_size")?.to_string());
    push(
        "seq_len",
        c.need_int("max_position_embeddings")?.to_string(),
    );
    push("norm_eps", fnum(c.num("rms_norm_eps")?.unwrap_or(1e-6)));
    let (theta, scaling) = rope(&c)?;
    push("rope_theta", fnum(theta));
    push("tie_embeddings", c.flag("tie_word_embeddings")?.to_string());
    // Qwen3Config's head_dim defaults to 128 (so does megac's for qwen3); the others derive
    // it from hidden / heads.
    let head_dim = match (c.int("head_dim")?, arch) {
        (Some(d), _) => Some(d),
        (None, Arch::Qwen3) => Some(128),
        (None, _) => None,
    };
    if let Some(d) = head_dim {
        push("head_dim", d.to_string());
    }
    match arch {
        Arch::Mistral => {
            if let Some(w) = c.int("sliding_window")? {
                push("sliding_window", w.to_string());
            }
        }
        // Qwen2/Qwen3/Qwen2-MoE carry a sliding_window that applies only with
        // use_sliding_window (Qwen2-MoE even writes `sliding_window: 0`): it is not read.
        Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Moe if c.flag("use_sliding_window")? => {
            return Err(c.refuse(
                "use_sliding_window",
                "Qwen's sliding window on the layers past max_window_layers",
            ));
        }
        Arch::Llama if moe && c.int("sliding_window")?.is_some() => {
            return Err(c.refuse("sliding_window", "a sliding window in Mixtral"));
        }
        _ => {}
    }
    if let Some(s) = scaling {
        lines.push(String::new());
        lines.push("[model.rope_scaling]".to_string());
        match s {
            RopeScaling::Linear { factor } => {
                lines.push("type = \"linear\"".to_string());
                lines.push(format!("factor = {}", fnum(factor)));
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                lines.push("type = \"llama3\"".to_string());
                lines.push(format!("factor = {}", fnum(factor)));
                lines.push(format!("low_freq_factor = {}", fnum(low_freq_factor)));
                lines.push(format!("high_freq_factor = {}", fnum(high_freq_factor)));
                lines.push(format!(
                    "original_max_position_embeddings = {}",
                    fnum(original_max_position_embeddings)
                ));
            }
        }
    }
    // Qwen2MoeConfig's qkv_bias (default true, as megac's for qwen2_moe).
    if arch == Arch::Qwen2Moe && c.get("qkv_bias").is_some() && !c.flag("qkv_bias")? {
        lines.push("qkv_bias = false".to_string());
    }
    if arch == Arch::Qwen2Moe {
        if c.int("decoder_sparse_step")?.unwrap_or(1) != 1 {
            return Err(c.refuse(
                "decoder_sparse_step",
                "MoE layers other than every layer from the first (megac counts layer_freq from layer 0)",
            ));
        }
        // mlp_only_layers: megac expresses the first k layers dense (0, 1, .., k-1).
        let dense = match c.get("mlp_only_layers") {
            None => 0,
            Some(Value::Array(a)) => {
                let ok = a
                    .iter()
                    .enumerate()
                    .all(|(i, v)| v.as_u64() == Some(i as u64));
                if !ok {
                    return Err(c.refuse(
                        "mlp_only_layers",
                        "dense layers other than the first k (0, 1, .., k-1)",
                    ));
                }
                a.len()
            }
            Some(_) => return Err(c.refuse("mlp_only_layers", "not a list of layers")),
        };
        moe_header(&mut lines, &c, "num_experts", 4)?;
        lines.push(format!(
            "ffn_hidden = {}",
            c.int("moe_intermediate_size")?.unwrap_or(1408)
        ));
        lines.push(format!(
            "shared_ffn_hidden = {}",
            c.int("shared_expert_intermediate_size")?.unwrap_or(5632)
        ));
        lines.push(format!("norm_topk_prob = {}", c.flag("norm_topk_prob")?));
        if dense > 0 {
            lines.push(format!("first_dense_layers = {dense}"));
        }
    } else if moe {
        moe_header(&mut lines, &c, "num_local_experts", 2)?;
    }
    lines.push(String::new());
    Ok(lines.join("\n"))
}

/// A float as a TOML number that reads back as the same f64 (`1e-5`, `10000.0`).
fn fnum(x: f64) -> String {
    let s = format!("{x:?}");
    if s.contains('e') || s.contains('.') || s.contains("inf") || s.contains("NaN") {
        s
    } else {
        format!("{s}.0")
    }
}

/// The transformers (5) `config.json` of `spec`'s model: what `from_pretrained` needs to
/// load megac's saved weights as the family's class (`--save-params` writes it beside them).
pub fn export_config(spec: &ModelSpec) -> String {
    let m: &ModelSection = &spec.model;
    let moe = m.moe.is_some();
    let class = m.arch.hf_class(moe);
    let mut o = Map::new();
    o.insert("architectures".into(), json!([class]));
    o.insert("dtype".into(), json!("float32"));
    o.insert("vocab_size".into(), json!(m.vocab));
    o.insert("tie_word_embeddings".into(), json!(m.tie_embeddings));
    if m.arch == Arch::Gpt {
        o.insert("model_type".into(), json!("gpt2"));
        o.insert("n_embd".into(), json!(m.hidden));
        o.insert("n_layer".into(), json!(m.layers));
        o.insert("n_head".into(), json!(m.heads));
        o.insert("n_inner".into(), json!(m.ffn_hidden));
        o.insert("n_positions".into(), json!(m.seq_len));
        o.insert("layer_norm_epsilon".into(), json!(m.norm_eps));
        o.insert("activation_function".into(), json!("gelu_new"));
        // GPT2Config's defaults (50256) lie outside a smaller vocabulary.
        o.insert("bos_token_id".into(), Value::Null);
        o.insert("eos_token_id".into(), Value::Null);
        for k in [
            "resid_pdrop",
            "embd_pdrop",
            "attn_pdrop",
            "summary_first_dropout",
        ] {
            o.insert(k.into(), json!(0.0));
        }
    } else {
        let model_type = match (m.arch, moe) {
            (Arch::Llama, true) => "mixtral",
            (a, _) => a.as_str(),
        };
        o.insert("model_type".into(), json!(model_type));
        o.insert("hidden_size".into(), json!(m.hidden));
        o.insert("num_hidden_layers".into(), json!(m.layers));
        o.insert("num_attention_heads".into(), json!(m.heads));
        o.insert("num_key_value_heads".into(), json!(m.kv_heads));
        o.insert("head_dim".into(), json!(m.head_dim));
        o.insert("intermediate_size".into(), json!(m.ffn_hidden));
        o.insert("max_position_embeddings".into(), json!(m.seq_len));
        o.insert("rms_norm_eps".into(), json!(m.norm_eps));
        o.insert("hidden_act".into(), json!("silu"));
        o.insert("attention_dropout".into(), json!(0.0));
        let mut rope = Map::new();
        rope.insert("rope_theta".into(), json!(m.rope_theta));
        match m.rope_scaling {
            None => {
                rope.insert("rope_type".into(), json!("default"));
            }
            Some(RopeScaling::Linear { factor }) => {
                rope.insert("rope_type".into(), json!("linear"));
                rope.insert("factor".into(), json!(factor));
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                rope.insert("rope_type".into(), json!("llama3"));
                rope.insert("factor".into(), json!(factor));
                rope.insert("low_freq_factor".into(), json!(low_freq_factor));
                rope.insert("high_freq_factor".into(), json!(high_freq_factor));
                rope.insert(
                    "original_max_position_embeddings".into(),
                    json!(original_max_position_embeddings as u64),
                );
            }
        }
        o.insert("rope_parameters".into(), Value::Object(rope));
        match m.arch {
            Arch::Llama if !moe => {
                o.insert("attention_bias".into(), json!(false));
                o.insert("mlp_bias".into(), json!(false));
            }
            Arch::Mistral | Arch::Llama => {
                o.insert("sliding_window".into(), json!(m.sliding_window));
            }
            Arch::Qwen2 => {
                o.insert("use_sliding_window".into(), json!(false));
            }
            Arch::Qwen3 => {
                o.insert("use_sliding_window".into(), json!(false));
                o.insert("attention_bias".into(), json!(false));
            }
            Arch::Qwen2Moe => {
                o.insert("use_sliding_window".into(), json!(false));
                o.insert("qkv_bias".into(), json!(m.qkv_bias));
            }
            Arch::Gpt => {}
        }
        if let (Arch::Qwen2Moe, Some(x)) = (m.arch, &m.moe) {
            o.insert("num_experts".into(), json!(x.experts));
            o.insert("num_experts_per_tok".into(), json!(x.top_k));
            o.insert("moe_intermediate_size".into(), json!(x.ffn_hidden));
            o.insert(
                "shared_expert_intermediate_size".into(),
                json!(x.shared_ffn_hidden),
            );
            o.insert("norm_topk_prob".into(), json!(x.norm_topk_prob));
            o.insert("decoder_sparse_step".into(), json!(x.layer_freq));
            let dense: Vec<u64> = (0..x.first_dense_layers).collect();
            o.insert("mlp_only_layers".into(), json!(dense));
            o.insert("router_aux_loss_coef".into(), json!(x.aux_loss_coeff));
            o.insert("output_router_logits".into(), json!(false));
        } else if let Some(x) = &m.moe {
            o.insert("num_local_experts".into(), json!(x.experts));
            o.insert("num_experts_per_tok".into(), json!(x.top_k));
            o.insert("router_aux_loss_coef".into(), json!(x.aux_loss_coeff));
            o.insert("output_router_logits".into(), json!(false));
            o.insert("router_jitter_noise".into(), json!(0.0));
        }
    }
    let mut text = serde_json::to_string_pretty(&Value::Object(o)).expect("a JSON object");
    text.push('\n');
    text
}
