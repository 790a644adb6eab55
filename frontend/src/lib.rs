//! The model.toml frontend: reads a model description, applies `--set` overrides,
//! checks types, ranges and cross-key rules, and returns an [`ModelSpec`] (IR level 1).
//!
//! Every problem becomes one [`SpecError`] naming the key, the values, the file, line and
//! column (or the `--set` argument), and what would be valid.
//!
//! ```
//! let text = "[model]\narch = \"llama\"\nlayers = 2\nhidden = 64\nheads = 4\n\
//!             ffn_hidden = 128\nvocab = 256\nseq_len = 32\n";
//! let spec = megac_frontend::parse_str("m.toml", text, &["parallel.tp=2".to_string()]).unwrap();
//! assert_eq!(spec.parallel.tp, 2);
//! ```

#![warn(missing_docs)]

pub mod error;
pub mod hf;
pub mod raw;
pub mod schema;
pub mod validate;

use std::path::Path;

pub use error::{Origin, SpecError};
pub use megac_ir::spec::ModelSpec;

/// Read, override and validate the model.toml at `path`.
pub fn load(path: &Path, sets: &[String]) -> Result<ModelSpec, SpecError> {
    let file = path.display().to_string();
    let text = megac_ir::file::read_text(path, megac_ir::file::MAX_CONFIG_BYTES).map_err(|e| {
        SpecError::new(&file, Origin::Default, format!("cannot read the file: {e}"))
    })?;
    parse_str(&file, &text, sets)
}

/// Parse, override and validate model.toml `text`; `file` names it in messages and its
/// stem names the model.
pub fn parse_str(file: &str, text: &str, sets: &[String]) -> Result<ModelSpec, SpecError> {
    let mut root = raw::parse_document(file, text)?;
    for arg in sets {
        raw::apply_set(&mut root, file, arg)?;
    }
    let name = Path::new(file)
        .file_stem()
        .map_or_else(|| "model".to_string(), |s| s.to_string_lossy().into_owned());
    let mut origins = schema::Origins::new();
    let spec = schema::read_spec(file, &name, root, &mut origins)?;
    validate::validate(file, &spec, &origins)?;
    Ok(spec)
}
