//! One module per subcommand. Each `run` returns the rendered error message on failure.

pub mod check;
pub mod check_plan;
pub mod compile;
pub mod dump;
pub mod inspect;
pub mod launch;
pub mod passes;
pub mod plan;
pub mod run;
pub mod schedule;
pub mod simulate;

use megac_ir::ModelSpec;
use megac_passes::{Module, PassError};

use crate::ModelArgs;

/// Load and validate the model, rendering any error for the terminal.
pub fn load_spec(args: &ModelArgs) -> Result<ModelSpec, String> {
    megac_frontend::load(&args.model, &args.sets).map_err(|e| e.render())
}

/// Run the pass pipeline (verifying after each pass) up to `after`.
pub fn compile(spec: ModelSpec, after: Option<&str>) -> Result<Module, String> {
    megac_passes::run_pipeline(spec, after, true).map_err(|e: PassError| format!("error: {e}"))
}
