//! The fusion pass: groups chains of elementwise and row-reduction instructions of a
//! program into fused groups, each run as one kernel (with the `mlir` feature, one
//! function generated through MLIR and JIT-compiled by the runtime, `megac_runtime`'s
//! `fusion` module).
//!
//! The grouping is a pure, deterministic function of a checked plan's instruction stream:
//! nothing of it is written into the plan, so `plan.json` is the same with and without
//! fusion and in every build (`megac dump MODEL --after fuse` prints the groups).
//!
//! ## Legality
//! An instruction is a *member* when it is a `zero`, or a kernel whose op is elementwise or
//! a row reduction with a linalg lowering ([`fusible_op`]: `add`, `grad_sum`, `bias_add`,
//! `cast`, `swiglu`, `gelu_tanh`, `sigmoid_mul` and their gradients, `rms_norm`,
//! `rms_norm_grad`, `layer_norm`, `rope`, `rope_grad`) and that does not communicate
//! inside itself (no implicit collective). `rope` and `rope_grad` have a fused form only
//! at positions `0..s` (their cos and sin tables are constants of the kernel, computed as
//! the Rust kernel computes them): where the sequence is split (context parallelism, whose
//! positions depend on the rank) the lowering has none, and a group holding one runs
//! unfused, every instruction by the Rust kernels. A group is a run of *consecutive* members of one program: no
//! instruction is moved, so every read and write happens in the program's order and the
//! group computes what its instructions compute one after the other (buffers that share
//! memory by liveness stay correct). Collectives, transfers, matmuls, AdamW and the
//! kernels without a lowering (attention, cross-entropy, ...) end a group. A `cast` is a
//! member like any elementwise kernel, but the plans the frontend compiles hold none:
//! mixed precision is carried by the buffers' dtypes (each kernel widens its 16-bit
//! operands and rounds its 16-bit outputs once, inside a fused kernel as well) and by
//! AdamW's master copy, so the conversions are already inside the groups' kernels.
//!
//! ## Profit
//! A member joins the group before it only when it is *connected* to it: it reads or
//! writes a buffer an earlier member writes (a producer-consumer chain: residual add then
//! RMSNorm, a gradient kernel then the `grad_sum` of its result), or it is a `zero`
//! (which the next member may accumulate into: the `zero`s before the two `rope_grad`s
//! of an attention backward, which then write their results instead of adding them to
//! zeroed buffers; on the bench model that group runs in 0.87 of the Rust kernels'
//! time, docs/mlir.md). Trailing `zero`s that nothing in the
//! group writes afterwards are left out, and a group must hold at least two instructions
//! and one kernel (an AdamW alone, below); at most [`MAX_GROUP`] instructions. What a group saves: one call
//! instead of several, and every `zero` followed by a kernel that accumulates into it
//! elementwise is not run at all: that kernel writes `0 + value` instead of reading the
//! zeroed buffer (the same bits), which saves a write and a read of the buffer.
//!
//! ## AdamW
//! Each AdamW update is a group of its own ([`alone`]): the Rust kernels pass over the
//! gradient up to three times (unscaling fp16's loss scale, clipping, the update) and copy
//! the master weight into the working weight; its fused kernel does all of it in one pass.
//! The step's scalars (learning rate, bias corrections, loss scale) are an argument the
//! runtime fills per call; the clipping norm is read from its buffer.
//!
//! ## Splitting a group over threads
//! A group whose every member is *row-local* (each output row depends only on the same row
//! of the row-shaped inputs: every member but `rms_norm_grad`, whose weight gradient sums
//! over rows) may run as `parts` calls on disjoint row ranges at once ([`split_rows`]):
//! every buffer of rank 2 or more has the same leading dimension `B`, a multiple of
//! `parts`, and is cut along it; buffers of rank 0 or 1 (norm weights, biases) are only
//! read, whole, by every part. Each row is computed by the same operations in the same
//! order as in one call.

use megac_ir::plan::{BufId, Instr};
use megac_ir::OpKind;

/// The most instructions in one group.
pub const MAX_GROUP: usize = 8;

/// A fused group: instructions `start..start + len` of a program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    /// Index of the first instruction.
    pub start: usize,
    /// How many instructions.
    pub len: usize,
}

impl Group {
    /// The group's instructions in `program`.
    pub fn instrs<'a>(&self, program: &'a [Instr]) -> &'a [Instr] {
        &program[self.start..self.start + self.len]
    }

    /// Its pattern: the members' op names joined by `+` (`zero+rms_norm_grad`).
    pub fn pattern(&self, program: &[Instr]) -> String {
        self.instrs(program)
            .iter()
            .map(|i| match i {
                Instr::Zero { .. } => "zero",
                Instr::Kernel { op, .. } => op.name(),
                Instr::Send { .. } => "send",
                Instr::Recv { .. } => "recv",
            })
            .collect::<Vec<_>>()
            .join("+")
    }
}

/// Whether kernels of `op` may join a group (elementwise or row reductions with a linalg
/// lowering).
pub fn fusible_op(op: &OpKind) -> bool {
    matches!(
        op,
        OpKind::Add
            | OpKind::GradSum
            | OpKind::BiasAdd
            | OpKind::Cast { .. }
            | OpKind::SwiGlu
            | OpKind::SwiGluGrad
            | OpKind::GeluTanh
            | OpKind::GeluTanhGrad
            | OpKind::SigmoidMul
            | OpKind::SigmoidMulGrad
            | OpKind::RmsNorm { .. }
            | OpKind::RmsNormGrad { .. }
            | OpKind::LayerNorm { .. }
            | OpKind::Rope { .. }
            | OpKind::RopeGrad { .. }
    ) && op.implicit_collective().is_none()
}

/// The leading dimension `B` along which a group's buffers can be cut into `parts` row
/// ranges run at once (see the module doc), if the group allows it.
pub fn split_rows(plan: &megac_ir::plan::Plan, instrs: &[Instr], parts: u64) -> Option<u64> {
    if parts < 2 {
        return None;
    }
    let mut lead: Option<u64> = None;
    for i in instrs {
        if let Instr::Kernel { op, .. } = i {
            if matches!(op, OpKind::RmsNormGrad { .. }) || !fusible_op(op) {
                return None;
            }
        }
        let (r, w) = access(i);
        for (b, written) in r
            .iter()
            .map(|b| (b, false))
            .chain(w.iter().map(|b| (b, true)))
        {
            let shape = &plan.buffers[*b as usize].shape;
            if shape.len() < 2 {
                if written {
                    return None;
                }
                continue;
            }
            match lead {
                None => lead = Some(shape[0]),
                Some(l) if l != shape[0] => return None,
                Some(_) => {}
            }
        }
    }
    lead.filter(|&l| l % parts == 0)
}

/// Whether instruction `i` is a group of its own: an AdamW update (its unscaling,
/// clipping, moments, step and master rounding in one pass instead of up to four).
pub fn alone(i: &Instr) -> bool {
    matches!(
        i,
        Instr::Kernel {
            op: OpKind::AdamW { .. },
            ..
        }
    )
}

/// Whether instruction `i` may be a member of a group.
pub fn member(i: &Instr) -> bool {
    match i {
        Instr::Zero { .. } => true,
        Instr::Kernel { op, .. } => fusible_op(op),
        Instr::Send { .. } | Instr::Recv { .. } => false,
    }
}

/// The buffers `i` reads and writes: (reads, writes).
fn access(i: &Instr) -> (&[BufId], &[BufId]) {
    match i {
        Instr::Zero { buffer } => (&[], std::slice::from_ref(buffer)),
        Instr::Kernel {
            inputs, outputs, ..
        } => (inputs, outputs),
        Instr::Send { buffer, .. } => (std::slice::from_ref(buffer), &[]),
        Instr::Recv { buffer, .. } => (&[], std::slice::from_ref(buffer)),
    }
}

/// The fused groups of `program`, in program order (disjoint).
pub fn groups(program: &[Instr]) -> Vec<Group> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < program.len() {
        if alone(&program[i]) {
            out.push(Group { start: i, len: 1 });
            i += 1;
            continue;
        }
        if !member(&program[i]) {
            i += 1;
            continue;
        }
        let mut written: Vec<BufId> = access(&program[i]).1.to_vec();
        let mut end = i + 1;
        while end < program.len() && end - i < MAX_GROUP && member(&program[end]) {
            let (r, w) = access(&program[end]);
            let connected = matches!(program[end], Instr::Zero { .. })
                || r.iter().chain(w).any(|b| written.contains(b));
            if !connected {
                break;
            }
            written.extend_from_slice(w);
            end += 1;
        }
        // Trailing zeros that nothing in the group writes afterwards stay out.
        while end > i + 1 && matches!(program[end - 1], Instr::Zero { .. }) {
            end -= 1;
        }
        let len = end - i;
        let kernels = program[i..end]
            .iter()
            .filter(|x| matches!(x, Instr::Kernel { .. }))
            .count();
        if len >= 2 && kernels >= 1 {
            out.push(Group { start: i, len });
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

/// The named programs of a role, as the runtime runs them: `microbatch`, `optimizer`, and
/// per pipeline chunk `chunk<c>_forward`, `_backward`, `_weight`.
pub fn programs(role: &megac_ir::plan::Role) -> Vec<(String, &[Instr])> {
    let mut out: Vec<(String, &[Instr])> = vec![
        ("microbatch".into(), &role.microbatch[..]),
        ("optimizer".into(), &role.optimizer[..]),
    ];
    if let Some(p) = &role.pipeline {
        for c in &p.chunks {
            out.push((format!("chunk{}_forward", c.chunk), &c.forward[..]));
            out.push((format!("chunk{}_backward", c.chunk), &c.backward[..]));
            out.push((format!("chunk{}_weight", c.chunk), &c.weight[..]));
        }
    }
    out
}

/// The pass's dump of a plan: per role and program, each group's instruction range,
/// pattern and the provenance path of its first kernel; then a count of groups by pattern.
pub fn dump(plan: &megac_ir::plan::Plan) -> String {
    use std::collections::BTreeMap;
    use std::fmt::Write as _;
    let mut s = String::new();
    for role in &plan.roles {
        let mut by_pattern: BTreeMap<String, usize> = BTreeMap::new();
        let _ = writeln!(s, "role {}:", role.name);
        for (name, program) in programs(role) {
            let gs = groups(program);
            if gs.is_empty() {
                continue;
            }
            let fused: usize = gs.iter().map(|g| g.len).sum();
            let _ = writeln!(
                s,
                "  {name}: {} groups, {fused} of {} instructions",
                gs.len(),
                program.len()
            );
            for g in &gs {
                let pattern = g.pattern(program);
                let path = g
                    .instrs(program)
                    .iter()
                    .find_map(|i| match i {
                        Instr::Kernel { path, .. } => Some(path.as_str()),
                        _ => None,
                    })
                    .unwrap_or("");
                let _ = writeln!(
                    s,
                    "    [{}..{}) {pattern}  {path}",
                    g.start,
                    g.start + g.len
                );
                *by_pattern.entry(pattern).or_default() += 1;
            }
        }
        for (p, n) in by_pattern {
            let _ = writeln!(s, "  {n:>4} x {p}");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(op: OpKind, inputs: &[BufId], outputs: &[BufId]) -> Instr {
        Instr::Kernel {
            op,
            inputs: inputs.to_vec(),
            outputs: outputs.to_vec(),
            path: String::new(),
        }
    }

    #[test]
    fn chains_group_and_independent_ops_do_not() {
        let lin = OpKind::Linear {
            weight: megac_ir::WeightLayout::OutIn,
        };
        let p = vec![
            k(OpKind::Add, &[1, 2], &[3]),
            k(OpKind::RmsNorm { eps: 1e-5 }, &[3, 4], &[5]),
            k(lin.clone(), &[5, 6], &[7]),
            Instr::Zero { buffer: 8 },
            Instr::Zero { buffer: 9 },
            k(OpKind::SwiGluGrad, &[10, 11, 12], &[8, 9]),
            Instr::Zero { buffer: 13 },
            k(lin, &[8, 6], &[13]),
            // Independent of each other: no group.
            k(OpKind::Add, &[1, 2], &[14]),
            k(OpKind::Add, &[1, 2], &[15]),
        ];
        let g = groups(&p);
        assert_eq!(
            g,
            vec![Group { start: 0, len: 2 }, Group { start: 3, len: 3 }]
        );
        assert_eq!(g[0].pattern(&p), "add+rms_norm");
        assert_eq!(g[1].pattern(&p), "zero+zero+swiglu_grad");
    }

    #[test]
    fn rope_grads_join_their_zeros_and_forward_ropes_stay_alone() {
        let rope = OpKind::Rope {
            theta: 1e4,
            scaling: None,
        };
        let grad = OpKind::RopeGrad {
            theta: 1e4,
            scaling: None,
        };
        let attn = OpKind::CausalAttention { window: 0 };
        let p = vec![
            // q and k rotated independently: no group.
            k(rope, &[1], &[3]),
            k(
                OpKind::Rope {
                    theta: 1e4,
                    scaling: None,
                },
                &[2],
                &[4],
            ),
            k(attn, &[3, 4, 5], &[6, 7]),
            Instr::Zero { buffer: 8 },
            k(grad.clone(), &[9], &[8]),
            Instr::Zero { buffer: 10 },
            k(grad, &[11], &[10]),
        ];
        let g = groups(&p);
        assert_eq!(g, vec![Group { start: 3, len: 4 }]);
        assert_eq!(g[0].pattern(&p), "zero+rope_grad+zero+rope_grad");
    }

    #[test]
    fn each_adamw_is_a_group_and_casts_join_their_chain() {
        let adamw = OpKind::AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            max_norm: 1.0,
            master: true,
        };
        let bf16 = OpKind::Cast {
            to: megac_ir::DType::Bf16,
        };
        let p = vec![
            // A cast between elementwise members joins their group.
            k(OpKind::Add, &[1, 2], &[3]),
            k(bf16.clone(), &[3], &[4]),
            k(OpKind::RmsNorm { eps: 1e-5 }, &[4, 5], &[6]),
            k(OpKind::GradNorm { axes: vec![] }, &[7, 8], &[9]),
            k(adamw.clone(), &[10, 7, 9], &[10, 11, 12, 13]),
            k(adamw, &[14, 8, 9], &[14, 15, 16, 17]),
            // A cast of nothing an earlier member wrote starts no group.
            k(bf16, &[18], &[19]),
        ];
        let g = groups(&p);
        assert_eq!(
            g,
            vec![
                Group { start: 0, len: 3 },
                Group { start: 4, len: 1 },
                Group { start: 5, len: 1 }
            ]
        );
        assert_eq!(g[0].pattern(&p), "add+cast+rms_norm");
        assert_eq!(g[1].pattern(&p), "adamw");
    }
}
