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
}

impl Arch {
    /// The spelling used in model.toml.
    pub fn as_str(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Gpt => "gpt",
        }
    }
}

/// `[model.moe]`: mixture-of-experts MLPs (Mixtral semantics).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeSpec {
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
}

impl ModelSection {
    /// Size of one attention head.
    pub fn head_dim(&self) -> u64 {
        self.hidden / self.heads
    }

    /// Whether layer `i` (0-based) has a MoE MLP.
    pub fn is_moe_layer(&self, i: u64) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| i.is_multiple_of(m.layer_freq))
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
/// `dpp.policy`): the one home of the policy and of its priority ([`DppPolicy::breadth_first`],
/// [`dpp_priority`]), used by the pipeline schedules' reference order, the runtime's dynamic
/// execution and the simulator.
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
}

impl DppPolicy {
    /// The spelling used in model.toml and in a plan's `dpp.policy`.
    pub fn as_str(self) -> &'static str {
        match self {
            DppPolicy::Bfs => "bfs",
            DppPolicy::Dfs => "dfs",
            DppPolicy::Adaptive { .. } => "adaptive",
        }
    }

    /// The policy spelled `name` (`bfs`, `dfs`, `adaptive` with the default cap).
    pub fn from_name(name: &str) -> Option<DppPolicy> {
        match name {
            "bfs" => Some(DppPolicy::Bfs),
            "dfs" => Some(DppPolicy::Dfs),
            "adaptive" => Some(DppPolicy::Adaptive { cap: None }),
            _ => None,
        }
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
            DppPolicy::Bfs => true,
            DppPolicy::Dfs => false,
            DppPolicy::Adaptive { cap } => inflight < cap.unwrap_or(default_cap).max(1),
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

    /// Read a name (`bfs`, `dfs`, `adaptive`).
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<DppPolicy, D::Error> {
        let name = <String as serde::Deserialize>::deserialize(d)?;
        DppPolicy::from_name(&name).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "unknown dpp policy `{name}` (expected bfs, dfs or adaptive)"
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
