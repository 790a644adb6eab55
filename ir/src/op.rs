//! Operations of the Graph IR: kernel-sized, each with its attributes.

/// How a linear layer stores its weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightLayout {
    /// `[out, in]`, as `torch.nn.Linear` (Llama, Mixtral, tied output layers).
    OutIn,
    /// `[in, out]`, as GPT-2's `Conv1D`.
    InOut,
}

impl WeightLayout {
    /// Textual name.
    pub fn as_str(self) -> &'static str {
        match self {
            WeightLayout::OutIn => "out_in",
            WeightLayout::InOut => "in_out",
        }
    }

    /// Parse the textual name.
    pub fn from_name(s: &str) -> Option<WeightLayout> {
        match s {
            "out_in" => Some(WeightLayout::OutIn),
            "in_out" => Some(WeightLayout::InOut),
            _ => None,
        }
    }
}

/// What an op computes, with its attributes. Inputs and outputs are listed per variant.
#[derive(Clone, Debug, PartialEq)]
pub enum OpKind {
    /// `(tokens i32[b,s], table[vocab,h]) -> [b,s,h]`: row lookup.
    Embedding,
    /// `(x[b,s,h], wpe[pos,h]) -> [b,s,h]`: adds learned positions `wpe[0..s]`.
    PosEmbedding,
    /// `(x[..,in], w, bias?) -> [..,out]`: `x · wᵀ (+ bias)` for `OutIn`, `x · w` for `InOut`.
    Linear {
        /// Storage order of the weight.
        weight: WeightLayout,
    },
    /// `(x[..,h], w[h]) -> [..,h]`: RMSNorm.
    RmsNorm {
        /// Epsilon inside the square root.
        eps: f64,
    },
    /// `(x[..,h], w[h], b[h]) -> [..,h]`: LayerNorm with bias.
    LayerNorm {
        /// Epsilon inside the square root.
        eps: f64,
    },
    /// `(x[..,a*b]) -> [..,a=n,b]`: view the last dim as `n` heads (no copy).
    SplitHeads {
        /// Size of the first factor.
        n: u64,
    },
    /// `(x[..,a,b]) -> [..,a*b]`: inverse of `SplitHeads` (no copy).
    MergeHeads,
    /// `(x[..,n*d]) -> n × [..,d]`: split the last dim into `n` equal parts.
    Split {
        /// Number of parts.
        n: u64,
    },
    /// `(x[b,s,heads,head_dim]) -> same`: rotary position embedding (HF's rotate_half form).
    Rope {
        /// Base frequency.
        theta: f64,
    },
    /// `(q[b,s,heads,d], k[b,s,kv_heads,d], v[b,s,kv_heads,d]) -> [b,s,heads,d]`:
    /// causal softmax attention with scale `1/sqrt(d)`, each kv head shared by `heads/kv_heads`
    /// query heads.
    CausalAttention,
    /// `(x) -> x` converted to dtype `to` (activations to bf16 under `precision = "bf16"`).
    Cast {
        /// Target dtype.
        to: crate::types::DType,
    },
    /// `(a, b) -> a + b` (same type).
    Add,
    /// `(gate, up) -> silu(gate) * up`.
    SwiGlu,
    /// `(x) -> gelu(x)` with the tanh approximation.
    GeluTanh,
    /// `(logits[b,s,vocab], labels i32[b,s]) -> f32[]`: mean next-token cross-entropy.
    CrossEntropy,
    /// `(logits[b,s,experts]) -> (weights f32[b,s,top_k], indices i32[b,s,top_k])`:
    /// softmax in f32, top-k, weights renormalised to sum to one (Mixtral).
    Router {
        /// Experts per token.
        top_k: u64,
    },
    /// `(logits[b,s,experts], indices i32[b,s,top_k]) -> f32[]`: load-balancing loss
    /// `coeff · E · Σ_e f_e · P_e` (Switch Transformer, as Megatron and transformers compute it).
    MoeAuxLoss {
        /// Loss coefficient.
        coeff: f64,
    },
    /// `(x[b,s,h], indices i32[b,s,top_k]) -> [tokens,h]`: gather the tokens routed to `expert`.
    Dispatch {
        /// Expert index.
        expert: u64,
        /// Token slots per expert; 0 means dropless (a dynamic count bounded by b·s).
        capacity: u64,
    },
    /// `(weights f32[b,s,top_k], indices i32[b,s,top_k], y_0[tokens,h], ..) -> [b,s,h]`:
    /// scatter each expert's outputs back, weighted by the router.
    Combine,
}

impl OpKind {
    /// The op's name in the text form.
    pub fn name(&self) -> &'static str {
        match self {
            OpKind::Embedding => "embedding",
            OpKind::PosEmbedding => "pos_embedding",
            OpKind::Linear { .. } => "linear",
            OpKind::RmsNorm { .. } => "rms_norm",
            OpKind::LayerNorm { .. } => "layer_norm",
            OpKind::SplitHeads { .. } => "split_heads",
            OpKind::MergeHeads => "merge_heads",
            OpKind::Split { .. } => "split",
            OpKind::Rope { .. } => "rope",
            OpKind::CausalAttention => "causal_attention",
            OpKind::Cast { .. } => "cast",
            OpKind::Add => "add",
            OpKind::SwiGlu => "swiglu",
            OpKind::GeluTanh => "gelu_tanh",
            OpKind::CrossEntropy => "cross_entropy",
            OpKind::Router { .. } => "router",
            OpKind::MoeAuxLoss { .. } => "moe_aux_loss",
            OpKind::Dispatch { .. } => "dispatch",
            OpKind::Combine => "combine",
        }
    }

    /// Attributes as `(key, value)` text pairs, in a fixed order.
    pub fn attrs(&self) -> Vec<(&'static str, String)> {
        match self {
            OpKind::Linear { weight } => vec![("w", weight.as_str().to_string())],
            OpKind::RmsNorm { eps } | OpKind::LayerNorm { eps } => vec![("eps", fmt_f64(*eps))],
            OpKind::SplitHeads { n } | OpKind::Split { n } => vec![("n", n.to_string())],
            OpKind::Rope { theta } => vec![("theta", fmt_f64(*theta))],
            OpKind::Router { top_k } => vec![("top_k", top_k.to_string())],
            OpKind::Cast { to } => vec![("to", to.as_str().to_string())],
            OpKind::MoeAuxLoss { coeff } => vec![("coeff", fmt_f64(*coeff))],
            OpKind::Dispatch { expert, capacity } => vec![
                ("expert", expert.to_string()),
                ("capacity", capacity.to_string()),
            ],
            _ => Vec::new(),
        }
    }

    /// Number of outputs the op produces.
    pub fn num_outputs(&self) -> usize {
        match self {
            OpKind::Split { n } => *n as usize,
            OpKind::Router { .. } => 2,
            _ => 1,
        }
    }
}

/// Shortest text that parses back to the same `f64`.
pub fn fmt_f64(x: f64) -> String {
    format!("{x:?}")
}
