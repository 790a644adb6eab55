//! MegaFBD (forward-backward decoupling): a forward-only role per pipeline stage that
//! hands its stage inputs to the stage's backward role and receives the updated parameters
//! after every step.

use std::collections::BTreeMap;

use megac_ir::plan::{ChunkProgram, Instr, MemoryPlan, PipeAction, PipeKind, Pipeline, Role};

use super::Phase;
use crate::Emitter;

/// MegaFBD: a forward role per stage (roles `pp..2pp`, the `fbd` coordinate 1). It runs only
/// the forward segments, micro-batch after micro-batch, with one activation slot per chunk,
/// exchanges activations with the other stages' forward roles, and sends every stage input it
/// receives to its twin, the backward role (the stage's role from the split), which receives
/// them instead of the previous stage's activations, recomputes the forward, runs the backward
/// and the optimizer, and sends the updated parameters back to the forward role after every
/// step. Transfer ids: the twin's stage inputs `base + t`, the parameters after them.
pub(super) fn fbd_forward_roles(
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
        // The transient scratch (stage_role) comes first; the forward role's slots follow.
        let mut fbase = pipe.chunks.first().map_or(0, |c| c.activation_base);
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
                decode: Vec::new(),
                decode_inputs: Vec::new(),
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
            decode: None,
        });
    }
    forward_roles
}
