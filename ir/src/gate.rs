//! The plan gate: `plan.json` is the contract between compiler and runtime, and a plan
//! reaches the runtime only as a [`CheckedPlan`], which only [`CheckedPlan::check`] makes.
//!
//! The check proves what the runtime later assumes, so that no plan that passes it can make
//! the runtime panic, abort or index out of bounds:
//! - **Indices**: every buffer, role, parameter, chunk, result and input a plan names exists;
//!   the rank table covers the mesh; transfers address chunks of the model (and FBD twins
//!   only on meshes with an fbd axis of 2).
//! - **Memory**: every buffer lies inside its arena on every rank (its offset, its
//!   rank-dependent far end, its chunk slot inside `activation_base + elems · slots`, all
//!   inside the role's memory plan), with overflow-checked arithmetic; dtypes fit their
//!   class; a stage holds every buffer its programs touch.
//! - **Kernels**: each instruction's arity, operand dtypes and local shapes are those its
//!   kernel reads and writes ([`op_rule`]: the plan-level shape rules, on the local shapes
//!   of a rank, including the collectives' group sizes); a kernel's outputs do not overlap
//!   its inputs or each other (except the documented in-place ops); token and label ids
//!   stay inside the embedding table and the logits; MoE index buffers come from a router
//!   of no more experts than their reader routes to.
//! - **Programs**: a program reads no activation before it writes it (a truncated program),
//!   the loss is written by the program the runtime reads it after, and the reported loss
//!   reaches rank 0.
//! - **Batch**: micro-batch counts are positive and match `global_batch / (micro_batch ·
//!   dp)`; data inputs are `[micro_batch, seq_len]` (the local part under context
//!   parallelism).
//! - **Parameters**: their buffers have the right class and dtype and hold exactly the
//!   rank's shard of the global shape.
//! - **Schedules and communication**: [`crate::check::check_plan`] (every collective and
//!   transfer matches, no deadlock, each action list runs every (chunk, micro-batch) once).
//! - **KV-cache plans** (`decode`): an inference plan of one sample, a decode step in every
//!   role (and chunk), an `i32[1]` position input, caches of the window's positions in the
//!   `kv_cache` arena written only by `kv_attention`; the decode step then gets every check
//!   above as a plan of its own ([`Plan::decode_view`]). Other plans have no cache buffer
//!   and no decode program.
//!
//! A violation is one [`PlanError`] naming the JSON path and the values involved, e.g.
//! `roles[0].results.loss: buffer 100000 does not exist (the plan has 312 buffers)`.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use crate::op::OpKind;
use crate::plan::{BufId, Buffer, BufferClass, Instr, MemoryPlan, Plan, RankOffset};
use crate::types::{Axis, DType};

mod rules;
pub use rules::op_rule;

/// The most ranks a plan may have.
pub const MAX_RANKS: u64 = 1 << 20;
/// The most elements one buffer may have (2^40).
pub const MAX_ELEMENTS: u64 = 1 << 40;
/// The most dims a buffer may have.
pub const MAX_DIMS: usize = 8;

/// Why a plan file is not a plan this runtime can run.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// The file could not be read.
    #[error("cannot read the plan: {0}")]
    Io(String),
    /// Not JSON, an unsupported schema version, or JSON that is not a plan.
    #[error("{0}")]
    Format(String),
    /// A value of the plan is out of range or inconsistent with another.
    #[error("{at}: {message}")]
    Invalid {
        /// JSON path of the value (`roles[0].results.loss`).
        at: String,
        /// What is wrong, with the values involved.
        message: String,
    },
    /// Communication or schedule: a collective or transfer that does not match, a
    /// deadlock, or an action list that misses or repeats a (chunk, micro-batch).
    #[error("{0}")]
    Schedule(String),
}

fn invalid(at: impl Into<String>, message: impl Into<String>) -> PlanError {
    PlanError::Invalid {
        at: at.into(),
        message: message.into(),
    }
}

/// A plan that passed [`CheckedPlan::check`]: the only form the runtime accepts. It derefs
/// to the [`Plan`] it holds, read-only.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckedPlan(Plan);

impl std::ops::Deref for CheckedPlan {
    type Target = Plan;
    fn deref(&self) -> &Plan {
        &self.0
    }
}

impl AsRef<Plan> for CheckedPlan {
    fn as_ref(&self) -> &Plan {
        &self.0
    }
}

impl CheckedPlan {
    /// Check `plan`: the first violation as one error, else the checked plan.
    pub fn check(plan: Plan) -> Result<CheckedPlan, PlanError> {
        Gate::new(&plan)?.run()?;
        crate::check::check_plan(&plan).map_err(PlanError::Schedule)?;
        // A KV-cache plan's decode step gets every check a forward gets, as a plan of its
        // own over the same buffers and arenas (`Plan::decode_view`).
        if let Some(view) = plan.decode_view() {
            let in_step = |e: PlanError| match e {
                PlanError::Invalid { at, message } => invalid(
                    format!("{at} (of the decode step: roles[r].decode, chunks' decode)"),
                    message,
                ),
                PlanError::Schedule(m) => PlanError::Schedule(format!("the decode step: {m}")),
                other => other,
            };
            let mut gate = Gate::new(&view).map_err(in_step)?;
            gate.view = true;
            gate.run().map_err(in_step)?;
            crate::check::check_plan(&view)
                .map_err(PlanError::Schedule)
                .map_err(in_step)?;
        }
        Ok(CheckedPlan(plan))
    }

    /// Parse `text` ([`Plan::parse_json`]) and check it.
    pub fn from_json(text: &str) -> Result<CheckedPlan, PlanError> {
        CheckedPlan::check(Plan::parse_json(text)?)
    }

    /// Read, parse and check the plan file at `path`.
    pub fn load(path: &Path) -> Result<CheckedPlan, PlanError> {
        let text =
            crate::file::read_text(path, u64::MAX).map_err(|e| PlanError::Io(e.to_string()))?;
        CheckedPlan::from_json(&text)
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        &self.0
    }

    /// Give the plan back (to change it; it must pass the check again to run).
    pub fn into_inner(self) -> Plan {
        self.0
    }
}

/// One instruction stream of a role: its JSON path, its instructions and its chunk.
struct Stream<'a> {
    at: String,
    instrs: &'a [Instr],
    /// The chunk whose activations the stream's slot-relative buffers belong to.
    chunk: Option<u32>,
}

/// What wrote an i32 activation: a router's expert indices (of this many experts) or
/// per-expert token counts.
#[derive(Clone, Copy, Debug, PartialEq)]
enum IntSource {
    Indices(u64),
    Counts,
}

struct Gate<'p> {
    plan: &'p Plan,
    world: usize,
    pp: u64,
    /// Checking a KV-cache plan's decode step ([`Plan::decode_view`]), whose structure the
    /// plan's own check has proved.
    view: bool,
}

/// Product of `dims` with overflow checking.
fn product(dims: &[u64]) -> Option<u64> {
    dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
}

impl<'p> Gate<'p> {
    fn new(plan: &'p Plan) -> Result<Gate<'p>, PlanError> {
        // The mesh's own rules (axes once, sizes >= 1, a world size that fits, ep | dp·cp).
        plan.mesh.validate().map_err(|e| invalid("mesh.axes", e))?;
        let world = plan.mesh.world_size() as u64;
        if world > MAX_RANKS {
            return Err(invalid(
                "mesh",
                format!("{world} ranks; this runtime supports at most {MAX_RANKS}"),
            ));
        }
        let mesh = &plan.mesh;
        if mesh.size(Axis::Fbd) > 2 {
            return Err(invalid(
                "mesh",
                format!("fbd has size {}; it is 1 or 2", mesh.size(Axis::Fbd)),
            ));
        }
        Ok(Gate {
            plan,
            world: world as usize,
            pp: mesh.size(Axis::Pp),
            view: false,
        })
    }

    fn run(&self) -> Result<(), PlanError> {
        self.ranks()?;
        self.batch()?;
        self.cluster()?;
        for (i, b) in self.plan.buffers.iter().enumerate() {
            self.buffer(i, b)?;
        }
        for i in 0..self.plan.params.len() {
            self.param(i)?;
        }
        for r in 0..self.plan.roles.len() {
            self.role(r)?;
        }
        if self.plan.kind == crate::plan::PlanKind::Inference {
            self.inference()?;
        }
        if !self.view {
            self.decode()?;
        }
        self.loss_reaches_rank_0()
    }

    /// A KV-cache plan (one with `decode`): an inference plan whose every role that a rank
    /// runs has a decode step (in each chunk it holds, under pp), a decode batch of one
    /// sample of at most the window's tokens, a position input `i32[1]`, and caches of the
    /// window's positions. Any other plan has no cache buffer and no decode program.
    fn decode(&self) -> Result<(), PlanError> {
        let plan = self.plan;
        let Some(d) = &plan.decode else {
            if let Some(i) = plan
                .buffers
                .iter()
                .position(|b| b.class == BufferClass::KvCache)
            {
                return Err(invalid(
                    format!("buffers[{i}].class"),
                    "a kv_cache buffer in a plan without decode steps (`decode`)",
                ));
            }
            for (r, role) in plan.roles.iter().enumerate() {
                let chunk = role
                    .pipeline
                    .iter()
                    .flat_map(|p| p.chunks.iter())
                    .any(|c| !c.decode.is_empty() || !c.decode_inputs.is_empty());
                if role.decode.is_some() || chunk {
                    return Err(invalid(
                        format!("roles[{r}].decode"),
                        "a decode step in a plan without `decode`",
                    ));
                }
            }
            return Ok(());
        };
        if plan.kind != crate::plan::PlanKind::Inference {
            return Err(invalid(
                "decode",
                "only an inference plan decodes with a KV cache",
            ));
        }
        let (w, b) = (&plan.batch, &d.batch);
        if b.micro_batch != 1
            || w.micro_batch != 1
            || b.seq_len == 0
            || b.seq_len > w.seq_len
            || b.vocab != w.vocab
            || b.microbatches != 1
        {
            return Err(invalid(
                "decode.batch",
                format!(
                    "a step of {} sample(s) of {} tokens (vocab {}, {} micro-batches) does not fit the window of {} sample(s) of {} tokens (vocab {}): the cache holds one sequence",
                    b.micro_batch, b.seq_len, b.vocab, b.microbatches, w.micro_batch, w.seq_len, w.vocab
                ),
            ));
        }
        let pos = self.buf(d.position, "decode.position")?;
        if pos.class != BufferClass::Input || pos.dtype != DType::I32 || pos.shape != [1] {
            return Err(invalid(
                "decode.position",
                format!(
                    "buffer {} ({}) is {} {} {:?}, expected input i32 [1]",
                    d.position,
                    pos.name,
                    pos.class.name(),
                    pos.dtype.as_str(),
                    pos.shape
                ),
            ));
        }
        // Under cp each rank caches the window positions it holds: seq_len / cp of them.
        let rows = w.seq_len / plan.mesh.size(Axis::Cp).max(1);
        for (i, c) in plan.buffers.iter().enumerate() {
            if c.class == BufferClass::KvCache
                && (c.shape.first() != Some(&rows) || c.chunk.is_some())
            {
                return Err(invalid(
                    format!("buffers[{i}].shape"),
                    format!(
                        "the cache {} has shape {:?}, but it holds the window's {rows} positions \
                         of this rank (dim 0)",
                        c.name, c.shape
                    ),
                ));
            }
        }
        for (r, role) in plan.roles.iter().enumerate() {
            if self.rank_of(r).is_none() {
                continue;
            }
            if role.decode.is_none() {
                return Err(invalid(
                    format!("roles[{r}].decode"),
                    "a role of a KV-cache plan has no decode step",
                ));
            }
            for (k, c) in role
                .pipeline
                .iter()
                .flat_map(|p| p.chunks.iter())
                .enumerate()
            {
                if c.decode.is_empty() {
                    return Err(invalid(
                        format!("roles[{r}].pipeline.chunks[{k}].decode"),
                        format!("chunk {} has no part of the decode step", c.chunk),
                    ));
                }
            }
        }
        Ok(())
    }

    /// An inference plan runs the forward only: no gradient or optimizer-state buffer, no
    /// optimizer program, no backward or weight-gradient instructions in a pipeline chunk,
    /// no gradient norm reported.
    fn inference(&self) -> Result<(), PlanError> {
        let plan = self.plan;
        if let Some((i, b)) = plan
            .buffers
            .iter()
            .enumerate()
            .find(|(_, b)| matches!(b.class, BufferClass::Grad | BufferClass::OptState))
        {
            return Err(invalid(
                format!("buffers[{i}].class"),
                format!(
                    "an inference plan keeps no gradients or optimizer state, but buffer {i} ({}) is `{}`",
                    b.name,
                    b.class.name()
                ),
            ));
        }
        for (r, role) in plan.roles.iter().enumerate() {
            let at = format!("roles[{r}]");
            if !role.optimizer.is_empty() {
                return Err(invalid(
                    format!("{at}.optimizer"),
                    format!(
                        "an inference plan has no optimizer program, but this one has {} instruction(s)",
                        role.optimizer.len()
                    ),
                ));
            }
            if role.results.contains_key("grad_norm") {
                return Err(invalid(
                    format!("{at}.results.grad_norm"),
                    "an inference plan computes no gradient norm",
                ));
            }
            for (c, chunk) in role
                .pipeline
                .iter()
                .flat_map(|p| p.chunks.iter())
                .enumerate()
            {
                if !chunk.backward.is_empty() || !chunk.weight.is_empty() {
                    return Err(invalid(
                        format!("{at}.pipeline.chunks[{c}]"),
                        "an inference plan's pipeline chunks run their forward only",
                    ));
                }
            }
        }
        Ok(())
    }

    /// The recorded `[cluster]`: at least one node of at least one device, a short name.
    fn cluster(&self) -> Result<(), PlanError> {
        let Some(c) = &self.plan.cluster else {
            return Ok(());
        };
        if c.nodes == 0 || c.gpus_per_node == 0 {
            return Err(invalid(
                "cluster",
                format!(
                    "{} node(s) × {} device(s): both must be at least 1",
                    c.nodes, c.gpus_per_node
                ),
            ));
        }
        if c.device.is_empty() || c.device.len() > 64 {
            return Err(invalid(
                "cluster.device",
                "must name a cluster preset (1 to 64 characters)",
            ));
        }
        Ok(())
    }

    fn ranks(&self) -> Result<(), PlanError> {
        let plan = self.plan;
        if plan.rank_to_role.len() != self.world {
            return Err(invalid(
                "rank_to_role",
                format!(
                    "lists {} ranks but the mesh has {}",
                    plan.rank_to_role.len(),
                    self.world
                ),
            ));
        }
        for (rank, &r) in plan.rank_to_role.iter().enumerate() {
            if r as usize >= plan.roles.len() {
                return Err(invalid(
                    format!("rank_to_role[{rank}]"),
                    format!(
                        "role {r} does not exist (the plan has {} roles)",
                        plan.roles.len()
                    ),
                ));
            }
        }
        Ok(())
    }

    fn batch(&self) -> Result<(), PlanError> {
        let b = &self.plan.batch;
        for (name, v) in [
            ("micro_batch", b.micro_batch),
            ("global_batch", b.global_batch),
            ("seq_len", b.seq_len),
            ("vocab", b.vocab),
            ("microbatches", b.microbatches),
        ] {
            if v == 0 {
                return Err(invalid(format!("batch.{name}"), "must be positive, got 0"));
            }
        }
        if b.vocab > i32::MAX as u64 {
            return Err(invalid(
                "batch.vocab",
                format!("{} does not fit token ids (i32)", b.vocab),
            ));
        }
        let dp = self.plan.mesh.size(Axis::Dp);
        let per_step = b
            .micro_batch
            .checked_mul(b.microbatches)
            .and_then(|x| x.checked_mul(dp));
        if per_step != Some(b.global_batch) {
            return Err(invalid(
                "batch.microbatches",
                format!(
                    "{} micro-batches of {} samples on {dp} data-parallel rank(s) do not make the global batch of {}",
                    b.microbatches, b.micro_batch, b.global_batch
                ),
            ));
        }
        if b.global_batch.checked_mul(b.seq_len) != Some(b.tokens_per_step) {
            return Err(invalid(
                "batch.tokens_per_step",
                format!(
                    "{} is not global_batch {} × seq_len {}",
                    b.tokens_per_step, b.global_batch, b.seq_len
                ),
            ));
        }
        let t = &self.plan.train;
        if !(t.lr.is_finite() && t.lr >= 0.0) {
            return Err(invalid(
                "train.lr",
                format!("{} is not a finite, non-negative rate", t.lr),
            ));
        }
        if let crate::plan::LrSchedule::Cosine { min_lr, .. } = t.lr_schedule {
            if !(min_lr.is_finite() && min_lr >= 0.0) {
                return Err(invalid(
                    "train.lr_schedule.min_lr",
                    format!("{min_lr} is not a finite, non-negative rate"),
                ));
            }
        }
        Ok(())
    }

    fn buffer(&self, i: usize, b: &Buffer) -> Result<(), PlanError> {
        let at = format!("buffers[{i}]");
        if b.shape.len() > MAX_DIMS {
            return Err(invalid(
                format!("{at}.shape"),
                format!("{} dims; at most {MAX_DIMS}", b.shape.len()),
            ));
        }
        match product(&b.shape) {
            Some(n) if n <= MAX_ELEMENTS => {}
            _ => {
                return Err(invalid(
                    format!("{at}.shape"),
                    format!("{:?} has more than {MAX_ELEMENTS} elements", b.shape),
                ))
            }
        }
        if b.layout.len() > b.shape.len() {
            return Err(invalid(
                format!("{at}.layout"),
                format!(
                    "shards {} dims of a {}-d buffer",
                    b.layout.len(),
                    b.shape.len()
                ),
            ));
        }
        if b.layout.get(1).is_some_and(|a| a.contains(&Axis::Cp)) && !b.shape[1].is_multiple_of(2) {
            return Err(invalid(
                format!("{at}.shape"),
                format!(
                    "{:?}: a sequence split over cp holds two chunks, so dim 1 must be even",
                    b.shape
                ),
            ));
        }
        let int = b.dtype == DType::I32;
        // f32 inputs: only activation patching's replacements (`patch:POINT`).
        if int && !matches!(b.class, BufferClass::Input | BufferClass::Activation)
            || !int
                && b.class == BufferClass::Input
                && !(b.dtype == DType::F32 && b.name.starts_with("patch:"))
        {
            return Err(invalid(
                format!("{at}.dtype"),
                format!("a {} buffer cannot be {}", b.class.name(), b.dtype.as_str()),
            ));
        }
        if let Some(s) = b.stage {
            if u64::from(s) >= self.pp {
                return Err(invalid(
                    format!("{at}.stage"),
                    format!("stage {s} does not exist (pp = {})", self.pp),
                ));
            }
        }
        if let Some(r) = &b.rank_offset {
            if r.with
                .iter()
                .any(|&a| a == r.axis || matches!(a, Axis::Ep | Axis::Edp))
            {
                return Err(invalid(
                    format!("{at}.rank_offset.with"),
                    "repeats its axis or names ep/edp (only dense axes are combined)",
                ));
            }
            let far = (r.count(&self.plan.mesh).max(1) - 1)
                .checked_mul(r.stride)
                .and_then(|x| x.checked_add(b.offset))
                .and_then(|x| x.checked_add(b.len()));
            if far.is_none() {
                return Err(invalid(
                    format!("{at}.rank_offset"),
                    format!("offset {} + stride {} overflows", b.offset, r.stride),
                ));
            }
        }
        if let Some(c) = b.chunk {
            if b.class != BufferClass::Activation {
                return Err(invalid(
                    format!("{at}.chunk"),
                    format!(
                        "only activations live in chunk slots, not {}",
                        b.class.name()
                    ),
                ));
            }
            if b.rank_offset.is_some() {
                return Err(invalid(
                    format!("{at}.rank_offset"),
                    "a chunk activation has no rank-dependent offset",
                ));
            }
            if self.pp > 0 && b.stage != Some((u64::from(c) % self.pp) as u32) {
                return Err(invalid(
                    format!("{at}.stage"),
                    format!(
                        "{:?}, but chunk {c} lives on stage {}",
                        b.stage,
                        u64::from(c) % self.pp
                    ),
                ));
            }
        }
        Ok(())
    }

    fn buf(&self, id: BufId, at: &str) -> Result<&'p Buffer, PlanError> {
        self.plan.buffers.get(id as usize).ok_or_else(|| {
            invalid(
                at,
                format!(
                    "buffer {id} does not exist (the plan has {} buffers)",
                    self.plan.buffers.len()
                ),
            )
        })
    }

    fn want(
        &self,
        id: BufId,
        at: &str,
        class: BufferClass,
        dtype: DType,
    ) -> Result<&'p Buffer, PlanError> {
        let b = self.buf(id, at)?;
        if b.class != class || b.dtype != dtype {
            return Err(invalid(
                at,
                format!(
                    "buffer {id} ({}) is {} {}, expected {} {}",
                    b.name,
                    b.class.name(),
                    b.dtype.as_str(),
                    class.name(),
                    dtype.as_str()
                ),
            ));
        }
        Ok(b)
    }

    fn param(&self, i: usize) -> Result<(), PlanError> {
        let p = &self.plan.params[i];
        let at = format!("params[{i}]");
        let mesh = &self.plan.mesh;
        product(&p.shape)
            .filter(|&n| n <= MAX_ELEMENTS)
            .ok_or_else(|| invalid(format!("{at}.shape"), format!("{:?} is too large", p.shape)))?;
        if p.shards.len() > p.shape.len() || p.blocks.len() > p.shape.len() {
            return Err(invalid(
                format!("{at}.shards"),
                format!(
                    "{} shard and {} block entries for a {}-d shape",
                    p.shards.len(),
                    p.blocks.len(),
                    p.shape.len()
                ),
            ));
        }
        let mut local = 1u64;
        for (d, &size) in p.shape.iter().enumerate() {
            let axes = p.shards.get(d).map_or(&[][..], |a| a.as_slice());
            let parts = axes
                .iter()
                .try_fold(1u64, |n, &a| n.checked_mul(mesh.size(a)))
                .unwrap_or(u64::MAX);
            let blocks = p.blocks.get(d).copied().unwrap_or(1).max(1);
            let split = parts.checked_mul(blocks).filter(|&n| n <= MAX_ELEMENTS);
            if split.is_none_or(|n| size % n != 0) {
                return Err(invalid(
                    format!("{at}.shape[{d}]"),
                    format!("{size} does not split into {blocks} block(s) over {parts} rank(s)"),
                ));
            }
            local *= size / parts;
        }
        if let Some(rows) = p.hf_rows {
            if p.shape.first().is_none_or(|&r| rows > r) {
                return Err(invalid(
                    format!("{at}.hf_rows"),
                    format!(
                        "{rows} is more than the {:?} rows of the shape",
                        p.shape.first()
                    ),
                ));
            }
        }
        if p.per_expert.is_some() && p.shape.is_empty() {
            return Err(invalid(
                format!("{at}.per_expert"),
                "stacked experts need an experts dim",
            ));
        }
        if let crate::plan::Init::Normal { std } = p.init {
            if !(std.is_finite() && std >= 0.0) {
                return Err(invalid(
                    format!("{at}.init.std"),
                    format!("{std} is not a finite, non-negative deviation"),
                ));
            }
        }
        // Working weights in the precision's storage dtype; the rest f32.
        let working = match self.plan.train.precision.as_str() {
            "bf16" => DType::Bf16,
            "fp16" => DType::F16,
            _ => DType::F32,
        };
        let check = |id: BufId, field: &str, class: BufferClass| -> Result<(), PlanError> {
            let at = format!("{at}.{field}");
            let dtype = if class == BufferClass::Param {
                working
            } else {
                DType::F32
            };
            let b = self.want(id, &at, class, dtype)?;
            if b.len() != local {
                return Err(invalid(
                    at,
                    format!(
                        "buffer {id} ({}) has {} elements, but the rank's shard of {:?} has {local}",
                        b.name,
                        b.len(),
                        p.shape
                    ),
                ));
            }
            Ok(())
        };
        check(p.buffer, "buffer", BufferClass::Param)?;
        let inference = self.plan.kind == crate::plan::PlanKind::Inference;
        match p.grad {
            Some(g) if !inference => check(g, "grad", BufferClass::Grad)?,
            None if inference => {}
            Some(g) => {
                return Err(invalid(
                    format!("{at}.grad"),
                    format!("an inference plan keeps no gradients, but this one has buffer {g}"),
                ))
            }
            None => {
                return Err(invalid(
                    format!("{at}.grad"),
                    "a training plan's parameter needs a gradient buffer",
                ))
            }
        }
        if inference {
            let state = [
                ("exp_avg", p.exp_avg),
                ("exp_avg_sq", p.exp_avg_sq),
                ("master", p.master),
            ];
            if let Some((field, Some(b))) = state.into_iter().find(|(_, b)| b.is_some()) {
                return Err(invalid(
                    format!("{at}.{field}"),
                    format!(
                        "an inference plan keeps no optimizer state, but this one has buffer {b}"
                    ),
                ));
            }
        }
        if let Some(m) = p.exp_avg {
            check(m, "exp_avg", BufferClass::OptState)?;
        }
        if let Some(v) = p.exp_avg_sq {
            check(v, "exp_avg_sq", BufferClass::OptState)?;
        }
        if let Some(m) = p.master {
            if !working.is_half() {
                return Err(invalid(
                    format!("{at}.master"),
                    "an f32 parameter has no master copy",
                ));
            }
            check(m, "master", BufferClass::OptState)?;
        }
        for (k, &c) in p.tied_copies.iter().enumerate() {
            check(c, &format!("tied_copies[{k}]"), BufferClass::Param)?;
        }
        Ok(())
    }

    /// The first rank with role `r`, if any.
    fn rank_of(&self, r: usize) -> Option<usize> {
        self.plan.rank_to_role.iter().position(|&x| x as usize == r)
    }

    fn role(&self, r: usize) -> Result<(), PlanError> {
        let plan = self.plan;
        let role = &plan.roles[r];
        let at = format!("roles[{r}]");
        let Some(rank) = self.rank_of(r) else {
            // No rank runs it: nothing of it reaches the runtime.
            return Ok(());
        };
        let stage = plan.mesh.coord(rank, Axis::Pp) as u32;
        let mut streams = Vec::new();
        let mut chunks: BTreeMap<u32, &crate::plan::ChunkProgram> = BTreeMap::new();
        match &role.pipeline {
            None => streams.push(Stream {
                at: format!("{at}.microbatch"),
                instrs: &role.microbatch,
                chunk: None,
            }),
            Some(p) => {
                if !role.microbatch.is_empty() {
                    return Err(invalid(
                        format!("{at}.microbatch"),
                        "a pipelined role runs its chunks' programs, not a micro-batch program",
                    ));
                }
                if p.chunks_total == 0 {
                    return Err(invalid(
                        format!("{at}.pipeline.chunks_total"),
                        "must be positive",
                    ));
                }
                // A static action list keeps at most `slots` micro-batches of a chunk's
                // slot pool in flight (the dynamic `dpp` schedule waits for a free slot).
                if p.dpp.is_none() {
                    let mut inflight: HashMap<(u64, u32), u32> = HashMap::new();
                    for (i, a) in p.actions.iter().enumerate() {
                        let Some(c) = p.chunks.iter().find(|c| c.chunk == a.chunk) else {
                            continue; // check_plan names the missing chunk
                        };
                        let n = inflight.entry(c.pool_key()).or_default();
                        if a.kind == crate::plan::PipeKind::F {
                            if *n >= c.slots {
                                return Err(invalid(
                                    format!("{at}.pipeline.actions[{i}]"),
                                    format!(
                                        "the forward of chunk {} micro-batch {} needs an activation slot, but all {} of its pool are in flight",
                                        a.chunk, a.microbatch, c.slots
                                    ),
                                ));
                            }
                            *n += 1;
                        }
                        let last = match a.kind {
                            crate::plan::PipeKind::BW | crate::plan::PipeKind::W => true,
                            crate::plan::PipeKind::B => c.weight.is_empty(),
                            crate::plan::PipeKind::F => {
                                c.backward.is_empty() && c.weight.is_empty()
                            }
                        };
                        if last {
                            *n = n.saturating_sub(1);
                        }
                    }
                }
                for (k, c) in p.chunks.iter().enumerate() {
                    let cat = format!("{at}.pipeline.chunks[{k}]");
                    if c.slots == 0 {
                        return Err(invalid(format!("{cat}.slots"), "must be positive"));
                    }
                    let end = c
                        .activation_elems
                        .checked_mul(u64::from(c.slots))
                        .and_then(|x| x.checked_add(c.activation_base));
                    let arena = self.memory(rank).activation_bytes / 4;
                    if end.is_none_or(|e| e > arena) {
                        return Err(invalid(
                            format!("{cat}.activation_base"),
                            format!(
                                "{} slots of {} elements from {} do not fit the activation arena of {arena} elements",
                                c.slots, c.activation_elems, c.activation_base
                            ),
                        ));
                    }
                    for (j, &b) in c.inputs.iter().enumerate() {
                        // A `patch` replacement is checked with the role's inputs below.
                        let patch = role
                            .inputs
                            .iter()
                            .any(|(n, &x)| x == b && n.starts_with("patch:"));
                        if !patch {
                            self.input_buffer(b, &format!("{cat}.inputs[{j}]"))?;
                        }
                        if !role.inputs.values().any(|&x| x == b) {
                            return Err(invalid(
                                format!("{cat}.inputs[{j}]"),
                                format!("buffer {b} is not one of the role's inputs"),
                            ));
                        }
                    }
                    chunks.insert(c.chunk, c);
                    for (name, instrs) in [
                        ("forward", &c.forward),
                        ("backward", &c.backward),
                        ("weight", &c.weight),
                    ] {
                        streams.push(Stream {
                            at: format!("{cat}.{name}"),
                            instrs,
                            chunk: Some(c.chunk),
                        });
                    }
                }
            }
        }
        streams.push(Stream {
            at: format!("{at}.optimizer"),
            instrs: &role.optimizer,
            chunk: None,
        });
        // Inputs and results.
        for (name, &b) in &role.inputs {
            let iat = format!("{at}.inputs.{name}");
            if name.starts_with("patch:") {
                // Activation patching's replacement (the `perturb` pass): f32, a micro-batch.
                let buf = self.want(b, &iat, BufferClass::Input, DType::F32)?;
                if buf.shape.first() != Some(&plan.batch.micro_batch) {
                    return Err(invalid(
                        iat,
                        format!(
                            "buffer {b} ({}) has shape {:?}, not a micro-batch of {}",
                            buf.name, buf.shape, plan.batch.micro_batch
                        ),
                    ));
                }
                continue;
            }
            if !matches!(name.as_str(), "tokens" | "labels") {
                return Err(invalid(iat, "unknown input (expected tokens or labels)"));
            }
            self.input_buffer(b, &iat)?;
        }
        for (name, &b) in &role.results {
            let rat = format!("{at}.results.{name}");
            let buf = self.want(b, &rat, BufferClass::Activation, DType::F32)?;
            if buf.len() != 1 {
                return Err(invalid(
                    rat,
                    format!(
                        "buffer {b} ({}) has shape {:?}; results are scalars",
                        buf.name, buf.shape
                    ),
                ));
            }
        }
        for (name, axes) in &role.result_axes {
            // The members of the reduction group call it together: they reduce alike.
            for other in plan.mesh.group(rank, axes) {
                let theirs = &plan.roles[plan.rank_to_role[other] as usize];
                if theirs.result_axes.get(name) != Some(axes) {
                    return Err(invalid(
                        format!("{at}.result_axes.{name}"),
                        format!(
                            "rank {rank} sums `{name}` over {axes:?}, but rank {other} of that group (role {}) sums it over {:?}",
                            theirs.name,
                            theirs.result_axes.get(name)
                        ),
                    ));
                }
            }
        }
        if role.pipeline.is_none() {
            for name in ["tokens", "labels"] {
                if !role.inputs.contains_key(name) {
                    return Err(invalid(
                        format!("{at}.inputs"),
                        format!("no `{name}` input"),
                    ));
                }
            }
            let wanted: &[&str] = if plan.kind == crate::plan::PlanKind::Inference {
                &["loss"]
            } else {
                &["loss", "grad_norm"]
            };
            for &name in wanted {
                if !role.results.contains_key(name) {
                    return Err(invalid(
                        format!("{at}.results"),
                        format!("no `{name}` result"),
                    ));
                }
            }
        }
        // Buffers: held by this stage, inside this rank's arenas.
        self.arenas(r, rank, stage, &chunks, &streams)?;
        self.state(r, stage, &streams)?;
        // Instructions.
        let mut written = Written::default();
        let mut ints: HashMap<BufId, IntSource> = HashMap::new();
        // The last write of the loss in the program it is read after: (where, op).
        let mut loss_by: Option<(String, &'static str)> = None;
        let loss = role.results.get("loss").copied();
        for s in &streams {
            for (i, instr) in s.instrs.iter().enumerate() {
                let iat = format!("{}[{i}]", s.at);
                self.instr(&iat, instr, &mut written, &mut ints)?;
                if let Some(l) = loss {
                    if instr_writes(instr).contains(&l) {
                        let right = match role.pipeline {
                            None => s.at.ends_with(".microbatch"),
                            Some(_) => {
                                s.at.ends_with(".forward")
                                    && s.chunk == plan.buffers[l as usize].chunk
                            }
                        };
                        if right {
                            let op = match instr {
                                Instr::Kernel { op, .. } => op.name(),
                                Instr::Zero { .. } => "zero",
                                Instr::Recv { .. } => "recv",
                                Instr::Send { .. } => "send",
                            };
                            loss_by = Some((iat.clone(), op));
                        }
                    }
                }
            }
        }
        if let Some(l) = loss {
            if let Some((by, op)) = loss_by.as_ref().filter(|(_, op)| *op != "cross_entropy") {
                return Err(invalid(
                    format!("{at}.results.loss"),
                    format!(
                        "buffer {l} ({}) is last written by {by} (`{op}`), not by a cross_entropy",
                        plan.buffers[l as usize].name
                    ),
                ));
            }
            if loss_by.is_none() {
                let what = match role.pipeline {
                    None => "the micro-batch program".to_string(),
                    Some(_) => format!(
                        "the forward of its chunk ({:?}) on this role",
                        plan.buffers[l as usize].chunk
                    ),
                };
                return Err(invalid(
                    format!("{at}.results.loss"),
                    format!("buffer {l} is never written by {what}"),
                ));
            }
        }
        // A training role (one with a gradient norm) computes the gradient of every
        // parameter it holds before its optimizer runs.
        if role.results.contains_key("grad_norm") {
            let grads: std::collections::HashSet<BufId> = streams[..streams.len() - 1]
                .iter()
                .flat_map(|s| s.instrs.iter().flat_map(instr_writes))
                .collect();
            for (i, p) in plan.params.iter().enumerate() {
                // A training plan's parameters all have one (`param` checks it).
                let Some(grad) = p.grad else { continue };
                let g = &plan.buffers[grad as usize];
                if g.stage.is_some_and(|s| s != stage) {
                    continue;
                }
                if !grads.contains(&grad) {
                    return Err(invalid(
                        format!("params[{i}].grad"),
                        format!(
                            "buffer {} ({}) is never written by the programs of role {} before its optimizer (a truncated program?)",
                            grad, g.name, role.name
                        ),
                    ));
                }
            }
        }
        if let Some(&g) = role.results.get("grad_norm") {
            if !role.optimizer.iter().any(|i| instr_writes(i).contains(&g)) {
                return Err(invalid(
                    format!("{at}.results.grad_norm"),
                    format!("buffer {g} is never written by the optimizer program"),
                ));
            }
        }
        Ok(())
    }

    /// Persistent state keeps apart: the buffers of distinct parameters (value, gradient,
    /// moments, tied copies) and all optimizer state never share memory (flat segments of
    /// the distributed optimizer may cover whole parameters), and each moment buffer is
    /// always the same moment of `adamw` (a first moment used as a second one goes negative).
    fn state(&self, r: usize, stage: u32, streams: &[Stream]) -> Result<(), PlanError> {
        let plan = self.plan;
        let mut owned: Vec<(BufId, String)> = Vec::new();
        for (i, p) in plan.params.iter().enumerate() {
            let here = |b: BufId| plan.buffers[b as usize].stage.is_none_or(|s| s == stage);
            let mut add = |b: BufId, field: String| {
                if here(b) {
                    owned.push((b, format!("params[{i}].{field}")));
                }
            };
            add(p.buffer, "buffer".into());
            if let Some(g) = p.grad {
                add(g, "grad".into());
            }
            if let Some(m) = p.exp_avg {
                add(m, "exp_avg".into());
            }
            if let Some(v) = p.exp_avg_sq {
                add(v, "exp_avg_sq".into());
            }
            for (k, &c) in p.tied_copies.iter().enumerate() {
                add(c, format!("tied_copies[{k}]"));
            }
        }
        let mut moment: HashMap<BufId, (usize, String)> = HashMap::new();
        for s in streams {
            for (i, instr) in s.instrs.iter().enumerate() {
                if let Instr::Kernel {
                    op: OpKind::AdamW { .. },
                    outputs,
                    ..
                } = instr
                {
                    for (k, &o) in outputs.iter().enumerate().skip(1) {
                        let at = format!("{}[{i}].out[{k}]", s.at);
                        if let Some((prev, where_)) = moment.insert(o, (k, at.clone())) {
                            return Err(invalid(
                                at,
                                format!(
                                    "buffer {o} ({}) is already {} at {where_}",
                                    plan.buffers[o as usize].name,
                                    if prev == k {
                                        "updated by another adamw"
                                    } else if prev == 1 {
                                        "a first moment (exp_avg)"
                                    } else {
                                        "a second moment (exp_avg_sq)"
                                    }
                                ),
                            ));
                        }
                        owned.push((o, at));
                    }
                }
            }
        }
        owned.sort_by_key(|&(b, _)| {
            let buf = &plan.buffers[b as usize];
            (buf.class.index(), bytes(buf).0, b)
        });
        owned.dedup_by_key(|(b, _)| *b);
        for w in owned.windows(2) {
            let ((a, at_a), (b, at_b)) = (&w[0], &w[1]);
            if self.overlap(*a, *b) {
                let (x, y) = (&plan.buffers[*a as usize], &plan.buffers[*b as usize]);
                return Err(invalid(
                    format!("buffers[{b}].offset"),
                    format!(
                        "{} ({at_b}) at [{}, {}) overlaps {} ({at_a}) at [{}, {}) in the {} arena of role {}",
                        y.name,
                        y.offset,
                        y.offset.saturating_add(y.len()),
                        x.name,
                        x.offset,
                        x.offset.saturating_add(x.len()),
                        y.class.name(),
                        plan.roles[r].name
                    ),
                ));
            }
        }
        Ok(())
    }

    fn memory(&self, rank: usize) -> &'p MemoryPlan {
        self.plan.memory_of(rank)
    }

    fn input_buffer(&self, b: BufId, at: &str) -> Result<(), PlanError> {
        let buf = self.want(b, at, BufferClass::Input, DType::I32)?;
        let batch = &self.plan.batch;
        let cp_split = buf.layout.get(1).is_some_and(|a| a.contains(&Axis::Cp));
        let cp = if cp_split {
            self.plan.mesh.size(Axis::Cp)
        } else {
            1
        };
        let ok = buf.shape.len() == 2
            && buf.shape[0] == batch.micro_batch
            && buf.shape[1].checked_mul(cp) == Some(batch.seq_len);
        if !ok {
            return Err(invalid(
                at,
                format!(
                    "buffer {b} ({}) has shape {:?}, but a micro-batch is [{}, {}]{}",
                    buf.name,
                    buf.shape,
                    batch.micro_batch,
                    batch.seq_len,
                    if cp_split {
                        format!(" (split over cp = {cp})")
                    } else {
                        String::new()
                    }
                ),
            ));
        }
        Ok(())
    }

    /// Every buffer role `r` touches (its programs' and the parameters of its stage) is held
    /// by its stage and lies inside its arenas on every rank.
    fn arenas(
        &self,
        r: usize,
        rank: usize,
        stage: u32,
        chunks: &BTreeMap<u32, &crate::plan::ChunkProgram>,
        streams: &[Stream],
    ) -> Result<(), PlanError> {
        let plan = self.plan;
        let mem = self.memory(rank);
        let mut first_use: Vec<Option<String>> = vec![None; plan.buffers.len()];
        for s in streams {
            for (i, instr) in s.instrs.iter().enumerate() {
                for (k, b) in operands(instr) {
                    let at = format!("{}[{i}].{k}", s.at);
                    let buf = self.buf(b, &at)?;
                    if buf.stage.is_some_and(|x| x != stage) {
                        return Err(invalid(
                            at,
                            format!(
                                "buffer {b} ({}) lives on pipeline stage {:?}, but role {} runs on stage {stage}",
                                buf.name, buf.stage, plan.roles[r].name
                            ),
                        ));
                    }
                    if let Some(c) = buf.chunk {
                        if !chunks.contains_key(&c) {
                            return Err(invalid(
                                at,
                                format!(
                                    "buffer {b} ({}) is an activation of chunk {c}, which role {} does not hold",
                                    buf.name, plan.roles[r].name
                                ),
                            ));
                        }
                    }
                    first_use[b as usize].get_or_insert(at);
                }
            }
        }
        let role = &plan.roles[r];
        let named = role
            .inputs
            .iter()
            .map(|(n, b)| (format!("inputs.{n}"), *b))
            .chain(
                role.results
                    .iter()
                    .map(|(n, b)| (format!("results.{n}"), *b)),
            );
        for (name, b) in named {
            let buf = &plan.buffers[b as usize];
            if buf.stage.is_some_and(|x| x != stage) {
                return Err(invalid(
                    format!("roles[{r}].{name}"),
                    format!(
                        "buffer {b} ({}) lives on pipeline stage {:?}, but role {} runs on stage {stage}",
                        buf.name, buf.stage, role.name
                    ),
                ));
            }
            if let Some(c) = buf.chunk.filter(|c| !chunks.contains_key(c)) {
                return Err(invalid(
                    format!("roles[{r}].{name}"),
                    format!(
                        "buffer {b} ({}) is an activation of chunk {c}, which role {} does not hold",
                        buf.name, role.name
                    ),
                ));
            }
            first_use[b as usize].get_or_insert_with(|| format!("roles[{r}].{name}"));
        }
        for (i, p) in plan.params.iter().enumerate() {
            for b in std::iter::once(p.buffer).chain(p.tied_copies.iter().copied()) {
                let buf = &plan.buffers[b as usize];
                if buf.stage.is_none_or(|s| s == stage) {
                    first_use[b as usize].get_or_insert_with(|| format!("params[{i}]"));
                }
            }
        }
        // Pipeline chunks' slot regions are disjoint or one pool (the same base, slot size
        // and count: its chunks take turns, a slot at a time), and no other activation lies
        // in one.
        let regions: Vec<(u32, u64, u64)> = chunks
            .values()
            .map(|c| {
                let end = c.activation_base + c.activation_elems * u64::from(c.slots);
                (c.chunk, c.activation_base * 4, end * 4)
            })
            .collect();
        for (k, &(c, s, e)) in regions.iter().enumerate() {
            for &(d, t, f) in &regions[..k] {
                let pooled = chunks[&c].pool_key() == chunks[&d].pool_key()
                    && chunks[&c].activation_elems == chunks[&d].activation_elems
                    && chunks[&c].slots == chunks[&d].slots;
                if s < f && t < e && !pooled {
                    return Err(invalid(
                        format!("roles[{r}].pipeline.chunks"),
                        format!(
                            "the activation slots of chunk {c} ([{s}, {e})) overlap those of chunk {d} ([{t}, {f}))"
                        ),
                    ));
                }
            }
        }
        for (id, used) in first_use.iter().enumerate() {
            if used.is_none() {
                continue;
            }
            let b = &plan.buffers[id];
            if b.class == BufferClass::Activation && b.chunk.is_none() && !b.is_empty() {
                let (s, e) = bytes(b);
                if let Some(&(c, t, f)) = regions.iter().find(|&&(_, t, f)| s < f && t < e) {
                    return Err(invalid(
                        format!("buffers[{id}].offset"),
                        format!(
                            "activation {} at bytes [{s}, {e}) lies in the activation slots of chunk {c} (bytes [{t}, {f}))",
                            b.name
                        ),
                    ));
                }
            }
        }
        for (id, used) in first_use.iter().enumerate() {
            if used.is_none() {
                continue;
            }
            let b = &plan.buffers[id];
            let at = format!("buffers[{id}]");
            let arena = match b.class {
                BufferClass::Param => mem.param_bytes,
                BufferClass::Grad => mem.grad_bytes,
                BufferClass::OptState => mem.opt_state_bytes,
                BufferClass::Activation => mem.activation_bytes,
                BufferClass::Input => mem.input_bytes,
                BufferClass::KvCache => mem.kv_cache_bytes,
            } / b.dtype.size_bytes();
            let (end, limit, what) = match b.chunk {
                Some(c) => {
                    // Slots are sized in 4-byte units; offsets in the buffer's dtype.
                    let elems = chunks.get(&c).map_or(0, |c| c.activation_elems);
                    let limit = elems.saturating_mul(4) / b.dtype.size_bytes();
                    (
                        b.offset.checked_add(b.len()),
                        limit,
                        format!("a chunk-{c} activation slot of {limit} elements"),
                    )
                }
                None => {
                    let far = b.rank_offset.as_ref().map_or(Some(0), |ro| {
                        (ro.count(&plan.mesh).max(1) - 1).checked_mul(ro.stride)
                    });
                    (
                        far.and_then(|f| f.checked_add(b.offset))
                            .and_then(|x| x.checked_add(b.len())),
                        arena,
                        format!(
                            "the {} arena of {arena} elements ({} bytes) of role {}",
                            b.class.name(),
                            arena * b.dtype.size_bytes(),
                            plan.roles[r].name
                        ),
                    )
                }
            };
            if end.is_none_or(|e| e > limit) {
                return Err(invalid(
                    format!("{at}.offset"),
                    format!(
                        "{} elements at offset {}{} do not fit {what}",
                        b.len(),
                        b.offset,
                        match &b.rank_offset {
                            Some(ro) => format!(
                                " (+ {} × {} on the farthest rank)",
                                ro.count(&plan.mesh).max(1) - 1,
                                ro.stride
                            ),
                            None => String::new(),
                        }
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Check one instruction (its operands exist and are held: [`Gate::arenas`]) and
    /// follow what it writes.
    fn instr(
        &self,
        at: &str,
        instr: &Instr,
        written: &mut Written,
        ints: &mut HashMap<BufId, IntSource>,
    ) -> Result<(), PlanError> {
        let plan = self.plan;
        let buffers = &plan.buffers;
        match instr {
            Instr::Zero { buffer } => {
                let b = &buffers[*buffer as usize];
                if b.dtype == DType::I32
                    || matches!(b.class, BufferClass::Input | BufferClass::KvCache)
                {
                    return Err(invalid(
                        format!("{at}.out[0]"),
                        format!(
                            "zero clears float buffers (not caches); buffer {buffer} ({}) is {} {}",
                            b.name,
                            b.class.name(),
                            b.dtype.as_str()
                        ),
                    ));
                }
                written.mark(*buffer, &buffers[*buffer as usize], at);
                ints.remove(buffer);
            }
            Instr::Send {
                buffer,
                chunk: c,
                twin,
                ..
            }
            | Instr::Recv {
                buffer,
                chunk: c,
                twin,
                ..
            } => {
                let send = matches!(instr, Instr::Send { .. });
                let b = &buffers[*buffer as usize];
                let slot = if send { "in[0]" } else { "out[0]" };
                if b.dtype == DType::I32
                    || matches!(b.class, BufferClass::Input | BufferClass::KvCache)
                {
                    return Err(invalid(
                        format!("{at}.{slot}"),
                        format!(
                            "transfers move float activations; buffer {buffer} ({}) is {} {}",
                            b.name,
                            b.class.name(),
                            b.dtype.as_str()
                        ),
                    ));
                }
                let total = plan
                    .roles
                    .iter()
                    .filter_map(|r| r.pipeline.as_ref().map(|p| p.chunks_total))
                    .max()
                    .unwrap_or(0);
                if *c >= total {
                    return Err(invalid(
                        format!("{at}.attrs.chunk"),
                        format!("chunk {c} does not exist (the model has {total} chunks)"),
                    ));
                }
                if *twin && plan.mesh.size(Axis::Fbd) != 2 {
                    return Err(invalid(
                        format!("{at}.attrs.twin"),
                        "a transfer to the FBD twin needs an fbd axis of size 2",
                    ));
                }
                if send {
                    self.read(at, "in[0]", *buffer, written)?;
                } else {
                    written.mark(*buffer, b, at);
                }
            }
            Instr::Kernel {
                op,
                inputs,
                outputs,
                path,
            } => {
                let at_op = || format!("{at} ({} {path})", op.name());
                op_rule(plan, op, inputs, outputs).map_err(|m| invalid(at_op(), m))?;
                // Caches: written only by `kv_attention` (its outputs 2 and 3), read by none.
                for (k, &o) in outputs.iter().enumerate() {
                    let cache_slot = matches!(op, OpKind::KvAttention { .. }) && k >= 2;
                    if (buffers[o as usize].class == BufferClass::KvCache) != cache_slot {
                        return Err(invalid(
                            format!("{at}.out[{k}]"),
                            format!(
                                "buffer {o} ({}) is {}; only kv_attention's outputs 2 and 3 are caches",
                                buffers[o as usize].name,
                                buffers[o as usize].class.name()
                            ),
                        ));
                    }
                }
                if let Some((k, &x)) = inputs
                    .iter()
                    .enumerate()
                    .find(|(_, &x)| buffers[x as usize].class == BufferClass::KvCache)
                {
                    return Err(invalid(
                        format!("{at}.in[{k}]"),
                        format!(
                            "buffer {x} ({}) is a cache, which only kv_attention reads (as its outputs)",
                            buffers[x as usize].name
                        ),
                    ));
                }
                // Integer operands: where they come from.
                for (k, &b) in inputs.iter().enumerate() {
                    let buf = &buffers[b as usize];
                    if buf.dtype != DType::I32 {
                        continue;
                    }
                    let want = int_input(plan, op, inputs);
                    match (want, buf.class, ints.get(&b)) {
                        (IntUse::Ids | IntUse::Position, BufferClass::Input, _) => {}
                        (IntUse::Position, _, _) => {
                            return Err(invalid(
                                format!("{at}.in[{k}]"),
                                format!(
                                    "`{}` reads the step's position from a data input; buffer {b} ({}) is {}",
                                    op.name(),
                                    buf.name,
                                    buf.class.name()
                                ),
                            ))
                        }
                        (IntUse::Ids, _, _) => {
                            return Err(invalid(
                                format!("{at}.in[{k}]"),
                                format!(
                                    "`{}` reads token ids or labels from the data inputs; buffer {b} ({}) is {}",
                                    op.name(),
                                    buf.name,
                                    buf.class.name()
                                ),
                            ))
                        }
                        (IntUse::Indices(e), _, Some(IntSource::Indices(n))) if *n <= e => {}
                        (IntUse::Counts, _, Some(IntSource::Counts)) => {}
                        (want, _, got) => {
                            return Err(invalid(
                                format!("{at}.in[{k}]"),
                                format!(
                                    "`{}` needs {} here; buffer {b} ({}) holds {}",
                                    op.name(),
                                    match want {
                                        IntUse::Indices(e) => format!("expert indices below {e}"),
                                        IntUse::Counts => "per-expert token counts".into(),
                                        IntUse::Ids => "token ids".into(),
                                        IntUse::Position => "the position".into(),
                                    },
                                    buf.name,
                                    match got {
                                        Some(IntSource::Indices(n)) =>
                                            format!("indices of a router over {n} experts"),
                                        Some(IntSource::Counts) => "token counts".into(),
                                        None => "nothing written by this program".into(),
                                    }
                                ),
                            ))
                        }
                    }
                }
                for (k, &b) in inputs.iter().enumerate() {
                    self.read(at, &format!("in[{k}]"), b, written)?;
                }
                // Outputs never overlap inputs or each other, except where the kernel works
                // in place by design.
                for (k, &o) in outputs.iter().enumerate() {
                    for (j, &x) in inputs.iter().enumerate() {
                        if in_place_ok(op, j, k, x == o) {
                            continue;
                        }
                        if self.overlap(o, x) {
                            return Err(invalid(
                                format!("{at}.out[{k}]"),
                                format!(
                                    "buffer {o} ({}) overlaps input {j}, buffer {x} ({}), in the {} arena; `{}` does not work in place",
                                    buffers[o as usize].name,
                                    buffers[x as usize].name,
                                    buffers[o as usize].class.name(),
                                    op.name()
                                ),
                            ));
                        }
                    }
                    for (j, &p) in outputs[..k].iter().enumerate() {
                        if self.overlap(o, p) {
                            return Err(invalid(
                                format!("{at}.out[{k}]"),
                                format!(
                                    "buffer {o} ({}) overlaps output {j}, buffer {p} ({})",
                                    buffers[o as usize].name, buffers[p as usize].name
                                ),
                            ));
                        }
                    }
                }
                for (k, &o) in outputs.iter().enumerate() {
                    written.mark(o, &buffers[o as usize], at);
                    ints.remove(&o);
                    match (op, k) {
                        (OpKind::Router { .. }, 1) => {
                            let e = buffers[inputs[0] as usize]
                                .shape
                                .last()
                                .copied()
                                .unwrap_or(0);
                            ints.insert(o, IntSource::Indices(e));
                        }
                        (OpKind::DispatchExperts { .. }, 1) => {
                            ints.insert(o, IntSource::Counts);
                        }
                        _ => {}
                    }
                }
            }
        }
        Ok(())
    }

    /// A read of buffer `b`: activations must have been written earlier in the role's
    /// programs (parameters, gradients, optimizer state and inputs are live from the start).
    fn read(&self, at: &str, slot: &str, b: BufId, written: &Written) -> Result<(), PlanError> {
        let buf = &self.plan.buffers[b as usize];
        if buf.class != BufferClass::Activation {
            return Ok(());
        }
        if let Some(why) = written.missing(buf) {
            return Err(invalid(
                format!("{at}.{slot}"),
                format!("reads activation buffer {b} ({}) {why}", buf.name),
            ));
        }
        Ok(())
    }

    /// Whether buffers `a` and `b` may share memory on some rank.
    fn overlap(&self, a: BufId, b: BufId) -> bool {
        let (x, y) = (
            &self.plan.buffers[a as usize],
            &self.plan.buffers[b as usize],
        );
        if a == b {
            return !x.is_empty();
        }
        if x.class != y.class || x.is_empty() || y.is_empty() {
            return false;
        }
        let range = |buf: &Buffer| -> (u64, u64) {
            let far = buf
                .rank_offset
                .as_ref()
                .map_or(0, |r| (r.count(&self.plan.mesh).max(1) - 1) * r.stride);
            let size = buf.dtype.size_bytes();
            (buf.offset * size, (buf.offset + far + buf.len()) * size)
        };
        match (x.chunk, y.chunk) {
            // Slot-relative offsets of one chunk: the same slot at run time.
            (Some(c), Some(d)) if c == d => {
                let ((xa, xb), (ya, yb)) = (bytes(x), bytes(y));
                xa < yb && ya < xb
            }
            // Different chunks' slots, or a slot and a chunk-less activation: the planner
            // keeps them apart; compare where they can be.
            (Some(_), _) | (_, Some(_)) => false,
            _ => {
                let (xa, xb) = range(x);
                let (ya, yb) = range(y);
                if x.rank_offset.is_some() || y.rank_offset.is_some() {
                    // Rank-dependent slices: compare on each coordinate of the axis.
                    return self.overlap_per_rank(x, y);
                }
                xa < yb && ya < xb
            }
        }
    }

    fn overlap_per_rank(&self, x: &Buffer, y: &Buffer) -> bool {
        let at = |buf: &Buffer, rank: usize| -> (u64, u64) {
            let o = buf.offset
                + buf
                    .rank_offset
                    .as_ref()
                    .map_or(0, |r| r.index(&self.plan.mesh, rank) * r.stride);
            let size = buf.dtype.size_bytes();
            (o * size, (o + buf.len()) * size)
        };
        // Ranks that differ along the buffers' axes: one representative per coordinate pair.
        let axes: Vec<Axis> = [&x.rank_offset, &y.rank_offset]
            .iter()
            .filter_map(|r| r.as_ref().map(RankOffset::axes))
            .flatten()
            .collect();
        let group = self.plan.mesh.group(0, &axes);
        group.into_iter().any(|rank| {
            let ((xa, xb), (ya, yb)) = (at(x, rank), at(y, rank));
            xa < yb && ya < xb
        })
    }

    /// The reported loss reaches rank 0: rank 0's role has it, or its loss reduction group
    /// includes a rank whose role has it.
    fn loss_reaches_rank_0(&self) -> Result<(), PlanError> {
        let plan = self.plan;
        let role0 = &plan.roles[plan.rank_to_role[0] as usize];
        let has = |rank: usize| {
            plan.roles[plan.rank_to_role[rank] as usize]
                .results
                .contains_key("loss")
        };
        let group = match role0.result_axes.get("loss") {
            Some(axes) if !axes.is_empty() => plan.mesh.group(0, axes),
            _ => vec![0],
        };
        if !group.iter().any(|&r| has(r)) {
            return Err(invalid(
                format!("roles[{}].result_axes.loss", plan.rank_to_role[0]),
                format!(
                    "rank 0 reports the loss summed over ranks {group:?}, none of which computes one"
                ),
            ));
        }
        Ok(())
    }
}

/// The activations whose values a role's programs have written and not overwritten since,
/// by where they live: (chunk slot or none, first element) -> (end, who wrote it). A view
/// (`split_heads`, `merge_heads`) is an alias of the buffer it views (same place), so
/// writing one writes the other; a write over part of a live value ends that value.
#[derive(Default)]
struct Written {
    live: BTreeMap<(Option<u32>, u64), (u64, BufId)>,
    /// Values that ended: (chunk, first element, end) -> the instruction that overwrote them.
    ended: HashMap<(Option<u32>, u64, u64), String>,
}

impl Written {
    fn range(b: &Buffer) -> (Option<u32>, u64, u64) {
        let (s, e) = bytes(b);
        (b.chunk, s, e)
    }

    fn mark(&mut self, id: BufId, b: &Buffer, at: &str) {
        if b.class != BufferClass::Activation || b.is_empty() {
            return;
        }
        let (c, s, e) = Written::range(b);
        // Live values that overlap [s, e): the one starting before s, and those inside.
        let mut gone: Vec<(u64, u64)> = Vec::new();
        if let Some((&(pc, ps), &(pe, _))) = self.live.range(..(c, s)).next_back() {
            if pc == c && pe > s {
                gone.push((ps, pe));
            }
        }
        for (&(_, qs), &(qe, _)) in self.live.range((c, s)..(c, e)) {
            gone.push((qs, qe));
        }
        for (gs, ge) in gone {
            self.live.remove(&(c, gs));
            if (gs, ge) != (s, e) {
                self.ended
                    .insert((c, gs, ge), format!("{at} (buffer {id}, {})", b.name));
            }
        }
        self.ended.remove(&(c, s, e));
        self.live.insert((c, s), (e, id));
    }

    /// None if `b`'s value is live, else why not.
    fn missing(&self, b: &Buffer) -> Option<String> {
        let (c, s, e) = Written::range(b);
        if b.is_empty() || self.live.get(&(c, s)).is_some_and(|&(end, _)| end == e) {
            return None;
        }
        Some(match self.ended.get(&(c, s, e)) {
            Some(by) => format!("after {by} overwrote it"),
            None => "before any instruction of the program writes it".to_string(),
        })
    }
}

/// What an i32 operand of a kernel must hold.
#[derive(Clone, Copy, Debug)]
enum IntUse {
    /// Token ids or labels (the data inputs).
    Ids,
    /// Expert indices of a router over at most this many experts.
    Indices(u64),
    /// Per-expert token counts.
    Counts,
    /// KV-cache decoding's step position (a data input).
    Position,
}

/// What the i32 operand of `op` (its only one) must hold; for expert indices, the number of
/// experts the kernel routes to (the router that wrote them must have no more).
fn int_input(plan: &Plan, op: &OpKind, ins: &[BufId]) -> IntUse {
    let dim0 = |k: usize| {
        ins.get(k)
            .and_then(|&b| plan.buffers[b as usize].shape.first().copied())
            .unwrap_or(0)
    };
    match op {
        OpKind::AllToAll { .. } => IntUse::Counts,
        OpKind::RopeAt { .. } | OpKind::PosEmbeddingAt | OpKind::KvAttention { .. } => {
            IntUse::Position
        }
        OpKind::Embedding
        | OpKind::EmbeddingGrad
        | OpKind::CrossEntropy
        | OpKind::CrossEntropyGrad => IntUse::Ids,
        OpKind::MoeAuxLoss { .. } | OpKind::MoeAuxLossGrad { .. } => IntUse::Indices(
            ins.first()
                .and_then(|&b| plan.buffers[b as usize].shape.last().copied())
                .unwrap_or(0),
        ),
        OpKind::DispatchExperts { experts, .. } => IntUse::Indices(*experts),
        OpKind::DispatchExpertsGrad => IntUse::Indices(dim0(0)),
        OpKind::CombineExperts | OpKind::CombineExpertsGrad => IntUse::Indices(dim0(2)),
        OpKind::Combine => IntUse::Indices(ins.len().saturating_sub(2) as u64),
        OpKind::CombineGrad => IntUse::Indices(ins.len().saturating_sub(3) as u64),
        // A single expert's dispatch routes to as many experts as the indices name.
        _ => IntUse::Indices(u64::MAX),
    }
}

/// Kernels that may write an output over an input: `adamw` updates the parameter it reads
/// (input 0 is output 0), `all_reduce` reduces in place, `all_gather` and `reduce_scatter`
/// copy their input before writing.
///
/// `input` and `output` index the kernel's operands; `same` says whether they are one buffer.
/// The runtime's memory re-checks this rule in debug builds.
pub fn in_place_ok(op: &OpKind, input: usize, output: usize, same: bool) -> bool {
    match op {
        OpKind::AdamW { .. } => input == 0 && output == 0 && same,
        OpKind::AllReduce { .. } => same,
        OpKind::AllGather { .. } | OpKind::ReduceScatter { .. } => true,
        _ => false,
    }
}

/// Buffers an instruction writes.
fn instr_writes(instr: &Instr) -> Vec<BufId> {
    match instr {
        Instr::Kernel { outputs, .. } => outputs.clone(),
        Instr::Zero { buffer } | Instr::Recv { buffer, .. } => vec![*buffer],
        Instr::Send { .. } => Vec::new(),
    }
}

/// Every operand of an instruction with its JSON field (`in[1]`, `out[0]`).
fn operands(instr: &Instr) -> Vec<(String, BufId)> {
    match instr {
        Instr::Kernel {
            inputs, outputs, ..
        } => inputs
            .iter()
            .enumerate()
            .map(|(k, &b)| (format!("in[{k}]"), b))
            .chain(
                outputs
                    .iter()
                    .enumerate()
                    .map(|(k, &b)| (format!("out[{k}]"), b)),
            )
            .collect(),
        Instr::Send { buffer, .. } => vec![("in[0]".into(), *buffer)],
        Instr::Zero { buffer } | Instr::Recv { buffer, .. } => vec![("out[0]".into(), *buffer)],
    }
}

/// Where a buffer lies, in bytes from the start of its arena (or chunk slot), on a rank
/// without a rank-dependent part.
fn bytes(b: &Buffer) -> (u64, u64) {
    let size = b.dtype.size_bytes();
    (
        b.offset.saturating_mul(size),
        b.offset.saturating_add(b.len()).saturating_mul(size),
    )
}
