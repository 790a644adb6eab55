//! The fused form's row reductions ([`Func::fast`]), in the order of the Rust kernels, so
//! a fused norm computes the same bits as `megac_kernels::norm`.
//!
//! The Rust kernels sum a row in f64 over 8 lanes (`megac_kernels`' `simd::sum_f64` and
//! its siblings): lane `l` adds the terms `l, l + 8, l + 16, ...` of the first `h - h % 8`
//! in order, the lanes are combined as `((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7))`,
//! then the last `h % 8` terms are added one by one. Here the row `[rows.., h]` is viewed
//! as `[rows.., h / 8, 8]` and one `linalg.generic` with loops `(rows.., j, l)` (the lane
//! `l` innermost, along memory) accumulates each lane into an f64 temporary `[rows.., 8]`;
//! a second combines the lanes in that tree, a third adds the tail. Every f64 operation
//! is the Rust kernel's, so LLVM may vectorize across the lanes but not reorder a sum.
//! The weight gradient of RMSNorm sums each column over the rows in row order, in f64
//! (`megac_kernels`' `column_blocks`), with the hidden dim inside so the loop runs along
//! memory. RMSNorm's, LayerNorm's and the MoE gate's statistics are then formed with the
//! Rust kernels' f32 and f64 operations in their order.

use super::*;

/// Lanes of the Rust kernels' row reductions (`megac_kernels`' `simd::LANES`).
const LANES: u64 = 8;

/// How an operand of a row reduction is indexed.
#[derive(Clone, Copy)]
pub(super) enum Ix {
    /// `[rows.., h]`: one value per element.
    Full,
    /// `[rows..]`: one value per row (an f64 statistic).
    Row,
    /// `[h]`: one value per column (a weight).
    Col,
}

/// A zeroed temporary of `shape`: f64 when `wide`, else f32.
fn temp(f: &mut Func, shape: &[u64], wide: bool) -> Arg {
    let el = if wide { "f64" } else { "f32" };
    let (name, ty) = f.alloc(shape, el);
    let z = f.constant("0.0", el);
    f.line(format!("linalg.fill ins({z} : {el}) outs({name} : {ty})"));
    Arg {
        name,
        ty,
        dtype: DType::F32,
        shape: shape.to_vec(),
        wide,
    }
}

fn free(f: &mut Func, a: &Arg) {
    f.line(format!("memref.dealloc {} : {}", a.name, a.ty));
}

/// The last dim's first `n8` elements of `a` (`n8` a multiple of 8) as `[.., n8 / 8, 8]`.
fn lanes(f: &mut Func, a: &Arg, n8: u64) -> Arg {
    let r = a.shape.len();
    let h = a.shape[r - 1];
    if n8 == h {
        return expand(f, a, r - 1, n8 / LANES, LANES);
    }
    let mut sizes = a.shape.clone();
    sizes[r - 1] = n8;
    let zeros = vec!["0".to_string(); r];
    let sv = subview(f, a, &zeros, Some(0), &sizes);
    let st = strides(&a.shape);
    let mut shape = sizes[..r - 1].to_vec();
    shape.extend([n8 / LANES, LANES]);
    let mut st2 = st[..r - 1].to_vec();
    st2.extend([LANES, 1]);
    // MLIR names a layout that is the row-major one of the new shape by its identity form.
    let ty = if st2 == strides(&shape) {
        memref_ty(&shape, a.el())
    } else {
        let st2: Vec<String> = st2.iter().map(u64::to_string).collect();
        format!(
            "memref<{}{}, strided<[{}], offset: 0>>",
            shape.iter().map(|s| format!("{s}x")).collect::<String>(),
            a.el(),
            st2.join(", ")
        )
    };
    let mut groups: Vec<String> = (0..r - 1).map(|i| format!("[{i}]")).collect();
    groups.push(format!("[{}, {}]", r - 1, r));
    let n = f.fresh("x");
    f.line(format!(
        "{n} = memref.expand_shape {} [{}] output_shape [{}] : {} into {ty}",
        sv.name,
        groups.join(", "),
        shape
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        sv.ty
    ));
    Arg {
        name: n,
        ty,
        dtype: a.dtype,
        shape,
        wide: false,
    }
}

/// The last dim's elements from `n8` on.
fn tail(f: &mut Func, a: &Arg, n8: u64) -> Arg {
    let r = a.shape.len();
    let mut sizes = a.shape.clone();
    sizes[r - 1] -= n8;
    let mut offs = vec!["0".to_string(); r];
    offs[r - 1] = n8.to_string();
    subview(f, a, &offs, Some(n8), &sizes)
}

/// `Σ_c term(operands at [row, c])` over the last dim `h` of every row (`rows` the leading
/// shape), in the Rust kernels' lane order (module doc); `term` gets the operands' values
/// (f32, or f64 for [`Ix::Row`] statistics) and returns an f64. The sums, a new f64
/// temporary `[rows..]` (the caller frees it).
pub(super) fn row_sum(
    f: &mut Func,
    operands: &[(&Arg, Ix)],
    rows: &[u64],
    h: u64,
    term: &dyn Fn(&mut Body, &[String]) -> String,
) -> Arg {
    for (a, _) in operands {
        f.materialize(&a.name);
    }
    let nr = rows.len();
    let lead = ds(0..nr);
    let n8 = h - h % LANES;
    let sum = temp(f, rows, true);
    if n8 > 0 {
        let mut lane_shape = rows.to_vec();
        lane_shape.push(LANES);
        let acc = temp(f, &lane_shape, true);
        let views: Vec<(Arg, Vec<String>)> = operands
            .iter()
            .map(|&(a, ix)| match ix {
                Ix::Full => (lanes(f, a, n8), ds(0..nr + 2)),
                Ix::Col => (lanes(f, a, n8), vec![d(nr), d(nr + 1)]),
                Ix::Row => (a.clone(), lead.clone()),
            })
            .collect();
        let ins: Vec<(&Arg, Vec<String>)> = views.iter().map(|(a, m)| (a, m.clone())).collect();
        let mut am = lead.clone();
        am.push(d(nr + 1));
        generic(f, nr + 2, &[nr], &ins, &[(&acc, am)], |b, i, o| {
            let t = term(b, i);
            vec![b.bin64("addf", &o[0], &t)]
        });
        let parts: Vec<(&Arg, Vec<String>)> = (0..LANES)
            .map(|l| {
                let mut m = lead.clone();
                m.push(l.to_string());
                (&acc, m)
            })
            .collect();
        generic(f, nr, &[], &parts, &[(&sum, lead.clone())], |b, a, _| {
            let p04 = b.bin64("addf", &a[0], &a[4]);
            let p15 = b.bin64("addf", &a[1], &a[5]);
            let p26 = b.bin64("addf", &a[2], &a[6]);
            let p37 = b.bin64("addf", &a[3], &a[7]);
            let lo = b.bin64("addf", &p04, &p15);
            let hi = b.bin64("addf", &p26, &p37);
            vec![b.bin64("addf", &lo, &hi)]
        });
        free(f, &acc);
    }
    if n8 < h {
        let views: Vec<(Arg, Vec<String>)> = operands
            .iter()
            .map(|&(a, ix)| match ix {
                Ix::Full => (tail(f, a, n8), ds(0..nr + 1)),
                Ix::Col => (tail(f, a, n8), vec![d(nr)]),
                Ix::Row => (a.clone(), lead.clone()),
            })
            .collect();
        let ins: Vec<(&Arg, Vec<String>)> = views.iter().map(|(a, m)| (a, m.clone())).collect();
        generic(
            f,
            nr + 1,
            &[nr],
            &ins,
            &[(&sum, lead.clone())],
            |b, i, o| {
                let t = term(b, i);
                vec![b.bin64("addf", &o[0], &t)]
            },
        );
    }
    sum
}

/// `1 / sqrt(v + eps)` in f32 (the Rust kernels' `rstd`).
fn rstd(b: &mut Body, v: &str, eps: f32) -> String {
    let e = b.cf(eps);
    let a = b.add(v, &e);
    let s = b.math("sqrt", &a);
    let one = b.c(1.0);
    b.div(&one, &s)
}

/// RMSNorm (`grad` false: `ins` x, w; `outs` y) or its gradient (`ins` x, w, dy; `outs`
/// dx, dw, accumulated), as `megac_kernels::norm::rms_norm_fwd` / `rms_norm_bwd`.
pub(super) fn rms_norm(f: &mut Func, grad: bool, eps: f32, ins: &[Arg], outs: &[Arg]) {
    let (x, w) = (&ins[0], &ins[1]);
    let rr = x.shape.len();
    let h = x.shape[rr - 1];
    let rows = x.shape[..rr - 1].to_vec();
    let lead = ds(0..rr - 1);
    let xid = ds(0..rr);
    let col = vec![d(rr - 1)];
    // rstd = 1 / sqrt((Σ x² / h) as f32 + eps), Σ in f64.
    let ss = row_sum(f, &[(x, Ix::Full)], &rows, h, &|b, v| {
        let e = b.ext(&v[0]);
        b.bin64("mulf", &e, &e)
    });
    let rs = temp(f, &rows, false);
    let hf = h as f64;
    generic(
        f,
        rr - 1,
        &[],
        &[(&ss, lead.clone())],
        &[(&rs, lead.clone())],
        |b, i, _| {
            let hc = b.c64(hf);
            let m = b.bin64("divf", &i[0], &hc);
            let v = b.trunc(&m);
            vec![rstd(b, &v, eps)]
        },
    );
    free(f, &ss);
    if !grad {
        // y = w * (x * rstd)
        generic(
            f,
            rr,
            &[],
            &[(x, xid.clone()), (&rs, lead.clone()), (w, col.clone())],
            &[(&outs[0], xid.clone())],
            |b, i, _| {
                let t = b.mul(&i[0], &i[1]);
                vec![b.mul(&i[2], &t)]
            },
        );
        free(f, &rs);
        return;
    }
    let dy = &ins[2];
    let (dx, dw) = (&outs[0], &outs[1]);
    // c = (Σ (dy·w) x · rstd / h) as f32, Σ in f64 (each dy·w rounded to f32).
    let dot = row_sum(
        f,
        &[(dy, Ix::Full), (w, Ix::Col), (x, Ix::Full)],
        &rows,
        h,
        &|b, v| {
            let g = b.mul(&v[0], &v[1]);
            let g = b.ext(&g);
            let xe = b.ext(&v[2]);
            b.bin64("mulf", &g, &xe)
        },
    );
    let c = temp(f, &rows, false);
    generic(
        f,
        rr - 1,
        &[],
        &[(&dot, lead.clone()), (&rs, lead.clone())],
        &[(&c, lead.clone())],
        |b, i, _| {
            let r = b.ext(&i[1]);
            let t = b.bin64("mulf", &i[0], &r);
            let hc = b.c64(hf);
            let t = b.bin64("divf", &t, &hc);
            vec![b.trunc(&t)]
        },
    );
    free(f, &dot);
    // dx += rstd * (dy * w - (x * rstd) * c)
    generic(
        f,
        rr,
        &[],
        &[
            (x, xid.clone()),
            (w, col.clone()),
            (dy, xid.clone()),
            (&rs, lead.clone()),
            (&c, lead.clone()),
        ],
        &[(dx, xid.clone())],
        |b, i, o| {
            let (xv, wv, dyv, r, cv) = (&i[0], &i[1], &i[2], &i[3], &i[4]);
            let g = b.mul(dyv, wv);
            let t = b.mul(xv, r);
            let t = b.mul(&t, cv);
            let g = b.sub(&g, &t);
            let g = b.mul(r, &g);
            vec![b.add(&o[0], &g)]
        },
    );
    free(f, &c);
    // dw = (dw as f64 + Σ_rows (dy * (x * rstd)) as f64) as f32, the rows in order.
    let acc = temp(f, &[h], true);
    generic(
        f,
        rr,
        &(0..rr - 1).collect::<Vec<_>>(),
        &[(x, xid.clone()), (dy, xid.clone()), (&rs, lead.clone())],
        &[(&acc, col.clone())],
        |b, i, o| {
            let t = b.mul(&i[0], &i[2]);
            let t = b.mul(&i[1], &t);
            let t = b.ext(&t);
            vec![b.bin64("addf", &o[0], &t)]
        },
    );
    generic(
        f,
        1,
        &[],
        &[(&acc, vec![d(0)])],
        &[(dw, vec![d(0)])],
        |b, i, o| {
            let w = b.ext(&o[0]);
            let s = b.bin64("addf", &w, &i[0]);
            vec![b.trunc(&s)]
        },
    );
    free(f, &acc);
    free(f, &rs);
}

/// LayerNorm (`ins` x, w, b; `outs` y) as `megac_kernels::norm::layer_norm_fwd`: the mean
/// and the biased variance in f64, the mean split into two f32 `hi + lo`, then
/// `(((x - hi) - lo) * rstd) * w + b`.
pub(super) fn layer_norm(f: &mut Func, eps: f32, ins: &[Arg], outs: &[Arg]) {
    let (x, w, bias) = (&ins[0], &ins[1], &ins[2]);
    let rr = x.shape.len();
    let h = x.shape[rr - 1];
    let hf = h as f64;
    let rows = x.shape[..rr - 1].to_vec();
    let lead = ds(0..rr - 1);
    let xid = ds(0..rr);
    let col = vec![d(rr - 1)];
    let s = row_sum(f, &[(x, Ix::Full)], &rows, h, &|b, v| b.ext(&v[0]));
    let mean = temp(f, &rows, true);
    generic(
        f,
        rr - 1,
        &[],
        &[(&s, lead.clone())],
        &[(&mean, lead.clone())],
        |b, i, _| {
            let hc = b.c64(hf);
            vec![b.bin64("divf", &i[0], &hc)]
        },
    );
    free(f, &s);
    let ssd = row_sum(f, &[(x, Ix::Full), (&mean, Ix::Row)], &rows, h, &|b, v| {
        let e = b.ext(&v[0]);
        let dv = b.bin64("subf", &e, &v[1]);
        b.bin64("mulf", &dv, &dv)
    });
    let (hi, lo, rs) = (
        temp(f, &rows, false),
        temp(f, &rows, false),
        temp(f, &rows, false),
    );
    generic(
        f,
        rr - 1,
        &[],
        &[(&mean, lead.clone()), (&ssd, lead.clone())],
        &[
            (&hi, lead.clone()),
            (&lo, lead.clone()),
            (&rs, lead.clone()),
        ],
        |b, i, _| {
            let h32 = b.trunc(&i[0]);
            let he = b.ext(&h32);
            let l = b.bin64("subf", &i[0], &he);
            let l32 = b.trunc(&l);
            let hc = b.c64(hf);
            let v = b.bin64("divf", &i[1], &hc);
            let v = b.trunc(&v);
            let zero = b.c(0.0);
            let v = b.op(format!("arith.maxnumf {v}, {zero} : f32"));
            let r = rstd(b, &v, eps);
            vec![h32, l32, r]
        },
    );
    free(f, &mean);
    free(f, &ssd);
    generic(
        f,
        rr,
        &[],
        &[
            (x, xid.clone()),
            (&hi, lead.clone()),
            (&lo, lead.clone()),
            (&rs, lead.clone()),
            (w, col.clone()),
            (bias, col),
        ],
        &[(&outs[0], xid.clone())],
        |b, i, _| {
            let c = b.sub(&i[0], &i[1]);
            let c = b.sub(&c, &i[2]);
            let n = b.mul(&c, &i[3]);
            let s = b.mul(&n, &i[4]);
            vec![b.add(&s, &i[5])]
        },
    );
    for a in [hi, lo, rs] {
        free(f, &a);
    }
}

/// The MoE gate's gradient (`ins` gate `[.., 1]`, x `[.., h]`, dy; `outs` dgate `[.., 1]`,
/// dx, accumulated) as `megac_kernels::activation::sigmoid_mul_bwd`: `dx += s · dy`, and
/// `dgate += (s (1 - s)) · (Σ_j (dy x) as f64) as f32`, the row's sum in f64 in order.
pub(super) fn sigmoid_mul_grad(f: &mut Func, ins: &[Arg], outs: &[Arg]) {
    let (dgate, dx) = (&outs[0], &outs[1]);
    let r = dx.shape.len();
    let id = ds(0..r);
    let lead = ds(0..r - 1);
    super::sigmoid_mul_grad_input(f, ins, dx);
    let rows = dx.shape[..r - 1].to_vec();
    let dot = temp(f, &rows, true);
    generic(
        f,
        r,
        &[r - 1],
        &[(&ins[2], id.clone()), (&ins[1], id.clone())],
        &[(&dot, lead.clone())],
        |b, i, o| {
            let t = b.mul(&i[0], &i[1]);
            let t = b.ext(&t);
            vec![b.bin64("addf", &o[0], &t)]
        },
    );
    generic(
        f,
        r,
        &[],
        &[(&ins[0], id.clone()), (&dot, lead)],
        &[(dgate, id)],
        |b, i, o| {
            let s = b.sigmoid(&i[0]);
            let one = b.c(1.0);
            let om = b.sub(&one, &s);
            let k = b.mul(&s, &om);
            let dv = b.trunc(&i[1]);
            let t = b.mul(&k, &dv);
            vec![b.add(&o[0], &t)]
        },
    );
    free(f, &dot);
}
