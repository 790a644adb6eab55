//! Kernels for context parallelism (CP): attention and rotary embeddings on a slice of the
//! sequence whose tokens carry explicit global positions.
//!
//! With `cp` ranks the sequence of length `S` is cut into `2·cp` chunks of `c = S/(2·cp)`
//! tokens; rank `r` holds chunks `r` and `2·cp-1-r` (so every rank gets the same share of
//! causal work), concatenated into a local sequence of `2c` tokens whose global positions
//! [`cp_local_positions`] returns. Queries stay local; keys and values are either
//! all-gathered (one [`attention_block_fwd`] call over every key) or passed around a ring
//! (one call per key block, the partial results combined with [`attention_merge`] /
//! [`attention_merge_into`]). Masking is by global position: query `i` may attend key `j`
//! iff `k_pos[j] <= q_pos[i]`.
//!
//! The backward ([`attention_block_bwd`]) takes the *final* (merged over every key block)
//! `out` and `lse`: with `P = exp(scores - lse)` and `D_i = rowsum(dout_i · out_i)`, the
//! flash-attention identity `dS = P ∘ (dP - D)` splits exactly over key blocks, so the ring
//! backward calls it once per block and the gradients add up to the full ones.
//!
//! Layouts follow [`crate::attention`]: `q`, `out` are `[b, sq, nh, d]`; `k`, `v` are
//! `[b, sk, nkv, d]`; `lse` is `[b, nh, sq]`; positions are shared by every sample.

use rayon::prelude::*;

use crate::attention::BLOCK_Q;
use crate::linear::{gemm_strided, rm, rm_mut, rm_t, MatMut, MatRef};
use crate::simd::{dot_f64, exp, max, simd_dispatch, sum_f64};
use crate::util::{row_chunk, SendConstPtr, SendPtr};

// ---------------------------------------------------------------------------------------
// Positions
// ---------------------------------------------------------------------------------------

/// Global positions of the `2c` local tokens of `rank` under load-balanced context
/// parallelism over `cp` ranks and a sequence of `s` tokens (`c = s / (2·cp)`): chunk
/// `rank` (`rank·c .. (rank+1)·c`) followed by chunk `2·cp-1-rank`.
pub fn cp_local_positions(s: usize, cp: usize, rank: usize) -> Vec<u32> {
    assert!(cp > 0, "cp_local_positions: cp must be positive");
    assert!(rank < cp, "cp_local_positions: rank {rank} >= cp {cp}");
    assert!(
        s.is_multiple_of(2 * cp),
        "cp_local_positions: sequence length {s} is not a multiple of 2·cp = {}",
        2 * cp
    );
    assert!(
        s <= u32::MAX as usize,
        "cp_local_positions: sequence too long"
    );
    let c = s / (2 * cp);
    let (a, z) = (rank * c, (2 * cp - 1 - rank) * c);
    (a..a + c).chain(z..z + c).map(|p| p as u32).collect()
}

// ---------------------------------------------------------------------------------------
// RoPE with explicit positions
// ---------------------------------------------------------------------------------------

/// [`crate::rope_fwd`] for a local sequence whose token `i` sits at global position
/// `positions[i]` (`x`, `y` are `[b, s_local, nh, d]`, `positions.len() == s_local`).
/// Bit-identical to `rope_fwd` on the rows at those positions. Overwrites `y`.
#[allow(clippy::too_many_arguments)]
pub fn rope_fwd_positions(
    x: &[f32],
    b: usize,
    s_local: usize,
    nh: usize,
    d: usize,
    theta: f32,
    positions: &[u32],
    y: &mut [f32],
) {
    crate::rope::rope_apply_at(x, b, s_local, nh, d, theta, positions, y, false);
}

/// Backward of [`rope_fwd_positions`]: `dx += Rᵀ dy`.
#[allow(clippy::too_many_arguments)]
pub fn rope_bwd_positions(
    dy: &[f32],
    b: usize,
    s_local: usize,
    nh: usize,
    d: usize,
    theta: f32,
    positions: &[u32],
    dx: &mut [f32],
) {
    crate::rope::rope_apply_at(dy, b, s_local, nh, d, theta, positions, dx, true);
}

// ---------------------------------------------------------------------------------------
// Block attention
// ---------------------------------------------------------------------------------------

/// `1 / sqrt(d)` as Hugging Face computes it (same as [`crate::attention`]).
fn softmax_scale(d: usize) -> f32 {
    (d as f64).powf(-0.5) as f32
}

simd_dispatch! {
    /// Masked softmax of each row of a `[rows, keys]` score block in place: row `r` (query
    /// at position `qp[r]`) sees key `j` iff `kp[j] <= qp[r]`; masked entries become 0.
    /// Writes each row's log-sum-exp to `lse[r]`; a row that sees no key becomes all 0 with
    /// `lse = -inf`.
    fn softmax_block_pos(sc: &mut [f32], keys: usize, qp: &[u32], kp: &[u32], lse: &mut [f32]) {
        for ((row, l), &qi) in sc.chunks_exact_mut(keys).zip(lse.iter_mut()).zip(qp) {
            for (x, &kj) in row.iter_mut().zip(kp) {
                if kj > qi {
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
    /// Turns a `[rows, keys]` scaled-score block into `p = exp(s - lse)` (0 where masked or
    /// where `lse = -inf`), then `dp` into `ds = p * (dp - D)`.
    fn probs_and_ds_pos(p: &mut [f32], dp: &mut [f32], keys: usize, qp: &[u32], kp: &[u32], lse: &[f32], dd: &[f32]) {
        let rows = p.chunks_exact_mut(keys).zip(dp.chunks_exact_mut(keys));
        for (r, (prow, dprow)) in rows.enumerate() {
            let (qi, l, dr) = (qp[r], lse[r], dd[r]);
            if l == f32::NEG_INFINITY {
                prow.fill(0.0);
                dprow.fill(0.0);
                continue;
            }
            for ((x, g), &kj) in prow.iter_mut().zip(dprow.iter_mut()).zip(kp) {
                let pv = if kj <= qi { exp(*x - l) } else { 0.0 };
                *x = pv;
                *g = pv * (*g - dr);
            }
        }
    }
}

/// Shape checks shared by the block kernels.
#[allow(clippy::too_many_arguments)]
fn check_block(
    what: &str,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_pos: &[u32],
    k_pos: &[u32],
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
    assert_eq!(q_pos.len(), sq, "{what}: q_pos must have sq entries");
    assert_eq!(k_pos.len(), sk, "{what}: k_pos must have sk entries");
}

/// Threading inside one task's gemms: only when there are too few tasks to keep every
/// thread busy.
fn inner_parallelism(tasks: usize) -> gemm::Parallelism {
    let threads = rayon::current_num_threads();
    if threads > 1 && tasks < 2 * threads {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    }
}

/// Attention of local queries against one block of keys, masked by global position.
///
/// `q`, `out` are `[b, sq, nh, d]`; `k`, `v` are `[b, sk, nkv, d]`; query head `j` reads kv
/// head `j / (nh / nkv)`. Scores are scaled by `1/sqrt(d)`; query `i` may attend key `j`
/// iff `k_pos[j] <= q_pos[i]` (keys may come in any order). Writes `out` (the softmax over
/// the allowed keys of this block, times `v`) and `lse` (`[b, nh, sq]`, natural-log
/// log-sum-exp of the allowed scaled scores). A query that may attend no key of the block
/// gets `out = 0` and `lse = -inf` (what [`attention_merge`] expects). With
/// `q_pos = k_pos = 0..s` this is [`crate::attention_fwd`]. Overwrites `out` and `lse`.
#[allow(clippy::too_many_arguments)]
pub fn attention_block_fwd(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_pos: &[u32],
    k_pos: &[u32],
    b: usize,
    sq: usize,
    sk: usize,
    nh: usize,
    nkv: usize,
    d: usize,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let what = "attention_block_fwd";
    check_block(what, q, k, v, q_pos, k_pos, b, sq, sk, nh, nkv, d);
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
    let keys = sk;
    (0..tasks).into_par_iter().for_each_init(
        || vec![0.0f32; BLOCK_Q * keys],
        |sc, t| {
            let (bi, rest) = (t / (nh * nqb), t % (nh * nqb));
            let (hj, qb) = (rest / nqb, rest % nqb);
            let kvh = hj / group;
            let q0 = qb * BLOCK_Q;
            let q1 = (q0 + BLOCK_Q).min(sq);
            let rows = q1 - q0;
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
                softmax_block_pos(sc, keys, &q_pos[q0..q1], k_pos, lse_blk);
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

/// Backward of attention over one key block, given the **final** `out` and `lse` of the
/// queries (merged over every key block they attend, e.g. by [`attention_merge`]; for a
/// single block, those [`attention_block_fwd`] wrote). Accumulates this block's share of
/// the gradients: `dq += ∂/∂q` (`[b, sq, nh, d]`), `dk += ∂/∂k`, `dv += ∂/∂v`
/// (`[b, sk, nkv, d]`; kv heads shared by several query heads receive the group's sum).
/// Summing the calls over a partition of the keys gives the full backward. Queries with
/// `lse = -inf` (no allowed key anywhere) contribute nothing.
#[allow(clippy::too_many_arguments)]
pub fn attention_block_bwd(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    q_pos: &[u32],
    k_pos: &[u32],
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
    let what = "attention_block_bwd";
    check_block(what, q, k, v, q_pos, k_pos, b, sq, sk, nh, nkv, d);
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
    let keys = sk;
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
                vec![0.0f32; BLOCK_Q * keys],
                vec![0.0f32; BLOCK_Q * keys],
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
                    let rows = q1 - q0;
                    let lse_blk = &lse[(bi * nh + hj) * sq + q0..(bi * nh + hj) * sq + q1];
                    if lse_blk.iter().all(|&l| l == f32::NEG_INFINITY) {
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
                        probs_and_ds_pos(p, dp, keys, &q_pos[q0..q1], k_pos, lse_blk, &dd[..rows]);
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

// ---------------------------------------------------------------------------------------
// Merging partial results
// ---------------------------------------------------------------------------------------

/// Weights `(wa, wb)` and merged log-sum-exp of two partial results with log-sum-exps
/// `la`, `lb` over disjoint key sets. Both `-inf`: `(0, 0, -inf)`.
#[inline]
fn merge_weights(la: f32, lb: f32) -> (f32, f32, f32) {
    let m = la.max(lb);
    if m == f32::NEG_INFINITY {
        return (0.0, 0.0, f32::NEG_INFINITY);
    }
    if lb == f32::NEG_INFINITY {
        return (1.0, 0.0, la);
    }
    if la == f32::NEG_INFINITY {
        return (0.0, 1.0, lb);
    }
    let (ea, eb) = (((la - m) as f64).exp(), ((lb - m) as f64).exp());
    let sum = ea + eb;
    let l = m as f64 + sum.ln();
    ((ea / sum) as f32, (eb / sum) as f32, l as f32)
}

/// In-place form of [`attention_merge`]: folds the partial result (`out_b`, `lse_b`) into
/// the accumulator (`out`, `lse`), as a ring step does after each key block.
#[allow(clippy::too_many_arguments)]
pub fn attention_merge_into(
    out: &mut [f32],
    lse: &mut [f32],
    out_b: &[f32],
    lse_b: &[f32],
    b: usize,
    s: usize,
    nh: usize,
    d: usize,
) {
    let (on, ln) = (b * s * nh * d, b * nh * s);
    assert_eq!(out.len(), on, "attention_merge: out must be [b, s, nh, d]");
    assert_eq!(
        out_b.len(),
        on,
        "attention_merge: out_b must be [b, s, nh, d]"
    );
    assert_eq!(lse.len(), ln, "attention_merge: lse must be [b, nh, s]");
    assert_eq!(lse_b.len(), ln, "attention_merge: lse_b must be [b, nh, s]");
    if on == 0 {
        // Still merge the log-sum-exps (d == 0 keeps lse meaningful).
        for (la, &lb) in lse.iter_mut().zip(lse_b) {
            *la = merge_weights(*la, lb).2;
        }
        return;
    }
    // Weights per (sample, head, query), laid out like lse.
    let w: Vec<(f32, f32)> = lse
        .iter_mut()
        .zip(lse_b)
        .map(|(la, &lb)| {
            let (wa, wb, l) = merge_weights(*la, lb);
            *la = l;
            (wa, wb)
        })
        .collect();
    let width = nh * d;
    let row = |(r, (o, ob)): (usize, (&mut [f32], &[f32]))| {
        let (bi, si) = (r / s, r % s);
        for (h, (oh, obh)) in o.chunks_exact_mut(d).zip(ob.chunks_exact(d)).enumerate() {
            let (wa, wb) = w[(bi * nh + h) * s + si];
            if wb == 0.0 {
                if wa == 0.0 {
                    oh.fill(0.0);
                } else if wa != 1.0 {
                    oh.iter_mut().for_each(|x| *x *= wa);
                }
            } else if wa == 0.0 {
                for (x, &y) in oh.iter_mut().zip(obh) {
                    *x = wb * y;
                }
            } else {
                for (x, &y) in oh.iter_mut().zip(obh) {
                    *x = wa * *x + wb * y;
                }
            }
        }
    };
    if row_chunk(b * s, width).is_some() {
        out.par_chunks_mut(width)
            .zip(out_b.par_chunks(width))
            .enumerate()
            .for_each(row);
    } else {
        out.chunks_mut(width)
            .zip(out_b.chunks(width))
            .enumerate()
            .for_each(row);
    }
}

/// Combines two partial attention results of the same queries over disjoint key sets
/// (`out_*` `[b, s, nh, d]`, `lse_*` `[b, nh, s]`, as [`attention_block_fwd`] writes them)
/// into the attention over the union: `lse = log(e^lse_a + e^lse_b)`,
/// `out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b`. A side with `lse = -inf` (no
/// allowed key) has weight 0 and its `out` is ignored (so it may be anything, even NaN);
/// both `-inf` gives `out = 0`, `lse = -inf`. Overwrites `out` and `lse`.
#[allow(clippy::too_many_arguments)]
pub fn attention_merge(
    out_a: &[f32],
    lse_a: &[f32],
    out_b: &[f32],
    lse_b: &[f32],
    b: usize,
    s: usize,
    nh: usize,
    d: usize,
    out: &mut [f32],
    lse: &mut [f32],
) {
    assert_eq!(
        out_a.len(),
        b * s * nh * d,
        "attention_merge: out_a must be [b, s, nh, d]"
    );
    assert_eq!(
        lse_a.len(),
        b * nh * s,
        "attention_merge: lse_a must be [b, nh, s]"
    );
    assert_eq!(
        out.len(),
        out_a.len(),
        "attention_merge: out must be [b, s, nh, d]"
    );
    assert_eq!(
        lse.len(),
        lse_a.len(),
        "attention_merge: lse must be [b, nh, s]"
    );
    out.copy_from_slice(out_a);
    lse.copy_from_slice(lse_a);
    attention_merge_into(out, lse, out_b, lse_b, b, s, nh, d);
}
