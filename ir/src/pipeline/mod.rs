//! Pipeline scheduling: how a model is cut into chunks and in which order each pipeline rank
//! runs them.
//!
//! - [`stages`]: the stage split, how many layers each chunk (virtual stage) holds.
//! - [`schedule`]: per-rank action lists for every schedule, their unit-cost simulator and
//!   their validator.
//!
//! Neither is a graph pass: codegen turns the lists into a plan's stage roles, and
//! `megac schedule` prints and draws them. Both live in ir so that codegen depends on ir only.

pub mod schedule;
pub mod stages;
