//! `megac run` and `megac train`: execute a plan and report.

use std::path::Path;

use megac_ir::gate::CheckedPlan;
use megac_runtime::train::{train, RunOptions, RunReport};

use crate::RunArgs;

/// What a build without MPI can do instead of `--comm mpi`.
#[cfg(not(feature = "mpi"))]
const NO_MPI_ALTERNATIVE: &str =
    "without MPI, --comm local runs every rank of the plan as a thread of this process";

/// `--device cuda` before any work: the first CUDA library (the driver, NVRTC, cuBLAS, and
/// NCCL when `nccl`) or device that is missing, as one error.
#[cfg(feature = "cuda")]
fn check_cuda(nccl: bool) -> Result<(), String> {
    megac_runtime::cuda::device::check_libraries(nccl)
        .and_then(|()| megac_runtime::cuda::probe(0))
        .map(|_| ())
        .map_err(|e| format!("error: --device cuda: {e}"))
}

/// `--device cuda`'s answer in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
fn check_cuda(_nccl: bool) -> Result<(), String> {
    Err(
        "error: --device cuda: this build has no `cuda` feature (cargo build --release --features \
         cuda); use --device cpu"
            .into(),
    )
}

/// Check the options this build supports and every path the run will write (before any
/// work: `megac train` calls it before compiling, `megac run` before reading the plan), and
/// turn them into runtime options.
fn options(args: &RunArgs) -> Result<RunOptions, String> {
    match args.comm.as_str() {
        "local" => {}
        #[cfg(feature = "mpi")]
        "mpi" | "nccl" => {}
        #[cfg(not(feature = "mpi"))]
        "mpi" => return Err(super::no_mpi("--comm mpi", Some(NO_MPI_ALTERNATIVE))),
        #[cfg(not(feature = "mpi"))]
        "nccl" => return Err(super::no_mpi("--comm nccl", None)),
        other => {
            return Err(format!(
                "error: --comm {other}: expected local, mpi or nccl"
            ))
        }
    }
    match args.device.as_str() {
        "cpu" if args.comm == "nccl" => {
            return Err(
                "error: --comm nccl: NCCL communicates between GPUs; use it with --device cuda \
                 (or --comm mpi with --device cpu)"
                    .into(),
            )
        }
        "cpu" => {}
        "cuda" if args.comm == "mpi" => {
            return Err(
                "error: --device cuda --comm mpi: the GPUs of an MPI job communicate through \
                 NCCL; use --comm nccl (megac launch -n N PLAN_DIR --device cuda --comm nccl)"
                    .into(),
            )
        }
        "cuda" => check_cuda(args.comm == "nccl")?,
        other => return Err(format!("error: --device {other}: expected cpu or cuda")),
    }
    let inject = args
        .inject
        .iter()
        .map(|s| megac_runtime::scan::Inject::parse(s).map_err(|e| format!("error: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let perturb = args
        .perturb
        .iter()
        .map(|s| {
            megac_runtime::perturb::TrainPerturbation::parse(s).map_err(|e| format!("error: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if args.steps == Some(0) {
        return Err("error: --steps 0: run at least one step".into());
    }
    // Rank 0 writes every output (on its node); the other ranks of an MPI job leave its
    // paths alone.
    if lead_process() {
        use super::output::{check_dir, check_file};
        if let Some(p) = &args.save_params {
            check_file("--save-params", p)?;
        }
        if let Some(p) = &args.report {
            check_file("--report", p)?;
        }
        if let Some(d) = &args.trace {
            check_dir("--trace", d)?;
        }
        if let Some(d) = &args.save {
            check_dir("--save", d)?;
        }
        if let Some(p) = &args.log {
            check_file("--log", p)?;
        }
    }
    if args.eval_interval == Some(0) {
        return Err("error: --eval-interval 0: evaluate every N >= 1 steps".into());
    }
    if args.eval_iters == Some(0) {
        return Err("error: --eval-iters 0: evaluate at least one batch".into());
    }
    if args.log_interval == Some(0) {
        return Err("error: --log-interval 0: log every N >= 1 steps".into());
    }
    if args.save_interval == Some(0) {
        return Err("error: --save-interval 0: checkpoint every N >= 1 steps".into());
    }
    match args.fusion.as_deref() {
        Some("on") if !cfg!(feature = "mlir") => {
            return Err(
                "error: --fusion on: fused kernels need a build with the `mlir` feature".into(),
            )
        }
        Some("on") => megac_runtime::fusion::set_enabled(true),
        Some(_) => megac_runtime::fusion::set_enabled(false),
        // The default: on in a build with the feature (`fusion::enabled` is false without).
        None => megac_runtime::fusion::set_enabled(true),
    }
    Ok(RunOptions {
        steps: args.steps,
        data: args.data.clone(),
        data_options: args.reading.options(),
        init: args.init.clone(),
        save_params: args.save_params.clone(),
        // `megac launch` asks for progress lines (the ranks' stderr is a pipe to mpirun).
        progress: progress_requested(args).then_some(true),
        profile: args.profile,
        trace: args.trace.clone(),
        save: args.save.clone(),
        save_interval: args.save_interval,
        save_async: args.save_async,
        load: args.load.clone(),
        trace_kernels: args.trace_kernels,
        inject,
        hf_config: None,
        perturb,
        perturb_seed: args.perturb_seed,
        eval: args
            .eval_data
            .as_ref()
            .map(|data| megac_runtime::eval::EvalOptions {
                data: data.clone(),
                interval: args.eval_interval,
                iters: args.eval_iters.unwrap_or(DEFAULT_EVAL_ITERS),
            }),
        log_interval: args.log_interval,
        // Under `megac launch` with a terminal, rank 0 prints progress lines already (its
        // stdout is a pipe to mpirun, which would otherwise ask for log lines as well).
        log_lines: progress_requested(args).then_some(false),
        log: args.log.clone(),
        deterministic: args.deterministic,
        scan: args.scan,
    })
}

/// Global batches per evaluation without `--eval-iters`.
const DEFAULT_EVAL_ITERS: u64 = 10;

/// Whether `megac launch` asked this rank for progress lines.
fn progress_requested(args: &RunArgs) -> bool {
    matches!(args.comm.as_str(), "mpi" | "nccl")
        && std::env::var_os("MEGAC_PROGRESS").is_some_and(|v| v == "1")
}

/// Whether this process is rank 0 of an MPI job (as mpirun tells it), or not in one.
fn lead_process() -> bool {
    std::env::var("OMPI_COMM_WORLD_RANK")
        .as_deref()
        .unwrap_or("0")
        == "0"
}

/// `megac train MODEL.toml`: check the options and output paths, compile, run.
pub fn train_model(model: &crate::ModelArgs, args: &RunArgs) -> Result<(), String> {
    let mut opts = options(args)?;
    // Activation perturbations are compiled into the plan (the `perturb` pass); weights are
    // perturbed by the runtime at their step.
    let instrument = megac_passes::Instrument {
        perturbations: opts.perturb.clone(),
        seed: opts.perturb_seed,
        train: true,
        ..Default::default()
    };
    let plan =
        super::compile::build_plan_with(model, megac_ir::plan::PlanKind::Train, &instrument)?;
    if opts.save.is_some() {
        let spec = super::load_spec(model)?;
        opts.hf_config = Some(megac_frontend::hf::export_config(&spec));
    }
    // The compiler's own plans pass the same gate as plan files.
    let plan = CheckedPlan::check(plan)
        .map_err(|e| format!("error: the compiled plan does not pass the plan gate: {e}"))?;
    execute(&plan, args, &opts)?;
    // Beside the saved weights, the config.json that makes transformers' from_pretrained
    // load the folder as the model's class (name the weights model.safetensors).
    if let (Some(p), true) = (&args.save_params, lead_process()) {
        let spec = super::load_spec(model)?;
        write_config_beside(p, &megac_frontend::hf::export_config(&spec))?;
    }
    Ok(())
}

/// Run `plan` with `args` (checked into `opts`), write the report, print a summary.
fn execute(plan: &CheckedPlan, args: &RunArgs, opts: &RunOptions) -> Result<(), String> {
    let named: Vec<(String, megac_runtime::scan::Inject)> = args
        .inject
        .iter()
        .cloned()
        .zip(opts.inject.iter().cloned())
        .collect();
    megac_runtime::scan::inject::check_ranks(&named, plan.mesh.world_size())
        .map_err(|e| format!("error: {e}"))?;
    if let Some(note) = super::lr_schedule_cut_short(
        plan.train.lr,
        &plan.train.lr_schedule,
        opts.steps.unwrap_or(plan.train.steps),
    ) {
        // Once per job: an MPI job's other ranks run the same plan.
        if lead_process() {
            eprintln!("note: {note}");
        }
    }
    let report = if args.comm == "nccl" {
        match train_on_nccl(plan, opts)? {
            Some(report) => report,
            None => return Ok(()), // ranks other than 0 print and write nothing
        }
    } else if args.comm == "mpi" {
        match train_on_mpi(plan, opts)? {
            Some(report) => report,
            None => return Ok(()), // ranks other than 0 print and write nothing
        }
    } else if args.device == "cuda" {
        train_on_cuda(plan, opts)?
    } else {
        train(plan, opts).map_err(|e| format!("error: {e}"))?
    };
    if let Some(path) = &args.report {
        super::output::write_file(path, &report.to_json())?;
    }
    if let Some((step, path, seconds)) = &report.resumed {
        println!(
            "resumed after step {step} from {} (loaded in {seconds:.3} s)",
            path.display()
        );
    }
    let (first, last) = (report.steps.first(), report.steps.last());
    let interval = args
        .log_interval
        .unwrap_or(megac_runtime::log::DEFAULT_LOG_INTERVAL);
    let tail = megac_runtime::log::last_interval(&report.steps, interval);
    if let (Some(a), Some(z), Some((from, to, mean))) = (first, last, tail) {
        // The final loss is the mean of the last log interval, not one step's.
        let over = if from == to {
            format!("step {to}")
        } else {
            format!("mean of steps {from}-{to}")
        };
        println!(
            "trained {} steps of {}: loss {:.4} -> {:.4} ({over}), grad norm {:.3}, {:.0} tokens/s, peak RSS {:.1} MiB",
            report.steps.len(),
            plan.model,
            a.loss,
            mean,
            z.grad_norm,
            report.tokens_per_s,
            report.peak_rss_bytes as f64 / (1u64 << 20) as f64
        );
        if let Some(scale) = z.loss_scale {
            let skipped = report.steps.iter().filter(|s| s.skipped).count();
            println!(
                "fp16 loss scale {}; {skipped} of {} steps skipped on overflow",
                megac_runtime::scaler::fmt_scale(scale),
                report.steps.len()
            );
        }
    }
    if let Some(m) = &report.device_memory {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        println!(
            "device memory: allocation {:.1} MiB; cudaMemGetInfo: {:.1} MiB held after setup, {:.1} MiB after the steps, of {:.1} MiB",
            mib(m.allocation_bytes),
            mib(m.setup_bytes),
            mib(m.after_steps_bytes),
            mib(m.total_bytes)
        );
    }
    if let Some(e) = report.evals.last() {
        println!(
            "eval loss {:.4} (perplexity {:.3}) after step {} on {} ({} batch{}; {} evaluation{})",
            e.loss,
            e.perplexity(),
            e.step,
            args.eval_data.as_deref().unwrap_or(""),
            e.batches,
            if e.batches == 1 { "" } else { "es" },
            report.evals.len(),
            if report.evals.len() == 1 { "" } else { "s" },
        );
    }
    if let (true, Some(profile)) = (args.profile, &report.profile) {
        print!("{}", profile.render());
    }
    if let Some(p) = &args.save_params {
        println!("saved parameters to {}", p.display());
    }
    if let Some(c) = report.checkpoints.last() {
        let n = report.checkpoints.len() as f64;
        let mean = |f: fn(&megac_runtime::checkpoint::SavedCheckpoint) -> f64| {
            report.checkpoints.iter().map(f).sum::<f64>() / n
        };
        println!(
            "saved {} checkpoint{}, the last {} ({:.1} MiB); per save {:.3} s, training waited {:.3} s",
            report.checkpoints.len(),
            if report.checkpoints.len() == 1 { "" } else { "s" },
            c.path.display(),
            c.bytes as f64 / (1u64 << 20) as f64,
            mean(|c| c.seconds),
            mean(|c| c.blocking_seconds),
        );
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
    Err(super::no_mpi("--comm mpi", Some(NO_MPI_ALTERNATIVE)))
}

/// Run `plan` as one process of an MPI job on its GPU, collectives through NCCL (`--device
/// cuda --comm nccl`); rank 0's report, None on the other ranks, errors as
/// [`train_on_mpi`].
#[cfg(all(feature = "mpi", feature = "cuda"))]
fn train_on_nccl(plan: &CheckedPlan, opts: &RunOptions) -> Result<Option<RunReport>, String> {
    use megac_runtime::mpi_comm;
    let result = megac_runtime::cuda::session::train_nccl(plan, opts);
    let rank = mpi_comm::world_rank().unwrap_or(0);
    match result {
        Ok(report) => Ok((rank == 0).then_some(report)),
        Err(e) if rank == 0 => Err(format!("error: {e}")),
        Err(_) if mpi_comm::error_on_every_rank() => std::process::exit(1),
        Err(e) => Err(format!("error: rank {rank}: {e}")),
    }
}

#[cfg(not(all(feature = "mpi", feature = "cuda")))]
fn train_on_nccl(_plan: &CheckedPlan, _opts: &RunOptions) -> Result<Option<RunReport>, String> {
    Err(super::no_mpi("--comm nccl", None))
}

/// Run a one-rank `plan` on GPU 0 (`--device cuda`, checked by [`options`]).
#[cfg(feature = "cuda")]
fn train_on_cuda(plan: &CheckedPlan, opts: &RunOptions) -> Result<RunReport, String> {
    megac_runtime::cuda::session::train(plan, opts).map_err(|e| format!("error: {e}"))
}

#[cfg(not(feature = "cuda"))]
fn train_on_cuda(_plan: &CheckedPlan, _opts: &RunOptions) -> Result<RunReport, String> {
    Err(check_cuda(false)
        .err()
        .unwrap_or_else(|| "error: --device cuda: no cuda feature".into()))
}

/// `megac run PLAN_DIR`.
pub fn run(dir: &Path, args: &RunArgs) -> Result<(), String> {
    if dir.is_file() {
        return Err(format!(
            "error: {0}: is a file; `megac run` takes a plan directory (written by `megac compile`)\n\
             help: to compile and train a model.toml in one go: megac train {0}",
            dir.display()
        ));
    }
    let mut opts = options(args)?;
    let plan = super::inspect::read_plan(dir)?;
    // The Hugging Face config `megac compile` wrote beside the plan: beside the saved
    // weights, and into every checkpoint.
    let config = dir.join("config.json");
    let hf_config = if config.is_file() && (args.save_params.is_some() || args.save.is_some()) {
        Some(
            megac_ir::file::read_text(&config, megac_ir::file::MAX_CONFIG_BYTES)
                .map_err(|e| format!("error: {}: {e}", config.display()))?,
        )
    } else {
        None
    };
    if opts.save.is_some() {
        opts.hf_config = hf_config.clone();
    }
    execute(&plan, args, &opts)?;
    if let (Some(p), true, Some(text)) = (&args.save_params, lead_process(), &hf_config) {
        write_config_beside(p, text)?;
    }
    Ok(())
}

/// Write the Hugging Face `config.json` in the folder of the saved weights `weights`.
fn write_config_beside(weights: &Path, text: &str) -> Result<(), String> {
    let dir = match weights.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let config = dir.join("config.json");
    super::output::write_file(&config, text)?;
    println!("wrote the Hugging Face config to {}", config.display());
    Ok(())
}
