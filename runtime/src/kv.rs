//! KV-cache decoding (`megac generate`'s default) over a KV-cache plan
//! (`megac_codegen::kv::kv_plan`: one inference plan with the caches, the prefill and the
//! decode step; docs/generate.md). The caches are plan buffers of class `kv_cache`, written
//! by the plan's `kv_attention` instructions; this module only writes the data inputs (the
//! tokens and the step's position) and runs the plan's programs through the executor:
//! the prefill (the micro-batch program, or each chunk's forward) once for the prompt at
//! position 0, then the decode step (each role's `decode.step`, or each chunk's `decode`)
//! once per new token at its position. Every rank holds one parameter arena. Under cp every
//! cp rank runs the same decode step; each caches the positions it holds (the executor's
//! `kv_attention`).

use megac_ir::gate::CheckedPlan;
use megac_ir::plan::{BufId, Instr};
use megac_ir::OpKind;

use crate::comm::Communicator;
use crate::error::RuntimeError;
use crate::infer::{Generated, Inference, Sampling};

/// The `--set`s that compile the block plan from the model.toml (and `--set`s) of
/// `window`: `model.seq_len` = one token per tp rank, `parallel.cp=1` under cp (the block is
/// not split over cp; with ep > 1 also `parallel.dp` = dp·cp and one sample per replica, so
/// the block's expert groups are the window's), and under pp the window plan's layers
/// per chunk as `parallel.stage_layers` (so a `"balanced"` split, which weighs layers at
/// the plan's length, places the block's layers on the same stages).
pub fn block_sets(window: &CheckedPlan) -> Vec<String> {
    let tp = window.mesh.size(megac_ir::Axis::Tp);
    let mut sets = vec![format!("model.seq_len={tp}")];
    let (cp, ep) = (
        window.mesh.size(megac_ir::Axis::Cp),
        window.mesh.size(megac_ir::Axis::Ep),
    );
    if cp > 1 {
        // One token is not split over cp: every cp rank runs the block (the caches are).
        sets.push("parallel.cp=1".into());
        if ep > 1 {
            // Expert parallelism folds over dp·cp: the block keeps those ranks as its dp
            // (one sample each, the same token), so its expert groups are the window's.
            let dp = window.mesh.size(megac_ir::Axis::Dp) * cp;
            sets.push(format!("parallel.dp={dp}"));
            sets.push(format!("train.global_batch={dp}"));
        }
    }
    let mut chunks: Vec<(u32, u64)> = window
        .roles
        .iter()
        .filter_map(|r| r.pipeline.as_ref())
        .flat_map(|p| p.chunks.iter())
        .filter_map(|c| c.layers.map(|[a, b]| (c.chunk, b.saturating_sub(a))))
        .collect();
    chunks.sort_unstable();
    chunks.dedup_by_key(|c| c.0);
    if !chunks.is_empty() {
        let counts: Vec<u64> = chunks.into_iter().map(|(_, n)| n).collect();
        sets.push(format!("parallel.stage_layers={counts:?}"));
    }
    sets
}

/// The logits buffer of a decode step: the first operand of its cross-entropy.
fn logits_of(program: &[Instr]) -> Option<BufId> {
    program.iter().find_map(|i| match i {
        Instr::Kernel {
            op: OpKind::CrossEntropy,
            inputs,
            ..
        } => inputs.first().copied(),
        _ => None,
    })
}

/// Generation through a KV-cache plan on one rank.
pub struct KvDecoder<'p> {
    inf: Inference<'p>,
    plan: &'p CheckedPlan,
    /// This rank's decode step: (pipeline chunk or None, instructions), in chunk order.
    steps: Vec<(Option<u32>, &'p [Instr])>,
    /// The step's logits (on the stage that computes them).
    logits: BufId,
    /// Whether this rank computes the step's logits.
    owns_logits: bool,
    /// The step's data inputs on this rank: tokens, labels.
    tokens: Option<BufId>,
    labels: Option<BufId>,
    position: BufId,
}

impl<'p> KvDecoder<'p> {
    /// Load `init` into the KV-cache plan `plan` for the rank `comm` stands for.
    pub fn with_comm(
        plan: &'p CheckedPlan,
        init: &std::path::Path,
        comm: Box<dyn Communicator>,
    ) -> Result<Self, RuntimeError> {
        let info = plan.decode.as_ref().ok_or_else(|| {
            RuntimeError::Plan("the plan has no decode step (not a KV-cache plan)".into())
        })?;
        let rank = comm.rank();
        let inf = Inference::with_comm(plan, init, comm)?;
        let role = &plan.roles[plan.rank_to_role[rank] as usize];
        let decode = role
            .decode
            .as_ref()
            .ok_or_else(|| RuntimeError::Plan(format!("rank {rank}'s role has no decode step")))?;
        let mut steps: Vec<(Option<u32>, &'p [Instr])> = Vec::new();
        match &role.pipeline {
            Some(p) => {
                let mut chunks: Vec<_> = p.chunks.iter().collect();
                chunks.sort_by_key(|c| c.chunk);
                steps.extend(chunks.into_iter().map(|c| (Some(c.chunk), &c.decode[..])));
            }
            None => steps.push((None, &decode.step[..])),
        }
        let mine = steps.iter().find_map(|(_, p)| logits_of(p));
        // The step's logits, on the stage that runs the head: the first operand of the
        // decode step's cross-entropy, whichever role holds it.
        let logits = plan
            .roles
            .iter()
            .flat_map(|r| {
                let chunks = r
                    .pipeline
                    .iter()
                    .flat_map(|p| p.chunks.iter().map(|c| &c.decode[..]));
                r.decode.iter().map(|d| &d.step[..]).chain(chunks)
            })
            .find_map(logits_of)
            .ok_or_else(|| RuntimeError::Plan("the decode step computes no logits".into()))?;
        let (tokens, labels) = match &role.pipeline {
            None => (
                decode.inputs.get("tokens").copied(),
                decode.inputs.get("labels").copied(),
            ),
            Some(p) => {
                let ins: Vec<BufId> = p
                    .chunks
                    .iter()
                    .flat_map(|c| c.decode_inputs.iter().copied())
                    .collect();
                let by = |name: &str| decode.inputs.get(name).copied().filter(|b| ins.contains(b));
                (by("tokens"), by("labels"))
            }
        };
        Ok(KvDecoder {
            inf,
            plan,
            steps,
            owns_logits: mine == Some(logits),
            logits,
            tokens,
            labels,
            position: info.position,
        })
    }

    /// The context window (the cache's positions).
    pub fn context(&self) -> usize {
        self.inf.context()
    }

    /// The vocabulary size.
    pub fn vocab(&self) -> usize {
        self.inf.vocab()
    }

    /// Write the step's position input.
    fn set_position(&mut self, at: usize) {
        let at = i32::try_from(at).unwrap_or(i32::MAX);
        self.inf.session.mem.i32_mut(self.position)[0] = at;
    }

    /// Run the prompt through the prefill (filling the caches from position 0); its
    /// logits, `prompt.len()` rows.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        self.set_position(0);
        self.inf.logits(prompt)
    }

    /// Run `token` at position `at` through the decode step (after a prefill of at least
    /// `at` tokens and the steps before it): its logits, one row.
    pub fn step(&mut self, token: u32, at: usize) -> Result<Vec<f32>, RuntimeError> {
        if at >= self.context() {
            return Err(RuntimeError::Unsupported(format!(
                "position {at} is outside the model's context of seq_len = {} tokens",
                self.context()
            )));
        }
        if token as usize >= self.vocab() {
            return Err(RuntimeError::Unsupported(format!(
                "token {token} is outside the vocabulary [0, {})",
                self.vocab()
            )));
        }
        self.set_position(at);
        let mem = &mut self.inf.session.mem;
        if let Some(b) = self.tokens {
            let ids = mem.i32_mut(b);
            ids.fill(0);
            ids[0] = token as i32;
        }
        if let Some(b) = self.labels {
            mem.i32_mut(b).fill(0);
        }
        let ctx = self.inf.session.context(1);
        for &(chunk, program) in &self.steps {
            if let Some(c) = chunk {
                self.inf.session.mem.set_slot(c, 0);
            }
            self.inf.session.run(program, &ctx)?;
        }
        let buf = &self.plan.buffers[self.logits as usize];
        let local = if self.owns_logits {
            self.inf.session.mem.read_f32(self.logits)
        } else {
            vec![0.0; buf.len() as usize]
        };
        let (shape, all) =
            self.inf
                .gather(&buf.shape, &buf.layout, &local, false, self.owns_logits)?;
        let row = shape.last().copied().unwrap_or(0) as usize;
        Ok(all[..self.vocab().min(row)].to_vec())
    }

    /// The logits of every position of `tokens` computed through the cache: a prefill of
    /// the first `prompt` tokens, then one step per later token (teacher forcing).
    pub fn logits(&mut self, tokens: &[u32], prompt: usize) -> Result<Vec<f32>, RuntimeError> {
        let mut out = self.prefill(&tokens[..prompt.clamp(1, tokens.len())])?;
        for (at, &t) in tokens.iter().enumerate().skip(prompt.max(1)) {
            out.extend(self.step(t, at)?);
        }
        Ok(out)
    }

    /// Generate `max_new` tokens after `prompt`: one prefill, then one step per token.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
    ) -> Result<Generated, RuntimeError> {
        self.inf.check_generation(prompt, max_new)?;
        let v = self.vocab();
        crate::infer::decode(prompt, max_new, sampling, |seq, i| {
            if i == 0 {
                let logits = self.prefill(prompt)?;
                Ok(logits[(prompt.len() - 1) * v..prompt.len() * v].to_vec())
            } else {
                self.step(seq[seq.len() - 1], seq.len() - 1)
            }
        })
    }
}

/// Run `f` on a [`KvDecoder`] of the KV-cache plan `plan` with the weights of `init`: on
/// this thread for a one-device plan, else one thread per rank (rank 0's result is
/// returned).
pub fn with_ranks_kv<T: Send>(
    plan: &CheckedPlan,
    init: &std::path::Path,
    f: impl Fn(&mut KvDecoder) -> Result<T, RuntimeError> + Sync,
) -> Result<T, RuntimeError> {
    Inference::supports_kv(plan)?;
    let world = plan.mesh.world_size();
    if world == 1 {
        let comm = Box::new(crate::comm::SingleRank);
        return f(&mut KvDecoder::with_comm(plan, init, comm)?);
    }
    let mut results = crate::local_comm::run_ranks(world, |comm| {
        f(&mut KvDecoder::with_comm(plan, init, Box::new(comm))?)
    })?;
    Ok(results.swap_remove(0))
}
