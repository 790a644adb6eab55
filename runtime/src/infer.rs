//! Forward-only execution of a compiled plan: logits for a token sequence, and greedy or
//! sampled generation (`megac generate`).
//!
//! The plan is the training plan of the model (one micro-batch of one sample); the runtime
//! runs its micro-batch program's forward instructions only, up to the one that writes the
//! logits (the cross-entropy's first operand), and never the loss, the backward or the
//! optimizer. Tensor-, pipeline-, context-, data- and expert-parallel plans run one thread
//! per rank (the local communicator; a pipeline stage runs its chunks' forward programs in
//! chunk order, as a forward pipeline; a cp rank is fed its load-balanced chunks of the
//! sequence; every dp replica runs the same sample; ep folds over dp·cp), and the
//! logits and probed tensors are gathered to their global shape from the buffers' layouts
//! (the cp chunks put back in order) and the stage that computed them. The plan's `seq_len` is the context window: a sequence shorter than it is
//! padded with token 0, which changes no logit at its real positions because attention is
//! causal (and MoE routing is per token and dropless). [`Inference::generate`] reruns the
//! forward over the whole prefix for each new token; [`crate::kv`] decodes with a KV cache.

use megac_ir::gate::CheckedPlan;
use megac_ir::plan::{BufId, Instr};
use megac_ir::{Axis, OpKind};

use crate::error::RuntimeError;
use crate::train::Session;

/// A plan loaded with weights, ready to run forward.
pub struct Inference<'p> {
    pub(crate) session: Session<'p>,
    /// This rank's forward segments in the order it runs them: (pipeline chunk or None,
    /// instructions); the one with the loss ends at the logits' writer.
    segments: Vec<Segment<'p>>,
    /// Every chunk's forward segment in the model (on any rank), for the probe points.
    all: Vec<Segment<'p>>,
    logits: BufId,
    /// Whether this rank computes the logits (the last pipeline stage; every tp rank).
    owns_logits: bool,
    /// The replacements of `patch` perturbations: plan input, file, shape, values.
    patches: Vec<(BufId, String, Vec<usize>, Vec<f32>)>,
    /// Tokens per position the logit lens keeps.
    lens_k: usize,
    /// Logits per position in the buffer (the padded vocabulary).
    row: usize,
}

/// A forward segment: the pipeline chunk (None: an unpipelined role) and its instructions.
pub(crate) type Segment<'p> = (Option<u32>, &'p [Instr]);

/// A forward program cut after the instruction that writes the logits (the cross-entropy's
/// first operand), if the program computes the loss: (the cut program, the logits).
fn cut_at_logits(program: &[Instr]) -> Option<(&[Instr], BufId)> {
    let ce = program.iter().position(|i| {
        matches!(
            i,
            Instr::Kernel {
                op: OpKind::CrossEntropy,
                ..
            }
        )
    })?;
    let Instr::Kernel { inputs, .. } = &program[ce] else {
        return None;
    };
    let logits = *inputs.first()?;
    let mut end = program[..ce]
        .iter()
        .rposition(|i| matches!(i, Instr::Kernel { outputs, .. } if outputs.contains(&logits)))?;
    // With the probes of the logits (the `probe` pass puts them right after its writer).
    while matches!(
        program.get(end + 1),
        Some(Instr::Kernel {
            op: OpKind::Probe { .. },
            ..
        })
    ) && end + 1 < ce
    {
        end += 1;
    }
    Some((&program[..=end], logits))
}

/// The forward segments of `role`: its chunks' forward programs by ascending chunk, or the
/// micro-batch program; the one that computes the loss cut at the logits.
pub(crate) fn segments_of(role: &megac_ir::plan::Role) -> (Vec<Segment<'_>>, Option<BufId>) {
    let mut logits = None;
    let mut out = Vec::new();
    match &role.pipeline {
        Some(pipe) => {
            let mut chunks: Vec<&megac_ir::plan::ChunkProgram> = pipe.chunks.iter().collect();
            chunks.sort_by_key(|c| c.chunk);
            for c in chunks {
                match cut_at_logits(&c.forward) {
                    Some((prog, l)) => {
                        logits = Some(l);
                        out.push((Some(c.chunk), prog));
                    }
                    None => out.push((Some(c.chunk), &c.forward[..])),
                }
            }
        }
        None => {
            if let Some((prog, l)) = cut_at_logits(&role.microbatch) {
                logits = Some(l);
                out.push((None, prog));
            }
        }
    }
    (out, logits)
}

/// How the next token is chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// 0: greedy (the most likely token, the lowest id on ties), else the softmax's temperature.
    pub temperature: f64,
    /// Keep only the `k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `p` (1: all).
    pub top_p: f64,
    /// Seed of the sampler.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// A finished generation.
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    /// The new token ids (after the prompt).
    pub tokens: Vec<u32>,
    /// Seconds spent generating them.
    pub seconds: f64,
}

impl<'p> Inference<'p> {
    /// Check that forward-only runs support `plan`'s layout: one device, tensor, pipeline,
    /// context, data and expert parallelism (not FBD). Every data-parallel replica runs the
    /// same sample (the plan's global batch is one sample per replica), and what is split
    /// over dp is gathered like any other split and cut to the first sample; expert
    /// parallelism folds over dp·cp and moves the tokens to their experts' ranks and back
    /// inside the forward.
    pub fn supports(plan: &CheckedPlan) -> Result<(), RuntimeError> {
        let m = &plan.mesh;
        let dense = m.size(Axis::Tp) * m.size(Axis::Pp) * m.size(Axis::Cp) * m.size(Axis::Dp);
        if m.world_size() as u64 != dense {
            return Err(RuntimeError::Unsupported(
                "forward-only runs support tensor, pipeline, context, data and expert \
                 parallel layouts only so far; this layout has forward/backward decoupling \
                 (parallel.fbd): set it off"
                    .to_string(),
            ));
        }
        Ok(())
    }

    /// As [`Inference::supports`], for KV-cache decoding ([`crate::kv`]): the same layouts
    /// (under cp each rank caches the positions it holds).
    pub fn supports_kv(plan: &CheckedPlan) -> Result<(), RuntimeError> {
        Self::supports(plan)
    }

    /// Load the weights of `init` into `plan`'s single rank (`megac generate` compiles a
    /// one-sample plan).
    pub fn new(plan: &'p CheckedPlan, init: &std::path::Path) -> Result<Self, RuntimeError> {
        Self::with_comm(plan, init, Box::new(crate::comm::SingleRank))
    }

    /// As [`Inference::new`], for the rank `comm` stands for (tensor-parallel plans).
    pub fn with_comm(
        plan: &'p CheckedPlan,
        init: &std::path::Path,
        comm: Box<dyn crate::comm::Communicator>,
    ) -> Result<Self, RuntimeError> {
        Self::supports(plan)?;
        let session = Session::with_comm(plan, "synthetic", Some(init), comm)?;
        Self::from_session(plan, session)
    }

    /// As [`Inference::with_comm`], with the weights copied from `other`'s session (a plan
    /// of the same model and layout on the same rank, e.g. compiled for another `seq_len`):
    /// every parameter of the same name and local size; one `other` does not hold is an
    /// error, one of another size (GPT-2's position table) is left as initialised.
    pub fn with_params_of(
        plan: &'p CheckedPlan,
        other: &mut Inference<'_>,
        comm: Box<dyn crate::comm::Communicator>,
    ) -> Result<Self, RuntimeError> {
        Self::supports(plan)?;
        let mut session = Session::with_comm(plan, "synthetic", None, comm)?;
        let src = &other.session;
        for p in &plan.params {
            let held: Vec<BufId> = std::iter::once(p.buffer)
                .chain(p.tied_copies.iter().copied())
                .filter(|&b| session.mem.holds(b))
                .collect();
            if held.is_empty() {
                continue;
            }
            let from = src
                .plan
                .params
                .iter()
                .find(|q| q.name == p.name)
                .and_then(|q| {
                    std::iter::once(q.buffer)
                        .chain(q.tied_copies.iter().copied())
                        .find(|&b| src.mem.holds(b))
                })
                .ok_or_else(|| {
                    RuntimeError::Plan(format!(
                        "rank {}: the plans place parameter `{}` on different pipeline stages",
                        session.comm.rank(),
                        p.name
                    ))
                })?;
            let values = src.mem.read_f32(from);
            for b in held {
                if session.mem.buffer(b).len() == values.len() as u64 {
                    session.mem.write_f32(b, &values);
                }
            }
        }
        Self::from_session(plan, session)
    }

    /// This rank's values of parameter `name` (None where it holds none).
    pub fn param_values(&self, name: &str) -> Option<Vec<f32>> {
        let p = self.session.plan.params.iter().find(|p| p.name == name)?;
        std::iter::once(p.buffer)
            .chain(p.tied_copies.iter().copied())
            .find(|&b| self.session.mem.holds(b))
            .map(|b| self.session.mem.read_f32(b))
    }

    /// An inference over `session`'s memory and weights.
    fn from_session(plan: &'p CheckedPlan, session: Session<'p>) -> Result<Self, RuntimeError> {
        let comm = &session.comm;
        let role = plan
            .rank_to_role
            .get(comm.rank())
            .and_then(|&r| plan.roles.get(r as usize))
            .ok_or_else(|| RuntimeError::Plan(format!("rank {} has no role", comm.rank())))?;
        let (segments, mine) = segments_of(role);
        // Every chunk of the model, once (tp ranks share roles).
        let mut all: Vec<Segment<'p>> = Vec::new();
        let mut logits = None;
        for r in &plan.roles {
            let (segs, l) = segments_of(r);
            logits = logits.or(l);
            for seg in segs {
                if !all.iter().any(|(c, _)| *c == seg.0) {
                    all.push(seg);
                }
            }
        }
        all.sort_by_key(|(c, _)| *c);
        let logits = logits
            .ok_or_else(|| RuntimeError::Plan("the plan computes no cross_entropy".into()))?;
        let lb = &plan.buffers[logits as usize];
        let row = global_shape(plan, &lb.shape, &lb.layout)
            .last()
            .copied()
            .unwrap_or(0) as usize;
        if row < plan.batch.vocab as usize {
            return Err(RuntimeError::Plan(format!(
                "the logits have {row} entries per token, fewer than the vocabulary ({})",
                plan.batch.vocab
            )));
        }
        Ok(Inference {
            session,
            segments,
            all,
            logits,
            owns_logits: mine == Some(logits),
            patches: Vec::new(),
            lens_k: 5,
            row,
        })
    }

    /// The context window: the most tokens a sequence may have (the plan's `seq_len`).
    pub fn context(&self) -> usize {
        self.session.plan.batch.seq_len as usize
    }

    /// The vocabulary size (logits per position).
    pub fn vocab(&self) -> usize {
        self.session.plan.batch.vocab as usize
    }

    /// Check `tokens` against the vocabulary and the context window.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<(), RuntimeError> {
        let bad = |m: String| Err(RuntimeError::Unsupported(m));
        if tokens.is_empty() {
            return bad("the prompt has no tokens".into());
        }
        if tokens.len() > self.context() {
            return bad(format!(
                "{} tokens do not fit the model's context of seq_len = {} tokens",
                tokens.len(),
                self.context()
            ));
        }
        if let Some((i, t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= self.vocab())
        {
            return bad(format!(
                "token {i} is {t}, outside the vocabulary [0, {})",
                self.vocab()
            ));
        }
        Ok(())
    }

    /// Run the forward over `tokens` (padded to the context window), calling `visit` after
    /// each instruction with its segment's chunk, its index and the memory. A pipeline stage
    /// runs its chunks' forwards in chunk order as micro-batch 0 (a forward pipeline: each
    /// receives its input from the previous stage and sends its output on).
    pub fn run_with(
        &mut self,
        tokens: &[u32],
        visit: impl FnMut(Option<u32>, usize, &Instr, &crate::memory::Memory),
    ) -> Result<(), RuntimeError> {
        self.run_inner(tokens, visit)
    }

    /// [`Inference::run_with`]'s body.
    fn run_inner(
        &mut self,
        tokens: &[u32],
        mut visit: impl FnMut(Option<u32>, usize, &Instr, &crate::memory::Memory),
    ) -> Result<(), RuntimeError> {
        self.check_tokens(tokens)?;
        let (mb, s) = (self.session.plan.batch.micro_batch as usize, self.context());
        let mut ids = vec![0i32; mb * s];
        for (x, &t) in ids.iter_mut().zip(tokens) {
            *x = t as i32;
        }
        let labels = vec![0i32; mb * s];
        // Under context parallelism, this rank's load-balanced chunks of the sequence.
        let (ids, labels) = self.session.local_inputs(&ids, &labels);
        self.session.write_inputs(&ids, &labels);
        let ctx = self.session.context(1);
        // The replacements of `patch` perturbations: this rank's part of the real tokens'
        // rows of the first sample.
        for i in 0..self.patches.len() {
            let (b, _, _, _) = &self.patches[i];
            let b = *b;
            let part = self.patch_part(i, tokens.len())?;
            if self.session.mem.holds(b) {
                let mut x = self.session.mem.read_f32(b);
                x[..part.len()].copy_from_slice(&part);
                self.session.mem.write_f32(b, &x);
            }
        }
        let mut result = Ok(());
        'run: for &(chunk, program) in &self.segments {
            if let Some(c) = chunk {
                self.session.mem.set_slot(c, 0);
            }
            for (i, instr) in program.iter().enumerate() {
                if let Err(e) = self.session.run(std::slice::from_ref(instr), &ctx) {
                    result = Err(e);
                    break 'run;
                }
                visit(chunk, i, instr, &self.session.mem);
            }
        }
        result
    }

    /// Gather a tensor whose part on each rank has shape `local_shape` (a plan buffer's
    /// shape), split by `layout` (per dim, the mesh axes that split it), from every rank's
    /// `local` values: every rank gets the global shape and the whole tensor. The parts are
    /// summed over the world into zeros, each element from one rank (replicated dims from
    /// the ranks at coordinate 0), so the values are exact.
    ///
    /// A `partial` tensor is a pending sum over tp (each rank holds an addend, as a
    /// row-parallel linear's output before its all-reduce): every tp rank's part is added.
    pub fn gather(
        &mut self,
        local_shape: &[u64],
        layout: &[Vec<Axis>],
        local: &[f32],
        partial: bool,
        owner: bool,
    ) -> Result<(Vec<u64>, Vec<f32>), RuntimeError> {
        let plan = self.session.plan;
        let world = plan.mesh.world_size();
        let shape = global_shape(plan, local_shape, layout);
        if world == 1 {
            return Ok((shape, local.to_vec()));
        }
        let rank = self.session.comm.rank();
        let axes_of = |d: usize| layout.get(d).cloned().unwrap_or_default();
        let split_axes: Vec<Axis> = (0..shape.len()).flat_map(axes_of).collect();
        // The pipeline stage that holds the tensor (`owner`) gives it; the others add zeros.
        // A rank gives its part if it is the first of the ranks holding that part: coordinate
        // 0 on every dense axis (tp, cp, dp) that does not split it. `ep` folds over dp·cp
        // and adds no ranks: a part split over ep is given by the expert-data-parallel
        // group's first rank instead (coordinate 0 along edp).
        let by_experts = split_axes.contains(&Axis::Ep);
        let contributes = owner
            && [Axis::Tp, Axis::Cp, Axis::Dp].iter().all(|a| {
                split_axes.contains(a)
                    || (partial && *a == Axis::Tp)
                    || (by_experts && *a != Axis::Tp)
                    || plan.mesh.coord(rank, *a) == 0
            })
            && (!by_experts || plan.mesh.coord(rank, Axis::Edp) == 0);
        let local_shape: Vec<usize> = local_shape.iter().map(|&d| d as usize).collect();
        // Per dim, the global index of each local index (the sequence under cp: the
        // load-balanced chunks, put back in order).
        let positions: Vec<Vec<usize>> = (0..shape.len())
            .map(|d| crate::sharded::dim_positions(&plan.mesh, rank, &axes_of(d), local_shape[d]))
            .collect();
        let total: usize = shape.iter().product::<u64>() as usize;
        let mut global = vec![0f32; total];
        if contributes && local.len() == local_shape.iter().product::<usize>() {
            let mut at = vec![0usize; shape.len()];
            for (i, &x) in local.iter().enumerate() {
                // Row-major local index -> global index.
                let mut rest = i;
                for d in (0..shape.len()).rev() {
                    at[d] = rest % local_shape[d];
                    rest /= local_shape[d];
                }
                let (mut g, mut stride) = (0usize, 1usize);
                for d in (0..shape.len()).rev() {
                    g += positions[d][at[d]] * stride;
                    stride *= shape[d] as usize;
                }
                global[g] = x;
            }
        }
        let ranks: Vec<usize> = (0..world).collect();
        self.session.comm.all_reduce_sum(&ranks, &mut global)?;
        Ok((shape, global))
    }

    /// Buffer `b` of every rank, gathered to its global shape.
    fn gather_buffer(
        &mut self,
        b: BufId,
        local: &[f32],
        partial: bool,
        owner: bool,
    ) -> Result<(Vec<u64>, Vec<f32>), RuntimeError> {
        let buf = &self.session.plan.buffers[b as usize];
        self.gather(&buf.shape, &buf.layout, local, partial, owner)
    }

    /// The logits of every position of `tokens`: `tokens.len()` rows of `vocab()` values.
    pub fn logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        self.run_with(tokens, |_, _, _, _| {})?;
        self.read_logits(tokens.len())
    }

    /// The first `n` rows of the last run's logits, gathered.
    fn read_logits(&mut self, n: usize) -> Result<Vec<f32>, RuntimeError> {
        let local = if self.owns_logits {
            self.session.mem.read_f32(self.logits)
        } else {
            vec![0.0; self.session.mem.buffer(self.logits).len() as usize]
        };
        let owner = self.owns_logits;
        let (_, all) = self.gather_buffer(self.logits, &local, false, owner)?;
        let v = self.vocab();
        Ok(all
            .chunks(self.row)
            .take(n)
            .flat_map(|r| r[..v].iter().copied())
            .collect())
    }

    /// Check that `prompt` and `max_new` new tokens fit the vocabulary and the context.
    pub fn check_generation(&self, prompt: &[u32], max_new: usize) -> Result<(), RuntimeError> {
        self.check_tokens(prompt)?;
        if prompt.len() + max_new > self.context() {
            return Err(RuntimeError::Unsupported(format!(
                "{} prompt tokens + {max_new} new tokens do not fit the model's context of \
                 seq_len = {} tokens",
                prompt.len(),
                self.context()
            )));
        }
        Ok(())
    }

    /// Generate up to `max_new` tokens after `prompt` (fewer if the context fills: an error
    /// says so instead).
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
    ) -> Result<Generated, RuntimeError> {
        self.check_generation(prompt, max_new)?;
        let v = self.vocab();
        decode(prompt, max_new, sampling, |seq, _| {
            let logits = self.logits(seq)?;
            Ok(logits[(seq.len() - 1) * v..seq.len() * v].to_vec())
        })
    }
}

/// The decoding loop of both generation paths: `next(seq, i)` gives the logits of the token
/// after `seq` (one row of the vocabulary) at new token `i`; each row is checked finite and
/// a token chosen from it by `sampling`.
pub(crate) fn decode(
    prompt: &[u32],
    max_new: usize,
    sampling: &Sampling,
    mut next: impl FnMut(&[u32], usize) -> Result<Vec<f32>, RuntimeError>,
) -> Result<Generated, RuntimeError> {
    let start = std::time::Instant::now();
    let mut rng = SplitMix64(sampling.seed);
    let mut seq = prompt.to_vec();
    for i in 0..max_new {
        let last = next(&seq, i)?;
        if let Some(x) = last.iter().find(|x| !x.is_finite()) {
            return Err(RuntimeError::NonFinite(format!(
                "a logit at position {} is {x}: the weights give no distribution",
                seq.len() - 1
            )));
        }
        seq.push(choose(&last, sampling, &mut rng));
    }
    Ok(Generated {
        tokens: seq[prompt.len()..].to_vec(),
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The next token from one position's logits.
pub fn choose(logits: &[f32], s: &Sampling, rng: &mut SplitMix64) -> u32 {
    let argmax = |xs: &[f32]| {
        let mut best = 0;
        for (i, &x) in xs.iter().enumerate() {
            if x > xs[best] {
                best = i;
            }
        }
        best as u32
    };
    if s.temperature <= 0.0 {
        return argmax(logits);
    }
    // Temperature, then top-k, then top-p, as transformers' logits warpers.
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let keep_k = if s.top_k == 0 {
        order.len()
    } else {
        s.top_k.min(order.len())
    };
    order.truncate(keep_k);
    let top = f64::from(logits[order[0]]);
    let mut probs: Vec<f64> = order
        .iter()
        .map(|&i| ((f64::from(logits[i]) - top) / s.temperature).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if s.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if acc >= s.top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        order.truncate(keep);
    }
    let total: f64 = probs.iter().sum();
    let mut u = rng.next_f64() * total;
    for (&i, &p) in order.iter().zip(&probs) {
        if u < p {
            return i as u32;
        }
        u -= p;
    }
    order[order.len() - 1] as u32
}

/// The sampler's generator (a seed gives the same tokens on every machine).
pub use crate::rng::SplitMix64;

/// A probed tensor at its global shape (batch 1, the real tokens only).
#[derive(Clone, Debug, PartialEq)]
pub struct Probe {
    /// Its name (`embed`, `layers.0.out`, ...; docs/scope.md).
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub values: Vec<f32>,
}

/// Where a probe point is: (pipeline chunk or None, instruction index in its segment).
pub use megac_ir::perturb::glob;

/// A probe instruction of the plan: its segment's chunk, its point, its part and result.
#[derive(Clone, Debug)]
struct ProbeOp {
    chunk: Option<u32>,
    name: String,
    part: String,
    buf: BufId,
}

impl Inference<'_> {
    /// The `probe` instructions of the plan's forward (the `probe` pass inserted them), in
    /// forward order.
    fn probe_ops(&self) -> Vec<ProbeOp> {
        let mut out = Vec::new();
        for (chunk, program) in &self.all {
            for instr in program.iter() {
                if let Instr::Kernel {
                    op: OpKind::Probe { name, part },
                    outputs,
                    ..
                } = instr
                {
                    out.push(ProbeOp {
                        chunk: *chunk,
                        name: name.clone(),
                        part: part.clone(),
                        buf: outputs[0],
                    });
                }
            }
        }
        out
    }

    /// The names of the probe points the plan was compiled with, in forward order.
    pub fn probe_names(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for p in self.probe_ops() {
            if !names.contains(&p.name) {
                names.push(p.name);
            }
        }
        names
    }

    /// Run the forward over `tokens` and return the probe points matching any of
    /// `patterns` (`*` matches any run of characters), in forward order: the points the
    /// plan's `probe` instructions copied, gathered to their global shape from their
    /// buffers' layouts (and the pipeline stage that ran them). A pattern that matches no
    /// probe of the plan is an error listing them (the plan is compiled with its probes:
    /// `megac_passes::Instrument::probes`).
    pub fn probe(
        &mut self,
        tokens: &[u32],
        patterns: &[String],
    ) -> Result<Vec<Probe>, RuntimeError> {
        let names = self.probe_names();
        for p in patterns {
            if !names.iter().any(|n| glob(p, n)) {
                return Err(RuntimeError::Unsupported(format!(
                    "--probe {p} matches no probe of this plan; it was compiled with probes \
                     of {}",
                    if names.is_empty() {
                        "no point".to_string()
                    } else {
                        names.join(", ")
                    }
                )));
            }
        }
        let wanted: Vec<ProbeOp> = self
            .probe_ops()
            .into_iter()
            .filter(|p| patterns.iter().any(|pat| glob(pat, &p.name)))
            .collect();
        let n = tokens.len();
        let vocab = self.vocab();
        self.run_with(tokens, |_, _, _, _| {})?;
        // Every rank gathers every probe in the same order; the stage that ran it gives it.
        let mut gathered: Vec<(ProbeOp, Vec<u64>, Vec<f32>)> = Vec::new();
        for p in wanted {
            let owner =
                self.segments.iter().any(|(c, _)| *c == p.chunk) && self.session.mem.holds(p.buf);
            let len = self.session.plan.buffers[p.buf as usize]
                .shape
                .iter()
                .product::<u64>() as usize;
            let local = if owner {
                self.session.mem.read_f32(p.buf)
            } else {
                vec![0.0; len]
            };
            let (shape, values) = self.gather_buffer(p.buf, &local, false, owner)?;
            gathered.push((p, shape, values));
        }
        let mut lens_head: Option<LensHead> = None;
        let mut probes = Vec::new();
        for (i, (p, shape, values)) in gathered.iter().enumerate() {
            let name = p.name.clone();
            if p.part == "k" {
                continue;
            }
            if p.part == "q" {
                // [1, heads, n, n] from the global q and k, after RoPE.
                let Some((_, kshape, k)) = gathered[i + 1..]
                    .iter()
                    .find(|(o, _, _)| o.name == p.name && o.part == "k")
                else {
                    return Err(RuntimeError::Plan(format!("probe {name}: no k")));
                };
                probes.push(attention_probs(&name, n, (shape, values), (kshape, k)));
                continue;
            }
            // [batch, seq, rest...]: the first sample's real tokens.
            let row = shape[2..].iter().product::<u64>() as usize;
            let mut out_shape = vec![1, n];
            out_shape.extend(shape[2..].iter().map(|&d| d as usize));
            let mut values = values[..n * row].to_vec();
            if name == "logits" {
                values = values
                    .chunks(row)
                    .flat_map(|r| r[..vocab].iter().copied())
                    .collect();
                out_shape[2] = vocab;
            }
            if name.ends_with(".lens") {
                let head = match &lens_head {
                    Some(h) => h,
                    None => lens_head.insert(self.lens_head()?),
                };
                let (tokens, probs) = head.apply(&values, row, vocab, self.lens_k);
                let shape = vec![1, n, self.lens_k.min(vocab)];
                probes.push(Probe {
                    name: format!("{name}.tokens"),
                    shape: shape.clone(),
                    values: tokens,
                });
                probes.push(Probe {
                    name: format!("{name}.probs"),
                    shape,
                    values: probs,
                });
                continue;
            }
            if name.ends_with(".moe.router") {
                for r in values.chunks_mut(row) {
                    let max = r
                        .iter()
                        .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
                    let e: Vec<f64> = r.iter().map(|&x| (f64::from(x) - max).exp()).collect();
                    let total: f64 = e.iter().sum();
                    for (x, e) in r.iter_mut().zip(&e) {
                        *x = (e / total) as f32;
                    }
                }
            }
            probes.push(Probe {
                name,
                shape: out_shape,
                values,
            });
        }
        Ok(probes)
    }
}

/// Softmax attention probabilities `[1, heads, n, n]` of the first `n` positions, from q
/// `[b, s, heads, d]` and k `[b, s, kv_heads, d]` (query head h reads kv head
/// h / (heads / kv_heads)), scaled by 1/sqrt(d), causal (0 above the diagonal).
fn attention_probs(
    name: &str,
    n: usize,
    (qs, q): (&[u64], &[f32]),
    (ks, k): (&[u64], &[f32]),
) -> Probe {
    let (heads, kv, d) = (qs[2] as usize, ks[2] as usize, qs[3] as usize);
    let group = heads / kv.max(1);
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0f32; heads * n * n];
    for h in 0..heads {
        let g = h / group.max(1);
        for i in 0..n {
            let qi = &q[(i * heads + h) * d..][..d];
            let scores: Vec<f64> = (0..=i)
                .map(|j| {
                    let kj = &k[(j * kv + g) * d..][..d];
                    qi.iter()
                        .zip(kj)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = exps.iter().sum();
            for (j, e) in exps.iter().enumerate() {
                out[(h * n + i) * n + j] = (e / total) as f32;
            }
        }
    }
    Probe {
        name: name.to_string(),
        shape: vec![1, heads, n, n],
        values: out,
    }
}

/// The global shape of a tensor whose part on each rank has shape `local` (plan buffers
/// hold a rank's shape), split by `layout`.
fn global_shape(plan: &CheckedPlan, local: &[u64], layout: &[Vec<Axis>]) -> Vec<u64> {
    local
        .iter()
        .enumerate()
        .map(|(d, &x)| {
            let parts: u64 = layout
                .get(d)
                .map_or(1, |ax| ax.iter().map(|&a| plan.mesh.size(a)).product());
            x * parts
        })
        .collect()
}

/// Run `f` on an [`Inference`] of `plan` with the weights of `init`: on this thread for a
/// one-device plan, else on one thread per rank (the local communicator; every rank runs
/// `f`, and rank 0's result is returned).
pub fn with_ranks<T: Send>(
    plan: &CheckedPlan,
    init: &std::path::Path,
    f: impl Fn(&mut Inference) -> Result<T, RuntimeError> + Sync,
) -> Result<T, RuntimeError> {
    Inference::supports(plan)?;
    run_ranks(plan, init, f)
}

/// [`with_ranks`] for `megac scope` (the same layouts: [`Inference::supports`]).
pub fn with_ranks_scope<T: Send>(
    plan: &CheckedPlan,
    init: &std::path::Path,
    f: impl Fn(&mut Inference) -> Result<T, RuntimeError> + Sync,
) -> Result<T, RuntimeError> {
    Inference::supports(plan)?;
    run_ranks(plan, init, f)
}

fn run_ranks<T: Send>(
    plan: &CheckedPlan,
    init: &std::path::Path,
    f: impl Fn(&mut Inference) -> Result<T, RuntimeError> + Sync,
) -> Result<T, RuntimeError> {
    let world = plan.mesh.world_size();
    if world == 1 {
        return f(&mut Inference::new(plan, init)?);
    }
    let mut results = crate::local_comm::run_ranks(world, |comm| {
        f(&mut Inference::with_comm(plan, init, Box::new(comm))?)
    })?;
    Ok(results.swap_remove(0))
}

pub use megac_ir::perturb::{BitField, PerturbKind, Perturbation};

/// The random stream of a perturbation: a function of the seed and the point's name only,
/// so the same perturbation draws the same numbers (twice the same bit flip restores the
/// tensor).
pub(crate) fn stream_seed(seed: u64, name: &str) -> u64 {
    megac_kernels::perturb::stream_seed(seed, name)
}

/// Apply `kind` to `x` with the random stream `seed` (`megac_kernels::perturb`, the kernels
/// of the `perturb` op; `zero-head` and `patch` need the point's shape or a file, and change
/// nothing here).
pub fn apply(kind: &PerturbKind, x: &mut [f32], seed: u64) {
    use megac_kernels::perturb as k;
    match *kind {
        PerturbKind::ZeroHead(_) | PerturbKind::Patch(_) => {}
        PerturbKind::Scale(f) => k::scale(x, f),
        PerturbKind::Noise(sigma) => k::noise(x, sigma, seed),
        PerturbKind::Bitflip(field, rate) => {
            let (first, count) = match field {
                BitField::Sign => (31, 1),
                BitField::Exponent => (23, 8),
                BitField::Mantissa => (0, 23),
            };
            k::bitflip(x, first, count, rate, seed)
        }
    }
}

/// What a perturbed run changed, against the clean run of the same tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct PerturbReport {
    /// Mean next-token cross-entropy of the clean run over the input (positions 0..n-1
    /// predicting tokens 1..n).
    pub clean_loss: f64,
    /// The same, perturbed.
    pub perturbed_loss: f64,
    /// Mean over positions of KL(clean || perturbed) of the next-token distributions.
    pub kl: f64,
    /// Fraction of positions whose most likely next token is the same.
    pub top1_agreement: f64,
    /// Per position: (kl, clean top-1, perturbed top-1).
    pub per_position: Vec<(f64, u32, u32)>,
}

/// Compare the logits (`n` rows of `vocab`) of a clean and a perturbed run on `tokens`.
pub fn compare(tokens: &[u32], clean: &[f32], perturbed: &[f32], vocab: usize) -> PerturbReport {
    let n = tokens.len();
    let log_softmax = |row: &[f32]| -> Vec<f64> {
        let max = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
        let lse = row
            .iter()
            .map(|&x| (f64::from(x) - max).exp())
            .sum::<f64>()
            .ln()
            + max;
        row.iter().map(|&x| f64::from(x) - lse).collect()
    };
    let argmax = |row: &[f32]| {
        let mut best = 0;
        for (i, &x) in row.iter().enumerate() {
            if x > row[best] {
                best = i;
            }
        }
        best as u32
    };
    let (mut loss0, mut loss1, mut kl_sum, mut agree) = (0.0, 0.0, 0.0, 0usize);
    let mut per_position = Vec::with_capacity(n);
    for t in 0..n {
        let (a, b) = (
            &clean[t * vocab..(t + 1) * vocab],
            &perturbed[t * vocab..(t + 1) * vocab],
        );
        let (la, lb) = (log_softmax(a), log_softmax(b));
        let kl: f64 = la.iter().zip(&lb).map(|(p, q)| p.exp() * (p - q)).sum();
        if t + 1 < n {
            let next = tokens[t + 1] as usize;
            loss0 -= la[next];
            loss1 -= lb[next];
        }
        let (ta, tb) = (argmax(a), argmax(b));
        agree += usize::from(ta == tb);
        kl_sum += kl;
        per_position.push((kl, ta, tb));
    }
    let pairs = n.saturating_sub(1).max(1) as f64;
    PerturbReport {
        clean_loss: loss0 / pairs,
        perturbed_loss: loss1 / pairs,
        kl: kl_sum / n.max(1) as f64,
        top1_agreement: agree as f64 / n.max(1) as f64,
        per_position,
    }
}

impl Inference<'_> {
    /// Load the replacements of the plan's `patch` perturbations (compiled by the `perturb`
    /// pass, each reading plan input `patch:POINT`) from `perturbations`' probe files: the
    /// tensor of the point's name, at the point's global shape. Before each run every rank
    /// writes its part of it into the input ([`Inference::patch_part`]).
    pub fn set_patches(&mut self, perturbations: &[Perturbation]) -> Result<(), RuntimeError> {
        let plan = self.session.plan;
        self.patches.clear();
        for p in perturbations {
            let PerturbKind::Patch(file) = &p.kind else {
                continue;
            };
            // The input is the same buffer in every role that has it (under pp: the stage
            // whose chunk holds the point; the other stages skip it).
            let name = format!("patch:{}", p.point);
            let Some(b) = plan.roles.iter().find_map(|r| r.inputs.get(&name).copied()) else {
                return Err(RuntimeError::Plan(format!(
                    "--perturb {}: the plan has no patch input for it (compile the \
                     perturbation into the plan)",
                    p.point
                )));
            };
            let (shape, values) = crate::hf::load_tensor(file, &p.point)?;
            self.patches
                .push((b, file.display().to_string(), shape, values));
        }
        Ok(())
    }

    /// This rank's part of patch `i`'s replacement for an input of `n` tokens: the values
    /// the `perturb` instruction copies, the real rows of the first sample of the plan input
    /// (`[b, s, rest..]` at the rank's shape). Each local element takes the file's element
    /// at its global index, by the input's layout: its part of every split dim (heads, ffn,
    /// the vocabulary, the sequence under sequence parallelism, under context parallelism
    /// its load-balanced chunks: `sharded::dim_positions`, as the probes are gathered). Every
    /// data-parallel replica runs the same sample, so each takes sample 0 of the file. A
    /// pending sum over tp is given whole by the tp rank 0 and as zeros by the others, so
    /// the sum is the replacement exactly.
    fn patch_part(&self, i: usize, n: usize) -> Result<Vec<f32>, RuntimeError> {
        let plan = self.session.plan;
        let (b, file, shape, values) = &self.patches[i];
        let buf = &plan.buffers[*b as usize];
        let global = global_shape(plan, &buf.shape, &buf.layout);
        let mut want = vec![1, n];
        want.extend(global.iter().skip(2).map(|&d| d as usize));
        if buf.shape.len() < 2 || *shape != want {
            return Err(RuntimeError::Unsupported(format!(
                "patch({file}): the file's tensor has shape {shape:?} ({} values), this \
                 run's point has shape {want:?}: patch from a probe file of an input of the \
                 same length",
                values.len(),
            )));
        }
        let rank = self.session.comm.rank();
        let local: Vec<usize> = buf.shape.iter().map(|&d| d as usize).collect();
        let positions: Vec<Vec<usize>> = (0..local.len())
            .map(|d| {
                let axes = buf.layout.get(d).cloned().unwrap_or_default();
                crate::sharded::dim_positions(&plan.mesh, rank, &axes, local[d])
            })
            .collect();
        // The rows' global positions ascend, so the real ones are a prefix.
        let rows = positions[1].iter().take_while(|&&p| p < n).count();
        let row: usize = local[2..].iter().product();
        let zero = buf.partial.iter().any(|&a| plan.mesh.coord(rank, a) != 0);
        let mut part = vec![0f32; rows * row];
        if zero {
            return Ok(part);
        }
        let mut at = vec![0usize; local.len()];
        for (j, x) in part.iter_mut().enumerate() {
            // Row-major local index (sample 0) -> the file's index.
            let mut rest = j;
            for d in (1..local.len()).rev() {
                at[d] = rest % local[d];
                rest /= local[d];
            }
            let (mut g, mut stride) = (0usize, 1usize);
            for d in (1..local.len()).rev() {
                g += positions[d][at[d]] * stride;
                stride *= want[d];
            }
            *x = values[g];
        }
        Ok(part)
    }
}

/// The final norm and output layer, gathered whole, for the logit lens.
struct LensHead {
    /// `RmsNorm` (no bias) or `LayerNorm` (with `bias`).
    rms: bool,
    eps: f32,
    weight: Vec<f32>,
    bias: Vec<f32>,
    /// The output layer's weight and whether it is `[in, out]`; its padded vocabulary.
    head: Vec<f32>,
    in_out: bool,
    padded: usize,
}

impl LensHead {
    /// Top-`k` tokens (as f32 ids) and probabilities, per row of `x` (`row` = hidden).
    fn apply(&self, x: &[f32], h: usize, vocab: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
        let rows = x.len() / h.max(1);
        let mut y = vec![0f32; x.len()];
        if self.rms {
            megac_kernels::norm::rms_norm_fwd(x, &self.weight, self.eps, rows, h, &mut y);
        } else {
            megac_kernels::norm::layer_norm_fwd(
                x,
                &self.weight,
                &self.bias,
                self.eps,
                rows,
                h,
                &mut y,
            );
        }
        let k = k.min(vocab);
        let (mut tokens, mut probs) = (Vec::new(), Vec::new());
        for r in y.chunks(h) {
            let logits: Vec<f64> = (0..vocab)
                .map(|v| {
                    (0..h)
                        .map(|j| {
                            let w = if self.in_out {
                                self.head[j * self.padded + v]
                            } else {
                                self.head[v * h + j]
                            };
                            f64::from(r[j]) * f64::from(w)
                        })
                        .sum()
                })
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let total: f64 = e.iter().sum();
            let mut order: Vec<usize> = (0..vocab).collect();
            order.sort_by(|&a, &b| e[b].total_cmp(&e[a]).then(a.cmp(&b)));
            for &t in &order[..k] {
                tokens.push(t as f32);
                probs.push((e[t] / total) as f32);
            }
        }
        (tokens, probs)
    }
}

impl Inference<'_> {
    /// The final norm and the output layer of the model, gathered from the ranks.
    fn lens_head(&mut self) -> Result<LensHead, RuntimeError> {
        let missing = || RuntimeError::Plan("the logit lens finds no final norm".into());
        let (chunk, program) = *self.all.last().ok_or_else(missing)?;
        // The output layer: the last instruction but the logits' probes.
        let last = program.iter().rev().find(|i| {
            !matches!(
                i,
                Instr::Kernel {
                    op: OpKind::Probe { .. },
                    ..
                }
            )
        });
        let Some(Instr::Kernel {
            op: OpKind::Linear { weight: layout },
            inputs: head_in,
            ..
        }) = last
        else {
            return Err(missing());
        };
        let writer = |b: BufId| {
            program.iter().rev().find_map(|i| match i {
                Instr::Kernel {
                    op,
                    inputs,
                    outputs,
                    ..
                } if outputs.contains(&b) => Some((op, inputs)),
                _ => None,
            })
        };
        // The norm, through sequence parallelism's all-gather.
        let mut w = writer(head_in[0]).ok_or_else(missing)?;
        if let (OpKind::AllGather { .. }, ins) = w {
            w = writer(ins[0]).ok_or_else(missing)?;
        }
        let (rms, eps, norm_in) = match w {
            (OpKind::RmsNorm { eps }, ins) => (true, *eps, ins.clone()),
            (OpKind::LayerNorm { eps }, ins) => (false, *eps, ins.clone()),
            _ => return Err(missing()),
        };
        let owner = self.segments.iter().any(|(c, _)| *c == chunk);
        let fetch = |inf: &mut Self, b: BufId| -> Result<(Vec<u64>, Vec<f32>), RuntimeError> {
            let len = inf.session.mem.buffer(b).len() as usize;
            let local = if owner {
                inf.session.mem.read_f32(b)
            } else {
                vec![0.0; len]
            };
            inf.gather_buffer(b, &local, false, owner)
        };
        let (_, weight) = fetch(self, norm_in[1])?;
        let bias = match norm_in.get(2) {
            Some(&b) if !rms => fetch(self, b)?.1,
            _ => Vec::new(),
        };
        let (shape, head) = fetch(self, head_in[1])?;
        let in_out = matches!(layout, megac_ir::op::WeightLayout::InOut);
        let padded = if in_out { shape[1] } else { shape[0] } as usize;
        Ok(LensHead {
            rms,
            eps: eps as f32,
            weight,
            bias,
            head,
            in_out,
            padded,
        })
    }
}
