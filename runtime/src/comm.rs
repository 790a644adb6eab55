//! Communicators: how ranks exchange data. The runtime talks to the [`Communicator`] trait
//! only. Three implement it: [`SingleRank`] (a world of one: its collectives are the
//! identity, as they are for any group of one), `local_comm::LocalComm` (one thread per rank
//! in this process, over channels; it reports mismatched collectives and deadlocks instead
//! of hanging) and `mpi_comm::MpiComm` (feature `mpi`: one process per rank over OpenMPI).
//! There is no NCCL communicator.

use crate::error::RuntimeError;

/// Collective and point-to-point operations. A group is the sorted list of world ranks that
/// take part (e.g. one tp group of the mesh); the calling rank is always a member. Every member
/// calls each collective in the same order with the same sizes (the plan validator proves it;
/// the local communicator also detects violations at run time and reports them).
pub trait Communicator: Send {
    /// This rank's index in the world.
    fn rank(&self) -> usize;
    /// Number of ranks in the world.
    fn size(&self) -> usize;
    /// Sum `data` element-wise over the group, in place.
    fn all_reduce_sum(&mut self, group: &[usize], data: &mut [f32]) -> Result<(), RuntimeError>;
    /// Element-wise maximum over the group, in place.
    fn all_reduce_max(&mut self, group: &[usize], data: &mut [f32]) -> Result<(), RuntimeError>;
    /// Sum f64 values over the group (norms, losses), in place.
    fn all_reduce_sum_f64(&mut self, group: &[usize], data: &mut [f64])
        -> Result<(), RuntimeError>;
    /// Concatenate every member's `send` into `recv` in group order;
    /// `recv.len() == group.len() · send.len()`.
    fn all_gather(
        &mut self,
        group: &[usize],
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), RuntimeError>;
    /// Sum over the group, then member i keeps chunk i; `send.len() == group.len() · recv.len()`.
    fn reduce_scatter_sum(
        &mut self,
        group: &[usize],
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), RuntimeError>;
    /// Member i sends `send[send_offsets[j]..send_offsets[j+1]]` to member j and receives
    /// member j's chunk for it into `recv[recv_offsets[j]..recv_offsets[j+1]]` (offsets have
    /// `group.len() + 1` entries; split sizes may differ per pair).
    fn all_to_all(
        &mut self,
        group: &[usize],
        send: &[f32],
        send_offsets: &[usize],
        recv: &mut [f32],
        recv_offsets: &[usize],
    ) -> Result<(), RuntimeError>;
    /// Send `data` to world rank `to` (blocking until the receiver has taken it or buffered).
    fn send(&mut self, to: usize, data: &[f32]) -> Result<(), RuntimeError>;
    /// Receive exactly `data.len()` values from world rank `from`.
    fn recv(&mut self, from: usize, data: &mut [f32]) -> Result<(), RuntimeError>;
    /// Send `data` to world rank `to` as the message tagged `tag` (pipeline transfers);
    /// never waits for the receiver.
    fn send_tagged(&mut self, to: usize, tag: u64, data: &[f32]) -> Result<(), RuntimeError> {
        let _ = (tag, data);
        Err(RuntimeError::Plan(format!(
            "rank {} has no peer {to} to send to",
            self.rank()
        )))
    }
    /// Receive the message tagged `tag` from world rank `from` (exactly `data.len()` values);
    /// messages with other tags may be taken in any order.
    fn recv_tagged(&mut self, from: usize, tag: u64, data: &mut [f32]) -> Result<(), RuntimeError> {
        let _ = (tag, data);
        Err(RuntimeError::Plan(format!(
            "rank {} has no peer {from} to receive from",
            self.rank()
        )))
    }
    /// Which of the messages `wanted`, (world rank, tag) pairs, have arrived (so that
    /// `recv_tagged` would not wait for them): one answer each, in order. One call answers a
    /// dynamic pipeline's whole readiness check, so a communicator whose probes cost (MPI)
    /// looks at its arrivals once rather than once per message.
    fn probe_tagged(&mut self, wanted: &[(usize, u64)]) -> Result<Vec<bool>, RuntimeError> {
        match wanted.first() {
            None => Ok(Vec::new()),
            Some(&(from, _)) => Err(RuntimeError::Plan(format!(
                "rank {} has no peer {from} to probe",
                self.rank()
            ))),
        }
    }
    /// Wait until a message may have arrived for this rank or another rank's communication
    /// may have changed what this one can do, at most about `timeout` (the dynamic
    /// pipeline's idle wait; an early return is always allowed). The default sleeps for
    /// `timeout` but at most 50 µs (a communicator that cannot be woken polls); the local
    /// communicator wakes as soon as another rank sends or deposits.
    fn wait_for_mail(&mut self, timeout: std::time::Duration) -> Result<(), RuntimeError> {
        std::thread::sleep(timeout.min(std::time::Duration::from_micros(50)));
        Ok(())
    }
    /// Let started transfers move while the caller computes (called between kernels). The
    /// default does nothing; MPI tests its pending sends, at most every few microseconds.
    fn progress(&mut self) {}
    /// The recording and injecting wrapper, when this communicator is one (`--trace`,
    /// `--inject`).
    fn scan(&mut self) -> Option<&mut crate::scan::ScanComm> {
        None
    }
}

/// The world of one rank: every collective over the group `[0]` is the identity and there is
/// no peer to talk to.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleRank;

impl SingleRank {
    fn check(group: &[usize]) -> Result<(), RuntimeError> {
        if group == [0] {
            Ok(())
        } else {
            Err(RuntimeError::Plan(format!(
                "collective over ranks {group:?}, but the world has one rank"
            )))
        }
    }

    fn copy(
        group: &[usize],
        send: &[f32],
        recv: &mut [f32],
        what: &str,
    ) -> Result<(), RuntimeError> {
        Self::check(group)?;
        if recv.len() != send.len() {
            return Err(RuntimeError::Plan(format!(
                "{what} of {} elements into {} on one rank",
                send.len(),
                recv.len()
            )));
        }
        recv.copy_from_slice(send);
        Ok(())
    }
}

impl Communicator for SingleRank {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn all_reduce_sum(&mut self, group: &[usize], _data: &mut [f32]) -> Result<(), RuntimeError> {
        Self::check(group)
    }

    fn all_reduce_max(&mut self, group: &[usize], _data: &mut [f32]) -> Result<(), RuntimeError> {
        Self::check(group)
    }

    fn all_reduce_sum_f64(
        &mut self,
        group: &[usize],
        _data: &mut [f64],
    ) -> Result<(), RuntimeError> {
        Self::check(group)
    }

    fn all_gather(
        &mut self,
        group: &[usize],
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), RuntimeError> {
        Self::copy(group, send, recv, "all_gather")
    }

    fn reduce_scatter_sum(
        &mut self,
        group: &[usize],
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), RuntimeError> {
        Self::copy(group, send, recv, "reduce_scatter")
    }

    fn all_to_all(
        &mut self,
        group: &[usize],
        send: &[f32],
        _send_offsets: &[usize],
        recv: &mut [f32],
        _recv_offsets: &[usize],
    ) -> Result<(), RuntimeError> {
        Self::copy(group, send, recv, "all_to_all")
    }

    fn send(&mut self, to: usize, _data: &[f32]) -> Result<(), RuntimeError> {
        Err(RuntimeError::Plan(format!(
            "send to rank {to}, but the world has one rank"
        )))
    }

    fn recv(&mut self, from: usize, _data: &mut [f32]) -> Result<(), RuntimeError> {
        Err(RuntimeError::Plan(format!(
            "receive from rank {from}, but the world has one rank"
        )))
    }
}

/// Argument checks every communicator makes before a collective: `group` is sorted,
/// distinct, inside a world of `world` ranks and contains `rank`; returns `rank`'s position
/// in it.
pub fn group_position(
    op: &dyn std::fmt::Display,
    group: &[usize],
    rank: usize,
    world: usize,
) -> Result<usize, RuntimeError> {
    if let Some(&bad) = group.iter().find(|&&r| r >= world) {
        return Err(RuntimeError::Plan(format!(
            "{op} on group {group:?}: rank {bad} is outside the world of {world} ranks"
        )));
    }
    if group.windows(2).any(|w| w[0] >= w[1]) {
        return Err(RuntimeError::Plan(format!(
            "{op} on group {group:?}: ranks must be sorted and distinct"
        )));
    }
    group.iter().position(|&r| r == rank).ok_or_else(|| {
        RuntimeError::Plan(format!(
            "rank {rank} calls {op} on group {group:?}, which it is not a member of"
        ))
    })
}

/// Checks `all_to_all` split offsets: `group.len() + 1` non-decreasing entries from 0 to
/// the buffer length `len`.
pub fn check_offsets(
    rank: usize,
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
        Err(RuntimeError::Plan(format!(
            "rank {rank}: all_to_all on group {group:?}: {what} offsets {offsets:?} must have {} \
             non-decreasing entries from 0 to the buffer length {len}",
            group.len() + 1
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_world_of_one() {
        let mut c = SingleRank;
        let mut x = [1.0, 2.0];
        c.all_reduce_sum(&[0], &mut x).unwrap();
        assert_eq!(x, [1.0, 2.0]);
        let mut y = [0.0; 2];
        c.all_gather(&[0], &x, &mut y).unwrap();
        assert_eq!(y, x);
        assert!(c.all_gather(&[0], &x, &mut [0.0; 4]).is_err());
        assert!(c.all_reduce_sum(&[0, 1], &mut x).is_err());
        assert!(c.send(1, &x).is_err());
        assert_eq!((c.rank(), c.size()), (0, 1));
    }
}
