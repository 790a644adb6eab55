//! The cuBLAS argument mapping of the plan's row-major matmuls, written once.
//!
//! cuBLAS is column-major; a row-major `[r, c]` matrix is the column-major `[c, r]` matrix
//! (its transpose) with leading dimension `c`. So the row-major product `C = A·B` is issued
//! as the column-major `Cᵀ = Bᵀ·Aᵀ`: cuBLAS's first operand is the plan's right-hand
//! matrix, its `m` is the row-major `C`'s columns, its `n` the rows. [`GemmCall`] is exactly
//! what is passed to `cublasGemmStridedBatchedEx`; [`GemmCall::eval`] evaluates those
//! arguments as cuBLAS defines them, on the host, so the mapping is tested against the cpu
//! backend's kernels (`megac_kernels::linear_*`) without a GPU.

use megac_ir::WeightLayout;

/// Where a GEMM operand lives: an input or output buffer of the instruction (by position),
/// or a region of the rank's device workspace (element offset).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operand {
    /// `inputs[i]`.
    Input(usize),
    /// `outputs[i]`.
    Output(usize),
    /// The workspace, at this element offset.
    Workspace(usize),
}

/// One `cublasGemmStridedBatchedEx` call (column-major semantics):
/// for each batch `p`, `C_p = alpha · op(A_p) · op(B_p) + beta · C_p`, with `op(A)` `m × k`,
/// `op(B)` `k × n`, `C` `m × n`; element `(i, j)` of a matrix with leading dimension `ld`
/// is at `i + j·ld`; batch `p` of `A` starts `p · stride_a` elements after `A`'s start
/// (its operand offset `a_offset`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmCall {
    /// `op(A) = Aᵀ`.
    pub transa: bool,
    /// `op(B) = Bᵀ`.
    pub transb: bool,
    /// Rows of `op(A)` and `C`.
    pub m: usize,
    /// Columns of `op(B)` and `C`.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// The first operand and its element offset from the operand's start.
    pub a: (Operand, usize),
    /// Leading dimension of `A` as stored.
    pub lda: usize,
    /// The second operand and its element offset.
    pub b: (Operand, usize),
    /// Leading dimension of `B` as stored.
    pub ldb: usize,
    /// The result and its element offset.
    pub c: (Operand, usize),
    /// Leading dimension of `C`.
    pub ldc: usize,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of the old `C`: 0 overwrites, 1 accumulates (gradients, a bias put in first).
    pub beta: f32,
    /// Batch count.
    pub batch: usize,
    /// Element strides between batches of `A`, `B`, `C`.
    pub strides: (usize, usize, usize),
}

impl GemmCall {
    /// Whether the leading dimensions satisfy cuBLAS's rules (`lda >= rows of A as stored`,
    /// likewise `ldb`, and `ldc >= m`), which cuBLAS rejects with CUBLAS_STATUS_INVALID_VALUE.
    pub fn valid(&self) -> bool {
        let a_rows = if self.transa { self.k } else { self.m };
        let b_rows = if self.transb { self.n } else { self.k };
        self.lda >= a_rows.max(1) && self.ldb >= b_rows.max(1) && self.ldc >= self.m.max(1)
    }

    /// Evaluate the call as cuBLAS defines it over host slices holding `A`, `B` and `C`
    /// (each starting at its operand's start; offsets and strides are applied here), in f64.
    pub fn eval(&self, a: &[f32], b: &[f32], c: &mut [f32]) {
        for p in 0..self.batch {
            let ao = self.a.1 + p * self.strides.0;
            let bo = self.b.1 + p * self.strides.1;
            let co = self.c.1 + p * self.strides.2;
            for j in 0..self.n {
                for i in 0..self.m {
                    let mut s = 0.0f64;
                    for l in 0..self.k {
                        let av = if self.transa {
                            a[ao + l + i * self.lda]
                        } else {
                            a[ao + i + l * self.lda]
                        };
                        let bv = if self.transb {
                            b[bo + j + l * self.ldb]
                        } else {
                            b[bo + l + j * self.ldb]
                        };
                        s += f64::from(av) * f64::from(bv);
                    }
                    let at = co + i + j * self.ldc;
                    c[at] = (f64::from(self.alpha) * s + f64::from(self.beta) * f64::from(c[at]))
                        as f32;
                }
            }
        }
    }
}

/// The shape of one plan matmul: `g` stacked matrices (experts; 1 otherwise) of
/// `x[m, k]`, `w` (`[n, k]` for [`WeightLayout::OutIn`], `[k, n]` for `InOut`), `y[m, n]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulShape {
    /// Rows of `x` per matrix.
    pub m: usize,
    /// Inner dimension.
    pub k: usize,
    /// Output columns.
    pub n: usize,
    /// Stacked matrices.
    pub g: usize,
    /// How `w` is stored.
    pub layout: WeightLayout,
}

#[allow(clippy::too_many_arguments)]
fn call(
    (transa, transb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    (a, lda): (Operand, usize),
    (b, ldb): (Operand, usize),
    (c, ldc): (Operand, usize),
    beta: f32,
    g: usize,
    strides: (usize, usize, usize),
) -> GemmCall {
    GemmCall {
        transa,
        transb,
        m,
        n,
        k,
        a: (a, 0),
        lda,
        b: (b, 0),
        ldb,
        c: (c, 0),
        ldc,
        alpha: 1.0,
        beta,
        batch: g,
        strides,
    }
}

/// `linear` (`inputs = [x, w, bias?]`, `outputs = [y]`): `y = x·W`; `accumulate` adds into
/// what `y` holds (`beta = 1`, e.g. a bias put there first) instead of overwriting it.
pub fn linear_fwd(s: MatmulShape, accumulate: bool) -> GemmCall {
    let MatmulShape { m, k, n, g, layout } = s;
    // Cᵀ[n×m] = Wᵀ[n×k] · xᵀ[k×m]; x row-major is xᵀ column-major with ld k.
    let (ta, lda) = match layout {
        // w [n, k] row-major is [k×n] column-major: transpose it.
        WeightLayout::OutIn => (true, k),
        // w [k, n] row-major is [n×k] column-major: as it is.
        WeightLayout::InOut => (false, n),
    };
    call(
        (ta, false),
        (n, m, k),
        (Operand::Input(1), lda),
        (Operand::Input(0), k),
        (Operand::Output(0), n),
        if accumulate { 1.0 } else { 0.0 },
        g,
        (n * k, m * k, m * n),
    )
}

/// `linear_grad_input` (`inputs = [dy, w]`, `outputs = [dx]`): `dx += dy·Wᵀ`.
pub fn linear_grad_input(s: MatmulShape) -> GemmCall {
    let MatmulShape { m, k, n, g, layout } = s;
    // dxᵀ[k×m] = W[k×n] · dyᵀ[n×m].
    let (ta, lda) = match layout {
        // W = wᵀ; w [n, k] row-major is W [k×n] column-major.
        WeightLayout::OutIn => (false, k),
        // W = w [k, n] row-major is [n×k] column-major: transpose it.
        WeightLayout::InOut => (true, n),
    };
    call(
        (ta, false),
        (k, m, n),
        (Operand::Input(1), lda),
        (Operand::Input(0), n),
        (Operand::Output(0), k),
        1.0,
        g,
        (n * k, m * n, m * k),
    )
}

/// `linear_grad_weight` (`inputs = [x, dy]`, `outputs = [dw]`): `dw += ∂/∂w` in `w`'s own
/// layout, accumulated in f32 into the main gradient (`beta = 1`).
pub fn linear_grad_weight(s: MatmulShape) -> GemmCall {
    let MatmulShape { m, k, n, g, layout } = s;
    match layout {
        // dw[n, k] += dyᵀ·x: dwᵀ[k×n] = xᵀ[k×m] · dy[m×n] (dy column-major is dyᵀ: transpose).
        WeightLayout::OutIn => call(
            (false, true),
            (k, n, m),
            (Operand::Input(0), k),
            (Operand::Input(1), n),
            (Operand::Output(0), k),
            1.0,
            g,
            (m * k, m * n, n * k),
        ),
        // dw[k, n] += xᵀ·dy: dwᵀ[n×k] = dyᵀ[n×m] · x[m×k] (x column-major is xᵀ: transpose).
        WeightLayout::InOut => call(
            (false, true),
            (n, k, m),
            (Operand::Input(1), n),
            (Operand::Input(0), k),
            (Operand::Output(0), n),
            1.0,
            g,
            (m * n, m * k, n * k),
        ),
    }
}

/// The batched GEMMs of unfused attention over head-major copies (`[b, heads, s, d]`) of
/// q (`nh` heads), k and v (`nkv` heads), for query-head group member `member` of `group =
/// nh / nkv` (one call per member: batch `b·nkv`, query head `kv·group + member`).
/// Scores `S[sq, sk] = Q·Kᵀ` (unscaled; the softmax scales) into `s` `[b, nh, sq, sk]`.
pub fn attention_scores(
    (b, sq, sk, nh, nkv, d): (usize, usize, usize, usize, usize, usize),
    member: usize,
    (q, k, s): (Operand, Operand, Operand),
) -> GemmCall {
    let group = nh / nkv.max(1);
    GemmCall {
        transa: true,
        transb: false,
        m: sk,
        n: sq,
        k: d,
        a: (k, 0),
        lda: d,
        b: (q, member * sq * d),
        ldb: d,
        c: (s, member * sq * sk),
        ldc: sk,
        alpha: 1.0,
        beta: 0.0,
        batch: b * nkv,
        strides: (sk * d, group * sq * d, group * sq * sk),
    }
}

/// `O[sq, d] = P·V` for group member `member`, as [`attention_scores`].
pub fn attention_pv(
    (b, sq, sk, nh, nkv, d): (usize, usize, usize, usize, usize, usize),
    member: usize,
    (p, v, o): (Operand, Operand, Operand),
) -> GemmCall {
    let group = nh / nkv.max(1);
    GemmCall {
        transa: false,
        transb: false,
        m: d,
        n: sq,
        k: sk,
        a: (v, 0),
        lda: d,
        b: (p, member * sq * sk),
        ldb: sk,
        c: (o, member * sq * d),
        ldc: d,
        alpha: 1.0,
        beta: 0.0,
        batch: b * nkv,
        strides: (sk * d, group * sq * sk, group * sq * d),
    }
}

/// The backward GEMMs of unfused attention for group member `member`, in order:
/// `dP = dO·Vᵀ` (overwrites), `dV += Pᵀ·dO`, then (after the softmax backward turned dP into
/// the scaled dS) `dQ = dS·K` (overwrites) and `dK += dSᵀ·Q`. The kv gradients accumulate
/// over the group's members (`beta = 1`: zeroed before the first).
pub fn attention_bwd(
    (b, sq, sk, nh, nkv, d): (usize, usize, usize, usize, usize, usize),
    member: usize,
    [q, k, v, p, dout, dp, dq, dk, dv]: [Operand; 9],
) -> [GemmCall; 4] {
    let group = nh / nkv.max(1);
    let batch = b * nkv;
    let (qo, so) = (member * sq * d, member * sq * sk);
    let (qs, ss, ks) = (group * sq * d, group * sq * sk, sk * d);
    let g = |transa, transb, (m, n, kk), a, lda, bb, ldb, c, ldc, beta, strides| GemmCall {
        transa,
        transb,
        m,
        n,
        k: kk,
        a,
        lda,
        b: bb,
        ldb,
        c,
        ldc,
        alpha: 1.0,
        beta,
        batch,
        strides,
    };
    [
        // dP[sq, sk] = dO[sq, d]·Vᵀ
        g(
            true,
            false,
            (sk, sq, d),
            (v, 0),
            d,
            (dout, qo),
            d,
            (dp, so),
            sk,
            0.0,
            (ks, qs, ss),
        ),
        // dV[sk, d] += Pᵀ[sk, sq]·dO[sq, d]
        g(
            false,
            true,
            (d, sk, sq),
            (dout, qo),
            d,
            (p, so),
            sk,
            (dv, 0),
            d,
            1.0,
            (qs, ss, ks),
        ),
        // dQ[sq, d] = dS[sq, sk]·K[sk, d]
        g(
            false,
            false,
            (d, sq, sk),
            (k, 0),
            d,
            (dp, so),
            sk,
            (dq, qo),
            d,
            0.0,
            (ks, ss, qs),
        ),
        // dK[sk, d] += dSᵀ[sk, sq]·Q[sq, d]
        g(
            false,
            true,
            (d, sk, sq),
            (q, qo),
            d,
            (dp, so),
            sk,
            (dk, 0),
            d,
            1.0,
            (qs, ss, ks),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use megac_kernels as k;

    /// Deterministic values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut r = crate::rng::SplitMix64(seed);
        (0..n)
            .map(|_| (r.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            .collect()
    }

    fn close(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                "{what}[{i}]: cuBLAS mapping {x}, cpu kernel {y}"
            );
        }
    }

    /// Pick the slice of each operand from (inputs, outputs).
    fn run(call: &GemmCall, ins: &[&[f32]], out: &mut [f32]) {
        assert!(call.valid(), "{call:?}");
        let pick = |o: Operand| match o {
            Operand::Input(i) => ins[i].to_vec(),
            Operand::Output(_) => Vec::new(),
            Operand::Workspace(_) => unreachable!(),
        };
        assert_eq!(call.c.0, Operand::Output(0));
        let (a, b) = (pick(call.a.0), pick(call.b.0));
        call.eval(&a, &b, out);
    }

    #[test]
    fn linear_mappings_compute_the_cpu_kernels() {
        for (m, kk, n, g) in [(3, 5, 4, 1), (7, 2, 9, 1), (4, 6, 3, 3), (1, 1, 1, 1)] {
            for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
                let kl = match layout {
                    WeightLayout::OutIn => k::WeightLayout::OutIn,
                    WeightLayout::InOut => k::WeightLayout::InOut,
                };
                let s = MatmulShape {
                    m,
                    k: kk,
                    n,
                    g,
                    layout,
                };
                let x = values(g * m * kk, 1);
                let w = values(g * n * kk, 2);
                let dy = values(g * m * n, 3);
                let bias = values(n, 4);
                let what = format!("{m}x{kk}x{n} g{g} {layout:?}");
                // Forward, without and with a bias (put into y first, then beta = 1).
                for with_bias in [false, true] {
                    let mut want = vec![0.0; g * m * n];
                    for e in 0..g {
                        k::linear_fwd(
                            &x[e * m * kk..(e + 1) * m * kk],
                            &w[e * n * kk..(e + 1) * n * kk],
                            with_bias.then_some(&bias[..]),
                            &mut want[e * m * n..(e + 1) * m * n],
                            m,
                            kk,
                            n,
                            kl,
                        );
                    }
                    let mut got: Vec<f32> = if with_bias {
                        (0..g * m * n).map(|i| bias[i % n]).collect()
                    } else {
                        vec![f32::NAN; g * m * n]
                    };
                    let call = linear_fwd(s, with_bias);
                    if !with_bias {
                        got.fill(7.0); // beta = 0 ignores what was there
                    }
                    run(&call, &[&x, &w], &mut got);
                    close(&got, &want, &format!("linear {what} bias {with_bias}"));
                }
                // Input gradient, accumulated into an existing dx.
                let dx0 = values(g * m * kk, 5);
                let mut want = dx0.clone();
                for e in 0..g {
                    k::linear_bwd_data(
                        &dy[e * m * n..(e + 1) * m * n],
                        &w[e * n * kk..(e + 1) * n * kk],
                        &mut want[e * m * kk..(e + 1) * m * kk],
                        m,
                        kk,
                        n,
                        kl,
                    );
                }
                let mut got = dx0.clone();
                run(&linear_grad_input(s), &[&dy, &w], &mut got);
                close(&got, &want, &format!("linear_grad_input {what}"));
                // Weight gradient, accumulated (beta = 1) into the main gradient.
                let dw0 = values(g * n * kk, 6);
                let mut want = dw0.clone();
                for e in 0..g {
                    k::linear_bwd_weight(
                        &x[e * m * kk..(e + 1) * m * kk],
                        &dy[e * m * n..(e + 1) * m * n],
                        &mut want[e * n * kk..(e + 1) * n * kk],
                        None,
                        m,
                        kk,
                        n,
                        kl,
                    );
                }
                let mut got = dw0.clone();
                let call = linear_grad_weight(s);
                assert_eq!(call.beta, 1.0);
                run(&call, &[&x, &dy], &mut got);
                close(&got, &want, &format!("linear_grad_weight {what}"));
            }
        }
    }

    /// `[b, s, h, d]` -> `[b, h, s, d]`.
    fn head_major(x: &[f32], b: usize, s: usize, h: usize, d: usize) -> Vec<f32> {
        let mut y = vec![0.0; x.len()];
        for bi in 0..b {
            for si in 0..s {
                for hi in 0..h {
                    for e in 0..d {
                        y[((bi * h + hi) * s + si) * d + e] = x[((bi * s + si) * h + hi) * d + e];
                    }
                }
            }
        }
        y
    }

    fn seq_major(x: &[f32], b: usize, s: usize, h: usize, d: usize) -> Vec<f32> {
        let mut y = vec![0.0; x.len()];
        for bi in 0..b {
            for si in 0..s {
                for hi in 0..h {
                    for e in 0..d {
                        y[((bi * s + si) * h + hi) * d + e] = x[((bi * h + hi) * s + si) * d + e];
                    }
                }
            }
        }
        y
    }

    /// The workspace as one vector: every operand of the attention GEMMs lives in it.
    fn eval_ws(call: &GemmCall, ws: &mut [f32], at: impl Fn(Operand) -> usize) {
        assert!(call.valid(), "{call:?}");
        let a = ws[at(call.a.0)..].to_vec();
        let b = ws[at(call.b.0)..].to_vec();
        let c0 = at(call.c.0);
        call.eval(&a, &b, &mut ws[c0..]);
    }

    /// masked_softmax_fwd's meaning (causal), on rows of `s` scores.
    fn softmax_rows(p: &mut [f32], lse: &mut [f32], s: usize, scale: f32) {
        for (r, (row, l)) in p.chunks_mut(s).zip(lse.iter_mut()).enumerate() {
            let i = r % s;
            let mx = row[..=i]
                .iter()
                .map(|&x| x * scale)
                .fold(f32::MIN, f32::max);
            let sum: f32 = row[..=i].iter().map(|&x| (x * scale - mx).exp()).sum();
            *l = mx + sum.ln();
            for (j, x) in row.iter_mut().enumerate() {
                *x = if j <= i { (*x * scale - *l).exp() } else { 0.0 };
            }
        }
    }

    #[test]
    fn attention_mappings_compute_the_cpu_attention() {
        let (b, s, nh, nkv, d) = (2usize, 5usize, 4usize, 2usize, 3usize);
        let dims = (b, s, s, nh, nkv, d);
        let (qn, kn, sn) = (b * s * nh * d, b * s * nkv * d, b * nh * s * s);
        let (q, kx, v, dout) = (
            values(qn, 11),
            values(kn, 12),
            values(kn, 13),
            values(qn, 14),
        );
        // Workspace regions (element offsets).
        let names = ["q", "k", "v", "p", "o", "do", "dp", "dq", "dk", "dv"];
        let sizes = [qn, kn, kn, sn, qn, qn, sn, qn, kn, kn];
        let mut offs = vec![0usize];
        for sz in sizes {
            offs.push(offs.last().unwrap() + sz);
        }
        let reg = |n: &str| Operand::Workspace(offs[names.iter().position(|x| *x == n).unwrap()]);
        let at = |o: Operand| match o {
            Operand::Workspace(e) => e,
            _ => unreachable!(),
        };
        let mut ws = vec![0.0f32; *offs.last().unwrap()];
        let put = |ws: &mut Vec<f32>, n: &str, x: &[f32]| {
            let o = at(reg(n));
            ws[o..o + x.len()].copy_from_slice(x);
        };
        put(&mut ws, "q", &head_major(&q, b, s, nh, d));
        put(&mut ws, "k", &head_major(&kx, b, s, nkv, d));
        put(&mut ws, "v", &head_major(&v, b, s, nkv, d));
        put(&mut ws, "do", &head_major(&dout, b, s, nh, d));
        let group = nh / nkv;
        for m in 0..group {
            eval_ws(
                &attention_scores(dims, m, (reg("q"), reg("k"), reg("p"))),
                &mut ws,
                at,
            );
        }
        let scale = (d as f64).powf(-0.5) as f32;
        let mut lse = vec![0.0; b * nh * s];
        let po = at(reg("p"));
        softmax_rows(&mut ws[po..po + sn], &mut lse, s, scale);
        for m in 0..group {
            eval_ws(
                &attention_pv(dims, m, (reg("p"), reg("v"), reg("o"))),
                &mut ws,
                at,
            );
        }
        let oo = at(reg("o"));
        let out = seq_major(&ws[oo..oo + qn], b, s, nh, d);
        let (mut want_out, mut want_lse) = (vec![0.0; qn], vec![0.0; b * nh * s]);
        k::attention_fwd(&q, &kx, &v, b, s, nh, nkv, d, &mut want_out, &mut want_lse);
        close(&out, &want_out, "attention out");
        close(&lse, &want_lse, "attention lse");
        // Backward: dP, dV, the softmax backward, dQ, dK.
        let ops = ["q", "k", "v", "p", "do", "dp", "dq", "dk", "dv"].map(reg);
        for m in 0..group {
            let [dp, dv, _, _] = attention_bwd(dims, m, ops);
            eval_ws(&dp, &mut ws, at);
            eval_ws(&dv, &mut ws, at);
        }
        let dpo = at(reg("dp"));
        for r in 0..b * nh * s {
            let (p, dp) = (
                &ws[po + r * s..po + (r + 1) * s],
                &ws[dpo + r * s..dpo + (r + 1) * s],
            );
            let dot: f32 = p.iter().zip(dp).map(|(a, b)| a * b).sum();
            let ds: Vec<f32> = p
                .iter()
                .zip(dp)
                .map(|(p, g)| scale * p * (g - dot))
                .collect();
            ws[dpo + r * s..dpo + (r + 1) * s].copy_from_slice(&ds);
        }
        for m in 0..group {
            let [_, _, dq, dk] = attention_bwd(dims, m, ops);
            eval_ws(&dq, &mut ws, at);
            eval_ws(&dk, &mut ws, at);
        }
        let grab = |ws: &[f32], n: &str, len: usize, h: usize| {
            let o = at(reg(n));
            seq_major(&ws[o..o + len], b, s, h, d)
        };
        let (mut dq, mut dk, mut dv) = (vec![0.0; qn], vec![0.0; kn], vec![0.0; kn]);
        k::attention_bwd(
            &q, &kx, &v, &want_out, &want_lse, &dout, b, s, nh, nkv, d, &mut dq, &mut dk, &mut dv,
        );
        close(&grab(&ws, "dq", qn, nh), &dq, "attention dq");
        close(&grab(&ws, "dk", kn, nkv), &dk, "attention dk");
        close(&grab(&ws, "dv", kn, nkv), &dv, "attention dv");
    }
}
