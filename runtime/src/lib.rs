//! The runtime: executes a Plan. It depends on ir (the Plan) and kernels, never on passes.
//!
//! - [`memory`]: the rank's arenas, laid out by the plan's static memory plan.
//! - [`exec`]: one kernel call per instruction (cpu backend).
//! - [`comm`]: the communicator trait; the single-rank `local` world today.
//! - [`train`]: the loop: data, micro-batches, optimizer steps, progress, report.
//! - [`data`]: synthetic data and token files; [`hf`]: Hugging Face safetensors;
//!   [`init`]: deterministic per-element initialisation.
//!
//! Multi-rank communicators (local threads, MPI, NCCL) and the cuda backend come with later
//! issues and implement [`comm::Communicator`].

pub mod comm;
pub mod data;
pub mod error;
pub mod exec;
pub mod hf;
pub mod init;
pub mod local_comm;
pub mod memory;
pub mod train;
