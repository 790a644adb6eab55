//! Plan emission: turns the scheduled IR into per-role programs (JSON and a compact binary
//! form). Empty until the single-device training issue lands; the crate exists so the
//! workspace has the shape of DESIGN.md from the start.
