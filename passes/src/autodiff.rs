//! The `autodiff` pass: reverse-mode differentiation of the forward graph.
//!
//! Walks the ops backwards and emits, for each op on a path to the objective, ordinary IR
//! ops that compute its operands' gradient contributions. Contributions to the same value
//! are summed with `grad_sum`. The objective is the sum of every `cross_entropy` and
//! `moe_aux_loss` op; their backward ops carry the implicit seed gradient 1 (and the 1/tokens
//! of the mean). Each parameter's gradient becomes a graph output `grad:NAME`.

use std::collections::HashMap;

use megac_ir::{DType, Graph, IrError, OpKind, ValueDef, ValueId};

use crate::PassError;

/// Append the backward graph to `g`.
pub fn differentiate(g: &mut Graph) -> Result<(), PassError> {
    let mut grads: HashMap<ValueId, ValueId> = HashMap::new();
    let forward_ops = g.ops.len();
    for op_index in (0..forward_ops).rev() {
        let op = g.ops[op_index].clone();
        let dys: Vec<Option<ValueId>> = op.outputs.iter().map(|v| grads.get(v).copied()).collect();
        let is_objective = matches!(op.kind, OpKind::CrossEntropy | OpKind::MoeAuxLoss { .. });
        if !is_objective && dys.iter().all(Option::is_none) {
            continue;
        }
        let path = op.path.as_str();
        let x = &op.inputs;
        let dy = dys[0];
        let mut acc = Acc {
            g: &mut *g,
            grads: &mut grads,
            path,
        };
        match &op.kind {
            OpKind::Embedding => {
                let d = acc.emit(OpKind::EmbeddingGrad, &[x[0], x[1], need(dy, &op.path)?])?;
                acc.add(x[1], d[0])?;
            }
            OpKind::PosEmbedding => {
                let dy = need(dy, &op.path)?;
                acc.add(x[0], dy)?;
                let d = acc.emit(OpKind::PosEmbeddingGrad, &[x[1], dy])?;
                acc.add(x[1], d[0])?;
            }
            OpKind::Cast { .. } => {
                let dy = need(dy, &op.path)?;
                let to = acc.g.ty(x[0]).dtype;
                let d = acc.emit(OpKind::Cast { to }, &[dy])?;
                acc.add(x[0], d[0])?;
            }
            OpKind::Linear { weight } => {
                let dy = need(dy, &op.path)?;
                if acc.differentiable(x[0]) {
                    let d = acc.emit(OpKind::LinearGradInput { weight: *weight }, &[dy, x[1]])?;
                    acc.add(x[0], d[0])?;
                }
                let d = acc.emit(OpKind::LinearGradWeight { weight: *weight }, &[x[0], dy])?;
                acc.add(x[1], d[0])?;
                if let Some(&bias) = x.get(2) {
                    let d = acc.emit(OpKind::BiasGrad, &[dy])?;
                    acc.add(bias, d[0])?;
                }
            }
            OpKind::RmsNorm { eps } => {
                let d = acc.emit(
                    OpKind::RmsNormGrad { eps: *eps },
                    &[x[0], x[1], need(dy, &op.path)?],
                )?;
                acc.add(x[0], d[0])?;
                acc.add(x[1], d[1])?;
            }
            OpKind::LayerNorm { eps } => {
                let d = acc.emit(
                    OpKind::LayerNormGrad { eps: *eps },
                    &[x[0], x[1], need(dy, &op.path)?],
                )?;
                acc.add(x[0], d[0])?;
                acc.add(x[1], d[1])?;
                acc.add(x[2], d[2])?;
            }
            OpKind::SplitHeads { .. } => {
                let d = acc.emit(OpKind::MergeHeads, &[need(dy, &op.path)?])?;
                acc.add(x[0], d[0])?;
            }
            OpKind::MergeHeads => {
                let dims = &acc.g.ty(x[0]).dims;
                let n = dims[dims.len() - 2].size;
                let d = acc.emit(OpKind::SplitHeads { n }, &[need(dy, &op.path)?])?;
                acc.add(x[0], d[0])?;
            }
            OpKind::Split { .. } => {
                let parts = dys
                    .iter()
                    .map(|d| need(*d, &op.path))
                    .collect::<Result<Vec<_>, _>>()?;
                let d = acc.emit(OpKind::Concat, &parts)?;
                acc.add(x[0], d[0])?;
            }
            OpKind::RepeatKv { n } => {
                let d = acc.emit(OpKind::RepeatKvGrad { n: *n }, &[need(dy, &op.path)?])?;
                acc.add(x[0], d[0])?;
            }
            OpKind::Rope { theta, scaling } => {
                let d = acc.emit(
                    OpKind::RopeGrad {
                        theta: *theta,
                        scaling: *scaling,
                    },
                    &[need(dy, &op.path)?],
                )?;
                acc.add(x[0], d[0])?;
            }
            OpKind::CausalAttention { window } => {
                let ins = [
                    x[0],
                    x[1],
                    x[2],
                    op.outputs[0],
                    op.outputs[1],
                    need(dy, &op.path)?,
                ];
                let d = acc.emit(OpKind::AttentionGrad { window: *window }, &ins)?;
                for i in 0..3 {
                    acc.add(x[i], d[i])?;
                }
            }
            OpKind::Add => {
                let dy = need(dy, &op.path)?;
                acc.add(x[0], dy)?;
                acc.add(x[1], dy)?;
            }
            OpKind::GradSum => {
                return Err(PassError::Autodiff(format!(
                    "{}: the graph is already differentiated",
                    op.path
                )))
            }
            OpKind::SigmoidMul => {
                let d = acc.emit(OpKind::SigmoidMulGrad, &[x[0], x[1], need(dy, &op.path)?])?;
                acc.add(x[0], d[0])?;
                acc.add(x[1], d[1])?;
            }
            OpKind::SwiGlu => {
                let d = acc.emit(OpKind::SwiGluGrad, &[x[0], x[1], need(dy, &op.path)?])?;
                acc.add(x[0], d[0])?;
                acc.add(x[1], d[1])?;
            }
            OpKind::GeluTanh => {
                let d = acc.emit(OpKind::GeluTanhGrad, &[x[0], need(dy, &op.path)?])?;
                acc.add(x[0], d[0])?;
            }
            OpKind::CrossEntropy => {
                let d = acc.emit(OpKind::CrossEntropyGrad, &[x[0], x[1]])?;
                acc.add(x[0], d[0])?;
            }
            OpKind::MoeAuxLoss { coeff } => {
                let d = acc.emit(OpKind::MoeAuxLossGrad { coeff: *coeff }, &[x[0], x[1]])?;
                acc.add(x[0], d[0])?;
            }
            OpKind::Router { top_k, renorm } => {
                if let Some(dw) = dy {
                    let (top_k, renorm) = (*top_k, *renorm);
                    let d = acc.emit(OpKind::RouterGrad { top_k, renorm }, &[x[0], dw])?;
                    acc.add(x[0], d[0])?;
                }
            }
            OpKind::Dispatch { expert, .. } => {
                let d = acc.emit(
                    OpKind::DispatchGrad { expert: *expert },
                    &[need(dy, &op.path)?, x[1]],
                )?;
                acc.add(x[0], d[0])?;
            }
            OpKind::DispatchExperts { .. } => {
                let d = acc.emit(OpKind::DispatchExpertsGrad, &[need(dy, &op.path)?, x[1]])?;
                acc.add(x[0], d[0])?;
            }
            OpKind::CombineExperts => {
                let mut ins = x.clone();
                ins.push(need(dy, &op.path)?);
                let d = acc.emit(OpKind::CombineExpertsGrad, &ins)?;
                acc.add(x[0], d[0])?;
                acc.add(x[2], d[1])?;
            }
            OpKind::Combine => {
                let mut ins = x.clone();
                ins.push(need(dy, &op.path)?);
                let d = acc.emit(OpKind::CombineGrad, &ins)?;
                acc.add(x[0], d[0])?;
                for (i, &y) in x[2..].iter().enumerate() {
                    acc.add(y, d[i + 1])?;
                }
            }
            other => {
                return Err(PassError::Autodiff(format!(
                    "{}: no derivative for `{}` in a forward graph",
                    op.path,
                    other.name()
                )))
            }
        }
    }
    let params: Vec<(ValueId, String)> = g.params().map(|(v, n, _)| (v, n.to_string())).collect();
    for (p, name) in params {
        match grads.get(&p) {
            Some(&d) => g.add_output(format!("grad:{name}"), d),
            None => {
                return Err(PassError::Autodiff(format!(
                    "parameter {name} does not reach the loss"
                )))
            }
        }
    }
    Ok(())
}

fn need(dy: Option<ValueId>, path: &str) -> Result<ValueId, PassError> {
    dy.ok_or_else(|| PassError::Autodiff(format!("{path}: an output has no gradient")))
}

/// Emits backward ops and sums gradient contributions.
struct Acc<'a> {
    g: &'a mut Graph,
    grads: &'a mut HashMap<ValueId, ValueId>,
    path: &'a str,
}

impl Acc<'_> {
    fn emit(&mut self, kind: OpKind, ins: &[ValueId]) -> Result<Vec<ValueId>, IrError> {
        self.g.add_op(kind, ins, self.path)
    }

    /// Whether gradients flow into `v` (float values; data inputs take none).
    fn differentiable(&self, v: ValueId) -> bool {
        let value = self.g.value(v);
        value.ty.dtype != DType::I32 && !matches!(value.def, ValueDef::Input(_))
    }

    /// Record `d` as a gradient contribution to `v`.
    fn add(&mut self, v: ValueId, d: ValueId) -> Result<(), IrError> {
        if !self.differentiable(v) {
            return Ok(());
        }
        let total = match self.grads.get(&v) {
            None => d,
            Some(&prev) => self.g.add_op1(OpKind::GradSum, &[prev, d], self.path)?,
        };
        self.grads.insert(v, total);
        Ok(())
    }
}
