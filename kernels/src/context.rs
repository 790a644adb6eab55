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
//! iff `k_pos[j] <= q_pos[i]`. The block kernels are the masked block kernel of
//! [`crate::attention`] with [`Mask::Positions`]; this module adds the positions, the
//! positional RoPE and the merging of partial results.
//!
//! The backward ([`attention_block_bwd`]) takes the *final* (merged over every key block)
//! `out` and `lse`: with `P = exp(scores - lse)` and `D_i = rowsum(dout_i · out_i)`, the
//! flash-attention identity `dS = P ∘ (dP - D)` splits exactly over key blocks, so the ring
//! backward calls it once per block and the gradients add up to the full ones.
//!
//! Layouts follow [`crate::attention`]: `q`, `out` are `[b, sq, nh, d]`; `k`, `v` are
//! `[b, sk, nkv, d]`; `lse` is `[b, nh, sq]`; positions are shared by every sample.

use rayon::prelude::*;

use crate::attention::{masked_attention_bwd, masked_attention_fwd, Mask};
use crate::util::row_chunk;

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
    let inv_freq = crate::rope::default_inv_freq(d, theta);
    crate::rope::rope_apply_at(x, b, s_local, nh, d, &inv_freq, positions, y, false);
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
    let inv_freq = crate::rope::default_inv_freq(d, theta);
    crate::rope::rope_apply_at(dy, b, s_local, nh, d, &inv_freq, positions, dx, true);
}

// ---------------------------------------------------------------------------------------
// Block attention
// ---------------------------------------------------------------------------------------

/// Attention of local queries against one block of keys, masked by global position: the
/// masked block kernel [`crate::attention::masked_attention_fwd`] with
/// [`Mask::Positions`].
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
    attention_window_fwd(q, k, v, q_pos, k_pos, 0, b, sq, sk, nh, nkv, d, out, lse);
}

/// [`attention_block_fwd`] under a sliding window: query `i` may attend key `j` iff
/// `k_pos[j] <= q_pos[i]` and `q_pos[i] - k_pos[j] < window` (transformers' sliding-window
/// mask: keys `q-window+1 ..= q`); `window = 0` is plain causal. With `q_pos = k_pos = 0..s`
/// it is the whole sequence's sliding-window attention.
#[allow(clippy::too_many_arguments)]
pub fn attention_window_fwd(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_pos: &[u32],
    k_pos: &[u32],
    window: u32,
    b: usize,
    sq: usize,
    sk: usize,
    nh: usize,
    nkv: usize,
    d: usize,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let mask = Mask::Positions {
        q: q_pos,
        k: k_pos,
        window,
    };
    masked_attention_fwd(q, k, v, mask, b, sq, sk, nh, nkv, d, out, lse);
}

/// Backward of attention over one key block, given the **final** `out` and `lse` of the
/// queries (merged over every key block they attend, e.g. by [`attention_merge`]; for a
/// single block, those [`attention_block_fwd`] wrote). Accumulates this block's share of
/// the gradients: `dq += ∂/∂q` (`[b, sq, nh, d]`), `dk += ∂/∂k`, `dv += ∂/∂v`
/// (`[b, sk, nkv, d]`; kv heads shared by several query heads receive the group's sum).
/// Summing the calls over a partition of the keys gives the full backward. Queries with
/// `lse = -inf` (no allowed key anywhere) contribute nothing. The masked block kernel
/// [`crate::attention::masked_attention_bwd`] with [`Mask::Positions`].
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
    attention_window_bwd(
        q, k, v, out, lse, dout, q_pos, k_pos, 0, b, sq, sk, nh, nkv, d, dq, dk, dv,
    );
}

/// Backward of [`attention_window_fwd`] (as [`attention_block_bwd`], with the window).
#[allow(clippy::too_many_arguments)]
pub fn attention_window_bwd(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    q_pos: &[u32],
    k_pos: &[u32],
    window: u32,
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
    let mask = Mask::Positions {
        q: q_pos,
        k: k_pos,
        window,
    };
    masked_attention_bwd(
        q, k, v, out, lse, dout, mask, b, sq, sk, nh, nkv, d, dq, dk, dv,
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
