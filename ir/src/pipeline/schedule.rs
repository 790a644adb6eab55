//! Schedule construction: one action list per pipeline rank for a [`ScheduleKind`].
//!
//! A model cut into `pp * vpp` chunks (virtual stages) runs on `pp` pipeline ranks; chunk `c`
//! lives on rank `c % pp` (Megatron's interleaved placement, so with `vpp == 1` chunk `c` is
//! rank `c`). One training step pushes `m` microbatches through every chunk forward (`F`) and
//! backward, either fused (`BW`, full backward) or split into input-gradient `B` and
//! weight-gradient `W` (zero-bubble schedules).
//!
//! [`schedule`] builds the lists. Communication is explicit: an `F` on chunk `c > 0` whose
//! previous chunk lives on another rank is preceded by a `Recv` of the activation, an `F` on a
//! non-last chunk is followed by a `Send` to the rank holding `c + 1`; backward mirrors this
//! with gradients. [`with_transfers`] adds the transfers to compute lists built elsewhere (a
//! compiled plan's). The simulator is [`simulate`](mod@super::simulate), the validator
//! [`validate`](mod@super::validate); `megac schedule` prints and draws the lists
//! (`src/render/schedule.rs`).
//! See `docs/schedules.md` for the schedules and the bubble formulas the tests verify.

use std::collections::{HashMap, VecDeque};

use super::action::{same_message, Action, ActionKind, Payload};
use crate::mesh::{chunk_owner, global_chunk};
use crate::spec::DppTask;

/// MegaDPP's policy: its home is [`crate::spec`] (with the priority the runtime and the
/// simulator use too).
pub use crate::spec::DppPolicy;

/// The pipeline schedules [`schedule`] builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleKind {
    /// All forwards, then all (fused) backwards.
    GPipe,
    /// PipeDream-flush 1F1B: warmup forwards, steady 1F1B, cooldown backwards.
    OneFOneB,
    /// Megatron's interleaved 1F1B over `vpp` chunks per rank, microbatch groups of `pp`.
    Interleaved,
    /// Zero-bubble ZB-H1: 1F1B's F/B order with `B`/`W` split and `W` filling the bubbles.
    ZbH1,
    /// MegaDPP: readiness-driven order under a breadth/depth-first priority (or, `ordered`,
    /// interleaved's or 1F1B's order run out of order).
    Dpp(DppPolicy),
}

impl ScheduleKind {
    /// The schedule a model.toml's `[parallel]` section asks for (`schedule`, `dpp_policy`).
    pub fn of(p: &crate::spec::ParallelSection) -> ScheduleKind {
        use crate::spec::Schedule;
        match p.schedule {
            Schedule::Gpipe => ScheduleKind::GPipe,
            Schedule::OneFOneB => ScheduleKind::OneFOneB,
            Schedule::Interleaved => ScheduleKind::Interleaved,
            Schedule::ZbH1 => ScheduleKind::ZbH1,
            Schedule::Dpp => ScheduleKind::Dpp(p.dpp_policy),
        }
    }

    /// The CLI name: `gpipe`, `1f1b`, `interleaved`, `zb-h1`, `dpp-bfs`, `dpp-dfs`,
    /// `dpp-adaptive`, `dpp-ordered`.
    pub fn name(&self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
            ScheduleKind::Dpp(DppPolicy::Bfs) => "dpp-bfs",
            ScheduleKind::Dpp(DppPolicy::Dfs) => "dpp-dfs",
            ScheduleKind::Dpp(DppPolicy::Adaptive { .. }) => "dpp-adaptive",
            ScheduleKind::Dpp(DppPolicy::Ordered) => "dpp-ordered",
        }
    }
}

impl std::str::FromStr for ScheduleKind {
    type Err = ScheduleError;

    /// Parses the names [`ScheduleKind::name`] returns (`dpp` alone means `dpp-bfs`,
    /// MegaDPP's implemented order; `dpp-adaptive` uses the default cap `pp`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "gpipe" => ScheduleKind::GPipe,
            "1f1b" => ScheduleKind::OneFOneB,
            "interleaved" => ScheduleKind::Interleaved,
            "zb-h1" => ScheduleKind::ZbH1,
            "dpp" | "dpp-bfs" => ScheduleKind::Dpp(DppPolicy::Bfs),
            "dpp-dfs" => ScheduleKind::Dpp(DppPolicy::Dfs),
            "dpp-adaptive" => ScheduleKind::Dpp(DppPolicy::Adaptive { cap: None }),
            "dpp-ordered" => ScheduleKind::Dpp(DppPolicy::Ordered),
            _ => {
                return Err(ScheduleError::UnknownKind {
                    name: s.to_string(),
                })
            }
        })
    }
}

/// Why [`schedule`] refused a configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// `pp`, `vpp` or `m` is zero.
    #[error("{what} must be at least 1")]
    Zero {
        /// The parameter name.
        what: &'static str,
    },
    /// The schedule has no virtual stages; it needs `vpp == 1`.
    #[error("schedule `{kind}` needs vpp = 1 (got vpp = {vpp}); use `interleaved` or `dpp`")]
    VppUnsupported {
        /// The schedule name.
        kind: &'static str,
        /// The requested chunks per rank.
        vpp: u32,
    },
    /// Interleaving needs more than one chunk per rank.
    #[error("schedule `interleaved` needs vpp > 1 (got vpp = {vpp}); use `1f1b`")]
    VppRequired {
        /// The requested chunks per rank.
        vpp: u32,
    },
    /// Megatron's interleaved order needs microbatch groups of exactly `pp`.
    #[error("schedule `interleaved` needs m to be a multiple of pp (m = {m}, pp = {pp})")]
    MicrobatchesNotMultiple {
        /// Microbatches.
        m: u32,
        /// Pipeline ranks.
        pp: u32,
    },
    /// Not a schedule name.
    #[error(
        "unknown schedule `{name}`; schedules: gpipe, 1f1b, interleaved, zb-h1, dpp-bfs, \
         dpp-dfs, dpp-adaptive"
    )]
    UnknownKind {
        /// The name given.
        name: String,
    },
    /// The greedy list scheduler made no progress (a bug in this module).
    #[error("internal: list scheduler for `{kind}` stalled")]
    Stalled {
        /// The schedule name.
        kind: &'static str,
    },
}

/// Builds one action list per pipeline rank (index = rank), with explicit `Send`/`Recv`.
///
/// `gpipe`, `1f1b` and `zb-h1` need `vpp == 1`; `interleaved` needs `vpp > 1` and
/// `m % pp == 0`. `dpp` accepts any `vpp`: its lists are the order a readiness-driven runtime
/// following the policy's priority would take when every input arrives the moment its
/// producer finishes (unit costs f = 1, full backward = 2, zero-latency transfers). The
/// runtime is meant to execute the policy dynamically; the static list is its reference order.
pub fn schedule(
    kind: ScheduleKind,
    pp: u32,
    vpp: u32,
    m: u32,
) -> Result<Vec<Vec<Action>>, ScheduleError> {
    for (what, v) in [("pp", pp), ("vpp", vpp), ("m", m)] {
        if v == 0 {
            return Err(ScheduleError::Zero { what });
        }
    }
    let compute = match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB | ScheduleKind::ZbH1 if vpp != 1 => {
            return Err(ScheduleError::VppUnsupported {
                kind: kind.name(),
                vpp,
            })
        }
        ScheduleKind::GPipe => (0..pp)
            .map(|r| {
                let f = (0..m).map(|j| Action::compute(ActionKind::F, r, j));
                let b = (0..m).map(|j| Action::compute(ActionKind::BW, r, j));
                f.chain(b).collect()
            })
            .collect(),
        ScheduleKind::OneFOneB => (0..pp)
            .map(|r| one_f_one_b(pp, r, m, ActionKind::BW))
            .collect(),
        ScheduleKind::Interleaved => {
            if vpp < 2 {
                return Err(ScheduleError::VppRequired { vpp });
            }
            if !m.is_multiple_of(pp) {
                return Err(ScheduleError::MicrobatchesNotMultiple { m, pp });
            }
            (0..pp).map(|r| interleaved(pp, vpp, r, m)).collect()
        }
        ScheduleKind::ZbH1 => greedy(kind, pp, vpp, m)?,
        // `ordered`'s reference order is the static order it runs out of order.
        ScheduleKind::Dpp(DppPolicy::Ordered) if vpp == 1 => (0..pp)
            .map(|r| one_f_one_b(pp, r, m, ActionKind::BW))
            .collect(),
        ScheduleKind::Dpp(DppPolicy::Ordered) => {
            if !m.is_multiple_of(pp) {
                return Err(ScheduleError::MicrobatchesNotMultiple { m, pp });
            }
            (0..pp).map(|r| interleaved(pp, vpp, r, m)).collect()
        }
        ScheduleKind::Dpp(_) => greedy(kind, pp, vpp, m)?,
    };
    Ok(fifo_sends(add_comm(compute, pp, vpp)))
}

/// Adds the `Send`/`Recv` of every transfer to per-rank compute lists (as [`schedule`] does),
/// e.g. to simulate the action lists a compiled plan carries.
pub fn with_transfers(compute: Vec<Vec<Action>>, pp: u32, vpp: u32) -> Vec<Vec<Action>> {
    fifo_sends(add_comm(compute, pp, vpp))
}

/// Reorders every rank's `Send`s so that, per `(src, dst)` pair, they go out in the order the
/// receiver posts its `Recv`s: each `Send` is placed after its producer and after the
/// previous send of the pair. A no-op for the fixed schedules; for `dpp` the receiver may
/// consume in another order than the sender produces, and delaying a zero-time, non-blocking
/// `Send` to the completion of an earlier-consumed message never delays a consumer.
fn fifo_sends(lists: Vec<Vec<Action>>) -> Vec<Vec<Action>> {
    let n = lists.len();
    // (src, dst) -> messages in the receiver's order.
    let mut wanted: HashMap<(u32, u32), VecDeque<Action>> = HashMap::new();
    for (dst, list) in lists.iter().enumerate() {
        for a in list {
            if let ActionKind::Recv { peer, .. } = a.kind {
                wanted.entry((peer, dst as u32)).or_default().push_back(*a);
            }
        }
    }
    lists
        .iter()
        .enumerate()
        .map(|(src, list)| {
            let src = src as u32;
            let sends: Vec<Action> = list
                .iter()
                .filter(|a| matches!(a.kind, ActionKind::Send { .. }))
                .copied()
                .collect();
            let mut posted = vec![false; sends.len()];
            let mut ready = vec![false; sends.len()];
            let mut out = Vec::with_capacity(list.len());
            let mut k = 0;
            for a in list {
                if matches!(a.kind, ActionKind::Send { .. }) {
                    ready[k] = true;
                    k += 1;
                } else {
                    out.push(*a);
                }
                // Post, per destination, every send whose turn has come.
                for dst in 0..n as u32 {
                    let Some(q) = wanted.get_mut(&(src, dst)) else {
                        continue;
                    };
                    while let Some(next) = q.front() {
                        let hit = (0..sends.len()).find(|&i| {
                            !posted[i]
                                && ready[i]
                                && same_message(&sends[i], next)
                                && matches!(sends[i].kind, ActionKind::Send { peer, .. } if peer == dst)
                        });
                        let Some(i) = hit else { break };
                        posted[i] = true;
                        out.push(sends[i]);
                        q.pop_front();
                    }
                }
            }
            // Sends nobody receives keep their relative order at the end.
            out.extend((0..sends.len()).filter(|&i| !posted[i]).map(|i| sends[i]));
            out
        })
        .collect()
}

/// 1F1B compute order of rank `r` (chunk `r`), backward of kind `bk`.
fn one_f_one_b(pp: u32, r: u32, m: u32, bk: ActionKind) -> Vec<Action> {
    let warmup = (pp - r - 1).min(m);
    let mut out = Vec::new();
    for j in 0..warmup {
        out.push(Action::compute(ActionKind::F, r, j));
    }
    for k in 0..m - warmup {
        out.push(Action::compute(ActionKind::F, r, warmup + k));
        out.push(Action::compute(bk, r, k));
    }
    for k in m - warmup..m {
        out.push(Action::compute(bk, r, k));
    }
    out
}

/// Megatron's interleaved order (`get_schedule_table` with group size `pp`, warmup
/// `2(pp - r - 1) + (vpp - 1) pp`) for rank `r`.
fn interleaved(pp: u32, vpp: u32, r: u32, m: u32) -> Vec<Action> {
    let total = m * vpp;
    let group = pp * vpp;
    // k-th virtual microbatch: (local chunk, microbatch).
    let table = |k: u32| {
        let idx = k % group;
        (idx / pp, (k / group) * pp + idx % pp)
    };
    let fwd = |k: u32| {
        let (lc, j) = table(k);
        Action::compute(ActionKind::F, global_chunk(lc, r, pp), j)
    };
    let bwd = |k: u32| {
        let (lc, j) = table(k);
        Action::compute(ActionKind::BW, global_chunk(vpp - 1 - lc, r, pp), j)
    };
    let warmup = (2 * (pp - r - 1) + (vpp - 1) * pp).min(total);
    let mut out: Vec<Action> = (0..warmup).map(fwd).collect();
    for k in 0..total - warmup {
        out.push(fwd(warmup + k));
        out.push(bwd(k));
    }
    for k in total - warmup..total {
        out.push(bwd(k));
    }
    out
}

/// Greedy unit-time list scheduler behind `zb-h1` and `dpp`: at each integer time every idle
/// rank picks a ready task by its policy; every input arrives when its producer finishes.
fn greedy(
    kind: ScheduleKind,
    pp: u32,
    vpp: u32,
    m: u32,
) -> Result<Vec<Vec<Action>>, ScheduleError> {
    let nc = pp * vpp;
    let idx = |c: u32, j: u32| (c * m + j) as usize;
    let n = (nc * m) as usize;
    let split = matches!(kind, ScheduleKind::ZbH1);
    // Completion times (None = not issued yet).
    let mut f_done: Vec<Option<u64>> = vec![None; n];
    let mut b_done: Vec<Option<u64>> = vec![None; n];
    let mut out: Vec<Vec<Action>> = vec![Vec::new(); pp as usize];
    let mut busy_until = vec![0u64; pp as usize];
    // zb-h1: position in the rank's 1F1B order.
    let orders: Vec<Vec<Action>> = (0..pp)
        .map(|r| one_f_one_b(pp, r, m, ActionKind::B))
        .collect();
    let mut pos = vec![0usize; pp as usize];
    let mut pending_w: Vec<VecDeque<u32>> = vec![VecDeque::new(); pp as usize];
    let mut w_issued = vec![0u32; pp as usize];
    let per_rank = if split { 3 * m } else { 2 * vpp * m } as usize;
    let total_tasks = per_rank * pp as usize;
    let mut issued = 0usize;
    let limit = 8 * (total_tasks as u64 + 4 * nc as u64 + 8);
    let mut t = 0u64;
    let ready = |done: &Option<u64>, t: u64| done.is_some_and(|d| d <= t);
    while issued < total_tasks {
        if t > limit {
            return Err(ScheduleError::Stalled { kind: kind.name() });
        }
        for r in 0..pp {
            let ru = r as usize;
            if busy_until[ru] > t {
                continue;
            }
            let f_ready = |c: u32, j: u32, f_done: &[Option<u64>]| {
                f_done[idx(c, j)].is_none() && (c == 0 || ready(&f_done[idx(c - 1, j)], t))
            };
            let b_ready = |c: u32, j: u32, f_done: &[Option<u64>], b_done: &[Option<u64>]| {
                b_done[idx(c, j)].is_none()
                    && ready(&f_done[idx(c, j)], t)
                    && (c + 1 == nc || ready(&b_done[idx(c + 1, j)], t))
            };
            let pick: Option<Action> = match kind {
                ScheduleKind::ZbH1 => {
                    let next = orders[ru].get(pos[ru]).copied();
                    // 1F1B's peak activation memory (ZB-H1): a rank holds at most pp
                    // micro-batches whose F is done and whose W is not (1F1B's first stage
                    // holds pp); past that, a deferred W goes first.
                    let f_issued = orders[ru][..pos[ru]]
                        .iter()
                        .filter(|a| a.kind == ActionKind::F)
                        .count();
                    let full = f_issued - (w_issued[ru] as usize) >= pp as usize
                        && !pending_w[ru].is_empty();
                    let next_ready = next.filter(|a| match a.kind {
                        ActionKind::F => !full && f_ready(a.chunk, a.microbatch, &f_done),
                        _ => b_ready(a.chunk, a.microbatch, &f_done, &b_done),
                    });
                    if next_ready.is_some() {
                        pos[ru] += 1;
                        next_ready
                    } else {
                        pending_w[ru].pop_front().map(|j| {
                            w_issued[ru] += 1;
                            Action::compute(ActionKind::W, r, j)
                        })
                    }
                }
                ScheduleKind::Dpp(policy) => {
                    let inflight = (0..vpp)
                        .flat_map(|lc| (0..m).map(move |j| (global_chunk(lc, r, pp), j)))
                        .filter(|&(c, j)| {
                            f_done[idx(c, j)].is_some() && b_done[idx(c, j)].is_none()
                        })
                        .count() as u32;
                    let tasks = || (0..vpp).flat_map(|lc| (0..m).map(move |j| (lc, j)));
                    let back = tasks()
                        .filter(|&(lc, j)| b_ready(global_chunk(lc, r, pp), j, &f_done, &b_done))
                        .map(|(lc, j)| (true, lc, j));
                    let fwd = tasks()
                        .filter(|&(lc, j)| f_ready(global_chunk(lc, r, pp), j, &f_done))
                        .map(|(lc, j)| (false, lc, j));
                    back.chain(fwd)
                        .min_by_key(|&(backward, local_chunk, microbatch)| {
                            policy.priority(
                                inflight,
                                pp,
                                DppTask {
                                    backward,
                                    local_chunk,
                                    local_chunks: vpp,
                                    microbatch,
                                    // `ordered` is not built greedily (above).
                                    position: 0,
                                },
                            )
                        })
                        .map(|(backward, lc, j)| {
                            let kind = if backward {
                                ActionKind::BW
                            } else {
                                ActionKind::F
                            };
                            Action::compute(kind, global_chunk(lc, r, pp), j)
                        })
                }
                _ => unreachable!("greedy is only used for zb-h1 and dpp"),
            };
            if let Some(a) = pick {
                let cost = if a.kind == ActionKind::BW { 2 } else { 1 };
                let i = idx(a.chunk, a.microbatch);
                match a.kind {
                    ActionKind::F => f_done[i] = Some(t + cost),
                    ActionKind::B => {
                        b_done[i] = Some(t + cost);
                        pending_w[ru].push_back(a.microbatch);
                    }
                    ActionKind::BW => b_done[i] = Some(t + cost),
                    _ => {}
                }
                busy_until[ru] = t + cost;
                out[ru].push(a);
                issued += 1;
            }
        }
        t += 1;
    }
    Ok(out)
}

/// Inserts the `Send`/`Recv` around every compute action whose neighbour chunk lives on
/// another rank.
fn add_comm(compute: Vec<Vec<Action>>, pp: u32, vpp: u32) -> Vec<Vec<Action>> {
    let nc = pp * vpp;
    compute
        .into_iter()
        .enumerate()
        .map(|(r, list)| {
            let r = r as u32;
            let mut out = Vec::with_capacity(list.len() * 3);
            for a in list {
                let (c, j) = (a.chunk, a.microbatch);
                let comm = |kind, chunk| Action {
                    kind,
                    chunk,
                    microbatch: j,
                };
                match a.kind {
                    ActionKind::F => {
                        if c > 0 && chunk_owner(c - 1, pp) != r {
                            let peer = chunk_owner(c - 1, pp);
                            let payload = Payload::Activation;
                            out.push(comm(ActionKind::Recv { payload, peer }, c - 1));
                        }
                        out.push(a);
                        if c + 1 < nc && chunk_owner(c + 1, pp) != r {
                            let peer = chunk_owner(c + 1, pp);
                            let payload = Payload::Activation;
                            out.push(comm(ActionKind::Send { payload, peer }, c));
                        }
                    }
                    ActionKind::B | ActionKind::BW => {
                        if c + 1 < nc && chunk_owner(c + 1, pp) != r {
                            let peer = chunk_owner(c + 1, pp);
                            let payload = Payload::Gradient;
                            out.push(comm(ActionKind::Recv { payload, peer }, c + 1));
                        }
                        out.push(a);
                        if c > 0 && chunk_owner(c - 1, pp) != r {
                            let peer = chunk_owner(c - 1, pp);
                            let payload = Payload::Gradient;
                            out.push(comm(ActionKind::Send { payload, peer }, c));
                        }
                    }
                    _ => out.push(a),
                }
            }
            out
        })
        .collect()
}
