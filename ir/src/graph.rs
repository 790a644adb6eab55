//! The Graph IR (level 2): one training step on the global view, as arenas of values and ops.
//!
//! Values and ops live in vectors and are referred to by index (`ValueId`, `OpId`), as in
//! naga and Cranelift. Ops are kept in a valid execution order; the verifier checks it.

use crate::infer::infer_types;
use crate::mesh::Mesh;
use crate::op::OpKind;
use crate::types::TensorType;
use crate::IrError;

/// Index of a value in `Graph::values`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

/// Index of an op in `Graph::ops`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u32);

/// Where a value comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum ValueDef {
    /// A graph input fed by the data loader (`tokens`, `labels`).
    Input(String),
    /// A trainable parameter, named as Hugging Face transformers names it.
    Param(String),
    /// Output `index` of an op.
    Op(OpId, usize),
}

/// A value: its type and its definition.
#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    /// Dtype, shape and layout.
    pub ty: TensorType,
    /// Definition.
    pub def: ValueDef,
}

/// An op: what it computes, its operands and results, and where in the model it comes from.
#[derive(Clone, Debug, PartialEq)]
pub struct Op {
    /// The computation and its attributes.
    pub kind: OpKind,
    /// Operands.
    pub inputs: Vec<ValueId>,
    /// Results.
    pub outputs: Vec<ValueId>,
    /// Provenance path in the model, e.g. `model.layers.3.mlp.down_proj`.
    pub path: String,
}

/// A whole graph: inputs, parameters, ops in execution order and named outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    /// Model name (shown in dumps).
    pub name: String,
    /// Device mesh the graph is laid out for.
    pub mesh: Mesh,
    /// Value arena.
    pub values: Vec<Value>,
    /// Op arena, in execution order.
    pub ops: Vec<Op>,
    /// Named graph outputs (`loss`, ...).
    pub outputs: Vec<(String, ValueId)>,
}

impl Graph {
    /// An empty graph.
    pub fn new(name: impl Into<String>, mesh: Mesh) -> Graph {
        Graph {
            name: name.into(),
            mesh,
            values: Vec::new(),
            ops: Vec::new(),
            outputs: Vec::new(),
        }
    }

    /// The value `id`.
    pub fn value(&self, id: ValueId) -> &Value {
        &self.values[id.0 as usize]
    }

    /// The type of value `id`.
    pub fn ty(&self, id: ValueId) -> &TensorType {
        &self.value(id).ty
    }

    /// Declare a graph input.
    pub fn add_input(&mut self, name: impl Into<String>, ty: TensorType) -> ValueId {
        self.push_value(ty, ValueDef::Input(name.into()))
    }

    /// Declare a parameter.
    pub fn add_param(&mut self, name: impl Into<String>, ty: TensorType) -> ValueId {
        self.push_value(ty, ValueDef::Param(name.into()))
    }

    /// Append an op; its result types come from shape inference.
    pub fn add_op(
        &mut self,
        kind: OpKind,
        inputs: &[ValueId],
        path: impl Into<String>,
    ) -> Result<Vec<ValueId>, IrError> {
        let path = path.into();
        let in_types: Vec<&TensorType> = inputs.iter().map(|&v| self.ty(v)).collect();
        let out_types = infer_types(&kind, &in_types).map_err(|message| IrError::Type {
            op: kind.name().to_string(),
            path: path.clone(),
            message,
        })?;
        let op_id = OpId(self.ops.len() as u32);
        let outputs = out_types
            .into_iter()
            .enumerate()
            .map(|(i, ty)| self.push_value(ty, ValueDef::Op(op_id, i)))
            .collect::<Vec<_>>();
        self.ops.push(Op {
            kind,
            inputs: inputs.to_vec(),
            outputs: outputs.clone(),
            path,
        });
        Ok(outputs)
    }

    /// Append a single-output op and return its result.
    pub fn add_op1(
        &mut self,
        kind: OpKind,
        inputs: &[ValueId],
        path: impl Into<String>,
    ) -> Result<ValueId, IrError> {
        Ok(self.add_op(kind, inputs, path)?[0])
    }

    /// Name a graph output.
    pub fn add_output(&mut self, name: impl Into<String>, value: ValueId) {
        self.outputs.push((name.into(), value));
    }

    /// Parameters in declaration order, with their names.
    pub fn params(&self) -> impl Iterator<Item = (ValueId, &str, &TensorType)> {
        self.values
            .iter()
            .enumerate()
            .filter_map(|(i, v)| match &v.def {
                ValueDef::Param(name) => Some((ValueId(i as u32), name.as_str(), &v.ty)),
                _ => None,
            })
    }

    fn push_value(&mut self, ty: TensorType, def: ValueDef) -> ValueId {
        let id = ValueId(self.values.len() as u32);
        self.values.push(Value { ty, def });
        id
    }
}

impl Graph {
    /// The graph as rank `rank` holds it: every dim sharded over mesh axes shrinks to its
    /// local size (the global size divided by the axes' sizes). Used by `megac dump --rank`.
    pub fn localize(&self, rank: usize) -> Result<Graph, String> {
        let world = self.mesh.world_size();
        if rank >= world {
            return Err(format!("rank {rank} is outside the mesh of {world} ranks"));
        }
        let mut g = self.clone();
        for v in &mut g.values {
            let ty = &mut v.ty;
            for (dim, axes) in ty.dims.iter_mut().zip(&ty.layout.shards) {
                let parts: u64 = axes.iter().map(|&a| self.mesh.size(a)).product();
                if parts > 1 {
                    dim.size /= parts;
                }
            }
        }
        Ok(g)
    }
}

impl Graph {
    /// Parameter elements as Hugging Face counts them: tables whose first dim is the
    /// vocabulary count `vocab` rows, whatever padding tensor parallelism added.
    pub fn param_count_unpadded(&self, vocab: u64) -> u64 {
        self.params()
            .map(|(_, _, ty)| match ty.dims.first() {
                Some(d) if d.name == "vocab" && d.size > vocab => ty.numel() / d.size * vocab,
                _ => ty.numel(),
            })
            .sum()
    }
}
