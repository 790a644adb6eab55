//! Pipeline codegen: the stage split of a compiled graph and the per-stage roles.
//!
//! The emitter first lowers the whole graph as for one pipeline stage (one micro-batch
//! program, one optimizer program). This module then
//! 1. gives every micro-batch instruction a chunk (virtual stage) from its provenance path:
//!    the embedding in chunk 0, the layers in contiguous runs ([`megac_ir::pipeline::stages`]), the
//!    final norm, head and loss in the last chunk; and a phase: forward `F`, input-gradient
//!    backward `B`, or, for zero-bubble schedules, weight-gradient `W` (kernels that only
//!    write parameter gradients);
//! 2. gives every activation the chunk that produces it; a chunk that reads another chunk's
//!    activation gets its own copy, filled by a `Recv` at the start of its first segment that
//!    reads it and sent by a `Send` at the end of the producer's segment (transfers go forward
//!    in the forward pass, backward in the backward pass; anything else is refused);
//! 3. splits the optimizer program by stage: each stage clips with the global norm (squares
//!    summed over `pp` too) and updates only its own parameters;
//! 4. plans each stage's memory on its own: persistent arenas hold only the stage's
//!    parameters, and every chunk gets `slots` activation slots, one per micro-batch in flight
//!    at once under the schedule (the runtime picks a free slot at each forward).
//!
//! Chunk `c` lives on pipeline rank `c % pp` (Megatron's interleaved placement).

use std::collections::{BTreeMap, BTreeSet};

use megac_ir::mesh::chunk_owner;
use megac_ir::pipeline::{self, ActionKind, ScheduleKind};
use megac_ir::plan::{
    BufId, Buffer, BufferClass, ChunkProgram, DppExec, Instr, MemoryPlan, PipeAction, PipeKind,
    Pipeline, Role,
};
use megac_ir::{Axis, OpKind};

use crate::{memory, CodegenError, Emitter};

/// Segment of a chunk's micro-batch work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    F,
    B,
    W,
}

/// What the split produces: one role per pipeline rank and the plan-wide memory summary.
pub(crate) struct Split {
    pub roles: Vec<Role>,
    pub memory: MemoryPlan,
}

/// The chunk of a micro-batch instruction, from its provenance path; `chunk_of_layer[l]` is
/// layer l's chunk.
fn chunk_of_path(path: &str, chunk_of_layer: &[u32], chunks: u32) -> u32 {
    let layer = ["model.layers.", "transformer.h."]
        .iter()
        .find_map(|p| path.strip_prefix(p))
        .and_then(|rest| rest.split('.').next())
        .and_then(|n| n.parse::<usize>().ok());
    if let Some(l) = layer {
        return chunk_of_layer.get(l).copied().unwrap_or(chunks - 1);
    }
    let first = ["model.embed_tokens", "transformer.wte", "transformer.wpe"];
    if first
        .iter()
        .any(|p| path == *p || path.starts_with(&format!("{p}.")))
    {
        0
    } else {
        chunks - 1
    }
}

fn unsupported(msg: String) -> CodegenError {
    CodegenError::Unsupported(msg)
}

/// The layout facts the split needs.
struct Geometry {
    /// Pipeline ranks.
    pp: u32,
    /// Chunks (`pp·vpp`).
    nc: u32,
    /// Micro-batches per step.
    m: u32,
    /// The schedule.
    kind: ScheduleKind,
    /// Zero-bubble schedules split the backward into `B` and `W`.
    split_bw: bool,
    /// Layer index -> chunk.
    chunk_of_layer: Vec<u32>,
    /// The pipeline schedule's action lists, per pipeline rank.
    lists: Vec<Vec<pipeline::Action>>,
}

impl Geometry {
    fn of(spec: &megac_ir::spec::ModelSpec) -> Result<Geometry, CodegenError> {
        let p = &spec.parallel;
        let (pp, vpp) = (p.pp as u32, p.vpp as u32);
        let m = spec.train.microbatches(p.dp) as u32;
        // Layers per chunk: the stage pass's split.
        let per_chunk = megac_ir::pipeline::stages::chunk_layers(spec).map_err(unsupported)?;
        let chunk_of_layer = per_chunk
            .iter()
            .enumerate()
            .flat_map(|(c, &n)| std::iter::repeat_n(c as u32, n as usize))
            .collect();
        let kind = ScheduleKind::of(p);
        let lists = pipeline::schedule(kind, pp, vpp, m)
            .map_err(|err| unsupported(format!("pipeline schedule: {err}")))?;
        Ok(Geometry {
            pp,
            nc: pp * vpp,
            m,
            kind,
            split_bw: matches!(kind, ScheduleKind::ZbH1),
            chunk_of_layer,
            lists,
        })
    }
}

/// An activation one chunk produces and another reads: `src` in the producer's segment,
/// received into the copy `dst` of the consumer.
struct Transfer {
    src: BufId,
    from: u32,
    from_phase: Phase,
    dst: BufId,
    to: u32,
    to_phase: Phase,
}

/// Who touches what in the micro-batch program.
#[derive(Default)]
struct Usage {
    /// Activation root -> the chunk that produces it.
    owner: BTreeMap<BufId, u32>,
    /// Activation root -> the producer's last writing phase.
    last_write: BTreeMap<BufId, Phase>,
    /// (activation root, another chunk) -> the first phase of that chunk that reads it.
    first_use: BTreeMap<(BufId, u32), Phase>,
    /// Parameter, gradient or state buffer -> the stages that touch it.
    persistent_stage: BTreeMap<BufId, BTreeSet<u32>>,
    /// Chunk -> the data inputs it reads.
    chunk_inputs: BTreeMap<u32, BTreeSet<BufId>>,
}

/// Parameters shared by stages (tied embeddings).
#[derive(Default)]
struct Tied {
    /// Parameter -> the stage that owns it and its gradient.
    home: BTreeMap<BufId, u32>,
    /// (parameter, other stage) -> that stage's copy.
    copy: BTreeMap<(BufId, u32), BufId>,
}

/// Split the emitter's single-stage programs into pipeline roles.
pub(crate) fn split(e: &mut Emitter) -> Result<Split, CodegenError> {
    let geo = Geometry::of(e.spec)?;
    let pp = geo.pp;
    let program = std::mem::take(&mut e.microbatch);
    let place = place_instructions(e, &program, &geo);
    let usage = scan_usage(e, &program, &place, pp)?;
    let tied = tie_parameters(e, &usage)?;
    let (copy, transfers) = cut_transfers(e, &usage)?;
    let mut segs = segments(program, &place, &copy, &tied, &transfers, &geo);
    let folds = fold_tied_gradients(e, &mut segs, &transfers, &tied, pp);
    assign_stages(e, &usage, &tied, pp);
    let (norms, mut opt) = split_optimizer(e, pp)?;
    let refresh = tied_refresh(&tied, transfers.len() as u32, pp);
    stage_optimizers(e, &mut opt, &norms, refresh, &tied)?;
    let first_fold = (transfers.len() + tied.copy.len()) as u32;
    reduce_tied_gradients(e, &mut opt, &folds, first_fold);
    let slots = slot_counts(&geo);
    let mut roles = Vec::new();
    let mut mems = Vec::new();
    for s in 0..pp {
        let optimizer = std::mem::take(&mut opt[s as usize]);
        let role = stage_role(
            e,
            s,
            &geo,
            &mut segs,
            &slots,
            &usage,
            optimizer,
            norms[s as usize],
        );
        mems.push(role.memory.clone().unwrap_or_default());
        roles.push(role);
    }
    // Inputs: every stage that reads one holds its own copy at the same offset.
    for b in e.inputs.values() {
        e.buffers[*b as usize].stage = None;
    }
    if e.spec.parallel.fbd {
        let total = (transfers.len() + tied.copy.len() + folds.len()) as u32;
        let consumer_phase: Vec<Phase> = transfers.iter().map(|t| t.to_phase).collect();
        let forward = fbd_forward_roles(e, &mut roles, &consumer_phase, total, geo.m);
        for r in &forward {
            mems.push(r.memory.clone().unwrap_or_default());
        }
        roles.extend(forward);
    }
    let max = |f: fn(&MemoryPlan) -> u64| mems.iter().map(f).max().unwrap_or(0);
    let memory = MemoryPlan {
        param_bytes: max(|m| m.param_bytes),
        grad_bytes: max(|m| m.grad_bytes),
        opt_state_bytes: max(|m| m.opt_state_bytes),
        activation_bytes: max(|m| m.activation_bytes),
        activation_bytes_unplanned: max(|m| m.activation_bytes_unplanned),
        activation_bytes_live: max(|m| m.activation_bytes_live),
        input_bytes: max(|m| m.input_bytes),
        staging_bytes: 0,
    };
    Ok(Split { roles, memory })
}

/// Step 1: the chunk and phase of every micro-batch instruction. Everything before the
/// first gradient kernel is forward; backward kernels that only write parameter gradients
/// are `W` under zero-bubble schedules; a `zero` goes with the kernel after it.
fn place_instructions(e: &Emitter, program: &[Instr], geo: &Geometry) -> Vec<(u32, Phase)> {
    let nc = geo.nc;
    let first_backward = program
        .iter()
        .position(|i| matches!(i, Instr::Kernel { op, .. } if op.accumulates()))
        .unwrap_or(program.len());
    let mut place: Vec<(u32, Phase)> = vec![(0, Phase::F); program.len()];
    for i in (0..program.len()).rev() {
        place[i] = match &program[i] {
            Instr::Kernel { path, outputs, .. } => {
                let chunk = chunk_of_path(path, &geo.chunk_of_layer, nc);
                let phase = if i < first_backward {
                    Phase::F
                } else if geo.split_bw
                    && outputs
                        .iter()
                        .all(|&o| e.buffers[o as usize].class == BufferClass::Grad)
                {
                    Phase::W
                } else {
                    Phase::B
                };
                (chunk, phase)
            }
            _ => place.get(i + 1).copied().unwrap_or((nc - 1, Phase::B)),
        };
    }
    place
}

/// Step 2: which chunk produces each activation and which others read it, which stages
/// touch each persistent buffer, which chunks read the data.
fn scan_usage(
    e: &Emitter,
    program: &[Instr],
    place: &[(u32, Phase)],
    pp: u32,
) -> Result<Usage, CodegenError> {
    let mut u = Usage::default();
    for (i, instr) in program.iter().enumerate() {
        let (c, ph) = place[i];
        let writes: Vec<BufId> = match instr {
            Instr::Kernel { outputs, .. } => outputs.clone(),
            Instr::Zero { buffer } => vec![*buffer],
            _ => Vec::new(),
        };
        for b in instr.buffers() {
            let r = *e.view_of.get(&b).unwrap_or(&b);
            match e.buffers[r as usize].class {
                BufferClass::Activation => {
                    let o = *u.owner.entry(r).or_insert(c);
                    if o == c {
                        if writes.contains(&b) {
                            u.last_write.insert(r, ph);
                        }
                    } else {
                        u.first_use.entry((r, c)).or_insert(ph);
                        if writes.contains(&b) {
                            return Err(unsupported(format!(
                                "activation {} is written by chunks {o} and {c}",
                                e.buffers[r as usize].name
                            )));
                        }
                    }
                }
                BufferClass::Input => {
                    u.chunk_inputs.entry(c).or_default().insert(r);
                }
                _ => {
                    u.persistent_stage
                        .entry(r)
                        .or_default()
                        .insert(chunk_owner(c, pp));
                }
            }
        }
    }
    Ok(u)
}

/// Tied parameters (GPT-2's word embeddings, read by the head on the last stage): the stage
/// that accumulates the gradient updates the parameter and sends it to a copy on every other
/// stage that reads it after each optimizer step. The other stages' gradient contributions
/// reach it as backward transfers, like any cross-chunk activation.
fn tie_parameters(e: &mut Emitter, usage: &Usage) -> Result<Tied, CodegenError> {
    let mut tied = Tied::default();
    for (&b, stages) in &usage.persistent_stage {
        if stages.len() < 2 {
            continue;
        }
        let entry = e.params.iter().position(|p| p.buffer == b);
        let grad_stage = entry.and_then(|i| {
            let g = usage.persistent_stage.get(&e.params[i].grad)?;
            (g.len() == 1).then(|| *g.iter().next().expect("one stage"))
        });
        let (Some(i), Some(h)) = (entry, grad_stage) else {
            return Err(unsupported(format!(
                "`{}` is used by pipeline stages {stages:?}; only parameters can be shared between stages",
                e.buffers[b as usize].name
            )));
        };
        tied.home.insert(b, h);
        for &s in stages.iter().filter(|&&s| s != h) {
            let mut buf = e.buffers[b as usize].clone();
            buf.name = format!("{}@stage{s}", buf.name);
            buf.stage = Some(s);
            let id = e.buffers.len() as BufId;
            e.buffers.push(buf);
            tied.copy.insert((b, s), id);
            e.params[i].tied_copies.push(id);
        }
    }
    Ok(tied)
}

/// Every activation read by another chunk gets a copy there (with copies of its views) and a
/// transfer. Forward-pass transfers go to later chunks, backward-pass ones to earlier chunks;
/// anything else is refused. Every activation buffer is labelled with its chunk.
#[allow(clippy::type_complexity)]
fn cut_transfers(
    e: &mut Emitter,
    usage: &Usage,
) -> Result<(BTreeMap<(BufId, u32), BufId>, Vec<Transfer>), CodegenError> {
    let mut copy: BTreeMap<(BufId, u32), BufId> = BTreeMap::new();
    let mut transfers = Vec::new();
    for (&(r, c), &ph) in &usage.first_use {
        let o = usage.owner[&r];
        let pw = usage.last_write.get(&r).copied().unwrap_or(Phase::F);
        let ok = match (pw, ph) {
            (Phase::F, Phase::F) => c > o,
            (Phase::F, _) => true,
            (Phase::B, Phase::B | Phase::W) => c < o,
            _ => false,
        };
        if !ok {
            return Err(unsupported(format!(
                "activation {} flows from chunk {o} ({pw:?}) to chunk {c} ({ph:?}), against the pipeline",
                e.buffers[r as usize].name
            )));
        }
        let mut buf = e.buffers[r as usize].clone();
        buf.name = format!("{}@{c}", buf.name);
        let id = e.buffers.len() as BufId;
        e.buffers.push(buf);
        copy.insert((r, c), id);
        transfers.push(Transfer {
            src: r,
            from: o,
            from_phase: pw,
            dst: id,
            to: c,
            to_phase: ph,
        });
    }
    let views: Vec<(BufId, BufId)> = e.view_of.iter().map(|(&v, &r)| (v, r)).collect();
    for (v, r) in views {
        let chunks: Vec<u32> = copy
            .keys()
            .filter(|(cr, _)| *cr == r)
            .map(|(_, c)| *c)
            .collect();
        for c in chunks {
            let mut buf = e.buffers[v as usize].clone();
            buf.name = format!("{}@{c}", buf.name);
            let id = e.buffers.len() as BufId;
            e.buffers.push(buf);
            copy.insert((v, c), id);
            e.view_of.insert(id, copy[&(r, c)]);
        }
    }
    for (&r, &c) in &usage.owner {
        e.buffers[r as usize].chunk = Some(c);
    }
    for (&(_, c), &id) in &copy {
        e.buffers[id as usize].chunk = Some(c);
    }
    let view_list: Vec<(BufId, BufId)> = e.view_of.iter().map(|(&v, &r)| (v, r)).collect();
    for (v, r) in view_list {
        if let Some(c) = e.buffers[r as usize].chunk {
            e.buffers[v as usize].chunk = Some(c);
        }
    }
    Ok((copy, transfers))
}

/// The segments (chunk, phase) with each chunk's buffers rewritten to its copies, the
/// `recv`s first and the `send`s last.
fn segments(
    program: Vec<Instr>,
    place: &[(u32, Phase)],
    copy: &BTreeMap<(BufId, u32), BufId>,
    tied: &Tied,
    transfers: &[Transfer],
    geo: &Geometry,
) -> BTreeMap<(u32, Phase), Vec<Instr>> {
    let mut segs: BTreeMap<(u32, Phase), Vec<Instr>> = BTreeMap::new();
    for c in 0..geo.nc {
        for ph in [Phase::F, Phase::B, Phase::W] {
            segs.insert((c, ph), Vec::new());
        }
    }
    for (t, x) in transfers.iter().enumerate() {
        segs.entry((x.to, x.to_phase))
            .or_default()
            .push(Instr::Recv {
                buffer: x.dst,
                chunk: x.from,
                transfer: t as u32,
                twin: false,
            });
    }
    for (i, instr) in program.into_iter().enumerate() {
        let (c, ph) = place[i];
        let map = |b: BufId| {
            *copy
                .get(&(b, c))
                .or_else(|| tied.copy.get(&(b, chunk_owner(c, geo.pp))))
                .unwrap_or(&b)
        };
        let instr = match instr {
            Instr::Kernel {
                op,
                inputs,
                outputs,
                path,
            } => Instr::Kernel {
                op,
                inputs: inputs.into_iter().map(map).collect(),
                outputs: outputs.into_iter().map(map).collect(),
                path,
            },
            Instr::Zero { buffer } => Instr::Zero {
                buffer: map(buffer),
            },
            other => other,
        };
        segs.entry((c, ph)).or_default().push(instr);
    }
    for (t, x) in transfers.iter().enumerate() {
        segs.entry((x.from, x.from_phase))
            .or_default()
            .push(Instr::Send {
                buffer: x.src,
                chunk: x.to,
                transfer: t as u32,
                twin: false,
            });
    }
    segs
}

/// A tied parameter's gradient contribution computed on another stage (GPT-2's head on the
/// last stage): accumulated there into `partial` over the step's micro-batches, sent once per
/// step and added into the home stage's gradient `grad` (through `incoming`) before the
/// optimizer — Megatron's reduction of the embedding gradient between the first and the last
/// stage, instead of one transfer per micro-batch.
struct TiedFold {
    grad: BufId,
    home: u32,
    stage: u32,
    partial: BufId,
    incoming: BufId,
}

/// Turn the per-micro-batch backward transfers that only feed a tied parameter's gradient
/// sum into per-step reductions ([`TiedFold`]): the producer accumulates into a gradient-class
/// copy, the home stage's sum drops the transferred term.
fn fold_tied_gradients(
    e: &mut Emitter,
    segs: &mut BTreeMap<(u32, Phase), Vec<Instr>>,
    transfers: &[Transfer],
    tied: &Tied,
    pp: u32,
) -> Vec<TiedFold> {
    let tied_grads: BTreeSet<BufId> = e
        .params
        .iter()
        .filter(|p| tied.home.contains_key(&p.buffer))
        .map(|p| p.grad)
        .collect();
    let mut folds: Vec<TiedFold> = Vec::new();
    for (t, x) in transfers.iter().enumerate() {
        let t = t as u32;
        let Some(seg) = segs.get(&(x.to, x.to_phase)) else {
            continue;
        };
        let users: Vec<usize> = seg
            .iter()
            .enumerate()
            .filter(|(_, i)| !matches!(i, Instr::Recv { .. }) && i.buffers().contains(&x.dst))
            .map(|(k, _)| k)
            .collect();
        let [k] = users[..] else { continue };
        let Instr::Kernel {
            op: OpKind::GradSum,
            inputs,
            outputs,
            ..
        } = &seg[k]
        else {
            continue;
        };
        let [grad] = outputs[..] else { continue };
        if !tied_grads.contains(&grad) || inputs.len() != 2 {
            continue;
        }
        let stage = chunk_owner(x.from, pp);
        let home = chunk_owner(x.to, pp);
        // The producer's per-step partial sum, and the home stage's landing buffer.
        let fold = match folds
            .iter()
            .position(|f| f.grad == grad && f.stage == stage)
        {
            Some(i) => i,
            None => {
                let mut partial = e.buffers[grad as usize].clone();
                partial.name = format!("{}@stage{stage}", partial.name);
                partial.stage = Some(stage);
                let mut incoming = partial.clone();
                incoming.name = format!("{}.from{stage}", e.buffers[grad as usize].name);
                incoming.stage = Some(home);
                let id = e.buffers.len() as BufId;
                e.buffers.push(partial);
                e.buffers.push(incoming);
                folds.push(TiedFold {
                    grad,
                    home,
                    stage,
                    partial: id,
                    incoming: id + 1,
                });
                folds.len() - 1
            }
        };
        let partial = folds[fold].partial;
        // Home: the sum keeps its own term; the receive goes.
        let seg = segs.get_mut(&(x.to, x.to_phase)).expect("segment");
        if let Instr::Kernel { inputs, .. } = &mut seg[k] {
            inputs.retain(|&b| b != x.dst);
        }
        seg.retain(|i| !matches!(i, Instr::Recv { transfer, .. } if *transfer == t));
        // Producer: accumulate instead of sending.
        let seg = segs.get_mut(&(x.from, x.from_phase)).expect("segment");
        for i in seg.iter_mut() {
            if matches!(i, Instr::Send { transfer, .. } if *transfer == t) {
                *i = Instr::Kernel {
                    op: OpKind::GradSum,
                    inputs: vec![x.src],
                    outputs: vec![partial],
                    path: "optimizer.tied_gradient".into(),
                };
            }
        }
    }
    folds
}

/// Once per step, before each stage's gradient reduction: the producers send their partial
/// tied gradients home, where they are added into the gradient. The extra buffers go after
/// each stage's gradient arena.
fn reduce_tied_gradients(e: &mut Emitter, opt: &mut [Vec<Instr>], folds: &[TiedFold], first: u32) {
    for (transfer, f) in (first..).zip(folds) {
        opt[f.stage as usize].insert(
            0,
            Instr::Send {
                buffer: f.partial,
                chunk: f.home,
                transfer,
                twin: false,
            },
        );
        let home = &mut opt[f.home as usize];
        home.insert(
            0,
            Instr::Kernel {
                op: OpKind::GradSum,
                inputs: vec![f.incoming],
                outputs: vec![f.grad],
                path: "optimizer.tied_gradient".into(),
            },
        );
        home.insert(
            0,
            Instr::Recv {
                buffer: f.incoming,
                chunk: f.stage,
                transfer,
                twin: false,
            },
        );
    }
    let mut extra: BTreeMap<u32, Vec<BufId>> = BTreeMap::new();
    for f in folds {
        extra.entry(f.stage).or_default().push(f.partial);
        extra.entry(f.home).or_default().push(f.incoming);
    }
    for (stage, ids) in extra {
        place_after_arena(e, BufferClass::Grad, stage, &ids);
    }
}

/// Place `ids` one after another past the end of stage `stage`'s `class` arena (the other
/// buffers' farthest extent over the mesh): buffers added after the arena was laid out.
fn place_after_arena(e: &mut Emitter, class: BufferClass, stage: u32, ids: &[BufId]) {
    let mut end = e
        .buffers
        .iter()
        .enumerate()
        .filter(|(i, b)| {
            b.class == class && b.stage == Some(stage) && !ids.contains(&(*i as BufId))
        })
        .map(|(_, b)| b.far_end(&e.g.mesh))
        .max()
        .unwrap_or(0);
    for &b in ids {
        e.buffers[b as usize].offset = end;
        end += e.buffers[b as usize].len();
    }
}

/// Step 3: the stage of every buffer: persistent ones where they are used (tied parameters
/// at home), activations with their chunk, optimizer state with its parameter.
fn assign_stages(e: &mut Emitter, usage: &Usage, tied: &Tied, pp: u32) {
    for (&b, stages) in &usage.persistent_stage {
        e.buffers[b as usize].stage = tied.home.get(&b).or(stages.iter().next()).copied();
    }
    for (&r, &c) in &usage.owner {
        e.buffers[r as usize].stage = Some(chunk_owner(c, pp));
    }
    for i in 0..e.buffers.len() {
        if let Some(c) = e.buffers[i].chunk {
            e.buffers[i].stage = Some(chunk_owner(c, pp));
        }
    }
    for entry in &e.params {
        let s = e.buffers[entry.buffer as usize].stage;
        for b in [entry.grad]
            .into_iter()
            .chain(entry.exp_avg)
            .chain(entry.exp_avg_sq)
            .chain(entry.master)
        {
            e.buffers[b as usize].stage = s;
        }
    }
}

/// The optimizer program per stage: every stage clips with the global norm (its own
/// squares, summed over pp too, into its own norm buffer) and updates its own parameters.
/// Returns the norm buffers and the programs.
#[allow(clippy::type_complexity)]
fn split_optimizer(
    e: &mut Emitter,
    pp: u32,
) -> Result<(Vec<BufId>, Vec<Vec<Instr>>), CodegenError> {
    let norm = *e
        .results
        .get("grad_norm")
        .ok_or_else(|| CodegenError::Incomplete("no grad_norm result".into()))?;
    let mut norms = vec![norm; pp as usize];
    for (s, n) in norms.iter_mut().enumerate().skip(1) {
        let mut buf = e.buffers[norm as usize].clone();
        buf.name = format!("{}@stage{s}", buf.name);
        *n = e.buffers.len() as BufId;
        e.buffers.push(buf);
    }
    for (s, &n) in norms.iter().enumerate() {
        e.buffers[n as usize].stage = Some(s as u32);
    }
    let mut opt: Vec<Vec<Instr>> = vec![Vec::new(); pp as usize];
    for instr in std::mem::take(&mut e.optimizer) {
        match instr {
            Instr::Kernel {
                op: OpKind::GradNorm { axes },
                inputs,
                path,
                ..
            } => {
                let mut axes = axes.clone();
                if !axes.contains(&Axis::Pp) {
                    axes.push(Axis::Pp);
                }
                for (s, prog) in opt.iter_mut().enumerate() {
                    let mine: Vec<BufId> = inputs
                        .iter()
                        .copied()
                        .filter(|&g| e.buffers[g as usize].stage == Some(s as u32))
                        .collect();
                    prog.push(Instr::Kernel {
                        op: OpKind::GradNorm { axes: axes.clone() },
                        inputs: mine,
                        outputs: vec![norms[s]],
                        path: path.clone(),
                    });
                }
            }
            Instr::Kernel {
                op,
                inputs,
                outputs,
                path,
            } => {
                let stages: BTreeSet<u32> = inputs
                    .iter()
                    .chain(&outputs)
                    .filter(|&&b| b != norm)
                    .filter_map(|&b| e.buffers[b as usize].stage)
                    .collect();
                let [s] = stages.iter().copied().collect::<Vec<_>>()[..] else {
                    return Err(unsupported(format!(
                        "optimizer instruction `{path}` touches stages {stages:?}"
                    )));
                };
                let fix = |b: BufId| if b == norm { norms[s as usize] } else { b };
                opt[s as usize].push(Instr::Kernel {
                    op,
                    inputs: inputs.into_iter().map(fix).collect(),
                    outputs: outputs.into_iter().map(fix).collect(),
                    path,
                });
            }
            other => {
                let s = other
                    .buffers()
                    .iter()
                    .find_map(|&b| e.buffers[b as usize].stage)
                    .unwrap_or(0);
                opt[s as usize].push(other);
            }
        }
    }
    Ok((norms, opt))
}

/// The sends and receives that refresh tied copies after each step, per stage (transfer ids
/// from `first`).
fn tied_refresh(tied: &Tied, first: u32, pp: u32) -> Vec<Vec<Instr>> {
    let mut refresh: Vec<Vec<Instr>> = vec![Vec::new(); pp as usize];
    for (transfer, (&(b, s), &copy_id)) in (first..).zip(&tied.copy) {
        let h = tied.home[&b];
        refresh[h as usize].push(Instr::Send {
            buffer: b,
            chunk: s,
            transfer,
            twin: false,
        });
        refresh[s as usize].push(Instr::Recv {
            buffer: copy_id,
            chunk: h,
            transfer,
            twin: false,
        });
    }
    refresh
}

/// Step 4: each stage's persistent arenas packed on their own, then its gradient reduction
/// (buckets, or ZeRO-1 over its own parameters with the norm summed over pp too; tied
/// copies after the flat segments), then the tied-copy refresh.
fn stage_optimizers(
    e: &mut Emitter,
    opt: &mut [Vec<Instr>],
    norms: &[BufId],
    mut refresh: Vec<Vec<Instr>>,
    tied: &Tied,
) -> Result<(), CodegenError> {
    let pp = opt.len() as u32;
    for class in [BufferClass::Param, BufferClass::Grad, BufferClass::OptState] {
        for s in 0..pp {
            let mut offset = 0u64;
            for b in e.buffers.iter_mut() {
                if b.class == class && b.stage == Some(s) {
                    b.offset = offset;
                    offset += b.len();
                }
            }
        }
    }
    let p = &e.spec.parallel;
    let zero1 = p.distributed_optimizer && p.dp > 1;
    for (s, prog) in opt.iter_mut().enumerate() {
        let before = e.buffers.len();
        if zero1 {
            let mine: Vec<usize> = (0..e.params.len())
                .filter(|&i| e.buffers[e.params[i].buffer as usize].stage == Some(s as u32))
                .collect();
            *prog = e.zero1_program(prog, &mine, norms[s], &[Axis::Pp])?;
        } else {
            *prog = e.bucketed(std::mem::take(prog));
        }
        for b in &mut e.buffers[before..] {
            b.stage = Some(s as u32);
            b.name = format!("{}@stage{s}", b.name);
        }
        if zero1 {
            // Tied copies go after the stage's flat segments.
            let copies: Vec<BufId> = tied
                .copy
                .iter()
                .filter(|((_, cs), _)| *cs == s as u32)
                .map(|(_, &id)| id)
                .collect();
            place_after_arena(e, BufferClass::Param, s as u32, &copies);
        }
        prog.append(&mut refresh[s]);
    }
    Ok(())
}

/// Activation slots per chunk: the most micro-batches of the chunk in flight under the
/// schedule (all of them for dpp, whose order is decided at run time).
fn slot_counts(geo: &Geometry) -> Vec<u32> {
    let nc = geo.nc as usize;
    if matches!(geo.kind, ScheduleKind::Dpp(_)) {
        return vec![geo.m; nc];
    }
    let mut slots = vec![0u32; nc];
    for list in &geo.lists {
        let mut inflight = vec![0u32; nc];
        for a in list {
            let c = a.chunk as usize;
            match a.kind {
                ActionKind::F => {
                    inflight[c] += 1;
                    slots[c] = slots[c].max(inflight[c]);
                }
                ActionKind::BW | ActionKind::W => inflight[c] = inflight[c].saturating_sub(1),
                _ => {}
            }
        }
    }
    slots
}

/// The role of pipeline stage `s`: its chunks (segments, activation slots placed one after
/// another, then the optimizer's activations), inputs, results, action list and memory.
#[allow(clippy::too_many_arguments)]
fn stage_role(
    e: &mut Emitter,
    s: u32,
    geo: &Geometry,
    segs: &mut BTreeMap<(u32, Phase), Vec<Instr>>,
    slots: &[u32],
    usage: &Usage,
    optimizer: Vec<Instr>,
    norm: BufId,
) -> Role {
    let spec = e.spec;
    let (pp, nc) = (geo.pp, geo.nc);
    let loss_keys: Vec<String> = ["loss", "total_loss"]
        .iter()
        .filter(|k| e.results.contains_key(**k))
        .map(|k| k.to_string())
        .collect();
    let live_to_end: Vec<BufId> = loss_keys.iter().map(|k| e.results[k]).collect();
    let mut chunks = Vec::new();
    let mut base = 0u64;
    let (mut unplanned, mut live) = (0u64, 0u64);
    for c in (s..nc).step_by(pp as usize) {
        let n_slots = slots[c as usize];
        let [forward, mut backward, weight] =
            [Phase::F, Phase::B, Phase::W].map(|ph| segs.remove(&(c, ph)).unwrap_or_default());
        let liveness = memory::Liveness {
            programs: vec![forward.clone(), backward.clone(), weight.clone()],
            view_of: e.view_of.clone(),
        };
        // Slots are counted in the runtime's 4-byte arena units.
        let elems = memory::assign_offsets(&mut e.buffers, &liveness, &live_to_end) / 4;
        live += memory::live_peak(&e.buffers, &liveness, &live_to_end) * u64::from(n_slots);
        unplanned += e
            .buffers
            .iter()
            .enumerate()
            .filter(|(i, b)| {
                b.chunk == Some(c)
                    && b.class == BufferClass::Activation
                    && !e.view_of.contains_key(&(*i as BufId))
            })
            .map(|(_, b)| b.len() * b.dtype.size_bytes())
            .sum::<u64>()
            * u64::from(n_slots);
        let inputs: Vec<BufId> = usage
            .chunk_inputs
            .get(&c)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default();
        let weight = if geo.split_bw {
            weight
        } else {
            backward.extend(weight);
            Vec::new()
        };
        let mine = || {
            (0..geo.chunk_of_layer.len() as u64).filter(|&l| geo.chunk_of_layer[l as usize] == c)
        };
        let layers = mine()
            .next()
            .zip(mine().next_back())
            .map(|(a, b)| [a, b + 1]);
        chunks.push(ChunkProgram {
            chunk: c,
            forward,
            backward,
            weight,
            activation_base: base,
            activation_elems: elems,
            slots: n_slots,
            inputs,
            layers,
        });
        base += elems * u64::from(n_slots);
    }
    // The optimizer's activations (the norm) after the chunks' slots.
    let liveness = memory::Liveness {
        programs: vec![optimizer.clone()],
        view_of: e.view_of.clone(),
    };
    let touched: BTreeSet<BufId> = optimizer
        .iter()
        .flat_map(Instr::buffers)
        .filter(|&b| e.buffers[b as usize].class == BufferClass::Activation)
        .collect();
    let elems = memory::assign_offsets(&mut e.buffers, &liveness, &[]) / 4;
    for &b in &touched {
        let size = e.buffers[b as usize].dtype.size_bytes().max(1);
        e.buffers[b as usize].offset += base * 4 / size;
    }
    let stage_bytes = |class: BufferClass, buffers: &[Buffer]| -> u64 {
        buffers
            .iter()
            .filter(|b| b.class == class && b.stage == Some(s))
            .map(|b| b.far_end(&e.g.mesh) * b.dtype.size_bytes())
            .max()
            .unwrap_or(0)
    };
    let stage_inputs: BTreeSet<BufId> = chunks.iter().flat_map(|c| c.inputs.clone()).collect();
    let mem = MemoryPlan {
        param_bytes: stage_bytes(BufferClass::Param, &e.buffers),
        grad_bytes: stage_bytes(BufferClass::Grad, &e.buffers),
        opt_state_bytes: stage_bytes(BufferClass::OptState, &e.buffers),
        activation_bytes: (base + elems) * 4,
        activation_bytes_unplanned: unplanned + elems * 4,
        activation_bytes_live: live + elems * 4,
        input_bytes: stage_inputs
            .iter()
            .map(|&b| {
                let buf = &e.buffers[b as usize];
                (buf.offset + buf.len()) * buf.dtype.size_bytes()
            })
            .max()
            .unwrap_or(0),
        staging_bytes: 0,
    };
    let inputs = e
        .inputs
        .iter()
        .filter(|(_, b)| stage_inputs.contains(b))
        .map(|(k, &b)| (k.clone(), b))
        .collect();
    let mut results = BTreeMap::new();
    let mut result_axes = BTreeMap::new();
    for k in &loss_keys {
        let b = e.results[k];
        if e.buffers[b as usize].stage == Some(s) {
            results.insert(k.clone(), b);
        }
        // Only the last stage has the loss: every stage adds it up over pp to report it.
        let mut axes = e.result_axes.get(k).cloned().unwrap_or_default();
        axes.push(Axis::Pp);
        result_axes.insert(k.clone(), axes);
    }
    results.insert("grad_norm".to_string(), norm);
    let actions = geo.lists[s as usize]
        .iter()
        .filter_map(|a| {
            let kind = match a.kind {
                ActionKind::F => PipeKind::F,
                ActionKind::B => PipeKind::B,
                ActionKind::W => PipeKind::W,
                ActionKind::BW => PipeKind::BW,
                _ => return None,
            };
            Some(PipeAction {
                kind,
                chunk: a.chunk,
                microbatch: a.microbatch,
            })
        })
        .collect();
    let dpp = match geo.kind {
        ScheduleKind::Dpp(policy) => Some(DppExec {
            policy: spec.parallel.dpp_policy,
            cap: policy.cap_or(pp),
        }),
        _ => None,
    };
    Role {
        name: format!("stage{s}"),
        microbatch: Vec::new(),
        optimizer,
        inputs,
        results,
        result_axes,
        pipeline: Some(Pipeline {
            schedule: spec.parallel.schedule.as_str().to_string(),
            chunks_total: nc,
            chunks,
            actions,
            dpp,
        }),
        memory: Some(mem),
    }
}

/// MegaFBD: a forward role per stage (roles `pp..2pp`, the `fbd` coordinate 1). It runs only
/// the forward segments, micro-batch after micro-batch, with one activation slot per chunk,
/// exchanges activations with the other stages' forward roles, and sends every stage input it
/// receives to its twin, the backward role (the stage's role from the split), which receives
/// them instead of the previous stage's activations, recomputes the forward, runs the backward
/// and the optimizer, and sends the updated parameters back to the forward role after every
/// step. Transfer ids: the twin's stage inputs `base + t`, the parameters after them.
fn fbd_forward_roles(
    e: &Emitter,
    roles: &mut [Role],
    consumer_phase: &[Phase],
    base: u32,
    m: u32,
) -> Vec<Role> {
    let twin_id = |t: u32| base + t;
    let mut next_param = base + consumer_phase.len() as u32;
    let mut forward_roles = Vec::new();
    for (s, role) in roles.iter_mut().enumerate() {
        let s = s as u32;
        let Some(pipe) = role.pipeline.as_mut() else {
            continue;
        };
        let forward_phase = |t: u32| {
            consumer_phase
                .get(t as usize)
                .is_none_or(|&ph| ph == Phase::F)
        };
        let mut fchunks = Vec::new();
        let mut fbase = 0u64;
        for chunk in &mut pipe.chunks {
            let c = chunk.chunk;
            let mut fwd = Vec::new();
            let mut bwd_fwd = Vec::new();
            for instr in &chunk.forward {
                match *instr {
                    Instr::Recv {
                        buffer, transfer, ..
                    } => {
                        // The forward role receives from the previous stage's forward role
                        // and passes the stage input on to its twin.
                        fwd.push(instr.clone());
                        fwd.push(Instr::Send {
                            buffer,
                            chunk: c,
                            transfer: twin_id(transfer),
                            twin: true,
                        });
                        bwd_fwd.push(Instr::Recv {
                            buffer,
                            chunk: c,
                            transfer: twin_id(transfer),
                            twin: true,
                        });
                    }
                    Instr::Send { transfer, .. } if forward_phase(transfer) => {
                        fwd.push(instr.clone());
                    }
                    Instr::Send { .. } => bwd_fwd.push(instr.clone()),
                    _ => {
                        fwd.push(instr.clone());
                        bwd_fwd.push(instr.clone());
                    }
                }
            }
            chunk.forward = bwd_fwd;
            fchunks.push(ChunkProgram {
                chunk: c,
                forward: fwd,
                backward: Vec::new(),
                weight: Vec::new(),
                activation_base: fbase,
                activation_elems: chunk.activation_elems,
                slots: 1,
                inputs: chunk.inputs.clone(),
                layers: chunk.layers,
            });
            fbase += chunk.activation_elems;
        }
        // Updated parameters (and tied copies) go to the forward role after each step.
        let mut recvs = Vec::new();
        for entry in &e.params {
            for b in std::iter::once(entry.buffer).chain(entry.tied_copies.iter().copied()) {
                if e.buffers[b as usize].stage != Some(s) {
                    continue;
                }
                let send = Instr::Send {
                    buffer: b,
                    chunk: s,
                    transfer: next_param,
                    twin: true,
                };
                role.optimizer.push(send);
                recvs.push(Instr::Recv {
                    buffer: b,
                    chunk: s,
                    transfer: next_param,
                    twin: true,
                });
                next_param += 1;
            }
        }
        let actions = (0..m)
            .flat_map(|j| {
                fchunks.iter().map(move |c| PipeAction {
                    kind: PipeKind::F,
                    chunk: c.chunk,
                    microbatch: j,
                })
            })
            .collect();
        let mem = role.memory.clone().unwrap_or_default();
        let memory = MemoryPlan {
            grad_bytes: 0,
            opt_state_bytes: 0,
            activation_bytes: fbase * 4,
            activation_bytes_unplanned: fbase * 4,
            activation_bytes_live: fbase * 4,
            ..mem
        };
        forward_roles.push(Role {
            name: format!("stage{s}.forward"),
            microbatch: Vec::new(),
            optimizer: recvs,
            inputs: role.inputs.clone(),
            results: BTreeMap::new(),
            result_axes: BTreeMap::new(),
            pipeline: Some(Pipeline {
                schedule: "fbd-forward".into(),
                chunks_total: pipe.chunks_total,
                chunks: fchunks,
                actions,
                dpp: None,
            }),
            memory: Some(memory),
        });
    }
    forward_roles
}
