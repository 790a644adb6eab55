//! `megac dump`: print the IR after a pass.

use std::io::Write;

use crate::ModelArgs;

/// Compile up to `after` and print the IR.
pub fn run(args: &ModelArgs, after: Option<&str>) -> Result<(), String> {
    let spec = super::load_spec(args)?;
    let module = super::compile(spec, after)?;
    let mut out = std::io::stdout().lock();
    // A closed pipe (`megac dump ... | head`) is not an error worth a message.
    let _ = out.write_all(module.dump().as_bytes());
    Ok(())
}
