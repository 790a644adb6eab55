//! KV-cache plans (`megac generate`, `megac compile --inference --kv-cache`): one inference
//! plan that holds the prefill, the decode step and the caches, over one parameter arena.
//!
//! Its inputs are two inference plans of the same model.toml and layout: the **window**
//! plan (one sample of `seq_len` tokens) and the **block** plan (the same model at
//! `model.seq_len` = the block, one token per tensor-parallel rank). The result is the
//! window plan with
//! - **caches**: per attention instruction (by provenance path, which both plans share),
//!   a key and a value buffer of class `kv_cache`, `[seq_len / cp, kv_heads, head_dim]` of
//!   this rank's kv heads (its shard under tp), on the pipeline stage of the layer, laid out in
//!   the `kv_cache` arena of the stage (`memory.kv_cache_bytes`);
//! - **the position**: one `i32[1]` data input (`decode.position`) the runtime writes
//!   before the prefill (0) and before each step;
//! - **the prefill**: the window's forward with each `causal_attention` replaced by
//!   `kv_attention` (the same attention, which also writes the rows' keys and values into
//!   the layer's caches);
//! - **the decode step**: the block plan's forward (per role, or per pipeline chunk under
//!   pp), its buffers remapped into the window plan: parameters to the window's (so the
//!   weights are held once; GPT-2's position table is the window's whole table), its
//!   activations after the window's in the activation arena (chunk activations in their
//!   chunk's slot), its inputs after the window's; `rope` becomes `rope_at`,
//!   `pos_embedding` `pos_embedding_at` and `causal_attention` `kv_attention`, each reading
//!   the position input.
//!
//! Under context parallelism the block is the layout without cp (one token is not split
//! over cp; `megac_runtime::kv::block_sets` compiles it with `parallel.cp=1`): every cp
//! rank runs the same decode step, and each caches only the window positions it holds in
//! the load-balanced layout (`seq_len / cp` rows per cache; the runtime's `kv_attention`
//! merges the ranks' partial attention over cp).
//!
//! The plan gate checks the result, the decode step as a plan of its own
//! ([`megac_ir::plan::Plan::decode_view`]).

use std::collections::BTreeMap;

use megac_ir::plan::{
    BufId, Buffer, BufferClass, DecodeInfo, DecodeProgram, Instr, MemoryPlan, Plan, PlanKind,
};
use megac_ir::{Axis, DType, OpKind};

use crate::CodegenError;

fn unsupported(m: impl Into<String>) -> CodegenError {
    CodegenError::Unsupported(m.into())
}

/// Every kernel instruction of `plan`'s programs (prefill only: no decode programs yet).
fn kernels(plan: &Plan) -> impl Iterator<Item = &Instr> {
    plan.roles
        .iter()
        .flat_map(Plan::programs_of)
        .flat_map(|p| p.iter())
}

/// The first rank of role `r`.
fn rank_of(plan: &Plan, r: usize) -> Option<usize> {
    plan.rank_to_role.iter().position(|&x| x as usize == r)
}

/// Build the KV-cache plan of `window` (the one-sample forward over the context) and
/// `block` (the same model and layout compiled with `model.seq_len` = the block): see the
/// module documentation. Refuses what the cache cannot hold exactly: more than one sample,
/// MoE routing with a capacity; under cp, a block plan that is not the layout without cp.
pub fn kv_plan(window: &Plan, block: &Plan) -> Result<Plan, CodegenError> {
    if window.kind != PlanKind::Inference || block.kind != PlanKind::Inference {
        return Err(unsupported(
            "a KV-cache plan is built from two inference plans",
        ));
    }
    if window.decode.is_some() || block.decode.is_some() {
        return Err(unsupported("the plans already decode with a KV cache"));
    }
    let (w, b) = (&window.batch, &block.batch);
    // Under cp the block is one token, which cannot be split over cp: the block plan is the
    // layout without cp, and every cp rank runs it (see the module documentation).
    // Under expert parallelism, which folds over dp·cp, the block keeps the dp·cp ranks as
    // its dp (so its expert groups are the window's): dp·cp replicas of the one token.
    let cp = window.mesh.size(Axis::Cp);
    let ep = window.mesh.size(Axis::Ep);
    let fold = cp > 1 && ep > 1;
    let mut block_mesh = window.mesh.clone();
    for (a, n) in &mut block_mesh.axes {
        if *a == Axis::Cp {
            *n = 1;
        }
        if *a == Axis::Dp && fold {
            *n *= cp;
        }
    }
    // A window rank's coordinate along `a` in the block's mesh (folded: its dp·cp position,
    // ep coordinate + ep · edp coordinate).
    let window_coord = |rank: usize, a: Axis| -> usize {
        if a == Axis::Dp && fold {
            let m = &window.mesh;
            m.coord(rank, Axis::Ep) + ep as usize * m.coord(rank, Axis::Edp)
        } else {
            window.mesh.coord(rank, a)
        }
    };
    let block_rank = |rank: usize| -> Option<usize> {
        (0..block.mesh.world_size()).find(|&x| {
            [Axis::Tp, Axis::Dp, Axis::Pp]
                .iter()
                .all(|&a| block.mesh.coord(x, a) == window_coord(rank, a))
        })
    };
    let same_roles = (0..window.mesh.world_size()).all(|rank| {
        block_rank(rank).is_some_and(|x| {
            window.rank_to_role.get(rank) == block.rank_to_role.get(x)
                && window.rank_to_role.len() == window.mesh.world_size()
        })
    });
    if block.mesh != block_mesh
        || !same_roles
        || window.roles.len() != block.roles.len()
        || w.vocab != b.vocab
        || b.seq_len > w.seq_len
        || b.micro_batch != 1
        || w.micro_batch != 1
    {
        return Err(unsupported(format!(
            "the block plan (seq_len {}, micro_batch {}) does not fit the window plan (seq_len {}, micro_batch {}) on the same mesh, roles and vocabulary",
            b.seq_len, b.micro_batch, w.seq_len, w.micro_batch
        )));
    }
    if cp > 1 && !w.seq_len.is_multiple_of(2 * cp) {
        return Err(unsupported(format!(
            "the window of {} tokens is not split in 2·cp = {} chunks",
            w.seq_len,
            2 * cp
        )));
    }
    let drops = kernels(window).any(|i| {
        matches!(
            i,
            Instr::Kernel {
                op: OpKind::Dispatch { capacity, .. } | OpKind::DispatchExperts { capacity, .. },
                ..
            } if *capacity > 0
        )
    });
    if drops {
        return Err(unsupported(
            "the KV cache needs dropless MoE routing (model.moe.capacity_factor = 0): with a \
             capacity, which tokens an expert drops depends on the whole window; use \
             --no-kv-cache",
        ));
    }
    let mut plan = window.clone();
    // The window's arenas per stage (roles of one stage share them).
    let stage_of_role = |p: &Plan, r: usize| -> Option<u32> {
        rank_of(p, r).map(|rank| p.mesh.coord(rank, Axis::Pp) as u32)
    };
    let mut win_mem: BTreeMap<u32, MemoryPlan> = BTreeMap::new();
    let mut blk_mem: BTreeMap<u32, MemoryPlan> = BTreeMap::new();
    for r in 0..window.roles.len() {
        if let Some(s) = stage_of_role(window, r) {
            let rank = rank_of(window, r).unwrap_or(0);
            win_mem.insert(s, window.memory_of(rank).clone());
            let brank = rank_of(block, r).unwrap_or(0);
            blk_mem.insert(s, block.memory_of(brank).clone());
        }
    }
    let stage_mem = |m: &BTreeMap<u32, MemoryPlan>, s: Option<u32>| -> MemoryPlan {
        match s {
            Some(s) => m.get(&s).cloned().unwrap_or_default(),
            // A buffer every stage holds: the largest arena of any.
            None => m.values().fold(MemoryPlan::default(), |a, x| MemoryPlan {
                activation_bytes: a.activation_bytes.max(x.activation_bytes),
                input_bytes: a.input_bytes.max(x.input_bytes),
                ..a
            }),
        }
    };
    // Chunks' slot sizes in the window plan.
    let mut win_slots: BTreeMap<u32, u64> = BTreeMap::new();
    for role in &window.roles {
        for c in role.pipeline.iter().flat_map(|p| p.chunks.iter()) {
            win_slots.insert(c.chunk, c.activation_elems);
        }
    }
    // Block buffers -> plan buffers.
    let mut map: Vec<Option<BufId>> = vec![None; block.buffers.len()];
    let wpe_uses: std::collections::HashSet<BufId> = kernels(block)
        .filter_map(|i| match i {
            Instr::Kernel {
                op: OpKind::PosEmbedding,
                inputs,
                ..
            } => inputs.get(1).copied(),
            _ => None,
        })
        .collect();
    for q in &block.params {
        let p = window
            .params
            .iter()
            .find(|p| p.name == q.name)
            .ok_or_else(|| unsupported(format!("the window plan has no parameter `{}`", q.name)))?;
        let pairs = std::iter::once((q.buffer, Some(p.buffer))).chain(
            q.tied_copies
                .iter()
                .enumerate()
                .map(|(k, &c)| (c, p.tied_copies.get(k).copied())),
        );
        for (from, to) in pairs {
            let to = to.ok_or_else(|| {
                unsupported(format!(
                    "parameter `{}` has tied copies on other stages in the block plan",
                    q.name
                ))
            })?;
            let (x, y) = (&block.buffers[from as usize], &window.buffers[to as usize]);
            if x.stage != y.stage {
                return Err(unsupported(format!(
                    "the plans place parameter `{}` on different pipeline stages ({:?}, {:?})",
                    q.name, x.stage, y.stage
                )));
            }
            if x.shape != y.shape && !wpe_uses.contains(&from) {
                return Err(unsupported(format!(
                    "parameter `{}` has local shape {:?} in the block plan, {:?} in the window plan",
                    q.name, x.shape, y.shape
                )));
            }
            map[from as usize] = Some(to);
        }
    }
    let mut input_end: BTreeMap<Option<u32>, u64> = BTreeMap::new();
    for (i, x) in block.buffers.iter().enumerate() {
        if map[i].is_some() {
            continue;
        }
        let mut nb = x.clone();
        nb.name = format!("decode:{}", x.name);
        let size = x.dtype.size_bytes();
        match (x.class, x.chunk) {
            (BufferClass::Activation, Some(c)) => {
                let slot = win_slots.get(&c).copied().unwrap_or(0) * 4;
                if x.offset.saturating_add(x.len()).saturating_mul(size) > slot {
                    return Err(unsupported(format!(
                        "the block's activation {} does not fit chunk {c}'s slot of {slot} bytes",
                        x.name
                    )));
                }
            }
            (BufferClass::Activation, None) => {
                nb.offset += stage_mem(&win_mem, x.stage).activation_bytes / size;
            }
            (BufferClass::Input, _) => {
                nb.offset += stage_mem(&win_mem, x.stage).input_bytes / size;
                let end = nb.offset.saturating_add(nb.len()) * size;
                let e = input_end.entry(x.stage).or_default();
                *e = (*e).max(end);
            }
            (class, _) => {
                return Err(unsupported(format!(
                    "the block plan has a {} buffer ({})",
                    class.name(),
                    x.name
                )))
            }
        }
        map[i] = Some(plan.buffers.len() as BufId);
        plan.buffers.push(nb);
    }
    // The position input, after every stage's inputs.
    let pos_offset = win_mem
        .values()
        .map(|m| m.input_bytes)
        .chain(input_end.values().copied())
        .max()
        .unwrap_or(0)
        .div_ceil(4);
    let position = plan.buffers.len() as BufId;
    plan.buffers.push(Buffer {
        name: "decode:position".into(),
        class: BufferClass::Input,
        dtype: DType::I32,
        shape: vec![1],
        offset: pos_offset,
        layout: Vec::new(),
        rank_offset: None,
        stage: None,
        chunk: None,
        routed_rows: None,
        partial: Vec::new(),
    });
    // The caches, per attention path, from the block's attention operands.
    let mut caches: BTreeMap<String, (BufId, BufId)> = BTreeMap::new();
    let mut kv_end: BTreeMap<Option<u32>, u64> = BTreeMap::new();
    for instr in kernels(block) {
        let Instr::Kernel {
            op: OpKind::CausalAttention { .. },
            inputs,
            path,
            ..
        } = instr
        else {
            continue;
        };
        if caches.contains_key(path) {
            continue;
        }
        let k = &block.buffers[inputs[1] as usize];
        let (nkv, d) = (k.shape[2], k.shape[3]);
        let mut pair = [0 as BufId; 2];
        for (j, what) in ["k", "v"].into_iter().enumerate() {
            let at = kv_end.entry(k.stage).or_default();
            pair[j] = plan.buffers.len() as BufId;
            plan.buffers.push(Buffer {
                name: format!("kv_cache:{path}.{what}"),
                class: BufferClass::KvCache,
                dtype: k.dtype,
                shape: vec![w.seq_len / cp, nkv, d],
                offset: *at,
                layout: Vec::new(),
                rank_offset: None,
                stage: k.stage,
                chunk: None,
                routed_rows: None,
                partial: Vec::new(),
            });
            *at += w.seq_len / cp * nkv * d;
        }
        caches.insert(path.clone(), (pair[0], pair[1]));
    }
    if caches.is_empty() {
        return Err(unsupported("the model has no attention to cache"));
    }
    // The prefill: the window's attention writes the caches.
    let prefill = |instr: &Instr| -> Result<Instr, CodegenError> {
        match instr {
            Instr::Kernel {
                op: OpKind::CausalAttention { window },
                inputs,
                outputs,
                path,
            } => {
                let &(ck, cv) = caches.get(path).ok_or_else(|| {
                    unsupported(format!("the block plan has no attention at {path}"))
                })?;
                Ok(Instr::Kernel {
                    op: OpKind::KvAttention { window: *window },
                    inputs: inputs.iter().copied().chain([position]).collect(),
                    outputs: outputs.iter().copied().chain([ck, cv]).collect(),
                    path: path.clone(),
                })
            }
            other => Ok(other.clone()),
        }
    };
    let m = |id: BufId| map[id as usize].unwrap_or(id);
    // The decode step: the block's instructions over the plan's buffers.
    let step = |instr: &Instr| -> Result<Instr, CodegenError> {
        Ok(match instr {
            Instr::Kernel {
                op,
                inputs,
                outputs,
                path,
            } => {
                let ins: Vec<BufId> = inputs.iter().map(|&x| m(x)).collect();
                let outs: Vec<BufId> = outputs.iter().map(|&x| m(x)).collect();
                let with_pos = |mut v: Vec<BufId>| {
                    v.push(position);
                    v
                };
                let (op, ins, outs) = match op {
                    OpKind::Rope { theta, scaling } => (
                        OpKind::RopeAt {
                            theta: *theta,
                            scaling: *scaling,
                        },
                        with_pos(ins),
                        outs,
                    ),
                    OpKind::PosEmbedding => (OpKind::PosEmbeddingAt, with_pos(ins), outs),
                    OpKind::CausalAttention { window } => {
                        let &(ck, cv) = caches.get(path).ok_or_else(|| {
                            unsupported(format!("no cache for the attention at {path}"))
                        })?;
                        let mut outs = outs;
                        outs.extend([ck, cv]);
                        (OpKind::KvAttention { window: *window }, with_pos(ins), outs)
                    }
                    other => (other.clone(), ins, outs),
                };
                Instr::Kernel {
                    op,
                    inputs: ins,
                    outputs: outs,
                    path: path.clone(),
                }
            }
            Instr::Zero { buffer } => Instr::Zero { buffer: m(*buffer) },
            Instr::Send {
                buffer,
                chunk,
                transfer,
                twin,
            } => Instr::Send {
                buffer: m(*buffer),
                chunk: *chunk,
                transfer: *transfer,
                twin: *twin,
            },
            Instr::Recv {
                buffer,
                chunk,
                transfer,
                twin,
            } => Instr::Recv {
                buffer: m(*buffer),
                chunk: *chunk,
                transfer: *transfer,
                twin: *twin,
            },
        })
    };
    let remap = |p: &[Instr], f: &dyn Fn(&Instr) -> Result<Instr, CodegenError>| {
        p.iter().map(f).collect::<Result<Vec<_>, _>>()
    };
    let mut grown = false;
    for (r, role) in plan.roles.iter_mut().enumerate() {
        let brole = &block.roles[r];
        role.microbatch = remap(&role.microbatch, &prefill)?;
        match (&mut role.pipeline, &brole.pipeline) {
            (None, None) => {}
            (Some(p), Some(bp)) => {
                for c in &mut p.chunks {
                    let bc = bp
                        .chunks
                        .iter()
                        .find(|x| x.chunk == c.chunk)
                        .ok_or_else(|| {
                            unsupported(format!(
                                "role {} holds chunk {} in the window plan, not in the block plan",
                                role.name, c.chunk
                            ))
                        })?;
                    c.forward = remap(&c.forward, &prefill)?;
                    c.decode = remap(&bc.forward, &step)?;
                    c.decode_inputs = bc.inputs.iter().map(|&x| m(x)).collect();
                }
            }
            _ => return Err(unsupported("one plan is pipelined and the other is not")),
        }
        role.decode = Some(DecodeProgram {
            step: remap(&brole.microbatch, &step)?,
            inputs: brole
                .inputs
                .iter()
                .map(|(k, &x)| (k.clone(), m(x)))
                .collect(),
            results: brole
                .results
                .iter()
                .map(|(k, &x)| (k.clone(), m(x)))
                .collect(),
        });
        // The role's arenas: the block's activations after the window's, its inputs and
        // the position after the window's, and its caches.
        let stage = stage_of_role(window, r);
        let bm = stage_mem(&blk_mem, stage);
        let grow = |mem: &mut MemoryPlan| {
            mem.activation_bytes += bm.activation_bytes;
            mem.activation_bytes_unplanned += bm.activation_bytes_unplanned;
            mem.input_bytes = (pos_offset + 1) * 4;
            mem.kv_cache_bytes = kv_end
                .iter()
                .filter(|(s, _)| s.is_none() || **s == stage)
                .map(|(_, &e)| e * 4)
                .sum();
        };
        if let Some(mem) = role.memory.as_mut() {
            grow(mem);
        } else if !grown {
            // Roles without arenas of their own share the plan's: grow it once.
            grow(&mut plan.memory);
            grown = true;
        }
    }
    if plan.roles.iter().any(|r| r.memory.is_some()) {
        // The plan-wide memory: each field the largest over the roles.
        let most = |f: &dyn Fn(&MemoryPlan) -> u64| {
            plan.roles
                .iter()
                .filter_map(|r| r.memory.as_ref())
                .map(f)
                .max()
                .unwrap_or(0)
        };
        plan.memory.activation_bytes = most(&|m| m.activation_bytes);
        plan.memory.activation_bytes_unplanned = most(&|m| m.activation_bytes_unplanned);
        plan.memory.input_bytes = most(&|m| m.input_bytes);
        plan.memory.kv_cache_bytes = most(&|m| m.kv_cache_bytes);
    }
    // The step's geometry on the window's mesh: folded, the block's dp·cp replicas are the
    // window's dp replicas (its cp ranks run the same sample).
    let mut batch = block.batch.clone();
    if fold {
        batch.global_batch /= cp;
        batch.tokens_per_step /= cp;
    }
    plan.decode = Some(DecodeInfo { batch, position });
    crate::memory::add_staging(&mut plan);
    Ok(plan)
}
