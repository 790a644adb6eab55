//! Linear layers (`nn.Linear` and GPT-2's `Conv1D`) on top of the `gemm` crate.

use gemm::Parallelism;

/// How a linear layer's weight is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightLayout {
    /// `w` is `[n, k]` (out, in): `torch.nn.Linear`, `y = x·wᵀ`.
    OutIn,
    /// `w` is `[k, n]` (in, out): GPT-2's `Conv1D`, `y = x·w`.
    InOut,
}

/// Multiply-add count from which a gemm is allowed to use every rayon thread.
const GEMM_PAR_MIN_FLOPS: usize = 1 << 18;

/// Threading for an `m×k · k×n` product: single-threaded when small, since waking
/// threads costs more than the work.
pub(crate) fn gemm_parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    if m.saturating_mul(n).saturating_mul(k) >= GEMM_PAR_MIN_FLOPS
        && rayon::current_num_threads() > 1
    {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    }
}

/// A strided read-only matrix: element `(i, j)` is at `ptr + i*rs + j*cs`.
#[derive(Clone, Copy)]
pub(crate) struct MatRef {
    pub(crate) ptr: *const f32,
    pub(crate) rs: isize,
    pub(crate) cs: isize,
}

/// A strided mutable matrix: element `(i, j)` is at `ptr + i*rs + j*cs`.
#[derive(Clone, Copy)]
pub(crate) struct MatMut {
    pub(crate) ptr: *mut f32,
    pub(crate) rs: isize,
    pub(crate) cs: isize,
}

/// `dst[m,n] = (accumulate ? dst : 0) + beta * lhs[m,k] · rhs[k,n]`.
///
/// # Safety
/// Every pointer must be valid for every element its strides address, `dst` must not
/// overlap `lhs` or `rhs`, and no other thread may write what this call reads or writes.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_strided(
    m: usize,
    n: usize,
    k: usize,
    dst: MatMut,
    accumulate: bool,
    lhs: MatRef,
    rhs: MatRef,
    beta: f32,
    par: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    *dst.ptr.offset(i as isize * dst.rs + j as isize * dst.cs) = 0.0;
                }
            }
        }
        return;
    }
    // gemm computes dst := alpha·dst + beta·lhs·rhs, reading dst only if `read_dst`.
    gemm::gemm(
        m, n, k, dst.ptr, dst.cs, dst.rs, accumulate, lhs.ptr, lhs.cs, lhs.rs, rhs.ptr, rhs.cs,
        rhs.rs, 1.0f32, beta, false, false, false, par,
    );
}

/// Row-major `[rows, cols]` matrix starting at `ptr`.
#[inline]
pub(crate) fn rm(ptr: *const f32, cols: usize) -> MatRef {
    MatRef {
        ptr,
        rs: cols as isize,
        cs: 1,
    }
}

/// Transpose of a row-major `[rows, cols]` matrix starting at `ptr` (a `[cols, rows]` view).
#[inline]
pub(crate) fn rm_t(ptr: *const f32, cols: usize) -> MatRef {
    MatRef {
        ptr,
        rs: 1,
        cs: cols as isize,
    }
}

/// Row-major mutable `[rows, cols]` matrix starting at `ptr`.
#[inline]
pub(crate) fn rm_mut(ptr: *mut f32, cols: usize) -> MatMut {
    MatMut {
        ptr,
        rs: cols as isize,
        cs: 1,
    }
}

/// `y[m,n] = x[m,k] · W + bias`, where `W` is `wᵀ` for [`WeightLayout::OutIn`] (`w` is
/// `[n, k]`) and `w` itself for [`WeightLayout::InOut`] (`w` is `[k, n]`). Overwrites `y`.
#[allow(clippy::too_many_arguments)]
pub fn linear_fwd(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    y: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
    layout: WeightLayout,
) {
    assert_eq!(x.len(), m * k, "linear_fwd: x must be [m, k]");
    assert_eq!(w.len(), n * k, "linear_fwd: w must hold n*k values");
    assert_eq!(y.len(), m * n, "linear_fwd: y must be [m, n]");
    let accumulate = match bias {
        Some(b) => {
            assert_eq!(b.len(), n, "linear_fwd: bias must be [n]");
            if n > 0 {
                for row in y.chunks_exact_mut(n) {
                    row.copy_from_slice(b);
                }
            }
            true
        }
        None => false,
    };
    let rhs = match layout {
        WeightLayout::OutIn => rm_t(w.as_ptr(), k),
        WeightLayout::InOut => rm(w.as_ptr(), n),
    };
    // SAFETY: the slices have the asserted lengths, so every strided access is in bounds.
    unsafe {
        gemm_strided(
            m,
            n,
            k,
            rm_mut(y.as_mut_ptr(), n),
            accumulate,
            rm(x.as_ptr(), k),
            rhs,
            1.0,
            gemm_parallelism(m, n, k),
        );
    }
}

/// `dx[m,k] += dy[m,n] · Wᵀ` for the `W` of [`linear_fwd`].
#[allow(clippy::too_many_arguments)]
pub fn linear_bwd_data(
    dy: &[f32],
    w: &[f32],
    dx: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
    layout: WeightLayout,
) {
    assert_eq!(dy.len(), m * n, "linear_bwd_data: dy must be [m, n]");
    assert_eq!(w.len(), n * k, "linear_bwd_data: w must hold n*k values");
    assert_eq!(dx.len(), m * k, "linear_bwd_data: dx must be [m, k]");
    let rhs = match layout {
        // W = wᵀ, so Wᵀ = w: [n, k] row-major.
        WeightLayout::OutIn => rm(w.as_ptr(), k),
        // W = w ([k, n]), so Wᵀ is its transpose view.
        WeightLayout::InOut => rm_t(w.as_ptr(), n),
    };
    // SAFETY: lengths asserted above.
    unsafe {
        gemm_strided(
            m,
            k,
            n,
            rm_mut(dx.as_mut_ptr(), k),
            true,
            rm(dy.as_ptr(), n),
            rhs,
            1.0,
            gemm_parallelism(m, k, n),
        );
    }
}

/// `dw += ∂(x·W)/∂w` in `w`'s own layout (`[n, k]` for [`WeightLayout::OutIn`],
/// `[k, n]` for [`WeightLayout::InOut`]), and `dbias[n] += Σ_rows dy` when given.
#[allow(clippy::too_many_arguments)]
pub fn linear_bwd_weight(
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    dbias: Option<&mut [f32]>,
    m: usize,
    k: usize,
    n: usize,
    layout: WeightLayout,
) {
    assert_eq!(x.len(), m * k, "linear_bwd_weight: x must be [m, k]");
    assert_eq!(dy.len(), m * n, "linear_bwd_weight: dy must be [m, n]");
    assert_eq!(
        dw.len(),
        n * k,
        "linear_bwd_weight: dw must hold n*k values"
    );
    // SAFETY: lengths asserted above.
    unsafe {
        match layout {
            // dw[n,k] += dyᵀ[n,m] · x[m,k]
            WeightLayout::OutIn => gemm_strided(
                n,
                k,
                m,
                rm_mut(dw.as_mut_ptr(), k),
                true,
                rm_t(dy.as_ptr(), n),
                rm(x.as_ptr(), k),
                1.0,
                gemm_parallelism(n, k, m),
            ),
            // dw[k,n] += xᵀ[k,m] · dy[m,n]
            WeightLayout::InOut => gemm_strided(
                k,
                n,
                m,
                rm_mut(dw.as_mut_ptr(), n),
                true,
                rm_t(x.as_ptr(), k),
                rm(dy.as_ptr(), n),
                1.0,
                gemm_parallelism(k, n, m),
            ),
        }
    }
    if let Some(db) = dbias {
        assert_eq!(db.len(), n, "linear_bwd_weight: dbias must be [n]");
        column_sums_accumulate(dy, m, n, db);
    }
}

/// Columns handled by one task of [`column_sums_accumulate`].
pub(crate) const COL_BLOCK: usize = 64;

/// `out[c] += Σ_r a[r, c]` for a row-major `[rows, cols]` matrix `a`, summing each column
/// in f64 in row order (deterministic whatever the thread count).
pub(crate) fn column_sums_accumulate(a: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    column_reduce_accumulate(rows, cols, out, |r, c0, acc| {
        let row = &a[r * cols + c0..r * cols + c0 + acc.len()];
        for (s, &v) in acc.iter_mut().zip(row) {
            *s += v as f64;
        }
    });
}

/// `out[c] += Σ_r f(r, c)`: `add(r, c0, acc)` adds row `r`'s terms for columns
/// `c0..c0+acc.len()` into the f64 accumulators `acc`. Column blocks run in parallel when
/// the matrix is large; each column is summed in row order.
pub(crate) fn column_reduce_accumulate<F>(rows: usize, cols: usize, out: &mut [f32], add: F)
where
    F: Fn(usize, usize, &mut [f64]) + Sync,
{
    assert_eq!(out.len(), cols);
    let block = |(bi, o): (usize, &mut [f32])| {
        let c0 = bi * COL_BLOCK;
        let mut acc = [0.0f64; COL_BLOCK];
        let acc = &mut acc[..o.len()];
        for r in 0..rows {
            add(r, c0, acc);
        }
        for (d, s) in o.iter_mut().zip(acc.iter()) {
            *d = (*d as f64 + *s) as f32;
        }
    };
    if rows * cols >= crate::util::PAR_MIN_ELEMS && cols > COL_BLOCK {
        use rayon::prelude::*;
        out.par_chunks_mut(COL_BLOCK).enumerate().for_each(block);
    } else {
        out.chunks_mut(COL_BLOCK).enumerate().for_each(block);
    }
}
