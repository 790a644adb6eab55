//! RMSNorm (Llama) and LayerNorm (GPT-2), forward and backward over the last dimension.
//!
//! Row statistics are accumulated in f64 and rounded to f32 before use, then the output
//! is formed in f32: `w * (x * rstd)` exactly as `LlamaRMSNorm` orders it, and
//! `((x - mean) * rstd) * w + b` for `nn.LayerNorm` (PyTorch's CPU kernel differs in the
//! last bit or two; subtracting the mean first keeps rows with a large common offset
//! accurate).

use rayon::prelude::*;

use crate::linear::COL_BLOCK;
use crate::simd::{dot3_f64, simd_dispatch, sum_f64, sum_sq_dev_f64, sum_sq_f64};
use crate::util::{row_chunk, PAR_MIN_ELEMS};

/// `1 / sqrt(mean(x²) + eps)` of one row, as `LlamaRMSNorm` computes it in f32.
#[inline(always)]
fn rms_rstd(x: &[f32], eps: f32) -> f32 {
    let var = (sum_sq_f64(x) / x.len() as f64) as f32;
    1.0 / (var + eps).sqrt()
}

/// `(mean_hi, mean_lo, rstd)` of one row with the biased variance, as `nn.LayerNorm`
/// defines them; the mean is split into two f32 so `(x - hi) - lo` is accurate even
/// when the row has a large common offset.
#[inline(always)]
fn ln_stats(x: &[f32], eps: f32) -> (f32, f32, f32) {
    let h = x.len() as f64;
    let mean = sum_f64(x) / h;
    let var = (sum_sq_dev_f64(x, mean) / h) as f32;
    let hi = mean as f32;
    let lo = (mean - hi as f64) as f32;
    let rstd = 1.0 / (var.max(0.0) + eps).sqrt();
    (hi, lo, rstd)
}

simd_dispatch! {
    fn rms_fwd_rows(x: &[f32], w: &[f32], eps: f32, h: usize, y: &mut [f32]) {
        for (xr, yr) in x.chunks_exact(h).zip(y.chunks_exact_mut(h)) {
            let r = rms_rstd(xr, eps);
            for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(w) {
                *y = w * (x * r);
            }
        }
    }
}

simd_dispatch! {
    fn rms_bwd_rows(
        x: &[f32],
        w: &[f32],
        dy: &[f32],
        eps: f32,
        h: usize,
        dx: &mut [f32],
        rstd: &mut [f32],
    ) {
        let rows = x.chunks_exact(h).zip(dy.chunks_exact(h));
        for (((xr, dyr), dxr), rs) in rows.zip(dx.chunks_exact_mut(h)).zip(rstd.iter_mut()) {
            let r = rms_rstd(xr, eps);
            *rs = r;
            // y = w * x * r with r = (Σx²/h + eps)^-1/2:
            // dx = r * (g - (x r) * (Σ g x) r / h), g = dy * w.
            let c = (dot3_f64(dyr, w, xr) * r as f64 / h as f64) as f32;
            for (((dx, &x), &dy), &w) in dxr.iter_mut().zip(xr).zip(dyr).zip(w) {
                *dx += r * (dy * w - (x * r) * c);
            }
        }
    }
}

simd_dispatch! {
    fn ln_fwd_rows(x: &[f32], w: &[f32], b: &[f32], eps: f32, h: usize, y: &mut [f32]) {
        for (xr, yr) in x.chunks_exact(h).zip(y.chunks_exact_mut(h)) {
            let (hi, lo, rstd) = ln_stats(xr, eps);
            for (((y, &x), &w), &b) in yr.iter_mut().zip(xr).zip(w).zip(b) {
                *y = (((x - hi) - lo) * rstd) * w + b;
            }
        }
    }
}

simd_dispatch! {
    fn ln_bwd_rows(
        x: &[f32],
        w: &[f32],
        dy: &[f32],
        eps: f32,
        h: usize,
        dx: &mut [f32],
        stats: &mut [f32],
    ) {
        let rows = x.chunks_exact(h).zip(dy.chunks_exact(h));
        for (((xr, dyr), dxr), st) in rows.zip(dx.chunks_exact_mut(h)).zip(stats.chunks_exact_mut(3)) {
            let (hi, lo, rstd) = ln_stats(xr, eps);
            st[0] = hi;
            st[1] = lo;
            st[2] = rstd;
            // xhat = (x - mean) * rstd, g = dy * w:
            // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
            let (mut sg, mut sgx) = ([0.0f64; 8], [0.0f64; 8]);
            let n8 = h - h % 8;
            for i in (0..n8).step_by(8) {
                for l in 0..8 {
                    let g = (dyr[i + l] * w[i + l]) as f64;
                    sg[l] += g;
                    sgx[l] += g * (((xr[i + l] - hi) - lo) * rstd) as f64;
                }
            }
            let (mut sg, mut sgx) = (sg.iter().sum::<f64>(), sgx.iter().sum::<f64>());
            for i in n8..h {
                let g = (dyr[i] * w[i]) as f64;
                sg += g;
                sgx += g * (((xr[i] - hi) - lo) * rstd) as f64;
            }
            let a = (sg / h as f64) as f32;
            let c = (sgx / h as f64) as f32;
            for (((dx, &x), &dy), &w) in dxr.iter_mut().zip(xr).zip(dyr).zip(w) {
                *dx += rstd * (dy * w - a - (((x - hi) - lo) * rstd) * c);
            }
        }
    }
}

/// `LlamaRMSNorm`: `y = w * (x * rsqrt(mean(x²) + eps))` per row; `x`, `y` are
/// `[rows, h]`, `w` is `[h]`. Overwrites `y`.
pub fn rms_norm_fwd(x: &[f32], w: &[f32], eps: f32, rows: usize, h: usize, y: &mut [f32]) {
    assert_eq!(x.len(), rows * h, "rms_norm_fwd: x must be [rows, h]");
    assert_eq!(y.len(), rows * h, "rms_norm_fwd: y must be [rows, h]");
    assert_eq!(w.len(), h, "rms_norm_fwd: w must be [h]");
    if h == 0 {
        return;
    }
    match row_chunk(rows, h) {
        None => rms_fwd_rows(x, w, eps, h, y),
        Some(rc) => y
            .par_chunks_mut(rc * h)
            .zip(x.par_chunks(rc * h))
            .for_each(|(y, x)| rms_fwd_rows(x, w, eps, h, y)),
    }
}

/// Backward of [`rms_norm_fwd`] (recomputing each row's rstd): `dx += ∂/∂x`,
/// `dw += Σ_rows dy * x * rstd`.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_bwd(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    eps: f32,
    rows: usize,
    h: usize,
    dx: &mut [f32],
    dw: &mut [f32],
) {
    assert_eq!(x.len(), rows * h, "rms_norm_bwd: x must be [rows, h]");
    assert_eq!(dy.len(), rows * h, "rms_norm_bwd: dy must be [rows, h]");
    assert_eq!(dx.len(), rows * h, "rms_norm_bwd: dx must be [rows, h]");
    assert_eq!(w.len(), h, "rms_norm_bwd: w must be [h]");
    assert_eq!(dw.len(), h, "rms_norm_bwd: dw must be [h]");
    if h == 0 || rows == 0 {
        return;
    }
    let mut rstd = vec![0.0f32; rows];
    match row_chunk(rows, h) {
        None => rms_bwd_rows(x, w, dy, eps, h, dx, &mut rstd),
        Some(rc) => dx
            .par_chunks_mut(rc * h)
            .zip(x.par_chunks(rc * h))
            .zip(dy.par_chunks(rc * h))
            .zip(rstd.par_chunks_mut(rc))
            .for_each(|(((dx, x), dy), rs)| rms_bwd_rows(x, w, dy, eps, h, dx, rs)),
    }
    let rstd = &rstd;
    column_blocks(rows, h, dw, None, |r, c0, acc, _| {
        let o = r * h + c0;
        let xr = &x[o..o + acc.len()];
        let dyr = &dy[o..o + acc.len()];
        let rs = rstd[r];
        for ((a, &x), &dy) in acc.iter_mut().zip(xr).zip(dyr) {
            *a += (dy * (x * rs)) as f64;
        }
    });
}

/// `nn.LayerNorm` over the last dim: `y = (x - mean) * rstd * w + b` per row (biased
/// variance, `rstd = 1 / sqrt(var + eps)`). Overwrites `y`.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_fwd(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    eps: f32,
    rows: usize,
    h: usize,
    y: &mut [f32],
) {
    assert_eq!(x.len(), rows * h, "layer_norm_fwd: x must be [rows, h]");
    assert_eq!(y.len(), rows * h, "layer_norm_fwd: y must be [rows, h]");
    assert_eq!(w.len(), h, "layer_norm_fwd: w must be [h]");
    assert_eq!(b.len(), h, "layer_norm_fwd: b must be [h]");
    if h == 0 {
        return;
    }
    match row_chunk(rows, h) {
        None => ln_fwd_rows(x, w, b, eps, h, y),
        Some(rc) => y
            .par_chunks_mut(rc * h)
            .zip(x.par_chunks(rc * h))
            .for_each(|(y, x)| ln_fwd_rows(x, w, b, eps, h, y)),
    }
}

/// Backward of [`layer_norm_fwd`] (recomputing mean and rstd): `dx += ∂/∂x`,
/// `dw += Σ_rows dy * xhat`, `db += Σ_rows dy`.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_bwd(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    eps: f32,
    rows: usize,
    h: usize,
    dx: &mut [f32],
    dw: &mut [f32],
    db: &mut [f32],
) {
    assert_eq!(x.len(), rows * h, "layer_norm_bwd: x must be [rows, h]");
    assert_eq!(dy.len(), rows * h, "layer_norm_bwd: dy must be [rows, h]");
    assert_eq!(dx.len(), rows * h, "layer_norm_bwd: dx must be [rows, h]");
    assert_eq!(w.len(), h, "layer_norm_bwd: w must be [h]");
    assert_eq!(dw.len(), h, "layer_norm_bwd: dw must be [h]");
    assert_eq!(db.len(), h, "layer_norm_bwd: db must be [h]");
    if h == 0 || rows == 0 {
        return;
    }
    let mut stats = vec![0.0f32; 3 * rows];
    match row_chunk(rows, h) {
        None => ln_bwd_rows(x, w, dy, eps, h, dx, &mut stats),
        Some(rc) => dx
            .par_chunks_mut(rc * h)
            .zip(x.par_chunks(rc * h))
            .zip(dy.par_chunks(rc * h))
            .zip(stats.par_chunks_mut(3 * rc))
            .for_each(|(((dx, x), dy), st)| ln_bwd_rows(x, w, dy, eps, h, dx, st)),
    }
    let stats = &stats;
    column_blocks(rows, h, dw, Some(db), |r, c0, acc_w, acc_b| {
        let o = r * h + c0;
        let n = acc_w.len();
        let (hi, lo, rstd) = (stats[3 * r], stats[3 * r + 1], stats[3 * r + 2]);
        let xr = &x[o..o + n];
        let dyr = &dy[o..o + n];
        for (((aw, ab), &x), &dy) in acc_w.iter_mut().zip(acc_b.iter_mut()).zip(xr).zip(dyr) {
            *aw += (dy * (((x - hi) - lo) * rstd)) as f64;
            *ab += dy as f64;
        }
    });
}

/// Column reductions over `rows` for one or two `[h]` outputs: `add(r, c0, acc1, acc2)`
/// adds row `r`'s terms for columns `c0..c0 + acc1.len()` into f64 accumulators (`acc2`
/// is empty without a second output). Each column is summed in row order, in parallel
/// over column blocks when large; the totals are added to the outputs.
fn column_blocks<F>(rows: usize, h: usize, out1: &mut [f32], out2: Option<&mut [f32]>, add: F)
where
    F: Fn(usize, usize, &mut [f64], &mut [f64]) + Sync,
{
    let mut empty: [f32; 0] = [];
    let two = out2.is_some();
    let out2 = out2.unwrap_or(&mut empty);
    let block = |bi: usize, o1: &mut [f32], o2: &mut [f32]| {
        let mut acc1 = [0.0f64; COL_BLOCK];
        let mut acc2 = [0.0f64; COL_BLOCK];
        let n = o1.len();
        let acc2 = if two { &mut acc2[..n] } else { &mut acc2[..0] };
        for r in 0..rows {
            add(r, bi * COL_BLOCK, &mut acc1[..n], acc2);
        }
        for (d, s) in o1.iter_mut().zip(&acc1[..n]) {
            *d = (*d as f64 + *s) as f32;
        }
        for (d, s) in o2.iter_mut().zip(acc2.iter()) {
            *d = (*d as f64 + *s) as f32;
        }
    };
    let parallel = rows * h >= PAR_MIN_ELEMS && h > COL_BLOCK;
    match (two, parallel) {
        (true, true) => out1
            .par_chunks_mut(COL_BLOCK)
            .zip(out2.par_chunks_mut(COL_BLOCK))
            .enumerate()
            .for_each(|(bi, (o1, o2))| block(bi, o1, o2)),
        (true, false) => out1
            .chunks_mut(COL_BLOCK)
            .zip(out2.chunks_mut(COL_BLOCK))
            .enumerate()
            .for_each(|(bi, (o1, o2))| block(bi, o1, o2)),
        (false, true) => out1
            .par_chunks_mut(COL_BLOCK)
            .enumerate()
            .for_each(|(bi, o1)| block(bi, o1, &mut [])),
        (false, false) => out1
            .chunks_mut(COL_BLOCK)
            .enumerate()
            .for_each(|(bi, o1)| block(bi, o1, &mut [])),
    }
}
