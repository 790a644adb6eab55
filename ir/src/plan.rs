//! IR level 5: the Plan, the only contract between compiler and runtime.
//!
//! A plan holds per-role programs (instruction streams of kernel calls over a buffer table),
//! the static memory plan (every buffer has an offset in the arena of its class), the
//! parameter map (Hugging Face name, shape, initialisation) and the facts the runtime needs
//! about batches and the optimizer. It is written as JSON (`plan.json`); a runtime reads any
//! plan of the same `schema_version`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::op::OpKind;
use crate::types::DType;

/// Version of the plan format; bump on any incompatible change.
pub const SCHEMA_VERSION: u32 = 1;

/// Index of a buffer in `Plan::buffers`.
pub type BufId = u32;

/// The whole plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Plan format version ([`SCHEMA_VERSION`]).
    pub schema_version: u32,
    /// Model name.
    pub model: String,
    /// Architecture (`llama` or `gpt`), for Hugging Face interop.
    pub arch: String,
    /// Device mesh (axis sizes in rank order); decides every rank's groups.
    pub mesh: crate::mesh::Mesh,
    /// How context-parallel attention exchanges keys and values.
    #[serde(default)]
    pub cp_comm: crate::spec::CpComm,
    /// Batch geometry.
    pub batch: BatchInfo,
    /// Optimizer and run settings.
    pub train: TrainInfo,
    /// Every buffer any program touches.
    pub buffers: Vec<Buffer>,
    /// Trainable parameters in declaration order.
    pub params: Vec<ParamEntry>,
    /// Rank roles; ranks running the same program share a role.
    pub roles: Vec<Role>,
    /// `rank_to_role[r]` is rank r's role.
    pub rank_to_role: Vec<u32>,
    /// Bytes per arena, the static memory plan's result.
    pub memory: MemoryPlan,
    /// Model FLOPs per optimizer step (Megatron's formula).
    pub flops_per_step: f64,
    /// The `[cluster]` of the model.toml it was compiled from: what `inspect`, `simulate`
    /// and `schedule --costs model` cost it on unless `--cluster` overrides it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<crate::spec::ClusterSection>,
    /// What the plan runs: a training step (the default, not written) or a forward-only
    /// inference (no gradients, no optimizer state, no optimizer program).
    #[serde(default, skip_serializing_if = "PlanKind::is_train")]
    pub kind: PlanKind,
    /// KV-cache decoding (an inference plan of `megac generate`, `codegen::kv`): the
    /// geometry of one decode step and the step's position input. The micro-batch program
    /// (or the chunks' forwards) is then the prefill, which fills the caches from position
    /// 0, and each role's [`Role::decode`] (or the chunks' [`ChunkProgram::decode`]) runs
    /// one step. None in every other plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<DecodeInfo>,
}

/// The decode steps of a KV-cache plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecodeInfo {
    /// One step's batch geometry: `seq_len` is the rows per step (the block: one token per
    /// tensor-parallel rank, the first row real, the others padding); `micro_batch` 1.
    pub batch: BatchInfo,
    /// The step's position: an `i32[1]` input buffer the runtime writes before the prefill
    /// (0) and before each step (the position of the block's first row), read by `rope_at`,
    /// `pos_embedding_at` and `kv_attention`.
    pub position: BufId,
}

/// What a plan runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanKind {
    /// Training: forward, backward and the optimizer step.
    #[default]
    Train,
    /// Forward only (`megac compile --inference`, `megac generate`): the micro-batch program
    /// is the forward up to the loss; parameters have no gradient or optimizer state.
    Inference,
}

impl PlanKind {
    /// Whether this is a training plan (the default, which plan.json leaves out).
    pub fn is_train(&self) -> bool {
        *self == PlanKind::Train
    }

    /// The kind's name as plan.json writes it.
    pub fn name(self) -> &'static str {
        match self {
            PlanKind::Train => "train",
            PlanKind::Inference => "inference",
        }
    }
}

/// Batch geometry of one optimizer step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BatchInfo {
    /// Samples per micro-batch.
    pub micro_batch: u64,
    /// Samples per step over all data-parallel ranks.
    pub global_batch: u64,
    /// Tokens per sample.
    pub seq_len: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Micro-batches per step and data-parallel rank.
    pub microbatches: u64,
    /// Tokens per step (the mean of the loss is over these).
    pub tokens_per_step: u64,
}

/// Learning-rate schedule.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LrSchedule {
    /// The base rate at every step.
    Constant,
    /// Linear warmup from 0 over `warmup_steps`, then cosine decay to `min_lr` at `decay_steps`
    /// (constant `min_lr` afterwards).
    Cosine {
        /// Steps of linear warmup.
        warmup_steps: u64,
        /// Step at which the decay reaches `min_lr`.
        decay_steps: u64,
        /// Final learning rate.
        min_lr: f64,
    },
}

impl LrSchedule {
    /// Learning rate of 1-based `step` for base rate `lr`.
    pub fn lr_at(&self, lr: f64, step: u64) -> f64 {
        match self {
            LrSchedule::Constant => lr,
            LrSchedule::Cosine {
                warmup_steps,
                decay_steps,
                min_lr,
            } => {
                if step <= *warmup_steps {
                    lr * step as f64 / (*warmup_steps).max(1) as f64
                } else if step >= *decay_steps {
                    *min_lr
                } else {
                    let span = (decay_steps - warmup_steps).max(1) as f64;
                    let t = (step - warmup_steps) as f64 / span;
                    min_lr + 0.5 * (lr - min_lr) * (1.0 + (std::f64::consts::PI * t).cos())
                }
            }
        }
    }
}

/// Optimizer and run settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainInfo {
    /// Default number of steps for `megac run`.
    pub steps: u64,
    /// Seed for initialisation and synthetic data.
    pub seed: u64,
    /// Base learning rate.
    pub lr: f64,
    /// Learning-rate schedule.
    pub lr_schedule: LrSchedule,
    /// `fp32`, `bf16` or `fp16`.
    pub precision: String,
    /// fp16's loss scaler (absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scaler: Option<crate::spec::LossScaler>,
}

/// What a buffer holds, which decides its arena and lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferClass {
    /// Parameters (fp32 master weights), persistent.
    Param,
    /// Parameter gradients, persistent, zeroed at each step and accumulated over micro-batches.
    Grad,
    /// Optimizer state (AdamW moments), persistent.
    OptState,
    /// Per-micro-batch activations and their gradients, placed by the memory planner.
    Activation,
    /// Data fed by the loader (token ids and labels, i32).
    Input,
    /// KV-cache decoding: the keys and values of every position so far, per attention
    /// layer, persistent between steps (written only by `kv_attention`).
    KvCache,
}

impl BufferClass {
    /// The class's arena index, `0..6` (per-class tables: sizes, needs).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The class's name as plan.json writes it (`param`, `opt_state`, ...).
    pub fn name(self) -> &'static str {
        match self {
            BufferClass::Param => "param",
            BufferClass::Grad => "grad",
            BufferClass::OptState => "opt_state",
            BufferClass::Activation => "activation",
            BufferClass::Input => "input",
            BufferClass::KvCache => "kv_cache",
        }
    }
}

/// One buffer: where it lives and what shape it has.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Buffer {
    /// Name for people: the IR value (`%42`), or `grad:NAME`, `exp_avg:NAME`, ...
    pub name: String,
    /// Arena.
    pub class: BufferClass,
    /// Element type.
    pub dtype: DType,
    /// Sizes (local to the rank, micro-batch sized).
    pub shape: Vec<u64>,
    /// Offset from the start of the class's arena, in elements of this buffer's dtype (byte
    /// offset / dtype size; pipeline activations: from the start of their chunk's slot).
    pub offset: u64,
    /// How the buffer's dims are sharded over mesh axes (empty: replicated); kernels whose
    /// meaning depends on it (vocab-parallel embedding and cross-entropy, the gradient norm)
    /// read it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layout: Vec<Vec<crate::types::Axis>>,
    /// For buffers that hold each rank's own slice (the distributed optimizer's shards):
    /// the rank's coordinate along this axis times this stride is added to `offset`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_offset: Option<RankOffset>,
    /// In a pipelined plan, the pipeline rank (stage) that holds the buffer; other stages
    /// allocate nothing for it. None: every rank holds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<u32>,
    /// For activations of a pipeline chunk: the chunk. `offset` is then relative to one of
    /// the chunk's activation slots (see [`ChunkProgram`]), chosen per micro-batch at run time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk: Option<u32>,
    /// For MoE token rows (`[.., rows, h]` with rows sized for every token choosing the
    /// expert, or the capacity): the rows of each expert block that a balanced router fills,
    /// `top_k / experts` of the source tokens. `simulate` costs kernels and all-to-alls on
    /// this many rows (as a grouped GEMM over the routed tokens runs); the CPU backend
    /// computes over the whole block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_rows: Option<u64>,
    /// For a plan input that is a pending sum over these mesh axes (the replacement of a
    /// `patch` perturbation at a point that is one, as a row-parallel linear's output before
    /// its all-reduce): the runtime fills the part of the rank at coordinate 0 along them
    /// with the values and the others' with zeros. Empty for every other buffer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partial: Vec<crate::types::Axis>,
}

/// A rank-dependent offset: `index · stride` elements, where `index` is the rank's position
/// in its group over `axis` and `with` (its coordinate along `axis` when `with` is empty).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankOffset {
    /// The mesh axis whose coordinate selects the slice.
    pub axis: crate::types::Axis,
    /// More axes of the group the slices are spread over (the distributed optimizer's dp·cp
    /// group: `axis` dp, `with` [cp]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub with: Vec<crate::types::Axis>,
    /// Elements per coordinate step.
    pub stride: u64,
}

impl RankOffset {
    /// Every axis of the group.
    pub fn axes(&self) -> Vec<crate::types::Axis> {
        std::iter::once(self.axis)
            .chain(self.with.iter().copied())
            .collect()
    }

    /// The number of slices: the group's size.
    pub fn count(&self, mesh: &crate::mesh::Mesh) -> u64 {
        if self.with.is_empty() {
            mesh.size(self.axis)
        } else {
            mesh.group(0, &self.axes()).len() as u64
        }
    }

    /// `rank`'s slice: its position in its group (rank order).
    pub fn index(&self, mesh: &crate::mesh::Mesh, rank: usize) -> u64 {
        if self.with.is_empty() {
            return mesh.coord(rank, self.axis) as u64;
        }
        let group = mesh.group(rank, &self.axes());
        group.iter().position(|&r| r == rank).unwrap_or(0) as u64
    }
}

impl Buffer {
    /// Number of elements (saturating at `u64::MAX`; [`Buffer::check_extent`] rejects such
    /// buffers in a plan read from a file).
    pub fn len(&self) -> u64 {
        self.shape.iter().fold(1u64, |n, &d| n.saturating_mul(d))
    }

    /// Check that `routed_rows` is at most the buffer's rows, and that its element count, its
    /// end (`offset + len`) and its farthest rank-dependent end fit in `u64` on `mesh`, as
    /// every size computation assumes.
    pub fn check_extent(&self, mesh: &crate::mesh::Mesh) -> Result<(), String> {
        if let Some(routed) = self.routed_rows {
            let rows = self.shape.len().checked_sub(2).map(|i| self.shape[i]);
            if rows.is_none_or(|rows| routed > rows) {
                return Err(format!(
                    "routed_rows {routed} exceeds the rows of shape {:?} (its second-to-last dim)",
                    self.shape
                ));
            }
        }
        let len = self
            .shape
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .ok_or_else(|| format!("shape {:?} has more than 2^64 elements", self.shape))?;
        let far = match &self.rank_offset {
            Some(r) => (r.count(mesh).max(1) - 1).checked_mul(r.stride),
            None => Some(0),
        };
        far.and_then(|f| f.checked_add(self.offset))
            .and_then(|e| e.checked_add(len))
            .map(|_| ())
            .ok_or_else(|| {
                format!(
                    "offset {} + {len} elements (and its rank offset) is past 2^64",
                    self.offset
                )
            })
    }

    /// True for zero-element buffers.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// End (in elements, from the arena's start) at the rank farthest along the buffer's
    /// rank-dependent offset: what the arena must hold for it on every rank.
    pub fn far_end(&self, mesh: &crate::mesh::Mesh) -> u64 {
        let far = self
            .rank_offset
            .as_ref()
            .map_or(0, |r| (r.count(mesh).max(1) - 1) * r.stride);
        self.offset + far + self.len()
    }
}

/// How a parameter is initialised without `--init`: per global element from
/// (seed, parameter name), so every layout starts from the same weights.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Init {
    /// Normal with mean 0 and this standard deviation.
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// All ones (norm weights).
    Ones,
    /// All zeros (biases).
    Zeros,
}

/// A trainable parameter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamEntry {
    /// Hugging Face name.
    pub name: String,
    /// Global shape (the vocabulary padded for tensor parallelism where it applies).
    pub shape: Vec<u64>,
    /// Rows of dim 0 that Hugging Face stores, when `shape` pads the vocabulary (the rest are
    /// zero padding, dropped on save and filled with zeros on load).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hf_rows: Option<u64>,
    /// Per dim, the mesh axes that shard it (a dim named `k*rest` is sharded block-wise:
    /// each of its k blocks is split); empty when replicated.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<Vec<crate::types::Axis>>,
    /// Per dim, the number of blocks a sharded dim is split block-wise into (GPT-2's fused
    /// `c_attn` is `3*heads*head_dim`: each of q, k, v is split); empty means 1 everywhere.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blocks: Vec<u64>,
    /// For stacked experts (expert parallelism: dim 0 is the experts dim, split over ep):
    /// the Hugging Face name of expert `j`'s tensor with `{}` for `j`. Hugging Face stores
    /// one tensor per expert (`shape[1..]`), and each is initialised as that tensor, so
    /// every layout starts from the same weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_expert: Option<String>,
    /// The parameter's buffer.
    pub buffer: BufId,
    /// Its gradient (None in an inference plan).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad: Option<BufId>,
    /// AdamW first moment (None with the distributed optimizer, whose state is one flat shard).
    pub exp_avg: Option<BufId>,
    /// AdamW second moment (None with the distributed optimizer).
    pub exp_avg_sq: Option<BufId>,
    /// The f32 master copy of a 16-bit working weight under mixed precision (None in fp32
    /// plans and with the distributed optimizer, whose master copy is one flat shard).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master: Option<BufId>,
    /// Initialisation.
    pub init: Init,
    /// Copies of a tied parameter on other pipeline stages (GPT-2's word embeddings, read by
    /// the head on the last stage): initialised and loaded like `buffer`, refreshed from it
    /// after every optimizer step; not saved.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tied_copies: Vec<BufId>,
}

/// One instruction of a program.
#[derive(Clone, Debug, PartialEq)]
pub enum Instr {
    /// Run a kernel. Gradient kernels accumulate (`+=`) into their outputs; `adamw` takes
    /// `outputs = [param, exp_avg, exp_avg_sq]` and updates them in place.
    Kernel {
        /// The op.
        op: OpKind,
        /// Operand buffers.
        inputs: Vec<BufId>,
        /// Result buffers.
        outputs: Vec<BufId>,
        /// Provenance path.
        path: String,
    },
    /// Set a buffer to zero (before a kernel accumulates into it).
    Zero {
        /// The buffer.
        buffer: BufId,
    },
    /// Pipeline transfer: send `buffer` of the current micro-batch to the rank that holds
    /// `chunk` (same coordinates but the pipeline one). Non-blocking: the data is copied.
    Send {
        /// The buffer sent.
        buffer: BufId,
        /// The chunk (virtual stage) that receives it.
        chunk: u32,
        /// Plan-wide id of the transfer; with the micro-batch it tags the message.
        transfer: u32,
        /// To this rank's FBD twin (same coordinates, the other role) instead.
        twin: bool,
    },
    /// Pipeline transfer: receive the current micro-batch's `buffer` from the rank that
    /// holds `chunk`; blocks until it has arrived.
    Recv {
        /// The buffer received into.
        buffer: BufId,
        /// The chunk (virtual stage) that sends it.
        chunk: u32,
        /// Plan-wide id of the transfer (the matching `Send` has the same).
        transfer: u32,
        /// From this rank's FBD twin instead.
        twin: bool,
    },
}

/// What a pipeline action runs of a chunk for one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PipeKind {
    /// The forward segment.
    F,
    /// The input-gradient backward segment (zero-bubble split; a later `W` follows).
    B,
    /// The weight-gradient segment (zero-bubble split).
    W,
    /// The whole backward: `B` then `W`.
    BW,
}

/// One compute action of a pipeline rank: `kind` of `chunk` for `microbatch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PipeAction {
    /// Which segment.
    pub kind: PipeKind,
    /// Global chunk index.
    pub chunk: u32,
    /// Micro-batch index within the step.
    pub microbatch: u32,
}

/// The programs of one chunk (virtual stage) held by a pipeline rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkProgram {
    /// Global chunk index (`0..pp·vpp`; chunk c lives on pipeline rank c % pp).
    pub chunk: u32,
    /// Forward of one micro-batch (starts with its `Recv`s, ends with its `Send`s).
    pub forward: Vec<Instr>,
    /// Input-gradient backward (the whole backward when `weight` is empty).
    pub backward: Vec<Instr>,
    /// Weight-gradient kernels, split out for zero-bubble schedules (else empty).
    pub weight: Vec<Instr>,
    /// Activation arena offset of the chunk's first slot, in 4-byte units.
    pub activation_base: u64,
    /// Size of one slot (one micro-batch's activations of this chunk), in 4-byte units.
    pub activation_elems: u64,
    /// Slots: the most micro-batches of this chunk in flight at once; or, for chunks that
    /// share a pool (the same `activation_base`, see [`ChunkProgram::pool_key`]), the most
    /// micro-batches of all of them in flight at once.
    pub slots: u32,
    /// Data inputs (`tokens`, `labels`) the chunk reads.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<BufId>,
    /// The transformer layers the chunk holds, `[first, end)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<[u64; 2]>,
    /// KV-cache plans: the chunk's part of one decode step (in the chunk's slot 0, as a
    /// forward; its `Recv`s and `Send`s use transfer ids of their own).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decode: Vec<Instr>,
    /// KV-cache plans: the data inputs the chunk's decode step reads.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decode_inputs: Vec<BufId>,
}

impl ChunkProgram {
    /// The slot pool the chunk draws from: chunks of a role whose slot regions start at the
    /// same `activation_base` (with the same size and count, which the gate checks) share
    /// one pool of slots, any of which a forward may take; a chunk that keeps nothing
    /// (`activation_elems` 0) has a pool of its own.
    pub fn pool_key(&self) -> (u64, u32) {
        if self.activation_elems == 0 {
            (self.activation_base, self.chunk + 1)
        } else {
            (self.activation_base, 0)
        }
    }
}

/// MegaDPP's dynamic execution: run the highest-priority ready task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DppExec {
    /// `bfs`, `dfs`, `adaptive` (its cap is `cap`) or `ordered`.
    #[serde(with = "crate::spec::dpp_policy_name")]
    pub policy: crate::spec::DppPolicy,
    /// Adaptive: breadth-first while fewer than `cap` micro-batches are in flight.
    pub cap: u32,
}

/// The pipeline program of a role: its chunks and the order of their actions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pipeline {
    /// Schedule name (`gpipe`, `1f1b`, `interleaved`, `zb-h1`, `dpp`).
    pub schedule: String,
    /// Chunks of the whole model (`pp·vpp`).
    pub chunks_total: u32,
    /// The chunks this role holds, by ascending index.
    pub chunks: Vec<ChunkProgram>,
    /// Actions in order (for `dpp`, the reference order of unit costs).
    pub actions: Vec<PipeAction>,
    /// Dynamic execution (the `dpp` schedule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dpp: Option<DppExec>,
}

impl Pipeline {
    /// Each of `tasks`' place in the reference order `actions` (`u32::MAX` where absent):
    /// the `ordered` DPP policy's priority ([`crate::spec::DppPolicy::priority`]).
    pub fn positions(&self, tasks: &[PipeAction]) -> Vec<u32> {
        tasks
            .iter()
            .map(|t| {
                self.actions
                    .iter()
                    .position(|a| a == t)
                    .map_or(u32::MAX, |i| i as u32)
            })
            .collect()
    }
}

/// The programs of one role.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Role {
    /// Role name.
    pub name: String,
    /// Forward and backward of one micro-batch (run `microbatches` times per step).
    pub microbatch: Vec<Instr>,
    /// Once per step, after the last micro-batch: gradient norm and optimizer.
    pub optimizer: Vec<Instr>,
    /// Buffers of the data inputs, by name (`tokens`, `labels`).
    pub inputs: BTreeMap<String, BufId>,
    /// Scalar results read after each micro-batch (`loss`, ...) or step (`grad_norm`).
    pub results: BTreeMap<String, BufId>,
    /// Results that are pending sums over these mesh axes (the data-parallel loss): the
    /// runtime reduces them for reporting.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub result_axes: BTreeMap<String, Vec<crate::types::Axis>>,
    /// Pipelined plans: the chunks and their schedule (then `microbatch` is empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<Pipeline>,
    /// This role's arenas, when they differ between roles (pipeline stages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryPlan>,
    /// KV-cache plans ([`Plan::decode`]): one decode step of this role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<DecodeProgram>,
}

/// One decode step of a role in a KV-cache plan.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DecodeProgram {
    /// The step's forward, ending at its cross-entropy (empty in a pipelined role, whose
    /// chunks hold their parts in [`ChunkProgram::decode`]).
    pub step: Vec<Instr>,
    /// The step's data inputs by name (`tokens`, `labels`: `[1, block]`).
    pub inputs: BTreeMap<String, BufId>,
    /// The step's results (`loss`, whose cross-entropy's first operand is the logits).
    pub results: BTreeMap<String, BufId>,
}

/// Sizes of the arenas, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryPlan {
    /// Parameters.
    pub param_bytes: u64,
    /// Gradients.
    pub grad_bytes: u64,
    /// Optimizer state.
    pub opt_state_bytes: u64,
    /// Peak activations: the activation arena after liveness-based reuse.
    pub activation_bytes: u64,
    /// Activations without reuse (sum of all activation buffers), for comparison.
    pub activation_bytes_unplanned: u64,
    /// The most activation bytes live at one time: a lower bound for any placement.
    #[serde(default)]
    pub activation_bytes_live: u64,
    /// Data inputs.
    pub input_bytes: u64,
    /// Mixed precision on the cpu backend: the f32 working copies of one instruction's
    /// 16-bit operands ([`Plan::staging_elements`] × 4 bytes; 0 in fp32 plans).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub staging_bytes: u64,
    /// KV-cache plans: the keys and values of every position, this rank's layers and kv
    /// heads (0 in every other plan).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub kv_cache_bytes: u64,
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

impl MemoryPlan {
    /// Total bytes of one rank's arenas: what any backend allocates for the plan (the
    /// figure `simulate` and `plan` compare with a device's memory).
    pub fn total(&self) -> u64 {
        self.param_bytes
            + self.grad_bytes
            + self.opt_state_bytes
            + self.activation_bytes
            + self.input_bytes
            + self.kv_cache_bytes
    }

    /// What the cpu backend allocates: the arenas and its mixed-precision staging area.
    pub fn cpu_total(&self) -> u64 {
        self.total() + self.staging_bytes
    }
}

/// JSON form of an instruction: `{"op": "linear", "attrs": {"w": "out_in"}, "in": [..], "out": [..], "path": ..}`
/// or `{"op": "zero", "out": [b]}`.
#[derive(Serialize, Deserialize)]
struct InstrJson {
    op: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    attrs: BTreeMap<String, String>,
    #[serde(rename = "in", default, skip_serializing_if = "Vec::is_empty")]
    inputs: Vec<BufId>,
    #[serde(rename = "out", default, skip_serializing_if = "Vec::is_empty")]
    outputs: Vec<BufId>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    path: String,
}

impl Serialize for Instr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let json = match self {
            Instr::Kernel {
                op,
                inputs,
                outputs,
                path,
            } => InstrJson {
                op: op.name().to_string(),
                attrs: op
                    .attrs()
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect(),
                inputs: inputs.clone(),
                outputs: outputs.clone(),
                path: path.clone(),
            },
            Instr::Zero { buffer } => InstrJson {
                op: "zero".into(),
                attrs: BTreeMap::new(),
                inputs: Vec::new(),
                outputs: vec![*buffer],
                path: String::new(),
            },
            Instr::Send {
                buffer,
                chunk,
                transfer,
                twin,
            } => InstrJson {
                op: "send".into(),
                attrs: transfer_attrs(*chunk, *transfer, *twin),
                inputs: vec![*buffer],
                outputs: Vec::new(),
                path: String::new(),
            },
            Instr::Recv {
                buffer,
                chunk,
                transfer,
                twin,
            } => InstrJson {
                op: "recv".into(),
                attrs: transfer_attrs(*chunk, *transfer, *twin),
                inputs: Vec::new(),
                outputs: vec![*buffer],
                path: String::new(),
            },
        };
        json.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Instr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let j = InstrJson::deserialize(d)?;
        if j.op == "zero" {
            let [buffer] = j.outputs[..] else {
                return Err(serde::de::Error::custom("zero takes exactly one buffer"));
            };
            return Ok(Instr::Zero { buffer });
        }
        if j.op == "send" || j.op == "recv" {
            let num = |k: &str| -> Result<u32, D::Error> {
                j.attrs.get(k).and_then(|v| v.parse().ok()).ok_or_else(|| {
                    serde::de::Error::custom(format!("{} needs attribute `{k}`", j.op))
                })
            };
            let (chunk, transfer) = (num("chunk")?, num("transfer")?);
            let twin = j.attrs.get("twin").is_some_and(|v| v == "1");
            let one = if j.op == "send" {
                &j.inputs
            } else {
                &j.outputs
            };
            let [buffer] = one[..] else {
                return Err(serde::de::Error::custom(format!(
                    "{} takes exactly one buffer",
                    j.op
                )));
            };
            return Ok(if j.op == "send" {
                Instr::Send {
                    buffer,
                    chunk,
                    transfer,
                    twin,
                }
            } else {
                Instr::Recv {
                    buffer,
                    chunk,
                    transfer,
                    twin,
                }
            });
        }
        let op = OpKind::from_text(&j.op, &|k| j.attrs.get(k).cloned())
            .map_err(serde::de::Error::custom)?;
        Ok(Instr::Kernel {
            op,
            inputs: j.inputs,
            outputs: j.outputs,
            path: j.path,
        })
    }
}

fn transfer_attrs(chunk: u32, transfer: u32, twin: bool) -> BTreeMap<String, String> {
    let mut a = BTreeMap::from([
        ("chunk".to_string(), chunk.to_string()),
        ("transfer".to_string(), transfer.to_string()),
    ]);
    if twin {
        a.insert("twin".to_string(), "1".to_string());
    }
    a
}

impl Instr {
    /// Every buffer the instruction reads or writes.
    pub fn buffers(&self) -> Vec<BufId> {
        match self {
            Instr::Kernel {
                inputs, outputs, ..
            } => inputs.iter().chain(outputs).copied().collect(),
            Instr::Zero { buffer } | Instr::Send { buffer, .. } | Instr::Recv { buffer, .. } => {
                vec![*buffer]
            }
        }
    }
}

impl Serialize for DType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for DType {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        DType::from_name(&s).ok_or_else(|| serde::de::Error::custom(format!("unknown dtype `{s}`")))
    }
}

impl ParamEntry {
    /// The shape Hugging Face stores (without vocabulary padding).
    pub fn hf_shape(&self) -> Vec<u64> {
        let mut s = self.shape.clone();
        if let (Some(rows), Some(first)) = (self.hf_rows, s.first_mut()) {
            *first = rows;
        }
        s
    }

    /// The tensors Hugging Face stores for this parameter: `(name, shape)`, one per expert
    /// for stacked experts (in expert order), else the parameter itself.
    pub fn hf_tensors(&self) -> Vec<(String, Vec<u64>)> {
        match (&self.per_expert, self.shape.split_first()) {
            (Some(template), Some((&experts, rest))) => (0..experts)
                .map(|j| (template.replace("{}", &j.to_string()), rest.to_vec()))
                .collect(),
            _ => vec![(self.name.clone(), self.hf_shape())],
        }
    }

    /// The Hugging Face tensor and the index in it of global element `index` (what
    /// initialisation is a function of): for stacked experts, expert `j`'s tensor.
    pub fn hf_element(&self, index: u64) -> (std::borrow::Cow<'_, str>, u64) {
        match &self.per_expert {
            Some(template) => {
                let per: u64 = self.shape.iter().skip(1).product::<u64>().max(1);
                let name = template.replace("{}", &(index / per).to_string());
                (std::borrow::Cow::Owned(name), index % per)
            }
            None => (std::borrow::Cow::Borrowed(self.name.as_str()), index),
        }
    }

    /// For each element of rank `rank`'s shard (row-major), its index in the global tensor.
    pub fn global_indices(&self, mesh: &crate::mesh::Mesh, rank: usize) -> Vec<usize> {
        let n = self.shape.len();
        // Per dim: (global size, local size, blocks, this rank's slice index).
        let dims: Vec<(usize, usize, usize, usize)> = (0..n)
            .map(|d| {
                let size = self.shape[d] as usize;
                let axes = self.shards.get(d).map_or(&[][..], |a| a.as_slice());
                let parts: usize = axes.iter().map(|&a| mesh.size(a) as usize).product();
                let mut coord = 0;
                for &a in axes {
                    coord = coord * mesh.size(a) as usize + mesh.coord(rank, a);
                }
                let blocks = self.blocks.get(d).copied().unwrap_or(1).max(1) as usize;
                (size, size / parts, blocks, coord)
            })
            .collect();
        let local_total: usize = dims.iter().map(|d| d.1).product();
        let mut out = Vec::with_capacity(local_total);
        let mut idx = vec![0usize; n];
        for _ in 0..local_total {
            let mut flat = 0usize;
            for (d, &(size, local, blocks, coord)) in dims.iter().enumerate() {
                let block = size / blocks;
                let per_rank = local / blocks;
                let i = idx[d];
                let g = (i / per_rank) * block + coord * per_rank + i % per_rank;
                flat = flat * size + g;
            }
            out.push(flat);
            for d in (0..n).rev() {
                idx[d] += 1;
                if idx[d] < dims[d].1 {
                    break;
                }
                idx[d] = 0;
            }
        }
        out
    }
}

impl Plan {
    /// The memory plan of rank `rank`'s role (its own where roles differ).
    pub fn memory_of(&self, rank: usize) -> &MemoryPlan {
        self.rank_to_role
            .get(rank)
            .and_then(|&r| self.roles.get(r as usize))
            .and_then(|r| r.memory.as_ref())
            .unwrap_or(&self.memory)
    }

    /// Every program of `role`: micro-batch, optimizer, each pipeline chunk's segments and,
    /// in KV-cache plans, the decode step's (the role's and its chunks').
    pub fn programs_of(role: &Role) -> Vec<&[Instr]> {
        let mut programs: Vec<&[Instr]> = vec![&role.microbatch, &role.optimizer];
        if let Some(p) = &role.pipeline {
            for c in &p.chunks {
                programs.extend([&c.forward[..], &c.backward[..], &c.weight[..]]);
            }
        }
        if let Some(d) = &role.decode {
            programs.push(&d.step);
        }
        if let Some(p) = &role.pipeline {
            for c in p.chunks.iter().filter(|c| !c.decode.is_empty()) {
                programs.push(&c.decode);
            }
        }
        programs
    }

    /// A KV-cache plan's decode step as a plan of its own, for the checks a forward gets: the
    /// decode batch, each role's decode step as its micro-batch program (and each chunk's
    /// decode part as its forward), its inputs and results; None for other plans. The
    /// buffer table, parameters and arenas are the plan's.
    pub fn decode_view(&self) -> Option<Plan> {
        let info = self.decode.as_ref()?;
        let mut view = self.clone();
        view.batch = info.batch.clone();
        view.decode = None;
        for role in &mut view.roles {
            let d = role.decode.take().unwrap_or_default();
            role.microbatch = d.step;
            role.inputs = d.inputs;
            role.results = d.results;
            if let Some(p) = &mut role.pipeline {
                for c in &mut p.chunks {
                    c.forward = std::mem::take(&mut c.decode);
                    c.inputs = std::mem::take(&mut c.decode_inputs);
                }
            }
        }
        Some(view)
    }

    /// Mixed precision: the elements of the largest set of distinct 16-bit (bf16/fp16)
    /// buffers one instruction of `role` touches. The cpu backend computes every kernel in
    /// f32, on copies of its 16-bit operands widened into a scratch area of this size.
    pub fn staging_elements(&self, role: &Role) -> u64 {
        let mut most = 0;
        for instr in Self::programs_of(role).into_iter().flatten() {
            let mut ids = instr.buffers();
            ids.sort_unstable();
            ids.dedup();
            let n: u64 = ids
                .iter()
                .filter_map(|&b| self.buffers.get(b as usize))
                .filter(|b| b.dtype.is_half())
                .map(Buffer::len)
                .sum();
            most = most.max(n);
        }
        most
    }

    /// Every tensor Hugging Face stores for the plan's parameters, in parameter order
    /// ([`ParamEntry::hf_tensors`]): what `--init` reads and `--save-params` writes.
    pub fn hf_tensors(&self) -> Vec<(String, Vec<u64>)> {
        self.params
            .iter()
            .flat_map(ParamEntry::hf_tensors)
            .collect()
    }

    /// The plan as pretty JSON (deterministic: same plan, same bytes).
    pub fn to_json(&self) -> String {
        let mut s = serde_json::to_string_pretty(self).expect("plans always serialize");
        s.push('\n');
        s
    }

    /// Parse a plan from JSON, checking only the schema version and the JSON's form: the
    /// result is not checked and no runtime entry point accepts it. Use
    /// [`Plan::from_json`] or [`Plan::load`] for a plan to run.
    pub fn parse_json(text: &str) -> Result<Plan, crate::gate::PlanError> {
        use crate::gate::PlanError;
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| PlanError::Format(format!("not a plan (invalid JSON): {e}")))?;
        let version = value.get("schema_version").and_then(|v| v.as_u64());
        if version != Some(u64::from(SCHEMA_VERSION)) {
            return Err(PlanError::Format(format!(
                "plan schema version {} is not supported by this build (expects {SCHEMA_VERSION}); recompile the plan",
                version.map_or("(missing)".to_string(), |v| v.to_string())
            )));
        }
        serde_json::from_value(value).map_err(|e| PlanError::Format(format!("malformed plan: {e}")))
    }

    /// Parse and check a plan: the gate between a plan file and the runtime
    /// ([`crate::gate::CheckedPlan::check`]).
    pub fn from_json(text: &str) -> Result<crate::gate::CheckedPlan, crate::gate::PlanError> {
        crate::gate::CheckedPlan::from_json(text)
    }

    /// Read, parse and check the plan file at `path` (`PLAN_DIR/plan.json`).
    pub fn load(
        path: &std::path::Path,
    ) -> Result<crate::gate::CheckedPlan, crate::gate::PlanError> {
        crate::gate::CheckedPlan::load(path)
    }
}

impl Serialize for crate::types::Axis {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for crate::types::Axis {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        crate::types::Axis::from_name(&s)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown mesh axis `{s}`")))
    }
}
