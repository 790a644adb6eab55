//! The training loop of one rank: data, micro-batches, optimizer steps, progress and report.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use megac_ir::gate::CheckedPlan;
use megac_ir::plan::Plan;

use crate::data::DataSource;
use crate::error::RuntimeError;
use crate::exec::{run_program, StepContext};
use crate::memory::Memory;
use crate::{hf, init};

/// How to run a plan (`megac run` options).
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Steps to run; the plan's `train.steps` when None.
    pub steps: Option<u64>,
    /// `synthetic`, a `.bin` / `.txt` / `.jsonl` file, a Megatron prefix or blend.
    pub data: String,
    /// How to read `data`: the tokenizer, Megatron's split (`samples` is set by [`train`]:
    /// the run's steps times the global batch).
    pub data_options: crate::data::DataOptions,
    /// Initial weights (Hugging Face safetensors).
    pub init: Option<PathBuf>,
    /// Where to write the trained weights (Hugging Face safetensors).
    pub save_params: Option<PathBuf>,
    /// Print a progress line per step (on by default when stderr is a terminal).
    pub progress: Option<bool>,
    /// Time every kernel (after the first step, which warms up) and report by op.
    pub profile: bool,
    /// Write every rank's event record (`rank-N.json`, for `megac scan`) to this directory.
    pub trace: Option<PathBuf>,
    /// Write distributed checkpoints into this folder (`DIR/step-NNNNNN/`, `DIR/latest`).
    pub save: Option<PathBuf>,
    /// Checkpoint every this many steps (and after the last); None: after the last only.
    pub save_interval: Option<u64>,
    /// Write checkpoints in the background: snapshot to host memory, write in a thread,
    /// complete at the next save or after the last step.
    pub save_async: bool,
    /// Resume from this checkpoint (a checkpoint folder's latest complete step, or a step
    /// folder); `steps` stays the total.
    pub load: Option<PathBuf>,
    /// With `trace`: also time every kernel and write rank 0's Chrome-trace timeline of them
    /// (`rank-0.trace.json`; costs more than the event records).
    pub trace_kernels: bool,
    /// Injected faults (`--inject`): timing only, never numbers.
    pub inject: Vec<crate::scan::Inject>,
    /// The model's Hugging Face `config.json` text: with `save`, written into every
    /// checkpoint (for `megac checkpoint export`).
    pub hf_config: Option<String>,
    /// Perturbations of activations or weights (`--perturb`; `crate::perturb`).
    pub perturb: Vec<crate::perturb::TrainPerturbation>,
    /// Seed of the perturbations' random numbers.
    pub perturb_seed: u64,
    /// Held-out evaluation (`--eval-data`, `--eval-interval`, `--eval-iters`).
    pub eval: Option<crate::eval::EvalOptions>,
    /// Steps per log line and per interval of the summary's mean loss (None: 10).
    pub log_interval: Option<u64>,
    /// Print a log line every `log_interval` steps on stdout (None: when stdout is not a
    /// terminal).
    pub log_lines: Option<bool>,
    /// Write one JSON object per step and per evaluation to this file (`--log FILE.jsonl`).
    pub log: Option<PathBuf>,
    /// `--deterministic`: over MPI, reduce in group order, bit-identical to local threads
    /// (otherwise MPI's native collectives). The local communicator is deterministic anyway.
    pub deterministic: bool,
    /// `--scan`: detect slow ranks and links while training (rank 0 prints a warning line
    /// per finding; see [`crate::scan::online`]).
    pub scan: bool,
}

impl RunOptions {
    /// The lead rank's run log (log lines, `--log`) for a run of `steps` steps: the
    /// options' interval, log lines by default when stdout is not a terminal.
    pub(crate) fn run_log(
        &self,
        steps: u64,
        tokens_per_step: u64,
    ) -> Result<crate::log::RunLog, RuntimeError> {
        crate::log::RunLog::new(
            self.log_interval
                .unwrap_or(crate::log::DEFAULT_LOG_INTERVAL),
            self.log_lines
                .unwrap_or_else(|| !std::io::stdout().is_terminal()),
            self.log.as_deref(),
            steps,
            tokens_per_step,
        )
    }
}

/// One step of the report.
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    /// 1-based step.
    pub step: u64,
    /// Mean cross-entropy of the step's forward pass (before its update).
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// The learning rate of the step (the plan's schedule at this step).
    pub lr: f64,
    /// Wall time of the step.
    pub seconds: f64,
    /// fp16: the loss scale the step ran with (None in other precisions).
    pub loss_scale: Option<f64>,
    /// fp16: the gradients overflowed and the update was skipped.
    pub skipped: bool,
}

/// A GPU rank's device memory (`--device cuda`), as `cudaMemGetInfo` sees it, to hold
/// against the plan's arenas (`megac inspect`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes of the one allocation: the plan's arenas, 256-byte aligned, the 16-bit
    /// operands' staging and the kernels' workspace.
    pub allocation_bytes: u64,
    /// Free device memory lost from just after the context was made to the end of the setup:
    /// the allocation, the kernels' modules, cuBLAS's and NCCL's memory.
    pub setup_bytes: u64,
    /// The same after the last step: more than `setup_bytes` if anything (cuBLAS's
    /// workspace, at its first GEMM) allocated during the steps.
    pub after_steps_bytes: u64,
    /// The device's memory.
    pub total_bytes: u64,
}

/// What a run produced.
#[derive(Clone, Debug, PartialEq)]
pub struct RunReport {
    /// Per-step records.
    pub steps: Vec<StepRecord>,
    /// Training tokens per second over the whole run.
    pub tokens_per_s: f64,
    /// Peak resident memory of the process (of the largest rank in an MPI run).
    pub peak_rss_bytes: u64,
    /// Peak resident memory of every rank's process in an MPI run (empty otherwise).
    pub peak_rss_bytes_per_rank: Vec<u64>,
    /// Resident memory of this process when the run started, before any rank allocated its
    /// arenas (the binary, its libraries, the plan): `peak_rss_bytes` less this is what the
    /// run itself took.
    pub start_rss_bytes: u64,
    /// Bytes of each arena: params, grads, optimizer state, activations, inputs.
    pub arena_bytes: [u64; 5],
    /// Per-op timings (with `profile`).
    pub profile: Option<crate::exec::Profile>,
    /// Pipelined plans: the actions this rank ran in its last step, in order (`F0.3` is the
    /// forward of chunk 0 for micro-batch 3); with `dpp` the order the run chose.
    pub pipeline_order: Vec<String>,
    /// The checkpoints written (`--save`), in order.
    pub checkpoints: Vec<crate::checkpoint::SavedCheckpoint>,
    /// `--load`: the step resumed after, the step folder, and the seconds this rank took to
    /// load its shards (after the checkpoint was verified).
    pub resumed: Option<(u64, PathBuf, f64)>,
    /// The evaluations (`--eval-data`), in order.
    pub evals: Vec<crate::eval::EvalRecord>,
    /// `--device cuda`: rank 0's device memory.
    pub device_memory: Option<DeviceMemory>,
}

impl RunReport {
    /// The `--report` JSON of DESIGN.md.
    pub fn to_json(&self) -> String {
        let steps: Vec<serde_json::Value> = self
            .steps
            .iter()
            .map(|s| {
                let mut j = serde_json::json!({
                    "step": s.step, "loss": s.loss, "grad_norm": s.grad_norm, "lr": s.lr,
                    "seconds": s.seconds
                });
                if let Some(scale) = s.loss_scale {
                    j["loss_scale"] = serde_json::json!(scale);
                    j["skipped"] = serde_json::json!(s.skipped);
                }
                j
            })
            .collect();
        let mut v = serde_json::json!({
            "steps": steps,
            "tokens_per_s": self.tokens_per_s,
            "peak_rss_bytes": self.peak_rss_bytes,
            "start_rss_bytes": self.start_rss_bytes,
            "memory_bytes": {
                "parameters": self.arena_bytes[0],
                "gradients": self.arena_bytes[1],
                "optimizer_state": self.arena_bytes[2],
                "activations": self.arena_bytes[3],
                "inputs": self.arena_bytes[4],
            },
        });
        if let Some(m) = &self.device_memory {
            v["device_memory"] = serde_json::json!({
                "allocation_bytes": m.allocation_bytes,
                "setup_bytes": m.setup_bytes,
                "after_steps_bytes": m.after_steps_bytes,
                "total_bytes": m.total_bytes,
            });
        }
        if !self.peak_rss_bytes_per_rank.is_empty() {
            v["peak_rss_bytes_per_rank"] = serde_json::json!(self.peak_rss_bytes_per_rank);
        }
        if !self.pipeline_order.is_empty() {
            v["pipeline_order"] = serde_json::json!(self.pipeline_order);
        }
        if let Some((step, path, seconds)) = &self.resumed {
            v["resumed"] = serde_json::json!({
                "step": step,
                "path": path.display().to_string(),
                "load_seconds": seconds,
            });
        }
        if !self.checkpoints.is_empty() {
            let saved: Vec<serde_json::Value> = self
                .checkpoints
                .iter()
                .map(|c| {
                    serde_json::json!({
                        "step": c.step,
                        "path": c.path.display().to_string(),
                        "bytes": c.bytes,
                        "seconds": c.seconds,
                        "blocking_seconds": c.blocking_seconds,
                    })
                })
                .collect();
            v["checkpoints"] = serde_json::json!(saved);
        }
        if !self.evals.is_empty() {
            let evals: Vec<serde_json::Value> = self
                .evals
                .iter()
                .map(|e| {
                    serde_json::json!({
                        "step": e.step, "loss": e.loss, "perplexity": e.perplexity(),
                        "batches": e.batches, "seconds": e.seconds,
                    })
                })
                .collect();
            v["evals"] = serde_json::json!(evals);
        }
        let mut s = serde_json::to_string_pretty(&v).expect("report serializes");
        s.push('\n');
        s
    }
}

/// Peak resident set size of this process (VmHWM), 0 where /proc is unavailable.
pub fn peak_rss_bytes() -> u64 {
    proc_status_bytes("VmHWM:")
}

/// Resident set size of this process now (VmRSS), 0 where /proc is unavailable.
pub fn rss_bytes() -> u64 {
    proc_status_bytes("VmRSS:")
}

/// A `kB` line of /proc/self/status, in bytes (0 where it cannot be read).
fn proc_status_bytes(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(key)).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|kb| kb.parse::<u64>().ok())
            })
        })
        .map_or(0, |kb| kb * 1024)
}

/// One rank's state while training: memory, data and the plan's well-known buffers.
pub struct Session<'p> {
    pub(crate) plan: &'p CheckedPlan,
    /// The rank's memory.
    pub mem: Memory,
    data: DataSource,
    /// The loss (None on pipeline stages without the head).
    pub(crate) loss_buf: Option<megac_ir::plan::BufId>,
    /// The gradient norm (None on FBD forward roles, which run no optimizer).
    norm_buf: Option<megac_ir::plan::BufId>,
    /// Data inputs this rank reads (a pipeline stage may read only one of them).
    pub(crate) tokens_buf: Option<megac_ir::plan::BufId>,
    pub(crate) labels_buf: Option<megac_ir::plan::BufId>,
    inputs: Vec<i32>,
    labels: Vec<i32>,
    /// Per-op timings, when profiling.
    pub profile: Option<crate::exec::Profile>,
    pub(crate) comm: Box<dyn crate::comm::Communicator>,
    /// The pipeline actions this rank ran in its last step, in order.
    pub executed: Vec<megac_ir::plan::PipeAction>,
    /// fp16's loss scaler (None in other precisions).
    pub scaler: Option<crate::scaler::Scaler>,
    /// `--perturb`'s perturbations (None: a clean run).
    pub(crate) perturber: Option<crate::perturb::Perturber>,
    /// Held-out data for [`crate::eval`] (None: no evaluation).
    pub(crate) eval_data: Option<DataSource>,
}

impl<'p> Session<'p> {
    /// Allocate memory, open the data and initialise the parameters (from `init` or per
    /// element from the seed).
    pub fn new(
        plan: &'p CheckedPlan,
        data: &str,
        init: Option<&std::path::Path>,
    ) -> Result<Self, RuntimeError> {
        Self::with_comm(plan, data, init, Box::new(crate::comm::SingleRank))
    }

    /// As [`Session::new`], for the rank `comm` stands for.
    pub fn with_comm(
        plan: &'p CheckedPlan,
        data: &str,
        init: Option<&std::path::Path>,
        comm: Box<dyn crate::comm::Communicator>,
    ) -> Result<Self, RuntimeError> {
        let b = &plan.batch;
        let data = DataSource::open(data, b.seq_len as usize, b.vocab as u32, plan.train.seed)?;
        Self::with_source(plan, data, init, comm)
    }

    /// As [`Session::with_comm`], with data already opened (for `plan`'s seq_len and vocab).
    pub fn with_source(
        plan: &'p CheckedPlan,
        data: DataSource,
        init: Option<&std::path::Path>,
        comm: Box<dyn crate::comm::Communicator>,
    ) -> Result<Self, RuntimeError> {
        let world = plan.mesh.world_size();
        let bad_role = plan
            .rank_to_role
            .iter()
            .any(|&r| r as usize >= plan.roles.len());
        if bad_role || plan.rank_to_role.len() != world || comm.size() != world {
            return Err(RuntimeError::Plan(format!(
                "the mesh has {world} ranks, the rank table {} (over {} roles), the communicator {}",
                plan.rank_to_role.len(),
                plan.roles.len(),
                comm.size()
            )));
        }
        let mem = Memory::new(plan, comm.rank())?;
        let checked = plan;
        let plan: &'p Plan = plan;
        let role = &plan.roles[plan.rank_to_role[comm.rank()] as usize];
        let b = &plan.batch;
        let get = |name: &str| {
            role.results.get(name).copied().ok_or_else(|| {
                RuntimeError::Plan(format!("the plan does not say where its `{name}` is"))
            })
        };
        let input = |name: &str| {
            role.inputs
                .get(name)
                .copied()
                .ok_or_else(|| RuntimeError::Plan(format!("the plan has no `{name}` input")))
        };
        let n = (b.micro_batch * b.seq_len) as usize;
        let piped = role.pipeline.is_some();
        // A pipeline stage holds the inputs and results of its own chunks only.
        let optional = |r: Result<megac_ir::plan::BufId, RuntimeError>| match r {
            Ok(b) => Ok(Some(b)),
            Err(_) if piped => Ok(None),
            Err(e) => Err(e),
        };
        let session = Session {
            plan: checked,
            mem,
            data,
            loss_buf: optional(get("loss"))?,
            // An inference plan has no gradient norm (and never runs the optimizer).
            norm_buf: if plan.kind.is_train() {
                optional(get("grad_norm"))?
            } else {
                None
            },
            tokens_buf: optional(input("tokens"))?,
            labels_buf: optional(input("labels"))?,
            inputs: vec![0; n],
            labels: vec![0; n],
            profile: None,
            comm,
            executed: Vec::new(),
            scaler: plan.train.loss_scaler.map(crate::scaler::Scaler::new),
            perturber: None,
            eval_data: None,
        };
        let mut session = session;
        session.init_params(init)?;
        session.init_masters();
        Ok(session)
    }

    /// Mixed precision: every master weight starts as its working weight (already rounded
    /// to 16 bits), as Megatron's main params are copies of its bf16 params. The plan names
    /// the pairs in its AdamW instructions: working weight first output, master fourth.
    fn init_masters(&mut self) {
        let mut pairs = Vec::new();
        for instr in Plan::programs_of(self.role()).into_iter().flatten() {
            if let megac_ir::plan::Instr::Kernel {
                op: megac_ir::OpKind::AdamW { .. },
                outputs,
                ..
            } = instr
            {
                if let [working, _, _, master] = outputs[..] {
                    pairs.push((working, master));
                }
            }
        }
        for (working, master) in pairs {
            let values = self.mem.read_f32(working);
            self.mem.write_f32(master, &values);
        }
    }

    fn init_params(&mut self, init: Option<&std::path::Path>) -> Result<(), RuntimeError> {
        let plan = self.plan;
        match init {
            Some(path) => {
                let expected: Vec<(String, Vec<usize>)> = plan
                    .hf_tensors()
                    .into_iter()
                    .map(|(name, shape)| (name, shape.iter().map(|&d| d as usize).collect()))
                    .collect();
                let tied = !plan.params.iter().any(|p| p.name == "lm_head.weight");
                let mut values = hf::load_params(path, &expected, tied)?.into_iter();
                for p in &plan.params {
                    // Stacked experts: Hugging Face's per-expert tensors, one after another.
                    let v: Vec<f32> = values
                        .by_ref()
                        .take(p.hf_tensors().len())
                        .flatten()
                        .collect();
                    for b in std::iter::once(p.buffer).chain(p.tied_copies.iter().copied()) {
                        if self.mem.holds(b) {
                            self.load_shard(p, b, &v);
                        }
                    }
                }
            }
            None => {
                let rank = self.comm.rank();
                for p in &plan.params {
                    for b in std::iter::once(p.buffer).chain(p.tied_copies.iter().copied()) {
                        if self.mem.holds(b) {
                            self.init_shard(p, b, rank);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Fill buffer `b` (parameter `p` or a tied copy) with this rank's shard of `v`.
    pub(crate) fn load_shard(
        &mut self,
        p: &megac_ir::plan::ParamEntry,
        b: megac_ir::plan::BufId,
        v: &[f32],
    ) {
        let (plan, rank) = (self.plan, self.comm.rank());
        let mut out = vec![0f32; self.mem.buffer(b).len() as usize];
        if p.shards.is_empty() && p.hf_rows.is_none() {
            out.copy_from_slice(v);
        } else {
            // This rank's shard of the global tensor; vocabulary padding rows (beyond what
            // the file holds) are zero.
            for (x, i) in out.iter_mut().zip(p.global_indices(&plan.mesh, rank)) {
                *x = v.get(i).copied().unwrap_or(0.0);
            }
        }
        // Rounded once to a 16-bit working weight under mixed precision.
        self.mem.write_f32(b, &out);
    }

    /// Initialise buffer `b` (parameter `p` or a tied copy) per element from the seed.
    fn init_shard(
        &mut self,
        p: &megac_ir::plan::ParamEntry,
        b: megac_ir::plan::BufId,
        rank: usize,
    ) {
        let plan = self.plan;
        let mut buf = vec![0f32; self.mem.buffer(b).len() as usize];
        let out = &mut buf[..];
        if p.per_expert.is_some() {
            // Each element as the Hugging Face tensor of its expert.
            let idx = p.global_indices(&plan.mesh, rank);
            for (x, &i) in out.iter_mut().zip(&idx) {
                let (name, at) = p.hf_element(i as u64);
                *x = init::init_value(plan.train.seed, &name, &p.init, at);
            }
        } else if p.shards.is_empty() && p.hf_rows.is_none() {
            init::init_param(plan.train.seed, &p.name, &p.init, 0, out);
        } else {
            let idx = p.global_indices(&plan.mesh, rank);
            init::init_at(plan.train.seed, &p.name, &p.init, &idx, out);
            // Vocabulary padding rows start (and stay) zero.
            let real = p.hf_shape().iter().product::<u64>() as usize;
            for (x, &i) in out.iter_mut().zip(&idx) {
                if i >= real {
                    *x = 0.0;
                }
            }
        }
        // Rounded once to a 16-bit working weight under mixed precision.
        self.mem.write_f32(b, &buf);
    }

    /// Forward and backward of micro-batch `mb` of 1-based `step`, accumulating gradients;
    /// returns the micro-batch's share of the step loss.
    pub fn microbatch(&mut self, step: u64, mb: u64) -> Result<f64, RuntimeError> {
        let (tokens, labels) = self.load(step, mb);
        self.write_inputs(&tokens, &labels);
        let mut ctx = self.context(step);
        // The micro-batch seeds training `perturb` instructions' streams.
        ctx.microbatch = mb;
        let t0 = Instant::now();
        self.run(&self.role().microbatch, &ctx)?;
        self.record(crate::scan::Kind::Microbatch, t0, 0, mb as u32);
        Ok(self.scalar(self.loss_buf))
    }

    /// Run `program` on this rank's memory and communicator.
    pub(crate) fn run(
        &mut self,
        program: &[megac_ir::plan::Instr],
        ctx: &StepContext,
    ) -> Result<(), RuntimeError> {
        if let Some(s) = self.comm.scan() {
            s.begin_segment();
        }
        let out = run_program(
            program,
            self.plan,
            &self.mem,
            ctx,
            self.comm.as_mut(),
            self.profile.as_mut(),
        );
        if let Some(s) = self.comm.scan() {
            s.end_segment();
        }
        out
    }

    /// Record a session event from `t0` to now (when tracing).
    pub(crate) fn record(&mut self, kind: crate::scan::Kind, t0: Instant, a: u32, b: u32) {
        if let Some(s) = self.comm.scan() {
            s.record(kind, t0, a, b);
        }
    }

    /// The scalar in buffer `b` (0 where this rank holds none).
    pub(crate) fn scalar(&self, b: Option<megac_ir::plan::BufId>) -> f64 {
        b.map_or(0.0, |b| f64::from(self.mem.f32(b)[0]))
    }

    /// Write micro-batch data (this rank's part, from [`Session::load`]) into the input
    /// buffers this rank holds.
    pub(crate) fn write_inputs(&mut self, tokens: &[i32], labels: &[i32]) {
        if let Some(b) = self.tokens_buf {
            self.mem.i32_mut(b).copy_from_slice(tokens);
        }
        if let Some(b) = self.labels_buf {
            self.mem.i32_mut(b).copy_from_slice(labels);
        }
    }

    /// This rank's part of a whole `[mb, S]` micro-batch of tokens and labels (under
    /// context parallelism its load-balanced chunks of every sample; else all of it).
    pub(crate) fn local_inputs(&self, tokens: &[i32], labels: &[i32]) -> (Vec<i32>, Vec<i32>) {
        let (rank, plan) = (self.comm.rank(), self.plan);
        let local = |full: &[i32], b: Option<megac_ir::plan::BufId>| match b {
            Some(b) => local_tokens(full, &plan.buffers[b as usize], &plan.mesh, rank),
            None => Vec::new(),
        };
        (
            local(tokens, self.tokens_buf),
            local(labels, self.labels_buf),
        )
    }

    /// This rank's part of micro-batch `mb` of 1-based `step`: (tokens, labels).
    pub(crate) fn load(&mut self, step: u64, mb: u64) -> (Vec<i32>, Vec<i32>) {
        let t0 = Instant::now();
        let out = self.load_untimed(step, mb);
        self.record(crate::scan::Kind::Data, t0, 0, mb as u32);
        out
    }

    /// As [`Session::load`] for batch `k` (from 0) of the eval data (untimed).
    pub(crate) fn load_eval(&mut self, k: u64, mb: u64) -> (Vec<i32>, Vec<i32>) {
        self.load_from(true, k + 1, mb)
    }

    fn load_untimed(&mut self, step: u64, mb: u64) -> (Vec<i32>, Vec<i32>) {
        self.load_from(false, step, mb)
    }

    /// This rank's part of micro-batch `mb` of 1-based `step` of the training data, or of
    /// the eval data (`eval`).
    fn load_from(&mut self, eval: bool, step: u64, mb: u64) -> (Vec<i32>, Vec<i32>) {
        let b = &self.plan.batch;
        // Micro-batch k of data-parallel rank r holds global samples (k·dp + r)·mb ..
        // (k·dp + r + 1)·mb - 1 of the step, as Megatron's sampler does.
        let dp = self.plan.mesh.size(megac_ir::Axis::Dp);
        let r = self.plan.mesh.coord(self.comm.rank(), megac_ir::Axis::Dp) as u64;
        let first = (step - 1) * b.global_batch + (mb * dp + r) * b.micro_batch;
        let data = match &self.eval_data {
            Some(d) if eval => d,
            _ => &self.data,
        };
        data.fill_batch(
            first,
            b.seq_len as usize,
            &mut self.inputs,
            &mut self.labels,
        );
        let (rank, plan) = (self.comm.rank(), self.plan);
        let local = |full: &[i32], b: Option<megac_ir::plan::BufId>| match b {
            Some(b) => local_tokens(full, &plan.buffers[b as usize], &plan.mesh, rank),
            None => Vec::new(),
        };
        (
            local(&self.inputs, self.tokens_buf),
            local(&self.labels, self.labels_buf),
        )
    }

    /// One optimizer step (1-based); returns the gradient norm before clipping.
    pub fn optimizer_step(&mut self, step: u64) -> Result<f64, RuntimeError> {
        let ctx = self.context(step);
        let t0 = Instant::now();
        self.run(&self.role().optimizer, &ctx)?;
        self.record(crate::scan::Kind::Optimizer, t0, 0, 0);
        Ok(self.scalar(self.norm_buf))
    }

    /// A whole step: zero gradients, every micro-batch, the optimizer. Returns (loss, grad norm).
    pub fn step(&mut self, step: u64) -> Result<(f64, f64), RuntimeError> {
        if let Some(s) = self.comm.scan() {
            s.begin_step(step);
        }
        let t0 = Instant::now();
        let out = self.step_untimed(step);
        self.record(crate::scan::Kind::Step, t0, 0, 0);
        out
    }

    fn step_untimed(&mut self, step: u64) -> Result<(f64, f64), RuntimeError> {
        self.mem.zero_grads();
        if let Some(p) = &self.perturber {
            p.weights(&mut self.mem, step);
        }
        let mut loss = 0.0;
        if self.role().pipeline.is_some() {
            loss = crate::pipeline::run_step(self, step)?;
        } else {
            for mb in 0..self.plan.batch.microbatches {
                loss += self.microbatch(step, mb)?;
            }
        }
        loss = self.reduce_loss(loss)?;
        let norm = self.optimizer_step(step)?;
        // fp16: every rank sees the same global norm, so every scaler moves alike.
        if let Some(s) = &mut self.scaler {
            s.update(!norm.is_finite());
        }
        Ok((loss, norm))
    }

    /// The step loss from this rank's share: the loss of data-parallel ranks (and pipeline
    /// stages) is a pending sum; add it up for the report (a collective over those ranks).
    pub(crate) fn reduce_loss(&mut self, loss: f64) -> Result<f64, RuntimeError> {
        let Some(axes) = self.role().result_axes.get("loss") else {
            return Ok(loss);
        };
        let group = self.plan.mesh.group(self.comm.rank(), axes);
        let mut total = [loss];
        self.comm.all_reduce_sum_f64(&group, &mut total)?;
        Ok(total[0])
    }

    /// This rank's role.
    pub(crate) fn role(&self) -> &'p megac_ir::plan::Role {
        let plan: &'p Plan = self.plan;
        &plan.roles[plan.rank_to_role[self.comm.rank()] as usize]
    }

    pub(crate) fn context(&self, step: u64) -> StepContext {
        StepContext {
            step,
            lr: self.plan.train.lr_schedule.lr_at(self.plan.train.lr, step),
            microbatch: 0,
            loss_scale: self.scaler.as_ref().map_or(1.0, |s| s.scale()),
        }
    }

    /// The global parameters, assembled from every rank's shard (a collective: every rank
    /// calls it; each gets the full tensors).
    pub fn global_params(&mut self) -> Result<Vec<Vec<f32>>, RuntimeError> {
        let plan = self.plan;
        let mut out = Vec::with_capacity(plan.params.len());
        let stages = plan.mesh.group(self.comm.rank(), &[megac_ir::Axis::Pp]);
        for p in &plan.params {
            let total = p.shape.iter().product::<u64>() as usize;
            let mut global = if !self.mem.holds(p.buffer) {
                // Another pipeline stage's parameter: it arrives in the sum over pp below.
                vec![0f32; total]
            } else if p.shards.is_empty() {
                self.mem.read_f32(p.buffer)
            } else {
                let local = &self.mem.read_f32(p.buffer)[..];
                let axes: Vec<megac_ir::Axis> = p.shards.iter().flatten().copied().collect();
                let members = plan.mesh.group(self.comm.rank(), &axes);
                let mut all = vec![0f32; local.len() * members.len()];
                self.comm.all_gather(&members, local, &mut all)?;
                let mut global = vec![0f32; total];
                for (m, &member) in members.iter().enumerate() {
                    let chunk = &all[m * local.len()..(m + 1) * local.len()];
                    for (x, i) in chunk.iter().zip(p.global_indices(&plan.mesh, member)) {
                        global[i] = *x;
                    }
                }
                global
            };
            // Each parameter lives on one pipeline stage: the others add zeros.
            if stages.len() > 1 {
                self.comm.all_reduce_sum(&stages, &mut global)?;
            }
            out.push(global);
        }
        Ok(out)
    }

    /// Write the global parameters as Hugging Face safetensors (a collective: every rank
    /// calls it, rank 0 writes).
    pub fn save_params(&mut self, path: &std::path::Path) -> Result<(), RuntimeError> {
        let values = self.global_params()?;
        if self.comm.rank() != 0 {
            return Ok(());
        }
        let tensors: Vec<(String, Vec<usize>, &[f32])> = self
            .plan
            .params
            .iter()
            .zip(&values)
            .flat_map(|(p, v)| {
                // Drop vocabulary padding: Hugging Face's shape; stacked experts as one
                // tensor per expert.
                let mut at = 0usize;
                p.hf_tensors().into_iter().map(move |(name, shape)| {
                    let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
                    let n: usize = shape.iter().product();
                    at += n;
                    (name, shape, &v[at - n..at])
                })
            })
            .collect();
        hf::save_params(path, &tensors)
    }
}

/// This rank's part of a `[mb, S]` batch: all of it, or under context parallelism the
/// tokens of its two load-balanced chunks (r and 2·cp-1-r) of every sample.
fn local_tokens(
    full: &[i32],
    buf: &megac_ir::plan::Buffer,
    mesh: &megac_ir::Mesh,
    rank: usize,
) -> Vec<i32> {
    let split = buf
        .layout
        .get(1)
        .is_some_and(|a| a.contains(&megac_ir::Axis::Cp));
    if !split {
        return full.to_vec();
    }
    let cp = mesh.size(megac_ir::Axis::Cp) as usize;
    let s_local = buf.shape[1] as usize;
    let s = s_local * cp;
    let pos =
        megac_kernels::context::cp_local_positions(s, cp, mesh.coord(rank, megac_ir::Axis::Cp));
    full.chunks_exact(s)
        .flat_map(|row| pos.iter().map(move |&p| row[p as usize]))
        .collect()
}

/// An inference plan (no gradients, no optimizer) cannot train.
pub(crate) fn refuse_inference(plan: &CheckedPlan) -> Result<(), RuntimeError> {
    if plan.kind.is_train() {
        return Ok(());
    }
    Err(RuntimeError::Unsupported(format!(
        "this is an {} plan (the forward only, no gradients or optimizer state): compile it \
         without --inference to train",
        plan.kind.name()
    )))
}

/// Train with `plan`: one rank in this thread, or one thread per rank on the local
/// communicator. Rank 0 prints progress, saves parameters and writes the trace; its report
/// is returned (every rank computes the same losses and norms).
pub fn train(plan: &CheckedPlan, opts: &RunOptions) -> Result<RunReport, RuntimeError> {
    refuse_inference(plan)?;
    let start_rss = rss_bytes();
    let world = plan.mesh.world_size();
    let ckpt = open_checkpoint(plan, opts)?;
    let ckpt = ckpt.as_ref();
    let data = open_data(plan, opts)?;
    let data = &data;
    let eval = open_eval_data(plan, opts)?;
    let eval = eval.as_ref();
    let mut report = if world == 1 {
        train_rank(
            plan,
            opts,
            ckpt,
            data,
            eval,
            Box::new(crate::comm::SingleRank),
            (0, 1),
        )?
    } else {
        let mut reports = crate::local_comm::run_ranks(world, |comm| {
            let slot = (crate::comm::Communicator::rank(&comm), world);
            train_rank(plan, opts, ckpt, data, eval, Box::new(comm), slot)
        })?;
        reports.swap_remove(0)
    };
    report.start_rss_bytes = start_rss;
    Ok(report)
}

/// Open and check the training data once, before any rank starts (one error naming the
/// file). Megatron data is indexed for the run's samples: `steps` (the total, resumed or
/// not) times the global batch, as Megatron's `train_samples = train_iters * global_batch`.
pub(crate) fn open_data(plan: &CheckedPlan, opts: &RunOptions) -> Result<DataSource, RuntimeError> {
    let b = &plan.batch;
    let steps = opts.steps.unwrap_or(plan.train.steps);
    let mut data_opts = opts.data_options.clone();
    data_opts.samples = Some(steps.saturating_mul(b.global_batch));
    DataSource::open_with(
        &opts.data,
        &data_opts,
        b.seq_len as usize,
        b.vocab as u32,
        plan.train.seed,
    )
}

/// `--load`: open and verify the checkpoint and check it against the plan, before any rank
/// starts (one error naming the file).
fn open_checkpoint(
    plan: &CheckedPlan,
    opts: &RunOptions,
) -> Result<Option<crate::checkpoint::Checkpoint>, RuntimeError> {
    let Some(path) = &opts.load else {
        return Ok(None);
    };
    let ckpt = crate::checkpoint::Checkpoint::open(path)?;
    ckpt.check(plan, opts.steps.unwrap_or(plan.train.steps))?;
    Ok(Some(ckpt))
}

/// `--eval-data`: open the held-out data before any rank starts (one error naming the file).
fn open_eval_data(
    plan: &CheckedPlan,
    opts: &RunOptions,
) -> Result<Option<DataSource>, RuntimeError> {
    match &opts.eval {
        Some(e) if e.iters == 0 => Err(RuntimeError::Unsupported(
            "--eval-iters 0: evaluate at least one batch".into(),
        )),
        Some(e) => {
            crate::eval::open_data(plan, &e.data, &opts.data_options, Some(e.iters)).map(Some)
        }
        None => Ok(None),
    }
}

/// Train with `plan` as one process of an MPI job (`mpirun -np N megac run PLAN --comm mpi`):
/// initialise MPI, check that the job has as many processes as the plan has ranks, and run
/// this process's rank (its MPI world rank) on the [`crate::mpi_comm::MpiComm`]. Every rank
/// returns its own report (all ranks compute the same losses and norms); rank 0 prints
/// progress, saves parameters and writes the trace, and [`crate::mpi_comm::world_rank`] tells
/// the caller which rank it is.
///
/// On success MPI is finalised before returning. On failure it is not: the process should
/// report the error and exit non-zero, and mpirun then ends the ranks that may be waiting for
/// this one in a collective (finalising would wait for them).
#[cfg(feature = "mpi")]
pub fn train_mpi(plan: &CheckedPlan, opts: &RunOptions) -> Result<RunReport, RuntimeError> {
    refuse_inference(plan)?;
    let start_rss = rss_bytes();
    let world = plan.mesh.world_size();
    if world > 1 && !crate::mpi_comm::started_by_launcher() {
        return Err(RuntimeError::Unsupported(format!(
            "--comm mpi: the plan has {world} ranks but this process was not started by mpirun; \
             run `megac launch -n {world} PLAN_DIR` or `mpirun -np {world} megac run PLAN_DIR --comm mpi`"
        )));
    }
    crate::threads::share_host_as_process();
    crate::mpi_comm::in_universe("--comm mpi", |universe| {
        let result = crate::mpi_comm::MpiComm::new(universe.world()).and_then(|mut comm| {
            comm.set_deterministic(opts.deterministic);
            let started = crate::comm::Communicator::size(&comm);
            if started != world {
                crate::mpi_comm::set_error_on_every_rank();
                return Err(RuntimeError::Unsupported(format!(
                    "the plan has {world} rank{} but mpirun started {started} process{}; \
                 launch it with `megac launch -n {world}` (or `mpirun -np {world}`)",
                    if world == 1 { "" } else { "s" },
                    if started == 1 { "" } else { "es" },
                )));
            }
            let ckpt = open_checkpoint(plan, opts).inspect_err(|_| {
                crate::mpi_comm::set_error_on_every_rank();
            })?;
            let data = open_data(plan, opts).inspect_err(|_| {
                crate::mpi_comm::set_error_on_every_rank();
            })?;
            let eval = open_eval_data(plan, opts).inspect_err(|_| {
                crate::mpi_comm::set_error_on_every_rank();
            })?;
            train_rank(
                plan,
                opts,
                ckpt.as_ref(),
                &data,
                eval.as_ref(),
                Box::new(comm),
                crate::threads::mpi_local_slot().unwrap_or((0, 1)),
            )
            .inspect_err(|e| {
                // The loss and the norm are reduced over the world: every rank stops at the same
                // step with the same values, and rank 0's message is enough.
                if matches!(e, RuntimeError::NonFinite(_)) {
                    crate::mpi_comm::set_error_on_every_rank();
                }
            })
        });
        // One report: rank 0 gathers every rank's peak RSS and step times (losses and norms are
        // the same on every rank: they are reduced over the world).
        let result = result.and_then(|mut report| {
            use crate::comm::Communicator as _;
            report.start_rss_bytes = start_rss;
            let mut comm = crate::mpi_comm::MpiComm::new(universe.world())?;
            let (rank, n) = (comm.rank(), comm.size());
            let steps = report.steps.len();
            // Row r of the table is rank r's: peak RSS, tokens/s, then the step times; every
            // other rank adds zeros, so the sum is exact.
            let width = 2 + steps;
            let mut table = vec![0f64; n * width];
            let row = &mut table[rank * width..(rank + 1) * width];
            row[0] = report.peak_rss_bytes as f64;
            row[1] = report.tokens_per_s;
            for (x, s) in row[2..].iter_mut().zip(&report.steps) {
                *x = s.seconds;
            }
            let world_ranks: Vec<usize> = (0..n).collect();
            comm.all_reduce_sum_f64(&world_ranks, &mut table)?;
            let rows: Vec<&[f64]> = table.chunks_exact(width).collect();
            report.peak_rss_bytes_per_rank = rows.iter().map(|r| r[0] as u64).collect();
            report.peak_rss_bytes = report
                .peak_rss_bytes_per_rank
                .iter()
                .copied()
                .max()
                .unwrap_or(0);
            // The job runs at the pace of its slowest rank.
            report.tokens_per_s = rows.iter().map(|r| r[1]).fold(f64::INFINITY, f64::min);
            for (i, s) in report.steps.iter_mut().enumerate() {
                s.seconds = rows.iter().map(|r| r[2 + i]).fold(0.0, f64::max);
            }
            Ok(report)
        });
        result
    })
}

fn train_rank(
    plan: &CheckedPlan,
    opts: &RunOptions,
    ckpt: Option<&crate::checkpoint::Checkpoint>,
    data: &DataSource,
    eval_data: Option<&DataSource>,
    comm: Box<dyn crate::comm::Communicator>,
    // (this rank's index among the ranks on its host, their number): its turns on the
    // host's cores while recording.
    host_slot: (usize, usize),
) -> Result<RunReport, RuntimeError> {
    let lead = comm.rank() == 0;
    let steps = opts.steps.unwrap_or(plan.train.steps);
    let rank = comm.rank();
    let comm: Box<dyn crate::comm::Communicator> =
        if opts.trace.is_some() || !opts.inject.is_empty() || opts.scan {
            let faults = crate::scan::RankFaults::of(&opts.inject, rank);
            let role = plan.rank_to_role.get(rank).map_or(0, |&r| r as usize);
            // `--scan` alone keeps one step's events at a time.
            let kept = if opts.trace.is_some() { steps } else { 2 };
            let rec = (opts.trace.is_some() || opts.scan).then(|| {
                crate::scan::Recorder::new(
                    crate::scan::capacity(plan, role.min(plan.roles.len().saturating_sub(1)), kept)
                        + 2 * crate::scan::SYNC_ROUNDS as usize * plan.mesh.world_size(),
                    faults.offset_ns,
                    faults.drift,
                )
            });
            let recording = rec.is_some();
            let mut scan = crate::scan::ScanComm::new(comm, rec, faults);
            if recording {
                scan.place(crate::threads::Crossover::new(host_slot.0, host_slot.1));
            }
            if opts.scan {
                let world = plan.mesh.world_size();
                let roles = (0..world)
                    .map(|r| plan.rank_to_role.get(r).map_or(0, |&x| x as usize))
                    .collect();
                let labels = (0..world)
                    .map(|r| crate::scan::analyze::label(&rank_header(plan, r, steps)))
                    .collect();
                let first = ckpt.map_or(0, |c| c.index.step) + 1;
                let online =
                    crate::scan::online::Online::new(rank, roles, labels, first, scan.rotation());
                scan.watch(online, opts.trace.is_some());
            }
            Box::new(scan)
        } else {
            comm
        };
    let mut session = Session::with_source(plan, data.clone(), opts.init.as_deref(), comm)?;
    session.perturber = crate::perturb::Perturber::new(
        plan,
        &opts.perturb,
        opts.perturb_seed,
        session.comm.rank(),
        &session.mem,
    )?;
    session.eval_data = eval_data.cloned();
    let b = &plan.batch;
    let steps = opts.steps.unwrap_or(plan.train.steps);
    // Resume: the state after step `first - 1`; the data and the lr schedule continue from
    // the step.
    let mut resumed = None;
    let done = match ckpt {
        Some(c) => {
            let t0 = Instant::now();
            crate::checkpoint::load(&mut session, c)?;
            resumed = Some((c.index.step, c.dir.clone(), t0.elapsed().as_secs_f64()));
            c.index.step
        }
        None => 0,
    };
    let save_layout = match &opts.save {
        Some(_) => Some(crate::checkpoint::SaveLayout::new(
            plan,
            opts.hf_config.clone(),
        )?),
        None => None,
    };
    let mut checkpoints = Vec::new();
    let mut pending: Option<crate::checkpoint::PendingSave> = None;
    let progress = lead
        && opts
            .progress
            .unwrap_or_else(|| std::io::stderr().is_terminal());
    let mut records = Vec::new();
    // Rank 0 logs (log lines, `--log`).
    let mut log = if lead {
        Some(opts.run_log(steps, b.tokens_per_step)?)
    } else {
        None
    };
    let mut evals = Vec::new();
    // Seconds spent evaluating: not training time (tokens/s, ETA).
    let mut paused = 0.0;
    // `--trace`: ping-pongs at both ends of the run for `megac scan`'s clock alignment.
    if let (Some(_), Some(s)) = (&opts.trace, session.comm.scan()) {
        s.sync_clocks(0)?;
    }
    let start = Instant::now();
    let mut step_times = Vec::new();
    if opts.trace.is_some() && opts.trace_kernels {
        session.profile = Some(crate::exec::Profile {
            events: Some(Vec::new()),
            ..Default::default()
        });
    }
    for step in done + 1..=steps {
        if opts.profile && session.profile.is_none() && step == (done + 2).min(steps) {
            session.profile = Some(Default::default());
        }
        let t0 = Instant::now();
        let loss_scale = session.scaler.as_ref().map(|s| s.scale());
        let (loss, grad_norm) = session.step(step)?;
        if opts.scan {
            let warnings = match session.comm.scan() {
                Some(s) => s.end_step(step)?,
                None => Vec::new(),
            };
            for w in warnings {
                let _ = writeln!(std::io::stderr().lock(), "{w}");
            }
        }
        let skipped = check_step(
            plan,
            step,
            loss,
            grad_norm,
            session.scaler.as_ref(),
            loss_scale,
        )?;
        let seconds = t0.elapsed().as_secs_f64();
        if let Some(p) = &session.profile {
            step_times.push((step, t0.duration_since(p.origin).as_secs_f64(), seconds));
        }
        records.push(StepRecord {
            step,
            loss,
            grad_norm,
            lr: plan.train.lr_schedule.lr_at(plan.train.lr, step),
            seconds,
            loss_scale,
            skipped,
        });
        if progress {
            print_progress(
                plan,
                (step, steps, done),
                start.elapsed().as_secs_f64() - paused,
                (loss, grad_norm),
                loss_scale,
                skipped,
            );
        }
        if let (Some(log), Some(r)) = (&mut log, records.last()) {
            log.step(r, start.elapsed().as_secs_f64() - paused, step - done)?;
        }
        if let Some(e) = &opts.eval {
            if step % e.interval.unwrap_or(u64::MAX).max(1) == 0 || step == steps {
                let t0 = Instant::now();
                let losses = session.evaluate(e.iters, step)?;
                let rec = crate::eval::EvalRecord {
                    step,
                    loss: losses.iter().sum::<f64>() / losses.len().max(1) as f64,
                    batches: e.iters,
                    seconds: t0.elapsed().as_secs_f64(),
                };
                paused += rec.seconds;
                if progress {
                    let _ = writeln!(
                        std::io::stderr().lock(),
                        "{}",
                        crate::log::eval_line(&rec, steps)
                    );
                }
                if let Some(log) = &mut log {
                    log.eval(&rec)?;
                }
                evals.push(rec);
            }
        }
        if let (Some(dir), Some(layout)) = (&opts.save, &save_layout) {
            let every = opts.save_interval.unwrap_or(u64::MAX).max(1);
            if step % every == 0 || step == steps {
                if let Some(p) = pending.take() {
                    let saved = crate::checkpoint::finish(&mut session, layout, dir, p)?;
                    checkpoints.push(announce(saved, progress));
                }
                if opts.save_async && step != steps {
                    pending = Some(crate::checkpoint::begin_async(
                        &mut session,
                        layout,
                        dir,
                        step,
                    )?);
                } else {
                    let saved = crate::checkpoint::save(&mut session, layout, dir, step)?;
                    checkpoints.push(announce(saved, progress));
                }
            }
        }
    }
    let elapsed = start.elapsed().as_secs_f64() - paused;
    if let Some(path) = &opts.save_params {
        session.save_params(path)?;
    }
    if let Some(dir) = &opts.trace {
        if let Some(s) = session.comm.scan() {
            s.sync_clocks(1)?;
        }
        write_rank_record(&mut session, dir, steps)?;
    }
    if let (true, Some(dir), Some(p)) = (lead, &opts.trace, &session.profile) {
        megac_ir::file::write_atomic(
            &dir.join("rank-0.trace.json"),
            p.chrome_trace(0, &step_times),
        )
        .map_err(|e| RuntimeError::Io {
            path: dir.display().to_string(),
            message: e.to_string(),
        })?;
    }
    Ok(RunReport {
        tokens_per_s: ((steps - done) * b.tokens_per_step) as f64 / elapsed.max(1e-9),
        steps: records,
        peak_rss_bytes: peak_rss_bytes(),
        start_rss_bytes: 0,
        peak_rss_bytes_per_rank: Vec::new(),
        arena_bytes: session.mem.bytes(),
        profile: session.profile.take(),
        pipeline_order: session
            .executed
            .iter()
            .map(|a| format!("{:?}{}.{}", a.kind, a.chunk, a.microbatch))
            .collect(),
        checkpoints,
        resumed,
        evals,
        device_memory: None,
    })
}

/// Print the progress line of 1-based `step` of `steps` (`done`: the steps before this run
/// started; `elapsed`: seconds of training so far), on stderr.
pub(crate) fn print_progress(
    plan: &Plan,
    (step, steps, done): (u64, u64, u64),
    elapsed: f64,
    (loss, grad_norm): (f64, f64),
    loss_scale: Option<f64>,
    skipped: bool,
) {
    let tok_s = ((step - done) * plan.batch.tokens_per_step) as f64 / elapsed.max(1e-9);
    let eta = elapsed / (step - done) as f64 * (steps - step) as f64;
    let mut err = std::io::stderr().lock();
    let scale = match loss_scale {
        Some(s) if skipped => format!(
            "  loss scale {}: overflow, step skipped",
            crate::scaler::fmt_scale(s)
        ),
        Some(s) => format!("  loss scale {}", crate::scaler::fmt_scale(s)),
        None => String::new(),
    };
    let _ = writeln!(
        err,
        "step {step:>5}/{steps}  loss {loss:.4}  grad norm {grad_norm:.3}  lr {:.3e}  {tok_s:>9.0} tok/s  ETA {}{scale}",
        plan.train.lr_schedule.lr_at(plan.train.lr, step),
        crate::log::fmt_duration(eta)
    );
}

/// Print a progress line for a checkpoint written (when `progress`); returns it.
fn announce(
    saved: crate::checkpoint::SavedCheckpoint,
    progress: bool,
) -> crate::checkpoint::SavedCheckpoint {
    if progress {
        let _ = writeln!(
            std::io::stderr().lock(),
            "saved checkpoint {} ({:.1} MiB, {:.3} s, training waited {:.3} s)",
            saved.path.display(),
            saved.bytes as f64 / (1u64 << 20) as f64,
            saved.seconds,
            saved.blocking_seconds
        );
    }
    saved
}

/// Who rank `rank` of `plan` is, for its event record and `--scan`'s warnings.
fn rank_header(plan: &Plan, rank: usize, steps: u64) -> crate::scan::RankHeader {
    crate::scan::RankHeader {
        rank,
        world: plan.mesh.world_size(),
        role: plan.rank_to_role[rank] as usize,
        coords: megac_ir::Axis::ALL
            .iter()
            .map(|&a| {
                (
                    a.as_str().to_string(),
                    plan.mesh.coord(rank, a),
                    plan.mesh.size(a) as usize,
                )
            })
            .collect(),
        steps,
        rotation: 1,
        placement: None,
    }
}

/// Write this rank's event record, `DIR/rank-N.json`.
fn write_rank_record(
    session: &mut Session<'_>,
    dir: &std::path::Path,
    steps: u64,
) -> Result<(), RuntimeError> {
    let plan = session.plan;
    let rank = session.comm.rank();
    let mut header = rank_header(plan, rank, steps);
    let Some(scan) = session.comm.scan() else {
        return Ok(());
    };
    header.rotation = scan.rotation();
    header.placement = scan.placement();
    let Some(rec) = scan.rec.as_ref() else {
        return Ok(());
    };
    let path = dir.join(format!("rank-{rank}.json"));
    megac_ir::file::write_atomic(&path, rec.to_json(&header)).map_err(|e| RuntimeError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

/// After step `step` (its loss and gradient norm, and the loss scale it ran with): fp16's
/// non-finite gradient norm with a finite loss is an overflow of the scaled gradients, so the
/// update was skipped and the scale halves, unless it cannot go lower (then, as any other
/// non-finite value, it stops the run: [`check_finite`]). A non-finite loss stops the run in
/// every precision (as Megatron's check_for_nan_in_loss_and_grad). Whether the update was
/// skipped. The cpu and cuda training loops both call this.
pub(crate) fn check_step(
    plan: &Plan,
    step: u64,
    loss: f64,
    grad_norm: f64,
    scaler: Option<&crate::scaler::Scaler>,
    loss_scale: Option<f64>,
) -> Result<bool, RuntimeError> {
    let skipped = loss_scale.is_some() && !grad_norm.is_finite() && loss.is_finite();
    let stuck = scaler.zip(loss_scale).is_some_and(|(s, before)| {
        skipped
            && s.scale() == before
            && plan
                .train
                .loss_scaler
                .is_some_and(|c| c.fixed || before <= c.min_scale)
    });
    if !skipped || stuck {
        check_finite(plan, step, loss, grad_norm)?;
    }
    Ok(skipped)
}

/// Stop at the first step whose loss or gradient norm is not finite: every later step would
/// only spread NaN through the weights. The loss and the norm are reduced over the ranks, so
/// every rank stops at the same step.
pub(crate) fn check_finite(
    plan: &Plan,
    step: u64,
    loss: f64,
    grad_norm: f64,
) -> Result<(), RuntimeError> {
    let what = if !loss.is_finite() {
        "loss"
    } else if !grad_norm.is_finite() {
        "gradient norm"
    } else {
        return Ok(());
    };
    let (lr, step_lr) = (
        plan.train.lr,
        plan.train.lr_schedule.lr_at(plan.train.lr, step),
    );
    let mut tries = vec![format!(
        "a lower train.lr (now {lr:e}; {step_lr:.3e} at this step)"
    )];
    tries.push(match grad_clip(plan) {
        Some(c) if c > 0.0 => format!("a lower train.grad_clip (now {c})"),
        _ => "gradient clipping with train.grad_clip = 1.0 (now off)".to_string(),
    });
    tries.push("and check the data and the --init weights".to_string());
    Err(RuntimeError::NonFinite(format!(
        "step {step}: the {what} is not finite (loss {loss:.4}, gradient norm {grad_norm:.4}); \
         training stopped there, no parameters or report written\n\
         help: try {}",
        tries.join(", ")
    )))
}

/// The gradient clipping threshold of the plan's AdamW (None when it has no optimizer).
fn grad_clip(plan: &Plan) -> Option<f64> {
    plan.roles
        .iter()
        .flat_map(|r| &r.optimizer)
        .find_map(|i| match i {
            megac_ir::plan::Instr::Kernel {
                op: megac_ir::OpKind::AdamW { max_norm, .. },
                ..
            } => Some(*max_norm),
            _ => None,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(device_memory: Option<DeviceMemory>) -> serde_json::Value {
        let r = RunReport {
            steps: Vec::new(),
            tokens_per_s: 1.0,
            peak_rss_bytes: 0,
            peak_rss_bytes_per_rank: Vec::new(),
            start_rss_bytes: 0,
            arena_bytes: [0; 5],
            profile: None,
            pipeline_order: Vec::new(),
            checkpoints: Vec::new(),
            resumed: None,
            evals: Vec::new(),
            device_memory,
        };
        serde_json::from_str(&r.to_json()).unwrap()
    }

    #[test]
    fn the_report_has_device_memory_only_from_a_gpu_run() {
        assert!(report(None).get("device_memory").is_none());
        let m = DeviceMemory {
            allocation_bytes: 1 << 30,
            setup_bytes: (1 << 30) + (40 << 20),
            after_steps_bytes: (1 << 30) + (72 << 20),
            total_bytes: 141 << 30,
        };
        let v = &report(Some(m))["device_memory"];
        assert_eq!(v["allocation_bytes"], m.allocation_bytes);
        assert_eq!(v["setup_bytes"], m.setup_bytes);
        assert_eq!(v["after_steps_bytes"], m.after_steps_bytes);
        assert_eq!(v["total_bytes"], m.total_bytes);
    }
}
