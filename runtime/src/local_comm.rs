//! The multi-rank `local` communicator: one OS thread per rank in one process, with real
//! collectives over shared memory.
//!
//! [`LocalWorld::new`] makes one [`LocalComm`] per rank (each is moved into its rank's thread);
//! [`run_ranks`] does that, runs a closure per rank on scoped threads and collects the results.
//!
//! Design, in brief:
//!
//! - **Rendezvous.** Every collective is call #k (1-based, counted per group by each member) on
//!   its group, the sorted list of world ranks. Each member deposits a descriptor (op and sizes)
//!   and a copy of its data into the slot for (group, k), then waits until every member has
//!   deposited. Each member then computes its own result from the deposits, outside the lock.
//!   Point-to-point messages are buffered in a FIFO mailbox per (from, to) pair: `send` never
//!   waits for the receiver.
//! - **Determinism.** Reductions are computed on every member from the same deposits in group
//!   order (the first member's contribution first), so every member gets bit-identical results.
//! - **Mismatch detection.** When a member deposits, its descriptor is checked against every
//!   deposit already in the slot; a difference (other op, other size, all-to-all split sizes
//!   that do not pair up) fails the call on every member with a message naming the ranks and
//!   what each called.
//! - **Deadlock detection.** One mutex guards the world; every rank's state (running, waiting
//!   for an operation, finished, failed) is kept under it. Whenever a rank is about to wait, the
//!   world is deadlocked exactly when every rank that has not finished is waiting and none of
//!   the waits can complete; then every waiting rank returns an error naming each rank's
//!   pending operation. A wait on a rank that has finished without joining (or without sending)
//!   fails at once, naming it. A rank that fails marks the world failed: every blocked and every
//!   later operation on the other ranks returns "rank R failed: ...". A long safety timeout is
//!   the last resort.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::comm::Communicator;
use crate::error::RuntimeError;

/// How long one operation may wait before it gives up (deadlocks are detected exactly; this
/// is only the last resort against a rank that runs forever without communicating).
const SAFETY_TIMEOUT: Duration = Duration::from_secs(120);

/// The tag of untagged point-to-point messages (`send`, `recv`).
const UNTAGGED: u64 = u64::MAX;

/// The state shared by the ranks of one local world: the rendezvous slots of every group, the
/// point-to-point mailboxes and every rank's status, under one mutex.
pub struct LocalWorld {
    size: usize,
    state: Mutex<State>,
    changed: Condvar,
}

/// One rank's handle on a [`LocalWorld`]; implements [`Communicator`]. Dropping it outside
/// [`run_ranks`] marks the rank finished (failed if its thread is panicking), which releases
/// ranks waiting for it.
pub struct LocalComm {
    world: Arc<LocalWorld>,
    rank: usize,
    /// Calls made so far on each group (the next call is this + 1).
    calls: HashMap<Vec<usize>, u64>,
    /// Messages received so far from each rank.
    received: HashMap<usize, u64>,
    /// Set by [`run_ranks`], which reports the rank's outcome itself.
    managed: bool,
    /// `State::mail_to` for this rank when [`Communicator::wait_for_mail`] last returned.
    mail_seen: u64,
}

impl fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalComm")
            .field("rank", &self.rank)
            .field("size", &self.world.size)
            .finish()
    }
}

impl LocalWorld {
    /// A world of `n` ranks: one communicator per rank, in rank order.
    #[allow(clippy::new_ret_no_self)] // the world itself is only reachable through its ranks
    pub fn new(n: usize) -> Vec<LocalComm> {
        let world = Arc::new(LocalWorld {
            size: n,
            state: Mutex::new(State {
                ranks: vec![Status::Running; n],
                failure: None,
                deadlock: None,
                groups: HashMap::new(),
                mail: HashMap::new(),
                mail_to: vec![0; n],
            }),
            changed: Condvar::new(),
        });
        (0..n)
            .map(|rank| LocalComm {
                world: Arc::clone(&world),
                rank,
                calls: HashMap::new(),
                received: HashMap::new(),
                managed: false,
                mail_seen: 0,
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock; tolerate poisoning anyway.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Record that `rank` is done: finished normally (`failure == None`) or failed. The first
    /// failure marks the world failed. Idempotent.
    fn finish(&self, rank: usize, failure: Option<String>) {
        let mut st = self.lock();
        if matches!(st.ranks[rank], Status::Finished | Status::Failed) {
            return;
        }
        match failure {
            None => st.ranks[rank] = Status::Finished,
            Some(message) => {
                st.ranks[rank] = Status::Failed;
                if st.failure.is_none() {
                    st.failure = Some((rank, message));
                }
            }
        }
        // Ranks that waited for this one may be able to fail now; or everyone left is stuck.
        if let Some(message) = st.detect_deadlock() {
            st.deadlock = Some(message);
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Wait until `poll` gives a result, the world fails, or a deadlock is detected. `poll`
    /// returns `None` to keep waiting; it must agree with [`State::ready`] for `pending`.
    fn wait_for<R>(
        &self,
        mut st: MutexGuard<'_, State>,
        rank: usize,
        pending: Pending,
        mut poll: impl FnMut(&mut State) -> Option<Result<R, String>>,
    ) -> Result<R, RuntimeError> {
        let deadline = Instant::now() + SAFETY_TIMEOUT;
        let result = loop {
            if let Some(message) = st.world_error() {
                break Err(message);
            }
            if let Some(result) = poll(&mut st) {
                break result;
            }
            st.ranks[rank] = Status::Waiting(pending.clone());
            if let Some(message) = st.detect_deadlock() {
                st.deadlock = Some(message.clone());
                self.changed.notify_all();
                break Err(message);
            }
            let now = Instant::now();
            if now >= deadline {
                break Err(format!(
                    "timed out after {} s: rank {rank} waits in {pending}",
                    SAFETY_TIMEOUT.as_secs()
                ));
            }
            st = self
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        if matches!(st.ranks[rank], Status::Waiting(_)) {
            st.ranks[rank] = Status::Running;
        }
        result.map_err(RuntimeError::Plan)
    }
}

/// Run `f` on `n` ranks of a fresh [`LocalWorld`], one scoped thread per rank, and return the
/// results in rank order. If any rank fails, the first failure in time is returned (the
/// other ranks' blocked operations are released with "rank R failed: ..."); a panic in `f` is
/// caught and reported as an error naming the rank.
pub fn run_ranks<T: Send>(
    n: usize,
    f: impl Fn(LocalComm) -> Result<T, RuntimeError> + Sync,
) -> Result<Vec<T>, RuntimeError> {
    if n == 0 {
        return Err(RuntimeError::Plan(
            "a local world needs at least one rank".to_string(),
        ));
    }
    let mut comms = LocalWorld::new(n);
    let world = Arc::clone(&comms[0].world);
    for comm in &mut comms {
        comm.managed = true;
    }
    let f = &f;
    let threads = crate::threads::per_rank(n);
    let mut results: Vec<Result<T, RuntimeError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let rank = comm.rank;
                let world = Arc::clone(&world);
                let spawned = std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let run = || crate::threads::on_own_pool(rank, threads, || f(comm));
                        let out = match catch_unwind(AssertUnwindSafe(run)) {
                            Ok(out) => out,
                            Err(payload) => Err(RuntimeError::Plan(format!(
                                "rank {rank} panicked: {}",
                                panic_message(payload.as_ref())
                            ))),
                        };
                        world.finish(rank, out.as_ref().err().map(failure_message));
                        out
                    });
                (rank, spawned)
            })
            .collect();
        handles
            .into_iter()
            .map(|(rank, spawned)| {
                let out = match spawned {
                    Ok(handle) => handle.join().unwrap_or_else(|payload| {
                        Err(RuntimeError::Plan(format!(
                            "rank {rank} panicked: {}",
                            panic_message(payload.as_ref())
                        )))
                    }),
                    Err(e) => Err(RuntimeError::Plan(format!(
                        "rank {rank}: could not start its thread: {e}"
                    ))),
                };
                // No-op unless the thread never ran or died outside the closure.
                world.finish(rank, out.as_ref().err().map(failure_message));
                out
            })
            .collect()
    });
    let first = world.lock().failure.as_ref().map(|(rank, _)| *rank);
    if let Some(rank) = first {
        if results[rank].is_err() {
            return Err(results
                .swap_remove(rank)
                .err()
                .unwrap_or_else(|| RuntimeError::Plan(format!("rank {rank} failed"))));
        }
    }
    results.into_iter().collect()
}

/// A failed rank's error as other ranks quote it ("rank R failed: ..."): without the `plan: `
/// prefix, which the quoting error adds again.
fn failure_message(e: &RuntimeError) -> String {
    match e {
        RuntimeError::Plan(message) => message.clone(),
        other => other.to_string(),
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}

// ---------------------------------------------------------------------------------------------
// Shared state.

#[derive(Clone, Debug)]
enum Status {
    Running,
    Waiting(Pending),
    Finished,
    Failed,
}

/// What a waiting rank waits for.
#[derive(Clone, Debug)]
enum Pending {
    Collective {
        op: Op,
        group: Vec<usize>,
        call: u64,
    },
    Recv {
        from: usize,
        tag: u64,
    },
}

impl fmt::Display for Pending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pending::Collective { op, group, call } => {
                write!(f, "{op} on {group:?} (call #{call})")
            }
            Pending::Recv { from, tag } if *tag == UNTAGGED => write!(f, "recv from rank {from}"),
            Pending::Recv { from, tag } => write!(f, "recv from rank {from} (tag {tag})"),
        }
    }
}

struct State {
    ranks: Vec<Status>,
    /// The first rank to fail, and its message.
    failure: Option<(usize, String)>,
    /// Set once a deadlock is detected; every waiting and later operation returns it.
    deadlock: Option<String>,
    groups: HashMap<Vec<usize>, HashMap<u64, Call>>,
    /// Mailboxes by (from, to, tag); untagged messages use [`UNTAGGED`].
    mail: HashMap<(usize, usize, u64), VecDeque<Vec<f32>>>,
    /// Messages sent to each rank so far (for [`Communicator::wait_for_mail`]).
    mail_to: Vec<u64>,
}

/// The rendezvous slot of one collective call on one group.
struct Call {
    /// Per member (in group order), its deposit once it has arrived.
    deposits: Vec<Option<Arc<Deposit>>>,
    arrived: usize,
    /// Members that have left with a result or an error; the slot goes when all have.
    left: usize,
    /// A mismatch between the members' descriptors.
    error: Option<String>,
}

struct Deposit {
    desc: Desc,
    data: Payload,
}

enum Payload {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl Payload {
    fn f32(&self) -> &[f32] {
        match self {
            Payload::F32(v) => v,
            Payload::F64(_) => &[],
        }
    }

    fn f64(&self) -> &[f64] {
        match self {
            Payload::F64(v) => v,
            Payload::F32(_) => &[],
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    AllReduceSum,
    AllReduceMax,
    AllReduceSumF64,
    AllGather,
    ReduceScatterSum,
    AllToAll,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::AllReduceSum => "all_reduce_sum",
            Op::AllReduceMax => "all_reduce_max",
            Op::AllReduceSumF64 => "all_reduce_sum_f64",
            Op::AllGather => "all_gather",
            Op::ReduceScatterSum => "reduce_scatter_sum",
            Op::AllToAll => "all_to_all",
        })
    }
}

/// What a member called: the op and the sizes every member must agree on.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Desc {
    op: Op,
    /// Elements this member contributes (its `data` or `send`).
    len: usize,
    /// All-to-all only: send and receive offsets (`group.len() + 1` entries each).
    send_offsets: Vec<usize>,
    recv_offsets: Vec<usize>,
}

fn splits(offsets: &[usize]) -> Vec<usize> {
    offsets.windows(2).map(|w| w[1] - w[0]).collect()
}

impl fmt::Display for Desc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.op == Op::AllToAll {
            write!(
                f,
                "all_to_all sending {:?} receiving {:?}",
                splits(&self.send_offsets),
                splits(&self.recv_offsets)
            )
        } else {
            write!(f, "{} of {} elements", self.op, self.len)
        }
    }
}

impl Desc {
    /// Why member `i` (descriptor `self`) and member `j` (`other`) of a group disagree, if they
    /// do; `ranks` are the world ranks of the group.
    fn conflict(&self, i: usize, other: &Desc, j: usize, ranks: &[usize]) -> Option<String> {
        if self.op != other.op {
            return Some(String::new());
        }
        if self.op != Op::AllToAll {
            return (self.len != other.len).then(String::new);
        }
        let pair = |a: &Desc, ai: usize, b: &Desc, bi: usize| {
            let sends = a.send_offsets[bi + 1] - a.send_offsets[bi];
            let expects = b.recv_offsets[ai + 1] - b.recv_offsets[ai];
            (sends != expects).then(|| {
                format!(
                    " (rank {} sends {sends} elements to rank {}, which expects {expects})",
                    ranks[ai], ranks[bi]
                )
            })
        };
        pair(self, i, other, j).or_else(|| pair(other, j, self, i))
    }
}

impl State {
    fn world_error(&self) -> Option<String> {
        if let Some((rank, message)) = &self.failure {
            return Some(format!("rank {rank} failed: {message}"));
        }
        self.deadlock.clone()
    }

    fn done(&self, rank: usize) -> bool {
        matches!(self.ranks[rank], Status::Finished | Status::Failed)
    }

    /// A member of the call's group that has finished without depositing, if any.
    fn absent_member(&self, group: &[usize], call: &Call) -> Option<usize> {
        group
            .iter()
            .zip(&call.deposits)
            .find(|(&m, d)| d.is_none() && self.done(m))
            .map(|(&m, _)| m)
    }

    /// Whether `rank` can stop waiting now (with a result or an error).
    fn ready(&self, rank: usize) -> bool {
        match &self.ranks[rank] {
            Status::Waiting(Pending::Collective { group, call, .. }) => {
                match self.groups.get(group).and_then(|calls| calls.get(call)) {
                    Some(c) => {
                        c.error.is_some()
                            || c.arrived == group.len()
                            || self.absent_member(group, c).is_some()
                    }
                    None => true,
                }
            }
            Status::Waiting(Pending::Recv { from, tag }) => {
                self.done(*from)
                    || self
                        .mail
                        .get(&(*from, rank, *tag))
                        .is_some_and(|q| !q.is_empty())
            }
            Status::Running | Status::Finished | Status::Failed => true,
        }
    }

    /// The deadlock message if every rank that has not finished waits and none can proceed.
    fn detect_deadlock(&self) -> Option<String> {
        if self.failure.is_some() || self.deadlock.is_some() {
            return None;
        }
        let mut waits = Vec::new();
        for (rank, status) in self.ranks.iter().enumerate() {
            match status {
                Status::Finished | Status::Failed => {}
                Status::Running => return None,
                Status::Waiting(pending) => {
                    if self.ready(rank) {
                        return None;
                    }
                    waits.push(format!("rank {rank} waits in {pending}"));
                }
            }
        }
        (!waits.is_empty()).then(|| format!("deadlock: {}", waits.join("; ")))
    }
}

// ---------------------------------------------------------------------------------------------
// The communicator.

impl LocalComm {
    fn plan(message: String) -> RuntimeError {
        RuntimeError::Plan(message)
    }

    /// This rank's position in `group`, after [`crate::comm::group_position`]'s checks.
    fn position(&self, op: Op, group: &[usize]) -> Result<usize, RuntimeError> {
        crate::comm::group_position(&op, group, self.rank, self.world.size)
    }

    fn check_offsets(
        &self,
        group: &[usize],
        what: &str,
        offsets: &[usize],
        len: usize,
    ) -> Result<(), RuntimeError> {
        crate::comm::check_offsets(self.rank, group, what, offsets, len)
    }

    /// Deposit this member's descriptor and data for its next call on `group` and wait for
    /// every member's deposit; returns them in group order.
    fn exchange(
        &mut self,
        group: &[usize],
        me: usize,
        desc: Desc,
        data: Payload,
    ) -> Result<Vec<Arc<Deposit>>, RuntimeError> {
        let counter = match self.calls.get_mut(group) {
            Some(c) => c,
            None => self.calls.entry(group.to_vec()).or_insert(0),
        };
        *counter += 1;
        let call_no = *counter;
        let op = desc.op;
        let deposit = Arc::new(Deposit { desc, data });
        let world = &*self.world;
        let mut st = world.lock();
        if let Some(message) = st.world_error() {
            return Err(Self::plan(message));
        }
        if !st.groups.contains_key(group) {
            st.groups.insert(group.to_vec(), HashMap::new());
        }
        let calls = st.groups.get_mut(group).expect("inserted above");
        let call = calls.entry(call_no).or_insert_with(|| Call {
            deposits: vec![None; group.len()],
            arrived: 0,
            left: 0,
            error: None,
        });
        if call.error.is_none() {
            let clash = call.deposits.iter().enumerate().find_map(|(j, d)| {
                d.as_ref()
                    .and_then(|d| deposit.desc.conflict(me, &d.desc, j, group))
            });
            if let Some(detail) = clash {
                let mut called: Vec<String> = Vec::new();
                for (j, d) in call.deposits.iter().enumerate() {
                    let d = if j == me { Some(&deposit) } else { d.as_ref() };
                    if let Some(d) = d {
                        called.push(format!("rank {} called {}", group[j], d.desc));
                    }
                }
                call.error = Some(format!(
                    "collective mismatch on group {group:?}, call #{call_no}: {}{detail}",
                    called.join(", ")
                ));
            }
        }
        call.deposits[me] = Some(deposit);
        call.arrived += 1;
        world.changed.notify_all();
        let pending = Pending::Collective {
            op,
            group: group.to_vec(),
            call: call_no,
        };
        world.wait_for(st, self.rank, pending, |st| {
            let calls = st.groups.get(group)?;
            let call = calls.get(&call_no)?;
            let result = if let Some(e) = &call.error {
                Err(e.clone())
            } else if call.arrived == group.len() {
                Ok(call.deposits.iter().flatten().cloned().collect())
            } else if let Some(absent) = st.absent_member(group, call) {
                Err(format!(
                    "rank {absent} finished without joining {op} on {group:?} call #{call_no}"
                ))
            } else {
                return None;
            };
            let calls = st.groups.get_mut(group)?;
            let call = calls.get_mut(&call_no)?;
            call.left += 1;
            if call.left == group.len() {
                calls.remove(&call_no);
            }
            Some(result)
        })
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        if !self.managed {
            let failure = std::thread::panicking().then(|| "panicked".to_string());
            self.world.finish(self.rank, failure);
        }
    }
}

fn same_len(op: Op, len: usize) -> Desc {
    Desc {
        op,
        len,
        send_offsets: Vec::new(),
        recv_offsets: Vec::new(),
    }
}

/// `out = Σ_j deposits[j][range]` summed in group order (the first member's contribution
/// first), so every member computes bit-identical sums.
fn sum_f32(out: &mut [f32], deposits: &[Arc<Deposit>], start: usize) {
    let end = start + out.len();
    out.copy_from_slice(&deposits[0].data.f32()[start..end]);
    for d in &deposits[1..] {
        for (o, x) in out.iter_mut().zip(&d.data.f32()[start..end]) {
            *o += *x;
        }
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.world.size
    }

    fn all_reduce_sum(&mut self, group: &[usize], data: &mut [f32]) -> Result<(), RuntimeError> {
        let op = Op::AllReduceSum;
        let me = self.position(op, group)?;
        let deps = self.exchange(
            group,
            me,
            same_len(op, data.len()),
            Payload::F32(data.to_vec()),
        )?;
        sum_f32(data, &deps, 0);
        Ok(())
    }

    fn all_reduce_max(&mut self, group: &[usize], data: &mut [f32]) -> Result<(), RuntimeError> {
        let op = Op::AllReduceMax;
        let me = self.position(op, group)?;
        let deps = self.exchange(
            group,
            me,
            same_len(op, data.len()),
            Payload::F32(data.to_vec()),
        )?;
        data.copy_from_slice(deps[0].data.f32());
        for d in &deps[1..] {
            for (o, &x) in data.iter_mut().zip(d.data.f32()) {
                // NaN propagates, as in torch.
                if x.is_nan() || x > *o {
                    *o = x;
                }
            }
        }
        Ok(())
    }

    fn all_reduce_sum_f64(
        &mut self,
        group: &[usize],
        data: &mut [f64],
    ) -> Result<(), RuntimeError> {
        let op = Op::AllReduceSumF64;
        let me = self.position(op, group)?;
        let deps = self.exchange(
            group,
            me,
            same_len(op, data.len()),
            Payload::F64(data.to_vec()),
        )?;
        data.copy_from_slice(deps[0].data.f64());
        for d in &deps[1..] {
            for (o, x) in data.iter_mut().zip(d.data.f64()) {
                *o += *x;
            }
        }
        Ok(())
    }

    fn all_gather(
        &mut self,
        group: &[usize],
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), RuntimeError> {
        let op = Op::AllGather;
        let me = self.position(op, group)?;
        if recv.len() != group.len() * send.len() {
            return Err(Self::plan(format!(
                "rank {}: all_gather on group {group:?} of {} elements needs a receive buffer of \
                 {}, not {}",
                self.rank,
                send.len(),
                group.len() * send.len(),
                recv.len()
            )));
        }
        let deps = self.exchange(
            group,
            me,
            same_len(op, send.len()),
            Payload::F32(send.to_vec()),
        )?;
        if !send.is_empty() {
            for (chunk, d) in recv.chunks_exact_mut(send.len()).zip(&deps) {
                chunk.copy_from_slice(d.data.f32());
            }
        }
        Ok(())
    }

    fn reduce_scatter_sum(
        &mut self,
        group: &[usize],
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), RuntimeError> {
        let op = Op::ReduceScatterSum;
        let me = self.position(op, group)?;
        if send.len() != group.len() * recv.len() {
            return Err(Self::plan(format!(
                "rank {}: reduce_scatter_sum on group {group:?} of {} elements needs a receive \
                 buffer of {} / {}, not {}",
                self.rank,
                send.len(),
                send.len(),
                group.len(),
                recv.len()
            )));
        }
        let deps = self.exchange(
            group,
            me,
            same_len(op, send.len()),
            Payload::F32(send.to_vec()),
        )?;
        sum_f32(recv, &deps, me * recv.len());
        Ok(())
    }

    fn all_to_all(
        &mut self,
        group: &[usize],
        send: &[f32],
        send_offsets: &[usize],
        recv: &mut [f32],
        recv_offsets: &[usize],
    ) -> Result<(), RuntimeError> {
        let op = Op::AllToAll;
        let me = self.position(op, group)?;
        self.check_offsets(group, "send", send_offsets, send.len())?;
        self.check_offsets(group, "receive", recv_offsets, recv.len())?;
        let (to_self, from_self) = (
            send_offsets[me + 1] - send_offsets[me],
            recv_offsets[me + 1] - recv_offsets[me],
        );
        if to_self != from_self {
            return Err(Self::plan(format!(
                "rank {}: all_to_all on group {group:?} sends {to_self} elements to itself but \
                 expects {from_self}",
                self.rank
            )));
        }
        let desc = Desc {
            op,
            len: send.len(),
            send_offsets: send_offsets.to_vec(),
            recv_offsets: recv_offsets.to_vec(),
        };
        let deps = self.exchange(group, me, desc, Payload::F32(send.to_vec()))?;
        for (j, d) in deps.iter().enumerate() {
            let from = &d.data.f32()[d.desc.send_offsets[me]..d.desc.send_offsets[me + 1]];
            recv[recv_offsets[j]..recv_offsets[j + 1]].copy_from_slice(from);
        }
        Ok(())
    }

    fn send(&mut self, to: usize, data: &[f32]) -> Result<(), RuntimeError> {
        self.send_tagged(to, UNTAGGED, data)
    }

    fn recv(&mut self, from: usize, data: &mut [f32]) -> Result<(), RuntimeError> {
        self.recv_tagged(from, UNTAGGED, data)
    }

    fn probe_tagged(&mut self, wanted: &[(usize, u64)]) -> Result<Vec<bool>, RuntimeError> {
        let me = self.rank;
        let st = self.world.lock();
        if let Some(message) = st.world_error() {
            return Err(Self::plan(message));
        }
        Ok(wanted
            .iter()
            .map(|&(from, tag)| st.mail.get(&(from, me, tag)).is_some_and(|q| !q.is_empty()))
            .collect())
    }

    /// Returns at once when a message came for this rank since the last return; otherwise
    /// waits for the world's next change (a send, a collective deposit, a rank finishing)
    /// or `timeout`, whichever comes first.
    fn wait_for_mail(&mut self, timeout: Duration) -> Result<(), RuntimeError> {
        let me = self.rank;
        let world = &*self.world;
        let mut st = world.lock();
        if let Some(message) = st.world_error() {
            return Err(Self::plan(message));
        }
        if st.mail_to[me] == self.mail_seen {
            st = world
                .changed
                .wait_timeout(st, timeout)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        self.mail_seen = st.mail_to[me];
        Ok(())
    }

    fn send_tagged(&mut self, to: usize, tag: u64, data: &[f32]) -> Result<(), RuntimeError> {
        let n = self.world.size;
        if to >= n {
            return Err(Self::plan(format!(
                "rank {} sends to rank {to}, outside the world of {n} ranks",
                self.rank
            )));
        }
        let message = data.to_vec();
        let world = &*self.world;
        let mut st = world.lock();
        if let Some(message) = st.world_error() {
            return Err(Self::plan(message));
        }
        st.mail
            .entry((self.rank, to, tag))
            .or_default()
            .push_back(message);
        st.mail_to[to] += 1;
        drop(st);
        world.changed.notify_all();
        Ok(())
    }

    fn recv_tagged(&mut self, from: usize, tag: u64, data: &mut [f32]) -> Result<(), RuntimeError> {
        let n = self.world.size;
        let me = self.rank;
        if from >= n {
            return Err(Self::plan(format!(
                "rank {me} receives from rank {from}, outside the world of {n} ranks"
            )));
        }
        let count = self.received.entry(from).or_insert(0);
        *count += 1;
        let number = *count;
        let world = &*self.world;
        let st = world.lock();
        let message = world.wait_for(st, me, Pending::Recv { from, tag }, |st| {
            if let Some(m) = st
                .mail
                .get_mut(&(from, me, tag))
                .and_then(VecDeque::pop_front)
            {
                Some(Ok(m))
            } else if st.done(from) {
                Some(Err(format!(
                    "rank {from} finished without sending to rank {me}, which waits in recv of \
                     {} elements (message #{number} from rank {from})",
                    data.len()
                )))
            } else {
                None
            }
        })?;
        if message.len() != data.len() {
            return Err(Self::plan(format!(
                "rank {me} expects {} elements from rank {from}, but message #{number} has {}",
                data.len(),
                message.len()
            )));
        }
        data.copy_from_slice(&message);
        Ok(())
    }
}
