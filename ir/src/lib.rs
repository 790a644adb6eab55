//! megac's intermediate representations.
//!
//! - [`spec`]: level 1, the validated model description.
//! - [`graph`]: level 2, the Graph IR of one training step (arena of values and ops), with
//!   [`types`] (dtypes, named-dim shapes, layouts), [`op`] (kernel-sized ops),
//!   [`infer`] (shape rules), [`verify`] (invariants), [`print`] and [`parse`] (text form).
//!
//! - [`file`]: reading users' files with size limits, and atomic writing (every writer of plans,
//!   reports, traces).
//! - [`flops`]: Megatron's model FLOPs per step and the padded vocabulary.
//! - [`rules`]: layout validity, model.toml's cross-key rules as typed violations.
//! - [`pipeline`]: pipeline scheduling: the stage split and per-rank schedules.
//! - [`plan`]: level 5, the Plan: the only contract between compiler and runtime;
//!   [`gate`]: the check every plan passes before the runtime accepts it ([`gate::CheckedPlan`]);
//!   [`plan_text`]: the plan's text form for people ([`print_plan`], `megac inspect --program`).
//!
//! The sharded and staged levels will build on these types.

#![warn(missing_docs)]

pub mod check;
pub mod file;
pub mod flops;
pub mod gate;
pub mod graph;
pub mod infer;
pub mod mesh;
pub mod op;
pub mod parse;
pub mod perturb;
pub mod pipeline;
pub mod plan;
pub mod plan_text;
pub mod print;
pub mod rng;
pub mod rules;
pub mod spec;
pub mod types;
pub mod verify;

pub use graph::{Graph, Op, OpId, Value, ValueDef, ValueId};
pub use mesh::Mesh;
pub use op::{OpKind, WeightLayout};
pub use parse::parse_graph;
pub use plan_text::print_plan;
pub use print::print_graph;
pub use spec::ModelSpec;
pub use types::{Axis, DType, Dim, Layout, TensorType};
pub use verify::{verify, VerifyError, VerifyErrors};

/// Errors raised while building or reading IR.
#[derive(Debug, thiserror::Error)]
pub enum IrError {
    /// Shape inference rejected an op's operands.
    #[error("{op} at {path}: {message}")]
    Type {
        /// Op name.
        op: String,
        /// Provenance path of the op.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// The text form could not be read.
    #[error("line {line}, column {col}: {message}")]
    Parse {
        /// 1-based line.
        line: usize,
        /// 1-based column.
        col: usize,
        /// What is wrong.
        message: String,
    },
}
