//! Held-out evaluation: the mean loss of a plan's forward pass over global batches of a
//! second data source, during training (`--eval-data`, every `--eval-interval` steps and
//! after the last) and for given weights without training (`megac eval`, [`evaluate`]).
//!
//! Evaluation batch `k` (from 0) holds the global samples `k·G .. (k+1)·G - 1` of the eval
//! data (`G` the global batch), split over micro-batches and data-parallel ranks exactly as a
//! training step's are; its loss is the training step's loss (the cross-entropy averaged
//! over the batch's tokens), and an evaluation reports the mean over its batches.
//!
//! **Mechanism: the training plan's own forward segments, nothing else.** Each rank runs,
//! on its own shards, the instructions of its role that compute the loss in training: an
//! unpipelined role the micro-batch program up to the cross-entropy that writes `loss`
//! (autodiff appends the backward after the forward, so this prefix holds no backward op,
//! which is checked); a pipeline stage the forward segment of each `F` action of its
//! schedule, in the schedule's order (for MegaDPP its reference order), with one slot per
//! chunk (nothing is kept for a backward). Of a forward segment's sends, those no forward
//! segment of any role receives (activations whose first reader is another chunk's backward,
//! which codegen allows; no layout compiled today has one) are left out, so that no message
//! outlives the evaluation. The alternatives: running the whole step on
//! scratch gradients without the optimizer is as simple but costs the backward (about twice
//! the forward) and overwrites the gradient arena; a separate forward-only plan would change
//! the plan bytes and need a second compilation.
//!
//! Why this changes no state: forward instructions write activations (rewritten before any
//! later read by the next forward) and the loss; the gradients, the optimizer state, the
//! parameters, fp16's loss scaler, the data position and the learning rate are not touched,
//! so a run with evaluation trains exactly as without. Why it cannot deadlock or mismatch:
//! the kept instructions of every rank are a subsequence of its training program, keeping
//! every send together with its receive and every collective on all members of its group
//! (all ranks of one role keep the same instructions), so the plan gate's proof that the
//! training order completes (for MegaDPP: its reference order, which the gate checks)
//! carries over to the subsequence; sends are buffered
//! (`local_comm`, `mpi_comm`), and tags are matched in order, so the next training step's
//! messages never meet an evaluation's. The trace (`--trace`) and the profile leave
//! evaluations out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Instant;

use megac_ir::gate::CheckedPlan;
use megac_ir::plan::{BufId, Instr, PipeKind, Plan, Role};

use crate::data::{DataOptions, DataSource, DataSplit};
use crate::error::RuntimeError;
use crate::train::Session;

/// Evaluation during training (`--eval-data FILE --eval-interval N --eval-iters K`).
#[derive(Clone, Debug, PartialEq)]
pub struct EvalOptions {
    /// The held-out data: the kinds `--data` takes (`synthetic`, `.bin`, `.txt`).
    pub data: String,
    /// Evaluate after every step that is a multiple of this (and after the last); None:
    /// after the last step only.
    pub interval: Option<u64>,
    /// Global batches per evaluation (at least 1).
    pub iters: u64,
}

/// One evaluation of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalRecord {
    /// The step after whose update it ran (the weights of steps 1..=step).
    pub step: u64,
    /// Mean loss over its batches.
    pub loss: f64,
    /// Batches evaluated.
    pub batches: u64,
    /// Wall time.
    pub seconds: f64,
}

impl EvalRecord {
    /// `exp(loss)`.
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

/// The weights `megac eval` evaluates.
#[derive(Clone, Debug, PartialEq)]
pub enum Weights {
    /// A Hugging Face safetensors file.
    Safetensors(PathBuf),
    /// A checkpoint folder (its latest complete step) or a step folder (`--save`).
    Checkpoint(PathBuf),
}

/// What `megac eval` evaluates: weights on a data file.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalRun {
    /// The weights.
    pub weights: Weights,
    /// The data (the kinds `--data` takes).
    pub data: String,
    /// Global batches; None: every whole global batch of a token file (at least one).
    pub iters: Option<u64>,
    /// How to read the data (tokenizer, EOS, Megatron split; Megatron data is read from its
    /// validation part).
    pub data_options: DataOptions,
}

/// What `megac eval` measured.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalReport {
    /// The loss of every batch, in order.
    pub losses: Vec<f64>,
    /// Their mean.
    pub loss: f64,
    /// Samples evaluated (batches × global batch).
    pub samples: u64,
    /// Tokens evaluated (samples × sequence length).
    pub tokens: u64,
    /// The checkpoint's step, when the weights came from one.
    pub checkpoint_step: Option<u64>,
    /// Wall time of the forward passes (after loading).
    pub seconds: f64,
}

/// One rank's forward-only program: what it runs per micro-batch.
pub(crate) enum Forward<'p> {
    /// An unpipelined role: its micro-batch program up to the cross-entropy of `loss`.
    Whole(&'p [Instr]),
    /// A pipeline stage: per chunk its forward segment (without the sends nothing forward
    /// receives), and the (chunk, micro-batch) of each `F` action of the schedule, in order.
    Piped {
        /// Forward segment per chunk.
        chunks: BTreeMap<u32, Vec<Instr>>,
        /// Chunks that read the data inputs.
        reads_data: BTreeSet<u32>,
        /// The forward actions.
        actions: Vec<(u32, u32)>,
    },
}

/// The forward-only program of `role` (see the module documentation).
pub(crate) fn forward_program<'p>(
    plan: &'p Plan,
    role: &'p Role,
    loss: Option<BufId>,
) -> Result<Forward<'p>, RuntimeError> {
    let Some(pipe) = &role.pipeline else {
        let loss = loss.ok_or_else(|| {
            RuntimeError::Plan("the plan does not say where its `loss` is".into())
        })?;
        let end = role
            .microbatch
            .iter()
            .position(|i| matches!(i, Instr::Kernel { outputs, .. } if outputs.contains(&loss)))
            .ok_or_else(|| {
                RuntimeError::Plan(format!(
                    "role `{}`: no instruction of the micro-batch program writes the loss",
                    role.name
                ))
            })?;
        let prefix = &role.microbatch[..=end];
        if let Some(Instr::Kernel { op, path, .. }) = prefix
            .iter()
            .find(|i| matches!(i, Instr::Kernel { op, .. } if op.is_backward()))
        {
            return Err(RuntimeError::Plan(format!(
                "role `{}`: the backward op `{}` ({path}) runs before the loss, so the \
                 micro-batch program has no forward-only prefix to evaluate with",
                role.name,
                op.name()
            )));
        }
        return Ok(Forward::Whole(prefix));
    };
    // Transfers some forward segment (of any role) receives.
    let received: BTreeSet<(u32, bool)> = plan
        .roles
        .iter()
        .filter_map(|r| r.pipeline.as_ref())
        .flat_map(|p| &p.chunks)
        .flat_map(|c| &c.forward)
        .filter_map(|i| match *i {
            Instr::Recv { transfer, twin, .. } => Some((transfer, twin)),
            _ => None,
        })
        .collect();
    let chunks = pipe
        .chunks
        .iter()
        .map(|c| {
            let kept = c
                .forward
                .iter()
                .filter(|i| {
                    !matches!(**i, Instr::Send { transfer, twin, .. }
                        if !received.contains(&(transfer, twin)))
                })
                .cloned()
                .collect();
            (c.chunk, kept)
        })
        .collect();
    let reads_data = pipe
        .chunks
        .iter()
        .filter(|c| !c.inputs.is_empty())
        .map(|c| c.chunk)
        .collect();
    let m = plan.batch.microbatches;
    let mut actions = Vec::new();
    for a in pipe.actions.iter().filter(|a| a.kind == PipeKind::F) {
        if u64::from(a.microbatch) >= m || !pipe.chunks.iter().any(|c| c.chunk == a.chunk) {
            return Err(RuntimeError::Plan(format!(
                "pipeline action {a:?} names a micro-batch or chunk this role does not have ({m} micro-batches)"
            )));
        }
        actions.push((a.chunk, a.microbatch));
    }
    Ok(Forward::Piped {
        chunks,
        reads_data,
        actions,
    })
}

impl Session<'_> {
    /// Evaluate: the mean loss of `iters` batches of the eval data (the session's
    /// `eval_data`) under the current weights; a collective (every rank calls it). `step`
    /// is the training step it follows (0 for none). Returns every batch's loss.
    pub(crate) fn evaluate(&mut self, iters: u64, step: u64) -> Result<Vec<f64>, RuntimeError> {
        if self.eval_data.is_none() {
            return Err(RuntimeError::Plan("no evaluation data".into()));
        }
        let plan: &Plan = self.plan;
        let fwd = forward_program(plan, self.role(), self.loss_buf)?;
        // Evaluations are not training: neither the trace nor the profile records them.
        let profile = self.profile.take();
        let rec = self.comm.scan().and_then(|s| s.rec.take());
        let mut losses = Vec::with_capacity(iters as usize);
        let mut out = Ok(());
        for k in 0..iters {
            match self.eval_batch(&fwd, k, step) {
                Ok(l) => losses.push(l),
                Err(e) => {
                    out = Err(e);
                    break;
                }
            }
        }
        self.profile = profile;
        if let Some(s) = self.comm.scan() {
            s.rec = rec;
        }
        out.map(|()| losses)
    }

    /// The loss of eval batch `k` (from 0), reduced as a training step's loss.
    fn eval_batch(&mut self, fwd: &Forward<'_>, k: u64, step: u64) -> Result<f64, RuntimeError> {
        let m = self.plan.batch.microbatches;
        let step = step.max(1);
        let mut loss = 0.0;
        match fwd {
            Forward::Whole(prog) => {
                let ctx = self.context(step);
                for mb in 0..m {
                    let (tokens, labels) = self.load_eval(k, mb);
                    self.write_inputs(&tokens, &labels);
                    self.run(prog, &ctx)?;
                    loss += self.scalar(self.loss_buf);
                }
            }
            Forward::Piped {
                chunks,
                reads_data,
                actions,
            } => {
                let data: Vec<(Vec<i32>, Vec<i32>)> = if reads_data.is_empty() {
                    Vec::new()
                } else {
                    (0..m).map(|mb| self.load_eval(k, mb)).collect()
                };
                for &(c, j) in actions {
                    // Nothing of a micro-batch is kept after its forward: one slot serves all.
                    self.mem.set_slot(c, 0);
                    if reads_data.contains(&c) {
                        let (tokens, labels) = &data[j as usize];
                        self.write_inputs(tokens, labels);
                    }
                    let mut ctx = self.context(step);
                    ctx.microbatch = u64::from(j);
                    self.run(&chunks[&c], &ctx)?;
                    let mine = self
                        .loss_buf
                        .filter(|&b| self.mem.buffer(b).chunk == Some(c));
                    loss += self.scalar(mine);
                }
            }
        }
        self.reduce_loss(loss)
    }
}

/// The number of eval batches `megac eval` runs on `data`: `iters`, or every whole global
/// batch of a token file (at least one).
fn batches(data: &DataSource, plan: &Plan, iters: Option<u64>) -> Result<u64, RuntimeError> {
    if let Some(k) = iters {
        return if k == 0 {
            Err(RuntimeError::Unsupported(
                "--iters 0: evaluate at least one batch".into(),
            ))
        } else {
            Ok(k)
        };
    }
    match data.samples_in_file(plan.batch.seq_len as usize) {
        Some(n) => Ok((n / plan.batch.global_batch.max(1)).max(1)),
        None => Err(RuntimeError::Unsupported(format!(
            "data {}: how many batches to evaluate? give --iters K (synthetic data has no end)",
            data.name()
        ))),
    }
}

/// Open held-out data for `plan` (once, before the ranks start: one error naming the file),
/// read as the run's data is (`options`: its tokenizer, EOS, Megatron split), except that
/// a Megatron dataset or blend is read from its validation part, as Megatron evaluates, with
/// indices for `iters` global batches (None: one epoch).
pub(crate) fn open_data(
    plan: &Plan,
    spec: &str,
    options: &DataOptions,
    iters: Option<u64>,
) -> Result<DataSource, RuntimeError> {
    let b = &plan.batch;
    let options = DataOptions {
        split_part: DataSplit::Valid,
        samples: iters.map(|k| k.saturating_mul(b.global_batch)),
        ..options.clone()
    };
    DataSource::open_with(
        spec,
        &options,
        b.seq_len as usize,
        b.vocab as u32,
        plan.train.seed,
    )
}

/// `megac eval`: the loss of `run.weights` on `run.data` with `plan` (any layout: one rank,
/// or one thread per rank on the local communicator). Rank 0's report is returned (every
/// rank computes the same losses).
pub fn evaluate(plan: &CheckedPlan, run: &EvalRun) -> Result<EvalReport, RuntimeError> {
    let data = open_data(plan, &run.data, &run.data_options, run.iters)?;
    let iters = batches(&data, plan, run.iters)?;
    let ckpt = match &run.weights {
        Weights::Checkpoint(dir) => {
            let c = crate::checkpoint::Checkpoint::open(dir)?;
            c.check_model(plan)?;
            Some(c)
        }
        Weights::Safetensors(_) => None,
    };
    let world = plan.mesh.world_size();
    let rank = |comm: Box<dyn crate::comm::Communicator>| {
        evaluate_rank(plan, run, &data, iters, ckpt.as_ref(), comm)
    };
    if world == 1 {
        return rank(Box::new(crate::comm::SingleRank));
    }
    let mut reports = crate::local_comm::run_ranks(world, |comm| rank(Box::new(comm)))?;
    Ok(reports.swap_remove(0))
}

fn evaluate_rank(
    plan: &CheckedPlan,
    run: &EvalRun,
    data: &DataSource,
    iters: u64,
    ckpt: Option<&crate::checkpoint::Checkpoint>,
    comm: Box<dyn crate::comm::Communicator>,
) -> Result<EvalReport, RuntimeError> {
    let init = match &run.weights {
        Weights::Safetensors(p) => Some(p.as_path()),
        Weights::Checkpoint(_) => None,
    };
    // The training data is not read: the session's eval data is the file.
    let mut session = Session::with_comm(plan, "synthetic", init, comm)?;
    if let Some(c) = ckpt {
        crate::checkpoint::load(&mut session, c)?;
    }
    session.eval_data = Some(data.clone());
    let t0 = Instant::now();
    let losses = session.evaluate(iters, 0)?;
    let b = &plan.batch;
    Ok(EvalReport {
        loss: losses.iter().sum::<f64>() / losses.len().max(1) as f64,
        losses,
        samples: iters * b.global_batch,
        tokens: iters * b.global_batch * b.seq_len,
        checkpoint_step: ckpt.map(|c| c.index.step),
        seconds: t0.elapsed().as_secs_f64(),
    })
}
