//! Operations of the Graph IR: kernel-sized, each with its attributes.

use crate::spec::RopeScaling;

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
    /// `(x_1[..,d], .., x_n[..,d]) -> [..,n*d]`: inverse of `Split`.
    Concat,
    /// `(x[b,s,heads,head_dim]) -> same`: rotary position embedding (HF's rotate_half form).
    Rope {
        /// Base frequency.
        theta: f64,
        /// The rewrite of the inverse frequencies (`[model.rope_scaling]`), if any.
        scaling: Option<crate::spec::RopeScaling>,
    },
    /// `(q[b,s,heads,d], k[b,s,kv_heads,d], v[b,s,kv_heads,d]) -> (out[b,s,heads,d],
    /// lse f32[b,heads,s])`: causal softmax attention with scale `1/sqrt(d)`, each kv head shared
    /// by `heads/kv_heads` query heads; `lse` is the log-sum-exp of each query's scores, kept
    /// for the backward pass. With `window > 0` (a sliding window, Mistral's) query `i` sees
    /// only keys `i-window+1 ..= i`.
    CausalAttention {
        /// Keys each query sees, itself included; 0: every earlier key (plain causal).
        window: u64,
    },
    /// KV-cache decoding (plan-level only, never in a graph): `(x[b,s,heads,head_dim],
    /// pos i32[1]) -> same`: `rope` with row `i` at position `pos[0] + shard + i`, where
    /// `shard` is the rows of the rank's sequence shards before its own (the step's
    /// position, a data input the runtime writes before each step).
    RopeAt {
        /// Base frequency.
        theta: f64,
        /// The rewrite of the inverse frequencies, if any.
        scaling: Option<crate::spec::RopeScaling>,
    },
    /// KV-cache decoding (plan-level only): `(x[b,s,h], wpe[positions,h], pos i32[1]) ->
    /// [b,s,h]`: adds learned position `pos[0] + shard + i` to row `i` (rows at or past
    /// the table's end are padding and take its last row).
    PosEmbeddingAt,
    /// KV-cache decoding (plan-level only): `(q[1,s,heads,d], k[1,s,kv_heads,d],
    /// v[1,s,kv_heads,d], pos i32[1]) -> (out[1,s,heads,d], lse f32[1,heads,s],
    /// cache_k[positions,kv_heads,d], cache_v[positions,kv_heads,d])`: writes the rows' keys
    /// and values into the caches at their positions `pos[0] + shard + i` (rows at or past
    /// `positions` are padding and are not written; every other cache row keeps its value:
    /// the caches are updated in place), then attends each row's query at position `p` to
    /// the cached keys `0 ..= p` (within `window` when it is positive), as
    /// `causal_attention` over the whole prefix.
    KvAttention {
        /// Keys each query sees, itself included; 0: every earlier key.
        window: u64,
    },
    /// `(x) -> x` converted to dtype `to` (activations to bf16 under `precision = "bf16"`).
    Cast {
        /// Target dtype.
        to: crate::types::DType,
    },
    /// `(x[b,s,kv_heads,d]) -> [b,s,heads,d]`: each key/value head repeated `n` times in
    /// place (transformers' `repeat_kv`), so attention can be split over more tensor-parallel
    /// ranks than there are key/value heads.
    RepeatKv {
        /// Query heads per key/value head.
        n: u64,
    },
    /// `(dy[b,s,heads,d]) -> dx[b,s,kv_heads,d]`: the sum over each head's `n` repeats.
    RepeatKvGrad {
        /// Query heads per key/value head.
        n: u64,
    },
    /// `(a, b) -> a + b` (same type).
    Add,
    /// `(x[..,n], bias[n]) -> x + bias` (the bias of a row-parallel linear, added once after
    /// its partial sums are reduced).
    BiasAdd,
    /// `(gate, up) -> silu(gate) * up`.
    SwiGlu,
    /// `(x) -> gelu(x)` with the tanh approximation.
    GeluTanh,
    /// `(gate[.., 1], y[.., h]) -> sigmoid(gate) * y`: Qwen2-MoE's shared-expert gate (one
    /// logit per token scales that token's row).
    SigmoidMul,
    /// `(logits[b,s,vocab], labels i32[b,s]) -> f32[]`: mean next-token cross-entropy.
    CrossEntropy,
    /// `(logits[b,s,experts]) -> (weights f32[b,s,top_k], indices i32[b,s,top_k])`:
    /// softmax in f32 over all experts, top-k, weights renormalised to sum to one
    /// (Mixtral) when `renorm`, else the top-k probabilities as they are (Qwen2-MoE's default).
    Router {
        /// Experts per token.
        top_k: u64,
        /// Renormalise the top-k weights (attribute `renorm = 0` when false).
        renorm: bool,
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
    /// `(x[b,s,h], indices i32[b,s,top_k]) -> (y[experts,tokens,h], counts i32[experts])`:
    /// [`OpKind::Dispatch`] for every expert at once, stacked (the expert-parallel form; the
    /// rows of expert `e` past `counts[e]` are zero). `counts` sizes the all-to-all.
    DispatchExperts {
        /// Number of experts.
        experts: u64,
        /// Token slots per expert; 0 means dropless.
        capacity: u64,
    },
    /// `(weights, indices, y[experts,tokens,h]) -> [b,s,h]`: [`OpKind::Combine`] of stacked
    /// expert outputs.
    CombineExperts,
    /// `(x) -> x` copied into a probe buffer that stays live to the end of the forward, read
    /// by `megac scope` (inserted by the `probe` pass). `name` is the probe point
    /// (`layers.0.out`); `part` names which operand of a computed point it is (`q`, `k` of
    /// `attn.probs`), empty otherwise.
    Probe {
        /// The probe point.
        name: String,
        /// The part of a computed point (empty: the point itself).
        part: String,
    },
    /// `(x[, replacement]) -> y`: `x` perturbed (inserted by the `perturb` pass right after
    /// the op that writes the point; every reader of the point reads `y`). Seeded: the random
    /// stream is a function of `seed` and `point` (training: also the step and micro-batch).
    Perturb {
        /// The point (`layers.0.out`, `weights.NAME`): names the random stream.
        point: String,
        /// What is done.
        action: PerturbAction,
        /// The user's seed.
        seed: u64,
        /// Only the first `tokens` positions of the first sample (0: every element).
        tokens: u64,
        /// Only in this 1-based training step (0: every step).
        step: u64,
        /// A training perturbation: the stream also depends on the step and micro-batch.
        train: bool,
    },

    // ---- Backward ops (generated by autodiff). Each gives the gradient contributions of
    // ---- its forward op's operands; `GradSum` adds contributions to the same value.
    /// `(tokens, table, dy[b,s,h]) -> dtable`: scatter-add rows.
    EmbeddingGrad,
    /// `(wpe, dy[b,s,h]) -> dwpe`: sum of `dy` over the batch, per position.
    PosEmbeddingGrad,
    /// `(dy[..,out], w) -> dx[..,in]`: input gradient of `Linear` (the "B" of zero-bubble).
    LinearGradInput {
        /// Storage order of the weight.
        weight: WeightLayout,
    },
    /// `(x[..,in], dy[..,out]) -> dw`: weight gradient of `Linear` (the "W" of zero-bubble).
    LinearGradWeight {
        /// Storage order of the weight.
        weight: WeightLayout,
    },
    /// `(dy[..,out]) -> dbias[out]`: bias gradient (sum over all leading dims).
    BiasGrad,
    /// `(x, w, dy) -> (dx, dw)`: RMSNorm backward (recomputes the normaliser).
    RmsNormGrad {
        /// Epsilon of the forward op.
        eps: f64,
    },
    /// `(x, w, dy) -> (dx, dw, db)`: LayerNorm backward (recomputes mean and normaliser).
    LayerNormGrad {
        /// Epsilon of the forward op.
        eps: f64,
    },
    /// `(dy) -> dx`: RoPE backward (rotation by the opposite angle).
    RopeGrad {
        /// Base frequency of the forward op.
        theta: f64,
        /// The forward op's frequency rewrite.
        scaling: Option<crate::spec::RopeScaling>,
    },
    /// `(q, k, v, out, lse, dout) -> (dq, dk, dv)`: causal attention backward.
    AttentionGrad {
        /// The forward op's sliding window (0: none).
        window: u64,
    },
    /// `(gate, up, dy) -> (dgate, dup)`.
    SwiGluGrad,
    /// `(gate, y, dout) -> (dgate, dy)`: backward of [`OpKind::SigmoidMul`].
    SigmoidMulGrad,
    /// `(x, dy) -> dx`.
    GeluTanhGrad,
    /// `(logits, labels) -> dlogits`: gradient of the mean cross-entropy over all tokens
    /// (`(softmax - onehot) / tokens`).
    CrossEntropyGrad,
    /// `(a, b) -> a + b`: sums two gradient contributions to the same value.
    GradSum,
    /// `(logits, dweights) -> dlogits`: router backward (softmax, top-k, renormalisation).
    RouterGrad {
        /// Experts per token.
        top_k: u64,
        /// As the forward's.
        renorm: bool,
    },
    /// `(logits, indices) -> dlogits`: gradient of the load-balancing loss.
    MoeAuxLossGrad {
        /// Loss coefficient.
        coeff: f64,
    },
    /// `(dy[tokens,h], indices) -> dx[b,s,h]`: scatter expert `expert`'s token gradients back.
    DispatchGrad {
        /// Expert index.
        expert: u64,
    },
    /// `(weights, indices, y_0, .., y_{E-1}, dout) -> (dweights, dy_0, .., dy_{E-1})`.
    CombineGrad,
    /// `(dy[experts,tokens,h], indices) -> dx[b,s,h]`: backward of
    /// [`OpKind::DispatchExperts`].
    DispatchExpertsGrad,
    /// `(weights, indices, y[experts,tokens,h], dout) -> (dweights, dy[experts,tokens,h])`.
    CombineExpertsGrad,

    // ---- Collectives (inserted by the shard pass). `axes` name the mesh axes of the group.
    /// `(x) -> x` summed over the group (Partial -> Replicate).
    AllReduce {
        /// Mesh axes of the group.
        axes: Vec<crate::types::Axis>,
    },
    /// `(x) -> x` concatenated over the group along `dim` (Shard -> Replicate).
    AllGather {
        /// Mesh axes of the group.
        axes: Vec<crate::types::Axis>,
        /// The dim that is gathered.
        dim: u64,
    },
    /// `(x) -> x` with each member keeping only its slice of `dim` (Replicate -> Shard, no
    /// communication).
    Slice {
        /// Mesh axes of the group.
        axes: Vec<crate::types::Axis>,
        /// The dim that is sliced.
        dim: u64,
    },
    /// `(x) -> x` summed over the group, each member keeping its slice of `dim`
    /// (Partial -> Shard).
    ReduceScatter {
        /// Mesh axes of the group.
        axes: Vec<crate::types::Axis>,
        /// The dim that is scattered.
        dim: u64,
    },
    /// `(x[experts,tokens,h], counts i32[experts]) -> x`: all-to-all of variable split sizes
    /// (expert parallelism). Member i's slice `i` of dim `split` goes to member i, and what
    /// each member receives is concatenated along dim `concat`. Only the first `counts[e]`
    /// token rows of each expert travel (`counts` are the sender's local counts; the members
    /// exchange them first), packed in member order; the rest is zero. `split = 0, concat = 1`
    /// dispatches tokens to their experts' ranks, `split = 1, concat = 0` brings them back.
    AllToAll {
        /// Mesh axes of the group.
        axes: Vec<crate::types::Axis>,
        /// The dim whose slices are sent to the members.
        split: u64,
        /// The dim along which received slices are concatenated.
        concat: u64,
    },

    // ---- Optimizer ops.
    /// `(g_1, .., g_n) -> f32[]`: global L2 norm of all gradients; each rank sums the squares
    /// of what it holds and the sums are added over the group `axes` (empty: local).
    GradNorm {
        /// Mesh axes over which the squared sums are added.
        axes: Vec<crate::types::Axis>,
    },
    /// `(p, g, norm) -> p'`: clip by `max_norm / (norm + 1e-6)` when below 1 (torch's
    /// clip_grad_norm_; `max_norm = 0` disables clipping), then one torch.optim.AdamW step.
    /// The moments `exp_avg`, `exp_avg_sq` are the op's state, one pair per parameter; with
    /// `master` (a 16-bit working weight under mixed precision) so is an f32 master copy,
    /// which the step updates and then rounds into the working weight.
    AdamW {
        /// Base learning rate (the plan's schedule scales it per step).
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Added to the denominator after the square root.
        eps: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
        /// Gradient clipping threshold on the global norm.
        max_norm: f64,
        /// The step updates an f32 master copy (the plan instruction's fourth output) and
        /// rounds it into the 16-bit working weight.
        master: bool,
    },
}

/// What a `perturb` op does to its operand (docs/scope.md).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PerturbAction {
    /// Gaussian noise of standard deviation `sigma` times the tensor's RMS.
    Noise(f64),
    /// Multiply by a factor.
    Scale(f64),
    /// Flip one random bit of the field (first bit, bit count) with probability `rate`.
    Bitflip {
        /// The field's lowest bit (sign 31, exponent 23, mantissa 0).
        first: u32,
        /// The field's bits (1, 8, 23).
        count: u32,
        /// The probability per element.
        rate: f64,
    },
    /// Zero global query head `head` of a `[b, s, heads, d]` tensor.
    ZeroHead(u64),
    /// Replace the values by the op's second operand (activation patching).
    Patch,
}

impl PerturbAction {
    /// The kind's name in the text form.
    pub fn name(&self) -> &'static str {
        match self {
            PerturbAction::Noise(_) => "noise",
            PerturbAction::Scale(_) => "scale",
            PerturbAction::Bitflip { .. } => "bitflip",
            PerturbAction::ZeroHead(_) => "zero-head",
            PerturbAction::Patch => "patch",
        }
    }
}

/// Every op name, for error messages.
pub const OP_NAMES: &[&str] = &[
    "embedding",
    "pos_embedding",
    "linear",
    "rms_norm",
    "layer_norm",
    "split_heads",
    "merge_heads",
    "split",
    "concat",
    "rope",
    "causal_attention",
    "rope_at",
    "pos_embedding_at",
    "kv_attention",
    "cast",
    "add",
    "swiglu",
    "gelu_tanh",
    "cross_entropy",
    "router",
    "moe_aux_loss",
    "dispatch",
    "combine",
    "dispatch_experts",
    "combine_experts",
    "embedding_grad",
    "pos_embedding_grad",
    "linear_grad_input",
    "linear_grad_weight",
    "bias_grad",
    "rms_norm_grad",
    "layer_norm_grad",
    "rope_grad",
    "attention_grad",
    "swiglu_grad",
    "gelu_tanh_grad",
    "cross_entropy_grad",
    "grad_sum",
    "router_grad",
    "moe_aux_loss_grad",
    "dispatch_grad",
    "combine_grad",
    "dispatch_experts_grad",
    "combine_experts_grad",
    "grad_norm",
    "adamw",
    "repeat_kv",
    "repeat_kv_grad",
    "bias_add",
    "all_reduce",
    "all_gather",
    "slice",
    "reduce_scatter",
    "all_to_all",
    "probe",
    "perturb",
];

/// How many buffers a kernel instruction of an op reads and writes in a plan (`adamw` also
/// writes its two moments there, so its outputs differ from the graph op's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arity {
    /// The fewest inputs.
    pub min_inputs: usize,
    /// The most inputs (`usize::MAX`: any number).
    pub max_inputs: usize,
    /// The outputs, for the number of inputs the arity was asked for.
    pub outputs: usize,
}

impl Arity {
    /// Exactly `inputs` inputs and `outputs` outputs.
    const fn exactly(inputs: usize, outputs: usize) -> Arity {
        Arity {
            min_inputs: inputs,
            max_inputs: inputs,
            outputs,
        }
    }

    /// Whether an instruction with these operand counts fits.
    pub fn accepts(&self, inputs: usize, outputs: usize) -> bool {
        (self.min_inputs..=self.max_inputs).contains(&inputs) && outputs == self.outputs
    }

    /// The input count the op takes nearest to `inputs` (what an error message names).
    pub fn inputs_near(&self, inputs: usize) -> usize {
        inputs.clamp(self.min_inputs, self.max_inputs)
    }
}

/// Which dim of an operand a kernel's implicit collective follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitDim {
    /// The dim at this index (the sequence dim of `[b, s, ..]` is 1).
    At(usize),
    /// The operand's last dim (the vocabulary of `logits[.., vocab]`).
    Last,
}

impl SplitDim {
    /// The dim's index in an operand of `rank` dims (`None` when it has no such dim).
    pub fn index(self, rank: usize) -> Option<usize> {
        match self {
            SplitDim::At(d) => (d < rank).then_some(d),
            SplitDim::Last => rank.checked_sub(1),
        }
    }
}

/// A collective a kernel makes inside itself (no collective op in the graph): when its
/// operand `operand` is split along `dim` over the mesh axis `axis`, the kernel reduces
/// statistics or exchanges keys over that axis's group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImplicitCollective {
    /// The mesh axis whose group the kernel communicates over.
    pub axis: crate::types::Axis,
    /// The operand whose split decides it.
    pub operand: usize,
    /// The operand's dim that is split.
    pub dim: SplitDim,
}

impl ImplicitCollective {
    /// Whether an operand with this per-dim layout (the mesh axes sharding each dim) is split
    /// so that the kernel communicates.
    pub fn applies(&self, layout: &[Vec<crate::types::Axis>]) -> bool {
        self.dim
            .index(layout.len())
            .is_some_and(|d| layout[d].contains(&self.axis))
    }
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
            OpKind::Concat => "concat",
            OpKind::Rope { .. } => "rope",
            OpKind::CausalAttention { .. } => "causal_attention",
            OpKind::RopeAt { .. } => "rope_at",
            OpKind::PosEmbeddingAt => "pos_embedding_at",
            OpKind::KvAttention { .. } => "kv_attention",
            OpKind::Cast { .. } => "cast",
            OpKind::RepeatKv { .. } => "repeat_kv",
            OpKind::RepeatKvGrad { .. } => "repeat_kv_grad",
            OpKind::Add => "add",
            OpKind::BiasAdd => "bias_add",
            OpKind::SwiGlu => "swiglu",
            OpKind::SigmoidMul => "sigmoid_mul",
            OpKind::GeluTanh => "gelu_tanh",
            OpKind::CrossEntropy => "cross_entropy",
            OpKind::Router { .. } => "router",
            OpKind::MoeAuxLoss { .. } => "moe_aux_loss",
            OpKind::Dispatch { .. } => "dispatch",
            OpKind::Combine => "combine",
            OpKind::DispatchExperts { .. } => "dispatch_experts",
            OpKind::CombineExperts => "combine_experts",
            OpKind::DispatchExpertsGrad => "dispatch_experts_grad",
            OpKind::CombineExpertsGrad => "combine_experts_grad",
            OpKind::AllToAll { .. } => "all_to_all",
            OpKind::EmbeddingGrad => "embedding_grad",
            OpKind::PosEmbeddingGrad => "pos_embedding_grad",
            OpKind::LinearGradInput { .. } => "linear_grad_input",
            OpKind::LinearGradWeight { .. } => "linear_grad_weight",
            OpKind::BiasGrad => "bias_grad",
            OpKind::RmsNormGrad { .. } => "rms_norm_grad",
            OpKind::LayerNormGrad { .. } => "layer_norm_grad",
            OpKind::RopeGrad { .. } => "rope_grad",
            OpKind::AttentionGrad { .. } => "attention_grad",
            OpKind::SwiGluGrad => "swiglu_grad",
            OpKind::SigmoidMulGrad => "sigmoid_mul_grad",
            OpKind::GeluTanhGrad => "gelu_tanh_grad",
            OpKind::CrossEntropyGrad => "cross_entropy_grad",
            OpKind::GradSum => "grad_sum",
            OpKind::RouterGrad { .. } => "router_grad",
            OpKind::MoeAuxLossGrad { .. } => "moe_aux_loss_grad",
            OpKind::DispatchGrad { .. } => "dispatch_grad",
            OpKind::CombineGrad => "combine_grad",
            OpKind::AllReduce { .. } => "all_reduce",
            OpKind::AllGather { .. } => "all_gather",
            OpKind::ReduceScatter { .. } => "reduce_scatter",
            OpKind::Slice { .. } => "slice",
            OpKind::GradNorm { .. } => "grad_norm",
            OpKind::AdamW { .. } => "adamw",
            OpKind::Probe { .. } => "probe",
            OpKind::Perturb { .. } => "perturb",
        }
    }

    /// Whether this is a backward op (generated by autodiff): the gradient kernels and
    /// `grad_sum`. Recomputation and the simulator split a micro-batch's program at the first.
    pub fn is_backward(&self) -> bool {
        match self {
            OpKind::EmbeddingGrad
            | OpKind::PosEmbeddingGrad
            | OpKind::LinearGradInput { .. }
            | OpKind::LinearGradWeight { .. }
            | OpKind::BiasGrad
            | OpKind::RmsNormGrad { .. }
            | OpKind::LayerNormGrad { .. }
            | OpKind::RopeGrad { .. }
            | OpKind::AttentionGrad { .. }
            | OpKind::SwiGluGrad
            | OpKind::SigmoidMulGrad
            | OpKind::GeluTanhGrad
            | OpKind::CrossEntropyGrad
            | OpKind::GradSum
            | OpKind::RouterGrad { .. }
            | OpKind::MoeAuxLossGrad { .. }
            | OpKind::DispatchGrad { .. }
            | OpKind::CombineGrad
            | OpKind::DispatchExpertsGrad
            | OpKind::CombineExpertsGrad
            | OpKind::RepeatKvGrad { .. } => true,
            OpKind::Embedding
            | OpKind::PosEmbedding
            | OpKind::Linear { .. }
            | OpKind::RmsNorm { .. }
            | OpKind::LayerNorm { .. }
            | OpKind::SplitHeads { .. }
            | OpKind::MergeHeads
            | OpKind::Split { .. }
            | OpKind::Concat
            | OpKind::Rope { .. }
            | OpKind::CausalAttention { .. }
            | OpKind::RopeAt { .. }
            | OpKind::PosEmbeddingAt
            | OpKind::KvAttention { .. }
            | OpKind::Cast { .. }
            | OpKind::RepeatKv { .. }
            | OpKind::Add
            | OpKind::BiasAdd
            | OpKind::SwiGlu
            | OpKind::SigmoidMul
            | OpKind::GeluTanh
            | OpKind::CrossEntropy
            | OpKind::Router { .. }
            | OpKind::MoeAuxLoss { .. }
            | OpKind::Dispatch { .. }
            | OpKind::Combine
            | OpKind::DispatchExperts { .. }
            | OpKind::CombineExperts
            | OpKind::AllReduce { .. }
            | OpKind::AllGather { .. }
            | OpKind::Slice { .. }
            | OpKind::ReduceScatter { .. }
            | OpKind::AllToAll { .. }
            | OpKind::GradNorm { .. }
            | OpKind::AdamW { .. }
            | OpKind::Probe { .. }
            | OpKind::Perturb { .. } => false,
        }
    }

    /// Whether the kernel adds into its outputs instead of overwriting them (so codegen
    /// zeroes them first): every backward op, since a gradient may have several
    /// contributions.
    pub fn accumulates(&self) -> bool {
        self.is_backward()
    }

    /// The operand counts of this op's kernel instruction when it has `inputs` inputs (the
    /// variadic ops: `concat` and `grad_norm` take any number, `grad_sum` one or two,
    /// `linear` an optional bias, `combine` one expert output per expert, `combine_grad` one
    /// expert gradient out per expert output in).
    pub fn kernel_arity(&self, inputs: usize) -> Arity {
        match self {
            OpKind::Concat | OpKind::GradNorm { .. } => Arity {
                min_inputs: 0,
                max_inputs: usize::MAX,
                outputs: 1,
            },
            OpKind::GradSum => Arity {
                min_inputs: 1,
                max_inputs: 2,
                outputs: 1,
            },
            OpKind::Linear { .. } => Arity {
                min_inputs: 2,
                max_inputs: 3,
                outputs: 1,
            },
            OpKind::Combine => Arity {
                min_inputs: 3,
                max_inputs: usize::MAX,
                outputs: 1,
            },
            // (weights, indices, y_0, .., y_{E-1}, dout) -> (dweights, dy_0, .., dy_{E-1})
            OpKind::CombineGrad => Arity {
                min_inputs: 4,
                max_inputs: usize::MAX,
                outputs: inputs.max(4) - 2,
            },
            OpKind::Split { n } => Arity::exactly(1, *n as usize),
            OpKind::Perturb { action, .. } => Arity::exactly(
                if *action == PerturbAction::Patch {
                    2
                } else {
                    1
                },
                1,
            ),
            OpKind::AttentionGrad { .. } => Arity::exactly(6, 3),
            OpKind::CombineExpertsGrad => Arity::exactly(4, 2),
            OpKind::AdamW { master: true, .. } => Arity::exactly(3, 4),
            OpKind::LayerNormGrad { .. } | OpKind::AdamW { .. } => Arity::exactly(3, 3),
            OpKind::CausalAttention { .. } => Arity::exactly(3, 2),
            OpKind::KvAttention { .. } => Arity::exactly(4, 4),
            OpKind::PosEmbeddingAt => Arity::exactly(3, 1),
            OpKind::RopeAt { .. } => Arity::exactly(2, 1),
            OpKind::RmsNormGrad { .. } | OpKind::SwiGluGrad | OpKind::SigmoidMulGrad => {
                Arity::exactly(3, 2)
            }
            OpKind::LayerNorm { .. } | OpKind::EmbeddingGrad | OpKind::CombineExperts => {
                Arity::exactly(3, 1)
            }
            OpKind::DispatchExperts { .. } => Arity::exactly(2, 2),
            OpKind::Router { .. } => Arity::exactly(1, 2),
            OpKind::Embedding
            | OpKind::PosEmbedding
            | OpKind::RmsNorm { .. }
            | OpKind::Add
            | OpKind::BiasAdd
            | OpKind::SwiGlu
            | OpKind::SigmoidMul
            | OpKind::CrossEntropy
            | OpKind::PosEmbeddingGrad
            | OpKind::LinearGradInput { .. }
            | OpKind::LinearGradWeight { .. }
            | OpKind::GeluTanhGrad
            | OpKind::CrossEntropyGrad
            | OpKind::RouterGrad { .. }
            | OpKind::MoeAuxLoss { .. }
            | OpKind::MoeAuxLossGrad { .. }
            | OpKind::Dispatch { .. }
            | OpKind::DispatchGrad { .. }
            | OpKind::DispatchExpertsGrad
            | OpKind::AllToAll { .. } => Arity::exactly(2, 1),
            OpKind::SplitHeads { .. }
            | OpKind::MergeHeads
            | OpKind::Rope { .. }
            | OpKind::RopeGrad { .. }
            | OpKind::Cast { .. }
            | OpKind::RepeatKv { .. }
            | OpKind::RepeatKvGrad { .. }
            | OpKind::GeluTanh
            | OpKind::BiasGrad
            | OpKind::AllReduce { .. }
            | OpKind::AllGather { .. }
            | OpKind::Slice { .. }
            | OpKind::ReduceScatter { .. }
            | OpKind::Probe { .. } => Arity::exactly(1, 1),
        }
    }

    /// Whether the op is a view of its operand's storage (no copy, never an instruction):
    /// `split_heads`, `merge_heads`.
    pub fn is_view(&self) -> bool {
        matches!(self, OpKind::SplitHeads { .. } | OpKind::MergeHeads)
    }

    /// The collective this kernel makes inside itself when its operand is split (see
    /// [`ImplicitCollective`]): cross-entropy over a vocab split on tp, attention and the
    /// load-balancing loss over a sequence split on cp. `None` for every other op (the
    /// collective ops communicate explicitly over their `axes`).
    pub fn implicit_collective(&self) -> Option<ImplicitCollective> {
        use crate::types::Axis;
        match self {
            OpKind::CrossEntropy | OpKind::CrossEntropyGrad => Some(ImplicitCollective {
                axis: Axis::Tp,
                operand: 0,
                dim: SplitDim::Last,
            }),
            OpKind::CausalAttention { .. }
            | OpKind::AttentionGrad { .. }
            | OpKind::MoeAuxLoss { .. }
            | OpKind::MoeAuxLossGrad { .. } => Some(ImplicitCollective {
                axis: Axis::Cp,
                operand: 0,
                dim: SplitDim::At(1),
            }),
            _ => None,
        }
    }

    /// Attributes as `(key, value)` text pairs, in a fixed order.
    pub fn attrs(&self) -> Vec<(&'static str, String)> {
        match self {
            OpKind::Linear { weight }
            | OpKind::LinearGradInput { weight }
            | OpKind::LinearGradWeight { weight } => vec![("w", weight.as_str().to_string())],
            OpKind::RmsNorm { eps }
            | OpKind::LayerNorm { eps }
            | OpKind::RmsNormGrad { eps }
            | OpKind::LayerNormGrad { eps } => vec![("eps", fmt_f64(*eps))],
            OpKind::SplitHeads { n }
            | OpKind::Split { n }
            | OpKind::RepeatKv { n }
            | OpKind::RepeatKvGrad { n } => vec![("n", n.to_string())],
            OpKind::Rope { theta, scaling }
            | OpKind::RopeGrad { theta, scaling }
            | OpKind::RopeAt { theta, scaling } => {
                let mut a = vec![("theta", fmt_f64(*theta))];
                match scaling {
                    None => {}
                    Some(RopeScaling::Linear { factor }) => {
                        a.push(("rope_type", "linear".to_string()));
                        a.push(("factor", fmt_f64(*factor)));
                    }
                    Some(RopeScaling::Llama3 {
                        factor,
                        low_freq_factor,
                        high_freq_factor,
                        original_max_position_embeddings,
                    }) => {
                        a.push(("rope_type", "llama3".to_string()));
                        a.push(("factor", fmt_f64(*factor)));
                        a.push(("low_freq_factor", fmt_f64(*low_freq_factor)));
                        a.push(("high_freq_factor", fmt_f64(*high_freq_factor)));
                        a.push((
                            "original_max_position_embeddings",
                            fmt_f64(*original_max_position_embeddings),
                        ));
                    }
                }
                a
            }
            OpKind::Router { top_k, renorm } | OpKind::RouterGrad { top_k, renorm } => {
                let mut a = vec![("top_k", top_k.to_string())];
                if !renorm {
                    a.push(("renorm", "0".to_string()));
                }
                a
            }
            OpKind::CausalAttention { window }
            | OpKind::AttentionGrad { window }
            | OpKind::KvAttention { window }
                if *window > 0 =>
            {
                vec![("window", window.to_string())]
            }
            OpKind::Cast { to } => vec![("to", to.as_str().to_string())],
            OpKind::MoeAuxLoss { coeff } | OpKind::MoeAuxLossGrad { coeff } => {
                vec![("coeff", fmt_f64(*coeff))]
            }
            OpKind::Dispatch { expert, capacity } => vec![
                ("expert", expert.to_string()),
                ("capacity", capacity.to_string()),
            ],
            OpKind::DispatchGrad { expert } => vec![("expert", expert.to_string())],
            OpKind::DispatchExperts { experts, capacity } => vec![
                ("experts", experts.to_string()),
                ("capacity", capacity.to_string()),
            ],
            OpKind::AllToAll {
                axes,
                split,
                concat,
            } => vec![
                ("axes", axes_text(axes)),
                ("split", split.to_string()),
                ("concat", concat.to_string()),
            ],
            OpKind::AllReduce { axes } => vec![("axes", axes_text(axes))],
            OpKind::AllGather { axes, dim }
            | OpKind::ReduceScatter { axes, dim }
            | OpKind::Slice { axes, dim } => {
                vec![("axes", axes_text(axes)), ("dim", dim.to_string())]
            }
            OpKind::GradNorm { axes } if !axes.is_empty() => vec![("axes", axes_text(axes))],
            OpKind::Probe { name, part } => {
                let mut a = vec![("name", name.clone())];
                if !part.is_empty() {
                    a.push(("part", part.clone()));
                }
                a
            }
            OpKind::Perturb {
                point,
                action,
                seed,
                tokens,
                step,
                train,
            } => {
                let mut a = vec![
                    ("point", point.clone()),
                    ("kind", action.name().to_string()),
                ];
                match action {
                    PerturbAction::Noise(x) | PerturbAction::Scale(x) => a.push(("x", fmt_f64(*x))),
                    PerturbAction::Bitflip { first, count, rate } => {
                        a.push(("first", first.to_string()));
                        a.push(("count", count.to_string()));
                        a.push(("rate", fmt_f64(*rate)));
                    }
                    PerturbAction::ZeroHead(h) => a.push(("head", h.to_string())),
                    PerturbAction::Patch => {}
                }
                a.push(("seed", seed.to_string()));
                if *tokens > 0 {
                    a.push(("tokens", tokens.to_string()));
                }
                if *step > 0 {
                    a.push(("step", step.to_string()));
                }
                if *train {
                    a.push(("train", "1".to_string()));
                }
                a
            }
            OpKind::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                max_norm,
                master,
            } => {
                let mut a = vec![
                    ("lr", fmt_f64(*lr)),
                    ("beta1", fmt_f64(*beta1)),
                    ("beta2", fmt_f64(*beta2)),
                    ("eps", fmt_f64(*eps)),
                    ("weight_decay", fmt_f64(*weight_decay)),
                    ("max_norm", fmt_f64(*max_norm)),
                ];
                if *master {
                    a.push(("master", "1".to_string()));
                }
                a
            }
            _ => Vec::new(),
        }
    }

    /// Build an op from its text name and attributes (`attr(key)` looks one up).
    /// The error says what is missing or malformed.
    pub fn from_text(name: &str, attr: &dyn Fn(&str) -> Option<String>) -> Result<OpKind, String> {
        let get = |key: &str| attr(key).ok_or_else(|| format!("{name} needs attribute `{key}`"));
        let num = |key: &str| -> Result<u64, String> {
            let v = get(key)?;
            v.parse()
                .map_err(|_| format!("attribute {key}={v} is not an unsigned integer"))
        };
        let float = |key: &str| -> Result<f64, String> {
            let v = get(key)?;
            v.parse()
                .map_err(|_| format!("attribute {key}={v} is not a number"))
        };
        let layout = || -> Result<WeightLayout, String> {
            let w = get("w")?;
            WeightLayout::from_name(&w)
                .ok_or_else(|| format!("attribute w={w}: expected out_in or in_out"))
        };
        let window = || -> Result<u64, String> {
            match attr("window") {
                None => Ok(0),
                Some(v) => v
                    .parse()
                    .map_err(|_| format!("attribute window={v} is not an unsigned integer")),
            }
        };
        let renorm = || -> Result<bool, String> {
            match attr("renorm").as_deref() {
                None | Some("1") => Ok(true),
                Some("0") => Ok(false),
                Some(v) => Err(format!("attribute renorm={v}: expected 0 or 1")),
            }
        };
        let rope_scaling = || -> Result<Option<RopeScaling>, String> {
            Ok(match attr("rope_type").as_deref() {
                None => None,
                Some("linear") => Some(RopeScaling::Linear {
                    factor: float("factor")?,
                }),
                Some("llama3") => Some(RopeScaling::Llama3 {
                    factor: float("factor")?,
                    low_freq_factor: float("low_freq_factor")?,
                    high_freq_factor: float("high_freq_factor")?,
                    original_max_position_embeddings: float("original_max_position_embeddings")?,
                }),
                Some(t) => {
                    return Err(format!(
                        "attribute rope_type={t}: expected linear or llama3"
                    ))
                }
            })
        };
        Ok(match name {
            "embedding" => OpKind::Embedding,
            "pos_embedding" => OpKind::PosEmbedding,
            "linear" => OpKind::Linear { weight: layout()? },
            "rms_norm" => OpKind::RmsNorm { eps: float("eps")? },
            "layer_norm" => OpKind::LayerNorm { eps: float("eps")? },
            "split_heads" => OpKind::SplitHeads { n: num("n")? },
            "merge_heads" => OpKind::MergeHeads,
            "split" => OpKind::Split { n: num("n")? },
            "concat" => OpKind::Concat,
            "rope" => OpKind::Rope {
                theta: float("theta")?,
                scaling: rope_scaling()?,
            },
            "causal_attention" => OpKind::CausalAttention { window: window()? },
            "rope_at" => OpKind::RopeAt {
                theta: float("theta")?,
                scaling: rope_scaling()?,
            },
            "pos_embedding_at" => OpKind::PosEmbeddingAt,
            "kv_attention" => OpKind::KvAttention { window: window()? },
            "cast" => {
                let to = get("to")?;
                OpKind::Cast {
                    to: crate::types::DType::from_name(&to)
                        .ok_or_else(|| format!("attribute to={to}: unknown dtype"))?,
                }
            }
            "add" => OpKind::Add,
            "repeat_kv" => OpKind::RepeatKv { n: num("n")? },
            "repeat_kv_grad" => OpKind::RepeatKvGrad { n: num("n")? },
            "bias_add" => OpKind::BiasAdd,
            "swiglu" => OpKind::SwiGlu,
            "sigmoid_mul" => OpKind::SigmoidMul,
            "gelu_tanh" => OpKind::GeluTanh,
            "cross_entropy" => OpKind::CrossEntropy,
            "router" => OpKind::Router {
                top_k: num("top_k")?,
                renorm: renorm()?,
            },
            "moe_aux_loss" => OpKind::MoeAuxLoss {
                coeff: float("coeff")?,
            },
            "dispatch" => OpKind::Dispatch {
                expert: num("expert")?,
                capacity: num("capacity")?,
            },
            "combine" => OpKind::Combine,
            "dispatch_experts" => OpKind::DispatchExperts {
                experts: num("experts")?,
                capacity: num("capacity")?,
            },
            "combine_experts" => OpKind::CombineExperts,
            "dispatch_experts_grad" => OpKind::DispatchExpertsGrad,
            "combine_experts_grad" => OpKind::CombineExpertsGrad,
            "all_to_all" => OpKind::AllToAll {
                axes: axes(get("axes")?)?,
                split: num("split")?,
                concat: num("concat")?,
            },
            "embedding_grad" => OpKind::EmbeddingGrad,
            "pos_embedding_grad" => OpKind::PosEmbeddingGrad,
            "linear_grad_input" => OpKind::LinearGradInput { weight: layout()? },
            "linear_grad_weight" => OpKind::LinearGradWeight { weight: layout()? },
            "bias_grad" => OpKind::BiasGrad,
            "rms_norm_grad" => OpKind::RmsNormGrad { eps: float("eps")? },
            "layer_norm_grad" => OpKind::LayerNormGrad { eps: float("eps")? },
            "rope_grad" => OpKind::RopeGrad {
                theta: float("theta")?,
                scaling: rope_scaling()?,
            },
            "attention_grad" => OpKind::AttentionGrad { window: window()? },
            "swiglu_grad" => OpKind::SwiGluGrad,
            "sigmoid_mul_grad" => OpKind::SigmoidMulGrad,
            "gelu_tanh_grad" => OpKind::GeluTanhGrad,
            "cross_entropy_grad" => OpKind::CrossEntropyGrad,
            "grad_sum" => OpKind::GradSum,
            "router_grad" => OpKind::RouterGrad {
                top_k: num("top_k")?,
                renorm: renorm()?,
            },
            "moe_aux_loss_grad" => OpKind::MoeAuxLossGrad {
                coeff: float("coeff")?,
            },
            "dispatch_grad" => OpKind::DispatchGrad {
                expert: num("expert")?,
            },
            "combine_grad" => OpKind::CombineGrad,
            "all_reduce" => OpKind::AllReduce {
                axes: axes(get("axes")?)?,
            },
            "all_gather" => OpKind::AllGather {
                axes: axes(get("axes")?)?,
                dim: num("dim")?,
            },
            "slice" => OpKind::Slice {
                axes: axes(get("axes")?)?,
                dim: num("dim")?,
            },
            "reduce_scatter" => OpKind::ReduceScatter {
                axes: axes(get("axes")?)?,
                dim: num("dim")?,
            },
            "grad_norm" => OpKind::GradNorm {
                axes: match attr("axes") {
                    Some(a) => axes(a)?,
                    None => Vec::new(),
                },
            },
            "probe" => OpKind::Probe {
                name: get("name")?,
                part: attr("part").unwrap_or_default(),
            },
            "perturb" => {
                let opt =
                    |key: &str| -> Result<u64, String> { attr(key).map_or(Ok(0), |_| num(key)) };
                let kind = get("kind")?;
                let action = match kind.as_str() {
                    "noise" => PerturbAction::Noise(float("x")?),
                    "scale" => PerturbAction::Scale(float("x")?),
                    "bitflip" => PerturbAction::Bitflip {
                        first: num("first")? as u32,
                        count: num("count")? as u32,
                        rate: float("rate")?,
                    },
                    "zero-head" => PerturbAction::ZeroHead(num("head")?),
                    "patch" => PerturbAction::Patch,
                    other => return Err(format!("attribute kind={other}: unknown perturbation")),
                };
                OpKind::Perturb {
                    point: get("point")?,
                    action,
                    seed: num("seed")?,
                    tokens: opt("tokens")?,
                    step: opt("step")?,
                    train: opt("train")? == 1,
                }
            }
            "adamw" => OpKind::AdamW {
                lr: float("lr")?,
                beta1: float("beta1")?,
                beta2: float("beta2")?,
                eps: float("eps")?,
                weight_decay: float("weight_decay")?,
                max_norm: float("max_norm")?,
                master: match attr("master").as_deref() {
                    None | Some("0") => false,
                    Some("1") => true,
                    Some(v) => return Err(format!("adamw: master must be 0 or 1, got `{v}`")),
                },
            },
            _ => return Err(format!("unknown op `{name}`")),
        })
    }
}

/// `[tp, dp]` -> `tp+dp`.
pub fn axes_text(axes: &[crate::types::Axis]) -> String {
    axes.iter()
        .map(|a| a.as_str())
        .collect::<Vec<_>>()
        .join("+")
}

/// `tp+dp` -> `[tp, dp]`.
fn axes(text: String) -> Result<Vec<crate::types::Axis>, String> {
    text.split('+')
        .map(|a| crate::types::Axis::from_name(a).ok_or_else(|| format!("unknown mesh axis `{a}`")))
        .collect()
}

/// Shortest text that parses back to the same `f64`.
pub fn fmt_f64(x: f64) -> String {
    format!("{x:?}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Axis;

    /// A valid value for every attribute key, so every name parses.
    fn any_attr(key: &str) -> Option<String> {
        if key == "rope_type" {
            // Optional (RoPE without scaling); the scaled forms have their own test.
            return None;
        }
        Some(
            match key {
                "w" => "out_in",
                "to" => "f32",
                "kind" => "noise",
                "x" | "rate" => "0.5",
                "axes" => "tp",
                "eps" | "theta" | "coeff" | "lr" | "beta1" | "beta2" | "weight_decay"
                | "max_norm" => "0.5",
                _ => "1",
            }
            .to_string(),
        )
    }

    /// Rope's optional scaling attributes print and parse back.
    #[test]
    fn rope_scaling_attributes_round_trip() {
        for scaling in [
            None,
            Some(RopeScaling::Linear { factor: 2.0 }),
            Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            }),
        ] {
            for op in [
                OpKind::Rope {
                    theta: 5e5,
                    scaling,
                },
                OpKind::RopeGrad {
                    theta: 5e5,
                    scaling,
                },
            ] {
                let attrs = op.attrs();
                assert_eq!(
                    attrs.len(),
                    1 + usize::from(scaling.is_some())
                        * match scaling {
                            Some(RopeScaling::Linear { .. }) => 2,
                            _ => 5,
                        }
                );
                let get = |k: &str| attrs.iter().find(|(a, _)| *a == k).map(|(_, v)| v.clone());
                assert_eq!(OpKind::from_text(op.name(), &get).unwrap(), op);
            }
        }
        let bad = |k: &str| {
            (k == "rope_type")
                .then(|| "yarn".to_string())
                .or(Some("1".into()))
        };
        assert!(OpKind::from_text("rope", &bad)
            .unwrap_err()
            .contains("rope_type=yarn"));
    }

    /// Every op, parsed from `OP_NAMES`.
    fn every_op() -> Vec<OpKind> {
        OP_NAMES
            .iter()
            .map(|n| OpKind::from_text(n, &any_attr).unwrap_or_else(|e| panic!("{n}: {e}")))
            .collect()
    }

    /// The expected properties, written out per variant (an exhaustive match, so a new
    /// variant must be added here): (backward, implicit collective as (axis, dim)).
    fn expected(op: &OpKind) -> (bool, Option<(Axis, SplitDim)>) {
        let cp = Some((Axis::Cp, SplitDim::At(1)));
        match op {
            OpKind::Embedding => (false, None),
            OpKind::PosEmbedding => (false, None),
            OpKind::Linear { .. } => (false, None),
            OpKind::RmsNorm { .. } => (false, None),
            OpKind::LayerNorm { .. } => (false, None),
            OpKind::SplitHeads { .. } => (false, None),
            OpKind::MergeHeads => (false, None),
            OpKind::Split { .. } => (false, None),
            OpKind::Concat => (false, None),
            OpKind::Rope { .. } => (false, None),
            OpKind::CausalAttention { .. } => (false, cp),
            OpKind::RopeAt { .. } => (false, None),
            OpKind::PosEmbeddingAt => (false, None),
            OpKind::KvAttention { .. } => (false, None),
            OpKind::Cast { .. } => (false, None),
            OpKind::RepeatKv { .. } => (false, None),
            OpKind::RepeatKvGrad { .. } => (true, None),
            OpKind::Add => (false, None),
            OpKind::BiasAdd => (false, None),
            OpKind::SwiGlu => (false, None),
            OpKind::SigmoidMul => (false, None),
            OpKind::GeluTanh => (false, None),
            OpKind::CrossEntropy => (false, Some((Axis::Tp, SplitDim::Last))),
            OpKind::Router { .. } => (false, None),
            OpKind::MoeAuxLoss { .. } => (false, cp),
            OpKind::Dispatch { .. } => (false, None),
            OpKind::Combine => (false, None),
            OpKind::DispatchExperts { .. } => (false, None),
            OpKind::CombineExperts => (false, None),
            OpKind::EmbeddingGrad => (true, None),
            OpKind::PosEmbeddingGrad => (true, None),
            OpKind::LinearGradInput { .. } => (true, None),
            OpKind::LinearGradWeight { .. } => (true, None),
            OpKind::BiasGrad => (true, None),
            OpKind::RmsNormGrad { .. } => (true, None),
            OpKind::LayerNormGrad { .. } => (true, None),
            OpKind::RopeGrad { .. } => (true, None),
            OpKind::AttentionGrad { .. } => (true, cp),
            OpKind::SwiGluGrad => (true, None),
            OpKind::SigmoidMulGrad => (true, None),
            OpKind::GeluTanhGrad => (true, None),
            OpKind::CrossEntropyGrad => (true, Some((Axis::Tp, SplitDim::Last))),
            OpKind::GradSum => (true, None),
            OpKind::RouterGrad { .. } => (true, None),
            OpKind::MoeAuxLossGrad { .. } => (true, cp),
            OpKind::DispatchGrad { .. } => (true, None),
            OpKind::CombineGrad => (true, None),
            OpKind::DispatchExpertsGrad => (true, None),
            OpKind::CombineExpertsGrad => (true, None),
            OpKind::AllReduce { .. } => (false, None),
            OpKind::AllGather { .. } => (false, None),
            OpKind::Slice { .. } => (false, None),
            OpKind::ReduceScatter { .. } => (false, None),
            OpKind::AllToAll { .. } => (false, None),
            OpKind::GradNorm { .. } => (false, None),
            OpKind::AdamW { .. } => (false, None),
            OpKind::Probe { .. } => (false, None),
            OpKind::Perturb { .. } => (false, None),
        }
    }

    /// The number of `OpKind` variants (the arms of `expected`).
    const VARIANTS: usize = 56;

    #[test]
    fn op_names_name_every_variant_once() {
        let ops = every_op();
        assert_eq!(ops.len(), VARIANTS, "OP_NAMES must list every variant");
        let mut names: Vec<&str> = ops.iter().map(|o| o.name()).collect();
        assert_eq!(names, OP_NAMES, "from_text(name).name() round-trips");
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), VARIANTS, "names are unique");
    }

    #[test]
    fn backward_and_accumulating_ops_match_the_table() {
        for op in every_op() {
            let (backward, _) = expected(&op);
            assert_eq!(op.is_backward(), backward, "{}", op.name());
            assert_eq!(op.accumulates(), backward, "{}", op.name());
        }
    }

    /// The kernel arity of each op in a plan with a fixed count: (name, inputs, outputs);
    /// `split` has `n = 1` output as `every_op` parses it.
    const FIXED_ARITY: &[(&str, usize, usize)] = &[
        ("embedding", 2, 1),
        ("pos_embedding", 2, 1),
        ("rms_norm", 2, 1),
        ("layer_norm", 3, 1),
        ("split_heads", 1, 1),
        ("merge_heads", 1, 1),
        ("split", 1, 1),
        ("rope", 1, 1),
        ("causal_attention", 3, 2),
        ("cast", 1, 1),
        ("add", 2, 1),
        ("swiglu", 2, 1),
        ("gelu_tanh", 1, 1),
        ("cross_entropy", 2, 1),
        ("router", 1, 2),
        ("moe_aux_loss", 2, 1),
        ("dispatch", 2, 1),
        ("dispatch_experts", 2, 2),
        ("combine_experts", 3, 1),
        ("embedding_grad", 3, 1),
        ("pos_embedding_grad", 2, 1),
        ("linear_grad_input", 2, 1),
        ("linear_grad_weight", 2, 1),
        ("bias_grad", 1, 1),
        ("rms_norm_grad", 3, 2),
        ("layer_norm_grad", 3, 3),
        ("rope_grad", 1, 1),
        ("attention_grad", 6, 3),
        ("swiglu_grad", 3, 2),
        ("gelu_tanh_grad", 2, 1),
        ("cross_entropy_grad", 2, 1),
        ("router_grad", 2, 1),
        ("moe_aux_loss_grad", 2, 1),
        ("dispatch_grad", 2, 1),
        ("dispatch_experts_grad", 2, 1),
        ("combine_experts_grad", 4, 2),
        // `any_attr` sets `master`: the working weight, moments and the f32 master copy.
        ("adamw", 3, 4),
        ("repeat_kv", 1, 1),
        ("repeat_kv_grad", 1, 1),
        ("bias_add", 2, 1),
        ("all_reduce", 1, 1),
        ("all_gather", 1, 1),
        ("slice", 1, 1),
        ("reduce_scatter", 1, 1),
        ("all_to_all", 2, 1),
        ("rope_at", 2, 1),
        ("pos_embedding_at", 3, 1),
        ("kv_attention", 4, 4),
        ("probe", 1, 1),
        // `any_attr` gives `noise`: one operand (`patch` takes its replacement too).
        ("perturb", 1, 1),
    ];

    /// The ops whose input count varies.
    const VARIADIC: &[&str] = &[
        "linear",
        "concat",
        "grad_sum",
        "combine",
        "combine_grad",
        "grad_norm",
    ];

    #[test]
    fn adamw_without_a_master_has_three_outputs() {
        let mut op = OpKind::from_text("adamw", &any_attr).unwrap();
        let OpKind::AdamW { master, .. } = &mut op else {
            panic!("not adamw");
        };
        *master = false;
        assert_eq!(op.kernel_arity(3), Arity::exactly(3, 3));
        // The text form omits `master` when false and round-trips it when true.
        assert!(!op.attrs().iter().any(|(k, _)| *k == "master"));
    }

    #[test]
    fn kernel_arity_matches_the_table() {
        for op in every_op() {
            let a = op.kernel_arity(0);
            let fixed = FIXED_ARITY.iter().find(|(n, ..)| *n == op.name());
            assert_ne!(
                fixed.is_some(),
                VARIADIC.contains(&op.name()),
                "{}",
                op.name()
            );
            match fixed {
                Some(&(_, i, o)) => {
                    assert_eq!(a, Arity::exactly(i, o), "{}", op.name());
                    assert!(a.accepts(i, o) && !a.accepts(i + 1, o) && !a.accepts(i, o + 1));
                }
                None => assert!(a.max_inputs > a.min_inputs, "{}", op.name()),
            }
        }
        let linear = OpKind::Linear {
            weight: WeightLayout::OutIn,
        };
        assert!(linear.kernel_arity(3).accepts(3, 1));
        assert!(!linear.kernel_arity(4).accepts(4, 1));
        assert_eq!(linear.kernel_arity(7).inputs_near(7), 3);
        assert!(OpKind::GradSum.kernel_arity(1).accepts(1, 1));
        assert!(!OpKind::GradSum.kernel_arity(3).accepts(3, 1));
        assert!(OpKind::Concat.kernel_arity(5).accepts(5, 1));
        // Two experts: (weights, indices, y0, y1, dout) -> (dweights, dy0, dy1).
        assert!(OpKind::CombineGrad.kernel_arity(5).accepts(5, 3));
        assert!(!OpKind::CombineGrad.kernel_arity(5).accepts(5, 2));
        assert!(!OpKind::CombineGrad.kernel_arity(3).accepts(3, 1));
        assert!(OpKind::Combine.kernel_arity(4).accepts(4, 1));
        assert!(!OpKind::Combine.kernel_arity(2).accepts(2, 1));
    }

    #[test]
    fn views_are_the_head_reshapes() {
        let views: Vec<&str> = every_op()
            .iter()
            .filter(|o| o.is_view())
            .map(|o| o.name())
            .collect();
        assert_eq!(views, ["split_heads", "merge_heads"]);
    }

    #[test]
    fn implicit_collectives_match_the_table() {
        for op in every_op() {
            let (_, want) = expected(&op);
            let got = op.implicit_collective();
            assert_eq!(got.map(|c| (c.axis, c.dim)), want, "{}", op.name());
            if let Some(c) = got {
                assert_eq!(c.operand, 0, "{}", op.name());
            }
        }
    }

    #[test]
    fn implicit_collective_applies_to_the_split_dim_only() {
        let ce = OpKind::CrossEntropy.implicit_collective().unwrap();
        assert!(ce.applies(&[vec![], vec![], vec![Axis::Tp]]));
        assert!(!ce.applies(&[vec![Axis::Tp], vec![], vec![]]));
        assert!(!ce.applies(&[]));
        let attn = OpKind::CausalAttention { window: 0 }
            .implicit_collective()
            .unwrap();
        assert!(attn.applies(&[vec![], vec![Axis::Cp], vec![], vec![]]));
        assert!(!attn.applies(&[vec![Axis::Cp]]));
        assert_eq!(SplitDim::Last.index(0), None);
        assert_eq!(SplitDim::At(1).index(2), Some(1));
    }
}
