//! Pipeline execution: one step of a pipeline stage's role.
//!
//! The role's chunks hold forward (`F`), backward (`B`, or the whole backward `BW`) and, for
//! zero-bubble schedules, weight-gradient (`W`) segments; transfers between chunks are
//! `Send`/`Recv` instructions inside them, tagged by transfer and micro-batch, so messages
//! never need to arrive in order. A static schedule runs the plan's action list as it is.
//! The `dpp` schedule (MegaDPP) runs dynamically: at each point the rank runs the
//! highest-priority task whose inputs have arrived; the ranks of one tensor- and
//! context-parallel group agree on the choice (a max-reduction of their "not ready" flags)
//! before running it, because the task's collectives must match across them.
//!
//! Each forward takes a free activation slot of its chunk's pool (its own slots, or those a
//! static schedule's chunks on the stage share); the chunk's last backward segment for that
//! micro-batch frees it.

use std::collections::BTreeMap;

use megac_ir::mesh::local_chunk;
use megac_ir::plan::{ChunkProgram, Instr, PipeAction, PipeKind, Pipeline};
use megac_ir::spec::DppTask;
use megac_ir::Axis;

use crate::error::RuntimeError;
use crate::exec::transfer_peer;
use crate::train::Session;

/// Per-step state of a rank's pipeline: which slots are free and which tasks are done.
struct State {
    /// Free slots per pool ([`ChunkProgram::pool_key`]).
    free: BTreeMap<(u64, u32), Vec<u32>>,
    slot_of: BTreeMap<(u32, u32), u32>,
    /// Per (chunk, micro-batch): forward done, input-gradient done, all done.
    f_done: BTreeMap<(u32, u32), bool>,
    b_done: BTreeMap<(u32, u32), bool>,
    loss: f64,
}

/// Run one step's micro-batches through this rank's pipeline chunks; returns the rank's
/// share of the step loss (0 on stages without the head).
pub(crate) fn run_step(session: &mut Session<'_>, step: u64) -> Result<f64, RuntimeError> {
    let role = session.role();
    let pipe = role
        .pipeline
        .as_ref()
        .ok_or_else(|| RuntimeError::Plan("run_step needs a pipelined role".into()))?;
    let m = session.plan.batch.microbatches;
    if let Some(a) = pipe
        .actions
        .iter()
        .find(|a| u64::from(a.microbatch) >= m || !pipe.chunks.iter().any(|c| c.chunk == a.chunk))
    {
        return Err(RuntimeError::Plan(format!(
            "pipeline action {a:?} names a micro-batch or chunk this role does not have ({m} micro-batches)"
        )));
    }
    let data: Vec<(Vec<i32>, Vec<i32>)> = (0..m).map(|mb| session.load(step, mb)).collect();
    let mut st = State {
        free: pipe
            .chunks
            .iter()
            .map(|c| (c.pool_key(), (0..c.slots).rev().collect()))
            .collect(),
        slot_of: BTreeMap::new(),
        f_done: BTreeMap::new(),
        b_done: BTreeMap::new(),
        loss: 0.0,
    };
    session.executed.clear();
    match &pipe.dpp {
        None => {
            for &a in &pipe.actions {
                run_action(session, pipe, &mut st, a, step, &data)?;
            }
        }
        Some(dpp) => run_dynamic(session, pipe, &mut st, dpp, step, &data)?,
    }
    Ok(st.loss)
}

fn chunk_of(pipe: &Pipeline, c: u32) -> Result<&ChunkProgram, RuntimeError> {
    pipe.chunks
        .iter()
        .find(|p| p.chunk == c)
        .ok_or_else(|| RuntimeError::Plan(format!("the role has no chunk {c}")))
}

fn run_action(
    session: &mut Session<'_>,
    pipe: &Pipeline,
    st: &mut State,
    a: PipeAction,
    step: u64,
    data: &[(Vec<i32>, Vec<i32>)],
) -> Result<(), RuntimeError> {
    let (c, j) = (a.chunk, a.microbatch);
    let prog = chunk_of(pipe, c)?;
    let bad = |what: String| RuntimeError::Plan(format!("pipeline action {a:?}: {what}"));
    let slot = match a.kind {
        PipeKind::F => {
            let slot = st
                .free
                .get_mut(&prog.pool_key())
                .and_then(Vec::pop)
                .ok_or_else(|| bad(format!("chunk {c} has no free activation slot")))?;
            st.slot_of.insert((c, j), slot);
            slot
        }
        _ => *st
            .slot_of
            .get(&(c, j))
            .ok_or_else(|| bad("runs before its forward".into()))?,
    };
    session.mem.set_slot(c, slot);
    if !prog.inputs.is_empty() {
        let (tokens, labels) = &data[j as usize];
        session.write_inputs(tokens, labels);
    }
    let mut ctx = session.context(step);
    ctx.microbatch = u64::from(j);
    let segments: Vec<&[Instr]> = match a.kind {
        PipeKind::F => vec![&prog.forward],
        PipeKind::B => vec![&prog.backward],
        PipeKind::W => vec![&prog.weight],
        PipeKind::BW => vec![&prog.backward, &prog.weight],
    };
    let t0 = std::time::Instant::now();
    for seg in segments {
        session.run(seg, &ctx)?;
    }
    let kind = match a.kind {
        PipeKind::F => crate::scan::Kind::Forward,
        PipeKind::B => crate::scan::Kind::Backward,
        PipeKind::W => crate::scan::Kind::Weight,
        PipeKind::BW => crate::scan::Kind::BackwardWeight,
    };
    session.record(kind, t0, c, j);
    match a.kind {
        PipeKind::F => {
            st.f_done.insert((c, j), true);
            let mine = session
                .loss_buf
                .filter(|&b| session.mem.buffer(b).chunk == Some(c));
            st.loss += session.scalar(mine);
        }
        PipeKind::B => {
            st.b_done.insert((c, j), true);
        }
        _ => {}
    }
    let last = match a.kind {
        PipeKind::BW | PipeKind::W => true,
        PipeKind::B => prog.weight.is_empty(),
        // A forward-only chunk (an FBD forward role) keeps nothing for a backward.
        PipeKind::F => prog.backward.is_empty() && prog.weight.is_empty(),
    };
    if last {
        st.b_done.insert((c, j), true);
        st.slot_of.remove(&(c, j));
        st.free.entry(prog.pool_key()).or_default().push(slot);
    }
    session.executed.push(a);
    Ok(())
}

/// The messages, (peer, tag), that micro-batch `j`'s run of `seg` receives.
fn receives(session: &Session<'_>, seg: &[Instr], j: u32, step: u64) -> Vec<(usize, u64)> {
    let mut ctx = session.context(step);
    ctx.microbatch = u64::from(j);
    let rank = session.comm.rank();
    seg.iter()
        .filter_map(|instr| match instr {
            Instr::Recv {
                chunk,
                transfer,
                twin,
                ..
            } => Some(transfer_peer(
                session.plan,
                rank,
                *chunk,
                *transfer,
                *twin,
                &ctx,
            )),
            _ => None,
        })
        .collect()
}

/// Whether each task's messages (`needs`: its (peer, tag) pairs) have all arrived, in one
/// probe of the communicator.
fn probe(session: &mut Session<'_>, needs: &[&[(usize, u64)]]) -> Result<Vec<bool>, RuntimeError> {
    let wanted: Vec<(usize, u64)> = needs.concat();
    let arrived = session.comm.probe_tagged(&wanted)?;
    if arrived.len() != wanted.len() {
        return Err(RuntimeError::Plan(format!(
            "the communicator answered {} of {} probes",
            arrived.len(),
            wanted.len()
        )));
    }
    let mut at = 0;
    Ok(needs
        .iter()
        .map(|n| {
            let k = n.len();
            at += k;
            arrived[at - k..at].iter().all(|&a| a)
        })
        .collect())
}

/// MegaDPP: run the highest-priority ready task until all are done.
///
/// Priority (as the reference order of `megac_ir::pipeline::schedule`): a ready backward before any forward;
/// among backwards, later chunks first; `bfs` orders by chunk then micro-batch (all
/// micro-batches of a chunk first), `dfs` by micro-batch then chunk (one micro-batch through
/// all chunks first), `adaptive` is breadth-first while fewer than `cap` micro-batches are in
/// flight on the rank and depth-first beyond; `ordered` runs the ready task placed earliest
/// in the plan's reference order (interleaved's or 1F1B's).
fn run_dynamic(
    session: &mut Session<'_>,
    pipe: &Pipeline,
    st: &mut State,
    dpp: &megac_ir::plan::DppExec,
    step: u64,
    data: &[(Vec<i32>, Vec<i32>)],
) -> Result<(), RuntimeError> {
    let m = session.plan.batch.microbatches as u32;
    let nc = pipe.chunks_total;
    let mine: Vec<u32> = pipe.chunks.iter().map(|c| c.chunk).collect();
    // Every task, in a fixed order that all peers share.
    let tasks: Vec<PipeAction> = mine
        .iter()
        .flat_map(|&c| {
            (0..m).flat_map(move |j| {
                [PipeKind::F, PipeKind::BW].map(|kind| PipeAction {
                    kind,
                    chunk: c,
                    microbatch: j,
                })
            })
        })
        .collect();
    // Each task's place in the plan's reference order (`ordered`'s priority).
    let positions = pipe.positions(&tasks);
    let rank = session.comm.rank();
    let peers = session.plan.mesh.group(rank, &[Axis::Tp, Axis::Cp]);
    let mut done = vec![false; tasks.len()];
    let mut remaining = tasks.len();
    // Each task's messages, fixed for the step.
    let needs: Vec<Vec<(usize, u64)>> = tasks
        .iter()
        .map(|t| {
            let prog = chunk_of(pipe, t.chunk)?;
            let seg = if t.kind == PipeKind::F {
                &prog.forward
            } else {
                &prog.backward
            };
            Ok(receives(session, seg, t.microbatch, step))
        })
        .collect::<Result<_, RuntimeError>>()?;
    let mut idle_rounds = 0u64;
    let n = pipe.chunks.len() as u32;
    while remaining > 0 {
        let inflight = st.slot_of.len() as u32;
        let key = |i: usize| {
            let t = &tasks[i];
            dpp.policy.priority(
                inflight,
                dpp.cap,
                DppTask {
                    backward: t.kind != PipeKind::F,
                    local_chunk: local_chunk(t.chunk, nc / n.max(1)),
                    local_chunks: n,
                    microbatch: t.microbatch,
                    position: positions[i],
                },
            )
        };
        // Local readiness: a free slot for a forward, the forward done for a backward.
        let mut candidates = Vec::new();
        for (i, t) in tasks.iter().enumerate() {
            if done[i] {
                continue;
            }
            let local = match t.kind {
                PipeKind::F => {
                    let pool = chunk_of(pipe, t.chunk)?.pool_key();
                    st.free.get(&pool).is_some_and(|f| !f.is_empty())
                }
                _ => st.f_done.contains_key(&(t.chunk, t.microbatch)),
            };
            if local {
                candidates.push(i);
            }
        }
        // Alone (no tp/cp peers to agree with), the best candidate runs as soon as its
        // messages are there, whatever else has come: ask about it first, so that over MPI
        // a message already taken needs no MPI call (an idle one may give up the core).
        let best = candidates.iter().copied().min_by_key(|&i| key(i));
        let pick = match best {
            Some(b) if peers.len() == 1 && probe(session, &[&needs[b]])?[0] => Some(b),
            _ => {
                // Then every candidate's messages, in one probe; the group agrees.
                let asked: Vec<&[(usize, u64)]> =
                    candidates.iter().map(|&i| needs[i].as_slice()).collect();
                let ready = probe(session, &asked)?;
                let mut not_ready = vec![1f32; tasks.len()];
                for (&i, r) in candidates.iter().zip(ready) {
                    if r {
                        not_ready[i] = 0.0;
                    }
                }
                if peers.len() > 1 {
                    session.comm.all_reduce_max(&peers, &mut not_ready)?;
                }
                (0..tasks.len())
                    .filter(|&i| !done[i] && not_ready[i] == 0.0)
                    .min_by_key(|&i| key(i))
            }
        };
        match pick {
            Some(i) => {
                idle_rounds = 0;
                run_action(session, pipe, st, tasks[i], step, data)?;
                done[i] = true;
                remaining -= 1;
            }
            None => {
                // Nothing is ready: only another rank's send (or, with tp/cp peers, their
                // deposit in the readiness reduction) can change that. The local
                // communicator wakes on exactly those; others sleep briefly. Polling
                // instead took the cores from the ranks that compute (bench/dpp_jitter.py).
                idle_rounds += 1;
                if idle_rounds > 2 {
                    session
                        .comm
                        .wait_for_mail(std::time::Duration::from_micros(500))?;
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }
    Ok(())
}
