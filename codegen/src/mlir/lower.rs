//! Lowering of plan instructions to MLIR: kernels to `linalg.generic` (with `arith` and
//! `math` bodies) on memref views, collectives and transfers to calls of runtime symbols.
//!
//! Every kernel computes in f32 as the CPU backend does: 16-bit inputs are widened inside
//! the body, 16-bit outputs are staged through an f32 temporary and rounded once. Kernels
//! without a lowering here ([`lowered`] says which) are calls of a declared runtime kernel
//! symbol, `@megac.kernel.<op>.<dtypes>`, carrying the op's attributes, so every op of
//! every plan has a form.

use std::fmt::Write as _;

use megac_ir::op::WeightLayout;
use megac_ir::plan::{BufId, Instr};
use megac_ir::types::{Axis, DType};
use megac_ir::OpKind;

use super::text::{elem, float_lit, memref_ty, str_attr, Func, View};

mod adamw;
mod ordered;

pub use adamw::SCALARS as ADAMW_SCALARS;

/// Whether `op` has a linalg lowering (else it is emitted as a runtime kernel call).
/// Ops whose kernel communicates or depends on the rank beyond what a view expresses
/// (vocab-split cross-entropy, ring attention, MoE routing) are calls.
pub fn lowered(op: &OpKind) -> bool {
    matches!(
        op,
        OpKind::Embedding
            | OpKind::PosEmbedding
            | OpKind::PosEmbeddingGrad
            | OpKind::Linear { .. }
            | OpKind::LinearGradInput { .. }
            | OpKind::LinearGradWeight { .. }
            | OpKind::BiasGrad
            | OpKind::RmsNorm { .. }
            | OpKind::RmsNormGrad { .. }
            | OpKind::LayerNorm { .. }
            | OpKind::Split { .. }
            | OpKind::Concat
            | OpKind::Cast { .. }
            | OpKind::RepeatKv { .. }
            | OpKind::RepeatKvGrad { .. }
            | OpKind::Add
            | OpKind::GradSum
            | OpKind::BiasAdd
            | OpKind::SwiGlu
            | OpKind::SwiGluGrad
            | OpKind::GeluTanh
            | OpKind::GeluTanhGrad
            | OpKind::SigmoidMul
            | OpKind::SigmoidMulGrad
            | OpKind::Slice { .. }
    )
}

/// A memref operand: SSA name, type, element type, shape.
#[derive(Clone, Debug)]
struct Arg {
    name: String,
    ty: String,
    dtype: DType,
    shape: Vec<u64>,
    /// An f64 temporary (the fused form's row statistics, [`ordered`]); `dtype` is then
    /// `F32` and not used.
    wide: bool,
}

impl Arg {
    /// The MLIR element type.
    fn el(&self) -> &'static str {
        if self.wide {
            "f64"
        } else {
            elem(self.dtype)
        }
    }
}

impl From<View> for Arg {
    fn from(v: View) -> Arg {
        Arg {
            name: v.name,
            ty: v.ty,
            dtype: v.dtype,
            shape: v.shape,
            wide: false,
        }
    }
}

/// The statements of a `linalg.generic` body.
struct Body {
    lines: Vec<String>,
    next: usize,
    /// Fused-kernel form ([`Func::fast`]): `exp` as the Rust kernels' polynomial.
    fast: bool,
}

impl Body {
    fn fresh(&mut self) -> String {
        self.next += 1;
        format!("%e{}", self.next)
    }
    fn op(&mut self, text: String) -> String {
        let n = self.fresh();
        self.lines.push(format!("{n} = {text}"));
        n
    }
    fn bin(&mut self, op: &str, a: &str, b: &str) -> String {
        self.op(format!("arith.{op} {a}, {b} : f32"))
    }
    fn add(&mut self, a: &str, b: &str) -> String {
        self.bin("addf", a, b)
    }
    /// `arith.<op>` on two f64 values.
    fn bin64(&mut self, op: &str, a: &str, b: &str) -> String {
        self.op(format!("arith.{op} {a}, {b} : f64"))
    }
    /// An f64 constant.
    fn c64(&mut self, x: f64) -> String {
        self.op(format!("arith.constant {} : f64", float_lit(x)))
    }
    /// f32 to f64 (exact).
    fn ext(&mut self, a: &str) -> String {
        self.op(format!("arith.extf {a} : f32 to f64"))
    }
    /// f64 to f32, rounded to nearest (Rust's `as f32`).
    fn trunc(&mut self, a: &str) -> String {
        self.op(format!("arith.truncf {a} : f64 to f32"))
    }
    fn sub(&mut self, a: &str, b: &str) -> String {
        self.bin("subf", a, b)
    }
    fn mul(&mut self, a: &str, b: &str) -> String {
        self.bin("mulf", a, b)
    }
    fn div(&mut self, a: &str, b: &str) -> String {
        self.bin("divf", a, b)
    }
    fn c(&mut self, x: f64) -> String {
        self.op(format!("arith.constant {} : f32", float_lit(x)))
    }
    fn math(&mut self, f: &str, a: &str) -> String {
        if self.fast && f == "exp" {
            return self.exp(a);
        }
        self.op(format!("math.{f} {a} : f32"))
    }
    fn cf(&mut self, x: f32) -> String {
        self.c(f64::from(x))
    }
    /// `e^x` as the Rust kernels compute it (`megac_kernels`' `simd::exp`, the Cephes
    /// `expf` polynomial): the same f32 operations in the same order, branch-free, so it
    /// vectorizes where libm's `expf` does not and gives the same bits.
    fn exp(&mut self, x: &str) -> String {
        const EXP_HI: f32 = 88.37;
        const EXP_LO: f32 = -87.33;
        let (hi, lo) = (self.cf(EXP_HI), self.cf(EXP_LO));
        let m = self.op(format!("arith.minimumf {x}, {hi} : f32"));
        let xc = self.op(format!("arith.maximumf {m}, {lo} : f32"));
        let log2e = self.cf(std::f32::consts::LOG2_E);
        let magic = self.cf(12_582_912.0);
        let t = self.mul(&xc, &log2e);
        let t = self.add(&t, &magic);
        let n = self.sub(&t, &magic);
        let (l1, l2) = (self.cf(0.693_359_4), self.cf(-2.121_944_4e-4));
        let a = self.mul(&n, &l1);
        let r = self.sub(&xc, &a);
        let a = self.mul(&n, &l2);
        let r = self.sub(&r, &a);
        let r2 = self.mul(&r, &r);
        let mut p = self.cf(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3f32,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            let q = self.mul(&p, &r);
            let c = self.cf(c);
            p = self.add(&q, &c);
        }
        let p = self.mul(&p, &r2);
        let p = self.add(&p, &r);
        let one = self.cf(1.0);
        let p = self.add(&p, &one);
        let ti = self.op(format!("arith.bitcast {t} : f32 to i32"));
        let k23 = self.op("arith.constant 23 : i32".into());
        let sh = self.op(format!("arith.shli {ti}, {k23} : i32"));
        let bias = self.op(format!("arith.constant {} : i32", 127i32 << 23));
        let e = self.op(format!("arith.addi {sh}, {bias} : i32"));
        let scale = self.op(format!("arith.bitcast {e} : i32 to f32"));
        let y = self.mul(&p, &scale);
        let inf = self.op("arith.constant 0x7F800000 : f32".into());
        let zero = self.cf(0.0);
        let over = self.op(format!("arith.cmpf ogt, {x}, {hi} : f32"));
        let under = self.op(format!("arith.cmpf olt, {x}, {lo} : f32"));
        let y = self.op(format!("arith.select {under}, {zero}, {y} : f32"));
        self.op(format!("arith.select {over}, {inf}, {y} : f32"))
    }
    /// `(sigmoid(z), 1 - sigmoid(z))` as `megac_kernels`' `simd::sigmoid_pair` forms
    /// them: `e = exp(-|z|)`, `r = 1 / (1 + e)`, then `(r, e·r)` for `z >= 0`, else
    /// `(e·r, r)`.
    fn sigmoid_pair(&mut self, z: &str) -> (String, String) {
        let a = self.op(format!("math.absf {z} : f32"));
        let n = self.op(format!("arith.negf {a} : f32"));
        let e = self.math("exp", &n);
        let one = self.c(1.0);
        let d = self.add(&one, &e);
        let r = self.div(&one, &d);
        let small = self.mul(&e, &r);
        let zero = self.c(0.0);
        let ge = self.op(format!("arith.cmpf oge, {z}, {zero} : f32"));
        let sg = self.op(format!("arith.select {ge}, {r}, {small} : f32"));
        let om = self.op(format!("arith.select {ge}, {small}, {r} : f32"));
        (sg, om)
    }
    /// `1 / (1 + exp(-x))`.
    fn sigmoid(&mut self, x: &str) -> String {
        let n = self.op(format!("arith.negf {x} : f32"));
        let e = self.math("exp", &n);
        let one = self.c(1.0);
        let d = self.add(&one, &e);
        self.div(&one, &d)
    }
}

/// Affine map text over `loops` dims with result expressions `exprs`.
fn map(loops: usize, exprs: &[String]) -> String {
    let dims: Vec<String> = (0..loops).map(|d| format!("d{d}")).collect();
    format!(
        "affine_map<({}) -> ({})>",
        dims.join(", "),
        exprs.join(", ")
    )
}

fn d(i: usize) -> String {
    format!("d{i}")
}

fn ds(r: std::ops::Range<usize>) -> Vec<String> {
    r.map(d).collect()
}

/// Emit a `linalg.generic`: `ins`/`outs` with their result expressions; `body` gets the
/// block arguments (16-bit inputs already widened to f32) and returns the yielded values.
fn generic(
    f: &mut Func,
    loops: usize,
    reductions: &[usize],
    ins: &[(&Arg, Vec<String>)],
    outs: &[(&Arg, Vec<String>)],
    body: impl FnOnce(&mut Body, &[String], &[String]) -> Vec<String>,
) {
    // Deferred zeros (fused kernels): an input is zeroed before it is read; an output
    // written elementwise (identity map, no reduction) starts from 0 instead of its value.
    for (a, _) in ins {
        f.materialize(&a.name);
    }
    let identity = ds(0..loops);
    let mut fresh_out = Vec::new();
    for (a, e) in outs {
        let absorbed = f.fresh.contains_key(&a.name) && reductions.is_empty() && *e == identity;
        if absorbed {
            f.fresh.remove(&a.name);
        } else {
            f.materialize(&a.name);
        }
        fresh_out.push(absorbed);
    }
    let maps: Vec<String> = ins.iter().chain(outs).map(|(_, e)| map(loops, e)).collect();
    let iters: Vec<&str> = (0..loops)
        .map(|l| {
            if reductions.contains(&l) {
                "\"reduction\""
            } else {
                "\"parallel\""
            }
        })
        .collect();
    let mut b = Body {
        lines: Vec::new(),
        next: 0,
        fast: f.fast,
    };
    let mut args = Vec::new();
    let mut in_vals = Vec::new();
    for (i, (a, _)) in ins.iter().enumerate() {
        let n = format!("%in{i}");
        args.push(format!("{n}: {}", a.el()));
        if a.dtype.is_half() && !a.wide {
            let w = b.op(format!("arith.extf {n} : {} to f32", elem(a.dtype)));
            in_vals.push(w);
        } else {
            in_vals.push(n);
        }
    }
    let mut out_vals = Vec::new();
    for (i, (a, _)) in outs.iter().enumerate() {
        let n = format!("%out{i}");
        args.push(format!("{n}: {}", a.el()));
        if fresh_out[i] {
            out_vals.push(b.c(0.0));
        } else {
            out_vals.push(n);
        }
    }
    let ys = body(&mut b, &in_vals, &out_vals);
    let out_tys: Vec<&str> = outs.iter().map(|(a, _)| a.el()).collect();
    let names = |xs: &[(&Arg, Vec<String>)]| -> (String, String) {
        (
            xs.iter()
                .map(|(a, _)| a.name.clone())
                .collect::<Vec<_>>()
                .join(", "),
            xs.iter()
                .map(|(a, _)| a.ty.clone())
                .collect::<Vec<_>>()
                .join(", "),
        )
    };
    let (in_n, in_t) = names(ins);
    let (out_n, out_t) = names(outs);
    let ins_text = if ins.is_empty() {
        String::new()
    } else {
        format!(" ins({in_n} : {in_t})")
    };
    f.line(format!(
        "linalg.generic {{indexing_maps = [{}], iterator_types = [{}]}}{ins_text} outs({out_n} : {out_t}) {{",
        maps.join(", "),
        iters.join(", ")
    ));
    f.line(format!("^bb0({}):", args.join(", ")));
    for l in b.lines {
        f.line(format!("  {l}"));
    }
    f.line(format!(
        "  linalg.yield {} : {}",
        ys.join(", "),
        out_tys.join(", ")
    ));
    f.line("}");
}

/// Staged outputs: 16-bit outputs replaced by f32 temporaries holding their widened values.
struct Staged {
    args: Vec<Arg>,
    /// (temporary, view) pairs to round back.
    back: Vec<(Arg, Arg)>,
}

fn stage(f: &mut Func, outs: Vec<Arg>) -> Staged {
    let mut args = Vec::new();
    let mut back = Vec::new();
    for o in outs {
        if !o.dtype.is_half() {
            args.push(o);
            continue;
        }
        let (name, ty) = f.alloc(&o.shape, "f32");
        let t = Arg {
            name,
            ty,
            dtype: DType::F32,
            shape: o.shape.clone(),
            wide: false,
        };
        let id = ds(0..o.shape.len());
        generic(
            f,
            o.shape.len(),
            &[],
            &[(&o, id.clone())],
            &[(&t, id)],
            |_, i, _| vec![i[0].clone()],
        );
        back.push((t.clone(), o));
        args.push(t);
    }
    Staged { args, back }
}

fn unstage(f: &mut Func, s: Staged) {
    for (t, o) in s.back {
        let id = ds(0..o.shape.len());
        let dt = elem(o.dtype);
        generic(
            f,
            o.shape.len(),
            &[],
            &[(&t, id.clone())],
            &[(&o, id)],
            |b, i, _| vec![b.op(format!("arith.truncf {} : f32 to {dt}", i[0]))],
        );
        f.line(format!("memref.dealloc {} : {}", t.name, t.ty));
    }
}

/// Row-major strides of `shape`.
fn strides(shape: &[u64]) -> Vec<u64> {
    let mut s = vec![1u64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// `memref.subview` of `a` at `offsets` (SSA `index` names or literals with `static_off`)
/// with `sizes`, unit strides.
fn subview(
    f: &mut Func,
    a: &Arg,
    offsets: &[String],
    static_off: Option<u64>,
    sizes: &[u64],
) -> Arg {
    let st = strides(&a.shape);
    let off = static_off.map_or("?".to_string(), |o| o.to_string());
    let st_text: Vec<String> = st.iter().map(|s| s.to_string()).collect();
    let ty = format!(
        "memref<{}{}, strided<[{}], offset: {off}>>",
        sizes.iter().map(|s| format!("{s}x")).collect::<String>(),
        elem(a.dtype),
        st_text.join(", ")
    );
    let n = f.fresh("s");
    let sz: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
    let ones = vec!["1"; sizes.len()].join(", ");
    f.line(format!(
        "{n} = memref.subview {}[{}] [{}] [{ones}] : {} to {ty}",
        a.name,
        offsets.join(", "),
        sz.join(", "),
        a.ty
    ));
    Arg {
        name: n,
        ty,
        dtype: a.dtype,
        shape: sizes.to_vec(),
        wide: false,
    }
}

fn copy(f: &mut Func, src: &Arg, dst: &Arg) {
    f.line(format!(
        "memref.copy {}, {} : {} to {}",
        src.name, dst.name, src.ty, dst.ty
    ));
}

/// `memref.expand_shape` of `a`'s dim `dim` into `[outer, inner]`.
fn expand(f: &mut Func, a: &Arg, dim: usize, outer: u64, inner: u64) -> Arg {
    let mut shape = a.shape.clone();
    shape[dim] = outer;
    shape.insert(dim + 1, inner);
    let mut groups = Vec::new();
    let mut j = 0;
    for i in 0..a.shape.len() {
        if i == dim {
            groups.push(format!("[{j}, {}]", j + 1));
            j += 2;
        } else {
            groups.push(format!("[{j}]"));
            j += 1;
        }
    }
    let ty = memref_ty(&shape, elem(a.dtype));
    let n = f.fresh("x");
    let sizes: Vec<String> = shape.iter().map(|s| s.to_string()).collect();
    f.line(format!(
        "{n} = memref.expand_shape {} [{}] output_shape [{}] : {} into {ty}",
        a.name,
        groups.join(", "),
        sizes.join(", "),
        a.ty
    ));
    Arg {
        name: n,
        ty,
        dtype: a.dtype,
        shape,
        wide: false,
    }
}

fn fill_zero(f: &mut Func, a: &Arg) {
    f.fresh.remove(&a.name);
    let z = f.zero(a.dtype);
    f.line(format!(
        "linalg.fill ins({z} : {}) outs({} : {})",
        elem(a.dtype),
        a.name,
        a.ty
    ));
}

/// The weight's result expressions: its `nb` stacked dims, then `[o, i]` or `[i, o]`.
fn weight_map(nb: usize, layout: WeightLayout, o: usize, i: usize) -> Vec<String> {
    let mut m = ds(0..nb);
    match layout {
        WeightLayout::OutIn => m.extend([d(o), d(i)]),
        WeightLayout::InOut => m.extend([d(i), d(o)]),
    }
    m
}

/// The mesh axes sharding dim `dim` of buffer `b`.
fn split_axes(f: &Func, b: BufId, dim: usize) -> Vec<Axis> {
    f.plan.buffers[b as usize]
        .layout
        .get(dim)
        .cloned()
        .unwrap_or_default()
}

/// Emit one instruction.
pub(crate) fn instr(f: &mut Func, i: &Instr) {
    match i {
        Instr::Zero { buffer } => {
            let v: Arg = f.view(*buffer).into();
            fill_zero(f, &v);
        }
        Instr::Send {
            buffer,
            chunk,
            transfer,
            twin,
        }
        | Instr::Recv {
            buffer,
            chunk,
            transfer,
            twin,
        } => {
            let stem = if matches!(i, Instr::Send { .. }) {
                "megac.send"
            } else {
                "megac.recv"
            };
            let v = f.view(*buffer);
            let bytes = f.plan.buffers[*buffer as usize].len()
                * f.plan.buffers[*buffer as usize].dtype.size_bytes();
            let group = if *twin { "fbd" } else { "pp" };
            f.call(
                stem,
                &[v],
                &[
                    ("megac.group".into(), str_attr(group)),
                    ("megac.bytes".into(), format!("{bytes} : i64")),
                    ("megac.tag".into(), format!("{transfer} : i64")),
                    ("megac.chunk".into(), format!("{chunk} : i64")),
                ],
            );
        }
        Instr::Kernel {
            op,
            inputs,
            outputs,
            path,
        } => kernel(f, op, inputs, outputs, path),
    }
}

/// The group attributes of a collective over `axes`.
fn group_attrs(f: &mut Func, axes: &[Axis], bytes: u64) -> Vec<(String, String)> {
    let names: Vec<&str> = axes.iter().map(|a| a.as_str()).collect();
    let size: u64 = if axes.is_empty() {
        1
    } else {
        f.plan.mesh.group(0, axes).len() as u64
    };
    let tag = *f.collectives;
    *f.collectives += 1;
    vec![
        ("megac.group".into(), str_attr(&names.join(","))),
        ("megac.group_size".into(), format!("{size} : i64")),
        ("megac.bytes".into(), format!("{bytes} : i64")),
        ("megac.tag".into(), format!("{tag} : i64")),
    ]
}

fn bytes_of(f: &Func, b: BufId) -> u64 {
    let buf = &f.plan.buffers[b as usize];
    buf.len() * buf.dtype.size_bytes()
}

fn kernel(f: &mut Func, op: &OpKind, inputs: &[BufId], outputs: &[BufId], path: &str) {
    let collective_axes = match op {
        OpKind::AllReduce { axes }
        | OpKind::AllGather { axes, .. }
        | OpKind::ReduceScatter { axes, .. }
        | OpKind::AllToAll { axes, .. } => Some(axes.clone()),
        _ => None,
    };
    if let Some(axes) = collective_axes {
        let views: Vec<View> = inputs.iter().chain(outputs).map(|&b| f.view(b)).collect();
        let bytes = bytes_of(f, inputs[0]);
        let mut attrs = group_attrs(f, &axes, bytes);
        for (k, v) in op.attrs() {
            if k != "axes" {
                attrs.push((format!("megac.{k}"), str_attr(&v)));
            }
        }
        attrs.push(("megac.inputs".into(), format!("{} : i64", inputs.len())));
        f.call(&format!("megac.{}", op.name()), &views, &attrs);
        return;
    }
    // RoPE and AdamW have a linalg form only in a fused kernel (RoPE's tables are module
    // constants, AdamW takes the step's scalars as an argument); the role modules call the
    // runtime's kernel.
    let fused_only = f.fast
        && matches!(
            op,
            OpKind::Rope { .. } | OpKind::RopeGrad { .. } | OpKind::AdamW { .. }
        );
    if (lowered(op) || fused_only) && lower(f, op, inputs, outputs).is_some() {
        return;
    }
    // A runtime kernel.
    let views: Vec<View> = inputs.iter().chain(outputs).map(|&b| f.view(b)).collect();
    let mut attrs = vec![
        ("megac.op".into(), str_attr(op.name())),
        ("megac.path".into(), str_attr(path)),
        ("megac.inputs".into(), format!("{} : i64", inputs.len())),
    ];
    let op_attrs = op.attrs();
    if !op_attrs.is_empty() {
        let mut t = String::from("{");
        for (n, (k, v)) in op_attrs.iter().enumerate() {
            if n > 0 {
                t.push_str(", ");
            }
            let _ = write!(t, "{k} = {}", str_attr(v));
        }
        t.push('}');
        attrs.push(("megac.attrs".into(), t));
    }
    if let Some(ic) = op.implicit_collective() {
        let layout = &f.plan.buffers[inputs[ic.operand] as usize].layout;
        if ic.applies(layout) {
            let bytes = bytes_of(f, inputs[ic.operand]);
            attrs.extend(group_attrs(f, &[ic.axis], bytes));
        }
    }
    if let OpKind::GradNorm { axes } = op {
        if !axes.is_empty() {
            attrs.extend(group_attrs(f, axes, 8));
        }
    }
    f.call(&format!("megac.kernel.{}", op.name()), &views, &attrs);
}

/// The linalg lowering of a kernel; `None` when this instance needs the runtime kernel
/// (a rank-dependent form the lowering does not express).
fn lower(f: &mut Func, op: &OpKind, inputs: &[BufId], outputs: &[BufId]) -> Option<()> {
    if let OpKind::AdamW { .. } = op {
        return adamw::adamw(f, op, inputs, outputs);
    }
    let ins: Vec<Arg> = inputs.iter().map(|&b| f.view(b).into()).collect();
    let outs: Vec<Arg> = outputs.iter().map(|&b| f.view(b).into()).collect();
    match op {
        // ---- data movement (no arithmetic, so no staging)
        OpKind::Split { n } => {
            let x = &ins[0];
            let r = x.shape.len();
            let part = x.shape[r - 1] / n;
            for (k, o) in outs.iter().enumerate() {
                let mut offs: Vec<String> = vec!["0".into(); r];
                offs[r - 1] = (k as u64 * part).to_string();
                let sv = subview(f, x, &offs, Some(k as u64 * part), &o.shape);
                copy(f, &sv, o);
            }
            Some(())
        }
        OpKind::Concat => {
            let y = &outs[0];
            let r = y.shape.len();
            let mut at = 0;
            for x in &ins {
                let mut offs: Vec<String> = vec!["0".into(); r];
                offs[r - 1] = at.to_string();
                let sv = subview(f, y, &offs, Some(at), &x.shape);
                copy(f, x, &sv);
                at += x.shape[r - 1];
            }
            Some(())
        }
        OpKind::Slice { axes, dim } => {
            let (x, y) = (&ins[0], &outs[0]);
            let dim = *dim as usize;
            let idx = f.rank_index(axes);
            let off = f.mul_add(&idx, y.shape[dim], 0);
            let offs: Vec<String> = (0..x.shape.len())
                .map(|i| if i == dim { off.clone() } else { "0".into() })
                .collect();
            let sv = subview(f, x, &offs, None, &y.shape);
            copy(f, &sv, y);
            Some(())
        }
        OpKind::RepeatKv { n } => {
            let (x, y) = (&ins[0], &outs[0]);
            if x.dtype != y.dtype || y.shape.len() != 4 {
                return None;
            }
            let y5 = expand(f, y, 2, x.shape[2], *n);
            generic(
                f,
                5,
                &[],
                &[(x, vec![d(0), d(1), d(2), d(4)])],
                &[(&y5, ds(0..5))],
                |_, i, _| vec![i[0].clone()],
            );
            Some(())
        }
        OpKind::Embedding => {
            let (tok, table, y) = (&ins[0], &ins[1], &outs[0]);
            let split = split_axes(f, inputs[1], 0);
            if table.dtype != y.dtype || !(split.is_empty() || split == [Axis::Tp]) {
                return None;
            }
            let rows = table.shape[0];
            // Vocab-parallel: this rank's rows start at its tp index times the rows.
            let start = if split.is_empty() {
                None
            } else {
                let idx = f.rank_index(&split);
                let s = f.mul_add(&idx, rows, 0);
                let zero = f.zero(y.dtype);
                let last = f.index(rows.saturating_sub(1));
                let c0 = f.index(0);
                Some((s, zero, last, c0))
            };
            let r = y.shape.len();
            let lead = ds(0..r - 1);
            let (tname, tty) = (table.name.clone(), table.ty.clone());
            let ydt = elem(y.dtype);
            generic(f, r, &[], &[(tok, lead)], &[(y, ds(0..r))], |b, i, _| {
                let id = b.op(format!("arith.index_cast {} : i32 to index", i[0]));
                let hh = b.op(format!("linalg.index {} : index", r - 1));
                match &start {
                    None => vec![b.op(format!("memref.load {tname}[{id}, {hh}] : {tty}"))],
                    Some((s, zero, last, c0)) => {
                        let local = b.op(format!("arith.subi {id}, {s} : index"));
                        let ge = b.op(format!("arith.cmpi sge, {local}, {c0} : index"));
                        let le = b.op(format!("arith.cmpi sle, {local}, {last} : index"));
                        let ok = b.op(format!("arith.andi {ge}, {le} : i1"));
                        let lo = b.op(format!("arith.maxsi {local}, {c0} : index"));
                        let cl = b.op(format!("arith.minsi {lo}, {last} : index"));
                        let v = b.op(format!("memref.load {tname}[{cl}, {hh}] : {tty}"));
                        vec![b.op(format!("arith.select {ok}, {v}, {zero} : {ydt}"))]
                    }
                }
            });
            Some(())
        }
        _ => lower_compute(f, op, inputs, ins, outs),
    }
}

/// RoPE's cos and sin tables for positions `0..s` (`[s, inv_freq.len()]`, f32, computed
/// as `megac_kernels::rope::rope_tables_freq` does: `cos`/`sin` of the f32 product
/// `pos · inv_freq[i]`), as module constants of `f` (one pair per distinct table): their
/// symbols' `memref.get_global` values.
fn rope_tables(f: &mut Func, s: usize, inv_freq: &[f32]) -> (String, String) {
    let half = inv_freq.len();
    let ty = memref_ty(&[s as u64, half as u64], "f32");
    let mut names = Vec::new();
    for trig in [f32::cos, f32::sin] {
        let mut hex = String::with_capacity(2 + 8 * s * half);
        hex.push_str("0x");
        for p in 0..s {
            for &fr in inv_freq {
                for byte in trig(p as f32 * fr).to_le_bytes() {
                    let _ = write!(hex, "{byte:02X}");
                }
            }
        }
        let body = format!("{ty} = dense<\"{hex}\">");
        let existing = f
            .globals
            .iter()
            .position(|g| g.ends_with(&format!(": {body}")));
        let k = existing.unwrap_or_else(|| {
            let k = f.globals.len();
            f.globals.push(format!(
                "memref.global \"private\" constant @rope{k} : {body}"
            ));
            k
        });
        let n = f.fresh("rope");
        f.line(format!("{n} = memref.get_global @rope{k} : {ty}"));
        names.push(n);
    }
    (names[0].clone(), names[1].clone())
}

/// Kernels with arithmetic: computed in f32 on staged outputs.
fn lower_compute(
    f: &mut Func,
    op: &OpKind,
    inputs: &[BufId],
    ins: Vec<Arg>,
    outs: Vec<Arg>,
) -> Option<()> {
    // Pre-checks of forms the lowering does not express (before emitting anything).
    match op {
        OpKind::PosEmbedding if !split_axes(f, inputs[0], 1).is_empty() => return None,
        OpKind::PosEmbeddingGrad if !split_axes(f, inputs[1], 1).is_empty() => return None,
        // Positions 0..s only: a sequence split (context parallelism) has others.
        OpKind::Rope { .. } | OpKind::RopeGrad { .. }
            if !split_axes(f, inputs[0], 1).is_empty() || ins[0].shape.len() != 4 =>
        {
            return None
        }
        _ => {}
    }
    let st = stage(f, outs);
    let outs = st.args.clone();
    let y = &outs[0];
    let r = y.shape.len();
    let id = ds(0..r);
    let acc = op.accumulates();
    match op {
        OpKind::Add | OpKind::GradSum => {
            let mut operands: Vec<(&Arg, Vec<String>)> =
                ins.iter().map(|a| (a, id.clone())).collect();
            if operands.is_empty() {
                unstage(f, st);
                return Some(());
            }
            let n = operands.len();
            operands.truncate(n);
            generic(f, r, &[], &operands, &[(y, id.clone())], |b, i, o| {
                let mut s = i[0].clone();
                for x in &i[1..] {
                    s = b.add(&s, x);
                }
                if acc {
                    s = b.add(&o[0], &s);
                }
                vec![s]
            });
        }
        OpKind::BiasAdd => {
            generic(
                f,
                r,
                &[],
                &[(&ins[0], id.clone()), (&ins[1], vec![d(r - 1)])],
                &[(y, id.clone())],
                |b, i, _| vec![b.add(&i[0], &i[1])],
            );
        }
        OpKind::Cast { .. } => {
            generic(
                f,
                r,
                &[],
                &[(&ins[0], id.clone())],
                &[(y, id.clone())],
                |_, i, _| vec![i[0].clone()],
            );
        }
        OpKind::Rope { theta, scaling } | OpKind::RopeGrad { theta, scaling } => {
            // `megac_kernels::rope`'s rotation, element by element, on `[b, s, heads, 2,
            // d/2]` views (the two halves of each head): with `x'` the element in the other
            // half, y = x·cos + (−x')·sin in the first half and x·cos + x'·sin in the second
            // (forward); the backward adds x·cos + x'·sin and x·cos + (−x')·sin (`a − b` is
            // `a + (−b)` exactly). The cos and sin tables are the kernel's own f32 values
            // (positions 0..s), module constants. The innermost loop runs along memory.
            let inverse = matches!(op, OpKind::RopeGrad { .. });
            let (s_len, dim) = (ins[0].shape[1] as usize, ins[0].shape[3] as usize);
            let half = dim / 2;
            let inv_freq = megac_ir::spec::rope_inv_freq(dim, *theta, scaling.as_ref());
            let (cos, sin) = rope_tables(f, s_len, &inv_freq);
            let table = |n: String| Arg {
                ty: memref_ty(&[s_len as u64, half as u64], "f32"),
                name: n,
                dtype: DType::F32,
                shape: vec![s_len as u64, half as u64],
                wide: false,
            };
            let (cos, sin) = (table(cos), table(sin));
            // The halves as a dimension of their own. A deferred zero of the input is
            // done first; one of the output moves to its view.
            f.materialize(&ins[0].name);
            let halves = |f: &mut Func, a: &Arg| -> Arg {
                let mut shape = a.shape[..3].to_vec();
                shape.extend([2, half as u64]);
                let ty = memref_ty(&shape, elem(a.dtype));
                let name = f.fresh("rope");
                f.line(format!(
                    "{name} = memref.expand_shape {} [[0], [1], [2], [3, 4]] output_shape [{}] : {} into {ty}",
                    a.name,
                    shape.iter().map(u64::to_string).collect::<Vec<_>>().join(", "),
                    a.ty
                ));
                Arg {
                    name,
                    ty,
                    dtype: a.dtype,
                    shape,
                    wide: false,
                }
            };
            let x = halves(f, &ins[0]);
            let y5 = halves(f, y);
            if let Some(v) = f.fresh.remove(&y.name) {
                let moved = View {
                    name: y5.name.clone(),
                    ty: y5.ty.clone(),
                    dtype: v.dtype,
                    shape: y5.shape.clone(),
                };
                f.fresh.insert(y5.name.clone(), moved);
            }
            let id5 = ds(0..5);
            let partner = vec![d(0), d(1), d(2), "1 - d3".to_string(), d(4)];
            let t = vec![d(1), d(4)];
            generic(
                f,
                5,
                &[],
                &[
                    (&x, id5.clone()),
                    (&x, partner),
                    (&cos, t.clone()),
                    (&sin, t),
                ],
                &[(&y5, id5)],
                |b, i, o| {
                    let k = b.op("linalg.index 3 : index".into());
                    let zero = b.op("arith.constant 0 : index".into());
                    let first = b.op(format!("arith.cmpi eq, {k}, {zero} : index"));
                    let neg = b.op(format!("arith.negf {} : f32", i[1]));
                    // Forward: −x' in the first half; backward: in the second.
                    let (a, c) = if inverse {
                        (i[1].clone(), neg)
                    } else {
                        (neg, i[1].clone())
                    };
                    let xq = b.op(format!("arith.select {first}, {a}, {c} : f32"));
                    let xc = b.mul(&i[0], &i[2]);
                    let xs = b.mul(&xq, &i[3]);
                    let v = b.add(&xc, &xs);
                    if acc {
                        vec![b.add(&o[0], &v)]
                    } else {
                        vec![v]
                    }
                },
            );
        }
        OpKind::SwiGlu => {
            generic(
                f,
                r,
                &[],
                &[(&ins[0], id.clone()), (&ins[1], id.clone())],
                &[(y, id.clone())],
                |b, i, _| {
                    let n = b.op(format!("arith.negf {} : f32", i[0]));
                    let e = b.math("exp", &n);
                    let one = b.c(1.0);
                    let den = b.add(&one, &e);
                    let s = b.div(&i[0], &den);
                    vec![b.mul(&s, &i[1])]
                },
            );
        }
        OpKind::SwiGluGrad => {
            let (dg, du) = (&outs[0], &outs[1]);
            generic(
                f,
                r,
                &[],
                &[
                    (&ins[0], id.clone()),
                    (&ins[1], id.clone()),
                    (&ins[2], id.clone()),
                ],
                &[(dg, id.clone()), (du, id.clone())],
                |b, i, o| {
                    let (g, u, dy) = (&i[0], &i[1], &i[2]);
                    // The fused form: the Rust kernel's `sigmoid_pair` (no `1 - sg`).
                    let (sg, one, om) = if b.fast {
                        let (sg, om) = b.sigmoid_pair(g);
                        (sg, b.c(1.0), om)
                    } else {
                        let sg = b.sigmoid(g);
                        let one = b.c(1.0);
                        let om = b.sub(&one, &sg);
                        (sg, one, om)
                    };
                    let gs = b.mul(g, &sg);
                    let t = b.mul(dy, &gs);
                    let dup = b.add(&o[1], &t);
                    let gom = b.mul(g, &om);
                    let p = b.add(&one, &gom);
                    let q = b.mul(&sg, &p);
                    let du_ = b.mul(dy, u);
                    let t2 = b.mul(&du_, &q);
                    let dgate = b.add(&o[0], &t2);
                    vec![dgate, dup]
                },
            );
        }
        OpKind::GeluTanh | OpKind::GeluTanhGrad => {
            let grad = matches!(op, OpKind::GeluTanhGrad);
            let operands: Vec<(&Arg, Vec<String>)> = ins.iter().map(|a| (a, id.clone())).collect();
            generic(f, r, &[], &operands, &[(y, id.clone())], |b, i, o| {
                let x = &i[0];
                let c1 = b.c(f64::from(0.797_884_6f32));
                let c2 = b.c(f64::from(0.044_715f32));
                let x2 = b.mul(x, x);
                let x3 = b.mul(&x2, x);
                let t = b.mul(&c2, &x3);
                let s = b.add(x, &t);
                let u = b.mul(&c1, &s);
                let two = b.c(2.0);
                let u2 = b.mul(&two, &u);
                // The fused form's gradient: the Rust kernel's `sigmoid_pair` (no `1 - sg`).
                let plain = (!b.fast || !grad).then(|| b.sigmoid(&u2));
                if !grad {
                    let sg = plain.unwrap_or_default();
                    return vec![b.mul(x, &sg)];
                }
                let pair = b.fast.then(|| b.sigmoid_pair(&u2));
                let one = b.c(1.0);
                let three = b.c(3.0);
                let k = b.mul(&three, &c2);
                let kx2 = b.mul(&k, &x2);
                let p = b.add(&one, &kx2);
                let du = b.mul(&c1, &p);
                let (sg, om) = match (pair, plain) {
                    (Some(pair), _) => pair,
                    (None, sg) => {
                        let sg = sg.unwrap_or_default();
                        let om = b.sub(&one, &sg);
                        (sg, om)
                    }
                };
                let tx = b.mul(&two, x);
                let a = b.mul(&tx, &sg);
                let a = b.mul(&a, &om);
                let a = b.mul(&a, &du);
                let g = b.add(&sg, &a);
                let g = b.mul(&i[1], &g);
                vec![b.add(&o[0], &g)]
            });
        }
        OpKind::SigmoidMul => {
            let lead = ds(0..r - 1);
            let mut gm = lead.clone();
            gm.push("0".into());
            generic(
                f,
                r,
                &[],
                &[(&ins[0], gm), (&ins[1], id.clone())],
                &[(y, id.clone())],
                |b, i, _| {
                    let s = b.sigmoid(&i[0]);
                    vec![b.mul(&s, &i[1])]
                },
            );
        }
        OpKind::SigmoidMulGrad if f.fast => ordered::sigmoid_mul_grad(f, &ins, &outs),
        OpKind::SigmoidMulGrad => {
            // (gate[..,1], y[..,h], dout) -> (dgate[..,1], dy)
            let (dgate, dy) = (&outs[0], &outs[1]);
            let r = dy.shape.len();
            let id = ds(0..r);
            let mut gm = ds(0..r - 1);
            gm.push("0".into());
            sigmoid_mul_grad_input(f, &ins, dy);
            generic(
                f,
                r,
                &[r - 1],
                &[
                    (&ins[0], gm.clone()),
                    (&ins[1], id.clone()),
                    (&ins[2], id.clone()),
                ],
                &[(dgate, gm)],
                |b, i, o| {
                    let s = b.sigmoid(&i[0]);
                    let one = b.c(1.0);
                    let om = b.sub(&one, &s);
                    let ds_ = b.mul(&s, &om);
                    let t = b.mul(&i[2], &i[1]);
                    let t = b.mul(&t, &ds_);
                    vec![b.add(&o[0], &t)]
                },
            );
        }
        OpKind::Linear { weight } => {
            // y[..,o] = sum_i x[..,i] w[o,i]; a stacked weight [E.., o, i] pairs its leading
            // dims with x's. loops: lead.., o, i
            let (x, w) = (&ins[0], &ins[1]);
            let lead = r - 1;
            let nb = w.shape.len() - 2;
            if let Some(bias) = ins.get(2) {
                let mut bm = ds(0..bias.shape.len() - 1);
                bm.push(d(lead));
                generic(f, r, &[], &[(bias, bm)], &[(y, id.clone())], |_, i, _| {
                    vec![i[0].clone()]
                });
            } else {
                fill_zero(f, y);
            }
            let (o, i_) = (lead, lead + 1);
            let mut xm = ds(0..lead);
            xm.push(d(i_));
            let wm = weight_map(nb, *weight, o, i_);
            generic(
                f,
                lead + 2,
                &[i_],
                &[(x, xm), (w, wm)],
                &[(y, ds(0..lead + 1))],
                |b, i, o| {
                    let m = b.mul(&i[0], &i[1]);
                    vec![b.add(&o[0], &m)]
                },
            );
        }
        OpKind::LinearGradInput { weight } => {
            // (dy[..,out], w) -> dx[..,in]; loops: lead.., i, o
            let (dyv, w) = (&ins[0], &ins[1]);
            let lead = r - 1;
            let nb = w.shape.len() - 2;
            let (i_, o) = (lead, lead + 1);
            let mut dym = ds(0..lead);
            dym.push(d(o));
            let wm = weight_map(nb, *weight, o, i_);
            generic(
                f,
                lead + 2,
                &[o],
                &[(dyv, dym), (w, wm)],
                &[(y, ds(0..lead + 1))],
                |b, i, o| {
                    let m = b.mul(&i[0], &i[1]);
                    vec![b.add(&o[0], &m)]
                },
            );
        }
        OpKind::LinearGradWeight { weight } => {
            // (x[B..,rows..,in], dy[B..,rows..,out]) -> dw[B..,o,i]; loops: B.., o, i, rows..
            let (x, dyv) = (&ins[0], &ins[1]);
            let nb = y.shape.len() - 2;
            let rows = x.shape.len() - 1 - nb;
            let (o, i_) = (nb, nb + 1);
            let first = nb + 2;
            let mut xm: Vec<String> = ds(0..nb);
            xm.extend(ds(first..first + rows));
            let mut dym = xm.clone();
            xm.push(d(i_));
            dym.push(d(o));
            let wm = weight_map(nb, *weight, o, i_);
            let red: Vec<usize> = (first..first + rows).collect();
            generic(
                f,
                first + rows,
                &red,
                &[(x, xm), (dyv, dym)],
                &[(y, wm)],
                |b, i, o| {
                    let m = b.mul(&i[0], &i[1]);
                    vec![b.add(&o[0], &m)]
                },
            );
        }
        OpKind::BiasGrad => {
            // (dy[..,out]) -> db[out]; loops: o, lead..
            let dyv = &ins[0];
            let lead = dyv.shape.len() - 1;
            let mut dym = ds(1..1 + lead);
            dym.push(d(0));
            let red: Vec<usize> = (1..1 + lead).collect();
            generic(
                f,
                1 + lead,
                &red,
                &[(dyv, dym)],
                &[(y, vec![d(0)])],
                |b, i, o| vec![b.add(&o[0], &i[0])],
            );
        }
        OpKind::PosEmbedding => {
            // (x[b,s,h], wpe[pos,h]) -> x + wpe[0..s]
            let (x, wpe) = (&ins[0], &ins[1]);
            let (s, h) = (x.shape[1], x.shape[2]);
            let wv = subview(f, wpe, &["0".into(), "0".into()], Some(0), &[s, h]);
            generic(
                f,
                3,
                &[],
                &[(x, ds(0..3)), (&wv, vec![d(1), d(2)])],
                &[(y, ds(0..3))],
                |b, i, _| vec![b.add(&i[0], &i[1])],
            );
        }
        OpKind::PosEmbeddingGrad => {
            // (wpe, dy[b,s,h]) -> dwpe[0..s] += sum over b; loops: s, h, b
            let dyv = &ins[1];
            let (s, h) = (dyv.shape[1], dyv.shape[2]);
            let dv = subview(f, y, &["0".into(), "0".into()], Some(0), &[s, h]);
            generic(
                f,
                3,
                &[2],
                &[(dyv, vec![d(2), d(0), d(1)])],
                &[(&dv, vec![d(0), d(1)])],
                |b, i, o| vec![b.add(&o[0], &i[0])],
            );
        }
        OpKind::RepeatKvGrad { n } => {
            // dx[b,s,kv,d] += sum_r dy[b,s,kv*n+r,d]
            let dyv = &ins[0];
            let dy5 = expand(f, dyv, 2, y.shape[2], *n);
            generic(
                f,
                5,
                &[3],
                &[(&dy5, ds(0..5))],
                &[(y, vec![d(0), d(1), d(2), d(4)])],
                |b, i, o| vec![b.add(&o[0], &i[0])],
            );
        }
        OpKind::RmsNorm { eps } | OpKind::RmsNormGrad { eps } if f.fast => {
            let grad = matches!(op, OpKind::RmsNormGrad { .. });
            ordered::rms_norm(f, grad, *eps as f32, &ins, &outs);
        }
        OpKind::LayerNorm { eps } if f.fast => ordered::layer_norm(f, *eps as f32, &ins, &outs),
        OpKind::RmsNorm { eps } | OpKind::RmsNormGrad { eps } => {
            let (x, w) = (&ins[0], &ins[1]);
            let rr = x.shape.len();
            let h = x.shape[rr - 1];
            let lead = ds(0..rr - 1);
            let xid = ds(0..rr);
            let (ss, ss_ty) = f.alloc(&x.shape[..rr - 1], "f32");
            let ssa = Arg {
                name: ss.clone(),
                ty: ss_ty.clone(),
                dtype: DType::F32,
                shape: x.shape[..rr - 1].to_vec(),
                wide: false,
            };
            fill_zero(f, &ssa);
            generic(
                f,
                rr,
                &[rr - 1],
                &[(x, xid.clone())],
                &[(&ssa, lead.clone())],
                |b, i, o| {
                    let sq = b.mul(&i[0], &i[0]);
                    vec![b.add(&o[0], &sq)]
                },
            );
            // rstd = rsqrt(ss / h + eps), in place.
            let (hf, epsf) = (h as f64, f64::from(*eps as f32));
            generic(f, rr - 1, &[], &[], &[(&ssa, ds(0..rr - 1))], |b, _, o| {
                let hc = b.c(hf);
                let m = b.div(&o[0], &hc);
                let e = b.c(epsf);
                let a = b.add(&m, &e);
                vec![b.math("rsqrt", &a)]
            });
            if matches!(op, OpKind::RmsNorm { .. }) {
                generic(
                    f,
                    rr,
                    &[],
                    &[(x, xid.clone()), (&ssa, lead.clone()), (w, vec![d(rr - 1)])],
                    &[(y, xid.clone())],
                    |b, i, _| {
                        let t = b.mul(&i[0], &i[1]);
                        vec![b.mul(&i[2], &t)]
                    },
                );
            } else {
                // dx += rstd * (dy*w - x * rstd² * mean(dy*w*x)); dw += sum_rows dy*x*rstd
                let dyv = &ins[2];
                let (dx, dw) = (&outs[0], &outs[1]);
                let (c, c_ty) = f.alloc(&x.shape[..rr - 1], "f32");
                let ca = Arg {
                    name: c.clone(),
                    ty: c_ty.clone(),
                    dtype: DType::F32,
                    shape: x.shape[..rr - 1].to_vec(),
                    wide: false,
                };
                fill_zero(f, &ca);
                generic(
                    f,
                    rr,
                    &[rr - 1],
                    &[(x, xid.clone()), (w, vec![d(rr - 1)]), (dyv, xid.clone())],
                    &[(&ca, lead.clone())],
                    |b, i, o| {
                        let t = b.mul(&i[2], &i[1]);
                        let t = b.mul(&t, &i[0]);
                        vec![b.add(&o[0], &t)]
                    },
                );
                generic(
                    f,
                    rr,
                    &[],
                    &[
                        (x, xid.clone()),
                        (w, vec![d(rr - 1)]),
                        (dyv, xid.clone()),
                        (&ssa, lead.clone()),
                        (&ca, lead.clone()),
                    ],
                    &[(dx, xid.clone())],
                    |b, i, o| {
                        let (xv, wv, dyv, rs, cv) = (&i[0], &i[1], &i[2], &i[3], &i[4]);
                        let hc = b.c(hf);
                        let mean = b.div(cv, &hc);
                        let r2 = b.mul(rs, rs);
                        let t = b.mul(xv, &r2);
                        let t = b.mul(&t, &mean);
                        let g = b.mul(dyv, wv);
                        let g = b.sub(&g, &t);
                        let g = b.mul(rs, &g);
                        vec![b.add(&o[0], &g)]
                    },
                );
                // loops: h, rows.. (reduction)
                let mut rows_m = ds(1..rr);
                rows_m.push(d(0));
                let (ss_m, dw_m, red): (Vec<String>, Vec<String>, Vec<usize>) =
                    (ds(1..rr), vec![d(0)], (1..rr).collect());
                generic(
                    f,
                    rr,
                    &red,
                    &[(x, rows_m.clone()), (dyv, rows_m), (&ssa, ss_m)],
                    &[(dw, dw_m)],
                    |b, i, o| {
                        let t = b.mul(&i[0], &i[2]);
                        let t = b.mul(&i[1], &t);
                        vec![b.add(&o[0], &t)]
                    },
                );
                f.line(format!("memref.dealloc {c} : {c_ty}"));
            }
            f.line(format!("memref.dealloc {ss} : {ss_ty}"));
        }
        OpKind::LayerNorm { eps } => {
            let (x, w, bias) = (&ins[0], &ins[1], &ins[2]);
            let rr = x.shape.len();
            let h = x.shape[rr - 1] as f64;
            let lead = ds(0..rr - 1);
            let xid = ds(0..rr);
            let rows = x.shape[..rr - 1].to_vec();
            let stat = |f: &mut Func| {
                let (n, t) = f.alloc(&rows, "f32");
                let a = Arg {
                    name: n,
                    ty: t,
                    dtype: DType::F32,
                    shape: rows.clone(),
                    wide: false,
                };
                fill_zero(f, &a);
                a
            };
            let mean = stat(f);
            let var = stat(f);
            generic(
                f,
                rr,
                &[rr - 1],
                &[(x, xid.clone())],
                &[(&mean, lead.clone())],
                |b, i, o| vec![b.add(&o[0], &i[0])],
            );
            generic(f, rr - 1, &[], &[], &[(&mean, ds(0..rr - 1))], |b, _, o| {
                let hc = b.c(h);
                vec![b.div(&o[0], &hc)]
            });
            generic(
                f,
                rr,
                &[rr - 1],
                &[(x, xid.clone()), (&mean, lead.clone())],
                &[(&var, lead.clone())],
                |b, i, o| {
                    let c = b.sub(&i[0], &i[1]);
                    let sq = b.mul(&c, &c);
                    vec![b.add(&o[0], &sq)]
                },
            );
            let epsf = f64::from(*eps as f32);
            generic(f, rr - 1, &[], &[], &[(&var, ds(0..rr - 1))], |b, _, o| {
                let hc = b.c(h);
                let m = b.div(&o[0], &hc);
                let e = b.c(epsf);
                let a = b.add(&m, &e);
                vec![b.math("rsqrt", &a)]
            });
            generic(
                f,
                rr,
                &[],
                &[
                    (x, xid.clone()),
                    (&mean, lead.clone()),
                    (&var, lead.clone()),
                    (w, vec![d(rr - 1)]),
                    (bias, vec![d(rr - 1)]),
                ],
                &[(y, xid.clone())],
                |b, i, _| {
                    let c = b.sub(&i[0], &i[1]);
                    let n = b.mul(&c, &i[2]);
                    let s = b.mul(&n, &i[3]);
                    vec![b.add(&s, &i[4])]
                },
            );
            for a in [mean, var] {
                f.line(format!("memref.dealloc {} : {}", a.name, a.ty));
            }
        }
        // `lowered` lists only the ops handled here.
        _ => {
            unstage(f, st);
            return None;
        }
    }
    unstage(f, st);
    Some(())
}

/// The input gradient of `sigmoid_mul` (`ins` gate `[.., 1]`, x, dy): `dx += sigmoid(gate) · dy`,
/// element by element (both forms of `sigmoid_mul_grad` share it).
fn sigmoid_mul_grad_input(f: &mut Func, ins: &[Arg], dx: &Arg) {
    let r = dx.shape.len();
    let id = ds(0..r);
    let mut gm = ds(0..r - 1);
    gm.push("0".into());
    generic(
        f,
        r,
        &[],
        &[(&ins[0], gm), (&ins[2], id.clone())],
        &[(dx, id)],
        |b, i, o| {
            let s = b.sigmoid(&i[0]);
            let t = b.mul(&s, &i[1]);
            vec![b.add(&o[0], &t)]
        },
    );
}
