//! Gradient bucketing: the optimizer program's in-place gradient all-reduces merged into
//! buckets, runs of adjacent gradient buffers over the same axes (as Megatron's DDP buckets),
//! so a step makes a few large collectives instead of one per parameter.

use megac_ir::plan::{BufferClass, Instr};
use megac_ir::OpKind;

use crate::Emitter;

/// Elements per gradient bucket (Megatron's DDP default; its distributed optimizer uses at
/// least 1M per member of the group).
pub(crate) const BUCKET_ELEMS: u64 = 40_000_000;

impl Emitter<'_> {
    /// Merge the in-place gradient all-reduces into buckets: runs of adjacent gradient
    /// buffers over the same axes, up to `BUCKET_ELEMS` each (as Megatron's DDP buckets).
    pub(crate) fn bucket_reductions(&mut self) {
        let program = std::mem::take(&mut self.optimizer);
        self.optimizer = self.bucketed(program);
    }

    /// `program` with its in-place gradient all-reduces merged into buckets.
    pub(crate) fn bucketed(&mut self, program: Vec<Instr>) -> Vec<Instr> {
        let mut out = Vec::new();
        let mut run: Option<(Vec<megac_ir::Axis>, u64, u64)> = None; // axes, start, end
        let flush = |run: &mut Option<(Vec<megac_ir::Axis>, u64, u64)>,
                     out: &mut Vec<Instr>,
                     e: &mut Self| {
            if let Some((axes, start, end)) = run.take() {
                let n = e
                    .buffers
                    .iter()
                    .filter(|b| b.name.starts_with("bucket:"))
                    .count();
                let b = e.flat(
                    &format!("bucket:{n}"),
                    BufferClass::Grad,
                    start,
                    end - start,
                );
                out.push(Instr::Kernel {
                    op: OpKind::AllReduce { axes },
                    inputs: vec![b],
                    outputs: vec![b],
                    path: format!("optimizer.bucket.{n}"),
                });
            }
        };
        for instr in program {
            let grad_reduce = match &instr {
                Instr::Kernel {
                    op: OpKind::AllReduce { axes },
                    inputs,
                    ..
                } if self.buffers[inputs[0] as usize].class == BufferClass::Grad => {
                    let b = &self.buffers[inputs[0] as usize];
                    Some((axes.clone(), b.offset, b.offset + b.len()))
                }
                _ => None,
            };
            match grad_reduce {
                Some((axes, start, end)) => {
                    let extend = matches!(&run, Some((a, s, e)) if *a == axes && *e == start && end - s <= BUCKET_ELEMS);
                    if extend {
                        if let Some(r) = run.as_mut() {
                            r.2 = end;
                        }
                    } else {
                        flush(&mut run, &mut out, self);
                        run = Some((axes, start, end));
                    }
                }
                None => {
                    flush(&mut run, &mut out, self);
                    out.push(instr);
                }
            }
        }
        flush(&mut run, &mut out, self);
        out
    }
}
