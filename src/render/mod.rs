//! Renderers: how the CLI draws what the library crates return.
//!
//! - [`schedule`]: pipeline schedules as text, JSON and SVG (`megac schedule --format`).
//! - [`scan`]: a traced run's aligned timeline as SVG (`megac scan DIR --svg`).
//! - [`scope_view`]: a probe file as one self-contained HTML page (`megac scope view`).

pub mod scan;
pub mod schedule;
pub mod scope_view;
