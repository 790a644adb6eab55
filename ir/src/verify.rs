//! The verifier: structural invariants every pass must keep.
//!
//! - every value is defined exactly once, and an op's results point back at it;
//! - every operand is defined before the op that uses it (so the def-use graph has no cycle);
//! - every recorded type equals what shape inference derives from the operands;
//! - layouts cover each dim, dim names are unique within a type, parameter names are unique;
//! - every op has a provenance path, and every graph output exists.
//!
//! Like Cranelift's verifier, [`verify`] does not stop at the first broken invariant: it
//! returns every one it finds, each a typed [`VerifyError`] naming its op or value. An op
//! whose operands or results are broken is not type-checked (its types cannot be read).

use std::collections::HashSet;
use std::fmt;

use crate::graph::{Graph, Op, OpId, ValueDef, ValueId};
use crate::infer::infer_types;
use crate::types::TensorType;

/// An op as an error names it: its id, kind and provenance path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpRef {
    /// The op's index in the op arena.
    pub id: OpId,
    /// The op kind's name (`linear`, `rms_norm`, ...).
    pub kind: &'static str,
    /// The op's provenance path (empty when missing).
    pub path: String,
}

impl OpRef {
    fn of(id: usize, op: &Op) -> Self {
        OpRef {
            id: OpId(id as u32),
            kind: op.kind.name(),
            path: op.path.clone(),
        }
    }
}

impl fmt::Display for OpRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "op {} `{}` ({})", self.id.0, self.kind, self.path)
    }
}

/// One broken invariant, naming the op or value it is about.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// A value's layout does not cover exactly its dims.
    #[error("%{}: layout covers {covered} dims but the type has {dims}", value.0)]
    LayoutRank {
        /// The value.
        value: ValueId,
        /// Dims the layout covers.
        covered: usize,
        /// Dims the type has.
        dims: usize,
    },
    /// A dim name appears twice in one value's type.
    #[error("%{}: dim name `{dim}` repeats in {ty}", value.0)]
    RepeatedDim {
        /// The value.
        value: ValueId,
        /// The repeated dim name.
        dim: String,
        /// The value's dtype and shape, as printed.
        ty: String,
    },
    /// Two inputs or parameters share a name.
    #[error("%{}: name \"{name}\" is declared twice", value.0)]
    DuplicateParam {
        /// The later of the two declarations.
        value: ValueId,
        /// The shared name.
        name: String,
    },
    /// A value claims to be defined by an op that does not exist.
    #[error("%{}: defined by a missing op {}", value.0, op.0)]
    MissingDefiningOp {
        /// The value.
        value: ValueId,
        /// The op it names.
        op: OpId,
    },
    /// A value claims to be result `index` of an op that does not list it there.
    #[error("%{}: op {} does not list it as result {index}", value.0, op.0)]
    NotListedAsResult {
        /// The value.
        value: ValueId,
        /// The op it names.
        op: OpId,
        /// The result index it claims.
        index: usize,
    },
    /// An op has no provenance path.
    #[error("{op}: no provenance path")]
    MissingProvenance {
        /// The op.
        op: OpRef,
    },
    /// An op reads a value that does not exist or is defined later.
    #[error("{op}: operand %{} is not defined before use", value.0)]
    UndefinedValue {
        /// The op.
        op: OpRef,
        /// The operand.
        value: ValueId,
    },
    /// An op lists a result whose definition names another op (or index), or no value.
    #[error("{op}: result %{} does not point back at it", value.0)]
    ResultNotOwned {
        /// The op.
        op: OpRef,
        /// The result.
        value: ValueId,
    },
    /// A value is the result of more than one op (or also an input or parameter).
    #[error("{op}: result %{} is defined twice", value.0)]
    DefinedTwice {
        /// The second definer.
        op: OpRef,
        /// The result.
        value: ValueId,
    },
    /// Shape inference rejects an op's operands.
    #[error("{op}: {message}")]
    Inference {
        /// The op.
        op: OpRef,
        /// What inference says.
        message: String,
    },
    /// An op records a different number of results than inference derives.
    #[error("{op}: {recorded} results recorded, {inferred} inferred")]
    ResultCount {
        /// The op.
        op: OpRef,
        /// Results the op lists.
        recorded: usize,
        /// Results inference derives.
        inferred: usize,
    },
    /// A result's recorded dtype or shape differs from what its operands give.
    #[error("{op}: result %{} is {found} but its operands give {expected}", value.0)]
    TypeMismatch {
        /// The op.
        op: OpRef,
        /// The result.
        value: ValueId,
        /// What inference derives, as printed.
        expected: String,
        /// What the graph records, as printed.
        found: String,
    },
    /// A graph output names a value that does not exist or is never defined.
    #[error("output \"{name}\" refers to undefined %{}", value.0)]
    UndefinedOutput {
        /// The output's name.
        name: String,
        /// The value it names.
        value: ValueId,
    },
}

/// Every invariant a graph breaks, in the order the verifier finds them (never empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyErrors(pub Vec<VerifyError>);

impl VerifyErrors {
    /// The errors, in order.
    pub fn errors(&self) -> &[VerifyError] {
        &self.0
    }
}

impl fmt::Display for VerifyErrors {
    /// The errors joined by `; ` (one line), prefixed by their count when more than one.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.len() > 1 {
            write!(f, "{} errors: ", self.0.len())?;
        }
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for VerifyErrors {}

/// Check `graph`; the error lists every broken invariant.
pub fn verify(graph: &Graph) -> Result<(), VerifyErrors> {
    let mut errors = Vec::new();
    let n_values = graph.values.len();
    let mut defined = vec![false; n_values];
    // Values whose own type is broken: an op reading them is not type-checked.
    let mut bad_type = vec![false; n_values];
    let mut names = HashSet::new();
    for (i, v) in graph.values.iter().enumerate() {
        let value = ValueId(i as u32);
        let before = errors.len();
        check_type(value, &v.ty, &mut errors);
        bad_type[i] = errors.len() > before;
        match &v.def {
            ValueDef::Input(name) | ValueDef::Param(name) => {
                if !names.insert(name.as_str()) {
                    errors.push(VerifyError::DuplicateParam {
                        value,
                        name: name.clone(),
                    });
                }
                defined[i] = true;
            }
            ValueDef::Op(op, k) => match graph.ops.get(op.0 as usize) {
                None => errors.push(VerifyError::MissingDefiningOp { value, op: *op }),
                Some(owner) if owner.outputs.get(*k) != Some(&value) => {
                    errors.push(VerifyError::NotListedAsResult {
                        value,
                        op: *op,
                        index: *k,
                    })
                }
                Some(_) => {}
            },
        }
    }

    for (i, op) in graph.ops.iter().enumerate() {
        let here = || OpRef::of(i, op);
        if op.path.is_empty() {
            errors.push(VerifyError::MissingProvenance { op: here() });
        }
        // Types are read only when every operand and result is sound.
        let mut sound = true;
        for &v in &op.inputs {
            let vi = v.0 as usize;
            if vi >= n_values || !defined[vi] {
                errors.push(VerifyError::UndefinedValue {
                    op: here(),
                    value: v,
                });
                sound = false;
                continue;
            }
            sound &= !bad_type[vi];
        }
        for (k, &v) in op.outputs.iter().enumerate() {
            let vi = v.0 as usize;
            if vi >= n_values || graph.values[vi].def != ValueDef::Op(OpId(i as u32), k) {
                errors.push(VerifyError::ResultNotOwned {
                    op: here(),
                    value: v,
                });
                sound = false;
                continue;
            }
            sound &= !bad_type[vi];
            if defined[vi] {
                errors.push(VerifyError::DefinedTwice {
                    op: here(),
                    value: v,
                });
                continue;
            }
            defined[vi] = true;
        }
        if sound {
            check_op_types(graph, i, op, &mut errors);
        }
    }
    for (name, v) in &graph.outputs {
        if (v.0 as usize) >= n_values || !defined[v.0 as usize] {
            errors.push(VerifyError::UndefinedOutput {
                name: name.clone(),
                value: *v,
            });
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(VerifyErrors(errors))
    }
}

/// Compare op `i`'s recorded result types with what inference derives from its operands.
fn check_op_types(graph: &Graph, i: usize, op: &Op, errors: &mut Vec<VerifyError>) {
    let ins: Vec<&TensorType> = op.inputs.iter().map(|&v| graph.ty(v)).collect();
    let want = match infer_types(&op.kind, &ins) {
        Ok(want) => want,
        Err(message) => {
            errors.push(VerifyError::Inference {
                op: OpRef::of(i, op),
                message,
            });
            return;
        }
    };
    if want.len() != op.outputs.len() {
        errors.push(VerifyError::ResultCount {
            op: OpRef::of(i, op),
            recorded: op.outputs.len(),
            inferred: want.len(),
        });
        return;
    }
    for (&v, w) in op.outputs.iter().zip(&want) {
        let got = graph.ty(v);
        if got.dtype != w.dtype || got.dims != w.dims {
            errors.push(VerifyError::TypeMismatch {
                op: OpRef::of(i, op),
                value: v,
                expected: w.dtype_shape(),
                found: got.dtype_shape(),
            });
        }
    }
}

fn check_type(value: ValueId, ty: &TensorType, errors: &mut Vec<VerifyError>) {
    if ty.layout.shards.len() != ty.dims.len() {
        errors.push(VerifyError::LayoutRank {
            value,
            covered: ty.layout.shards.len(),
            dims: ty.dims.len(),
        });
    }
    let mut seen = HashSet::new();
    for d in &ty.dims {
        if !seen.insert(d.name.as_str()) {
            errors.push(VerifyError::RepeatedDim {
                value,
                dim: d.name.clone(),
                ty: ty.dtype_shape(),
            });
        }
    }
}
