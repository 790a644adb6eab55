//! Multi-head attention with grouped-query heads (Llama's GQA, GPT-2's MHA): one masked
//! block kernel ([`masked_attention_fwd`] / [`masked_attention_bwd`]) and the causal
//! attention of a whole sequence built on it.
//!
//! Which keys a query may see is a [`Mask`]: causal (query `i` sees keys `0..=i`), causal by
//! global position (the context-parallel chunks of [`crate::context`], whose tokens carry
//! explicit positions), or full. Only the softmax rows depend on the mask; the tile loop
//! around them is the same for every mask.
//!
//! Work is split by query block: for each (sample, head, block of [`BLOCK_Q`] queries)
//! the forward computes the block's scores against every key it may see with one gemm,
//! a row softmax in place, then one gemm with V, writing straight into the strided
//! `[b, sq, nh, d]` output. The softmax rows are exact (not online), so the result is
//! the same as Hugging Face's eager `softmax(q·kᵀ * scale + causal_mask) · v`. The
//! backward recomputes the probabilities from the saved log-sum-exp and forms every
//! gradient with gemms; it runs one task per (sample, kv head) so that the query heads
//! sharing a kv head accumulate into `dk`/`dv` without races.

use gemm::Parallelism;
use rayon::prelude::*;

use crate::linear::{gemm_strided, rm, rm_mut, rm_t, MatMut, MatRef};
use crate::simd::{dot_f64, exp, max, simd_dispatch, sum_f64};
use crate::util::{SendConstPtr, SendPtr};

/// Queries per block (the rows of one scores gemm).
pub const BLOCK_Q: usize = 64;

/// Which keys each query may attend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mask<'a> {
    /// Queries and keys are the same sequence (`sq == sk`); query `i` sees keys `0..=i`.
    /// A block of queries `q0..q1` only computes scores against keys `0..q1`.
    Causal,
    /// Causal by global position, for a slice of the sequence (context-parallel chunks):
    /// query `i` sits at position `q[i]`, key `j` at `k[j]` (keys in any order), and query
    /// `i` sees key `j` iff `k[j] <= q[i]`. A query that sees no key gets `out = 0` and
    /// `lse = -inf`; its gradients are 0.
    Positions {
        /// Global position of each query (`sq` entries).
        q: &'a [u32],
        /// Global position of each key (`sk` entries).
        k: &'a [u32],
        /// A sliding window: query `i` sees key `j` only if also `q[i] - k[j] < window`
        /// (keys `q[i]-window+1 ..= q[i]`, transformers' sliding-window mask); 0: no window.
        window: u32,
    },
    /// Every query sees every key.
    Full,
}

impl Mask<'_> {
    /// Keys a block of queries ending at `q1` scores against (a prefix of the `sk` keys).
    fn keys(&self, q1: usize, sk: usize) -> usize {
        match self {
            Mask::Causal => q1,
            Mask::Positions { .. } | Mask::Full => sk,
        }
    }

    /// Softmax in place of the `[rows, keys]` scores of queries `q0..` and their
    /// log-sum-exps.
    fn softmax(&self, sc: &mut [f32], keys: usize, q0: usize, lse: &mut [f32]) {
        match *self {
            Mask::Causal => softmax_prefix(sc, keys, q0 + 1, lse),
            Mask::Full => softmax_prefix(sc, keys, keys, lse),
            Mask::Positions { q, k, window } => {
                softmax_pos(sc, keys, &q[q0..q0 + lse.len()], k, window, lse)
            }
        }
    }

    /// Probabilities and `ds` of the `[rows, keys]` block of queries `q0..` (see
    /// [`probs_and_ds_prefix`]).
    fn probs_and_ds(
        &self,
        p: &mut [f32],
        dp: &mut [f32],
        keys: usize,
        q0: usize,
        lse: &[f32],
        dd: &[f32],
    ) {
        match *self {
            Mask::Causal => probs_and_ds_prefix(p, dp, keys, q0 + 1, lse, dd),
            Mask::Full => probs_and_ds_prefix(p, dp, keys, keys, lse, dd),
            Mask::Positions { q, k, window } => {
                probs_and_ds_pos(p, dp, keys, &q[q0..q0 + lse.len()], k, window, lse, dd)
            }
        }
    }

    /// Whether a block of queries with these final log-sum-exps contributes no gradient
    /// (every query sees no key at all; only a positional mask has such queries).
    fn skips(&self, lse: &[f32]) -> bool {
        match self {
            Mask::Positions { .. } => lse.iter().all(|&l| l == f32::NEG_INFINITY),
            Mask::Causal | Mask::Full => false,
        }
    }
}

/// Whether a query at position `q` may attend a key at position `k`: causal (`k <= q`) and,
/// with a sliding window (`window > 0`), `q - k < window`.
#[inline(always)]
fn sees(q: u32, k: u32, window: u32) -> bool {
    k <= q && (window == 0 || q - k < window)
}

/// `1 / sqrt(d)` as Hugging Face computes it (`head_dim ** -0.5` in f64, used as f32).
fn softmax_scale(d: usize) -> f32 {
    (d as f64).powf(-0.5) as f32
}

simd_dispatch! {
    /// Softmax of each row of a `[rows, keys]` score block in place, where row `r` sees the
    /// first `min(first + r, keys)` keys; masked entries become 0. Writes each row's
    /// log-sum-exp to `lse[r]`. Causal: `first = q0 + 1`; full: `first = keys`.
    fn softmax_prefix(sc: &mut [f32], keys: usize, first: usize, lse: &mut [f32]) {
        for (r, (row, l)) in sc.chunks_exact_mut(keys).zip(lse.iter_mut()).enumerate() {
            let valid = (first + r).min(keys);
            let (live, masked) = row.split_at_mut(valid);
            let m = max(live);
            for x in live.iter_mut() {
                *x = exp(*x - m);
            }
            let sum = sum_f64(live);
            let inv = (1.0 / sum) as f32;
            for x in live.iter_mut() {
                *x *= inv;
            }
            masked.fill(0.0);
            *l = (m as f64 + sum.ln()) as f32;
        }
    }
}

simd_dispatch! {
    /// Turns a `[rows, keys]` scaled-score block into probabilities `exp(s - lse)` (0 where
    /// masked), then `dp` into `ds = p * (dp - D)` with `D[r] = dot(dout_r, out_r)`; row `r`
    /// sees the first `min(first + r, keys)` keys, as in [`softmax_prefix`].
    fn probs_and_ds_prefix(p: &mut [f32], dp: &mut [f32], keys: usize, first: usize, lse: &[f32], dd: &[f32]) {
        let rows = p.chunks_exact_mut(keys).zip(dp.chunks_exact_mut(keys));
        for (r, (prow, dprow)) in rows.enumerate() {
            let valid = (first + r).min(keys);
            let (l, dr) = (lse[r], dd[r]);
            for (x, g) in prow[..valid].iter_mut().zip(&mut dprow[..valid]) {
                let pv = exp(*x - l);
                *x = pv;
                *g = pv * (*g - dr);
            }
            prow[valid..].fill(0.0);
            dprow[valid..].fill(0.0);
        }
    }
}

simd_dispatch! {
    /// Masked softmax of each row of a `[rows, keys]` score block in place: row `r` (query
    /// at position `qp[r]`) sees key `j` iff `kp[j] <= qp[r]`; masked entries become 0.
    /// Writes each row's log-sum-exp to `lse[r]`; a row that sees no key becomes all 0 with
    /// `lse = -inf`.
    fn softmax_pos(sc: &mut [f32], keys: usize, qp: &[u32], kp: &[u32], window: u32, lse: &mut [f32]) {
        for ((row, l), &qi) in sc.chunks_exact_mut(keys).zip(lse.iter_mut()).zip(qp) {
            for (x, &kj) in row.iter_mut().zip(kp) {
                if !sees(qi, kj, window) {
                    *x = f32::NEG_INFINITY;
                }
            }
            let m = max(row);
            if m == f32::NEG_INFINITY {
                row.fill(0.0);
                *l = f32::NEG_INFINITY;
                continue;
            }
            // exp(-inf) is 0 (the masked entries).
            for x in row.iter_mut() {
                *x = exp(*x - m);
            }
            let sum = sum_f64(row);
            let inv = (1.0 / sum) as f32;
            for x in row.iter_mut() {
                *x *= inv;
            }
            *l = (m as f64 + sum.ln()) as f32;
        }
    }
}

simd_dispatch! {
    /// Positional form of [`probs_and_ds_prefix`]: `p = exp(s - lse)` (0 where masked or
    /// where `lse = -inf`), then `dp` into `ds = p * (dp - D)`.
    fn probs_and_ds_pos(p: &mut [f32], dp: &mut [f32], keys: usize, qp: &[u32], kp: &[u32], window: u32, lse: &[f32], dd: &[f32]) {
        let rows = p.chunks_exact_mut(keys).zip(dp.chunks_exact_mut(keys));
        for (r, (prow, dprow)) in rows.enumerate() {
            let (qi, l, dr) = (qp[r], lse[r], dd[r]);
            if l == f32::NEG_INFINITY {
                prow.fill(0.0);
                dprow.fill(0.0);
                continue;
            }
            for ((x, g), &kj) in prow.iter_mut().zip(dprow.iter_mut()).zip(kp) {
                let pv = if sees(qi, kj, window) { exp(*x - l) } else { 0.0 };
                *x = pv;
                *g = pv * (*g - dr);
            }
        }
    }
}

/// Shape checks shared by the forward and backward: heads, `q`, `k`, `v` and the mask.
#[allow(clippy::too_many_arguments)]
fn check_shapes(
    what: &str,
    mask: &Mask,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    b: usize,
    sq: usize,
    sk: usize,
    nh: usize,
    nkv: usize,
    d: usize,
) {
    assert!(
        nkv > 0 && nh.is_multiple_of(nkv),
        "{what}: heads ({nh}) must be a multiple of kv heads ({nkv})"
    );
    assert!(d > 0, "{what}: head_dim must be positive");
    assert_eq!(q.len(), b * sq * nh * d, "{what}: q must be [b, sq, nh, d]");
    assert_eq!(
        k.len(),
        b * sk * nkv * d,
        "{what}: k must be [b, sk, nkv, d]"
    );
    assert_eq!(
        v.len(),
        b * sk * nkv * d,
        "{what}: v must be [b, sk, nkv, d]"
    );
    match mask {
        Mask::Causal => assert_eq!(sq, sk, "{what}: a causal mask needs sq == sk"),
        Mask::Positions { q, k, .. } => {
            assert_eq!(q.len(), sq, "{what}: q positions must have sq entries");
            assert_eq!(k.len(), sk, "{what}: k positions must have sk entries");
        }
        Mask::Full => {}
    }
}

/// Causal scaled-dot-product attention forward. `q`, `out` are `[b, s, nh, d]`; `k`, `v`
/// are `[b, s, nkv, d]`; query head `j` reads kv head `j / (nh / nkv)` (Hugging Face's
/// `repeat_kv`). Scores are scaled by `1/sqrt(d)`; query `i` sees keys `0..=i`. Writes
/// `out` and `lse` (`[b, nh, s]`, the natural-log log-sum-exp of each query's scaled
/// scores, needed by [`attention_bwd`]). [`masked_attention_fwd`] with [`Mask::Causal`].
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    b: usize,
    s: usize,
    nh: usize,
    nkv: usize,
    d: usize,
    out: &mut [f32],
    lse: &mut [f32],
) {
    masked_attention_fwd(q, k, v, Mask::Causal, b, s, s, nh, nkv, d, out, lse);
}

/// Backward of [`attention_fwd`], given its inputs, `out` and `lse`: accumulates
/// `dq += ∂/∂q`, `dk += ∂/∂k`, `dv += ∂/∂v` (kv heads shared by several query heads
/// receive the sum over the group). [`masked_attention_bwd`] with [`Mask::Causal`].
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    b: usize,
    s: usize,
    nh: usize,
    nkv: usize,
    d: usize,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
    masked_attention_bwd(
        q,
        k,
        v,
        out,
        lse,
        dout,
        Mask::Causal,
        b,
        s,
        s,
        nh,
        nkv,
        d,
        dq,
        dk,
        dv,
    );
}

/// Attention of `sq` queries against `sk` keys under `mask`: the block kernel every
/// attention forward runs.
///
/// `q`, `out` are `[b, sq, nh, d]`; `k`, `v` are `[b, sk, nkv, d]`; query head `j` reads kv
/// head `j / (nh / nkv)`. Scores are scaled by `1/sqrt(d)`. Writes `out` (the softmax over
/// the allowed keys, times `v`) and `lse` (`[b, nh, sq]`, natural-log log-sum-exp of the
/// allowed scaled scores). With no keys (`sk == 0`) every query gets `out = 0` and
/// `lse = -inf`. Overwrites `out` and `lse`.
#[allow(clippy::too_many_arguments)]
pub fn masked_attention_fwd(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Mask,
    b: usize,
    sq: usize,
    sk: usize,
    nh: usize,
    nkv: usize,
    d: usize,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let what = "masked_attention_fwd";
    check_shapes(what, &mask, q, k, v, b, sq, sk, nh, nkv, d);
    assert_eq!(
        out.len(),
        b * sq * nh * d,
        "{what}: out must be [b, sq, nh, d]"
    );
    assert_eq!(lse.len(), b * nh * sq, "{what}: lse must be [b, nh, sq]");
    if b * sq * nh == 0 {
        return;
    }
    if sk == 0 {
        out.fill(0.0);
        lse.fill(f32::NEG_INFINITY);
        return;
    }
    let group = nh / nkv;
    let scale = softmax_scale(d);
    let nqb = sq.div_ceil(BLOCK_Q);
    let tasks = b * nh * nqb;
    let par = inner_parallelism(tasks);
    let (qp, kp, vp) = (
        SendConstPtr(q.as_ptr()),
        SendConstPtr(k.as_ptr()),
        SendConstPtr(v.as_ptr()),
    );
    let op = SendPtr(out.as_mut_ptr());
    let lp = SendPtr(lse.as_mut_ptr());
    let (qs, ks) = (nh * d, nkv * d); // row strides of q/out and k/v
    (0..tasks).into_par_iter().for_each_init(
        || vec![0.0f32; BLOCK_Q * sk],
        |sc, t| {
            let (bi, rest) = (t / (nh * nqb), t % (nh * nqb));
            let (hj, qb) = (rest / nqb, rest % nqb);
            let kvh = hj / group;
            let q0 = qb * BLOCK_Q;
            let q1 = (q0 + BLOCK_Q).min(sq);
            let (rows, keys) = (q1 - q0, mask.keys(q1, sk));
            let sc = &mut sc[..rows * keys];
            let qoff = ((bi * sq + q0) * nh + hj) * d;
            let koff = (bi * sk * nkv + kvh) * d;
            // SAFETY: offsets and strides stay inside q, k, v, out (checked lengths); this
            // task alone writes rows q0..q1 of head hj of sample bi in `out`, and
            // lse[bi, hj, q0..q1].
            unsafe {
                gemm_strided(
                    rows,
                    keys,
                    d,
                    rm_mut(sc.as_mut_ptr(), keys),
                    false,
                    MatRef {
                        ptr: qp.get().add(qoff),
                        rs: qs as isize,
                        cs: 1,
                    },
                    MatRef {
                        ptr: kp.get().add(koff),
                        rs: 1,
                        cs: ks as isize,
                    },
                    scale,
                    par,
                );
                let lse_blk =
                    std::slice::from_raw_parts_mut(lp.get().add((bi * nh + hj) * sq + q0), rows);
                mask.softmax(sc, keys, q0, lse_blk);
                gemm_strided(
                    rows,
                    d,
                    keys,
                    MatMut {
                        ptr: op.get().add(qoff),
                        rs: qs as isize,
                        cs: 1,
                    },
                    false,
                    rm(sc.as_ptr(), keys),
                    MatRef {
                        ptr: vp.get().add(koff),
                        rs: ks as isize,
                        cs: 1,
                    },
                    1.0,
                    par,
                );
            }
        },
    );
}

/// Backward of [`masked_attention_fwd`] over these keys, given the **final** `out` and
/// `lse` of the queries (for keys split in blocks, merged over every block, e.g. by
/// [`crate::attention_merge`]). Accumulates this key set's share of the gradients:
/// `dq += ∂/∂q` (`[b, sq, nh, d]`), `dk += ∂/∂k`, `dv += ∂/∂v` (`[b, sk, nkv, d]`; kv heads
/// shared by several query heads receive the group's sum). Summing the calls over a
/// partition of the keys gives the full backward.
#[allow(clippy::too_many_arguments)]
pub fn masked_attention_bwd(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    mask: Mask,
    b: usize,
    sq: usize,
    sk: usize,
    nh: usize,
    nkv: usize,
    d: usize,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
    let what = "masked_attention_bwd";
    check_shapes(what, &mask, q, k, v, b, sq, sk, nh, nkv, d);
    let (qn, kn) = (b * sq * nh * d, b * sk * nkv * d);
    assert_eq!(out.len(), qn, "{what}: out must be [b, sq, nh, d]");
    assert_eq!(dout.len(), qn, "{what}: dout must be [b, sq, nh, d]");
    assert_eq!(lse.len(), b * nh * sq, "{what}: lse must be [b, nh, sq]");
    assert_eq!(dq.len(), qn, "{what}: dq must be [b, sq, nh, d]");
    assert_eq!(dk.len(), kn, "{what}: dk must be [b, sk, nkv, d]");
    assert_eq!(dv.len(), kn, "{what}: dv must be [b, sk, nkv, d]");
    if b * sq * nh == 0 || sk == 0 {
        return;
    }
    let group = nh / nkv;
    let scale = softmax_scale(d);
    let nqb = sq.div_ceil(BLOCK_Q);
    let tasks = b * nkv;
    let par = inner_parallelism(tasks);
    let (qs, ks) = (nh * d, nkv * d);
    let (qp, kp, vp) = (
        SendConstPtr(q.as_ptr()),
        SendConstPtr(k.as_ptr()),
        SendConstPtr(v.as_ptr()),
    );
    let (dqp, dkp, dvp) = (
        SendPtr(dq.as_mut_ptr()),
        SendPtr(dk.as_mut_ptr()),
        SendPtr(dv.as_mut_ptr()),
    );
    (0..tasks).into_par_iter().for_each_init(
        || {
            (
                vec![0.0f32; BLOCK_Q * sk],
                vec![0.0f32; BLOCK_Q * sk],
                [0.0f32; BLOCK_Q],
            )
        },
        |(pbuf, dpbuf, dd), t| {
            let (bi, kvh) = (t / nkv, t % nkv);
            let koff = (bi * sk * nkv + kvh) * d;
            for hj in kvh * group..(kvh + 1) * group {
                for qb in 0..nqb {
                    let q0 = qb * BLOCK_Q;
                    let q1 = (q0 + BLOCK_Q).min(sq);
                    let (rows, keys) = (q1 - q0, mask.keys(q1, sk));
                    let lse_blk = &lse[(bi * nh + hj) * sq + q0..(bi * nh + hj) * sq + q1];
                    if mask.skips(lse_blk) {
                        continue;
                    }
                    let qoff = ((bi * sq + q0) * nh + hj) * d;
                    let p = &mut pbuf[..rows * keys];
                    let dp = &mut dpbuf[..rows * keys];
                    for (r, dr) in dd[..rows].iter_mut().enumerate() {
                        let o = qoff + r * qs;
                        *dr = dot_f64(&dout[o..o + d], &out[o..o + d]) as f32;
                    }
                    let q_blk = MatRef {
                        ptr: qp.get().wrapping_add(qoff),
                        rs: qs as isize,
                        cs: 1,
                    };
                    let do_blk = rm(dout.as_ptr().wrapping_add(qoff), qs);
                    let k_all = MatRef {
                        ptr: kp.get().wrapping_add(koff),
                        rs: ks as isize,
                        cs: 1,
                    };
                    let v_all = MatRef {
                        ptr: vp.get().wrapping_add(koff),
                        rs: ks as isize,
                        cs: 1,
                    };
                    let t_of = |m: MatRef| MatRef {
                        ptr: m.ptr,
                        rs: m.cs,
                        cs: m.rs,
                    };
                    // SAFETY: every view stays inside its checked slice; this task alone
                    // writes dq rows of heads kvh*group.. of sample bi and dk/dv rows of kv
                    // head kvh of sample bi.
                    unsafe {
                        // S = scale * Q Kᵀ, P = exp(S - lse).
                        gemm_strided(
                            rows,
                            keys,
                            d,
                            rm_mut(p.as_mut_ptr(), keys),
                            false,
                            q_blk,
                            t_of(k_all),
                            scale,
                            par,
                        );
                        // dP = dO Vᵀ.
                        gemm_strided(
                            rows,
                            keys,
                            d,
                            rm_mut(dp.as_mut_ptr(), keys),
                            false,
                            do_blk,
                            t_of(v_all),
                            1.0,
                            par,
                        );
                        mask.probs_and_ds(p, dp, keys, q0, lse_blk, &dd[..rows]);
                        // dV += Pᵀ dO.
                        gemm_strided(
                            keys,
                            d,
                            rows,
                            MatMut {
                                ptr: dvp.get().add(koff),
                                rs: ks as isize,
                                cs: 1,
                            },
                            true,
                            rm_t(p.as_ptr(), keys),
                            do_blk,
                            1.0,
                            par,
                        );
                        // dQ += scale * dS K.
                        gemm_strided(
                            rows,
                            d,
                            keys,
                            MatMut {
                                ptr: dqp.get().add(qoff),
                                rs: qs as isize,
                                cs: 1,
                            },
                            true,
                            rm(dp.as_ptr(), keys),
                            k_all,
                            scale,
                            par,
                        );
                        // dK += scale * dSᵀ Q.
                        gemm_strided(
                            keys,
                            d,
                            rows,
                            MatMut {
                                ptr: dkp.get().add(koff),
                                rs: ks as isize,
                                cs: 1,
                            },
                            true,
                            rm_t(dp.as_ptr(), keys),
                            q_blk,
                            scale,
                            par,
                        );
                    }
                }
            }
        },
    );
}

/// Threading inside one task's gemms: only when there are too few tasks to keep every
/// thread busy.
fn inner_parallelism(tasks: usize) -> Parallelism {
    let threads = rayon::current_num_threads();
    if threads > 1 && tasks < 2 * threads {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    }
}
