//! The `shard` pass: layouts over the device mesh.
//!
//! Today it places data parallelism: the data inputs are sharded over `dp` along the batch
//! dim, and propagation gives every op's results a layout from its operands' — a result
//! with a batch dim (`b`, or MoE's `tokens`) stays sharded like its operands, and a result
//! without one (a parameter gradient, the loss) becomes a pending sum, `Partial(dp)`. The
//! optimizer pass then reduces partial gradients with `all_reduce` over `dp`.
//!
//! Tensor, sequence, context and expert parallelism add their own layout rules here (the
//! sharding issue); until then those axes stay replicated and codegen refuses such layouts.

use megac_ir::spec::ModelSpec;
use megac_ir::{Axis, Graph, ValueDef, ValueId};

use crate::PassError;

/// Annotate `g` with the layouts of `spec`'s parallel layout.
pub fn shard(g: &mut Graph, spec: &ModelSpec) -> Result<(), PassError> {
    if spec.parallel.dp == 1 {
        return Ok(());
    }
    let batch_dim = |g: &Graph, v: ValueId| {
        g.ty(v)
            .dims
            .iter()
            .position(|d| d.name == "b" || d.name == "tokens")
    };
    for i in 0..g.values.len() {
        let v = ValueId(i as u32);
        let sharded = match &g.values[i].def {
            ValueDef::Input(_) => true,
            ValueDef::Param(_) => false,
            ValueDef::Op(op, _) => g.ops[op.0 as usize].inputs.iter().any(|&x| {
                let l = &g.ty(x).layout;
                l.partial.contains(&Axis::Dp) || l.shards.iter().any(|s| s.contains(&Axis::Dp))
            }),
        };
        if !sharded {
            continue;
        }
        let dim = batch_dim(g, v);
        let layout = &mut g.values[i].ty.layout;
        match dim {
            Some(d) => layout.shards[d] = vec![Axis::Dp],
            None => layout.partial = vec![Axis::Dp],
        }
    }
    Ok(())
}
