//! The unit-cost (or per-action cost) simulator of pipeline action lists: when each action
//! runs, each rank's idle time and bubble fraction, and the peak number of micro-batches in
//! flight; a `Recv` whose message never comes is reported as a deadlock naming the blocked
//! ranks.

use std::collections::{HashMap, VecDeque};

use super::action::{same_message, Action, ActionKind};

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
