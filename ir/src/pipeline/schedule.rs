//! Pipeline schedules: per-rank action lists, a simulator and a validator.
//!
//! A model cut into `pp * vpp` chunks (virtual stages) runs on `pp` pipeline ranks; chunk `c`
//! lives on rank `c % pp` (Megatron's interleaved placement, so with `vpp == 1` chunk `c` is
//! rank `c`). One training step pushes `m` microbatches through every chunk forward (`F`) and
//! backward, either fused (`BW`, full backward) or split into input-gradient `B` and
//! weight-gradient `W` (zero-bubble schedules).
//!
//! [`schedule`] builds one action list per rank for a [`ScheduleKind`]. Communication is
//! explicit: an `F` on chunk `c > 0` whose previous chunk lives on another rank is preceded by
//! a `Recv` of the activation, an `F` on a non-last chunk is followed by a `Send` to the rank
//! holding `c + 1`; backward mirrors this with gradients. [`simulate`] executes the lists with
//! given [`Costs`] ([`simulate_by`] with a cost per action) and [`validate`] checks them;
//! `megac schedule` prints and draws them (`src/render/schedule.rs`).
//! See `docs/schedules.md` for the schedules and the bubble formulas the tests verify.

use std::collections::{HashMap, VecDeque};
use std::fmt;

use crate::mesh::{chunk_owner, global_chunk};
use crate::spec::{dpp_priority, DppTask};

/// What a pipeline action does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActionKind {
    /// Forward of one chunk for one microbatch.
    F,
    /// Input-gradient backward (zero-bubble split); needs a later `W`.
    B,
    /// Weight-gradient backward (zero-bubble split); follows the `B` of the same pair.
    W,
    /// Full backward: `B` and `W` fused.
    BW,
    /// Send a tensor to rank `peer` (non-blocking: the data arrives after `Costs::send`).
    Send {
        /// Activation (forward) or gradient (backward).
        payload: Payload,
        /// Destination rank.
        peer: u32,
    },
    /// Receive a tensor from rank `peer` (blocks until the matching `Send` has arrived).
    Recv {
        /// Activation (forward) or gradient (backward).
        payload: Payload,
        /// Source rank.
        peer: u32,
    },
}

/// The tensor a `Send`/`Recv` moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Payload {
    /// Output activation of chunk `c`, moving to the rank of chunk `c + 1`.
    Activation,
    /// Input gradient computed by chunk `c`, moving to the rank of chunk `c - 1`.
    Gradient,
}

/// One step of a rank's action list.
///
/// For `Send`/`Recv`, `chunk` is the chunk that *produced* the tensor: the activation of
/// `(c, j)` feeds `F` of `(c + 1, j)`; the gradient of `(c, j)` feeds the backward of
/// `(c - 1, j)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Action {
    /// What the action does.
    pub kind: ActionKind,
    /// Global chunk (virtual stage) index, `0..pp * vpp`.
    pub chunk: u32,
    /// Microbatch index, `0..m`.
    pub microbatch: u32,
}

impl Action {
    /// A compute action (`F`, `B`, `W` or `BW`).
    pub fn compute(kind: ActionKind, chunk: u32, microbatch: u32) -> Action {
        Action {
            kind,
            chunk,
            microbatch,
        }
    }

    /// True for `F`, `B`, `W` and `BW`.
    pub fn is_compute(&self) -> bool {
        matches!(
            self.kind,
            ActionKind::F | ActionKind::B | ActionKind::W | ActionKind::BW
        )
    }

    /// The rendering token: `F3`, or `F1.3` (chunk 1, microbatch 3) when `show_chunk`;
    /// communication as `sA1.3>2` (send activation to rank 2), `rG2.3<2` (receive gradient
    /// from rank 2).
    pub fn token(&self, show_chunk: bool) -> String {
        let label = if show_chunk {
            format!("{}.{}", self.chunk, self.microbatch)
        } else {
            format!("{}", self.microbatch)
        };
        let p = |payload: Payload| match payload {
            Payload::Activation => 'A',
            Payload::Gradient => 'G',
        };
        match self.kind {
            ActionKind::F => format!("F{label}"),
            ActionKind::B => format!("B{label}"),
            ActionKind::W => format!("W{label}"),
            ActionKind::BW => format!("BW{label}"),
            ActionKind::Send { payload, peer } => format!("s{}{label}>{peer}", p(payload)),
            ActionKind::Recv { payload, peer } => format!("r{}{label}<{peer}", p(payload)),
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.token(true))
    }
}

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
    /// MegaDPP: readiness-driven order under a breadth/depth-first priority.
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
    /// `dpp-adaptive`.
    pub fn name(&self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
            ScheduleKind::Dpp(DppPolicy::Bfs) => "dpp-bfs",
            ScheduleKind::Dpp(DppPolicy::Dfs) => "dpp-dfs",
            ScheduleKind::Dpp(DppPolicy::Adaptive { .. }) => "dpp-adaptive",
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
                    let breadth = policy.breadth_first(inflight, pp);
                    let tasks = || (0..vpp).flat_map(|lc| (0..m).map(move |j| (lc, j)));
                    let back = tasks()
                        .filter(|&(lc, j)| b_ready(global_chunk(lc, r, pp), j, &f_done, &b_done))
                        .map(|(lc, j)| (true, lc, j));
                    let fwd = tasks()
                        .filter(|&(lc, j)| f_ready(global_chunk(lc, r, pp), j, &f_done))
                        .map(|(lc, j)| (false, lc, j));
                    back.chain(fwd)
                        .min_by_key(|&(backward, local_chunk, microbatch)| {
                            dpp_priority(
                                breadth,
                                DppTask {
                                    backward,
                                    local_chunk,
                                    local_chunks: vpp,
                                    microbatch,
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

/// Per-action durations for [`simulate`]. `BW` costs `b + w`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    /// Forward of one chunk for one microbatch.
    pub f: f64,
    /// Input-gradient backward.
    pub b: f64,
    /// Weight-gradient backward.
    pub w: f64,
    /// Transfer latency of one `Send` (the sender does not wait).
    pub send: f64,
}

impl Costs {
    /// Unit costs: `f = b = w = 1` (so a fused `BW` costs 2), free transfers.
    pub fn unit() -> Costs {
        Costs {
            f: 1.0,
            b: 1.0,
            w: 1.0,
            send: 0.0,
        }
    }

    /// The duration of a compute action (`BW` = `b + w`); 0 for `Send`/`Recv`.
    pub fn of(&self, a: &Action) -> f64 {
        match a.kind {
            ActionKind::F => self.f,
            ActionKind::B => self.b,
            ActionKind::W => self.w,
            ActionKind::BW => self.b + self.w,
            ActionKind::Send { .. } | ActionKind::Recv { .. } => 0.0,
        }
    }
}

/// One rank's simulated execution.
#[derive(Clone, Debug, PartialEq)]
pub struct RankTimeline {
    /// `(start, end)` of every action, in list order (a `Send` has zero length; a `Recv`
    /// spans the wait for its data).
    pub spans: Vec<(f64, f64)>,
    /// Time spent in compute actions.
    pub busy: f64,
    /// `makespan - busy`: idle or waiting, over the whole step `[0, makespan]`.
    pub idle: f64,
    /// `idle / makespan`.
    pub bubble_fraction: f64,
    /// Most `(chunk, microbatch)` pairs at once whose `F` is done and whose `B`/`BW` is not.
    pub peak_inflight: u32,
}

/// The result of [`simulate`].
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// Per rank, index = rank.
    pub ranks: Vec<RankTimeline>,
    /// End of the last action on any rank (the step starts at 0 on every rank).
    pub makespan: f64,
    /// Total idle over total time: `sum(idle) / (ranks * makespan)`.
    pub bubble_fraction: f64,
}

/// A rank that cannot progress.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocked {
    /// The rank.
    pub rank: u32,
    /// Index of the blocked action in the rank's list.
    pub index: usize,
    /// The blocked action (a `Recv`).
    pub action: Action,
}

/// Why [`simulate`] could not finish.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    /// No rank can progress.
    #[error("deadlock: {}", blocked.iter().map(|b| format!("rank {} blocked at action {} ({})", b.rank, b.index, b.action)).collect::<Vec<_>>().join("; "))]
    Deadlock {
        /// Every unfinished rank and the action it waits at.
        blocked: Vec<Blocked>,
    },
    /// A `Recv` got a message other than the one it names.
    #[error("rank {dst} action {recv_index} ({expected}) received {got} sent by rank {src} at action {send_index}")]
    Mismatch {
        /// Sending rank.
        src: u32,
        /// Receiving rank.
        dst: u32,
        /// Index of the `Send` on `src`.
        send_index: usize,
        /// Index of the `Recv` on `dst`.
        recv_index: usize,
        /// The `Recv`.
        expected: Action,
        /// The `Send` that arrived.
        got: Action,
    },
    /// A `Send`/`Recv` names a peer that is not a rank.
    #[error("rank {rank} action {index} ({action}) names peer outside 0..{ranks}")]
    BadPeer {
        /// The rank.
        rank: u32,
        /// Action index.
        index: usize,
        /// The action.
        action: Action,
        /// Number of ranks.
        ranks: u32,
    },
}

/// A posted message: the `Send`, its index on the sender, its arrival time.
type InFlight = (Action, usize, f64);

/// Same message: kind, chunk, microbatch (the peer is checked by the channel).
fn same_message(send: &Action, recv: &Action) -> bool {
    let payload = |a: &Action| match a.kind {
        ActionKind::Send { payload, .. } | ActionKind::Recv { payload, .. } => Some(payload),
        _ => None,
    };
    payload(send) == payload(recv) && send.chunk == recv.chunk && send.microbatch == recv.microbatch
}

/// Executes the lists: compute actions take their cost, a `Send` posts its message (arriving
/// `costs.send` later) without waiting, a `Recv` waits for the next message on its
/// `(src, dst)` channel, which must be the one it names.
pub fn simulate(lists: &[Vec<Action>], costs: Costs) -> Result<Timeline, SimError> {
    simulate_by(lists, costs.send, |a| costs.of(a))
}

/// [`simulate`] with a duration per compute action (`cost` is only called for `F`, `B`, `W`
/// and `BW`), e.g. per-chunk costs when chunks hold different layers; `send` is the transfer
/// latency. Negative or non-finite durations count as 0.
pub fn simulate_by(
    lists: &[Vec<Action>],
    send: f64,
    cost: impl Fn(&Action) -> f64,
) -> Result<Timeline, SimError> {
    let finite = |x: f64| if x.is_finite() && x > 0.0 { x } else { 0.0 };
    let send = finite(send);
    let n = lists.len();
    let mut pc = vec![0usize; n];
    let mut clock = vec![0f64; n];
    let mut spans: Vec<Vec<(f64, f64)>> =
        lists.iter().map(|l| Vec::with_capacity(l.len())).collect();
    let mut busy = vec![0f64; n];
    let mut inflight = vec![0u32; n];
    let mut peak = vec![0u32; n];
    // (src, dst) -> queue of (send action, send index, arrival time)
    let mut channels: HashMap<(usize, usize), VecDeque<InFlight>> = HashMap::new();
    loop {
        let mut progress = false;
        for r in 0..n {
            while let Some(a) = lists[r].get(pc[r]).copied() {
                let t = clock[r];
                let bad_peer = |peer: u32| {
                    (peer as usize >= n).then_some(SimError::BadPeer {
                        rank: r as u32,
                        index: pc[r],
                        action: a,
                        ranks: n as u32,
                    })
                };
                let end = match a.kind {
                    ActionKind::F | ActionKind::B | ActionKind::W | ActionKind::BW => {
                        let cost = finite(cost(&a));
                        busy[r] += cost;
                        match a.kind {
                            ActionKind::F => {
                                inflight[r] += 1;
                                peak[r] = peak[r].max(inflight[r]);
                            }
                            ActionKind::B | ActionKind::BW => {
                                inflight[r] = inflight[r].saturating_sub(1)
                            }
                            _ => {}
                        }
                        t + cost
                    }
                    ActionKind::Send { peer, .. } => {
                        if let Some(e) = bad_peer(peer) {
                            return Err(e);
                        }
                        channels.entry((r, peer as usize)).or_default().push_back((
                            a,
                            pc[r],
                            t + send,
                        ));
                        t
                    }
                    ActionKind::Recv { peer, .. } => {
                        if let Some(e) = bad_peer(peer) {
                            return Err(e);
                        }
                        let Some(q) = channels.get_mut(&(peer as usize, r)) else {
                            break;
                        };
                        let Some((sent, send_index, arrival)) = q.pop_front() else {
                            break;
                        };
                        if !same_message(&sent, &a) {
                            return Err(SimError::Mismatch {
                                src: peer,
                                dst: r as u32,
                                send_index,
                                recv_index: pc[r],
                                expected: a,
                                got: sent,
                            });
                        }
                        t.max(arrival)
                    }
                };
                spans[r].push((t, end));
                clock[r] = end;
                pc[r] += 1;
                progress = true;
            }
        }
        if (0..n).all(|r| pc[r] == lists[r].len()) {
            break;
        }
        if !progress {
            let blocked = (0..n)
                .filter(|&r| pc[r] < lists[r].len())
                .map(|r| Blocked {
                    rank: r as u32,
                    index: pc[r],
                    action: lists[r][pc[r]],
                })
                .collect();
            return Err(SimError::Deadlock { blocked });
        }
    }
    let makespan = clock.iter().copied().fold(0f64, f64::max);
    let frac = |idle: f64, total: f64| if total > 0.0 { idle / total } else { 0.0 };
    let ranks: Vec<RankTimeline> = (0..n)
        .map(|r| {
            let idle = makespan - busy[r];
            RankTimeline {
                spans: std::mem::take(&mut spans[r]),
                busy: busy[r],
                idle,
                bubble_fraction: frac(idle, makespan),
                peak_inflight: peak[r],
            }
        })
        .collect();
    let idle: f64 = ranks.iter().map(|r| r.idle).sum();
    Ok(Timeline {
        bubble_fraction: frac(idle, makespan * n as f64),
        ranks,
        makespan,
    })
}

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
