//! The runtime: executes a Plan. It depends on ir (the Plan) and kernels, never on passes.
//!
//! - [`memory`]: the rank's arenas, laid out by the plan's static memory plan.
//! - [`exec`]: one kernel call per instruction (cpu backend); `sharded` holds the helpers
//!   of kernels that communicate (context-parallel K/V exchange, vocab-parallel loss);
//!   [`profile`]: per-op timings and the Chrome trace; [`rng`]: the one seeded random stream.
//! - [`comm`]: the communicator trait and the single-rank world; `local_comm`: one thread
//!   per rank in this process; `mpi_comm` (feature `mpi`): one process per rank over MPI.
//! - [`scan`]: per-rank event records (`--trace`), fault injection (`--inject`) and their
//!   analysis (clock alignment, merged timeline, slow-rank and slow-link detection).
//! - [`train`]: the loop: data, micro-batches, optimizer steps, progress, report;
//!   [`checkpoint`]: distributed checkpoints (save, resume, resharding).
//! - [`data`]: synthetic data and token files; [`hf`]: Hugging Face safetensors;
//!   [`init`]: deterministic per-element initialisation.
//! - [`infer`]: forward-only runs of a plan: logits, probes, generation; [`kv`]: generation
//!   with a KV cache (a window plan for the prompt, a block plan per new token);
//!   [`perturb`]: perturbations during training.
//! - [`eval`]: held-out evaluation (the forward segments of the training plan) and
//!   `megac eval`; [`log`]: log lines and `--log FILE.jsonl` for unattended runs.
//!
//! The cpu backend runs every plan; [`cuda`] (feature `cuda`) runs one-rank plans on a GPU
//! (`--device cuda`, not run on hardware yet). There is no NCCL communicator; a communicator
//! implements [`comm::Communicator`].

#![warn(missing_docs)]

pub mod checkpoint;
pub mod comm;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod error;
pub mod eval;
pub mod exec;
pub mod fusion;
pub mod hf;
pub mod hostfile;
pub mod infer;
pub mod init;
pub mod kv;
pub mod local_comm;
pub mod log;
pub mod memory;
#[cfg(feature = "mpi")]
pub mod mpi_comm;
pub mod perturb;
mod pipeline;
pub mod profile;
/// The seeded random stream (its home is `megac_ir::rng`).
pub mod rng {
    pub use megac_ir::rng::SplitMix64;
}
pub mod scaler;
pub mod scan;
mod sharded;
pub mod threads;
pub mod train;
