//! Renderers: how the CLI draws what the library crates return.
//!
//! - [`schedule`]: pipeline schedules as text, JSON and SVG (`megac schedule --format`).
//! - [`scan`]: a traced run's aligned timeline as SVG (`megac scan DIR --svg`).

pub mod scan;
pub mod schedule;
