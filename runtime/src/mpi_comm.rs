//! The `mpi` communicator: one process per rank, over MPI (the `mpi` crate on the system
//! OpenMPI), so a plan runs across processes and nodes (`mpirun -np N megac run PLAN --comm
//! mpi`, or `megac launch -n N PLAN`).
//!
//! Design, in brief:
//!
//! - **Groups.** A group is a sorted list of world ranks. The first collective on a group
//!   creates its sub-communicator with `MPI_Comm_create_group` over the world group (collective
//!   over the group's members only, which are exactly the ranks making that first call) and
//!   caches it, keyed by the rank list; member i of the group is rank i of the
//!   sub-communicator. The whole world uses `MPI_COMM_WORLD`; a group of one is a local copy.
//! - **Deterministic reductions.** Sums and maxima do not use `MPI_Allreduce`, whose reduction
//!   order is the library's choice (it may change with the algorithm, the message size and the
//!   number of ranks). Instead every element is reduced in group order, the first member's
//!   value first, exactly as the `local` communicator does: an all-reduce is an
//!   `MPI_Alltoallv` (member j receives chunk j of every member's data), a local reduction of
//!   the chunk in group order, and an `MPI_Allgatherv` of the reduced chunks. That moves
//!   2·(n-1)/n of the data per rank, like a ring all-reduce, and makes MPI and local-thread
//!   runs of a plan bit-identical. A reduce-scatter is the first two steps (an `MPI_Alltoall`).
//! - **All-to-all** with per-pair split sizes is `MPI_Alltoallv`; the split sizes are first
//!   checked against the peers' (a small `MPI_Alltoall` of counts), so a mismatch is a clear
//!   error rather than a truncated message.
//! - **Point-to-point.** `send` never waits for the receiver, as in the `local` communicator:
//!   it copies the data and starts an `MPI_Isend` (completed sends are reaped on later calls
//!   and when the communicator is dropped), on a duplicate of the world communicator. `recv`
//!   probes the message first, so a size mismatch is a clear error. Messages between two
//!   ranks arrive in order (MPI's non-overtaking rule), as the local mailboxes do.
//! - **Failures.** MPI's default error handler aborts the job on a transport error. A rank
//!   whose training fails returns its error without finalising MPI (see
//!   [`crate::train::train_mpi`]); the command line prints it and exits non-zero, and mpirun
//!   then terminates the other ranks, which may be blocked in a collective.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use mpi::datatype::{Equivalence, Partition, PartitionMut};
use mpi::environment::Threading;
use mpi::point_to_point::{Destination, Source};
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator as _, Group as _, SimpleCommunicator};
use mpi::traits::CommunicatorCollectives;
use mpi::{Count, Rank};

use crate::comm::Communicator;
use crate::error::RuntimeError;

/// The tag of point-to-point messages.
const P2P_TAG: mpi::Tag = 7;

/// How long dropping the communicator waits for its started sends to complete before it
/// leaves them (the job is failing then; see the module documentation).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

static WORLD_RANK: OnceLock<usize> = OnceLock::new();

/// Whether an [`MpiComm`] lives in this process (there is at most one).
static LIVE: AtomicBool = AtomicBool::new(false);

/// This process's rank in `MPI_COMM_WORLD` once an [`MpiComm`] has been made (None before, and
/// in processes that do not use MPI). The command line uses it to print on rank 0 only.
pub fn world_rank() -> Option<usize> {
    WORLD_RANK.get().copied()
}

static ERROR_ON_EVERY_RANK: AtomicBool = AtomicBool::new(false);

/// Record that the error this process is about to return is one every rank of the job
/// returns too (a wrong number of processes), so rank 0's report of it is enough.
pub fn set_error_on_every_rank() {
    ERROR_ON_EVERY_RANK.store(true, Ordering::Relaxed);
}

/// Whether the error this process returned is one every rank returns (see
/// [`set_error_on_every_rank`]); the command line prints such errors on rank 0 only.
pub fn error_on_every_rank() -> bool {
    ERROR_ON_EVERY_RANK.load(Ordering::Relaxed)
}

/// Whether this process was started by an MPI launcher (mpirun, mpiexec, srun), judged by
/// the environment variables OpenMPI, MPICH (Hydra), PMIx and Slurm set. A process started
/// otherwise is a world of one ("singleton") when it initialises MPI.
pub fn started_by_launcher() -> bool {
    [
        "OMPI_COMM_WORLD_SIZE",
        "PMIX_RANK",
        "PMI_SIZE",
        "PMI_RANK",
        "MPI_LOCALNRANKS",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some())
}

/// One rank's communicator over MPI; implements [`Communicator`]. Made from the world
/// communicator of an initialised MPI (see [`crate::train::train_mpi`]).
pub struct MpiComm {
    world: SimpleCommunicator,
    /// A duplicate of the world for point-to-point messages, so they never meet the messages
    /// MPI itself exchanges on the world (creating sub-communicators).
    p2p: SimpleCommunicator,
    rank: usize,
    size: usize,
    /// Sub-communicators of the groups used so far, keyed by their sorted world ranks.
    groups: HashMap<Vec<usize>, SimpleCommunicator>,
    /// Sends started and not yet known to be complete, with their (leaked) buffers.
    pending: Vec<PendingSend>,
}

// SAFETY: the MPI handles inside are plain pointers into the MPI library, which is thread
// safe at the level `MpiComm::new` checks (`MPI_THREAD_SERIALIZED` or better): any thread may
// make MPI calls as long as no two do so at the same time. Only one `MpiComm` lives in a
// process at a time (`new` refuses a second), every call goes through `&mut self`, and
// `MpiComm` is neither `Sync` nor `Clone`, so its calls never overlap.
unsafe impl Send for MpiComm {}

/// A started `MPI_Isend` and the buffer it reads, which this module owns (leaked from a `Box`
/// for the `'static` scope, freed once the send completes).
struct PendingSend {
    request: Request<'static, [f32], StaticScope>,
}

impl fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("groups", &self.groups.keys().collect::<Vec<_>>())
            .field("pending_sends", &self.pending.len())
            .finish()
    }
}

fn plan(message: String) -> RuntimeError {
    RuntimeError::Plan(message)
}

/// An element count as MPI's `int`.
fn count(n: usize, what: &str) -> Result<Count, RuntimeError> {
    Count::try_from(n).map_err(|_| {
        RuntimeError::Unsupported(format!(
            "mpi: {what} of {n} elements is more than MPI's count limit of {}",
            Count::MAX
        ))
    })
}

/// Counts and displacements of consecutive chunks with the given boundaries
/// (`bounds.len() == chunks + 1`).
fn partition(bounds: &[usize], what: &str) -> Result<(Vec<Count>, Vec<Count>), RuntimeError> {
    let counts = bounds
        .windows(2)
        .map(|w| count(w[1] - w[0], what))
        .collect::<Result<Vec<_>, _>>()?;
    let displs = bounds[..bounds.len() - 1]
        .iter()
        .map(|&d| count(d, what))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((counts, displs))
}

/// Reduce `data` element-wise over the members of `comm` (this process is member `me` of
/// `n`), every element in member order: `combine(acc, x)` folds member k's value `x` into the
/// accumulator, which starts as member 0's value.
fn reduce_in_order<T: Equivalence + Copy + Default>(
    comm: &SimpleCommunicator,
    n: usize,
    me: usize,
    data: &mut [T],
    what: &str,
    combine: impl Fn(&mut T, T),
) -> Result<(), RuntimeError> {
    let len = data.len();
    count(len, what)?;
    // Member j reduces chunk j (balanced boundaries; some chunks may be empty).
    let bounds: Vec<usize> = (0..=n).map(|j| j * len / n).collect();
    let (counts, displs) = partition(&bounds, what)?;
    let mine = bounds[me + 1] - bounds[me];
    let recv_bounds: Vec<usize> = (0..=n).map(|k| k * mine).collect();
    let (recv_counts, recv_displs) = partition(&recv_bounds, what)?;
    let mut gathered = vec![T::default(); n * mine];
    {
        let send = Partition::new(&data[..], &counts[..], &displs[..]);
        let mut recv = PartitionMut::new(&mut gathered[..], &recv_counts[..], &recv_displs[..]);
        comm.all_to_all_varcount_into(&send, &mut recv);
    }
    let mut acc = gathered[..mine].to_vec();
    for k in 1..n {
        for (a, &x) in acc.iter_mut().zip(&gathered[k * mine..(k + 1) * mine]) {
            combine(a, x);
        }
    }
    let mut out = PartitionMut::new(data, &counts[..], &displs[..]);
    comm.all_gather_varcount_into(&acc[..], &mut out);
    Ok(())
}

fn add_f32(a: &mut f32, x: f32) {
    *a += x;
}

fn add_f64(a: &mut f64, x: f64) {
    *a += x;
}

/// The maximum as the local communicator takes it: NaN propagates, as in torch.
fn max_f32(a: &mut f32, x: f32) {
    if x.is_nan() || x > *a {
        *a = x;
    }
}

impl MpiComm {
    /// This process's rank on `world` (normally `universe.world()`). MPI must be initialised
    /// with at least `MPI_THREAD_SERIALIZED` support (the communicator may move between
    /// threads; it is never used from two at once), and a process has one `MpiComm` at a
    /// time (a second is an error until the first is dropped).
    pub fn new(world: SimpleCommunicator) -> Result<Self, RuntimeError> {
        let level = mpi::environment::threading_support();
        if level < Threading::Serialized {
            return Err(RuntimeError::Unsupported(format!(
                "mpi: the MPI library provides thread support {level:?}; the mpi communicator \
                 needs Serialized or better"
            )));
        }
        if LIVE.swap(true, Ordering::SeqCst) {
            return Err(RuntimeError::Unsupported(
                "mpi: this process already has an MPI communicator (one per process)".to_string(),
            ));
        }
        let rank = world.rank() as usize;
        let size = world.size() as usize;
        let _ = WORLD_RANK.set(rank);
        let p2p = world.duplicate();
        Ok(MpiComm {
            world,
            p2p,
            rank,
            size,
            groups: HashMap::new(),
            pending: Vec::new(),
        })
    }

    /// Check that `group` is sorted, inside the world and contains this rank; return this
    /// rank's position in it.
    fn position(&self, op: &str, group: &[usize]) -> Result<usize, RuntimeError> {
        let n = self.size;
        if let Some(&bad) = group.iter().find(|&&r| r >= n) {
            return Err(plan(format!(
                "{op} on group {group:?}: rank {bad} is outside the world of {n} ranks"
            )));
        }
        if group.windows(2).any(|w| w[0] >= w[1]) {
            return Err(plan(format!(
                "{op} on group {group:?}: ranks must be sorted and distinct"
            )));
        }
        group.iter().position(|&r| r == self.rank).ok_or_else(|| {
            plan(format!(
                "rank {} calls {op} on group {group:?}, which it is not a member of",
                self.rank
            ))
        })
    }

    /// The communicator of `group` (of at least two ranks), created on first use.
    fn comm(&mut self, group: &[usize]) -> Result<&SimpleCommunicator, RuntimeError> {
        if group.len() == self.size {
            return Ok(&self.world);
        }
        if !self.groups.contains_key(group) {
            let ranks: Vec<Rank> = group.iter().map(|&r| r as Rank).collect();
            let members = self.world.group().include(&ranks);
            // The tag keeps creations of different groups apart; every member derives the same.
            let tag = group.iter().fold(17u64, |h, &r| {
                h.wrapping_mul(1_000_003).wrapping_add(r as u64)
            }) % 30_000
                + 1;
            let sub = self
                .world
                .split_by_subgroup_with_tag(&members, tag as mpi::Tag)
                .ok_or_else(|| {
                    plan(format!(
                        "mpi: rank {} could not create the communicator of group {group:?}",
                        self.rank
                    ))
                })?;
            self.groups.insert(group.to_vec(), sub);
        }
        Ok(&self.groups[group])
    }

    fn check_offsets(
        &self,
        group: &[usize],
        what: &str,
        offsets: &[usize],
        len: usize,
    ) -> Result<(), RuntimeError> {
        let ok = offsets.len() == group.len() + 1
            && offsets[0] == 0
            && offsets.windows(2).all(|w| w[0] <= w[1])
            && offsets[group.len()] == len;
        if ok {
            Ok(())
        } else {
            Err(plan(format!(
                "rank {}: all_to_all on group {group:?}: {what} offsets {offsets:?} must have {} \
                 non-decreasing entries from 0 to the buffer length {len}",
                self.rank,
                group.len() + 1
            )))
        }
    }

    /// Complete the started sends that have finished and free their buffers.
    fn reap_sends(&mut self) {
        let mut still = Vec::with_capacity(self.pending.len());
        for p in self.pending.drain(..) {
            match p.request.test_with_data() {
                Ok((_, buf)) => free_send_buffer(buf),
                Err(request) => still.push(PendingSend { request }),
            }
        }
        self.pending = still;
    }
}

/// Free a send buffer leaked in [`MpiComm::send`] once its send has completed.
fn free_send_buffer(buf: &'static [f32]) {
    // SAFETY: `buf` came from `Box::leak` in `send`, and MPI no longer reads it (the request
    // completed); nothing else refers to it.
    drop(unsafe { Box::from_raw(buf as *const [f32] as *mut [f32]) });
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // Sends complete once their receivers take them; in a failing job they may never do,
        // so wait a bounded time, then leave them (and their buffers) to the dying process.
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        while !self.pending.is_empty() && !std::thread::panicking() && Instant::now() < deadline {
            self.reap_sends();
            if !self.pending.is_empty() {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        for p in self.pending.drain(..) {
            // A request must not be dropped incomplete (rsmpi panics); leak it.
            std::mem::forget(p);
        }
        // Sub-communicators are freed here (MPI_Comm_free), before MPI is finalised.
        self.groups.clear();
        LIVE.store(false, Ordering::SeqCst);
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&mut self, group: &[usize], data: &mut [f32]) -> Result<(), RuntimeError> {
        let me = self.position("all_reduce_sum", group)?;
        if group.len() == 1 {
            return Ok(());
        }
        let n = group.len();
        let comm = self.comm(group)?;
        reduce_in_order(comm, n, me, data, "all_reduce_sum", add_f32)
    }

    fn all_reduce_max(&mut self, group: &[usize], data: &mut [f32]) -> Result<(), RuntimeError> {
        let me = self.position("all_reduce_max", group)?;
        if group.len() == 1 {
            return Ok(());
        }
        let n = group.len();
        let comm = self.comm(group)?;
        reduce_in_order(comm, n, me, data, "all_reduce_max", max_f32)
    }

    fn all_reduce_sum_f64(
        &mut self,
        group: &[usize],
        data: &mut [f64],
    ) -> Result<(), RuntimeError> {
        let me = self.position("all_reduce_sum_f64", group)?;
        if group.len() == 1 {
            return Ok(());
        }
        let n = group.len();
        let comm = self.comm(group)?;
        reduce_in_order(comm, n, me, data, "all_reduce_sum_f64", add_f64)
    }

    fn all_gather(
        &mut self,
        group: &[usize],
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), RuntimeError> {
        self.position("all_gather", group)?;
        if recv.len() != group.len() * send.len() {
            return Err(plan(format!(
                "rank {}: all_gather on group {group:?} of {} elements needs a receive buffer of \
                 {}, not {}",
                self.rank,
                send.len(),
                group.len() * send.len(),
                recv.len()
            )));
        }
        count(recv.len(), "all_gather")?;
        if group.len() == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        let comm = self.comm(group)?;
        comm.all_gather_into(send, recv);
        Ok(())
    }

    fn reduce_scatter_sum(
        &mut self,
        group: &[usize],
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), RuntimeError> {
        self.position("reduce_scatter_sum", group)?;
        let n = group.len();
        if send.len() != n * recv.len() {
            return Err(plan(format!(
                "rank {}: reduce_scatter_sum on group {group:?} of {} elements needs a receive \
                 buffer of {} / {}, not {}",
                self.rank,
                send.len(),
                send.len(),
                n,
                recv.len()
            )));
        }
        count(send.len(), "reduce_scatter_sum")?;
        if n == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        let comm = self.comm(group)?;
        // Member j gets chunk j of every member, then sums them in group order.
        let c = recv.len();
        let mut gathered = vec![0f32; n * c];
        comm.all_to_all_into(send, &mut gathered[..]);
        recv.copy_from_slice(&gathered[..c]);
        for k in 1..n {
            for (o, &x) in recv.iter_mut().zip(&gathered[k * c..(k + 1) * c]) {
                *o += x;
            }
        }
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
        let me = self.position("all_to_all", group)?;
        self.check_offsets(group, "send", send_offsets, send.len())?;
        self.check_offsets(group, "receive", recv_offsets, recv.len())?;
        let (to_self, from_self) = (
            send_offsets[me + 1] - send_offsets[me],
            recv_offsets[me + 1] - recv_offsets[me],
        );
        if to_self != from_self {
            return Err(plan(format!(
                "rank {}: all_to_all on group {group:?} sends {to_self} elements to itself but \
                 expects {from_self}",
                self.rank
            )));
        }
        let (send_counts, send_displs) = partition(send_offsets, "all_to_all send")?;
        let (recv_counts, recv_displs) = partition(recv_offsets, "all_to_all receive")?;
        if group.len() == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        let rank = self.rank;
        let comm = self.comm(group)?;
        // What each peer will send this member, against what it expects.
        let mut incoming = vec![0 as Count; group.len()];
        comm.all_to_all_into(&send_counts[..], &mut incoming[..]);
        if let Some(j) = (0..group.len()).find(|&j| incoming[j] != recv_counts[j]) {
            return Err(plan(format!(
                "collective mismatch on group {group:?}: rank {} sends {} elements to rank \
                 {rank} in all_to_all, which expects {}",
                group[j], incoming[j], recv_counts[j]
            )));
        }
        let send = Partition::new(send, &send_counts[..], &send_displs[..]);
        let mut recv = PartitionMut::new(recv, &recv_counts[..], &recv_displs[..]);
        comm.all_to_all_varcount_into(&send, &mut recv);
        Ok(())
    }

    fn send(&mut self, to: usize, data: &[f32]) -> Result<(), RuntimeError> {
        if to >= self.size {
            return Err(plan(format!(
                "rank {} sends to rank {to}, outside the world of {} ranks",
                self.rank, self.size
            )));
        }
        count(data.len(), "send")?;
        self.reap_sends();
        let buf: &'static [f32] = Box::leak(data.to_vec().into_boxed_slice());
        let request = self
            .p2p
            .process_at_rank(to as Rank)
            .immediate_send_with_tag(StaticScope, buf, P2P_TAG);
        self.pending.push(PendingSend { request });
        Ok(())
    }

    fn recv(&mut self, from: usize, data: &mut [f32]) -> Result<(), RuntimeError> {
        if from >= self.size {
            return Err(plan(format!(
                "rank {} receives from rank {from}, outside the world of {} ranks",
                self.rank, self.size
            )));
        }
        count(data.len(), "recv")?;
        self.reap_sends();
        let (message, status) = self
            .p2p
            .process_at_rank(from as Rank)
            .matched_probe_with_tag(P2P_TAG);
        let n = status.count(f32::equivalent_datatype()) as usize;
        if n != data.len() {
            // Take the message anyway (a matched message must be received), then fail.
            let mut scratch = vec![0f32; n];
            message.matched_receive_into(&mut scratch[..]);
            return Err(plan(format!(
                "rank {} expects {} elements from rank {from} but the message has {n}",
                self.rank,
                data.len()
            )));
        }
        message.matched_receive_into(data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_cover_the_buffer() {
        let (c, d) = partition(&[0, 2, 2, 5], "x").unwrap();
        assert_eq!((c, d), (vec![2, 0, 3], vec![0, 2, 2]));
        assert!(count(usize::MAX, "x").is_err());
    }

    #[test]
    fn max_propagates_nan() {
        let mut a = 1.0f32;
        max_f32(&mut a, 2.0);
        assert_eq!(a, 2.0);
        max_f32(&mut a, f32::NAN);
        assert!(a.is_nan());
        max_f32(&mut a, 3.0);
        assert!(a.is_nan());
    }
}
