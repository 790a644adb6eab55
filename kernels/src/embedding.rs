//! Token and learned position embeddings.

use rayon::prelude::*;

use crate::elementwise::accumulate;
use crate::util::row_chunk;

/// Checks a token id against the table size and turns it into a row index.
#[inline]
fn row_of(id: i32, vocab: usize) -> usize {
    assert!(
        id >= 0 && (id as usize) < vocab,
        "embedding: token id {id} outside the table's {vocab} rows"
    );
    id as usize
}

/// `out[t] = table[ids[t]]`: `ids` is `[tokens]`, `table` is `[vocab, h]`, `out` is
/// `[tokens, h]`. Panics on an id outside `0..vocab`.
pub fn embedding_fwd(ids: &[i32], table: &[f32], h: usize, out: &mut [f32]) {
    assert!(
        h > 0 && table.len().is_multiple_of(h),
        "embedding_fwd: table must be [vocab, h]"
    );
    assert_eq!(
        out.len(),
        ids.len() * h,
        "embedding_fwd: out must be [tokens, h]"
    );
    let vocab = table.len() / h;
    let copy = |(o, &id): (&mut [f32], &i32)| {
        let r = row_of(id, vocab);
        o.copy_from_slice(&table[r * h..(r + 1) * h]);
    };
    if row_chunk(ids.len(), h).is_some() {
        out.par_chunks_mut(h).zip(ids.par_iter()).for_each(copy);
    } else {
        out.chunks_mut(h).zip(ids.iter()).for_each(copy);
    }
}

/// `dtable[ids[t]] += dout[t]` for every token, in token order (repeated ids add up).
pub fn embedding_bwd(ids: &[i32], dout: &[f32], h: usize, dtable: &mut [f32]) {
    assert!(
        h > 0 && dtable.len().is_multiple_of(h),
        "embedding_bwd: dtable must be [vocab, h]"
    );
    assert_eq!(
        dout.len(),
        ids.len() * h,
        "embedding_bwd: dout must be [tokens, h]"
    );
    let vocab = dtable.len() / h;
    for (t, &id) in ids.iter().enumerate() {
        let r = row_of(id, vocab);
        let dst = &mut dtable[r * h..(r + 1) * h];
        for (d, &g) in dst.iter_mut().zip(&dout[t * h..(t + 1) * h]) {
            *d += g;
        }
    }
}

/// `out[b, p] = x[b, p] + wpe[p]` for positions `p < s`: `x` and `out` are `[b, s, h]`,
/// `wpe` is `[max_positions, h]` with `max_positions >= s` (GPT-2's `wte + wpe`).
pub fn pos_embedding_fwd(x: &[f32], wpe: &[f32], b: usize, s: usize, h: usize, out: &mut [f32]) {
    assert_eq!(x.len(), b * s * h, "pos_embedding_fwd: x must be [b, s, h]");
    assert_eq!(
        out.len(),
        b * s * h,
        "pos_embedding_fwd: out must be [b, s, h]"
    );
    assert!(
        wpe.len() >= s * h,
        "pos_embedding_fwd: wpe has fewer than s positions"
    );
    if h == 0 || s == 0 {
        return;
    }
    let wpe = &wpe[..s * h];
    let add = |(o, xs): (&mut [f32], &[f32])| {
        for ((o, &x), &p) in o.iter_mut().zip(xs).zip(wpe) {
            *o = x + p;
        }
    };
    if row_chunk(b, s * h).is_some() {
        out.par_chunks_mut(s * h)
            .zip(x.par_chunks(s * h))
            .for_each(add);
    } else {
        out.chunks_mut(s * h).zip(x.chunks(s * h)).for_each(add);
    }
}

/// Backward of [`pos_embedding_fwd`]: `dx += dout` and `dwpe[p] += Σ_b dout[b, p]` for
/// `p < s` (rows of `dwpe` past `s` are untouched).
pub fn pos_embedding_bwd(
    dout: &[f32],
    b: usize,
    s: usize,
    h: usize,
    dx: &mut [f32],
    dwpe: &mut [f32],
) {
    assert_eq!(
        dout.len(),
        b * s * h,
        "pos_embedding_bwd: dout must be [b, s, h]"
    );
    assert_eq!(
        dx.len(),
        b * s * h,
        "pos_embedding_bwd: dx must be [b, s, h]"
    );
    assert!(
        dwpe.len() >= s * h,
        "pos_embedding_bwd: dwpe has fewer than s positions"
    );
    accumulate(dx, dout);
    if h == 0 || s == 0 {
        return;
    }
    // Sum over the batch in f32, sample order, one position row at a time.
    let sum_pos = |(p, d): (usize, &mut [f32])| {
        for bi in 0..b {
            let src = &dout[(bi * s + p) * h..(bi * s + p + 1) * h];
            for (d, &g) in d.iter_mut().zip(src) {
                *d += g;
            }
        }
    };
    let dwpe = &mut dwpe[..s * h];
    if row_chunk(s, b * h).is_some() {
        dwpe.par_chunks_mut(h).enumerate().for_each(sum_pos);
    } else {
        dwpe.chunks_mut(h).enumerate().for_each(sum_pos);
    }
}
