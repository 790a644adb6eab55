//! The MLIR source text of one function: SSA names, hoisted constants, and a view of each
//! plan buffer into its arena argument (`memref.view` at the buffer's byte offset).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use megac_ir::plan::{BufId, Buffer, BufferClass, Plan, RankOffset};
use megac_ir::types::DType;

/// MLIR's name of an element type.
pub(crate) fn elem(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::Bf16 => "bf16",
        DType::F16 => "f16",
        DType::I32 => "i32",
    }
}

/// `memref<2x3xf32>` (`memref<f32>` for a scalar).
pub(crate) fn memref_ty(shape: &[u64], d: &str) -> String {
    let mut s = String::from("memref<");
    for n in shape {
        let _ = write!(s, "{n}x");
    }
    s.push_str(d);
    s.push('>');
    s
}

/// An f64 as an MLIR float literal (always with a decimal point or exponent).
pub(crate) fn float_lit(x: f64) -> String {
    if x.is_finite() {
        let s = format!("{x:e}");
        // `1e0` is not a float literal in MLIR; `1.0e0` is.
        match s.split_once('e') {
            Some((m, e)) if !m.contains('.') => format!("{m}.0e{e}"),
            _ => s,
        }
    } else if x.is_nan() {
        "0x7FC00000".into()
    } else if x > 0.0 {
        "0x7F800000".into()
    } else {
        "0xFF800000".into()
    }
}

/// A buffer seen as a memref: its SSA name, type, element type and shape.
#[derive(Clone, Debug)]
pub(crate) struct View {
    /// SSA name (`%v12`).
    pub name: String,
    /// The memref type.
    pub ty: String,
    /// Element type.
    pub dtype: DType,
    /// Static shape.
    pub shape: Vec<u64>,
}

/// What a function takes besides its arenas: the rank's index in a group (for buffers with
/// a rank-dependent offset, and `slice`) and the byte offset of a pipeline chunk's slot.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Extra {
    /// The rank's position in its group over these axes (comma-joined names).
    RankIndex(String),
    /// The byte offset, in the activation arena, of the slot chunk `c` runs in.
    Slot(u32),
}

/// One function under construction.
pub(crate) struct Func<'p> {
    pub plan: &'p Plan,
    /// Arena sizes in bytes, by class index.
    pub arena_bytes: [u64; 5],
    /// The body's lines (indented by the caller).
    pub lines: Vec<String>,
    next: usize,
    consts: BTreeMap<String, String>,
    views: BTreeMap<BufId, View>,
    /// Extra arguments used, in first-use order of their names.
    pub extras: BTreeMap<Extra, String>,
    /// Runtime symbols called: name -> argument types.
    pub decls: &'p mut BTreeMap<String, Vec<String>>,
    /// Sequence number of the next collective (its tag).
    pub collectives: &'p mut u64,
    /// Buffer-argument mode (fused kernels): each buffer is an argument of its own, a
    /// rank-1 memref of its elements, instead of a view of an arena; the buffers in
    /// first-use order.
    pub buffer_args: Option<Vec<BufId>>,
    /// Buffers whose `zero` is deferred (fused kernels): a `linalg.generic` that writes one
    /// of them elementwise as its output uses 0 for its old value; any other use zeroes it
    /// first ([`Func::materialize`]).
    pub fresh: BTreeMap<String, View>,
    /// The fused-kernel form (set by [`super::fused_source`]): `exp` as the Rust kernels'
    /// polynomial, and the norms' row sums and weight gradients, the activation gradients
    /// and the MoE gate's gradient in the Rust kernels' operations and order.
    pub fast: bool,
    /// Buffer-argument mode: the buffers of rank 2 or more hold `1 / split` of their rows
    /// (a row range of a group split over threads, `crate::fuse::split_rows`); 1 otherwise.
    pub split: u64,
    /// The function takes the per-step scalars of a fused AdamW as its last argument,
    /// `%sc: memref<8xf32>` (set by its lowering).
    pub scalars: bool,
    /// Module-level constants (fused kernels: RoPE's cos and sin tables), as
    /// `memref.global` lines, in first-use order.
    pub globals: Vec<String>,
}

/// The classes in arena-argument order.
pub(crate) const CLASSES: [BufferClass; 5] = [
    BufferClass::Param,
    BufferClass::Grad,
    BufferClass::OptState,
    BufferClass::Activation,
    BufferClass::Input,
];

/// The SSA name of arena argument `class`.
pub(crate) fn arena_arg(class: BufferClass) -> String {
    format!("%arena_{}", class.name())
}

impl<'p> Func<'p> {
    pub fn new(
        plan: &'p Plan,
        arena_bytes: [u64; 5],
        decls: &'p mut BTreeMap<String, Vec<String>>,
        collectives: &'p mut u64,
    ) -> Func<'p> {
        Func {
            plan,
            arena_bytes,
            lines: Vec::new(),
            next: 0,
            consts: BTreeMap::new(),
            views: BTreeMap::new(),
            extras: BTreeMap::new(),
            decls,
            collectives,
            buffer_args: None,
            fresh: BTreeMap::new(),
            fast: false,
            split: 1,
            scalars: false,
            globals: Vec::new(),
        }
    }

    /// Zero buffer view `v` now if its `zero` was deferred.
    pub fn materialize(&mut self, name: &str) {
        if let Some(v) = self.fresh.remove(name) {
            let z = self.zero(v.dtype);
            self.line(format!(
                "linalg.fill ins({z} : {}) outs({} : {})",
                elem(v.dtype),
                v.name,
                v.ty
            ));
        }
    }

    /// A fresh SSA name.
    pub fn fresh(&mut self, stem: &str) -> String {
        self.next += 1;
        format!("%{stem}{}", self.next)
    }

    /// Append a line to the body.
    pub fn line(&mut self, s: impl Into<String>) {
        self.lines.push(s.into());
    }

    /// An `index` constant.
    pub fn index(&mut self, n: u64) -> String {
        self.constant(&n.to_string(), "index")
    }

    /// A constant of type `ty` written `lit` (hoisted and shared within the function).
    pub fn constant(&mut self, lit: &str, ty: &str) -> String {
        let key = format!("{lit}:{ty}");
        if let Some(n) = self.consts.get(&key) {
            return n.clone();
        }
        let name = self.fresh("c");
        self.line(format!("{name} = arith.constant {lit} : {ty}"));
        self.consts.insert(key, name.clone());
        name
    }

    /// The zero of element type `d`.
    pub fn zero(&mut self, d: DType) -> String {
        match d {
            DType::I32 => self.constant("0", "i32"),
            _ => self.constant("0.0", elem(d)),
        }
    }

    /// An extra argument's SSA name.
    fn extra(&mut self, e: Extra) -> String {
        let n = self.extras.len();
        self.extras
            .entry(e)
            .or_insert_with(|| format!("%x{n}"))
            .clone()
    }

    /// The rank's index in its group over `axes` (an `index` argument).
    pub fn rank_index(&mut self, axes: &[megac_ir::types::Axis]) -> String {
        let names: Vec<&str> = axes.iter().map(|a| a.as_str()).collect();
        self.extra(Extra::RankIndex(names.join(",")))
    }

    fn rank_offset_index(&mut self, r: &RankOffset) -> String {
        self.rank_index(&r.axes())
    }

    /// `a * b + c` on `index` values (`b`, `c` constants).
    pub fn mul_add(&mut self, a: &str, b: u64, c: u64) -> String {
        let bn = self.index(b);
        let m = self.fresh("i");
        self.line(format!("{m} = arith.muli {a}, {bn} : index"));
        if c == 0 {
            return m;
        }
        let cn = self.index(c);
        let s = self.fresh("i");
        self.line(format!("{s} = arith.addi {m}, {cn} : index"));
        s
    }

    /// The view of buffer `id`: `memref.view` of its arena at its byte offset (plus the
    /// rank-dependent part and the chunk slot's offset, both arguments).
    pub fn view(&mut self, id: BufId) -> View {
        if let Some(v) = self.views.get(&id) {
            return v.clone();
        }
        let b: &Buffer = &self.plan.buffers[id as usize];
        if let Some(args) = self.buffer_args.as_mut() {
            let k = args.len();
            args.push(id);
            let mut shape = b.shape.clone();
            if shape.len() >= 2 {
                shape[0] /= self.split;
            }
            let ty = memref_ty(&shape, elem(b.dtype));
            let flat = memref_ty(&[shape.iter().product()], elem(b.dtype));
            let arg = format!("%a{k}");
            let (name, dtype) = (self.fresh("b"), b.dtype);
            let dims: Vec<String> = shape.iter().map(|n| n.to_string()).collect();
            if shape.is_empty() {
                self.line(format!(
                    "{name} = memref.collapse_shape {arg} [] : {flat} into {ty}"
                ));
            } else {
                let all: Vec<String> = (0..shape.len()).map(|d| d.to_string()).collect();
                self.line(format!(
                    "{name} = memref.expand_shape {arg} [[{}]] output_shape [{}] : {flat} into {ty}",
                    all.join(", "),
                    dims.join(", ")
                ));
            }
            let v = View {
                name,
                ty,
                dtype,
                shape,
            };
            self.views.insert(id, v.clone());
            return v;
        }
        let size = b.dtype.size_bytes();
        let mut shift = match &b.rank_offset {
            None => self.index(b.offset * size),
            Some(r) => {
                let idx = self.rank_offset_index(r);
                self.mul_add(&idx, r.stride * size, b.offset * size)
            }
        };
        if let Some(c) = b.chunk {
            let slot = self.extra(Extra::Slot(c));
            let s = self.fresh("i");
            self.line(format!("{s} = arith.addi {slot}, {shift} : index"));
            shift = s;
        }
        let ty = memref_ty(&b.shape, elem(b.dtype));
        let name = self.fresh("b");
        let arena = arena_arg(b.class);
        let arena_ty = memref_ty(&[self.arena_bytes[b.class.index()]], "i8");
        self.line(format!(
            "{name} = memref.view {arena}[{shift}][] : {arena_ty} to {ty}"
        ));
        let v = View {
            name,
            ty,
            dtype: b.dtype,
            shape: b.shape.clone(),
        };
        self.views.insert(id, v.clone());
        v
    }

    /// A `func.call` of runtime symbol `stem` (suffixed with its operands' element types) on
    /// `views` as unranked memrefs, with `attrs` (`key = value` MLIR attribute text).
    pub fn call(&mut self, stem: &str, views: &[View], attrs: &[(String, String)]) {
        let mut args = Vec::new();
        let mut tys = Vec::new();
        for v in views {
            let uty = format!("memref<*x{}>", elem(v.dtype));
            let c = self.fresh("u");
            self.line(format!("{c} = memref.cast {} : {} to {uty}", v.name, v.ty));
            args.push(c);
            tys.push(uty);
        }
        let mut dts: Vec<&str> = views.iter().map(|v| elem(v.dtype)).collect();
        if dts.windows(2).all(|w| w[0] == w[1]) {
            dts.truncate(1);
        }
        let name = if dts.is_empty() {
            stem.to_string()
        } else {
            format!("{stem}.{}", dts.join("_"))
        };
        self.decls.insert(name.clone(), tys.clone());
        let attr_text: Vec<String> = attrs.iter().map(|(k, v)| format!("{k} = {v}")).collect();
        self.line(format!(
            "func.call @\"{name}\"({}) {{{}}} : ({}) -> ()",
            args.join(", "),
            attr_text.join(", "),
            tys.join(", ")
        ));
    }

    /// A temporary memref (`memref.alloc`).
    pub fn alloc(&mut self, shape: &[u64], d: &str) -> (String, String) {
        let ty = memref_ty(shape, d);
        let n = self.fresh("t");
        self.line(format!("{n} = memref.alloc() : {ty}"));
        (n, ty)
    }
}

/// An MLIR string attribute.
pub(crate) fn str_attr(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\{:02X}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
