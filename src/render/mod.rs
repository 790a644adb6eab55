//! Renderers: how the CLI draws what the library crates return.
//!
//! - [`schedule`]: pipeline schedules as text, JSON and SVG (`megac schedule --format`).

pub mod schedule;
