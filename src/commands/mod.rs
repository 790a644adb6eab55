//! One module per subcommand. Each `run` returns the rendered error message on failure.

pub mod check;
pub mod check_plan;
pub mod checkpoint;
pub mod compile;
pub mod dump;
pub mod eval;
pub mod generate;
pub mod import_hf;
pub mod inspect;
pub mod launch;
pub mod output;
pub mod passes;
pub mod plan;
pub mod run;
pub mod scan;
pub mod schedule;
pub mod scope;
pub mod scope_serve;
pub mod scope_view;
pub mod simulate;

use megac_ir::plan::LrSchedule;
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

/// The learning-rate schedule in words, e.g. `cosine: warmup from 0 to 0.001 over 10 steps,
/// then decay to 0.0001 at step 200` (`megac check`).
pub fn lr_schedule_text(lr: f64, schedule: &LrSchedule) -> String {
    match schedule {
        LrSchedule::Constant => format!("constant {lr}"),
        LrSchedule::Cosine {
            warmup_steps,
            decay_steps,
            min_lr,
        } => {
            let warmup = match warmup_steps {
                0 => format!("no warmup, {lr} at step 1"),
                w => format!("warmup from 0 to {lr} over {w} step{}", plural(*w)),
            };
            format!("cosine: {warmup}, then decay to {min_lr} at step {decay_steps}")
        }
    }
}

/// One line when a run of `steps` steps stops before its learning-rate schedule ends (in its
/// warmup, or before the decay reaches `min_lr`): the schedule it will actually follow.
pub fn lr_schedule_cut_short(lr: f64, schedule: &LrSchedule, steps: u64) -> Option<String> {
    let LrSchedule::Cosine {
        warmup_steps,
        decay_steps,
        min_lr,
    } = schedule
    else {
        return None;
    };
    if steps >= *decay_steps {
        return None;
    }
    let last = schedule.lr_at(lr, steps);
    let planned = format!("decay to {min_lr} at step {decay_steps}");
    Some(if steps <= *warmup_steps {
        format!(
            "the run stops at step {steps}, inside the lr warmup ({warmup_steps} steps): \
             the lr rises from 0 to {last:.3e} and never decays (the schedule's {planned})"
        )
    } else {
        format!(
            "the run stops at step {steps}, before the lr schedule ends: it follows the \
             warmup ({warmup_steps} step{}) and the cosine decay down to lr {last:.3e} at step \
             {steps}, not the schedule's {planned}",
            plural(*warmup_steps)
        )
    })
}

fn plural(n: u64) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}
