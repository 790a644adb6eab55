//! Rotary position embeddings, Hugging Face `rotate_half` convention (Llama).

use rayon::prelude::*;

use crate::util::row_chunk;

/// The `[s, d/2]` cos and sin tables, computed in f32 the way `LlamaRotaryEmbedding`
/// does: `inv_freq[i] = 1 / theta^((2i) / d)`, `angle = pos * inv_freq[i]` (one f32
/// product), then `cos` and `sin` of the f32 angle.
pub fn rope_tables(s: usize, d: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    let positions: Vec<u32> = (0..s as u32).collect();
    rope_tables_at(&positions, d, theta)
}

/// The cos and sin tables (`[positions.len(), d/2]`) at the given global positions, with
/// the same f32 arithmetic as [`rope_tables`].
pub fn rope_tables_at(positions: &[u32], d: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    assert!(d.is_multiple_of(2), "rope: head_dim must be even");
    rope_tables_freq(positions, &default_inv_freq(d, theta))
}

/// `1 / theta^((2i) / d)` for `i < d/2`, in f32 as torch computes it
/// (`1.0 / (base ** (arange(0, d, 2, int64).float() / d))`).
pub fn default_inv_freq(d: usize, theta: f32) -> Vec<f32> {
    (0..d / 2)
        .map(|i| 1.0f32 / theta.powf((2 * i) as f32 / d as f32))
        .collect()
}

/// The cos and sin tables (`[positions.len(), inv_freq.len()]`) for explicit inverse
/// frequencies (a scaled RoPE's): `angle = pos * inv_freq[i]` in f32.
pub fn rope_tables_freq(positions: &[u32], inv_freq: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let mut cos = vec![0.0f32; positions.len() * half];
    let mut sin = vec![0.0f32; positions.len() * half];
    for (r, &p) in positions.iter().enumerate() {
        for i in 0..half {
            let a = p as f32 * inv_freq[i];
            cos[r * half + i] = a.cos();
            sin[r * half + i] = a.sin();
        }
    }
    (cos, sin)
}

/// Rotates one `[nh, d]` row of heads at one position with that position's `cos`/`sin`
/// (`[d/2]` each). Forward overwrites `y`; `inverse` applies the transposed rotation
/// (the backward) and adds into `y`.
#[inline(always)]
fn rotate_row(x: &[f32], cos: &[f32], sin: &[f32], d: usize, inverse: bool, y: &mut [f32]) {
    let half = d / 2;
    for (xh, yh) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
        let (x1, x2) = xh.split_at(half);
        let (y1, y2) = yh.split_at_mut(half);
        for i in 0..half {
            let (c, s) = (cos[i], sin[i]);
            if inverse {
                // dx1 = dy1 c + dy2 s, dx2 = dy2 c - dy1 s (accumulated).
                y1[i] += x1[i] * c + x2[i] * s;
                y2[i] += x2[i] * c - x1[i] * s;
            } else {
                // y = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
                y1[i] = x1[i] * c + (-x2[i]) * s;
                y2[i] = x2[i] * c + x1[i] * s;
            }
        }
    }
}

/// Shared body of [`rope_fwd`] and [`rope_bwd`]: positions `0..s`.
#[allow(clippy::too_many_arguments)]
fn rope_apply(
    x: &[f32],
    b: usize,
    s: usize,
    nh: usize,
    d: usize,
    theta: f32,
    y: &mut [f32],
    inverse: bool,
) {
    let positions: Vec<u32> = (0..s as u32).collect();
    rope_apply_at(
        x,
        b,
        s,
        nh,
        d,
        &default_inv_freq(d, theta),
        &positions,
        y,
        inverse,
    );
}

/// Rotary embeddings at explicit global positions (`positions.len() == s`, one per local
/// token) with explicit inverse frequencies (`d/2` of them): the body of [`rope_fwd`],
/// [`rope_bwd`], [`rope_freq`] and the context-parallel variants.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_apply_at(
    x: &[f32],
    b: usize,
    s: usize,
    nh: usize,
    d: usize,
    inv_freq: &[f32],
    positions: &[u32],
    y: &mut [f32],
    inverse: bool,
) {
    assert!(d.is_multiple_of(2), "rope: head_dim must be even");
    assert_eq!(
        positions.len(),
        s,
        "rope: positions must have one entry per local token"
    );
    assert_eq!(x.len(), b * s * nh * d, "rope: input must be [b, s, nh, d]");
    assert_eq!(
        y.len(),
        b * s * nh * d,
        "rope: output must be [b, s, nh, d]"
    );
    let w = nh * d;
    if w == 0 || s == 0 {
        return;
    }
    assert_eq!(
        inv_freq.len(),
        d / 2,
        "rope: inv_freq must have head_dim / 2 entries"
    );
    let half = d / 2;
    let (cos, sin) = rope_tables_freq(positions, inv_freq);
    let row = |(r, (yr, xr)): (usize, (&mut [f32], &[f32]))| {
        let p = r % s;
        let (c, sn) = (
            &cos[p * half..(p + 1) * half],
            &sin[p * half..(p + 1) * half],
        );
        rotate_row(xr, c, sn, d, inverse, yr);
    };
    if row_chunk(b * s, w).is_some() {
        y.par_chunks_mut(w)
            .zip(x.par_chunks(w))
            .enumerate()
            .for_each(row);
    } else {
        y.chunks_mut(w).zip(x.chunks(w)).enumerate().for_each(row);
    }
}

/// Applies rotary embeddings to `x` (`[b, s, nh, d]`, positions `0..s`), writing `y`:
/// `y = x * cos + rotate_half(x) * sin` with cos/sin duplicated over both halves of the
/// head dim. Overwrites `y`.
#[allow(clippy::too_many_arguments)]
pub fn rope_fwd(x: &[f32], b: usize, s: usize, nh: usize, d: usize, theta: f32, y: &mut [f32]) {
    rope_apply(x, b, s, nh, d, theta, y, false);
}

/// Backward of [`rope_fwd`]: `dx += Rᵀ dy` (the rotation by the opposite angle).
#[allow(clippy::too_many_arguments)]
pub fn rope_bwd(dy: &[f32], b: usize, s: usize, nh: usize, d: usize, theta: f32, dx: &mut [f32]) {
    rope_apply(dy, b, s, nh, d, theta, dx, true);
}

/// Rotary embeddings with explicit inverse frequencies (`inv_freq.len() == d/2`, e.g. a
/// scaled RoPE's) at explicit positions (`positions.len() == s`, shared by every sample):
/// [`rope_fwd`] when `inverse` is false (overwrites `y`), [`rope_bwd`] when true (adds
/// into `y`).
#[allow(clippy::too_many_arguments)]
pub fn rope_freq(
    x: &[f32],
    b: usize,
    s: usize,
    nh: usize,
    d: usize,
    inv_freq: &[f32],
    positions: &[u32],
    y: &mut [f32],
    inverse: bool,
) {
    rope_apply_at(x, b, s, nh, d, inv_freq, positions, y, inverse);
}
