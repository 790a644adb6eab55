//! Communicators: how ranks exchange data. The runtime talks to the [`Communicator`] trait
//! only; `local` (threads in one process), `mpi` and `nccl` implement it.
//!
//! Today plans are single-rank, so [`SingleRank`] (the `local` communicator of a world of one)
//! is the only implementation; its collectives are the identity, as they are for any group of
//! one. The multi-rank local communicator (one thread per rank, channels) and MPI come with
//! the sharding and multi-process issues and implement the same trait.

use crate::error::RuntimeError;

/// Collective and point-to-point operations over a group of ranks. Every member calls each
/// collective in the same order with the same sizes (the plan validator proves it).
pub trait Communicator {
    /// This rank's index in the world.
    fn rank(&self) -> usize;
    /// Number of ranks in the world.
    fn size(&self) -> usize;
    /// Sum `data` element-wise over every rank, in place.
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), RuntimeError>;
    /// Sum f64 scalars over every rank (norms, losses), in place.
    fn all_reduce_sum_f64(&mut self, data: &mut [f64]) -> Result<(), RuntimeError>;
    /// Concatenate every rank's `send` into `recv` (rank order); `recv.len() == size · send.len()`.
    fn all_gather(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), RuntimeError>;
    /// Sum over ranks, then scatter: rank r keeps chunk r; `send.len() == size · recv.len()`.
    fn reduce_scatter_sum(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), RuntimeError>;
    /// Send `data` to rank `to`.
    fn send(&mut self, to: usize, data: &[f32]) -> Result<(), RuntimeError>;
    /// Receive into `data` from rank `from`.
    fn recv(&mut self, from: usize, data: &mut [f32]) -> Result<(), RuntimeError>;
}

/// The world of one rank: every collective is the identity and there is no peer to talk to.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleRank;

impl SingleRank {
    fn no_peer(what: &str, peer: usize) -> RuntimeError {
        RuntimeError::Plan(format!("{what} rank {peer}, but the world has one rank"))
    }
}

impl Communicator for SingleRank {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn all_reduce_sum(&mut self, _data: &mut [f32]) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn all_reduce_sum_f64(&mut self, _data: &mut [f64]) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn all_gather(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), RuntimeError> {
        if recv.len() != send.len() {
            return Err(RuntimeError::Plan(format!(
                "all_gather of {} elements into {} on one rank",
                send.len(),
                recv.len()
            )));
        }
        recv.copy_from_slice(send);
        Ok(())
    }

    fn reduce_scatter_sum(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), RuntimeError> {
        self.all_gather(send, recv)
    }

    fn send(&mut self, to: usize, _data: &[f32]) -> Result<(), RuntimeError> {
        Err(Self::no_peer("send to", to))
    }

    fn recv(&mut self, from: usize, _data: &mut [f32]) -> Result<(), RuntimeError> {
        Err(Self::no_peer("receive from", from))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_world_of_one() {
        let mut c = SingleRank;
        let mut x = [1.0, 2.0];
        c.all_reduce_sum(&mut x).unwrap();
        assert_eq!(x, [1.0, 2.0]);
        let mut y = [0.0; 2];
        c.all_gather(&x, &mut y).unwrap();
        assert_eq!(y, x);
        assert!(c.all_gather(&x, &mut [0.0; 4]).is_err());
        assert!(c.send(1, &x).is_err());
        assert_eq!((c.rank(), c.size()), (0, 1));
    }
}
