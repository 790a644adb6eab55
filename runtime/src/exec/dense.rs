//! Dense kernels: embeddings, linear layers, norms, element-wise ops, the loss, and their
//! backward ops (the vocab-parallel loss reduces its statistics over tp inside the kernel).

use super::*;

/// Run one of this family's kernels (`run_kernel` routes only these ops here and has checked
/// their arity).
pub(super) fn run(
    op: &OpKind,
    ins: &[BufId],
    outs: &[BufId],
    env: &Env,
    comm: &mut dyn Communicator,
) -> Result<(), RuntimeError> {
    let (mem, tokens, mesh) = (env.mem, env.tokens, env.mesh);
    match op {
        OpKind::Embedding => {
            match tp_split(mem, ins[1], 0, mesh, comm.rank()) {
                None => k::embedding_fwd(
                    mem.i32(ins[0]),
                    mem.f32(ins[1]),
                    last(mem, ins[1]),
                    mem.f32_mut(outs[0]),
                ),
                Some((start, rows)) => {
                    // Vocab-parallel: rows outside this rank's slice contribute zero.
                    let (ids, table, out) =
                        (mem.i32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
                    let h = last(mem, ins[1]);
                    for (&id, row) in ids.iter().zip(out.chunks_exact_mut(h)) {
                        let local = id as i64 - start as i64;
                        if (0..rows as i64).contains(&local) {
                            let l = local as usize;
                            row.copy_from_slice(&table[l * h..(l + 1) * h]);
                        } else {
                            row.fill(0.0);
                        }
                    }
                }
            }
        }
        OpKind::PosEmbeddingAt => {
            let h = shape(mem, ins[0]).last().copied().unwrap_or(0) as usize;
            let pos = super::attention::step_positions(mem, ins[0], ins[2], env.mesh, comm.rank());
            k::kv::add_positions(
                mem.f32(ins[0]),
                mem.f32(ins[1]),
                &pos,
                h,
                mem.f32_mut(outs[0]),
            );
        }
        OpKind::PosEmbedding => {
            let s = shape(mem, ins[0]);
            let (b, sl, h) = (s[0] as usize, s[1] as usize, s[2] as usize);
            match cp_positions(mem, ins[0], 1, mesh, comm.rank()) {
                None => k::pos_embedding_fwd(
                    mem.f32(ins[0]),
                    mem.f32(ins[1]),
                    b,
                    sl,
                    h,
                    mem.f32_mut(outs[0]),
                ),
                Some(pos) => {
                    let (x, wpe, y) = (mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
                    for bi in 0..b {
                        for (i, &p) in pos.local.iter().enumerate() {
                            let at = (bi * sl + i) * h;
                            let w = &wpe[p as usize * h..(p as usize + 1) * h];
                            k::add_fwd(&x[at..at + h], w, &mut y[at..at + h]);
                        }
                    }
                }
            }
        }
        OpKind::Linear { weight } => {
            let (kk, n) = (last(mem, ins[0]), last(mem, outs[0]));
            // Stacked experts: one matrix per expert, over that expert's rows.
            let g = experts_of(mem, ins[1]);
            let m = numel(mem, ins[0]) / kk.max(1) / g;
            let bias = ins.get(2).map(|&b| mem.f32(b));
            let (x, w, y) = (mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
            for ((x, w), y) in x
                .chunks_exact(m * kk)
                .zip(w.chunks_exact(kk * n))
                .zip(y.chunks_exact_mut(m * n))
            {
                k::linear_fwd(x, w, bias, y, m, kk, n, layout(*weight));
            }
        }
        OpKind::RmsNorm { eps } => {
            let h = last(mem, ins[0]);
            k::rms_norm_fwd(
                mem.f32(ins[0]),
                mem.f32(ins[1]),
                *eps as f32,
                numel(mem, ins[0]) / h,
                h,
                mem.f32_mut(outs[0]),
            );
        }
        OpKind::LayerNorm { eps } => {
            let h = last(mem, ins[0]);
            k::layer_norm_fwd(
                mem.f32(ins[0]),
                mem.f32(ins[1]),
                mem.f32(ins[2]),
                *eps as f32,
                numel(mem, ins[0]) / h,
                h,
                mem.f32_mut(outs[0]),
            );
        }
        OpKind::Split { n } => {
            let (x, width) = (mem.f32(ins[0]), last(mem, ins[0]));
            let d = width / *n as usize;
            for (p, &o) in outs.iter().enumerate() {
                let y = mem.f32_mut(o);
                for (row, dst) in y.chunks_exact_mut(d).enumerate() {
                    dst.copy_from_slice(&x[row * width + p * d..row * width + (p + 1) * d]);
                }
            }
        }
        OpKind::Concat => {
            let y = mem.f32_mut(outs[0]);
            let width = last(mem, outs[0]);
            let d = width / ins.len().max(1);
            for (p, &i) in ins.iter().enumerate() {
                for (row, src) in mem.f32(i).chunks_exact(d).enumerate() {
                    y[row * width + p * d..row * width + (p + 1) * d].copy_from_slice(src);
                }
            }
        }
        OpKind::Cast { .. } => {
            mem.f32_mut(outs[0]).copy_from_slice(mem.f32(ins[0]));
        }
        OpKind::Add => {
            k::add_fwd(mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
        }
        OpKind::BiasAdd => {
            let (x, b, y) = (mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
            let n = b.len();
            for (yr, xr) in y.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
                k::add_fwd(xr, b, yr);
            }
        }
        OpKind::GradSum => {
            // Two contributions (autodiff), or one added into a gradient (the pipeline's
            // tied-parameter reduction).
            let y = mem.f32_mut(outs[0]);
            for &x in ins {
                k::accumulate(y, mem.f32(x));
            }
        }
        OpKind::SwiGlu => {
            k::swiglu_fwd(mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
        }
        OpKind::SigmoidMul => {
            let h = last(mem, ins[1]);
            k::sigmoid_mul_fwd(mem.f32(ins[0]), mem.f32(ins[1]), h, mem.f32_mut(outs[0]));
        }
        OpKind::GeluTanh => {
            k::gelu_tanh_fwd(mem.f32(ins[0]), mem.f32_mut(outs[0]));
        }
        OpKind::CrossEntropy => {
            let v = last(mem, ins[0]);
            let rank_dims = mem.buffer(ins[0]).shape.len();
            let sum = match tp_split(mem, ins[0], rank_dims - 1, mesh, comm.rank()) {
                None => k::cross_entropy_fwd(
                    mem.f32(ins[0]),
                    mem.i32(ins[1]),
                    numel(mem, ins[0]) / v,
                    v,
                ),
                Some((start, _)) => {
                    let members = mesh.group(comm.rank(), &[megac_ir::Axis::Tp]);
                    let stats = vocab_parallel_stats(
                        mem.f32(ins[0]),
                        mem.i32(ins[1]),
                        v,
                        start,
                        env.vocab,
                        &members,
                        comm,
                    )?;
                    stats.iter().map(|s| f64::from(s.lse - s.target)).sum()
                }
            };
            mem.f32_mut(outs[0])[0] = (sum / tokens) as f32;
        }
        OpKind::EmbeddingGrad => match tp_split(mem, ins[1], 0, mesh, comm.rank()) {
            None => k::embedding_bwd(
                mem.i32(ins[0]),
                mem.f32(ins[2]),
                last(mem, ins[1]),
                mem.f32_mut(outs[0]),
            ),
            Some((start, rows)) => {
                let (ids, dy, dt) = (mem.i32(ins[0]), mem.f32(ins[2]), mem.f32_mut(outs[0]));
                let h = last(mem, ins[1]);
                for (&id, row) in ids.iter().zip(dy.chunks_exact(h)) {
                    let local = id as i64 - start as i64;
                    if (0..rows as i64).contains(&local) {
                        let l = local as usize;
                        k::accumulate(&mut dt[l * h..(l + 1) * h], row);
                    }
                }
            }
        },
        OpKind::PosEmbeddingGrad => {
            let s = shape(mem, ins[1]);
            let (b, sl, h) = (s[0] as usize, s[1] as usize, s[2] as usize);
            let (dy, dwpe) = (mem.f32(ins[1]), mem.f32_mut(outs[0]));
            match cp_positions(mem, ins[1], 1, mesh, comm.rank()) {
                None => {
                    for bi in 0..b {
                        k::accumulate(&mut dwpe[..sl * h], &dy[bi * sl * h..(bi + 1) * sl * h]);
                    }
                }
                Some(pos) => {
                    for bi in 0..b {
                        for (i, &p) in pos.local.iter().enumerate() {
                            let at = (bi * sl + i) * h;
                            k::accumulate(
                                &mut dwpe[p as usize * h..(p as usize + 1) * h],
                                &dy[at..at + h],
                            );
                        }
                    }
                }
            }
        }
        OpKind::LinearGradInput { weight } => {
            let (n, kk) = (last(mem, ins[0]), last(mem, outs[0]));
            let g = experts_of(mem, ins[1]);
            let m = numel(mem, ins[0]) / n.max(1) / g;
            let (dy, w, dx) = (mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
            for ((dy, w), dx) in dy
                .chunks_exact(m * n)
                .zip(w.chunks_exact(kk * n))
                .zip(dx.chunks_exact_mut(m * kk))
            {
                k::linear_bwd_data(dy, w, dx, m, kk, n, layout(*weight));
            }
        }
        OpKind::LinearGradWeight { weight } => {
            let (kk, n) = (last(mem, ins[0]), last(mem, ins[1]));
            let g = experts_of(mem, outs[0]);
            let m = numel(mem, ins[0]) / kk.max(1) / g;
            let (x, dy, dw) = (mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
            for ((x, dy), dw) in x
                .chunks_exact(m * kk)
                .zip(dy.chunks_exact(m * n))
                .zip(dw.chunks_exact_mut(kk * n))
            {
                k::linear_bwd_weight(x, dy, dw, None, m, kk, n, layout(*weight));
            }
        }
        OpKind::BiasGrad => {
            let n = last(mem, ins[0]);
            let db = mem.f32_mut(outs[0]);
            for row in mem.f32(ins[0]).chunks_exact(n) {
                k::accumulate(db, row);
            }
        }
        OpKind::RmsNormGrad { eps } => {
            let h = last(mem, ins[0]);
            k::rms_norm_bwd(
                mem.f32(ins[0]),
                mem.f32(ins[1]),
                mem.f32(ins[2]),
                *eps as f32,
                numel(mem, ins[0]) / h,
                h,
                mem.f32_mut(outs[0]),
                mem.f32_mut(outs[1]),
            );
        }
        OpKind::LayerNormGrad { eps } => {
            let h = last(mem, ins[0]);
            k::layer_norm_bwd(
                mem.f32(ins[0]),
                mem.f32(ins[1]),
                mem.f32(ins[2]),
                *eps as f32,
                numel(mem, ins[0]) / h,
                h,
                mem.f32_mut(outs[0]),
                mem.f32_mut(outs[1]),
                mem.f32_mut(outs[2]),
            );
        }
        OpKind::SwiGluGrad => {
            k::swiglu_bwd(
                mem.f32(ins[0]),
                mem.f32(ins[1]),
                mem.f32(ins[2]),
                mem.f32_mut(outs[0]),
                mem.f32_mut(outs[1]),
            );
        }
        OpKind::SigmoidMulGrad => {
            let h = last(mem, ins[1]);
            k::sigmoid_mul_bwd(
                mem.f32(ins[0]),
                mem.f32(ins[1]),
                mem.f32(ins[2]),
                h,
                mem.f32_mut(outs[0]),
                mem.f32_mut(outs[1]),
            );
        }
        OpKind::GeluTanhGrad => {
            k::gelu_tanh_bwd(mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
        }
        OpKind::CrossEntropyGrad => {
            let v = last(mem, ins[0]);
            let rank_dims = mem.buffer(ins[0]).shape.len();
            if let Some((start, _)) = tp_split(mem, ins[0], rank_dims - 1, mesh, comm.rank()) {
                let members = mesh.group(comm.rank(), &[megac_ir::Axis::Tp]);
                let (logits, labels) = (mem.f32(ins[0]), mem.i32(ins[1]));
                let stats =
                    vocab_parallel_stats(logits, labels, v, start, env.vocab, &members, comm)?;
                let real = real_columns(v, start, env.vocab);
                let scale = (env.ctx.loss_scale / tokens) as f32;
                let dl = mem.f32_mut(outs[0]);
                for (row, ((x, d), st)) in logits
                    .chunks_exact(v)
                    .zip(dl.chunks_exact_mut(v))
                    .zip(&stats)
                    .enumerate()
                {
                    for (j, (&xj, dj)) in x[..real].iter().zip(d.iter_mut()).enumerate() {
                        *dj += scale * (xj - st.lse).exp();
                        if labels[row] as i64 - start as i64 == j as i64 {
                            *dj -= scale;
                        }
                    }
                }
                return Ok(());
            }
            k::cross_entropy_bwd(
                mem.f32(ins[0]),
                mem.i32(ins[1]),
                numel(mem, ins[0]) / v,
                v,
                (env.ctx.loss_scale / tokens) as f32,
                mem.f32_mut(outs[0]),
            );
        }
        _ => unreachable!("run_kernel routes `{}` elsewhere", op.name()),
    }
    Ok(())
}
