//! megac's passes and the pass manager.
//!
//! - [`manager`]: the ordered pipeline of named passes (`megac passes` lists it).
//! - [`build`]: ModelSpec -> Graph IR.
//! - [`autodiff`]: backward graph; [`recompute`]: activation recomputation rewrite;
//!   [`shard`]: layouts over the mesh, with each parameter's tp layout from
//!   [`tensor_parallel`] and sequence parallelism's placement from [`collectives`] (both
//!   egg rewrites over the real IR); [`optimizer`]: gradient norm, clipping, AdamW.
//! - [`instrument`]: the `perturb` and `probe` passes of MegaScope (no-ops unless asked).
//! - `flops`: model FLOPs per step, re-exported from their home, [`megac_ir::flops`].

#![warn(missing_docs)]

pub mod autodiff;
pub mod build;
pub mod collectives;
pub mod instrument;
pub mod manager;
pub mod optimizer;
pub mod recompute;
pub mod shard;
pub mod tensor_parallel;

pub use instrument::Instrument;
pub use manager::{
    pass_names, pipeline, run_inference_pipeline, run_inference_pipeline_with, run_pass,
    run_pipeline, run_pipeline_with, Module, Pass, INFERENCE_PASSES,
};
/// Model FLOPs per step (analysis, not a transformation): their home is in ir.
pub use megac_ir::flops;

/// Errors raised by passes.
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    /// A pass produced ill-typed IR.
    #[error(transparent)]
    Ir(#[from] megac_ir::IrError),
    /// The verifier rejected a pass's output.
    #[error("verifier failed after pass `{pass}`: {errors}")]
    Verify {
        /// The pass just run.
        pass: &'static str,
        /// Every broken invariant, typed.
        errors: megac_ir::VerifyErrors,
    },
    /// Differentiation or the optimizer could not be generated.
    #[error("autodiff: {0}")]
    Autodiff(String),
    /// The collective rewrites found no placement (they did not saturate, or no valid
    /// term was extracted).
    #[error("collective placement: {0}")]
    Collectives(String),
    /// A graph pass ran on a module without a graph (the build pass has not run).
    #[error("no graph: run the build pass first")]
    NoGraph,
    /// A probe pattern or perturbation names no point, or a bad one for its kind.
    #[error("{0}")]
    Instrument(String),
    /// `--after` named no pass.
    #[error("no pass named `{name}`; passes: {known}")]
    UnknownPass {
        /// The name given.
        name: String,
        /// The valid names.
        known: String,
    },
}
