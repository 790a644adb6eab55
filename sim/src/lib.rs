//! megac-sim: the cost model, the plan simulator and the layout search.
//!
//! - [`cluster`]: the machine (presets `a100-80g`, `h100-sxm`, `h200`, and cluster.toml);
//! - [`cost`]: per-kernel roofline costs and alpha-beta collective costs;
//! - [`simulate`]: event-driven simulation of a compiled [`megac_ir::plan::Plan`];
//! - [`model`]: the analytic model of a layout (no compiled plan needed);
//! - [`search`]: enumeration of every valid layout for a GPU count, ranked by the model;
//! - [`calibrate`]: the model against Megatron-LM's published H100 weak-scaling table;
//! - [`error`]: the crate's one error type, with file, line and column where there is one.
//!
//! The crate depends on the IR only. docs/cluster-toml.md documents the file format, the
//! presets' sources and the fitted constants.

#![warn(missing_docs)]

pub mod calibrate;
pub mod cluster;
pub mod cost;
pub mod error;
pub mod model;
pub mod search;
pub mod simulate;

pub use cluster::Cluster;
pub use cost::{CostMode, CostModel, CostParams, Jitter};
pub use error::SimError;
pub use model::{estimate, Estimate, ParallelLayout};
pub use search::{search, SearchResult};
pub use simulate::{simulate, SimReport};
