//! Causal multi-head attention with grouped-query heads (Llama's GQA, GPT-2's MHA).
//!
//! Work is split by query block: for each (sample, head, block of [`BLOCK_Q`] queries)
//! the forward computes the block's scores against every key it may see with one gemm,
//! a row softmax in place, then one gemm with V, writing straight into the strided
//! `[b, s, nh, d]` output. The softmax rows are exact (not online), so the result is
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

/// `1 / sqrt(d)` as Hugging Face computes it (`head_dim ** -0.5` in f64, used as f32).
fn softmax_scale(d: usize) -> f32 {
    (d as f64).powf(-0.5) as f32
}

/// Shape checks shared by forward and backward.
fn check_heads(nh: usize, nkv: usize, d: usize) {
    assert!(
        nkv > 0 && nh.is_multiple_of(nkv),
        "attention: heads ({nh}) must be a multiple of kv heads ({nkv})"
    );
    assert!(d > 0, "attention: head_dim must be positive");
}

simd_dispatch! {
    /// Softmax of each row of a `[rows, keys]` score block in place, where row `r` (query
    /// `q0 + r`) sees keys `0..=q0 + r`; masked entries become 0. Writes each row's
    /// log-sum-exp to `lse[r]`.
    fn softmax_block(sc: &mut [f32], keys: usize, q0: usize, lse: &mut [f32]) {
        for (r, (row, l)) in sc.chunks_exact_mut(keys).zip(lse.iter_mut()).enumerate() {
            let valid = q0 + r + 1;
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
    /// masked), then `dp` into `ds = p * (dp - D)` with `D[r] = dot(dout_r, out_r)`.
    fn probs_and_ds(p: &mut [f32], dp: &mut [f32], keys: usize, q0: usize, lse: &[f32], dd: &[f32]) {
        let rows = p.chunks_exact_mut(keys).zip(dp.chunks_exact_mut(keys));
        for (r, (prow, dprow)) in rows.enumerate() {
            let valid = q0 + r + 1;
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

/// Causal scaled-dot-product attention forward. `q`, `out` are `[b, s, nh, d]`; `k`, `v`
/// are `[b, s, nkv, d]`; query head `j` reads kv head `j / (nh / nkv)` (Hugging Face's
/// `repeat_kv`). Scores are scaled by `1/sqrt(d)`; query `i` sees keys `0..=i`. Writes
/// `out` and `lse` (`[b, nh, s]`, the natural-log log-sum-exp of each query's scaled
/// scores, needed by [`attention_bwd`]).
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
    check_heads(nh, nkv, d);
    assert_eq!(
        q.len(),
        b * s * nh * d,
        "attention_fwd: q must be [b, s, nh, d]"
    );
    assert_eq!(
        k.len(),
        b * s * nkv * d,
        "attention_fwd: k must be [b, s, nkv, d]"
    );
    assert_eq!(
        v.len(),
        b * s * nkv * d,
        "attention_fwd: v must be [b, s, nkv, d]"
    );
    assert_eq!(
        out.len(),
        b * s * nh * d,
        "attention_fwd: out must be [b, s, nh, d]"
    );
    assert_eq!(
        lse.len(),
        b * nh * s,
        "attention_fwd: lse must be [b, nh, s]"
    );
    if b * s * nh == 0 {
        return;
    }
    let group = nh / nkv;
    let scale = softmax_scale(d);
    let nqb = s.div_ceil(BLOCK_Q);
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
        || vec![0.0f32; BLOCK_Q * s],
        |sc, t| {
            let (bi, rest) = (t / (nh * nqb), t % (nh * nqb));
            let (hj, qb) = (rest / nqb, rest % nqb);
            let kvh = hj / group;
            let q0 = qb * BLOCK_Q;
            let q1 = (q0 + BLOCK_Q).min(s);
            let (rows, keys) = (q1 - q0, q1);
            let sc = &mut sc[..rows * keys];
            let qoff = ((bi * s + q0) * nh + hj) * d;
            let koff = (bi * s * nkv + kvh) * d;
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
                    std::slice::from_raw_parts_mut(lp.get().add((bi * nh + hj) * s + q0), rows);
                softmax_block(sc, keys, q0, lse_blk);
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

/// Backward of [`attention_fwd`], given its inputs, `out` and `lse`: accumulates
/// `dq += ∂/∂q`, `dk += ∂/∂k`, `dv += ∂/∂v` (kv heads shared by several query heads
/// receive the sum over the group).
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
    check_heads(nh, nkv, d);
    let (qn, kn) = (b * s * nh * d, b * s * nkv * d);
    assert_eq!(q.len(), qn, "attention_bwd: q must be [b, s, nh, d]");
    assert_eq!(k.len(), kn, "attention_bwd: k must be [b, s, nkv, d]");
    assert_eq!(v.len(), kn, "attention_bwd: v must be [b, s, nkv, d]");
    assert_eq!(out.len(), qn, "attention_bwd: out must be [b, s, nh, d]");
    assert_eq!(dout.len(), qn, "attention_bwd: dout must be [b, s, nh, d]");
    assert_eq!(
        lse.len(),
        b * nh * s,
        "attention_bwd: lse must be [b, nh, s]"
    );
    assert_eq!(dq.len(), qn, "attention_bwd: dq must be [b, s, nh, d]");
    assert_eq!(dk.len(), kn, "attention_bwd: dk must be [b, s, nkv, d]");
    assert_eq!(dv.len(), kn, "attention_bwd: dv must be [b, s, nkv, d]");
    if b * s * nh == 0 {
        return;
    }
    let group = nh / nkv;
    let scale = softmax_scale(d);
    let nqb = s.div_ceil(BLOCK_Q);
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
                vec![0.0f32; BLOCK_Q * s],
                vec![0.0f32; BLOCK_Q * s],
                [0.0f32; BLOCK_Q],
            )
        },
        |(pbuf, dpbuf, dd), t| {
            let (bi, kvh) = (t / nkv, t % nkv);
            let koff = (bi * s * nkv + kvh) * d;
            for hj in kvh * group..(kvh + 1) * group {
                for qb in 0..nqb {
                    let q0 = qb * BLOCK_Q;
                    let q1 = (q0 + BLOCK_Q).min(s);
                    let (rows, keys) = (q1 - q0, q1);
                    let qoff = ((bi * s + q0) * nh + hj) * d;
                    let p = &mut pbuf[..rows * keys];
                    let dp = &mut dpbuf[..rows * keys];
                    for (r, dr) in dd[..rows].iter_mut().enumerate() {
                        let o = qoff + r * qs;
                        *dr = dot_f64(&dout[o..o + d], &out[o..o + d]) as f32;
                    }
                    let lse_blk = &lse[(bi * nh + hj) * s + q0..(bi * nh + hj) * s + q1];
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
                        probs_and_ds(p, dp, keys, q0, lse_blk, &dd[..rows]);
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
