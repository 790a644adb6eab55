//! The validator of pipeline action lists: every compute action exactly once on its chunk's
//! rank and in dependency order, every transfer paired and ordered, and the lists running to
//! completion in the simulator.

use std::collections::HashMap;

use super::action::{same_message, Action, ActionKind, Payload};
use super::simulate::{simulate, Costs, SimError};
use crate::mesh::chunk_owner;

/// The first thing wrong with a set of action lists, found by [`validate`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ValidateError {
    /// The number of lists is not `pp`.
    #[error("expected {pp} rank lists, got {got}")]
    RankCount {
        /// Expected ranks.
        pp: u32,
        /// Lists given.
        got: usize,
    },
    /// An action out of range, on the wrong rank, or a transfer between the wrong ranks.
    #[error("rank {rank} action {index} ({action}): {reason}")]
    BadAction {
        /// The rank.
        rank: u32,
        /// Action index.
        index: usize,
        /// The action.
        action: Action,
        /// What is wrong.
        reason: String,
    },
    /// A compute action (or transfer) appears twice.
    #[error(
        "rank {rank} action {index} ({action}) duplicates rank {first_rank} action {first_index}"
    )]
    Duplicate {
        /// The rank of the second occurrence.
        rank: u32,
        /// Its index.
        index: usize,
        /// The action.
        action: Action,
        /// Rank of the first occurrence.
        first_rank: u32,
        /// Its index.
        first_index: usize,
    },
    /// A `(chunk, microbatch)` lacks a compute action (`kind` is `B` for a missing `B`/`BW`).
    #[error("no {kind:?} for chunk {chunk} microbatch {microbatch} (on rank {rank})")]
    MissingCompute {
        /// The missing kind.
        kind: ActionKind,
        /// Chunk.
        chunk: u32,
        /// Microbatch.
        microbatch: u32,
        /// The rank that should run it.
        rank: u32,
    },
    /// A needed transfer has no `Send` (`is_send`) or no `Recv`.
    #[error("missing {} of {payload:?} chunk {chunk} microbatch {microbatch} from rank {src} to rank {dst}", if *is_send { "Send" } else { "Recv" })]
    MissingTransfer {
        /// True for a missing `Send`, false for a missing `Recv`.
        is_send: bool,
        /// Activation or gradient.
        payload: Payload,
        /// Producing chunk.
        chunk: u32,
        /// Microbatch.
        microbatch: u32,
        /// Sending rank.
        src: u32,
        /// Receiving rank.
        dst: u32,
    },
    /// An action runs before one it depends on (on the same rank).
    #[error("rank {rank} action {index} ({action}) must come after action {dep_index} ({dep})")]
    Order {
        /// The rank.
        rank: u32,
        /// Index of the action that is too early.
        index: usize,
        /// The action.
        action: Action,
        /// Index of the action it must follow.
        dep_index: usize,
        /// That action.
        dep: Action,
    },
    /// The `k`-th send from `src` to `dst` is not the `k`-th receive at `dst` from `src`.
    #[error("rank {src} -> rank {dst}: send #{position} is action {send_index} ({sent}) but receive #{position} is action {recv_index} ({received})")]
    PairOrder {
        /// Sending rank.
        src: u32,
        /// Receiving rank.
        dst: u32,
        /// Position in the channel.
        position: usize,
        /// Index of the send on `src`.
        send_index: usize,
        /// Index of the receive on `dst`.
        recv_index: usize,
        /// The send.
        sent: Action,
        /// The receive.
        received: Action,
    },
    /// The simulator failed (deadlock).
    #[error(transparent)]
    Sim(#[from] SimError),
}

/// Checks action lists for `pp` ranks, `vpp` chunks per rank and `m` microbatches: ranges and
/// placement; every `(chunk, microbatch)` has exactly one `F` and one `BW` or one `B` and one
/// `W`; a backward follows its forward, `W` follows `B`, and same-rank neighbour chunks run in
/// dependency order; every cross-rank transfer has exactly one `Send` (after its producer) and
/// one `Recv` (before its consumer), in the same order per `(src, dst)`; and the lists run to
/// completion in [`simulate`] with unit costs. Returns the first violation.
pub fn validate(lists: &[Vec<Action>], pp: u32, vpp: u32, m: u32) -> Result<(), ValidateError> {
    if lists.len() != pp as usize {
        return Err(ValidateError::RankCount {
            pp,
            got: lists.len(),
        });
    }
    let nc = pp * vpp;
    // Slots: 0 = F, 1 = B, 2 = W. BW fills B and W.
    let mut compute: HashMap<(u8, u32, u32), (u32, usize)> = HashMap::new();
    // (is_send, payload as u8, chunk, mb) -> (rank, index)
    let mut comm: HashMap<(bool, u8, u32, u32), (u32, usize)> = HashMap::new();
    for (r, list) in lists.iter().enumerate() {
        let r = r as u32;
        for (i, a) in list.iter().enumerate() {
            let bad = |reason: String| ValidateError::BadAction {
                rank: r,
                index: i,
                action: *a,
                reason,
            };
            if a.chunk >= nc {
                return Err(bad(format!("chunk out of range 0..{nc}")));
            }
            if a.microbatch >= m {
                return Err(bad(format!("microbatch out of range 0..{m}")));
            }
            let dup = |first: (u32, usize)| ValidateError::Duplicate {
                rank: r,
                index: i,
                action: *a,
                first_rank: first.0,
                first_index: first.1,
            };
            let key = match a.kind {
                ActionKind::Send { payload, peer } | ActionKind::Recv { payload, peer } => {
                    let is_send = matches!(a.kind, ActionKind::Send { .. });
                    let (src, dst) = match payload {
                        Payload::Activation if a.chunk + 1 < nc => {
                            (chunk_owner(a.chunk, pp), chunk_owner(a.chunk + 1, pp))
                        }
                        Payload::Gradient if a.chunk > 0 => {
                            (chunk_owner(a.chunk, pp), chunk_owner(a.chunk - 1, pp))
                        }
                        _ => return Err(bad("no consumer chunk for this tensor".into())),
                    };
                    let (me, other) = if is_send { (src, dst) } else { (dst, src) };
                    if src == dst || me != r || other != peer {
                        return Err(bad(format!(
                            "this transfer goes from rank {src} to rank {dst}"
                        )));
                    }
                    let k = (is_send, payload as u8, a.chunk, a.microbatch);
                    if let Some(&first) = comm.get(&k) {
                        return Err(dup(first));
                    }
                    comm.insert(k, (r, i));
                    continue;
                }
                _ => {
                    if chunk_owner(a.chunk, pp) != r {
                        return Err(bad(format!(
                            "chunk {} lives on rank {}",
                            a.chunk,
                            chunk_owner(a.chunk, pp)
                        )));
                    }
                    a.kind
                }
            };
            let slots: &[u8] = match key {
                ActionKind::F => &[0],
                ActionKind::B => &[1],
                ActionKind::W => &[2],
                _ => &[1, 2],
            };
            for &s in slots {
                let k = (s, a.chunk, a.microbatch);
                if let Some(&first) = compute.get(&k) {
                    return Err(dup(first));
                }
                compute.insert(k, (r, i));
            }
        }
    }
    // Completeness.
    for c in 0..nc {
        for j in 0..m {
            for (s, kind) in [(0, ActionKind::F), (1, ActionKind::B), (2, ActionKind::W)] {
                if !compute.contains_key(&(s, c, j)) {
                    return Err(ValidateError::MissingCompute {
                        kind,
                        chunk: c,
                        microbatch: j,
                        rank: chunk_owner(c, pp),
                    });
                }
            }
        }
    }
    let at = |(r, i): (u32, usize)| lists[r as usize][i];
    let order = |later: (u32, usize), earlier: (u32, usize)| {
        if later.1 < earlier.1 {
            Err(ValidateError::Order {
                rank: later.0,
                index: later.1,
                action: at(later),
                dep_index: earlier.1,
                dep: at(earlier),
            })
        } else {
            Ok(())
        }
    };
    // Local dependencies.
    for c in 0..nc {
        for j in 0..m {
            let f = compute[&(0, c, j)];
            let b = compute[&(1, c, j)];
            let w = compute[&(2, c, j)];
            order(b, f)?;
            order(w, b)?;
            if c > 0 && chunk_owner(c - 1, pp) == chunk_owner(c, pp) {
                order(f, compute[&(0, c - 1, j)])?;
            }
            if c + 1 < nc && chunk_owner(c + 1, pp) == chunk_owner(c, pp) {
                order(b, compute[&(1, c + 1, j)])?;
            }
        }
    }
    // Transfers: existence, send after producer, recv before consumer.
    for c in 0..nc {
        for j in 0..m {
            for payload in [Payload::Activation, Payload::Gradient] {
                let (dst_chunk, producer, consumer) = match payload {
                    Payload::Activation if c + 1 < nc => (c + 1, (0, c), (0, c + 1)),
                    Payload::Gradient if c > 0 => (c - 1, (1, c), (1, c - 1)),
                    _ => continue,
                };
                let (src, dst) = (chunk_owner(c, pp), chunk_owner(dst_chunk, pp));
                if src == dst {
                    continue;
                }
                let missing = |is_send| ValidateError::MissingTransfer {
                    is_send,
                    payload,
                    chunk: c,
                    microbatch: j,
                    src,
                    dst,
                };
                let send = *comm
                    .get(&(true, payload as u8, c, j))
                    .ok_or_else(|| missing(true))?;
                let recv = *comm
                    .get(&(false, payload as u8, c, j))
                    .ok_or_else(|| missing(false))?;
                order(send, compute[&(producer.0, producer.1, j)])?;
                order(compute[&(consumer.0, consumer.1, j)], recv)?;
            }
        }
    }
    // Same order per (src, dst).
    for src in 0..pp {
        for dst in 0..pp {
            let sends = lists[src as usize]
                .iter()
                .enumerate()
                .filter(|(_, a)| matches!(a.kind, ActionKind::Send { peer, .. } if peer == dst));
            let recvs = lists[dst as usize]
                .iter()
                .enumerate()
                .filter(|(_, a)| matches!(a.kind, ActionKind::Recv { peer, .. } if peer == src));
            for (position, ((si, s), (ri, rv))) in sends.zip(recvs).enumerate() {
                if !same_message(s, rv) {
                    return Err(ValidateError::PairOrder {
                        src,
                        dst,
                        position,
                        send_index: si,
                        recv_index: ri,
                        sent: *s,
                        received: *rv,
                    });
                }
            }
        }
    }
    simulate(lists, Costs::unit())?;
    Ok(())
}
