//! A single-rank training loop on the cuda executor, driven like the cpu backend's
//! [`crate::train::Session`] (which it uses for the data, the initial parameters, the step's
//! learning rate and fp16's loss scaler): per step the gradients are zeroed, every
//! micro-batch's tokens are copied in and its program run, then the optimizer program.
//! [`train`] is `megac run/train --device cuda` (one rank), [`train_nccl`] one rank of
//! `megac launch --device cuda --comm nccl` (feature `mpi`): the cpu backend's progress
//! lines, log lines and report around [`CudaSession::step`]. Not run on a GPU yet.

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
        Self::with_comm(
            plan,
            data,
            init,
            Box::new(crate::comm::SingleRank),
            ordinal,
            None,
        )
    }

    /// The rank `comm` stands for on device `ordinal`: the cpu session over `comm` (data,
    /// initialisation, the loss's host reduction) and the GPU, with NCCL communicators
    /// from the world's unique id `id` when given ([`share_unique_id`]).
    pub fn with_comm(
        plan: &'p CheckedPlan,
        data: DataSource,
        init: Option<&std::path::Path>,
        comm: Box<dyn crate::comm::Communicator>,
        ordinal: usize,
        id: Option<&[u8; 128]>,
    ) -> Result<Self, CudaError> {
        super::device::check_libraries(id.is_some())?;
        let rank = comm.rank();
        let cpu = Session::with_source(plan, data, init, comm).map_err(cpu_err)?;
        let gpu = match id {
            Some(id) => CudaExecutor::with_nccl(plan, rank, ordinal, id)?,
            None => CudaExecutor::new(plan, rank, ordinal)?,
        };
        gpu.upload(&cpu.mem)?;
        Ok(CudaSession { cpu, gpu })
    }

    /// Forward and backward of micro-batch `mb` of 1-based `step` on the GPU (its tokens
    /// copied in, gradients accumulated); the micro-batch's share of the step loss.
    pub fn microbatch(&mut self, step: u64, mb: u64) -> Result<f64, CudaError> {
        let ctx = self.cpu.context(step);
        let (tokens, labels) = self.cpu.load(step, mb);
        if let Some(b) = self.cpu.tokens_buf {
            self.gpu.write_i32(b, &tokens)?;
        }
        if let Some(b) = self.cpu.labels_buf {
            self.gpu.write_i32(b, &labels)?;
        }
        self.gpu.run(Program::Microbatch, &ctx)?;
        match self.cpu.loss_buf {
            Some(b) => Ok(f64::from(self.gpu.read_f32(b)?[0])),
            None => Ok(0.0),
        }
    }

    /// One optimizer step (1-based) on the GPU: (loss, gradient norm). fp16's loss scaler
    /// moves as the cpu backend's does (halved on a non-finite norm).
    pub fn step(&mut self, step: u64) -> Result<(f64, f64), CudaError> {
        let plan = self.cpu.plan;
        self.gpu.zero_class(BufferClass::Grad)?;
        let ctx = self.cpu.context(step);
        let mut loss = 0.0;
        for mb in 0..plan.batch.microbatches {
            loss += self.microbatch(step, mb)?;
        }
        // The loss of data-parallel ranks is a pending sum: added up on the host, as the
        // cpu backend's.
        let loss = self.cpu.reduce_loss(loss).map_err(cpu_err)?;
        self.gpu.run(Program::Optimizer, &ctx)?;
        let role = self.cpu.role();
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

/// Check what `--device cuda` cannot run (before any work).
fn refuse(plan: &CheckedPlan, opts: &RunOptions) -> Result<(), RuntimeError> {
    crate::train::refuse_inference(plan)?;
    if let Some(o) = unsupported_option(opts) {
        return Err(RuntimeError::Unsupported(format!(
            "--device cuda does not support {o} yet; run without it, or with --device cpu"
        )));
    }
    Ok(())
}

/// `megac run/train --device cuda`: train a one-rank `plan` on GPU 0 with the cpu
/// backend's progress lines (stderr), log lines (stdout), `--log` file, `--save-params` and
/// report; the step time is the wall time of the step, synchronised with the GPU (the loss
/// and the norm are read back every step). The options [`unsupported_option`] names and
/// plans of more than one rank are refused with one error.
pub fn train(plan: &CheckedPlan, opts: &RunOptions) -> Result<RunReport, RuntimeError> {
    refuse(plan, opts)?;
    let world = plan.mesh.world_size();
    if world > 1 {
        return Err(RuntimeError::Unsupported(format!(
            "--device cuda: the plan has {world} ranks; run it with one process per rank and \
             GPU: megac launch -n {world} PLAN_DIR --device cuda --comm nccl"
        )));
    }
    let start_rss = crate::train::rss_bytes();
    let data = crate::train::open_data(plan, opts)?;
    let s = CudaSession::with_source(plan, data, opts.init.as_deref(), 0).map_err(cuda_err)?;
    let mut report = run(plan, opts, s, true)?;
    report.start_rss_bytes = start_rss;
    Ok(report)
}

/// Share rank 0's NCCL unique id (`mine` on rank 0: its [`super::nccl::unique_id`]; None
/// elsewhere) with every rank of `comm`, through the communicator's f64 all-reduce (the
/// 128 bytes and a flag, zeros on the other ranks: exact integer sums). Every rank returns
/// the same id, or the same error when rank 0 had none.
pub fn share_unique_id(
    comm: &mut dyn crate::comm::Communicator,
    mine: Option<Result<[u8; 128], CudaError>>,
) -> Result<[u8; 128], RuntimeError> {
    let mut buf = [0f64; 129];
    let mut failed = None;
    match mine {
        Some(Ok(id)) => {
            buf[0] = 1.0;
            for (x, b) in buf[1..].iter_mut().zip(id) {
                *x = f64::from(b);
            }
        }
        Some(Err(e)) => failed = Some(e.to_string()),
        None => {}
    }
    let everyone: Vec<usize> = (0..comm.size()).collect();
    comm.all_reduce_sum_f64(&everyone, &mut buf)?;
    if buf[0] != 1.0 {
        return Err(RuntimeError::Unsupported(format!(
            "--comm nccl: rank 0 could not make an NCCL unique id{}",
            failed.map_or(String::new(), |e| format!(": {e}"))
        )));
    }
    let mut id = [0u8; 128];
    for (b, &x) in id.iter_mut().zip(&buf[1..]) {
        *b = x as u8;
    }
    Ok(id)
}

/// This process's GPU under a launcher: its node-local rank (OpenMPI, MPICH, Slurm), 0
/// without one.
pub fn local_ordinal() -> usize {
    [
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "SLURM_LOCALID",
    ]
    .iter()
    .find_map(|v| std::env::var(v).ok()?.parse().ok())
    .unwrap_or(0)
}

/// `megac launch -n N PLAN --device cuda --comm nccl` (each rank runs `megac run --comm
/// nccl`): this process is one rank of an MPI job on its node-local GPU; MPI carries rank
/// 0's NCCL unique id to every rank ([`share_unique_id`]) and the host reductions (the
/// loss), NCCL the plan's collectives. Rank 0's report (every rank's losses and norms are
/// the same). Not run on hardware.
#[cfg(feature = "mpi")]
pub fn train_nccl(plan: &CheckedPlan, opts: &RunOptions) -> Result<RunReport, RuntimeError> {
    use crate::comm::Communicator as _;
    refuse(plan, opts)?;
    let start_rss = crate::train::rss_bytes();
    let world = plan.mesh.world_size();
    if world > 1 && !crate::mpi_comm::started_by_launcher() {
        return Err(RuntimeError::Unsupported(format!(
            "--comm nccl: the plan has {world} ranks but this process was not started by \
             mpirun; run `megac launch -n {world} PLAN_DIR --device cuda --comm nccl`"
        )));
    }
    crate::mpi_comm::in_universe("--comm nccl", |universe| {
        let mut comm = crate::mpi_comm::MpiComm::new(universe.world())?;
        if comm.size() != world {
            crate::mpi_comm::set_error_on_every_rank();
            return Err(RuntimeError::Unsupported(format!(
                "the plan has {world} ranks but mpirun started {} processes; launch it with \
                 `megac launch -n {world}`",
                comm.size()
            )));
        }
        let rank = comm.rank();
        let mine = (rank == 0).then(super::nccl::unique_id);
        let id = share_unique_id(&mut comm, mine)?;
        let data = crate::train::open_data(plan, opts)?;
        let s = CudaSession::with_comm(
            plan,
            data,
            opts.init.as_deref(),
            Box::new(comm),
            local_ordinal(),
            Some(&id),
        )
        .map_err(cuda_err)?;
        let mut report = run(plan, opts, s, rank == 0)?;
        report.start_rss_bytes = start_rss;
        Ok(report)
    })
}

/// The training loop around a session; `lead` (rank 0) prints and logs.
fn run(
    plan: &CheckedPlan,
    opts: &RunOptions,
    mut s: CudaSession<'_>,
    lead: bool,
) -> Result<RunReport, RuntimeError> {
    let steps = opts.steps.unwrap_or(plan.train.steps);
    let b = &plan.batch;
    let progress = lead
        && opts
            .progress
            .unwrap_or_else(|| std::io::stderr().is_terminal());
    let mut log = if lead {
        Some(opts.run_log(steps, b.tokens_per_step)?)
    } else {
        None
    };
    let (setup_bytes, _) = s.gpu.held_bytes().map_err(cuda_err)?;
    let mut records = Vec::new();
    let start = Instant::now();
    for step in 1..=steps {
        // As the cpu backend: the first step warms up, the profile starts at the second.
        if opts.profile && step == 2.min(steps) {
            s.gpu.enable_profile();
        }
        let t0 = Instant::now();
        let loss_scale = s.cpu.scaler.as_ref().map(|x| x.scale());
        let (loss, grad_norm) = s.step(step).map_err(cuda_err)?;
        // As the cpu backend: an fp16 overflow skips the step; anything else non-finite
        // stops the run.
        let skipped = crate::train::check_step(
            plan,
            step,
            loss,
            grad_norm,
            s.cpu.scaler.as_ref(),
            loss_scale,
        )?;
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
        if let (Some(log), Some(r)) = (&mut log, records.last()) {
            log.step(r, elapsed, step)?;
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let (after_steps_bytes, total_bytes) = s.gpu.held_bytes().map_err(cuda_err)?;
    let device_memory = Some(crate::train::DeviceMemory {
        allocation_bytes: s.gpu.device_bytes(),
        setup_bytes,
        after_steps_bytes,
        total_bytes,
    });
    if let Some(path) = &opts.save_params {
        // A collective over the ranks (the global tensors); rank 0 writes.
        s.download().map_err(cuda_err)?;
        s.cpu.save_params(path)?;
    }
    Ok(RunReport {
        tokens_per_s: (steps * b.tokens_per_step) as f64 / elapsed.max(1e-9),
        steps: records,
        peak_rss_bytes: crate::train::peak_rss_bytes(),
        start_rss_bytes: 0,
        peak_rss_bytes_per_rank: Vec::new(),
        arena_bytes: s.cpu.mem.bytes(),
        profile: s.gpu.profile(),
        pipeline_order: Vec::new(),
        checkpoints: Vec::new(),
        resumed: None,
        evals: Vec::new(),
        device_memory,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_the_cuda_loop_does_not_run_are_named() {
        assert_eq!(unsupported_option(&RunOptions::default()), None);
        let o = RunOptions {
            trace: Some("t".into()),
            ..Default::default()
        };
        assert_eq!(unsupported_option(&o), Some("--trace"));
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

    #[test]
    fn every_rank_gets_rank_0s_unique_id_or_the_same_error() {
        let id: [u8; 128] = std::array::from_fn(|i| (i * 37 % 256) as u8);
        let got = crate::local_comm::run_ranks(4, |mut comm| {
            use crate::comm::Communicator as _;
            let mine = (comm.rank() == 0).then_some(Ok(id));
            share_unique_id(&mut comm, mine)
        })
        .unwrap();
        assert!(got.iter().all(|g| *g == id), "every rank has rank 0's id");
        let errs = crate::local_comm::run_ranks(3, |mut comm| {
            use crate::comm::Communicator as _;
            let mine = (comm.rank() == 0).then(|| Err(CudaError::Driver("no NCCL".into())));
            Ok(share_unique_id(&mut comm, mine).unwrap_err().to_string())
        })
        .unwrap();
        assert!(errs[0].contains("no NCCL"), "{errs:?}");
        assert!(errs
            .iter()
            .all(|e| e.contains("could not make an NCCL unique id")));
    }
}
