//! Mixture of experts (Mixtral): the router, the load-balancing loss, and the dispatch /
//! combine of tokens to and from the experts, with their backward passes.
//!
//! The math is that of transformers' `MixtralSparseMoeBlock` in fp32:
//!
//! ```text
//! p       = softmax(logits)                    per token, over the E experts
//! idx     = topk(p, k)                         descending probability
//! w       = p[idx] / Σ p[idx]                  renormalised (Mixtral)
//! out[t]  = Σ_slot w[t, slot] · expert_{idx[t, slot]}(x[t])
//! ```
//!
//! **Ties** in the top-k selection go to the lower expert index (`torch.topk` does not
//! promise any order for ties; a fixed rule keeps every rank and every recomputation of
//! the routing identical). NaN probabilities rank below every number.
//!
//! A [`Routing`] is built once per layer from the router's indices: for each expert the
//! `(token, slot)` pairs routed to it, in token order, after capacity dropping. Dispatch,
//! combine and their backward passes all read it, so they agree on which row of an
//! expert's buffer holds which token.
//!
//! Shapes: `t` tokens (the flattened `[b, s]`), `e` experts, `top_k` slots per token, `h`
//! hidden size. Expert buffers are `[rows, h]` with `rows` at least the number of tokens
//! routed to the expert (`t` when dropless, `capacity` otherwise).

use rayon::prelude::*;

use crate::simd::{dot_f64, exp, max, sum_f64};
use crate::util::row_chunk;

/// Tokens per task of the load-balancing statistics: fixed, so the f64 sums do not depend
/// on the number of threads.
const AUX_TOKENS_PER_TASK: usize = 64;

/// `p = softmax(z)` in f32: exponentials of the max-shifted logits, summed in f64.
#[inline]
fn softmax_into(z: &[f32], p: &mut [f32]) {
    let m = max(z);
    for (p, &v) in p.iter_mut().zip(z) {
        *p = exp(v - m);
    }
    let inv = 1.0 / sum_f64(p);
    for p in p.iter_mut() {
        *p = (*p as f64 * inv) as f32;
    }
}

/// Ranking key of a probability: NaN ranks below everything.
#[inline]
fn rank_key(p: f32) -> f32 {
    if p.is_nan() {
        f32::NEG_INFINITY
    } else {
        p
    }
}

/// Writes the `k = idx.len()` largest entries of `p` into `idx` (descending, ties to the
/// lower index) and their probabilities into `vals`.
#[inline]
fn top_k_into(p: &[f32], vals: &mut [f32], idx: &mut [i32]) {
    let k = idx.len();
    let mut n = 0usize;
    for (j, &pj) in p.iter().enumerate() {
        let v = rank_key(pj);
        if n == k {
            // Strictly greater: an equal value that comes later keeps losing the tie.
            if v <= vals[k - 1] {
                continue;
            }
        } else {
            n += 1;
        }
        let mut pos = n - 1;
        while pos > 0 && v > vals[pos - 1] {
            vals[pos] = vals[pos - 1];
            idx[pos] = idx[pos - 1];
            pos -= 1;
        }
        vals[pos] = v;
        idx[pos] = j as i32;
    }
    for (v, &j) in vals.iter_mut().zip(idx.iter()) {
        *v = p[j as usize];
    }
}

/// Checks an expert index and turns it into a `usize`.
#[inline]
fn expert_of(id: i32, e: usize, who: &str) -> usize {
    assert!(
        id >= 0 && (id as usize) < e,
        "{who}: expert index {id} outside 0..{e}"
    );
    id as usize
}

fn check_router_shapes(who: &str, logits: &[f32], t: usize, e: usize, top_k: usize) {
    assert!(
        (1..=e).contains(&top_k),
        "{who}: top_k {top_k} must be in 1..={e}"
    );
    assert_eq!(logits.len(), t * e, "{who}: logits must be [t, e]");
}

/// Mixtral's router: `p = softmax(logits[t])` in f32 (max-shifted, summed in f64), the
/// `top_k` most probable experts into `indices` in descending probability (ties to the
/// lower expert index), and their probabilities renormalised to sum to one into
/// `weights` (`routing_weights /= routing_weights.sum(-1)`). `logits` is `[t, e]`,
/// `weights` and `indices` are `[t, top_k]`; both are overwritten.
pub fn router_fwd(
    logits: &[f32],
    t: usize,
    e: usize,
    top_k: usize,
    weights: &mut [f32],
    indices: &mut [i32],
) {
    router_fwd_with(logits, t, e, top_k, true, weights, indices)
}

/// [`router_fwd`], renormalising the top-k weights only when `renorm` (Qwen2-MoE's
/// `norm_topk_prob`); otherwise `weights` are the chosen experts' softmax probabilities.
pub fn router_fwd_with(
    logits: &[f32],
    t: usize,
    e: usize,
    top_k: usize,
    renorm: bool,
    weights: &mut [f32],
    indices: &mut [i32],
) {
    check_router_shapes("router_fwd", logits, t, e, top_k);
    assert_eq!(
        weights.len(),
        t * top_k,
        "router_fwd: weights must be [t, top_k]"
    );
    assert_eq!(
        indices.len(),
        t * top_k,
        "router_fwd: indices must be [t, top_k]"
    );
    let run = |z: &[f32], w: &mut [f32], ix: &mut [i32]| {
        let mut p = vec![0.0f32; e];
        for ((z, w), ix) in z
            .chunks(e)
            .zip(w.chunks_mut(top_k))
            .zip(ix.chunks_mut(top_k))
        {
            softmax_into(z, &mut p);
            top_k_into(&p, w, ix);
            if renorm {
                let s: f64 = w.iter().map(|&v| v as f64).sum();
                for w in w.iter_mut() {
                    *w = (*w as f64 / s) as f32;
                }
            }
        }
    };
    match row_chunk(t, e) {
        Some(rows) => logits
            .par_chunks(rows * e)
            .zip(weights.par_chunks_mut(rows * top_k))
            .zip(indices.par_chunks_mut(rows * top_k))
            .for_each(|((z, w), ix)| run(z, w, ix)),
        None => run(logits, weights, indices),
    }
}

/// Backward of [`router_fwd`]: `dlogits += ∂(Σ dweights · weights)/∂logits`, the top-k
/// choice held fixed (it is piecewise constant). `indices` are the forward's (recompute
/// them with [`router_fwd`] from the same logits if they were not kept: the selection is
/// deterministic). `logits` and `dlogits` are `[t, e]`; `indices` and `dweights` are
/// `[t, top_k]`.
///
/// With `C` the chosen experts, `S = Σ_{c∈C} p_c` and `w_j = p_j / S`, the renormalised
/// weights are a softmax over the chosen logits alone (`w_j = e^{z_j} / Σ_{c∈C} e^{z_c}`),
/// so with `g = dweights` and `ḡ = Σ_j g_j w_j`:
/// `dlogits[i] += w_i (g_i - ḡ)` for `i ∈ C` and `0` for the other experts.
pub fn router_bwd(
    logits: &[f32],
    t: usize,
    e: usize,
    top_k: usize,
    indices: &[i32],
    dweights: &[f32],
    dlogits: &mut [f32],
) {
    router_bwd_with(logits, t, e, top_k, true, indices, dweights, dlogits)
}

/// Backward of [`router_fwd_with`]. Without `renorm` the weights are the softmax
/// probabilities themselves (`w_j = p_j`), so with `ḡ = Σ_{j∈C} g_j p_j` every expert's
/// logit gets `dlogits[i] += p_i (g_i [i∈C] - ḡ)`.
#[allow(clippy::too_many_arguments)]
pub fn router_bwd_with(
    logits: &[f32],
    t: usize,
    e: usize,
    top_k: usize,
    renorm: bool,
    indices: &[i32],
    dweights: &[f32],
    dlogits: &mut [f32],
) {
    check_router_shapes("router_bwd", logits, t, e, top_k);
    assert_eq!(
        indices.len(),
        t * top_k,
        "router_bwd: indices must be [t, top_k]"
    );
    assert_eq!(
        dweights.len(),
        t * top_k,
        "router_bwd: dweights must be [t, top_k]"
    );
    assert_eq!(dlogits.len(), t * e, "router_bwd: dlogits must be [t, e]");
    let run = |z: &[f32], ix: &[i32], g: &[f32], dz: &mut [f32]| {
        let mut p = vec![0.0f32; e];
        let mut w = vec![0.0f64; top_k];
        for (((z, ix), g), dz) in z
            .chunks(e)
            .zip(ix.chunks(top_k))
            .zip(g.chunks(top_k))
            .zip(dz.chunks_mut(e))
        {
            softmax_into(z, &mut p);
            for (w, &j) in w.iter_mut().zip(ix) {
                *w = p[expert_of(j, e, "router_bwd")] as f64;
            }
            if !renorm {
                let gbar: f64 = w.iter().zip(g).map(|(&w, &g)| w * g as f64).sum();
                let mut gi = vec![0.0f64; e];
                for (&g, &j) in g.iter().zip(ix) {
                    gi[j as usize] += g as f64;
                }
                for ((dz, &p), &gi) in dz.iter_mut().zip(p.iter()).zip(&gi) {
                    *dz += (p as f64 * (gi - gbar)) as f32;
                }
                continue;
            }
            let s: f64 = w.iter().sum();
            let mut gbar = 0.0f64;
            for (w, &g) in w.iter_mut().zip(g) {
                *w /= s;
                gbar += g as f64 * *w;
            }
            for ((&w, &g), &j) in w.iter().zip(g).zip(ix) {
                dz[j as usize] += (w * (g as f64 - gbar)) as f32;
            }
        }
    };
    match row_chunk(t, e) {
        Some(rows) => logits
            .par_chunks(rows * e)
            .zip(indices.par_chunks(rows * top_k))
            .zip(dweights.par_chunks(rows * top_k))
            .zip(dlogits.par_chunks_mut(rows * e))
            .for_each(|(((z, ix), g), dz)| run(z, ix, g, dz)),
        None => run(logits, indices, dweights, dlogits),
    }
}

/// Token statistics of the load-balancing loss over a set of tokens: per expert the number
/// of `(token, slot)` assignments routed to it and the sum of its softmax probability,
/// and the number of tokens. Statistics of disjoint token sets add up, so a distributed
/// run computes them per rank with [`moe_aux_stats`], sums them over the ranks that share
/// a sequence ([`AuxStats::as_mut_slice`] is one contiguous f64 buffer, ready for an
/// all-reduce), and evaluates the loss and its gradient from the global statistics with
/// [`moe_aux_loss_from_stats`] and [`moe_aux_loss_bwd_from_stats`].
///
/// Megatron sums these token statistics over the tensor- and context-parallel ranks (the
/// sequence-partitioned tokens of one microbatch), so every such rank sees the same loss;
/// data-parallel ranks and separate microbatches keep their own statistics.
#[derive(Clone, Debug, PartialEq)]
pub struct AuxStats {
    experts: usize,
    /// `[counts; E] ++ [prob_sums; E] ++ [tokens]`.
    data: Vec<f64>,
}

impl AuxStats {
    /// Empty statistics (no tokens) for `experts` experts.
    pub fn zeros(experts: usize) -> AuxStats {
        AuxStats {
            experts,
            data: vec![0.0; 2 * experts + 1],
        }
    }

    /// Statistics from their flat layout `[counts; E] ++ [prob_sums; E] ++ [tokens]`
    /// (what [`AuxStats::as_slice`] returns).
    pub fn from_slice(experts: usize, data: &[f64]) -> AuxStats {
        assert_eq!(
            data.len(),
            2 * experts + 1,
            "AuxStats::from_slice: need 2 * experts + 1 values"
        );
        AuxStats {
            experts,
            data: data.to_vec(),
        }
    }

    /// Number of experts.
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Assignments per expert (each token counts once per slot it routes to the expert).
    pub fn counts(&self) -> &[f64] {
        &self.data[..self.experts]
    }

    /// Per expert, the sum over tokens of its softmax probability.
    pub fn prob_sums(&self) -> &[f64] {
        &self.data[self.experts..2 * self.experts]
    }

    /// Number of tokens.
    pub fn tokens(&self) -> f64 {
        self.data[2 * self.experts]
    }

    /// The flat layout `[counts; E] ++ [prob_sums; E] ++ [tokens]`.
    pub fn as_slice(&self) -> &[f64] {
        &self.data
    }

    /// The flat layout, mutable: all-reduce (sum) it in place over the ranks.
    pub fn as_mut_slice(&mut self) -> &mut [f64] {
        &mut self.data
    }

    /// Adds the statistics of another (disjoint) set of tokens.
    pub fn merge(&mut self, other: &AuxStats) {
        assert_eq!(
            self.experts, other.experts,
            "AuxStats::merge: expert counts differ"
        );
        for (a, b) in self.data.iter_mut().zip(&other.data) {
            *a += b;
        }
    }
}

/// Assignment counts per expert from `indices` `[t, top_k]`.
fn count_assignments(indices: &[i32], e: usize, who: &str) -> Vec<f64> {
    let mut counts = vec![0u64; e];
    for &j in indices {
        counts[expert_of(j, e, who)] += 1;
    }
    counts.into_iter().map(|c| c as f64).collect()
}

/// The load-balancing statistics of local tokens: `logits` `[t, e]`, `indices`
/// `[t, top_k]` (the router's choice, before any capacity dropping, as Megatron counts
/// them). Probability sums are in f64 over a fixed chunking (thread-count independent).
pub fn moe_aux_stats(
    logits: &[f32],
    t: usize,
    e: usize,
    top_k: usize,
    indices: &[i32],
) -> AuxStats {
    check_router_shapes("moe_aux_stats", logits, t, e, top_k);
    assert_eq!(
        indices.len(),
        t * top_k,
        "moe_aux_stats: indices must be [t, top_k]"
    );
    let mut stats = AuxStats::zeros(e);
    let counts = count_assignments(indices, e, "moe_aux_stats");
    stats.data[..e].copy_from_slice(&counts);
    let partial = |z: &[f32]| -> Vec<f64> {
        let mut p = vec![0.0f32; e];
        let mut acc = vec![0.0f64; e];
        for z in z.chunks(e) {
            softmax_into(z, &mut p);
            for (a, &v) in acc.iter_mut().zip(&p) {
                *a += v as f64;
            }
        }
        acc
    };
    let chunk = AUX_TOKENS_PER_TASK * e;
    let partials: Vec<Vec<f64>> = if row_chunk(t, e).is_some() {
        logits.par_chunks(chunk).map(partial).collect()
    } else {
        logits.chunks(chunk).map(partial).collect()
    };
    let sums = &mut stats.data[e..2 * e];
    for part in &partials {
        for (s, v) in sums.iter_mut().zip(part) {
            *s += v;
        }
    }
    stats.data[2 * e] = t as f64;
    stats
}

/// The load-balancing loss from (global) statistics:
/// `coeff · E · Σ_e f_e · P_e` with `f_e = counts_e / (tokens · top_k)` and
/// `P_e = prob_sums_e / tokens` (Switch Transformer eq. 4, Megatron's normalisation).
/// Zero when there are no tokens.
///
/// transformers' `load_balancing_loss_func` averages the one-hot assignments over tokens
/// only (`tokens_per_expert` is `[top_k, E]`, summed over both), which is `top_k` times
/// this value; pass `coeff · top_k` to reproduce it.
pub fn moe_aux_loss_from_stats(stats: &AuxStats, top_k: usize, coeff: f64) -> f64 {
    let n = stats.tokens();
    if n <= 0.0 {
        return 0.0;
    }
    let e = stats.experts();
    let dot: f64 = stats
        .counts()
        .iter()
        .zip(stats.prob_sums())
        .map(|(c, p)| c * p)
        .sum();
    coeff * e as f64 * dot / (n * n * top_k as f64)
}

/// `dlogits += scale · ∂loss/∂logits` for the local tokens' `logits` `[t, e]`, with the
/// loss of [`moe_aux_loss_from_stats`] evaluated on `stats` (the global statistics, which
/// include these tokens). The assignment fractions `f_e` are constants (top-k is
/// piecewise constant), so with `p` the local token's softmax and
/// `g_e = scale · coeff · E · f_e / tokens` (the derivative with respect to each `p_e`),
/// `dlogits[i] += p_i (g_i - Σ_j p_j g_j)`.
#[allow(clippy::too_many_arguments)]
pub fn moe_aux_loss_bwd_from_stats(
    logits: &[f32],
    t: usize,
    e: usize,
    top_k: usize,
    stats: &AuxStats,
    coeff: f64,
    scale: f32,
    dlogits: &mut [f32],
) {
    check_router_shapes("moe_aux_loss_bwd", logits, t, e, top_k);
    assert_eq!(
        dlogits.len(),
        t * e,
        "moe_aux_loss_bwd: dlogits must be [t, e]"
    );
    assert_eq!(
        stats.experts(),
        e,
        "moe_aux_loss_bwd: statistics of {} experts for {e}",
        stats.experts()
    );
    let n = stats.tokens();
    if n <= 0.0 || t == 0 {
        return;
    }
    let c = scale as f64 * coeff * e as f64 / (n * n * top_k as f64);
    let g: Vec<f64> = stats.counts().iter().map(|&k| c * k).collect();
    let run = |z: &[f32], dz: &mut [f32]| {
        let mut p = vec![0.0f32; e];
        for (z, dz) in z.chunks(e).zip(dz.chunks_mut(e)) {
            softmax_into(z, &mut p);
            let pg: f64 = p.iter().zip(&g).map(|(&p, &g)| p as f64 * g).sum();
            for ((d, &p), &g) in dz.iter_mut().zip(&p).zip(&g) {
                *d += (p as f64 * (g - pg)) as f32;
            }
        }
    };
    match row_chunk(t, e) {
        Some(rows) => logits
            .par_chunks(rows * e)
            .zip(dlogits.par_chunks_mut(rows * e))
            .for_each(|(z, dz)| run(z, dz)),
        None => run(logits, dlogits),
    }
}

/// The load-balancing loss of one layer over `t` tokens (single rank):
/// `coeff · E · Σ_e f_e · P_e`, `f_e` the fraction of the `t · top_k` assignments in
/// `indices` `[t, top_k]` that go to expert `e` and `P_e` the mean softmax probability of
/// `e` over the tokens of `logits` `[t, e]`. See [`moe_aux_loss_from_stats`] for the
/// relation to transformers' value, and [`AuxStats`] for the distributed form.
pub fn moe_aux_loss_fwd(
    logits: &[f32],
    t: usize,
    e: usize,
    top_k: usize,
    indices: &[i32],
    coeff: f64,
) -> f64 {
    let stats = moe_aux_stats(logits, t, e, top_k, indices);
    moe_aux_loss_from_stats(&stats, top_k, coeff)
}

/// Backward of [`moe_aux_loss_fwd`]: `dlogits += scale · ∂loss/∂logits` (see
/// [`moe_aux_loss_bwd_from_stats`] for the formula).
#[allow(clippy::too_many_arguments)]
pub fn moe_aux_loss_bwd(
    logits: &[f32],
    t: usize,
    e: usize,
    indices: &[i32],
    top_k: usize,
    coeff: f64,
    scale: f32,
    dlogits: &mut [f32],
) {
    check_router_shapes("moe_aux_loss_bwd", logits, t, e, top_k);
    assert_eq!(
        indices.len(),
        t * top_k,
        "moe_aux_loss_bwd: indices must be [t, top_k]"
    );
    // Only the counts and the token count enter the gradient.
    let mut stats = AuxStats::zeros(e);
    let counts = count_assignments(indices, e, "moe_aux_loss_bwd");
    stats.data[..e].copy_from_slice(&counts);
    stats.data[2 * e] = t as f64;
    moe_aux_loss_bwd_from_stats(logits, t, e, top_k, &stats, coeff, scale, dlogits);
}

/// Where each token goes: for every expert, the `(token, slot)` pairs routed to it in
/// token order, truncated to `capacity` (tokens beyond it are dropped, in token order:
/// Megatron's "position" drop policy); and for every `(token, slot)` its row in the
/// expert's buffer, or none when dropped. Build it once per layer from the router's
/// indices and hand it to [`dispatch_fwd_routed`], [`dispatch_bwd`], [`combine_fwd`] and
/// [`combine_bwd`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routing {
    tokens: usize,
    top_k: usize,
    capacity: usize,
    /// `[t, top_k]` expert of each slot (validated copy of the indices).
    expert: Vec<u32>,
    /// `[t, top_k]` row in the expert's buffer, `u32::MAX` when dropped.
    row: Vec<u32>,
    /// Per expert, the `(token, slot)` of each row.
    rows: Vec<Vec<(u32, u32)>>,
}

/// Marks a dropped slot in [`Routing::row`].
const DROPPED: u32 = u32::MAX;

impl Routing {
    /// Builds the routing of `t` tokens from `indices` `[t, top_k]` over `experts`
    /// experts, keeping at most `capacity` tokens per expert (`0`: dropless). Panics on an
    /// index outside `0..experts` or on an expert chosen twice by one token.
    pub fn new(
        indices: &[i32],
        t: usize,
        top_k: usize,
        experts: usize,
        capacity: usize,
    ) -> Routing {
        assert!(top_k >= 1, "Routing::new: top_k must be positive");
        assert_eq!(
            indices.len(),
            t * top_k,
            "Routing::new: indices must be [t, top_k]"
        );
        assert!(
            t < u32::MAX as usize,
            "Routing::new: too many tokens for u32 rows"
        );
        let mut rows: Vec<Vec<(u32, u32)>> = vec![Vec::new(); experts];
        let mut expert = Vec::with_capacity(t * top_k);
        let mut row = Vec::with_capacity(t * top_k);
        for (tok, ix) in indices.chunks(top_k).enumerate() {
            for (slot, &j) in ix.iter().enumerate() {
                let ej = expert_of(j, experts, "Routing::new");
                assert!(
                    !ix[..slot].contains(&j),
                    "Routing::new: token {tok} chooses expert {j} twice"
                );
                expert.push(ej as u32);
                let list = &mut rows[ej];
                if capacity == 0 || list.len() < capacity {
                    row.push(list.len() as u32);
                    list.push((tok as u32, slot as u32));
                } else {
                    row.push(DROPPED);
                }
            }
        }
        Routing {
            tokens: t,
            top_k,
            capacity,
            expert,
            row,
            rows,
        }
    }

    /// Number of tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Slots per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Number of experts.
    pub fn experts(&self) -> usize {
        self.rows.len()
    }

    /// Tokens kept per expert (`0` = dropless).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Rows of `expert`'s buffer in use: the tokens routed to it and kept.
    pub fn count(&self, expert: usize) -> usize {
        self.rows[expert].len()
    }

    /// The `(token, slot)` of each row of `expert`'s buffer, in token order.
    pub fn rows(&self, expert: usize) -> impl ExactSizeIterator<Item = (usize, usize)> + '_ {
        self.rows[expert]
            .iter()
            .map(|&(t, s)| (t as usize, s as usize))
    }

    /// The expert of `(token, slot)`.
    pub fn expert_of(&self, token: usize, slot: usize) -> usize {
        self.expert[token * self.top_k + slot] as usize
    }

    /// The row of `(token, slot)` in its expert's buffer, `None` when it was dropped.
    pub fn row_of(&self, token: usize, slot: usize) -> Option<usize> {
        match self.row[token * self.top_k + slot] {
            DROPPED => None,
            r => Some(r as usize),
        }
    }

    /// Number of `(token, slot)` assignments dropped for lack of capacity.
    pub fn dropped(&self) -> usize {
        self.row.iter().filter(|&&r| r == DROPPED).count()
    }
}

/// Copies `x[token]` into row `r` of `out` for each listed token, zeroing the rest.
fn gather_rows(x: &[f32], tokens: &[usize], h: usize, out: &mut [f32]) {
    let copy = |(r, o): (usize, &mut [f32])| match tokens.get(r) {
        Some(&tok) => o.copy_from_slice(&x[tok * h..(tok + 1) * h]),
        None => o.fill(0.0),
    };
    let rows = out.len() / h;
    match row_chunk(rows, h) {
        Some(c) => out.par_chunks_mut(c * h).enumerate().for_each(|(i, o)| {
            o.chunks_mut(h)
                .enumerate()
                .for_each(|(j, o)| copy((i * c + j, o)))
        }),
        None => out.chunks_mut(h).enumerate().for_each(copy),
    }
}

fn check_dispatch_out(who: &str, x: &[f32], t: usize, h: usize, out: &[f32], count: usize) {
    assert!(h > 0, "{who}: h must be positive");
    assert_eq!(x.len(), t * h, "{who}: x must be [t, h]");
    assert!(out.len().is_multiple_of(h), "{who}: out must be [rows, h]");
    assert!(
        out.len() / h >= count,
        "{who}: out has {} rows for {count} routed tokens",
        out.len() / h
    );
}

/// Gathers the tokens routed to `expert` into `out` `[rows, h]`: `x` is `[t, h]`,
/// `indices` `[t, top_k]`. Tokens go in token order, at most `capacity` of them
/// (`0`: dropless; later tokens are dropped), and the rows past them are zeroed. Returns
/// the number of rows written. Selects the same tokens as [`Routing::new`] with the same
/// capacity.
#[allow(clippy::too_many_arguments)]
pub fn dispatch_fwd(
    x: &[f32],
    indices: &[i32],
    t: usize,
    h: usize,
    top_k: usize,
    expert: usize,
    capacity: usize,
    out: &mut [f32],
) -> usize {
    assert!(top_k >= 1, "dispatch_fwd: top_k must be positive");
    assert_eq!(
        indices.len(),
        t * top_k,
        "dispatch_fwd: indices must be [t, top_k]"
    );
    let limit = if capacity == 0 { usize::MAX } else { capacity };
    let tokens: Vec<usize> = indices
        .chunks(top_k)
        .enumerate()
        .filter(|(_, ix)| ix.contains(&(expert as i32)))
        .map(|(tok, _)| tok)
        .take(limit)
        .collect();
    check_dispatch_out("dispatch_fwd", x, t, h, out, tokens.len());
    gather_rows(x, &tokens, h, out);
    tokens.len()
}

/// [`dispatch_fwd`] from a prebuilt [`Routing`]: gathers `expert`'s kept tokens of `x`
/// `[t, h]` into `out` `[rows, h]`, zeroing the rows past them; returns their number.
pub fn dispatch_fwd_routed(
    x: &[f32],
    routing: &Routing,
    expert: usize,
    h: usize,
    out: &mut [f32],
) -> usize {
    let tokens: Vec<usize> = routing.rows(expert).map(|(tok, _)| tok).collect();
    check_dispatch_out(
        "dispatch_fwd_routed",
        x,
        routing.tokens(),
        h,
        out,
        tokens.len(),
    );
    gather_rows(x, &tokens, h, out);
    tokens.len()
}

/// Backward of dispatch: `dx[token] += dy[row]` for each row of `expert`'s buffer in
/// `routing`. `dy` is `[rows, h]` (rows past the routed count are ignored), `dx` is
/// `[t, h]`. Each token has at most one row per expert, so the work is split over the
/// tokens of `dx` without races.
pub fn dispatch_bwd(dy: &[f32], routing: &Routing, expert: usize, h: usize, dx: &mut [f32]) {
    assert!(h > 0, "dispatch_bwd: h must be positive");
    let (t, k) = (routing.tokens(), routing.top_k());
    assert_eq!(dx.len(), t * h, "dispatch_bwd: dx must be [t, h]");
    assert!(
        dy.len().is_multiple_of(h) && dy.len() / h >= routing.count(expert),
        "dispatch_bwd: dy must be [rows, h] with at least {} rows",
        routing.count(expert)
    );
    let add = |tok: usize, d: &mut [f32]| {
        for slot in 0..k {
            if routing.expert_of(tok, slot) == expert {
                if let Some(r) = routing.row_of(tok, slot) {
                    for (d, &g) in d.iter_mut().zip(&dy[r * h..(r + 1) * h]) {
                        *d += g;
                    }
                }
            }
        }
    };
    match row_chunk(t, h) {
        Some(c) => dx.par_chunks_mut(c * h).enumerate().for_each(|(i, d)| {
            for (j, d) in d.chunks_mut(h).enumerate() {
                add(i * c + j, d);
            }
        }),
        None => dx
            .chunks_mut(h)
            .enumerate()
            .for_each(|(tok, d)| add(tok, d)),
    }
}

fn check_combine(who: &str, weights: &[f32], routing: &Routing, ys: &[&[f32]], h: usize) {
    assert!(h > 0, "{who}: h must be positive");
    assert_eq!(
        weights.len(),
        routing.tokens() * routing.top_k(),
        "{who}: weights must be [t, top_k]"
    );
    assert_eq!(
        ys.len(),
        routing.experts(),
        "{who}: one expert output per expert"
    );
    for (e, y) in ys.iter().enumerate() {
        assert!(
            y.len().is_multiple_of(h) && y.len() / h >= routing.count(e),
            "{who}: expert {e}'s output must be [rows, h] with at least {} rows",
            routing.count(e)
        );
    }
}

/// Scatters the experts' outputs back, weighted by the router:
/// `out[t] = Σ_slot weights[t, slot] · ys[e][row]` over the token's kept slots (`e` its
/// expert, `row` its row there); dropped slots contribute nothing. `weights` is
/// `[t, top_k]`, `ys[e]` is `[rows_e, h]`, `out` `[t, h]` is overwritten. Sums in f64.
pub fn combine_fwd(
    weights: &[f32],
    routing: &Routing,
    ys: &[&[f32]],
    t: usize,
    h: usize,
    out: &mut [f32],
) {
    check_combine("combine_fwd", weights, routing, ys, h);
    assert_eq!(
        routing.tokens(),
        t,
        "combine_fwd: routing is for {} tokens",
        routing.tokens()
    );
    assert_eq!(out.len(), t * h, "combine_fwd: out must be [t, h]");
    let k = routing.top_k();
    let row = |tok: usize, o: &mut [f32], acc: &mut [f64]| {
        acc.fill(0.0);
        for slot in 0..k {
            if let Some(r) = routing.row_of(tok, slot) {
                let w = weights[tok * k + slot] as f64;
                let y = &ys[routing.expert_of(tok, slot)][r * h..(r + 1) * h];
                for (a, &y) in acc.iter_mut().zip(y) {
                    *a += w * y as f64;
                }
            }
        }
        for (o, &a) in o.iter_mut().zip(acc.iter()) {
            *o = a as f32;
        }
    };
    match row_chunk(t, h) {
        Some(c) => out.par_chunks_mut(c * h).enumerate().for_each(|(i, o)| {
            let mut acc = vec![0.0f64; h];
            for (j, o) in o.chunks_mut(h).enumerate() {
                row(i * c + j, o, &mut acc);
            }
        }),
        None => {
            let mut acc = vec![0.0f64; h];
            for (tok, o) in out.chunks_mut(h).enumerate() {
                row(tok, o, &mut acc);
            }
        }
    }
}

/// Backward of [`combine_fwd`], accumulating: `dweights[t, slot] += dout[t] · ys[e][row]`
/// (f64 dot) for kept slots, and `dys[e][row] += weights[t, slot] · dout[t]` for each row
/// in use (rows past the routed count are left alone). `dout` is `[t, h]`, `dweights`
/// `[t, top_k]`, `dys[e]` shaped as `ys[e]`.
pub fn combine_bwd(
    weights: &[f32],
    routing: &Routing,
    ys: &[&[f32]],
    dout: &[f32],
    h: usize,
    dweights: &mut [f32],
    dys: &mut [&mut [f32]],
) {
    check_combine("combine_bwd", weights, routing, ys, h);
    let (t, k) = (routing.tokens(), routing.top_k());
    assert_eq!(dout.len(), t * h, "combine_bwd: dout must be [t, h]");
    assert_eq!(
        dweights.len(),
        t * k,
        "combine_bwd: dweights must be [t, top_k]"
    );
    assert_eq!(dys.len(), ys.len(), "combine_bwd: one dy per expert");
    for (e, (dy, y)) in dys.iter().zip(ys).enumerate() {
        assert_eq!(
            dy.len(),
            y.len(),
            "combine_bwd: dys[{e}] must be shaped as ys[{e}]"
        );
    }

    // dweights: one row of top_k per token.
    let dw_rows = |t0: usize, dw: &mut [f32]| {
        for (i, dw) in dw.chunks_mut(k).enumerate() {
            let tok = t0 + i;
            let g = &dout[tok * h..(tok + 1) * h];
            for (slot, d) in dw.iter_mut().enumerate() {
                if let Some(r) = routing.row_of(tok, slot) {
                    let y = &ys[routing.expert_of(tok, slot)][r * h..(r + 1) * h];
                    *d += dot_f64(g, y) as f32;
                }
            }
        }
    };
    match row_chunk(t, h) {
        Some(c) => dweights
            .par_chunks_mut(c * k)
            .enumerate()
            .for_each(|(i, dw)| dw_rows(i * c, dw)),
        None => dw_rows(0, dweights),
    }

    // dys: each row of each expert's buffer receives one token's scaled gradient.
    for (e, dy) in dys.iter_mut().enumerate() {
        let n = routing.count(e);
        let list = &routing.rows[e];
        let dy = &mut dy[..n * h];
        let add = |r: usize, d: &mut [f32]| {
            let (tok, slot) = (list[r].0 as usize, list[r].1 as usize);
            let w = weights[tok * k + slot];
            for (d, &g) in d.iter_mut().zip(&dout[tok * h..(tok + 1) * h]) {
                *d += w * g;
            }
        };
        match row_chunk(n, h) {
            Some(c) => dy.par_chunks_mut(c * h).enumerate().for_each(|(i, d)| {
                for (j, d) in d.chunks_mut(h).enumerate() {
                    add(i * c + j, d);
                }
            }),
            None => dy.chunks_mut(h).enumerate().for_each(|(r, d)| add(r, d)),
        }
    }
}
