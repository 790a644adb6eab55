//! A single-rank training loop on the cuda executor, driven like the cpu backend's
//! [`crate::train::Session`] (which it uses for the data, the initial parameters, the step's
//! learning rate and fp16's loss scaler): per step the gradients are zeroed, every
//! micro-batch's tokens are copied in and its program run, then the optimizer program.
//! [`train`] is `megac run/train --device cuda`: the cpu backend's progress lines, log lines
//! and report around [`CudaSession::step`]. Not run on a GPU yet.

use std::io::IsTerminal;
use std::time::Instant;

use megac_ir::gate::CheckedPlan;
use megac_ir::plan::BufferClass;

use super::device::{CudaExecutor, Program};
use super::CudaError;
use crate::data::DataSource;
use crate::error::RuntimeError;
use crate::train::{RunOptions, RunReport, Session, StepRecord};

/// A cpu session (data, initialisation) and the GPU state of its one rank.
pub struct CudaSession<'p> {
    /// The cpu session: the data source, the initialised parameters, the loss scaler.
    pub cpu: Session<'p>,
    /// The GPU.
    pub gpu: CudaExecutor,
}

fn cpu_err(e: RuntimeError) -> CudaError {
    CudaError::Unsupported(e.to_string())
}

impl<'p> CudaSession<'p> {
    /// Open the data, initialise the parameters on the host, set up the GPU and upload them.
    pub fn new(plan: &'p CheckedPlan, data: &str, ordinal: usize) -> Result<Self, CudaError> {
        let b = &plan.batch;
        let data = DataSource::open(data, b.seq_len as usize, b.vocab as u32, plan.train.seed)
            .map_err(cpu_err)?;
        Self::with_source(plan, data, None, ordinal)
    }

    /// As [`CudaSession::new`] with the data already open and optional initial weights
    /// (Hugging Face safetensors). The libraries are checked before anything else.
    pub fn with_source(
        plan: &'p CheckedPlan,
        data: DataSource,
        init: Option<&std::path::Path>,
        ordinal: usize,
    ) -> Result<Self, CudaError> {
        super::device::check_libraries(plan.mesh.world_size() > 1)?;
        let cpu = Session::with_source(plan, data, init, Box::new(crate::comm::SingleRank))
            .map_err(cpu_err)?;
        let gpu = CudaExecutor::new(plan, 0, ordinal)?;
        gpu.upload(&cpu.mem)?;
        Ok(CudaSession { cpu, gpu })
    }

    /// One optimizer step (1-based) on the GPU: (loss, gradient norm). fp16's loss scaler
    /// moves as the cpu backend's does (halved on a non-finite norm).
    pub fn step(&mut self, step: u64) -> Result<(f64, f64), CudaError> {
        let plan = self.cpu.plan;
        self.gpu.zero_class(BufferClass::Grad)?;
        let ctx = self.cpu.context(step);
        let mut loss = 0.0;
        for mb in 0..plan.batch.microbatches {
            let (tokens, labels) = self.cpu.load(step, mb);
            if let Some(b) = self.cpu.tokens_buf {
                self.gpu.write_i32(b, &tokens)?;
            }
            if let Some(b) = self.cpu.labels_buf {
                self.gpu.write_i32(b, &labels)?;
            }
            self.gpu.run(Program::Microbatch, &ctx)?;
            if let Some(b) = self.cpu.loss_buf {
                loss += f64::from(self.gpu.read_f32(b)?[0]);
            }
        }
        self.gpu.run(Program::Optimizer, &ctx)?;
        let role = &plan.roles[plan.rank_to_role[0] as usize];
        let norm = match role.results.get("grad_norm") {
            Some(&b) => f64::from(self.gpu.read_f32(b)?[0]),
            None => 0.0,
        };
        if let Some(s) = &mut self.cpu.scaler {
            s.update(!norm.is_finite());
        }
        Ok((loss, norm))
    }

    /// Bring the parameters and optimizer state (master weights) back into the cpu
    /// session's memory.
    pub fn download(&mut self) -> Result<(), CudaError> {
        self.gpu.download(
            &mut self.cpu.mem,
            &[BufferClass::Param, BufferClass::OptState],
        )
    }
}

/// The first option of `opts` that `--device cuda` does not support yet, if any.
pub fn unsupported_option(opts: &RunOptions) -> Option<&'static str> {
    [
        (opts.profile, "--profile"),
        (opts.trace.is_some(), "--trace"),
        (opts.save.is_some(), "--save"),
        (opts.load.is_some(), "--load"),
        (opts.eval.is_some(), "--eval-data"),
        (!opts.perturb.is_empty(), "--perturb"),
        (!opts.inject.is_empty(), "--inject"),
        (opts.scan, "--scan"),
    ]
    .into_iter()
    .find_map(|(on, name)| on.then_some(name))
}

fn cuda_err(e: CudaError) -> RuntimeError {
    RuntimeError::Unsupported(format!("--device cuda: {e}"))
}

/// `megac run/train --device cuda`: train a one-rank `plan` on GPU 0 with the cpu
/// backend's progress lines (stderr), log lines (stdout), `--log` file, `--save-params` and
/// report; the step time is the wall time of the step, synchronised with the GPU (the loss
/// and the norm are read back every step). The options [`unsupported_option`] names and
/// plans of more than one rank are refused with one error.
pub fn train(plan: &CheckedPlan, opts: &RunOptions) -> Result<RunReport, RuntimeError> {
    crate::train::refuse_inference(plan)?;
    if let Some(o) = unsupported_option(opts) {
        return Err(RuntimeError::Unsupported(format!(
            "--device cuda does not support {o} yet; run without it, or with --device cpu"
        )));
    }
    let world = plan.mesh.world_size();
    if world > 1 {
        return Err(RuntimeError::Unsupported(format!(
            "--device cuda: the plan has {world} ranks; the cuda backend runs one-rank plans \
             only (NCCL communicators over MPI are not built yet); use --device cpu"
        )));
    }
    let start_rss = crate::train::rss_bytes();
    let data = crate::train::open_data(plan, opts)?;
    let steps = opts.steps.unwrap_or(plan.train.steps);
    let b = &plan.batch;
    let mut s = CudaSession::with_source(plan, data, opts.init.as_deref(), 0).map_err(cuda_err)?;
    let progress = opts
        .progress
        .unwrap_or_else(|| std::io::stderr().is_terminal());
    let mut log = crate::log::RunLog::new(
        opts.log_interval
            .unwrap_or(crate::log::DEFAULT_LOG_INTERVAL),
        opts.log_lines
            .unwrap_or_else(|| !std::io::stdout().is_terminal()),
        opts.log.as_deref(),
        steps,
        b.tokens_per_step,
    )?;
    let mut records = Vec::new();
    let start = Instant::now();
    for step in 1..=steps {
        let t0 = Instant::now();
        let loss_scale = s.cpu.scaler.as_ref().map(|x| x.scale());
        let (loss, grad_norm) = s.step(step).map_err(cuda_err)?;
        // As the cpu backend: an fp16 overflow skips the step; anything else non-finite
        // stops the run.
        let skipped = loss_scale.is_some() && !grad_norm.is_finite() && loss.is_finite();
        let stuck = s
            .cpu
            .scaler
            .as_ref()
            .zip(loss_scale)
            .is_some_and(|(sc, before)| {
                skipped
                    && sc.scale() == before
                    && plan
                        .train
                        .loss_scaler
                        .is_some_and(|c| c.fixed || before <= c.min_scale)
            });
        if !skipped || stuck {
            crate::train::check_finite(plan, step, loss, grad_norm)?;
        }
        let seconds = t0.elapsed().as_secs_f64();
        records.push(StepRecord {
            step,
            loss,
            grad_norm,
            lr: plan.train.lr_schedule.lr_at(plan.train.lr, step),
            seconds,
            loss_scale,
            skipped,
        });
        let elapsed = start.elapsed().as_secs_f64();
        if progress {
            crate::train::print_progress(
                plan,
                (step, steps, 0),
                elapsed,
                (loss, grad_norm),
                loss_scale,
                skipped,
            );
        }
        if let Some(r) = records.last() {
            log.step(r, elapsed, step)?;
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    if let Some(path) = &opts.save_params {
        s.download().map_err(cuda_err)?;
        s.cpu.save_params(path)?;
    }
    Ok(RunReport {
        tokens_per_s: (steps * b.tokens_per_step) as f64 / elapsed.max(1e-9),
        steps: records,
        peak_rss_bytes: crate::train::peak_rss_bytes(),
        start_rss_bytes: start_rss,
        peak_rss_bytes_per_rank: Vec::new(),
        arena_bytes: s.cpu.mem.bytes(),
        profile: None,
        pipeline_order: Vec::new(),
        checkpoints: Vec::new(),
        resumed: None,
        evals: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_the_cuda_loop_does_not_run_are_named() {
        assert_eq!(unsupported_option(&RunOptions::default()), None);
        let o = RunOptions {
            profile: true,
            ..Default::default()
        };
        assert_eq!(unsupported_option(&o), Some("--profile"));
        let o = RunOptions {
            save: Some("x".into()),
            ..Default::default()
        };
        assert_eq!(unsupported_option(&o), Some("--save"));
        let o = RunOptions {
            scan: true,
            ..Default::default()
        };
        assert_eq!(unsupported_option(&o), Some("--scan"));
    }
}
