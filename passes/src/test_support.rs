//! Helpers for unit tests: specs from model.toml text.

use megac_ir::ModelSpec;

/// Parse and validate model.toml text, panicking with the rendered error (tests only).
pub fn spec(text: &str) -> ModelSpec {
    megac_frontend::parse_str("test.toml", text, &[]).unwrap_or_else(|e| panic!("{}", e.render()))
}
