//! Plan emission: turns the compiled Graph IR (after the optimizer pass) into a [`Plan`]:
//! a buffer table, the per-micro-batch and per-step instruction streams, the parameter map,
//! and a static memory plan that reuses activation memory by liveness.
//!
//! Plans cover every layout of the mesh (dp, tp, sp, cp, ep, the distributed optimizer):
//! ranks that run the same program share a role. With pp > 1, [`pipeline`] splits the
//! lowering into one role per pipeline stage (and FBD's forward roles).
//!
//! This file holds the public API and the emission itself (graph -> buffers and
//! instructions); the optimizer program's gradient reduction is in `bucket` (all-reduce
//! buckets) or `zero1` (the distributed optimizer), both `impl Emitter` blocks, and the
//! liveness placement of activations in `memory`.

#![warn(missing_docs)]

mod bucket;
pub mod fuse;
pub mod kv;
mod memory;
#[cfg(feature = "mlir")]
pub mod mlir;
pub mod pipeline;
mod zero1;

use std::collections::BTreeMap;
use std::path::Path;

use megac_ir::plan::{
    BatchInfo, BufId, Buffer, BufferClass, Init, Instr, LrSchedule, MemoryPlan, ParamEntry, Plan,
    PlanKind, Role, TrainInfo, SCHEMA_VERSION,
};
use megac_ir::spec::ModelSpec;
use megac_ir::{Graph, OpKind, ValueDef, ValueId};

/// Why a plan could not be emitted or written.
#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    /// The layout or model needs a compiler feature that does not exist yet.
    #[error("{0}")]
    Unsupported(String),
    /// The graph is not the output of the full pass pipeline.
    #[error("codegen needs the graph after the optimizer pass: {0}")]
    Incomplete(String),
    /// Writing the plan failed.
    #[error("cannot write the plan to {path}: {message}")]
    Write {
        /// The plan directory.
        path: String,
        /// What failed.
        message: String,
    },
}

/// Emit the plan of `graph` (the pipeline's output) for `spec`.
pub fn emit_plan(
    spec: &ModelSpec,
    graph: &Graph,
    flops_per_step: f64,
) -> Result<Plan, CodegenError> {
    emit(spec, graph, flops_per_step, PlanKind::Train)
}

/// Emit the inference plan of `graph`, a forward-only graph (the `build` and `shard`
/// passes, `megac_passes::run_inference_pipeline`): the micro-batch program is the
/// forward up to the loss, parameters get no gradient or optimizer state, and there is no
/// optimizer program, so the plan's gradient and optimizer arenas are empty.
pub fn emit_inference_plan(
    spec: &ModelSpec,
    graph: &Graph,
    flops_per_step: f64,
) -> Result<Plan, CodegenError> {
    if spec.parallel.fbd {
        return Err(CodegenError::Unsupported(
            "an inference plan has no backward to decouple: set parallel.fbd = false".into(),
        ));
    }
    emit(spec, graph, flops_per_step, PlanKind::Inference)
}

fn emit(
    spec: &ModelSpec,
    graph: &Graph,
    flops_per_step: f64,
    kind: PlanKind,
) -> Result<Plan, CodegenError> {
    let p = &spec.parallel;
    let m = &spec.model;
    if p.fbd && p.pp < 2 {
        return Err(CodegenError::Unsupported(
            "parallel.fbd = true decouples the forward and backward of pipeline stages: set parallel.pp to 2 or more".into(),
        ));
    }
    if p.cp > 1 && m.moe.as_ref().is_some_and(|moe| moe.capacity_factor > 0.0) {
        return Err(CodegenError::Unsupported(
            "token dropping (model.moe.capacity_factor > 0) with context parallelism is not supported; use a dropless MoE with cp".into(),
        ));
    }
    let mut e = Emitter::new(spec, graph);
    e.inference = kind == PlanKind::Inference;
    e.emit()?;
    if p.pp > 1 {
        let split = pipeline::split(&mut e)?;
        let mesh = &graph.mesh;
        // Backward (or only) roles are 0..pp, FBD's forward roles pp..2pp.
        let rank_to_role = (0..mesh.world_size())
            .map(|r| {
                let pp = mesh.size(megac_ir::Axis::Pp) as usize;
                (mesh.coord(r, megac_ir::Axis::Pp) + pp * mesh.coord(r, megac_ir::Axis::Fbd)) as u32
            })
            .collect();
        let mut plan = e.into_plan(split.roles, rank_to_role, split.memory, flops_per_step);
        memory::add_staging(&mut plan);
        return Ok(plan);
    }
    if kind == PlanKind::Inference {
        // No gradients to reduce.
    } else if p.distributed_optimizer && p.dp * p.cp > 1 {
        e.zero1()?;
    } else {
        e.bucket_reductions();
    }
    let activation_bytes_unplanned = e.unplanned_activation_bytes();
    let liveness = e.programs_for_liveness();
    let mut live_to_end = e.live_to_end.clone();
    live_to_end.extend(e.probes.iter().copied());
    let activation_arena = memory::assign_offsets(&mut e.buffers, &liveness, &live_to_end);
    let live_bytes = memory::live_peak(&e.buffers, &liveness, &live_to_end);
    // Arena extents (buffers may overlap: views, buckets, the distributed optimizer's
    // flat buffers), with rank-dependent slices at their farthest rank.
    let mesh = &graph.mesh;
    let bytes = |class: BufferClass| -> u64 {
        e.buffers
            .iter()
            .filter(|b| b.class == class)
            .map(|b| b.far_end(mesh) * b.dtype.size_bytes())
            .max()
            .unwrap_or(0)
    };
    let memory = MemoryPlan {
        param_bytes: bytes(BufferClass::Param),
        grad_bytes: bytes(BufferClass::Grad),
        opt_state_bytes: bytes(BufferClass::OptState),
        activation_bytes: activation_arena,
        activation_bytes_unplanned,
        activation_bytes_live: live_bytes,
        input_bytes: bytes(BufferClass::Input),
        staging_bytes: 0,
        kv_cache_bytes: 0,
    };
    let roles = vec![Role {
        name: "rank".into(),
        microbatch: std::mem::take(&mut e.microbatch),
        optimizer: std::mem::take(&mut e.optimizer),
        inputs: std::mem::take(&mut e.inputs),
        results: std::mem::take(&mut e.results),
        result_axes: std::mem::take(&mut e.result_axes),
        pipeline: None,
        memory: None,
        decode: None,
    }];
    let rank_to_role = vec![0; graph.mesh.world_size()];
    let mut plan = e.into_plan(roles, rank_to_role, memory, flops_per_step);
    memory::add_staging(&mut plan);
    Ok(plan)
}

/// The plan's learning-rate schedule for `spec`.
pub fn lr_schedule(spec: &ModelSpec) -> LrSchedule {
    match &spec.train.lr_schedule {
        Some(s) => LrSchedule::Cosine {
            warmup_steps: s.warmup_steps,
            decay_steps: s.decay_steps,
            min_lr: s.min_lr,
        },
        None => LrSchedule::Constant,
    }
}

/// Write `plan` to `dir/plan.json`, atomically: the file appears whole or not at all.
pub fn write_plan(plan: &Plan, dir: &Path) -> Result<(), CodegenError> {
    megac_ir::file::write_atomic(&dir.join("plan.json"), plan.to_json()).map_err(|e| {
        CodegenError::Write {
            path: dir.display().to_string(),
            message: e.to_string(),
        }
    })
}

/// The initialisation of parameter `name` of `shape` (Hugging Face's `_init_weights`:
/// normal(0, 0.02) for matrices, GPT-2's residual projections scaled by 1/sqrt(2·layers),
/// ones for norm weights, zeros for biases).
pub fn init_for(spec: &ModelSpec, name: &str, shape: &[u64]) -> Init {
    if name.ends_with(".bias") {
        Init::Zeros
    } else if shape.len() == 1 {
        Init::Ones
    } else if spec.model.arch == megac_ir::spec::Arch::Gpt && name.ends_with("c_proj.weight") {
        Init::Normal {
            std: 0.02 / (2.0 * spec.model.layers as f64).sqrt(),
        }
    } else {
        Init::Normal { std: 0.02 }
    }
}

/// The lowering state: the buffer table, parameters and instruction streams built from the
/// graph, extended by `bucket`, `zero1` and `pipeline`.
struct Emitter<'a> {
    spec: &'a ModelSpec,
    g: &'a Graph,
    buffers: Vec<Buffer>,
    /// IR value -> buffer.
    buf_of: BTreeMap<ValueId, BufId>,
    params: Vec<ParamEntry>,
    microbatch: Vec<Instr>,
    optimizer: Vec<Instr>,
    inputs: BTreeMap<String, BufId>,
    results: BTreeMap<String, BufId>,
    result_axes: BTreeMap<String, Vec<megac_ir::Axis>>,
    /// Activation buffers read after the micro-batch program (results).
    live_to_end: Vec<BufId>,
    /// The results of `probe` instructions (live to the end of the forward: the runtime
    /// reads them after it).
    probes: Vec<BufId>,
    /// Views: buffer -> the buffer whose storage it shares.
    view_of: BTreeMap<BufId, BufId>,
    /// An inference plan: no gradients, optimizer state or optimizer program.
    inference: bool,
}

impl<'a> Emitter<'a> {
    fn new(spec: &'a ModelSpec, g: &'a Graph) -> Self {
        Emitter {
            spec,
            g,
            buffers: Vec::new(),
            buf_of: BTreeMap::new(),
            params: Vec::new(),
            microbatch: Vec::new(),
            optimizer: Vec::new(),
            inputs: BTreeMap::new(),
            results: BTreeMap::new(),
            result_axes: BTreeMap::new(),
            live_to_end: Vec::new(),
            probes: Vec::new(),
            view_of: BTreeMap::new(),
            inference: false,
        }
    }

    /// Local (micro-batch) sizes of a value: the global batch dim becomes the micro-batch.
    fn local_shape(&self, v: ValueId) -> Vec<u64> {
        let t = &self.spec.train;
        let ty = self.g.ty(v);
        ty.dims
            .iter()
            .zip(&ty.layout.shards)
            .map(|(d, axes)| {
                if d.name == "b" {
                    // The global batch becomes one data-parallel rank's micro-batch.
                    t.micro_batch
                } else if d.name == "tokens" {
                    // MoE token rows: one micro-batch's tokens (its share under cp) or the
                    // capacity; on the experts' ranks (experts split over ep) the rows of
                    // the whole ep group.
                    let base = if d.dynamic {
                        d.size * t.micro_batch / t.global_batch
                    } else {
                        d.size
                    };
                    // Every source rank's rows are its cp share of the micro-batch, on the
                    // tokens' ranks and on the experts' ranks alike (there the tokens dim is
                    // split over edp, which does not name cp).
                    let mesh = &self.g.mesh;
                    let cp = mesh.size(megac_ir::Axis::Cp);
                    let on_experts = ty
                        .layout
                        .shards
                        .first()
                        .is_some_and(|a| a.contains(&megac_ir::Axis::Ep));
                    let ep = if on_experts {
                        mesh.size(megac_ir::Axis::Ep)
                    } else {
                        1
                    };
                    base / cp * ep
                } else if d.dynamic {
                    d.size * t.micro_batch / t.global_batch
                } else {
                    let parts: u64 = axes
                        .iter()
                        .filter(|&&a| a != megac_ir::Axis::Dp)
                        .map(|&a| self.g.mesh.size(a))
                        .product();
                    d.size / parts
                }
            })
            .collect()
    }

    /// The non-batch shardings of a value's dims, for the plan's buffer table.
    fn layout_of(&self, v: ValueId) -> Vec<Vec<megac_ir::Axis>> {
        let l = &self.g.ty(v).layout;
        let shards: Vec<Vec<megac_ir::Axis>> = l
            .shards
            .iter()
            .map(|axes| {
                axes.iter()
                    .copied()
                    .filter(|&a| a != megac_ir::Axis::Dp)
                    .collect()
            })
            .collect();
        if shards.iter().all(Vec::is_empty) {
            Vec::new()
        } else {
            shards
        }
    }

    fn new_buffer(
        &mut self,
        name: String,
        class: BufferClass,
        v: ValueId,
        shape: Vec<u64>,
    ) -> BufId {
        let id = self.buffers.len() as BufId;
        let routed_rows = self.routed_rows(v, &shape);
        self.buffers.push(Buffer {
            name,
            class,
            dtype: self.g.ty(v).dtype,
            shape,
            offset: 0,
            layout: self.layout_of(v),
            rank_offset: None,
            stage: None,
            chunk: None,
            routed_rows,
            partial: Vec::new(),
        });
        id
    }

    /// For MoE token rows (a `tokens` dim sized for every token choosing the expert, or the
    /// capacity): the rows of each expert block a balanced router fills, `top_k / experts`
    /// of each source rank's tokens, at most the block's rows.
    fn routed_rows(&self, v: ValueId, shape: &[u64]) -> Option<u64> {
        let ty = self.g.ty(v);
        let i = ty.dims.iter().position(|d| d.name == "tokens")?;
        let moe = self.spec.model.moe.as_ref()?;
        let t = &self.spec.train;
        // One source rank's tokens of a micro-batch, and the rows it may send each expert.
        let tokens = t.micro_batch * self.spec.model.seq_len / self.g.mesh.size(megac_ir::Axis::Cp);
        let d = &ty.dims[i];
        let rows_per_source = if d.dynamic { tokens } else { d.size };
        let rows = *shape.get(i)?;
        let filled = (rows * moe.top_k * tokens).div_ceil((moe.experts * rows_per_source).max(1));
        Some(filled.min(rows))
    }

    /// A persistent buffer of `dtype`, placed after the class's others (offsets count
    /// elements of the buffer's own dtype; a class holds one dtype, so they pack).
    fn persistent(
        &mut self,
        name: String,
        class: BufferClass,
        dtype: megac_ir::DType,
        shape: &[u64],
        layout: &[Vec<megac_ir::Axis>],
    ) -> BufId {
        let id = self.buffers.len() as BufId;
        let bytes: u64 = self
            .buffers
            .iter()
            .filter(|b| b.class == class)
            .map(|b| b.len() * b.dtype.size_bytes())
            .sum();
        let offset = bytes.div_ceil(dtype.size_bytes());
        self.buffers.push(Buffer {
            name,
            class,
            dtype,
            shape: shape.to_vec(),
            offset,
            layout: layout.to_vec(),
            rank_offset: None,
            stage: None,
            chunk: None,
            routed_rows: None,
            partial: Vec::new(),
        });
        id
    }

    fn emit(&mut self) -> Result<(), CodegenError> {
        let g = self.g;
        let output_of = |name: &str| g.outputs.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
        let grad_outputs: BTreeMap<ValueId, String> = g
            .outputs
            .iter()
            .filter_map(|(n, v)| n.strip_prefix("grad:").map(|p| (*v, p.to_string())))
            .collect();
        if self.inference {
            if !grad_outputs.is_empty() || output_of("grad_norm").is_some() {
                return Err(CodegenError::Unsupported(
                    "an inference plan is emitted from the forward graph only (the build and \
                     shard passes), not from one with gradients"
                        .into(),
                ));
            }
        } else if grad_outputs.is_empty() || output_of("grad_norm").is_none() {
            return Err(CodegenError::Incomplete(
                "no gradients or optimizer step in the graph".into(),
            ));
        }
        // Parameters and their persistent companions.
        let mut grad_buf: BTreeMap<String, BufId> = BTreeMap::new();
        let mut param_entry: BTreeMap<ValueId, usize> = BTreeMap::new();
        for (v, name, ty) in g.params() {
            let global = ty.sizes();
            let shape = self.local_shape(v);
            let layout = self.layout_of(v);
            // The working weight in its dtype (16-bit under mixed precision); gradients,
            // moments and the master copy in f32 (Megatron's main_grad and main params).
            let f32 = megac_ir::DType::F32;
            let buffer = self.persistent(
                name.to_string(),
                BufferClass::Param,
                ty.dtype,
                &shape,
                &layout,
            );
            let grad = (!self.inference).then(|| {
                self.persistent(
                    format!("grad:{name}"),
                    BufferClass::Grad,
                    f32,
                    &shape,
                    &layout,
                )
            });
            let zero1 = self.spec.parallel.distributed_optimizer
                && self.spec.parallel.dp * self.spec.parallel.cp > 1;
            let state = |e: &mut Self, what: &str| {
                e.persistent(
                    format!("{what}:{name}"),
                    BufferClass::OptState,
                    f32,
                    &shape,
                    &layout,
                )
            };
            let (exp_avg, exp_avg_sq, master) = if zero1 || self.inference {
                (None, None, None)
            } else {
                (
                    Some(state(self, "exp_avg")),
                    Some(state(self, "exp_avg_sq")),
                    ty.dtype.is_half().then(|| state(self, "master")),
                )
            };
            self.buf_of.insert(v, buffer);
            if let Some(grad) = grad {
                grad_buf.insert(name.to_string(), grad);
            }
            param_entry.insert(v, self.params.len());
            let shards = g.ty(v).layout.shards.clone();
            let blocks: Vec<u64> = ty
                .dims
                .iter()
                .map(|d| {
                    d.name
                        .split_once('*')
                        .and_then(|(k, _)| k.parse().ok())
                        .unwrap_or(1)
                })
                .collect();
            let padded_vocab = global.first().copied().unwrap_or(0) > self.spec.model.vocab
                && g.ty(v).dims.first().is_some_and(|d| d.name == "vocab");
            let stacked = ty.dims.first().is_some_and(|d| d.name == "experts");
            self.params.push(ParamEntry {
                per_expert: (stacked && name.contains(".experts."))
                    .then(|| name.replacen(".experts.", ".experts.{}.", 1)),
                name: name.to_string(),
                hf_rows: padded_vocab.then_some(self.spec.model.vocab),
                blocks: if blocks.iter().all(|&b| b == 1) {
                    Vec::new()
                } else {
                    blocks
                },
                shards: if shards.iter().all(Vec::is_empty) {
                    Vec::new()
                } else {
                    shards
                },
                init: init_for(self.spec, name, &global),
                shape: global,
                buffer,
                grad,
                exp_avg,
                exp_avg_sq,
                master,
                tied_copies: Vec::new(),
            });
        }
        for (i, value) in g.values.iter().enumerate() {
            if let ValueDef::Input(name) = &value.def {
                let v = ValueId(i as u32);
                let shape = self.local_shape(v);
                let offset = self
                    .buffers
                    .iter()
                    .filter(|b| b.class == BufferClass::Input)
                    .map(Buffer::len)
                    .sum();
                let id = self.new_buffer(name.clone(), BufferClass::Input, v, shape);
                self.buffers[id as usize].offset = offset;
                // A pending sum (a `patch` replacement of one): the runtime fills one part.
                self.buffers[id as usize].partial = value.ty.layout.partial.clone();
                self.buf_of.insert(v, id);
                self.inputs.insert(name.clone(), id);
            }
        }

        for op in &g.ops {
            let ins: Vec<BufId> = op.inputs.iter().map(|v| self.buf_of[v]).collect();
            // The optimizer program: the norm, AdamW, and reductions of parameter gradients.
            let optimizer = match op.kind {
                OpKind::GradNorm { .. } | OpKind::AdamW { .. } => true,
                OpKind::AllReduce { .. } => {
                    self.buffers[ins[0] as usize].class == BufferClass::Grad
                }
                _ => false,
            };
            // Views share their operand's storage and need no instruction.
            if op.kind.is_view() {
                let src = ins[0];
                let out = op.outputs[0];
                let shape = self.local_shape(out);
                let class = self.buffers[src as usize].class;
                let id = self.new_buffer(format!("%{}", out.0), class, out, shape);
                let root = *self.view_of.get(&src).unwrap_or(&src);
                self.view_of.insert(id, root);
                self.buf_of.insert(out, id);
                continue;
            }
            let mut outs = Vec::new();
            if let OpKind::AdamW { .. } = op.kind {
                let entry = &self.params[param_entry[&op.inputs[0]]];
                outs = vec![entry.buffer];
                outs.extend(entry.exp_avg);
                outs.extend(entry.exp_avg_sq);
                outs.extend(entry.master);
                self.buf_of.insert(op.outputs[0], entry.buffer);
            } else if matches!(op.kind, OpKind::AllReduce { .. })
                && self.buffers[ins[0] as usize].class == BufferClass::Grad
            {
                // Gradients are reduced in place (and bucketed below).
                outs = vec![ins[0]];
                self.buf_of.insert(op.outputs[0], ins[0]);
            } else {
                for &out in &op.outputs {
                    let id = match grad_outputs.get(&out) {
                        Some(name) => grad_buf[name],
                        None => {
                            let shape = self.local_shape(out);
                            self.new_buffer(
                                format!("%{}", out.0),
                                BufferClass::Activation,
                                out,
                                shape,
                            )
                        }
                    };
                    self.buf_of.insert(out, id);
                    outs.push(id);
                }
            }
            let program = if optimizer {
                &mut self.optimizer
            } else {
                &mut self.microbatch
            };
            if op.kind.accumulates() {
                for &o in &outs {
                    if self.buffers[o as usize].class == BufferClass::Activation {
                        program.push(Instr::Zero { buffer: o });
                    }
                }
            }
            if matches!(op.kind, OpKind::Probe { .. }) {
                self.probes.extend(outs.iter().copied());
            }
            program.push(Instr::Kernel {
                op: op.kind.clone(),
                inputs: ins,
                outputs: outs,
                path: op.path.clone(),
            });
        }
        for (name, v) in &g.outputs {
            if name == "loss" || name == "total_loss" || name == "grad_norm" {
                let b = self.buf_of[v];
                self.results.insert(name.clone(), b);
                let partial = g.ty(*v).layout.partial.clone();
                if !partial.is_empty() {
                    self.result_axes.insert(name.clone(), partial);
                }
                if name != "grad_norm" {
                    self.live_to_end.push(b);
                }
            }
        }
        Ok(())
    }

    /// The plan of the emitted buffers and parameters with these roles and memory.
    fn into_plan(
        self,
        roles: Vec<Role>,
        rank_to_role: Vec<u32>,
        memory: MemoryPlan,
        flops_per_step: f64,
    ) -> Plan {
        let spec = self.spec;
        let (t, m, p) = (&spec.train, &spec.model, &spec.parallel);
        Plan {
            schema_version: SCHEMA_VERSION,
            model: spec.name.clone(),
            arch: m.arch.as_str().to_string(),
            mesh: self.g.mesh.clone(),
            cp_comm: p.cp_comm,
            batch: BatchInfo {
                micro_batch: t.micro_batch,
                global_batch: t.global_batch,
                seq_len: m.seq_len,
                vocab: m.vocab,
                microbatches: t.microbatches(p.dp),
                tokens_per_step: t.global_batch * m.seq_len,
            },
            train: TrainInfo {
                steps: t.steps,
                seed: t.seed,
                lr: t.lr,
                lr_schedule: lr_schedule(spec),
                precision: t.precision.as_str().to_string(),
                loss_scaler: t.loss_scaler,
            },
            buffers: self.buffers,
            params: self.params,
            roles,
            rank_to_role,
            memory,
            flops_per_step,
            cluster: spec.cluster.clone(),
            kind: if self.inference {
                PlanKind::Inference
            } else {
                PlanKind::Train
            },
            decode: None,
        }
    }

    /// A flat f32 buffer of `len` elements at `offset` of its `class` arena (a bucket or a
    /// ZeRO-1 segment or shard, overlapping the buffers it covers).
    /// A flat f32 buffer of `len` elements at `offset` of `class`'s arena.
    fn flat(&mut self, name: &str, class: BufferClass, offset: u64, len: u64) -> BufId {
        self.flat_of(name, class, megac_ir::DType::F32, offset, len)
    }

    /// A flat buffer of `dtype`.
    fn flat_of(
        &mut self,
        name: &str,
        class: BufferClass,
        dtype: megac_ir::DType,
        offset: u64,
        len: u64,
    ) -> BufId {
        let id = self.buffers.len() as BufId;
        self.buffers.push(Buffer {
            name: name.to_string(),
            class,
            dtype,
            shape: vec![len],
            offset,
            layout: Vec::new(),
            rank_offset: None,
            stage: None,
            chunk: None,
            routed_rows: None,
            partial: Vec::new(),
        });
        id
    }

    fn unplanned_activation_bytes(&self) -> u64 {
        self.buffers
            .iter()
            .enumerate()
            .filter(|(i, b)| {
                b.class == BufferClass::Activation && !self.view_of.contains_key(&(*i as BufId))
            })
            .map(|(_, b)| b.len() * b.dtype.size_bytes())
            .sum()
    }

    fn programs_for_liveness(&self) -> memory::Liveness {
        memory::Liveness {
            programs: vec![self.microbatch.clone(), self.optimizer.clone()],
            view_of: self.view_of.clone(),
        }
    }
}
