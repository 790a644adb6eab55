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
//!
//! The steps live in one module each, in the order `split` runs them:
//! - `placement`: the chunk and phase of every instruction, who touches which buffer, and the
//!   stage of every buffer (steps 1 and 3);
//! - `tied`: parameters shared by stages (tied embeddings): their copies, the per-step
//!   reduction of their gradients and the refresh of the copies after each step;
//! - `transfers`: the cross-chunk activation copies and their `send`/`recv`s, and the
//!   per-(chunk, phase) segments (step 2);
//! - `optimizer`: the optimizer program split by stage, each stage's persistent arenas and
//!   gradient reduction (buckets or ZeRO-1) (steps 3 and 4);
//! - `roles`: activation slots and the role of each stage (chunk programs, memory, results,
//!   action list) (step 4);
//! - `fbd`: MegaFBD's forward roles.

mod fbd;
mod optimizer;
mod placement;
mod roles;
mod tied;
mod transfers;

use megac_ir::pipeline::{self, ScheduleKind};
use megac_ir::plan::{MemoryPlan, Role};

use crate::{CodegenError, Emitter};

/// Segment of a chunk's micro-batch work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    F,
    B,
    W,
}

/// What the split produces: one role per pipeline rank and the plan-wide memory summary.
pub(crate) struct Split {
    /// Backward (or only) roles `0..pp`, then FBD's forward roles `pp..2pp`.
    pub roles: Vec<Role>,
    /// The plan-wide memory: each field the largest over the roles.
    pub memory: MemoryPlan,
}

/// A layout the pipeline split cannot lower.
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

/// Split the emitter's single-stage programs into pipeline roles.
pub(crate) fn split(e: &mut Emitter) -> Result<Split, CodegenError> {
    let geo = Geometry::of(e.spec)?;
    let pp = geo.pp;
    let program = std::mem::take(&mut e.microbatch);
    let place = placement::place_instructions(e, &program, &geo);
    let usage = placement::scan_usage(e, &program, &place, pp)?;
    let tied = tied::tie_parameters(e, &usage)?;
    let (copy, transfers) = transfers::cut_transfers(e, &usage)?;
    let mut segs = transfers::segments(program, &place, &copy, &tied, &transfers, &geo);
    let folds = tied::fold_tied_gradients(e, &mut segs, &transfers, &tied, pp);
    placement::assign_stages(e, &usage, &tied, pp);
    // An inference plan has no optimizer: no norms, programs or tied-copy refreshes (the
    // copies are loaded like their parameter); its arenas are still packed per stage.
    let (norms, mut opt, refresh) = if e.inference {
        let none = vec![Vec::new(); pp as usize];
        (Vec::new(), none.clone(), none)
    } else {
        let (norms, opt) = optimizer::split_optimizer(e, pp)?;
        let refresh = tied::tied_refresh(&tied, transfers.len() as u32, pp);
        (norms, opt, refresh)
    };
    optimizer::stage_optimizers(e, &mut opt, &norms, refresh, &tied)?;
    let first_fold = (transfers.len() + tied.copy.len()) as u32;
    tied::reduce_tied_gradients(e, &mut opt, &folds, first_fold);
    let slots = roles::slot_counts(&geo);
    let mut roles = Vec::new();
    let mut mems = Vec::new();
    for s in 0..pp {
        let optimizer = std::mem::take(&mut opt[s as usize]);
        let role = roles::stage_role(
            e,
            s,
            &geo,
            &mut segs,
            &slots,
            &usage,
            optimizer,
            norms.get(s as usize).copied(),
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
        let forward = fbd::fbd_forward_roles(e, &mut roles, &consumer_phase, total, geo.m);
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
        kv_cache_bytes: 0,
    };
    Ok(Split { roles, memory })
}
