//! `megac run` and `megac train`: execute a plan and report.

use std::path::{Path, PathBuf};

use megac_ir::gate::CheckedPlan;
use megac_runtime::train::{train, RunOptions, RunReport};

use crate::RunArgs;

/// Check the options this build supports and turn them into runtime options.
fn options(args: &RunArgs) -> Result<RunOptions, String> {
    match args.comm.as_str() {
        "local" => {}
        #[cfg(feature = "mpi")]
        "mpi" => {}
        #[cfg(not(feature = "mpi"))]
        "mpi" => return Err("error: --comm mpi: this megac was built without MPI (cargo feature `mpi`, which needs OpenMPI: apt-get install libopenmpi-dev openmpi-bin); use --comm local".into()),
        other => return Err(format!("error: --comm {other}: expected local or mpi")),
    }
    match args.device.as_str() {
        "cpu" => {}
        "cuda" => {
            return Err(
                "error: --device cuda: this build has no cuda backend yet; use --device cpu".into(),
            )
        }
        other => return Err(format!("error: --device {other}: expected cpu or cuda")),
    }
    if args.steps == Some(0) {
        return Err("error: --steps 0: run at least one step".into());
    }
    Ok(RunOptions {
        steps: args.steps,
        data: args.data.clone(),
        init: args.init.clone(),
        save_params: args.save_params.clone(),
        // `megac launch` asks for progress lines (the ranks' stderr is a pipe to mpirun).
        progress: (args.comm == "mpi"
            && std::env::var_os("MEGAC_PROGRESS").is_some_and(|v| v == "1"))
        .then_some(true),
        profile: args.profile,
        trace: args.trace.clone(),
    })
}

/// Run `plan` with `args`, write the report, print a summary.
pub fn execute(plan: &CheckedPlan, args: &RunArgs) -> Result<(), String> {
    let opts = options(args)?;
    let report = if args.comm == "mpi" {
        match train_on_mpi(plan, &opts)? {
            Some(report) => report,
            None => return Ok(()), // ranks other than 0 print and write nothing
        }
    } else {
        train(plan, &opts).map_err(|e| format!("error: {e}"))?
    };
    if let Some(path) = &args.report {
        write_atomically(path, &report.to_json())?;
    }
    let (first, last) = (report.steps.first(), report.steps.last());
    if let (Some(a), Some(z)) = (first, last) {
        println!(
            "trained {} steps of {}: loss {:.4} -> {:.4}, grad norm {:.3}, {:.0} tokens/s, peak RSS {:.1} MiB",
            report.steps.len(),
            plan.model,
            a.loss,
            z.loss,
            z.grad_norm,
            report.tokens_per_s,
            report.peak_rss_bytes as f64 / (1u64 << 20) as f64
        );
    }
    if let (true, Some(profile)) = (args.profile, &report.profile) {
        print!("{}", profile.render());
    }
    if let Some(p) = &args.save_params {
        println!("saved parameters to {}", p.display());
    }
    Ok(())
}

/// Run `plan` as one process of an MPI job; rank 0's report, None on the other ranks. An
/// error on a rank other than 0 names the rank (and is left to rank 0 when every rank has it).
#[cfg(feature = "mpi")]
fn train_on_mpi(plan: &CheckedPlan, opts: &RunOptions) -> Result<Option<RunReport>, String> {
    use megac_runtime::mpi_comm;
    let result = megac_runtime::train::train_mpi(plan, opts);
    let rank = mpi_comm::world_rank().unwrap_or(0);
    match result {
        Ok(report) => Ok((rank == 0).then_some(report)),
        Err(e) if rank == 0 => Err(format!("error: {e}")),
        // main prints a message and exits 1; an empty one would print an empty line.
        Err(_) if mpi_comm::error_on_every_rank() => std::process::exit(1),
        Err(e) => Err(format!("error: rank {rank}: {e}")),
    }
}

#[cfg(not(feature = "mpi"))]
fn train_on_mpi(_plan: &CheckedPlan, _opts: &RunOptions) -> Result<Option<RunReport>, String> {
    Err("error: --comm mpi: this megac was built without MPI".to_string())
}

/// Write `text` to `path` via a temporary file, so no half-written file is left behind.
pub fn write_atomically(path: &Path, text: &str) -> Result<(), String> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| format!("error: {}: not a file path", path.display()))?;
    let tmp: PathBuf = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    let result = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, path));
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("error: {}: cannot write: {e}", path.display())
    })
}

/// `megac run PLAN_DIR`.
pub fn run(dir: &Path, args: &RunArgs) -> Result<(), String> {
    let plan = super::inspect::read_plan(dir)?;
    execute(&plan, args)
}
