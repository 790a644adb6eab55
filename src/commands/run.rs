//! `megac run` and `megac train`: execute a plan and report.

use std::path::{Path, PathBuf};

use megac_ir::plan::Plan;
use megac_runtime::train::{train, RunOptions};

use crate::RunArgs;

/// Check the options this build supports and turn them into runtime options.
fn options(args: &RunArgs) -> Result<RunOptions, String> {
    match args.comm.as_str() {
        "local" => {}
        "mpi" => return Err("error: --comm mpi: this build has no MPI communicator yet (it comes with multi-process runs); use --comm local".into()),
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
        progress: None,
        profile: args.profile,
        trace: args.trace.clone(),
    })
}

/// Run `plan` with `args`, write the report, print a summary.
pub fn execute(plan: &Plan, args: &RunArgs) -> Result<(), String> {
    let opts = options(args)?;
    let report = train(plan, &opts).map_err(|e| format!("error: {e}"))?;
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
