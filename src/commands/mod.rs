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

/// The one error of `--comm mpi` and `megac launch` in a build without the `mpi` feature
/// (off by default, so that the default build needs only the Rust toolchain): how to get a
/// build with MPI, and `alternative` (a further `help:` line) when there is one.
pub fn no_mpi(what: &str, alternative: Option<&str>) -> String {
    let mut message = format!(
        "error: {what}: this megac was built without MPI (the cargo feature `mpi` is off by default)\n\
         help: to run with MPI, install OpenMPI and libclang, then build with the feature:\n    \
         apt-get install --no-install-recommends libopenmpi-dev openmpi-bin libclang-dev\n    \
         cargo build --release --features mpi\n"
    );
    if let Some(alternative) = alternative {
        message.push_str(&format!("help: {alternative}\n"));
    }
    message
}

/// Load and validate the model, rendering any error for the terminal.
pub fn load_spec(args: &ModelArgs) -> Result<ModelSpec, String> {
    megac_frontend::load(&args.model, &args.sets).map_err(|e| e.render())
}

/// Run the pass pipeline (verifying after each pass) up to `after`.
pub fn compile(spec: ModelSpec, after: Option<&str>) -> Result<Module, String> {
    megac_passes::run_pipeline(spec, after, true).map_err(|e: PassError| format!("error: {e}"))
}
