//! KV-cache decoding (`megac generate`'s default): the prompt runs once through the window
//! plan (the one-sample forward over `seq_len` tokens, as [`crate::infer`] runs it), then each
//! new token runs alone through the block plan, the same model.toml compiled with
//! `model.seq_len` = the block (1 token, or `tp` under sequence parallelism, the first row
//! real and the others padding), at its position.
//!
//! Three kinds of instruction depend on where a block's rows sit in the sequence, and run
//! here instead of through the executor: `rope` (rotations at the rows' positions),
//! `pos_embedding` (GPT-2's learned positions: the rows of the whole table, which the
//! block plan's own `wpe` is too short to hold) and `causal_attention`, which writes the
//! block's keys and values into the layer's cache at their positions (this rank's shard:
//! under tp the kv heads are split, so is the cache) and attends the block's queries to
//! every cached key at or before them (within the sliding window). Every other instruction
//! is per token (linears, norms, MLPs, MoE routing and experts) and runs unchanged, so a
//! step costs one token's forward plus attention over the cache instead of a whole
//! window's forward.

use std::collections::BTreeMap;

use megac_ir::gate::CheckedPlan;
use megac_ir::plan::{BufId, Instr};
use megac_ir::OpKind;
use megac_kernels as k;

use crate::comm::Communicator;
use crate::error::RuntimeError;
use crate::infer::{Generated, Inference, Sampling};
use crate::memory::Memory;

/// The `--set`s that compile the block plan from the model.toml (and `--set`s) of
/// `window`: `model.seq_len` = one token per tp rank, and under pp the window plan's layers
/// per chunk as `parallel.stage_layers` (so a `"balanced"` split, which weighs layers at
/// the plan's length, places the block's layers on the same stages).
pub fn block_sets(window: &CheckedPlan) -> Vec<String> {
    let tp = window.mesh.size(megac_ir::Axis::Tp);
    let mut sets = vec![format!("model.seq_len={tp}")];
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

/// The K/V cache of one rank: per attention instruction (by its provenance path, which the
/// window and block plans share), keys and values `[capacity, kv_heads, head_dim]` of the
/// positions written so far.
pub struct KvCache {
    /// Positions the cache holds (the context window).
    capacity: usize,
    /// Position of the running block's first row.
    offset: usize,
    /// Keys and values per attention instruction's path.
    layers: BTreeMap<String, (Vec<f32>, Vec<f32>)>,
    /// GPT-2's whole position table `[capacity, hidden]` (on the rank that embeds).
    wpe: Option<Vec<f32>>,
}

impl KvCache {
    /// An empty cache of `capacity` positions; `wpe` is the whole learned position table
    /// when the model has one and this rank embeds.
    pub fn new(capacity: usize, wpe: Option<Vec<f32>>) -> Self {
        KvCache {
            capacity,
            offset: 0,
            layers: BTreeMap::new(),
            wpe,
        }
    }

    /// The global positions of the rows of buffer `b` (`[batch, seq, ..]`, its seq dim
    /// possibly split over tp by sequence parallelism) when the block starts at `offset`.
    fn positions(&self, plan: &CheckedPlan, rank: usize, b: BufId) -> Vec<u32> {
        let buf = &plan.buffers[b as usize];
        let s = buf.shape.get(1).copied().unwrap_or(1) as usize;
        let part = buf.layout.get(1).map_or(0, |axes| {
            axes.iter().fold(0usize, |acc, &a| {
                acc * plan.mesh.size(a) as usize + plan.mesh.coord(rank, a)
            })
        });
        (0..s)
            .map(|i| (self.offset + part * s + i).min(u32::MAX as usize) as u32)
            .collect()
    }

    /// Run `instr` here if it depends on positions (rope, position embedding, attention);
    /// false for every other instruction (the executor runs it).
    pub(crate) fn run(
        &mut self,
        instr: &Instr,
        mem: &mut Memory,
        plan: &CheckedPlan,
        rank: usize,
    ) -> Result<bool, RuntimeError> {
        let Instr::Kernel {
            op,
            inputs,
            outputs,
            path,
        } = instr
        else {
            return Ok(false);
        };
        let dims = |b: BufId| -> Vec<usize> {
            plan.buffers[b as usize]
                .shape
                .iter()
                .map(|&d| d as usize)
                .collect()
        };
        let four = |b: BufId| -> Result<[usize; 4], RuntimeError> {
            <[usize; 4]>::try_from(dims(b)).map_err(|s| {
                RuntimeError::Plan(format!("`{}` at {path}: operand of shape {s:?}", op.name()))
            })
        };
        match op {
            OpKind::Rope { theta, scaling } => {
                let [b, s, nh, d] = four(inputs[0])?;
                let inv_freq = megac_ir::spec::rope_inv_freq(d, *theta, scaling.as_ref());
                let pos = self.positions(plan, rank, inputs[0]);
                let x = mem.read_f32(inputs[0]);
                let mut y = vec![0f32; x.len()];
                k::rope_freq(&x, b, s, nh, d, &inv_freq, &pos, &mut y, false);
                mem.write_f32(outputs[0], &y);
            }
            OpKind::PosEmbedding => {
                let shape = dims(inputs[0]);
                let h = shape.last().copied().unwrap_or(0);
                let wpe = self.wpe.as_ref().ok_or_else(|| {
                    RuntimeError::Plan(format!(
                        "{path}: this rank embeds positions but holds no position table"
                    ))
                })?;
                let rows = wpe.len() / h.max(1);
                let pos = self.positions(plan, rank, inputs[0]);
                let x = mem.read_f32(inputs[0]);
                let mut y = vec![0f32; x.len()];
                for (i, (xr, yr)) in x.chunks_exact(h).zip(y.chunks_exact_mut(h)).enumerate() {
                    // Padding rows past the table take its last row (their values are unused).
                    let p = (pos[i % pos.len()] as usize).min(rows.saturating_sub(1));
                    k::add_fwd(xr, &wpe[p * h..(p + 1) * h], yr);
                }
                mem.write_f32(outputs[0], &y);
            }
            OpKind::CausalAttention { window } => {
                let [b, s, nh, d] = four(inputs[0])?;
                let nkv = four(inputs[1])?[2];
                if b != 1 {
                    return Err(RuntimeError::Unsupported(format!(
                        "the KV cache holds one sequence; {path} runs {b}"
                    )));
                }
                let pos = self.positions(plan, rank, inputs[0]);
                let row = nkv * d;
                let cap = self.capacity;
                let (ck, cv) = self
                    .layers
                    .entry(path.clone())
                    .or_insert_with(|| (vec![0f32; cap * row], vec![0f32; cap * row]));
                let (kx, vx) = (mem.read_f32(inputs[1]), mem.read_f32(inputs[2]));
                for (i, &p) in pos.iter().enumerate() {
                    let p = p as usize;
                    if p < cap {
                        ck[p * row..(p + 1) * row].copy_from_slice(&kx[i * row..(i + 1) * row]);
                        cv[p * row..(p + 1) * row].copy_from_slice(&vx[i * row..(i + 1) * row]);
                    }
                }
                // Keys 0 ..= the block's last position (the cache holds no later ones).
                let keys = (self.offset + s).min(cap);
                let k_pos: Vec<u32> = (0..keys as u32).collect();
                let q = mem.read_f32(inputs[0]);
                let mut out = vec![0f32; s * nh * d];
                let mut lse = vec![0f32; nh * s];
                let window = u32::try_from(*window).unwrap_or(u32::MAX);
                k::context::attention_window_fwd(
                    &q,
                    &ck[..keys * row],
                    &cv[..keys * row],
                    &pos,
                    &k_pos,
                    window,
                    1,
                    s,
                    keys,
                    nh,
                    nkv,
                    d,
                    &mut out,
                    &mut lse,
                );
                mem.write_f32(outputs[0], &out);
                mem.write_f32(outputs[1], &lse);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// A communicator that stands in for the rank's real one while another plan's session
/// holds it (the decoder moves the one communicator between its two sessions); it
/// communicates nothing.
struct Parked {
    rank: usize,
    size: usize,
}

impl Parked {
    fn refuse<T>(&self) -> Result<T, RuntimeError> {
        Err(RuntimeError::Plan(
            "a parked session communicated (the KV decoder runs one plan at a time)".into(),
        ))
    }
}

impl Communicator for Parked {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&mut self, _: &[usize], _: &mut [f32]) -> Result<(), RuntimeError> {
        self.refuse()
    }
    fn all_reduce_max(&mut self, _: &[usize], _: &mut [f32]) -> Result<(), RuntimeError> {
        self.refuse()
    }
    fn all_reduce_sum_f64(&mut self, _: &[usize], _: &mut [f64]) -> Result<(), RuntimeError> {
        self.refuse()
    }
    fn all_gather(&mut self, _: &[usize], _: &[f32], _: &mut [f32]) -> Result<(), RuntimeError> {
        self.refuse()
    }
    fn reduce_scatter_sum(
        &mut self,
        _: &[usize],
        _: &[f32],
        _: &mut [f32],
    ) -> Result<(), RuntimeError> {
        self.refuse()
    }
    fn all_to_all(
        &mut self,
        _: &[usize],
        _: &[f32],
        _: &[usize],
        _: &mut [f32],
        _: &[usize],
    ) -> Result<(), RuntimeError> {
        self.refuse()
    }
    fn send(&mut self, _: usize, _: &[f32]) -> Result<(), RuntimeError> {
        self.refuse()
    }
    fn recv(&mut self, _: usize, _: &mut [f32]) -> Result<(), RuntimeError> {
        self.refuse()
    }
}

/// Generation with a KV cache: the window plan for the prompt, the block plan per new token.
pub struct KvDecoder<'p> {
    window: Inference<'p>,
    block: Inference<'p>,
    cache: KvCache,
}

impl<'p> KvDecoder<'p> {
    /// Load `init` into `window` (the one-sample plan) and copy the weights into `block`
    /// (the same model compiled with a shorter `seq_len`, the block) for the rank `comm`
    /// stands for.
    pub fn with_comm(
        window: &'p CheckedPlan,
        block: &'p CheckedPlan,
        init: &std::path::Path,
        comm: Box<dyn Communicator>,
    ) -> Result<Self, RuntimeError> {
        Inference::supports(block)?;
        let (w, b) = (&window.batch, &block.batch);
        if window.mesh != block.mesh
            || w.vocab != b.vocab
            || b.seq_len > w.seq_len
            || b.micro_batch != 1
            || w.micro_batch != 1
        {
            return Err(RuntimeError::Plan(format!(
                "the block plan (seq_len {}, micro_batch {}) does not fit the window plan \
                 (seq_len {}, micro_batch {}) on the same mesh and vocabulary",
                b.seq_len, b.micro_batch, w.seq_len, w.micro_batch
            )));
        }
        let drops = window.roles.iter().flat_map(megac_ir::plan::Plan::programs_of).flatten().any(|i| {
            matches!(
                i,
                Instr::Kernel {
                    op: OpKind::Dispatch { capacity, .. } | OpKind::DispatchExperts { capacity, .. },
                    ..
                } if *capacity > 0
            )
        });
        if drops {
            return Err(RuntimeError::Unsupported(
                "the KV cache needs dropless MoE routing (model.moe.capacity_factor = 0): with \
                 a capacity, which tokens an expert drops depends on the whole window; use \
                 --no-kv-cache"
                    .into(),
            ));
        }
        let (rank, size) = (comm.rank(), comm.size());
        let mut win = Inference::with_comm(window, init, comm)?;
        let blk = Inference::with_params_of(block, &mut win, Box::new(Parked { rank, size }))?;
        let wpe = win.param_values("transformer.wpe.weight");
        Ok(KvDecoder {
            cache: KvCache::new(window.batch.seq_len as usize, wpe),
            window: win,
            block: blk,
        })
    }

    /// The context window.
    pub fn context(&self) -> usize {
        self.window.context()
    }

    /// The vocabulary size.
    pub fn vocab(&self) -> usize {
        self.window.vocab()
    }

    /// Run the prompt through the window plan (filling the cache from position 0); its
    /// logits, `prompt.len()` rows.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        self.cache.offset = 0;
        self.window.logits_kv(prompt, &mut self.cache)
    }

    /// Run `token` at position `at` (after a prefill of at least `at` tokens and the steps
    /// before it): its logits, one row.
    pub fn step(&mut self, token: u32, at: usize) -> Result<Vec<f32>, RuntimeError> {
        if at >= self.context() {
            return Err(RuntimeError::Unsupported(format!(
                "position {at} is outside the model's context of seq_len = {} tokens",
                self.context()
            )));
        }
        self.cache.offset = at;
        std::mem::swap(&mut self.window.session.comm, &mut self.block.session.comm);
        let out = self.block.logits_kv(&[token], &mut self.cache);
        std::mem::swap(&mut self.window.session.comm, &mut self.block.session.comm);
        out
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
        self.window.check_generation(prompt, max_new)?;
        let v = self.vocab();
        crate::infer::decode(prompt, max_new, sampling, |seq, i| {
            if i == 0 {
                let logits = self.prefill(prompt)?;
                Ok(logits[(prompt.len() - 1) * v..prompt.len() * v].to_vec())
            } else {
                let mut logits = self.step(seq[seq.len() - 1], seq.len() - 1)?;
                logits.truncate(v);
                Ok(logits)
            }
        })
    }
}

/// Run `f` on a [`KvDecoder`] of `window` and `block` with the weights of `init`: on this
/// thread for a one-device plan, else one thread per rank (rank 0's result is returned).
pub fn with_ranks_kv<T: Send>(
    window: &CheckedPlan,
    block: &CheckedPlan,
    init: &std::path::Path,
    f: impl Fn(&mut KvDecoder) -> Result<T, RuntimeError> + Sync,
) -> Result<T, RuntimeError> {
    Inference::supports(window)?;
    let world = window.mesh.world_size();
    if world == 1 {
        let comm = Box::new(crate::comm::SingleRank);
        return f(&mut KvDecoder::with_comm(window, block, init, comm)?);
    }
    let mut results = crate::local_comm::run_ranks(world, |comm| {
        f(&mut KvDecoder::with_comm(
            window,
            block,
            init,
            Box::new(comm),
        )?)
    })?;
    Ok(results.swap_remove(0))
}
