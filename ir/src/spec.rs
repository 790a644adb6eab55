//! IR level 1: the validated model description (`ModelSpec`).
//!
//! The frontend parses and validates `model.toml` into these types; every later stage
//! may rely on the invariants the frontend checked (divisibility of heads by tp, layers
//! by pp·vpp, and so on; see docs/model-toml.md).

use std::fmt;

/// Model family: decides norms, activations, positions and parameter names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// LlamaForCausalLM: RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases.
    Llama,
    /// GPT2LMHeadModel: LayerNorm with bias, GELU (tanh), learned positions, biases.
    Gpt,
    /// MistralForCausalLM: Llama's layer and names, with an optional sliding window.
    Mistral,
    /// Qwen2ForCausalLM: Llama's layer and names with biases on q, k and v.
    Qwen2,
    /// Qwen3ForCausalLM: Llama's layer and names with an RMSNorm over each head's q and k.
    Qwen3,
    /// Qwen2MoeForCausalLM: Qwen2's attention with MoE MLPs (`mlp.gate`, `mlp.experts.{j}.*`,
    /// a sigmoid-gated `mlp.shared_expert`); needs `[model.moe]`.
    Qwen2Moe,
}

impl Arch {
    /// The spelling used in model.toml.
    pub fn as_str(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Gpt => "gpt",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen2Moe => "qwen2_moe",
        }
    }

    /// Whether the family is built as Llama is (RMSNorm, SwiGLU, RoPE, `model.layers.*`
    /// names): every family but GPT-2.
    pub fn llama_like(self) -> bool {
        self != Arch::Gpt
    }

    /// The Hugging Face class whose parameter names and semantics the family follows.
    pub fn hf_class(self, moe: bool) -> &'static str {
        match self {
            Arch::Llama if moe => "MixtralForCausalLM",
            Arch::Llama => "LlamaForCausalLM",
            Arch::Gpt => "GPT2LMHeadModel",
            Arch::Mistral => "MistralForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Qwen2Moe => "Qwen2MoeForCausalLM",
        }
    }
}

/// `[model.rope_scaling]`: a rewrite of RoPE's inverse frequencies (transformers'
/// `ROPE_INIT_FUNCTIONS`); the attention scaling of both types is 1.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// `type = "linear"`: every inverse frequency divided by `factor` (positions / factor).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// `type = "llama3"`: Llama 3.1's rewrite (`_compute_llama3_parameters`): wavelengths
    /// above `original_max_position_embeddings / low_freq_factor` divided by `factor`, those
    /// below `original_max_position_embeddings / high_freq_factor` kept, and those between
    /// interpolated smoothly.
    Llama3 {
        /// The divisor of the low frequencies.
        factor: f64,
        /// Low-frequency bound factor.
        low_freq_factor: f64,
        /// High-frequency bound factor.
        high_freq_factor: f64,
        /// The context length the model was trained with before scaling.
        original_max_position_embeddings: f64,
    },
}

impl RopeScaling {
    /// The spelling of `type` in model.toml (and the op attribute `rope_type`).
    pub fn type_name(&self) -> &'static str {
        match self {
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
        }
    }

    /// What makes the rewrite meaningless (the frontend reports it with a location, the plan
    /// gate as the op's error): a factor or bound that is not positive and finite, or a
    /// high-frequency factor not above the low-frequency one.
    pub fn problem(&self) -> Option<String> {
        let bad = |x: f64| !(x.is_finite() && x > 0.0);
        match *self {
            RopeScaling::Linear { factor } if bad(factor) => {
                Some(format!("rope scaling factor {factor} must be positive"))
            }
            RopeScaling::Linear { .. } => None,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                for (k, v) in [
                    ("factor", factor),
                    ("low_freq_factor", low_freq_factor),
                    ("high_freq_factor", high_freq_factor),
                    (
                        "original_max_position_embeddings",
                        original_max_position_embeddings,
                    ),
                ] {
                    if bad(v) {
                        return Some(format!("rope scaling {k} {v} must be positive"));
                    }
                }
                (high_freq_factor <= low_freq_factor).then(|| {
                    format!(
                        "rope scaling high_freq_factor {high_freq_factor} must exceed low_freq_factor {low_freq_factor}"
                    )
                })
            }
        }
    }

    /// Apply the rewrite to the default inverse frequencies, in f32 as torch computes it.
    pub fn apply(&self, inv_freq: &mut [f32]) {
        match *self {
            RopeScaling::Linear { factor } => {
                let f = factor as f32;
                for x in inv_freq.iter_mut() {
                    *x /= f;
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                // transformers' `_compute_llama3_parameters` on f32 tensors: each python
                // float (bounds computed in f64) meets the tensor as an f32 scalar.
                let low_wavelen = (old / low_freq_factor) as f32;
                let high_wavelen = (old / high_freq_factor) as f32;
                let (f, lo) = (factor as f32, low_freq_factor as f32);
                let span = (high_freq_factor - low_freq_factor) as f32;
                let two_pi = (2.0 * std::f64::consts::PI) as f32;
                for x in inv_freq.iter_mut() {
                    let inv = *x;
                    let wavelen = two_pi / inv;
                    let mut scaled = if wavelen > low_wavelen { inv / f } else { inv };
                    // Neither above the low- nor below the high-frequency wavelength.
                    if wavelen >= high_wavelen && wavelen <= low_wavelen {
                        let smooth = (old as f32 / wavelen - lo) / span;
                        scaled = (1.0 - smooth) * scaled / f + smooth * scaled;
                    }
                    *x = scaled;
                }
            }
        }
    }
}

/// RoPE's inverse frequencies for heads of `d` dims (`d/2` of them), computed in f32 as
/// transformers does: `1 / theta^(arange(0, d, 2) / d)`, then `scaling`'s rewrite.
pub fn rope_inv_freq(d: usize, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f32> {
    let theta = theta as f32;
    let mut inv: Vec<f32> = (0..d / 2)
        .map(|i| 1.0f32 / theta.powf((2 * i) as f32 / d as f32))
        .collect();
    if let Some(s) = scaling {
        s.apply(&mut inv);
    }
    inv
}

/// `[model.moe]`: mixture-of-experts MLPs (Mixtral's or Qwen2-MoE's semantics).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeSpec {
    /// Intermediate size of each routed expert (`model.moe.ffn_hidden`, default the dense
    /// `model.ffn_hidden`).
    pub ffn_hidden: u64,
    /// Intermediate size of the shared expert (a dense SwiGLU MLP every token passes
    /// through); 0: none.
    pub shared_ffn_hidden: u64,
    /// Scale the shared expert's output by `sigmoid(x · w)`, `w` of shape `[1, hidden]`
    /// (Qwen2-MoE's `shared_expert_gate`).
    pub shared_expert_gate: bool,
    /// Renormalise the top-k router weights to sum to one (Mixtral; Qwen2-MoE's
    /// `norm_topk_prob`, default false there).
    pub norm_topk_prob: bool,
    /// The first `first_dense_layers` layers have a dense MLP of `model.ffn_hidden`.
    pub first_dense_layers: u64,
    /// Number of experts per MoE layer.
    pub experts: u64,
    /// Experts each token is routed to.
    pub top_k: u64,
    /// Every `layer_freq`-th layer is a MoE layer (1 = all), counting from layer 0.
    pub layer_freq: u64,
    /// Weight of the load-balancing auxiliary loss.
    pub aux_loss_coeff: f64,
    /// Expert capacity factor; 0 means dropless.
    pub capacity_factor: f64,
}

/// `[model]`: the architecture and its sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSection {
    /// Model family.
    pub arch: Arch,
    /// Number of transformer layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// Attention (query) heads.
    pub heads: u64,
    /// Key/value heads (grouped-query attention); equals `heads` for multi-head attention.
    pub kv_heads: u64,
    /// MLP intermediate size (per expert for MoE layers).
    pub ffn_hidden: u64,
    /// Vocabulary size (unpadded).
    pub vocab: u64,
    /// Sequence length of one sample.
    pub seq_len: u64,
    /// Share the embedding matrix with the output layer.
    pub tie_embeddings: bool,
    /// Epsilon of RMSNorm / LayerNorm.
    pub norm_eps: f64,
    /// RoPE base frequency (llama only).
    pub rope_theta: f64,
    /// Mixture of experts, if any.
    pub moe: Option<MoeSpec>,
    /// Size of one attention head (`model.head_dim`, default `hidden / heads`).
    pub head_dim: u64,
    /// Biases on the q, k and v projections (`model.qkv_bias`; Qwen2's default).
    pub qkv_bias: bool,
    /// An RMSNorm over each head's q and k before RoPE (`model.qk_norm`; Qwen3's default).
    pub qk_norm: bool,
    /// Sliding-window attention (`model.sliding_window`): query `q` sees keys
    /// `q-window+1 ..= q`; None: full causal attention.
    pub sliding_window: Option<u64>,
    /// `[model.rope_scaling]`, if any.
    pub rope_scaling: Option<RopeScaling>,
}

impl ModelSection {
    /// Size of one attention head.
    pub fn head_dim(&self) -> u64 {
        self.head_dim
    }

    /// Whether layer `i` (0-based) has a MoE MLP: every `layer_freq`-th layer from 0, except
    /// the first `first_dense_layers`.
    pub fn is_moe_layer(&self, i: u64) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| i >= m.first_dense_layers && i.is_multiple_of(m.layer_freq))
    }
}

/// Arithmetic precision of the training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// Everything in float32.
    Fp32,
    /// Megatron's bf16 mixed precision: bf16 working weights and activations, f32 matmul
    /// accumulation, norms, softmax and loss, f32 gradients, master weights and AdamW state.
    Bf16,
    /// The same with fp16 storage and a dynamic loss scaler (Megatron's fp16 mode).
    Fp16,
}

impl Precision {
    /// The spelling used in model.toml.
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    /// The dtype of working weights and activations.
    pub fn storage(self) -> crate::DType {
        match self {
            Precision::Fp32 => crate::DType::F32,
            Precision::Bf16 => crate::DType::Bf16,
            Precision::Fp16 => crate::DType::F16,
        }
    }
}

/// Activation recomputation policy (`train.recompute`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recompute {
    /// Keep every activation.
    None,
    /// Recompute the core attention only (Megatron's selective recomputation).
    Selective,
    /// Recompute each layer from its input.
    Full,
}

impl Recompute {
    /// The spelling used in model.toml.
    pub fn as_str(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }
}

/// `[train]`: batch, optimizer and numerics.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainSection {
    /// Samples per micro-batch on one data-parallel rank.
    pub micro_batch: u64,
    /// Samples per optimizer step over all data-parallel ranks.
    pub global_batch: u64,
    /// Optimizer steps to run.
    pub steps: u64,
    /// Seed for parameter initialisation and synthetic data.
    pub seed: u64,
    /// Arithmetic precision.
    pub precision: Precision,
    /// AdamW learning rate.
    pub lr: f64,
    /// AdamW (beta1, beta2).
    pub betas: (f64, f64),
    /// AdamW epsilon (added after the square root).
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Max global gradient L2 norm; 0 disables clipping.
    pub grad_clip: f64,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// Warmup + cosine decay of the learning rate; constant when None.
    pub lr_schedule: Option<CosineSchedule>,
    /// The fp16 loss scaler (None unless `precision = "fp16"`).
    pub loss_scaler: Option<LossScaler>,
}

/// Megatron's fp16 loss scaling: the loss gradient is multiplied by the scale, the
/// gradients divided by it before clipping; a step whose gradients overflow is skipped.
/// Dynamic (Megatron's `DynamicGradScaler`): the scale halves after `hysteresis` overflowing
/// steps (and at every one after, until a growth), never below `min_scale`, and doubles
/// after `window` clean steps in a row. Static (`train.loss_scale`): a fixed scale.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScaler {
    /// The scale of the first step (Megatron's `--initial-loss-scale`, default 2^32).
    pub initial_scale: f64,
    /// The smallest scale (`--min-loss-scale`, default 1).
    pub min_scale: f64,
    /// Clean steps in a row before the scale doubles (`--loss-scale-window`, default 1000).
    pub window: u64,
    /// Overflowing steps before the scale first halves (`--hysteresis`, default 2).
    pub hysteresis: u64,
    /// A static scale: never changes (`--loss-scale`).
    pub fixed: bool,
}

/// `train.lr_schedule = "cosine"`: linear warmup from 0, then cosine decay to `min_lr`.
#[derive(Clone, Debug, PartialEq)]
pub struct CosineSchedule {
    /// Steps of linear warmup (`train.warmup_steps`).
    pub warmup_steps: u64,
    /// Step where the decay reaches `min_lr` (`train.decay_steps`, default `steps`).
    pub decay_steps: u64,
    /// Final learning rate (`train.min_lr`).
    pub min_lr: f64,
}

impl TrainSection {
    /// Micro-batches per data-parallel rank and step.
    pub fn microbatches(&self, dp: u64) -> u64 {
        self.global_batch / (self.micro_batch * dp)
    }
}

/// Pipeline schedule (`parallel.schedule`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// All forwards, then all backwards.
    Gpipe,
    /// One-forward-one-backward.
    OneFOneB,
    /// Megatron's interleaved 1F1B over virtual stages (needs vpp > 1).
    Interleaved,
    /// Zero-bubble H1: backward split into B and W, W fills bubbles.
    ZbH1,
    /// MegaDPP: dynamic priority order over the task matrix.
    Dpp,
}

impl Schedule {
    /// The spelling used in model.toml.
    pub fn as_str(self) -> &'static str {
        match self {
            Schedule::Gpipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
            Schedule::Interleaved => "interleaved",
            Schedule::ZbH1 => "zb-h1",
            Schedule::Dpp => "dpp",
        }
    }
}

/// MegaDPP priority policy (`parallel.dpp_policy`, `megac schedule dpp-*`, a plan's
/// `dpp.policy`): the one home of the policy and of its priority ([`DppPolicy::priority`]),
/// used by the pipeline schedules' reference order, the runtime's dynamic execution and the
/// simulator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DppPolicy {
    /// All micro-batches of a chunk first (priority `(chunk, micro-batch)`).
    Bfs,
    /// One micro-batch through all chunks first (priority `(micro-batch, chunk)`).
    Dfs,
    /// Breadth-first while fewer than `cap` micro-batches are in flight on the rank,
    /// depth-first beyond.
    Adaptive {
        /// In-flight threshold; `None`: the default (`pp`, or a plan's `dpp.cap`).
        cap: Option<u32>,
    },
    /// Not MegaDPP's: the static interleaved 1F1B order (1F1B's with one chunk per rank)
    /// run out of order, the ready task placed earliest in it first. The plan's reference
    /// order is that static order, so without jitter it runs exactly it.
    Ordered,
}

impl DppPolicy {
    /// Every policy (adaptive with the default cap), in the order error messages list them.
    pub const ALL: [DppPolicy; 4] = [
        DppPolicy::Bfs,
        DppPolicy::Dfs,
        DppPolicy::Adaptive { cap: None },
        DppPolicy::Ordered,
    ];

    /// The spelling used in model.toml and in a plan's `dpp.policy`.
    pub fn as_str(self) -> &'static str {
        match self {
            DppPolicy::Bfs => "bfs",
            DppPolicy::Dfs => "dfs",
            DppPolicy::Adaptive { .. } => "adaptive",
            DppPolicy::Ordered => "ordered",
        }
    }

    /// The policy spelled `name` (`bfs`, `dfs`, `adaptive` with the default cap, `ordered`).
    pub fn from_name(name: &str) -> Option<DppPolicy> {
        DppPolicy::ALL.into_iter().find(|p| p.as_str() == name)
    }

    /// The policies' names as a list for messages: "bfs, dfs, adaptive or ordered".
    pub fn names() -> String {
        let names: Vec<&str> = DppPolicy::ALL.iter().map(|p| p.as_str()).collect();
        format!(
            "{} or {}",
            names[..names.len() - 1].join(", "),
            names[names.len() - 1]
        )
    }

    /// The in-flight cap a plan records: adaptive's cap (`default` when unset), 0 for the
    /// policies without one.
    pub fn cap_or(self, default: u32) -> u32 {
        match self {
            DppPolicy::Adaptive { cap } => cap.unwrap_or(default),
            _ => 0,
        }
    }

    /// Whether the next task is chosen breadth-first with `inflight` micro-batches in flight
    /// on the rank (forward done, backward not); `default_cap` stands for an unset adaptive
    /// cap, and a cap under 1 counts as 1.
    pub fn breadth_first(self, inflight: u32, default_cap: u32) -> bool {
        match self {
            DppPolicy::Bfs | DppPolicy::Ordered => true,
            DppPolicy::Dfs => false,
            DppPolicy::Adaptive { cap } => inflight < cap.unwrap_or(default_cap).max(1),
        }
    }

    /// The priority of ready task `t`, lowest first, with `inflight` micro-batches in flight
    /// on the rank (`default_cap` stands for an unset adaptive cap): `ordered`'s is the
    /// task's place in the reference order; MegaDPP's policies' is [`dpp_priority`].
    pub fn priority(self, inflight: u32, default_cap: u32, t: DppTask) -> (u32, u32, u32) {
        match self {
            DppPolicy::Ordered => (t.position, 0, 0),
            _ => dpp_priority(self.breadth_first(inflight, default_cap), t),
        }
    }
}

impl fmt::Display for DppPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A ready pipeline task as MegaDPP's priority sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DppTask {
    /// A backward (B, or fused BW), not a forward.
    pub backward: bool,
    /// The chunk's index among the rank's own chunks (0 = earliest in the model).
    pub local_chunk: u32,
    /// How many chunks the rank holds.
    pub local_chunks: u32,
    /// The micro-batch.
    pub microbatch: u32,
    /// Its place among the rank's tasks in the plan's reference order (`ordered` runs the
    /// lowest ready one; the other policies do not read it).
    pub position: u32,
}

/// MegaDPP's priority of a ready task, lowest first: any backward before any forward, later
/// chunks' backwards first; breadth-first orders by chunk then micro-batch, depth-first by
/// micro-batch then chunk (`breadth` from [`DppPolicy::breadth_first`]).
pub fn dpp_priority(breadth: bool, t: DppTask) -> (u32, u32, u32) {
    let (kind, chunk) = if t.backward {
        (0, t.local_chunks.saturating_sub(1 + t.local_chunk))
    } else {
        (1, t.local_chunk)
    };
    if breadth {
        (kind, chunk, t.microbatch)
    } else {
        (kind, t.microbatch, chunk)
    }
}

/// Serde for a plan's `dpp.policy`: the policy's name (its cap travels apart, as
/// `dpp.cap`); an unknown name is an error.
pub mod dpp_policy_name {
    use super::DppPolicy;

    /// Write the name.
    pub fn serialize<S: serde::Serializer>(p: &DppPolicy, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(p.as_str())
    }

    /// Read a name (`bfs`, `dfs`, `adaptive`, `ordered`).
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<DppPolicy, D::Error> {
        let name = <String as serde::Deserialize>::deserialize(d)?;
        DppPolicy::from_name(&name).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "unknown dpp policy `{name}` (expected {})",
                DppPolicy::names()
            ))
        })
    }
}

/// `[parallel]`: the parallel layout.
#[derive(Clone, Debug, PartialEq)]
pub struct ParallelSection {
    /// Tensor-parallel size.
    pub tp: u64,
    /// Pipeline-parallel size.
    pub pp: u64,
    /// Virtual pipeline chunks per pipeline rank.
    pub vpp: u64,
    /// Data-parallel size.
    pub dp: u64,
    /// Context-parallel size.
    pub cp: u64,
    /// Expert-parallel size (folds over dp·cp).
    pub ep: u64,
    /// Megatron sequence parallelism inside the tp group.
    pub sequence_parallel: bool,
    /// ZeRO-1 distributed optimizer over dp.
    pub distributed_optimizer: bool,
    /// Pipeline schedule.
    pub schedule: Schedule,
    /// MegaDPP policy (used by `schedule = "dpp"`).
    pub dpp_policy: DppPolicy,
    /// MegaFBD forward/backward decoupling.
    pub fbd: bool,
    /// How context-parallel attention exchanges keys and values.
    pub cp_comm: CpComm,
    /// Rank order: the mesh axes innermost (fastest-varying rank) first
    /// (`parallel.order`, default Megatron's `tp-cp-ep-dp-pp`).
    pub order: Vec<crate::types::Axis>,
    /// Layers per pipeline chunk, in chunk order (`parallel.stage_layers`); empty: every
    /// chunk gets `layers / (pp·vpp)`, or the cost-balanced split with `balance_stages`.
    pub stage_layers: Vec<u64>,
    /// `parallel.stage_layers = "balanced"`: split the layers by a per-layer cost estimate.
    pub balance_stages: bool,
}

/// Context-parallel attention's communication (`parallel.cp_comm`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CpComm {
    /// K/V blocks travel around the cp ring (and dK/dV in backward), merged by log-sum-exp.
    #[default]
    Ring,
    /// Every rank all-gathers K and V and reduce-scatters their gradients.
    AllGather,
}

impl ParallelSection {
    /// Size of `axis` in this layout.
    pub fn size(&self, axis: crate::types::Axis) -> u64 {
        use crate::types::Axis;
        match axis {
            Axis::Tp => self.tp,
            Axis::Cp => self.cp,
            Axis::Ep => self.ep,
            Axis::Dp => self.dp,
            Axis::Pp => self.pp,
            Axis::Fbd => {
                if self.fbd {
                    2
                } else {
                    1
                }
            }
            Axis::Edp => self.dp * self.cp / self.ep.max(1),
        }
    }

    /// Number of ranks the layout needs (each FBD stage has a forward and a backward role).
    pub fn world_size(&self) -> u64 {
        let base = self.tp * self.pp * self.dp * self.cp;
        if self.fbd {
            base * 2
        } else {
            base
        }
    }
}

/// `[cluster]`: the machine a plan is meant for (`megac plan` searches for it; a compiled
/// plan records it, and `inspect`, `simulate` and `schedule --costs model` use it).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ClusterSection {
    /// Accelerator preset name.
    pub device: String,
    /// Number of nodes.
    pub nodes: u64,
    /// Accelerators per node.
    pub gpus_per_node: u64,
}

/// The validated model.toml.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// Display name (the file stem of model.toml).
    pub name: String,
    /// `[model]`.
    pub model: ModelSection,
    /// `[train]`.
    pub train: TrainSection,
    /// `[parallel]`.
    pub parallel: ParallelSection,
    /// `[cluster]`, if given.
    pub cluster: Option<ClusterSection>,
}

impl ModelSpec {
    /// Vocabulary padded to a multiple of 128·tp, as Megatron pads it.
    pub fn padded_vocab(&self) -> u64 {
        crate::flops::padded_vocab(self.model.vocab, self.parallel.tp)
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama 3.1's rewrite at its published parameters (factor 8, 1, 4, 8192; head_dim 128,
    /// theta 500000): the high frequencies are kept, the low ones divided by 8, the band
    /// between interpolated (values from transformers 5.24's `_compute_llama3_parameters`).
    #[test]
    fn llama3_rope_scaling_matches_transformers() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let plain = rope_inv_freq(128, 500000.0, None);
        let scaled = rope_inv_freq(128, 500000.0, Some(&s));
        // transformers 5.24 (torch 2.15, f32): `_compute_llama3_parameters` of a
        // Llama-3.1-8B config, as f32 bits; megac's frequencies are bit-identical.
        #[rustfmt::skip]
        const TORCH: [u32; 64] = [
            0x3f800000, 0x3f508ac1, 0x3f29e1c6, 0x3f0a6384, 0x3ee177bc, 0x3eb7ab7d,
            0x3e959ee3, 0x3e73c461, 0x3e4693b0, 0x3e21c3a0, 0x3e03c6a0, 0x3dd6b19c,
            0x3daee4ad, 0x3d8e7898, 0x3d681e67, 0x3d3d1684, 0x3d1a08c8, 0x3cfaf53f,
            0x3ccc6f49, 0x3ca68939, 0x3c87a9c3, 0x3c5d06ec, 0x3c340d6d, 0x3c12ac7f,
            0x3beef74f, 0x3bc2aa76, 0x3b9e9402, 0x3b812e35, 0x3b527720, 0x3b0dfd06,
            0x3ab3d11d, 0x3a60979e, 0x3a0995d2, 0x39a3f108, 0x393b2dd2, 0x38c86886,
            0x38a3418d, 0x3884fdbf, 0x3858ac81, 0x38308199, 0x380fc8f8, 0x37ea426f,
            0x37bed4f4, 0x379b7475, 0x377d45c3, 0x374e51f5, 0x3728126b, 0x3708ea0f,
            0x36df10c4, 0x36b5b687, 0x369406cb, 0x36712b80, 0x36447610, 0x36200a69,
            0x36025f34, 0x35d46808, 0x35ad07a7, 0x358cf400, 0x3565a54d, 0x353b12c7,
            0x351864a7, 0x34f848c2, 0x34ca41b0, 0x34a4c2ff,
        ];
        let bits: Vec<u32> = scaled.iter().map(|x| x.to_bits()).collect();
        assert_eq!(bits, TORCH);
        // Wavelength below 8192 / 4 = 2048: unchanged.
        assert_eq!(scaled[0], plain[0]);
        assert_eq!(scaled[20], plain[20]);
        // Above 8192: divided by the factor.
        assert_eq!(scaled[63], plain[63] / 8.0);
        // Between: strictly between the two.
        let mid = (0..64)
            .find(|&i| {
                let w = 2.0 * std::f32::consts::PI / plain[i];
                (2048.0..=8192.0).contains(&w)
            })
            .unwrap();
        assert!(scaled[mid] < plain[mid] && scaled[mid] > plain[mid] / 8.0);
        let lin = rope_inv_freq(16, 10000.0, Some(&RopeScaling::Linear { factor: 2.0 }));
        let base = rope_inv_freq(16, 10000.0, None);
        assert!(lin.iter().zip(&base).all(|(a, b)| *a == b / 2.0));
    }

    #[test]
    fn rope_scaling_problems_are_named() {
        let bad = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 4.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        assert!(bad.problem().unwrap().contains("high_freq_factor"));
        assert!(RopeScaling::Linear { factor: 0.0 }.problem().is_some());
        assert!(RopeScaling::Linear { factor: 2.0 }.problem().is_none());
    }
}
