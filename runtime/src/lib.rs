//! Plan executor: backends (cpu, cuda), communicators (local, mpi, nccl), data loading,
//! checkpoints and traces. Empty until the single-device training issue lands; the crate
//! exists so the workspace has the shape of DESIGN.md from the start.

pub mod data;
pub mod error;
pub mod hf;
