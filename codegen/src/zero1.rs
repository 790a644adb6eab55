//! The distributed optimizer (ZeRO-1, as Megatron's): the optimizer program that
//! reduce-scatters the gradients over flat segments of the parameter arena, updates each
//! rank's shard with its own slice of the AdamW state and all-gathers the parameters back.

use megac_ir::plan::{BufId, BufferClass, Instr, ParamEntry};
use megac_ir::{Axis, OpKind};

use crate::bucket::BUCKET_ELEMS;
use crate::{CodegenError, Emitter};

impl Emitter<'_> {
    /// The distributed optimizer (ZeRO-1, as Megatron's): gradients are reduce-scattered over
    /// dp·cp (expert gradients over the expert-data-parallel group edp) so each rank holds the
    /// summed gradient of a slice of the flat parameter arena; each rank updates that slice
    /// with its own slice of the AdamW state (and, under mixed precision, of the fp32 master
    /// weights); the working weights are all-gathered back. The gradient norm sums the squares of every rank's slices.
    pub(crate) fn zero1(&mut self) -> Result<(), CodegenError> {
        let norm = match self.results.get("grad_norm") {
            Some(&b) => b,
            None => return Err(CodegenError::Incomplete("no grad_norm result".into())),
        };
        let program = std::mem::take(&mut self.optimizer);
        let all: Vec<usize> = (0..self.params.len()).collect();
        self.optimizer = self.zero1_program(&program, &all, norm, &[])?;
        Ok(())
    }

    /// The ZeRO-1 optimizer program replacing `program` for the parameters `params` (indices
    /// into `self.params`, laid out from offset 0 of their arenas), writing the norm to
    /// `norm`, whose squares are also summed over `norm_axes` (pipeline stages).
    ///
    /// The flat arenas hold four kinds of segments (each kind bucketed), each padded to a
    /// multiple of the size of the group it is sharded over: non-expert parameters
    /// replicated over tp, then those split
    /// over tp (both sharded over dp), then expert parameters (stacked experts split over ep)
    /// replicated over tp, then those split over tp (both sharded over edp, Megatron's
    /// expert-data-parallel group). A shard's layout says over which ranks its elements are
    /// unique, so the gradient norm counts every element once: non-expert shards are unique
    /// over dp (replicated over cp), expert shards over ep × edp = dp·cp; tp as the segment.
    pub(crate) fn zero1_program(
        &mut self,
        program_in: &[Instr],
        params: &[usize],
        norm: BufId,
        norm_axes_extra: &[Axis],
    ) -> Result<Vec<Instr>, CodegenError> {
        let hp = program_in.iter().find_map(|i| match i {
            Instr::Kernel {
                op: op @ OpKind::AdamW { .. },
                ..
            } => Some(op.clone()),
            _ => None,
        });
        let Some(adamw) = hp else {
            return Err(CodegenError::Incomplete(
                "no AdamW step to distribute".into(),
            ));
        };
        let mut program = self.pending_reductions(program_in, params);
        let (segments, _total) = self.lay_out_segments(params);
        let mut opt_offset = 0u64;
        let mut shards = Vec::new();
        // Last segment first: the backward finishes the last layers' gradients first, so
        // their reduce-scatters can start (and overlap the rest of the backward) while the
        // first layers' are still being computed.
        for (k, seg) in segments.iter().enumerate().rev() {
            shards.push(self.shard_segment(k, seg, &mut opt_offset, &mut program));
        }
        // Every shard is unique over dp·cp (dense shards over the dp·cp group, expert
        // shards over ep × edp = dp·cp).
        let mut norm_axes = self.dense_axes();
        if segments.iter().any(|s| s.split) {
            norm_axes.push(Axis::Tp);
        }
        norm_axes.extend_from_slice(norm_axes_extra);
        program.push(Instr::Kernel {
            op: OpKind::GradNorm { axes: norm_axes },
            inputs: shards.iter().map(|s| s.grad_shard).collect(),
            outputs: vec![norm],
            path: "optimizer.grad_norm".into(),
        });
        for sh in shards {
            let k = sh.k;
            program.push(Instr::Kernel {
                op: adamw.clone(),
                inputs: vec![sh.param_shard, sh.grad_shard, norm],
                outputs: [sh.param_shard, sh.exp_avg, sh.exp_avg_sq]
                    .into_iter()
                    .chain(sh.master)
                    .collect(),
                path: format!("optimizer.adamw.segment{k}"),
            });
            if sh.n > 1 {
                program.push(Instr::Kernel {
                    op: OpKind::AllGather {
                        axes: sh.axes.clone(),
                        dim: 0,
                    },
                    inputs: vec![sh.param_shard],
                    outputs: vec![sh.params],
                    path: format!("optimizer.all_gather.segment{k}"),
                });
            }
        }
        Ok(program)
    }

    /// The group the non-expert segments are sharded over: dp·cp, as Megatron's distributed
    /// optimizer (its data-parallel group with context parallelism).
    fn dense_axes(&self) -> Vec<Axis> {
        if self.g.mesh.size(Axis::Cp) > 1 {
            vec![Axis::Dp, Axis::Cp]
        } else {
            vec![Axis::Dp]
        }
    }

    /// Gradients of `params` that are also pending sums over other axes (cp, or tp for norm
    /// weights under sequence parallelism) are reduced over those first, in place; the sum
    /// over the segment's own axis (dp, or edp for experts) is the reduce-scatter that
    /// follows. Returns those in-place all-reduces of `program_in`.
    fn pending_reductions(&self, program_in: &[Instr], params: &[usize]) -> Vec<Instr> {
        let expert_grads: Vec<BufId> = params
            .iter()
            .filter(|&&i| is_expert(&self.params[i]))
            .filter_map(|&i| self.params[i].grad)
            .collect();
        let mut program = Vec::new();
        for instr in program_in {
            if let Instr::Kernel {
                op: OpKind::AllReduce { axes },
                inputs,
                ..
            } = instr
            {
                let own = if expert_grads.contains(&inputs[0]) {
                    vec![Axis::Edp]
                } else {
                    self.dense_axes()
                };
                let rest: Vec<Axis> = axes.iter().copied().filter(|a| !own.contains(a)).collect();
                if !rest.is_empty() && self.buffers[inputs[0] as usize].class == BufferClass::Grad {
                    program.push(Instr::Kernel {
                        op: OpKind::AllReduce { axes: rest },
                        inputs: inputs.clone(),
                        outputs: inputs.clone(),
                        path: format!("optimizer.reduce.{}", self.buffers[inputs[0] as usize].name),
                    });
                }
            }
        }
        program
    }

    /// Lay the parameters and gradients of `params` out in the flat arenas, segment after
    /// segment: each kind's parameters in buckets of at most max(40M, 1M × group) elements
    /// (a larger parameter alone), as Megatron's distributed optimizer buckets them, each
    /// padded to a multiple of its group's size. Returns the non-empty segments and the
    /// arenas' total length.
    fn lay_out_segments(&mut self, params: &[usize]) -> (Vec<Segment>, u64) {
        let mesh = &self.g.mesh;
        let (dpcp, edp) = (
            mesh.size(Axis::Dp) * mesh.size(Axis::Cp),
            mesh.size(Axis::Edp),
        );
        // Segment kinds in arena order: (expert, tp split).
        let kinds = [(false, false), (false, true), (true, false), (true, true)];
        let mut segments: Vec<Segment> = Vec::new();
        let mut offset = 0u64;
        for (expert, split) in kinds {
            let n = if expert { edp } else { dpcp };
            // Megatron's bucket size for the distributed optimizer.
            let bucket = BUCKET_ELEMS.max(1_000_000 * n);
            let mut start = offset;
            let close = |offset: &mut u64, start: u64, segments: &mut Vec<Segment>| {
                let len = *offset - start;
                if len > 0 {
                    let padded = len.div_ceil(n) * n;
                    segments.push(Segment {
                        start,
                        padded,
                        split,
                        expert,
                    });
                    *offset = start + padded;
                }
            };
            for &i in params {
                let entry = &self.params[i];
                if is_expert(entry) != expert || tp_split(entry) != split {
                    continue;
                }
                // Every parameter of a training plan has a gradient (the distributed
                // optimizer runs in training plans only).
                let Some(gb) = entry.grad else { continue };
                let pb = entry.buffer;
                let len = self.buffers[pb as usize].len();
                if offset > start && offset - start + len > bucket {
                    close(&mut offset, start, &mut segments);
                    start = offset;
                }
                self.buffers[pb as usize].offset = offset;
                self.buffers[gb as usize].offset = offset;
                offset += len;
            }
            close(&mut offset, start, &mut segments);
        }
        (segments, offset)
    }

    /// Segment `k`'s flat buffers, this rank's shard of them (its gradients reduce-scattered
    /// in place into the rank's own slice of the segment, as Megatron's distributed
    /// optimizer does, pushed onto `program`) and the shard's AdamW state, from `opt_offset`.
    fn shard_segment(
        &mut self,
        k: usize,
        seg: &Segment,
        opt_offset: &mut u64,
        program: &mut Vec<Instr>,
    ) -> Shard {
        let mesh = &self.g.mesh;
        let (axes, n) = if seg.expert {
            (vec![Axis::Edp], mesh.size(Axis::Edp))
        } else {
            (self.dense_axes(), mesh.size(Axis::Dp) * mesh.size(Axis::Cp))
        };
        let shard = seg.padded / n;
        let mut layout = if seg.expert {
            vec![Axis::Edp, Axis::Ep]
        } else {
            axes.clone()
        };
        if seg.split {
            layout.push(Axis::Tp);
        }
        let grads = self.flat(
            &format!("grad:segment{k}"),
            BufferClass::Grad,
            seg.start,
            seg.padded,
        );
        // Working weights in the precision's storage dtype (16-bit under mixed precision:
        // the all-gather moves 16-bit weights, and an f32 master shard sits beside the
        // moments).
        let working = self.spec.train.precision.storage();
        let params = self.flat_of(
            &format!("param:segment{k}"),
            BufferClass::Param,
            working,
            seg.start,
            seg.padded,
        );
        // With a group of one (edp = 1: ep = dp·cp) the rank's shard is the segment.
        let (grad_shard, param_shard) = if n > 1 {
            let grad_shard = self.flat(
                &format!("grad:shard{k}"),
                BufferClass::Grad,
                seg.start,
                shard,
            );
            self.buffers[grad_shard as usize].rank_offset = Some(megac_ir::plan::RankOffset {
                axis: axes[0],
                with: axes[1..].to_vec(),
                stride: shard,
            });
            let param_shard = self.flat_of(
                &format!("param:shard{k}"),
                BufferClass::Param,
                working,
                seg.start,
                shard,
            );
            self.buffers[param_shard as usize].rank_offset = Some(megac_ir::plan::RankOffset {
                axis: axes[0],
                with: axes[1..].to_vec(),
                stride: shard,
            });
            program.push(Instr::Kernel {
                op: OpKind::ReduceScatter {
                    axes: axes.clone(),
                    dim: 0,
                },
                inputs: vec![grads],
                outputs: vec![grad_shard],
                path: format!("optimizer.reduce_scatter.segment{k}"),
            });
            (grad_shard, param_shard)
        } else {
            (grads, params)
        };
        self.buffers[grad_shard as usize].layout = vec![layout];
        let exp_avg = self.flat(
            &format!("exp_avg:shard{k}"),
            BufferClass::OptState,
            *opt_offset,
            shard,
        );
        let exp_avg_sq = self.flat(
            &format!("exp_avg_sq:shard{k}"),
            BufferClass::OptState,
            *opt_offset + shard,
            shard,
        );
        *opt_offset += 2 * shard;
        let master = working.is_half().then(|| {
            let b = self.flat(
                &format!("master:shard{k}"),
                BufferClass::OptState,
                *opt_offset,
                shard,
            );
            *opt_offset += shard;
            b
        });
        Shard {
            k,
            n,
            axes,
            grad_shard,
            params,
            param_shard,
            exp_avg,
            exp_avg_sq,
            master,
        }
    }
}

/// Whether a parameter is an expert's (split over ep): it goes in the expert segments.
fn is_expert(e: &ParamEntry) -> bool {
    e.shards.iter().any(|a| a.contains(&Axis::Ep))
}

/// Whether a parameter is split over tp: it goes in a tp-split segment.
fn tp_split(e: &ParamEntry) -> bool {
    e.shards.iter().any(|a| a.contains(&Axis::Tp))
}

/// One segment of the flat arenas.
struct Segment {
    start: u64,
    padded: u64,
    split: bool,
    expert: bool,
}

/// A rank's shard of segment `k` and the buffers its update reads and writes.
struct Shard {
    k: usize,
    /// The size of the group the segment is sharded over.
    n: u64,
    /// The axes of that group (dp and cp, or edp for experts).
    axes: Vec<Axis>,
    grad_shard: BufId,
    /// The whole segment's parameters (the all-gather's output).
    params: BufId,
    param_shard: BufId,
    exp_avg: BufId,
    exp_avg_sq: BufId,
    /// The f32 master shard of 16-bit working weights (mixed precision).
    master: Option<BufId>,
}
