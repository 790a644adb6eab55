//! Stage roles (step 4 of the split): the activation slots of every chunk under the
//! schedule, and the role of each pipeline stage: its chunk programs with their activation
//! memory, the optimizer program, inputs, results, action list and memory summary.

use std::collections::{BTreeMap, BTreeSet};

use megac_ir::pipeline::{ActionKind, ScheduleKind};
use megac_ir::plan::{
    BufId, Buffer, BufferClass, ChunkProgram, DppExec, Instr, MemoryPlan, PipeAction, PipeKind,
    Pipeline, Role,
};
use megac_ir::Axis;

use super::placement::Usage;
use super::{Geometry, Phase};
use crate::{memory, Emitter};

/// The most micro-batches of the chunks `group` in flight at once on stage `s` under a
/// static schedule (None for dpp, whose order is decided at run time).
fn concurrent(geo: &Geometry, s: u32, group: &BTreeSet<u32>) -> Option<u32> {
    if matches!(geo.kind, ScheduleKind::Dpp(_)) {
        return None;
    }
    let (mut inflight, mut most) = (0u32, 0u32);
    for a in geo
        .lists
        .get(s as usize)?
        .iter()
        .filter(|a| group.contains(&a.chunk))
    {
        match a.kind {
            ActionKind::F => {
                inflight += 1;
                most = most.max(inflight);
            }
            ActionKind::BW | ActionKind::W => inflight = inflight.saturating_sub(1),
            _ => {}
        }
    }
    Some(most.max(1))
}

/// Activation slots per chunk: the most micro-batches of the chunk in flight under the
/// schedule (all of them for dpp, whose order is decided at run time).
pub(super) fn slot_counts(geo: &Geometry) -> Vec<u32> {
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
pub(super) fn stage_role(
    e: &mut Emitter,
    s: u32,
    geo: &Geometry,
    segs: &mut BTreeMap<(u32, Phase), Vec<Instr>>,
    slots: &[u32],
    usage: &Usage,
    optimizer: Vec<Instr>,
    norm: Option<BufId>,
) -> Role {
    let spec = e.spec;
    let loss_keys: Vec<String> = ["loss", "total_loss"]
        .iter()
        .filter(|k| e.results.contains_key(**k))
        .map(|k| k.to_string())
        .collect();
    let mut live_to_end: Vec<BufId> = loss_keys.iter().map(|k| e.results[k]).collect();
    // Probes are read after the forward.
    live_to_end.extend(e.probes.iter().copied());
    let placed = chunk_programs(e, s, geo, segs, slots, usage, &live_to_end);
    let opt_elems = place_optimizer_activations(e, &optimizer, placed.base);
    let stage_inputs: BTreeSet<BufId> = placed
        .chunks
        .iter()
        .flat_map(|c| c.inputs.clone())
        .collect();
    let mem = stage_memory(e, s, &placed, opt_elems, &stage_inputs);
    let inputs = e
        .inputs
        .iter()
        .filter(|(_, b)| stage_inputs.contains(b))
        .map(|(k, &b)| (k.clone(), b))
        .collect();
    let (results, result_axes) = stage_results(e, s, &loss_keys, norm);
    Role {
        name: format!("stage{s}"),
        microbatch: Vec::new(),
        optimizer,
        inputs,
        results,
        result_axes,
        pipeline: Some(Pipeline {
            schedule: spec.parallel.schedule.as_str().to_string(),
            chunks_total: geo.nc,
            chunks: placed.chunks,
            actions: stage_actions(geo, s, e.inference),
            dpp: match geo.kind {
                ScheduleKind::Dpp(policy) => Some(DppExec {
                    policy: spec.parallel.dpp_policy,
                    cap: policy.cap_or(geo.pp),
                }),
                _ => None,
            },
        }),
        memory: Some(mem),
        decode: None,
    }
}

/// A stage's chunk programs with the activation memory their slots take.
struct PlacedChunks {
    chunks: Vec<ChunkProgram>,
    /// Activation elements taken by every chunk's slots (where the optimizer's begin).
    base: u64,
    /// Bytes of the chunks' activations without liveness reuse, times their slots.
    unplanned: u64,
    /// Peak live activation bytes of the chunks, times their slots.
    live: u64,
}

/// The chunks of stage `s`: each chunk's segments (the backward and weight segments merged
/// unless the schedule splits them), the data inputs it reads and its layers, and their
/// activation memory.
///
/// An activation used by only one segment (a forward's temporaries, the recomputed forward
/// and the activation gradients of a backward, ...) is *transient*: it lives in one scratch
/// region at the start of the stage's activation arena, shared by every segment of every
/// chunk (a rank runs one segment at a time), and has no chunk. Only what a micro-batch keeps
/// from one segment to a later one (what the backward reads of the forward, what the weight
/// segment reads of the backward) takes a slot per micro-batch in flight, each chunk's slots
/// placed one after another after the scratch; under a static schedule the chunks that keep
/// the same size share one pool of as many slots as micro-batches of them are in flight
/// together (not the sum of each chunk's most). So full recomputation keeps one layer input per micro-batch and layer, and
/// more chunks (vpp) do not multiply what a chunk needs only while it runs.
fn chunk_programs(
    e: &mut Emitter,
    s: u32,
    geo: &Geometry,
    segs: &mut BTreeMap<(u32, Phase), Vec<Instr>>,
    slots: &[u32],
    usage: &Usage,
    live_to_end: &[BufId],
) -> PlacedChunks {
    let (pp, nc) = (geo.pp, geo.nc);
    let mine: Vec<(u32, [Vec<Instr>; 3])> = (s..nc)
        .step_by(pp as usize)
        .map(|c| {
            (
                c,
                [Phase::F, Phase::B, Phase::W].map(|ph| segs.remove(&(c, ph)).unwrap_or_default()),
            )
        })
        .collect();
    let transient = transient_activations(e, &mine, live_to_end);
    for b in 0..e.buffers.len() {
        let r = *e.view_of.get(&(b as BufId)).unwrap_or(&(b as BufId));
        if transient.contains(&r) {
            e.buffers[b].chunk = None;
        }
    }
    // The scratch: every segment's transient activations, placed by liveness over all the
    // segments in a row (each dies within its segment, so different segments share room).
    let all = memory::Liveness {
        programs: mine.iter().flat_map(|(_, p)| p.iter().cloned()).collect(),
        view_of: e.view_of.clone(),
    };
    let scratch =
        memory::assign_offsets_where(&mut e.buffers, &all, &[], &|r| transient.contains(&r))
            .div_ceil(4);
    let mut live = memory::live_peak_where(&e.buffers, &all, &[], &|r| transient.contains(&r));
    let mut chunks = Vec::new();
    let mut base = scratch;
    let mut unplanned = 0u64;
    for (c, [forward, mut backward, weight]) in mine {
        let n_slots = slots[c as usize];
        let liveness = memory::Liveness {
            programs: vec![forward.clone(), backward.clone(), weight.clone()],
            view_of: e.view_of.clone(),
        };
        let kept: BTreeSet<BufId> = (0..e.buffers.len() as BufId)
            .filter(|&b| e.buffers[b as usize].chunk == Some(c))
            .collect();
        let in_slot = |r: BufId| kept.contains(&r);
        // Slots are counted in the runtime's 4-byte arena units.
        let elems =
            memory::assign_offsets_where(&mut e.buffers, &liveness, live_to_end, &in_slot) / 4;
        live += memory::live_peak_where(&e.buffers, &liveness, live_to_end, &in_slot)
            * u64::from(n_slots);
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
        let layers_of = || {
            (0..geo.chunk_of_layer.len() as u64).filter(|&l| geo.chunk_of_layer[l as usize] == c)
        };
        let layers = layers_of()
            .next()
            .zip(layers_of().next_back())
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
            decode: Vec::new(),
            decode_inputs: Vec::new(),
        });
        base += elems * u64::from(n_slots);
    }
    // Under a static schedule, chunks that keep the same size (the layers' chunks, as
    // opposed to those with the embedding or the head) share one pool of slots instead: as
    // many as micro-batches of them are in flight together on the stage.
    let mut sizes: BTreeMap<u64, BTreeSet<u32>> = BTreeMap::new();
    for c in &chunks {
        sizes.entry(c.activation_elems).or_default().insert(c.chunk);
    }
    let pooled: Vec<(u64, BTreeSet<u32>, u32)> = sizes
        .into_iter()
        .filter(|(elems, group)| *elems > 0 && group.len() > 1)
        .filter_map(|(elems, group)| concurrent(geo, s, &group).map(|n| (elems, group, n)))
        .collect();
    if !pooled.is_empty() {
        base = scratch;
        for c in chunks
            .iter_mut()
            .filter(|c| !pooled.iter().any(|p| p.1.contains(&c.chunk)))
        {
            c.activation_base = base;
            base += c.activation_elems * u64::from(c.slots);
        }
        for (elems, group, n) in &pooled {
            for c in chunks.iter_mut().filter(|c| group.contains(&c.chunk)) {
                c.activation_base = base;
                c.slots = *n;
            }
            base += elems * u64::from(*n);
        }
        live = live.min(base * 4);
    }
    // Without reuse, the transient activations would take their full size too.
    unplanned += e
        .buffers
        .iter()
        .enumerate()
        .filter(|(i, _)| transient.contains(&(*i as BufId)))
        .map(|(_, b)| b.len() * b.dtype.size_bytes())
        .sum::<u64>();
    PlacedChunks {
        chunks,
        base,
        unplanned,
        live,
    }
}

/// The activations of `chunks` (a stage's chunks with their forward, backward and weight
/// segments) that one segment alone uses, as allocation units (root buffers): the rest
/// (used by two segments, or read after the step as `live_to_end` results) must survive
/// between a micro-batch's segments.
fn transient_activations(
    e: &Emitter,
    chunks: &[(u32, [Vec<Instr>; 3])],
    live_to_end: &[BufId],
) -> BTreeSet<BufId> {
    let root = |b: BufId| *e.view_of.get(&b).unwrap_or(&b);
    let results: BTreeSet<BufId> = live_to_end.iter().map(|&b| root(b)).collect();
    let mut out = BTreeSet::new();
    for (c, programs) in chunks {
        let mut used: BTreeMap<BufId, u8> = BTreeMap::new();
        for (k, program) in programs.iter().enumerate() {
            for instr in program {
                for b in instr.buffers() {
                    let r = root(b);
                    let buf = &e.buffers[r as usize];
                    if buf.class == BufferClass::Activation && buf.chunk == Some(*c) {
                        *used.entry(r).or_default() |= 1 << k;
                    }
                }
            }
        }
        out.extend(
            used.into_iter()
                .filter(|(r, mask)| mask.count_ones() == 1 && !results.contains(r))
                .map(|(r, _)| r),
        );
    }
    out
}

/// The optimizer's activations (the norm), placed by liveness after the chunks' slots
/// (`base` elements); returns the elements they take.
fn place_optimizer_activations(e: &mut Emitter, optimizer: &[Instr], base: u64) -> u64 {
    let liveness = memory::Liveness {
        programs: vec![optimizer.to_vec()],
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
    elems
}

/// Stage `s`'s memory: its own persistent arenas, its chunks' slots and the optimizer's
/// `opt_elems` activation elements, and the data inputs it reads.
fn stage_memory(
    e: &Emitter,
    s: u32,
    placed: &PlacedChunks,
    opt_elems: u64,
    stage_inputs: &BTreeSet<BufId>,
) -> MemoryPlan {
    let stage_bytes = |class: BufferClass, buffers: &[Buffer]| -> u64 {
        buffers
            .iter()
            .filter(|b| b.class == class && b.stage == Some(s))
            .map(|b| b.far_end(&e.g.mesh) * b.dtype.size_bytes())
            .max()
            .unwrap_or(0)
    };
    MemoryPlan {
        param_bytes: stage_bytes(BufferClass::Param, &e.buffers),
        grad_bytes: stage_bytes(BufferClass::Grad, &e.buffers),
        opt_state_bytes: stage_bytes(BufferClass::OptState, &e.buffers),
        activation_bytes: (placed.base + opt_elems) * 4,
        activation_bytes_unplanned: placed.unplanned + opt_elems * 4,
        activation_bytes_live: placed.live + opt_elems * 4,
        input_bytes: stage_inputs
            .iter()
            .map(|&b| {
                let buf = &e.buffers[b as usize];
                (buf.offset + buf.len()) * buf.dtype.size_bytes()
            })
            .max()
            .unwrap_or(0),
        staging_bytes: 0,
        kv_cache_bytes: 0,
    }
}

/// Stage `s`'s results and the axes each is summed over to report it: the loss where the
/// stage holds it (every stage sums it over pp) and the stage's gradient norm `norm`.
#[allow(clippy::type_complexity)]
fn stage_results(
    e: &Emitter,
    s: u32,
    loss_keys: &[String],
    norm: Option<BufId>,
) -> (BTreeMap<String, BufId>, BTreeMap<String, Vec<Axis>>) {
    let mut results = BTreeMap::new();
    let mut result_axes = BTreeMap::new();
    for k in loss_keys {
        let b = e.results[k];
        if e.buffers[b as usize].stage == Some(s) {
            results.insert(k.clone(), b);
        }
        // Only the last stage has the loss: every stage adds it up over pp to report it.
        let mut axes = e.result_axes.get(k).cloned().unwrap_or_default();
        axes.push(Axis::Pp);
        result_axes.insert(k.clone(), axes);
    }
    if let Some(norm) = norm {
        results.insert("grad_norm".to_string(), norm);
    }
    (results, result_axes)
}

/// Stage `s`'s action list from the schedule (its compute actions; transfers are
/// instructions in the chunk programs); an inference plan's forward actions only.
fn stage_actions(geo: &Geometry, s: u32, inference: bool) -> Vec<PipeAction> {
    geo.lists[s as usize]
        .iter()
        .filter_map(|a| {
            let kind = match a.kind {
                ActionKind::F => PipeKind::F,
                _ if inference => return None,
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
        .collect()
}
