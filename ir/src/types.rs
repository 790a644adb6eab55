//! Value types: dtypes, named-dim shapes and layouts over the device mesh.

use std::fmt;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// bfloat16 (8 exponent bits, 8 significant bits).
    Bf16,
    /// IEEE half precision (5 exponent bits, 11 significant bits).
    F16,
    /// 32-bit signed integer (token ids, expert indices).
    I32,
}

impl DType {
    /// Textual name used by the printer and parser.
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
        }
    }

    /// Parse the textual name.
    pub fn from_name(s: &str) -> Option<DType> {
        match s {
            "f32" => Some(DType::F32),
            "bf16" => Some(DType::Bf16),
            "f16" => Some(DType::F16),
            "i32" => Some(DType::I32),
            _ => None,
        }
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }

    /// Whether this is a 16-bit float (a mixed-precision storage type: values are
    /// computed in f32 and rounded once when stored).
    pub fn is_half(self) -> bool {
        matches!(self, DType::Bf16 | DType::F16)
    }
}

/// One named dimension, e.g. `s=2048` or `tokens<=512` (a dynamic size with an upper bound).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Dim {
    /// Name (`b`, `s`, `h`, `heads`, `head_dim`, `ffn`, `vocab`, `experts`, `heads*head_dim`, ...).
    pub name: String,
    /// Size, or the upper bound of a dynamic size.
    pub size: u64,
    /// The size is only known at run time (MoE token counts); `size` bounds it.
    pub dynamic: bool,
}

impl Dim {
    /// A static dimension.
    pub fn new(name: impl Into<String>, size: u64) -> Dim {
        Dim {
            name: name.into(),
            size,
            dynamic: false,
        }
    }

    /// A dynamic dimension bounded by `bound`.
    pub fn dynamic(name: impl Into<String>, bound: u64) -> Dim {
        Dim {
            name: name.into(),
            size: bound,
            dynamic: true,
        }
    }
}

/// An axis of the device mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Axis {
    /// Tensor parallel.
    Tp,
    /// Context parallel.
    Cp,
    /// Expert parallel.
    Ep,
    /// Data parallel.
    Dp,
    /// Pipeline parallel.
    Pp,
    /// Forward/backward decoupling (MegaFBD): coordinate 0 runs a stage's backward role
    /// (recompute, backward, optimizer), 1 its forward role. Outermost; size 2 with
    /// `parallel.fbd = true`, absent otherwise; not part of `parallel.order`.
    Fbd,
    /// Expert data parallel: the ranks of a dp·cp group that hold the same experts (its
    /// members differ only in their expert-parallel partners; see [`crate::Mesh`]). Derived
    /// from the mesh, never part of the rank order.
    Edp,
}

impl Axis {
    /// All axes in Megatron's default rank order (`tp-cp-ep-dp-pp`).
    pub const ALL: [Axis; 5] = [Axis::Tp, Axis::Cp, Axis::Ep, Axis::Dp, Axis::Pp];

    /// Textual name.
    pub fn as_str(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Cp => "cp",
            Axis::Ep => "ep",
            Axis::Dp => "dp",
            Axis::Pp => "pp",
            Axis::Fbd => "fbd",
            Axis::Edp => "edp",
        }
    }

    /// Parse the textual name.
    pub fn from_name(s: &str) -> Option<Axis> {
        Axis::ALL
            .into_iter()
            .chain([Axis::Fbd, Axis::Edp])
            .find(|a| a.as_str() == s)
    }
}

/// How a value is laid out over the mesh: per dim the axes it is sharded over
/// (empty = replicated along that dim), plus the axes over which it is a pending sum.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Layout {
    /// For each dim of the shape, the mesh axes that shard it, outermost first.
    pub shards: Vec<Vec<Axis>>,
    /// Axes over which each rank holds a partial sum (Partial(axis)).
    pub partial: Vec<Axis>,
}

impl Layout {
    /// The fully replicated layout of a value of `rank` dims.
    pub fn replicated(rank: usize) -> Layout {
        Layout {
            shards: vec![Vec::new(); rank],
            partial: Vec::new(),
        }
    }

    /// True when no dim is sharded and no sum is pending.
    pub fn is_replicated(&self) -> bool {
        self.partial.is_empty() && self.shards.iter().all(Vec::is_empty)
    }
}

/// The type of a value: dtype, shape and layout.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Named dims, outermost first; empty for a scalar.
    pub dims: Vec<Dim>,
    /// Layout over the mesh.
    pub layout: Layout,
}

impl TensorType {
    /// A replicated tensor type.
    pub fn new(dtype: DType, dims: Vec<Dim>) -> TensorType {
        let layout = Layout::replicated(dims.len());
        TensorType {
            dtype,
            dims,
            layout,
        }
    }

    /// A replicated scalar.
    pub fn scalar(dtype: DType) -> TensorType {
        TensorType::new(dtype, Vec::new())
    }

    /// Number of elements (upper bound for dynamic dims).
    pub fn numel(&self) -> u64 {
        self.dims.iter().fold(1u64, |n, d| n.saturating_mul(d.size))
    }

    /// Size in bytes (upper bound for dynamic dims).
    pub fn size_bytes(&self) -> u64 {
        self.numel().saturating_mul(self.dtype.size_bytes())
    }

    /// The sizes of the dims.
    pub fn sizes(&self) -> Vec<u64> {
        self.dims.iter().map(|d| d.size).collect()
    }

    /// The last dim; panics on scalars, so callers check the rank first.
    pub fn last(&self) -> &Dim {
        &self.dims[self.dims.len() - 1]
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sep = if self.dynamic { "<=" } else { "=" };
        write!(f, "{}{}{}", self.name, sep, self.size)
    }
}

impl Layout {
    /// Render with the dim names of `dims`: `{R}`, or e.g. `{b:dp, h:tp, partial:tp}`.
    pub fn render(&self, dims: &[Dim]) -> String {
        if self.is_replicated() {
            return "{R}".to_string();
        }
        let mut parts = Vec::new();
        for (axes, dim) in self.shards.iter().zip(dims) {
            if !axes.is_empty() {
                let names: Vec<&str> = axes.iter().map(|a| a.as_str()).collect();
                parts.push(format!("{}:{}", dim.name, names.join("+")));
            }
        }
        if !self.partial.is_empty() {
            let names: Vec<&str> = self.partial.iter().map(|a| a.as_str()).collect();
            parts.push(format!("partial:{}", names.join("+")));
        }
        format!("{{{}}}", parts.join(", "))
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.dims.iter().map(Dim::to_string).collect();
        write!(
            f,
            "{}[{}] {}",
            self.dtype.as_str(),
            dims.join(", "),
            self.layout.render(&self.dims)
        )
    }
}
