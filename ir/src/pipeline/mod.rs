//! Pipeline scheduling: how a model is cut into chunks and in which order each pipeline rank
//! runs them.
//!
//! - [`stages`]: the stage split, how many layers each chunk (virtual stage) holds.
//! - [`action`]: the steps of a schedule ([`Action`]: compute on a chunk, or a transfer).
//! - [`schedule`](mod@schedule): construction, one action list per rank for a
//!   [`ScheduleKind`].
//! - [`simulate`](mod@simulate): the simulator (timelines, bubbles, peaks, deadlocks).
//! - [`validate`](mod@validate): the validator of action lists.
//!
//! None of this is a graph pass: codegen turns the lists into a plan's stage roles, and
//! `megac schedule` prints and draws them (`src/render/schedule.rs`). It lives in ir so that
//! codegen depends on ir only, next to the rules it builds on (chunk placement in
//! [`crate::mesh`], the DPP policy in [`crate::spec`]). The items are re-exported here.

pub mod action;
pub mod schedule;
pub mod simulate;
pub mod stages;
pub mod validate;

pub use action::{Action, ActionKind, Payload};
pub use schedule::{schedule, with_transfers, DppPolicy, ScheduleError, ScheduleKind};
pub use simulate::{simulate, simulate_by, Blocked, Costs, RankTimeline, SimError, Timeline};
pub use validate::{validate, ValidateError};
