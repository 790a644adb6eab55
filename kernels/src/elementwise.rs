//! Elementwise arithmetic: residual adds, gradient accumulation, norms and scaling.

use rayon::prelude::*;

use crate::simd::{simd_dispatch, sum_sq_f64};
use crate::util::{elem_chunk, PAR_MIN_ELEMS};

/// Elements per partial sum in [`sum_squares`]; fixed so the result does not depend on
/// the number of threads.
const SUM_CHUNK: usize = 1 << 16;

simd_dispatch! {
    fn add_serial(a: &[f32], b: &[f32], y: &mut [f32]) {
        for ((y, &a), &b) in y.iter_mut().zip(a).zip(b) {
            *y = a + b;
        }
    }
}

simd_dispatch! {
    fn accumulate_serial(dst: &mut [f32], src: &[f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d += s;
        }
    }
}

simd_dispatch! {
    fn scale_serial(x: &mut [f32], c: f32) {
        for v in x.iter_mut() {
            *v *= c;
        }
    }
}

simd_dispatch! {
    fn sum_sq_serial(x: &[f32]) -> f64 {
        sum_sq_f64(x)
    }
}

/// `y = a + b` (the residual connection). Overwrites `y`.
pub fn add_fwd(a: &[f32], b: &[f32], y: &mut [f32]) {
    assert!(
        a.len() == y.len() && b.len() == y.len(),
        "add_fwd: length mismatch"
    );
    if y.len() < PAR_MIN_ELEMS {
        return add_serial(a, b, y);
    }
    let c = elem_chunk(y.len());
    y.par_chunks_mut(c)
        .zip(a.par_chunks(c))
        .zip(b.par_chunks(c))
        .for_each(|((y, a), b)| add_serial(a, b, y));
}

/// `dst += src` (gradient accumulation, the backward of a residual add).
pub fn accumulate(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "accumulate: length mismatch");
    if dst.len() < PAR_MIN_ELEMS {
        return accumulate_serial(dst, src);
    }
    let c = elem_chunk(dst.len());
    dst.par_chunks_mut(c)
        .zip(src.par_chunks(c))
        .for_each(|(d, s)| accumulate_serial(d, s));
}

/// `Σ x²`, accumulated in f64 (for global gradient-norm clipping). Deterministic: the
/// partial sums cover fixed chunks of 65536 elements and are added in order.
pub fn sum_squares(x: &[f32]) -> f64 {
    if x.len() <= SUM_CHUNK {
        return sum_sq_serial(x);
    }
    let parts: Vec<f64> = x.par_chunks(SUM_CHUNK).map(sum_sq_serial).collect();
    parts.iter().sum()
}

/// `x *= c` (gradient clipping, loss scaling).
pub fn scale_in_place(x: &mut [f32], c: f32) {
    if x.len() < PAR_MIN_ELEMS {
        return scale_serial(x, c);
    }
    let ch = elem_chunk(x.len());
    x.par_chunks_mut(ch).for_each(|x| scale_serial(x, c));
}
