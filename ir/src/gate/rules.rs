//! The plan-level shape rules of the gate ([`op_rule`]): per kernel, the arity (from
//! [`OpKind::kernel_arity`], the table the runtime checks too), operand dtypes and local
//! shapes the runtime's kernel reads and writes. The graph-level rules (global shapes, named
//! dims) are `infer`'s; these are the local ones a rank's kernels index by, including the
//! collectives' group sizes.

use crate::op::{OpKind, WeightLayout};
use crate::plan::{BufId, Buffer, BufferClass, Plan};
use crate::types::{Axis, DType};

/// The plan-level shape rule of `op` on one rank's local shapes: arity, operand dtypes and
/// the shapes its kernel reads and writes. The graph-level rules (global shapes, named dims)
/// are `infer`'s; these are what the runtime's kernels index by.
pub fn op_rule(plan: &Plan, op: &OpKind, ins: &[BufId], outs: &[BufId]) -> Result<(), String> {
    let bufs = &plan.buffers;
    let b = |id: BufId| &bufs[id as usize];
    let sh = |id: BufId| -> &[u64] { &bufs[id as usize].shape };
    let n = |id: BufId| bufs[id as usize].len();
    let eq = |x: BufId, want: &[u64], what: &str| -> Result<(), String> {
        if sh(x) == want {
            Ok(())
        } else {
            Err(format!(
                "{what} (buffer {x}, {}) has shape {:?}, expected {want:?}",
                b(x).name,
                sh(x)
            ))
        }
    };
    let rank = |x: BufId, r: usize, what: &str| -> Result<(), String> {
        if sh(x).len() == r {
            Ok(())
        } else {
            Err(format!(
                "{what} (buffer {x}, {}) must have {r} dims, has shape {:?}",
                b(x).name,
                sh(x)
            ))
        }
    };
    let nonscalar = |x: BufId, what: &str| -> Result<u64, String> {
        match sh(x).last() {
            Some(&l) if l > 0 => Ok(l),
            _ => Err(format!(
                "{what} (buffer {x}, {}) needs a positive last dim, has shape {:?}",
                b(x).name,
                sh(x)
            )),
        }
    };
    let with_last = |x: BufId, last: u64| -> Vec<u64> {
        let mut s = sh(x).to_vec();
        if let Some(l) = s.last_mut() {
            *l = last;
        }
        s
    };
    let parts = |x: BufId, dim: usize, axis: Axis| -> u64 {
        if b(x).layout.get(dim).is_some_and(|a| a.contains(&axis)) {
            plan.mesh.size(axis)
        } else {
            1
        }
    };
    let group = |axes: &[Axis]| -> u64 {
        if axes.is_empty() {
            1
        } else {
            plan.mesh.group(0, axes).len() as u64
        }
    };
    // The step's position of KV-cache decoding: one i32 data input.
    let position = |x: BufId| -> Result<(), String> {
        if b(x).class == BufferClass::Input && b(x).dtype == DType::I32 && sh(x) == [1] {
            Ok(())
        } else {
            Err(format!(
                "the position (buffer {x}, {}) is {} {} {:?}, expected input i32 [1]",
                b(x).name,
                b(x).class.name(),
                b(x).dtype.as_str(),
                sh(x)
            ))
        }
    };
    // Operand dtypes: i32 where the kernel reads ids, indices or counts, f32 elsewhere.
    let int_ins: &[usize] = match op {
        OpKind::Embedding | OpKind::EmbeddingGrad => &[0],
        OpKind::CrossEntropy
        | OpKind::CrossEntropyGrad
        | OpKind::MoeAuxLoss { .. }
        | OpKind::MoeAuxLossGrad { .. }
        | OpKind::Dispatch { .. }
        | OpKind::DispatchGrad { .. }
        | OpKind::DispatchExperts { .. }
        | OpKind::DispatchExpertsGrad
        | OpKind::CombineExperts
        | OpKind::CombineExpertsGrad
        | OpKind::Combine
        | OpKind::CombineGrad
        | OpKind::AllToAll { .. } => &[1],
        OpKind::RopeAt { .. } => &[1],
        OpKind::PosEmbeddingAt => &[2],
        OpKind::KvAttention { .. } => &[3],
        _ => &[],
    };
    let int_outs: &[usize] = match op {
        OpKind::Router { .. } | OpKind::DispatchExperts { .. } => &[1],
        _ => &[],
    };
    for (k, &x) in ins.iter().enumerate() {
        let want = if int_ins.contains(&k) {
            DType::I32
        } else {
            DType::F32
        };
        let float = |d: DType| d != DType::I32;
        let fits = if want == DType::I32 {
            b(x).dtype == DType::I32
        } else {
            // An f32 input is only a patch's replacement, read by its `perturb`.
            float(b(x).dtype)
                && (b(x).class != BufferClass::Input
                    || matches!(op, OpKind::Perturb { .. }) && b(x).name.starts_with("patch:"))
        };
        if !fits {
            return Err(format!(
                "input {k} (buffer {x}, {}) is {} {}, expected {}",
                b(x).name,
                b(x).class.name(),
                b(x).dtype.as_str(),
                want.as_str()
            ));
        }
    }
    for (k, &x) in outs.iter().enumerate() {
        let int = int_outs.contains(&k);
        let ok = if int {
            b(x).dtype == DType::I32 && b(x).class == BufferClass::Activation
        } else {
            b(x).dtype != DType::I32 && b(x).class != BufferClass::Input
        };
        if !ok {
            return Err(format!(
                "output {k} (buffer {x}, {}) is {} {}, expected {}",
                b(x).name,
                b(x).class.name(),
                b(x).dtype.as_str(),
                if int { "activation i32" } else { "f32" }
            ));
        }
    }
    // The operand counts: `OpKind::kernel_arity`, the one table the runtime checks too.
    // Views are never instructions (their arm says so).
    let want = op.kernel_arity(ins.len());
    if !op.is_view() && !want.accepts(ins.len(), outs.len()) {
        return Err(format!(
            "takes {} inputs and {} outputs, the plan gives {} and {}",
            want.inputs_near(ins.len()),
            want.outputs,
            ins.len(),
            outs.len()
        ));
    }
    let vocab = plan.batch.vocab;
    match op {
        OpKind::Embedding | OpKind::EmbeddingGrad => {
            let grad = matches!(op, OpKind::EmbeddingGrad);
            rank(ins[1], 2, "embedding table")?;
            let (rows, h) = (sh(ins[1])[0], sh(ins[1])[1]);
            let vparts = parts(ins[1], 0, Axis::Tp);
            if rows == 0 || rows.saturating_mul(vparts) < vocab {
                return Err(format!(
                    "the embedding table (buffer {}) has {rows} rows{}, which do not cover the vocabulary of {vocab}",
                    ins[1],
                    if vparts > 1 { format!(" per rank over {vparts} ranks") } else { String::new() }
                ));
            }
            let mut y = sh(ins[0]).to_vec();
            y.push(h);
            if grad {
                eq(ins[2], &y, "the output gradient")?;
                eq(outs[0], sh(ins[1]), "the table gradient")
            } else {
                eq(outs[0], &y, "the output")
            }
        }
        OpKind::PosEmbedding | OpKind::PosEmbeddingGrad => {
            let grad = matches!(op, OpKind::PosEmbeddingGrad);
            let (x, wpe) = if grad {
                (ins[1], ins[0])
            } else {
                (ins[0], ins[1])
            };
            rank(x, 3, "the activations")?;
            rank(wpe, 2, "the position table")?;
            let s = sh(x)[1].saturating_mul(parts(x, 1, Axis::Cp));
            if sh(wpe)[0] < s || sh(wpe)[1] != sh(x)[2] {
                return Err(format!(
                    "the position table {:?} does not cover {s} positions of width {}",
                    sh(wpe),
                    sh(x)[2]
                ));
            }
            if grad {
                eq(outs[0], sh(wpe), "the table gradient")
            } else {
                eq(outs[0], sh(x), "the output")
            }
        }
        OpKind::Linear { weight } | OpKind::LinearGradInput { weight } => {
            let fwd = matches!(op, OpKind::Linear { .. });
            let x = ins[0];
            let kk = nonscalar(x, "the input")?;
            let w = sh(ins[1]);
            if w.len() != 2 && w.len() != 3 {
                return Err(format!(
                    "the weight (buffer {}) has shape {w:?}; expected 2 or 3 dims",
                    ins[1]
                ));
            }
            let g = if w.len() == 3 { w[0] } else { 1 };
            let (a, c) = (w[w.len() - 2], w[w.len() - 1]);
            let (w_in, w_out) = match weight {
                WeightLayout::OutIn => (c, a),
                WeightLayout::InOut => (a, c),
            };
            // Forward: x[.., in] -> y[.., out]; input gradient: dy[.., out] -> dx[.., in].
            let (from, to) = if fwd { (w_in, w_out) } else { (w_out, w_in) };
            if kk != from || g == 0 || (g > 1 && sh(x).first() != Some(&g)) {
                return Err(format!(
                    "the input {:?} does not match the weight {w:?} (w={})",
                    sh(x),
                    weight.as_str()
                ));
            }
            if let Some(&bias) = ins.get(2) {
                eq(bias, &[to], "the bias")?;
            }
            eq(outs[0], &with_last(x, to), "the output")
        }
        OpKind::LinearGradWeight { weight } => {
            let (x, dy) = (ins[0], ins[1]);
            let kk = nonscalar(x, "the input")?;
            let nn = nonscalar(dy, "the output gradient")?;
            if sh(x)[..sh(x).len() - 1] != sh(dy)[..sh(dy).len().saturating_sub(1)] {
                return Err(format!(
                    "the input {:?} and the output gradient {:?} disagree",
                    sh(x),
                    sh(dy)
                ));
            }
            let mat = match weight {
                WeightLayout::OutIn => vec![nn, kk],
                WeightLayout::InOut => vec![kk, nn],
            };
            let dw = sh(outs[0]);
            if dw.len() == 3 {
                let mut want = vec![dw[0]];
                want.extend(&mat);
                if dw[0] == 0 || sh(x).first() != Some(&dw[0]) {
                    return Err(format!(
                        "the weight gradient {dw:?} does not match the input {:?}",
                        sh(x)
                    ));
                }
                eq(outs[0], &want, "the weight gradient")
            } else {
                eq(outs[0], &mat, "the weight gradient")
            }
        }
        OpKind::RmsNorm { eps } | OpKind::LayerNorm { eps } => {
            positive(*eps, "eps")?;
            let h = nonscalar(ins[0], "the input")?;
            for &p in &ins[1..] {
                eq(p, &[h], "the norm parameter")?;
            }
            eq(outs[0], sh(ins[0]), "the output")
        }
        OpKind::RmsNormGrad { eps } | OpKind::LayerNormGrad { eps } => {
            positive(*eps, "eps")?;
            let h = nonscalar(ins[0], "the input")?;
            eq(ins[1], &[h], "the norm weight")?;
            eq(ins[2], sh(ins[0]), "the output gradient")?;
            eq(outs[0], sh(ins[0]), "the input gradient")?;
            for &o in &outs[1..] {
                eq(o, &[h], "the parameter gradient")?;
            }
            Ok(())
        }
        OpKind::Split { n: parts_n } => {
            let w = nonscalar(ins[0], "the input")?;
            if *parts_n == 0 || w % parts_n != 0 {
                return Err(format!(
                    "cannot split a last dim of {w} into {parts_n} parts"
                ));
            }
            for &o in outs {
                eq(o, &with_last(ins[0], w / parts_n), "a part")?;
            }
            Ok(())
        }
        OpKind::Concat => {
            if ins.is_empty() {
                return Err("takes at least one input".into());
            }
            let w = nonscalar(ins[0], "the first input")?;
            for &x in &ins[1..] {
                eq(x, sh(ins[0]), "an input")?;
            }
            eq(
                outs[0],
                &with_last(ins[0], w * ins.len() as u64),
                "the output",
            )
        }
        OpKind::Rope { theta, scaling } | OpKind::RopeGrad { theta, scaling } => {
            positive(*theta, "theta")?;
            if let Some(p) = scaling.as_ref().and_then(|s| s.problem()) {
                return Err(p);
            }
            rank(ins[0], 4, "the input [b, s, heads, head_dim]")?;
            if sh(ins[0])[3] % 2 != 0 {
                return Err(format!("head dim {} is odd", sh(ins[0])[3]));
            }
            eq(outs[0], sh(ins[0]), "the output")
        }
        OpKind::RopeAt { theta, scaling } => {
            positive(*theta, "theta")?;
            if let Some(p) = scaling.as_ref().and_then(|s| s.problem()) {
                return Err(p);
            }
            rank(ins[0], 4, "the input [b, s, heads, head_dim]")?;
            if sh(ins[0])[3] % 2 != 0 {
                return Err(format!("head dim {} is odd", sh(ins[0])[3]));
            }
            position(ins[1])?;
            eq(outs[0], sh(ins[0]), "the output")
        }
        OpKind::PosEmbeddingAt => {
            let (x, wpe) = (ins[0], ins[1]);
            rank(x, 3, "the activations")?;
            rank(wpe, 2, "the position table")?;
            if sh(wpe)[0] == 0 || sh(wpe)[1] != sh(x)[2] {
                return Err(format!(
                    "the position table {:?} has no rows of width {}",
                    sh(wpe),
                    sh(x)[2]
                ));
            }
            position(ins[2])?;
            eq(outs[0], sh(x), "the output")
        }
        OpKind::KvAttention { .. } => {
            let (q, k, v) = (ins[0], ins[1], ins[2]);
            rank(q, 4, "q")?;
            rank(k, 4, "k")?;
            eq(v, sh(k), "v")?;
            let (qs, ks) = (sh(q), sh(k));
            if qs[0] != 1
                || qs[0] != ks[0]
                || qs[1] != ks[1]
                || qs[3] != ks[3]
                || ks[2] == 0
                || qs[2] % ks[2] != 0
            {
                return Err(format!(
                    "q {qs:?} and k {ks:?} do not match (the cache holds one sequence: batch 1)"
                ));
            }
            if parts(q, 1, Axis::Cp) != parts(k, 1, Axis::Cp) {
                return Err("q and k are split differently over cp".into());
            }
            position(ins[3])?;
            eq(outs[0], qs, "the output")?;
            eq(outs[1], &[qs[0], qs[2], qs[1]], "the log-sum-exp")?;
            for (j, what) in [(2, "the key cache"), (3, "the value cache")] {
                let c = outs[j];
                if b(c).class != BufferClass::KvCache || b(c).dtype != b(k).dtype {
                    return Err(format!(
                        "{what} (buffer {c}, {}) is {} {}, expected kv_cache {}",
                        b(c).name,
                        b(c).class.name(),
                        b(c).dtype.as_str(),
                        b(k).dtype.as_str()
                    ));
                }
                rank(c, 3, what)?;
                if sh(c)[0] == 0 || sh(c)[1..] != ks[2..] {
                    return Err(format!(
                        "{what} (buffer {c}) has shape {:?}, expected [positions, {}, {}]",
                        sh(c),
                        ks[2],
                        ks[3]
                    ));
                }
            }
            Ok(())
        }
        OpKind::CausalAttention { .. } | OpKind::AttentionGrad { .. } => {
            let fwd = matches!(op, OpKind::CausalAttention { .. });
            let (q, k, v) = (ins[0], ins[1], ins[2]);
            rank(q, 4, "q")?;
            rank(k, 4, "k")?;
            eq(v, sh(k), "v")?;
            let (qs, ks) = (sh(q), sh(k));
            if qs[0] != ks[0]
                || qs[1] != ks[1]
                || qs[3] != ks[3]
                || ks[2] == 0
                || qs[2] % ks[2] != 0
            {
                return Err(format!("q {qs:?} and k {ks:?} do not match"));
            }
            if parts(q, 1, Axis::Cp) != parts(k, 1, Axis::Cp) {
                return Err("q and k are split over cp differently".into());
            }
            let lse = [qs[0], qs[2], qs[1]];
            if fwd {
                eq(outs[0], qs, "the output")?;
                eq(outs[1], &lse, "the log-sum-exp")
            } else {
                eq(ins[3], qs, "the output")?;
                eq(ins[4], &lse, "the log-sum-exp")?;
                eq(ins[5], qs, "the output gradient")?;
                eq(outs[0], qs, "dq")?;
                eq(outs[1], ks, "dk")?;
                eq(outs[2], ks, "dv")
            }
        }
        OpKind::Cast { to } => {
            if *to == DType::I32 || b(outs[0]).dtype != *to {
                return Err(format!(
                    "casts to {} into a {} buffer",
                    to.as_str(),
                    b(outs[0]).dtype.as_str()
                ));
            }
            eq(outs[0], sh(ins[0]), "the output")
        }
        OpKind::Add | OpKind::SwiGlu => {
            eq(ins[1], sh(ins[0]), "the second operand")?;
            eq(outs[0], sh(ins[0]), "the output")
        }
        OpKind::GradSum => {
            for &x in ins {
                if n(x) != n(outs[0]) {
                    return Err(format!(
                        "input (buffer {x}) has {} elements, the output {}",
                        n(x),
                        n(outs[0])
                    ));
                }
            }
            Ok(())
        }
        OpKind::RepeatKv { n: r } | OpKind::RepeatKvGrad { n: r } => {
            rank(ins[0], 4, "the heads tensor")?;
            let mut y = sh(ins[0]).to_vec();
            if *r == 0 || y[3] == 0 {
                return Err(format!("repeats {r} times heads of width {}", y[3]));
            }
            if matches!(op, OpKind::RepeatKv { .. }) {
                y[2] = y[2].checked_mul(*r).ok_or("too many heads")?;
            } else {
                if y[2] % r != 0 {
                    return Err(format!("{} heads are not a multiple of {r}", y[2]));
                }
                y[2] /= r;
            }
            eq(outs[0], &y, "the output")
        }
        OpKind::BiasAdd => {
            let h = nonscalar(ins[0], "the input")?;
            eq(ins[1], &[h], "the bias")?;
            eq(outs[0], sh(ins[0]), "the output")
        }
        OpKind::BiasGrad => {
            let h = nonscalar(ins[0], "the gradient")?;
            eq(outs[0], &[h], "the bias gradient")
        }
        OpKind::GeluTanh | OpKind::Probe { .. } => eq(outs[0], sh(ins[0]), "the output"),
        OpKind::Perturb { .. } => {
            if let Some(&r) = ins.get(1) {
                eq(r, sh(ins[0]), "the replacement")?;
            }
            eq(outs[0], sh(ins[0]), "the output")
        }
        OpKind::GeluTanhGrad => {
            eq(ins[1], sh(ins[0]), "the output gradient")?;
            eq(outs[0], sh(ins[0]), "the input gradient")
        }
        OpKind::SigmoidMul | OpKind::SigmoidMulGrad => {
            let (g, y) = (sh(ins[0]), sh(ins[1]));
            if g.last() != Some(&1) || g.len() != y.len() || g[..g.len() - 1] != y[..y.len() - 1] {
                return Err(format!(
                    "the gate {g:?} must be the value's {y:?} with a last dim of 1"
                ));
            }
            if matches!(op, OpKind::SigmoidMul) {
                eq(outs[0], y, "the output")
            } else {
                eq(ins[2], y, "the output gradient")?;
                eq(outs[0], g, "the gate gradient")?;
                eq(outs[1], y, "the value gradient")
            }
        }
        OpKind::SwiGluGrad => {
            eq(ins[1], sh(ins[0]), "up")?;
            eq(ins[2], sh(ins[0]), "the output gradient")?;
            eq(outs[0], sh(ins[0]), "the gate gradient")?;
            eq(outs[1], sh(ins[0]), "the up gradient")
        }
        OpKind::CrossEntropy | OpKind::CrossEntropyGrad => {
            let (logits, labels) = (ins[0], ins[1]);
            let v = nonscalar(logits, "the logits")?;
            let ls = sh(logits);
            if ls[..ls.len() - 1] != *sh(labels) {
                return Err(format!(
                    "the logits {ls:?} do not match the labels {:?}",
                    sh(labels)
                ));
            }
            let vparts = parts(logits, ls.len() - 1, Axis::Tp);
            if v.saturating_mul(vparts) < vocab {
                return Err(format!(
                    "the logits (buffer {logits}) have {v} columns{}, which do not cover the vocabulary of {vocab}",
                    if vparts > 1 { format!(" per rank over {vparts} ranks") } else { String::new() }
                ));
            }
            if matches!(op, OpKind::CrossEntropy) {
                scalar(outs[0], b(outs[0]), "the loss")
            } else {
                eq(outs[0], ls, "the logits gradient")
            }
        }
        OpKind::GradNorm { .. } => {
            if ins.is_empty() {
                return Err("takes at least one gradient".into());
            }
            scalar(outs[0], b(outs[0]), "the norm")
        }
        OpKind::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
            max_norm,
            master: _,
            ..
        } => {
            for (v, what) in [(*beta1, "beta1"), (*beta2, "beta2")] {
                if !(0.0..1.0).contains(&v) {
                    return Err(format!("{what} = {v} is not in [0, 1)"));
                }
            }
            positive(*eps, "eps")?;
            if !(weight_decay.is_finite() && *weight_decay >= 0.0 && max_norm.is_finite()) {
                return Err(format!(
                    "weight_decay {weight_decay} and max_norm {max_norm} must be finite"
                ));
            }
            if ins[0] != outs[0] {
                return Err("updates its parameter in place: input 0 is output 0".into());
            }
            // The parameter, its gradient and the AdamW state (with the master copy): each
            // in its arena; all but the working weight in f32, whatever that is.
            let operands: Vec<(BufId, BufferClass, &str)> = [
                (outs[0], BufferClass::Param, "the parameter"),
                (ins[1], BufferClass::Grad, "the gradient"),
                (outs[1], BufferClass::OptState, "the first moment"),
                (outs[2], BufferClass::OptState, "the second moment"),
            ]
            .into_iter()
            .chain(
                outs.get(3)
                    .map(|&m| (m, BufferClass::OptState, "the master copy")),
            )
            .collect();
            for &(x, _, what) in &operands[1..] {
                if b(x).dtype != DType::F32 {
                    return Err(format!(
                        "{what} (buffer {x}, {}) is {}, expected f32",
                        b(x).name,
                        b(x).dtype.as_str()
                    ));
                }
            }
            for &(x, class, what) in &operands {
                if b(x).class != class {
                    return Err(format!(
                        "{what} (buffer {x}, {}) is in the {} arena, expected {}",
                        b(x).name,
                        b(x).class.name(),
                        class.name()
                    ));
                }
            }
            for &x in [ins[1]].iter().chain(outs) {
                if n(x) != n(outs[0]) {
                    return Err(format!(
                        "buffer {x} has {} elements, the parameter {}",
                        n(x),
                        n(outs[0])
                    ));
                }
            }
            scalar(ins[2], b(ins[2]), "the norm")
        }
        OpKind::AllReduce { .. } => eq(outs[0], sh(ins[0]), "the output"),
        OpKind::Slice { axes, dim }
        | OpKind::AllGather { axes, dim }
        | OpKind::ReduceScatter { axes, dim } => {
            let members = group(axes);
            // The sharded side and the whole side.
            let (local, whole) = match op {
                OpKind::AllGather { .. } => (ins[0], outs[0]),
                _ => (outs[0], ins[0]),
            };
            let d = *dim as usize;
            if d >= sh(local).len() {
                return Err(format!("dim {d} of a {}-d buffer", sh(local).len()));
            }
            let mut want = sh(local).to_vec();
            want[d] = want[d].checked_mul(members).ok_or("too large")?;
            eq(whole, &want, &format!("the whole (over {members} ranks)"))
        }
        OpKind::SplitHeads { .. } | OpKind::MergeHeads => {
            Err("is a view and never an instruction".into())
        }
        OpKind::Router { top_k, .. } | OpKind::RouterGrad { top_k, .. } => {
            let fwd = matches!(op, OpKind::Router { .. });
            rank(ins[0], 3, "the router logits")?;
            let e = sh(ins[0])[2];
            if *top_k == 0 || *top_k > e {
                return Err(format!(
                    "top_k {top_k} must be between 1 and the {e} experts"
                ));
            }
            let w = with_last(ins[0], *top_k);
            if fwd {
                eq(outs[0], &w, "the weights")?;
                eq(outs[1], &w, "the indices")
            } else {
                eq(ins[1], &w, "the weights gradient")?;
                eq(outs[0], sh(ins[0]), "the logits gradient")
            }
        }
        OpKind::MoeAuxLoss { coeff } | OpKind::MoeAuxLossGrad { coeff } => {
            if !coeff.is_finite() {
                return Err(format!("coeff {coeff} is not finite"));
            }
            rank(ins[0], 3, "the router logits")?;
            rank(ins[1], 3, "the indices")?;
            let (l, i) = (sh(ins[0]), sh(ins[1]));
            if l[..2] != i[..2] || i[2] == 0 || i[2] > l[2] {
                return Err(format!(
                    "the router logits {l:?} and indices {i:?} disagree"
                ));
            }
            if matches!(op, OpKind::MoeAuxLoss { .. }) {
                scalar(outs[0], b(outs[0]), "the loss")
            } else {
                eq(outs[0], l, "the logits gradient")
            }
        }
        OpKind::Dispatch { .. } => {
            let (x, _) = tokens_and_indices(plan, ins[0], ins[1])?;
            rank(outs[0], 2, "the expert tokens")?;
            if sh(outs[0])[1] != x[2] {
                return Err(format!(
                    "the expert tokens {:?} are not of width {}",
                    sh(outs[0]),
                    x[2]
                ));
            }
            Ok(())
        }
        OpKind::DispatchGrad { .. } => {
            rank(ins[0], 2, "the expert gradient")?;
            rank(ins[1], 3, "the indices")?;
            let i = sh(ins[1]);
            eq(outs[0], &[i[0], i[1], sh(ins[0])[1]], "the token gradient")
        }
        OpKind::DispatchExperts { experts, .. } => {
            let (x, _) = tokens_and_indices(plan, ins[0], ins[1])?;
            rank(outs[0], 3, "the expert tokens")?;
            let o = sh(outs[0]);
            if o[0] != *experts || o[2] != x[2] || *experts == 0 {
                return Err(format!(
                    "the expert tokens {o:?} are not [{experts}, rows, {}]",
                    x[2]
                ));
            }
            eq(outs[1], &[*experts], "the token counts")
        }
        OpKind::DispatchExpertsGrad => {
            rank(ins[0], 3, "the expert gradients")?;
            rank(ins[1], 3, "the indices")?;
            let (d, i) = (sh(ins[0]), sh(ins[1]));
            if d[0] == 0 {
                return Err("no experts".into());
            }
            eq(outs[0], &[i[0], i[1], d[2]], "the token gradient")
        }
        OpKind::CombineExperts | OpKind::CombineExpertsGrad => {
            let fwd = matches!(op, OpKind::CombineExperts);
            rank(ins[0], 3, "the router weights")?;
            eq(ins[1], sh(ins[0]), "the indices")?;
            rank(ins[2], 3, "the expert outputs")?;
            let (w, y) = (sh(ins[0]), sh(ins[2]));
            if y[0] == 0 || y[2] == 0 {
                return Err(format!("the expert outputs {y:?} are empty"));
            }
            let tokens = [w[0], w[1], y[2]];
            if fwd {
                eq(outs[0], &tokens, "the output")
            } else {
                eq(ins[3], &tokens, "the output gradient")?;
                eq(outs[0], w, "the weights gradient")?;
                eq(outs[1], y, "the expert gradients")
            }
        }
        OpKind::Combine | OpKind::CombineGrad => {
            let fwd = matches!(op, OpKind::Combine);
            let experts = if fwd {
                ins.len().saturating_sub(2)
            } else {
                ins.len().saturating_sub(3)
            };
            rank(ins[0], 3, "the router weights")?;
            eq(ins[1], sh(ins[0]), "the indices")?;
            rank(ins[2], 2, "an expert output")?;
            let y = sh(ins[2]).to_vec();
            if y[1] == 0 {
                return Err("expert outputs of width 0".into());
            }
            for &e in &ins[2..2 + experts] {
                eq(e, &y, "an expert output")?;
            }
            let w = sh(ins[0]);
            let tokens = [w[0], w[1], y[1]];
            if fwd {
                eq(outs[0], &tokens, "the output")
            } else {
                eq(ins[2 + experts], &tokens, "the output gradient")?;
                eq(outs[0], w, "the weights gradient")?;
                for &o in &outs[1..] {
                    eq(o, &y, "an expert gradient")?;
                }
                Ok(())
            }
        }
        OpKind::AllToAll {
            axes,
            split,
            concat,
        } => {
            rank(ins[0], 3, "the expert tokens")?;
            rank(outs[0], 3, "the output")?;
            let (x, y) = (sh(ins[0]), sh(outs[0]));
            if *split > 1 || *concat > 1 || split == concat || x[2] != y[2] {
                return Err(format!(
                    "moves [experts, tokens, h] buffers (split 0/1, concat 1/0), the plan gives {x:?} -> {y:?} (split {split}, concat {concat})"
                ));
            }
            let members = group(axes);
            let e = n(ins[1]);
            let experts = if *split == 0 { x[0] } else { y[0] };
            if e == 0 || e % members != 0 || e != experts {
                return Err(format!(
                    "{e} token counts for {experts} experts over {members} ranks"
                ));
            }
            let local = e / members;
            // The experts' side holds every member's rows of its local experts (bounded by
            // the tokens side's rows, which the runtime checks the counts against).
            let (local_side, full_side) = if *split == 0 { (y, x) } else { (x, y) };
            if local_side[0] != local
                || full_side[1] == 0
                || local_side[1] < full_side[1].saturating_mul(members)
            {
                return Err(format!(
                    "the exchange over {members} ranks does not map {x:?} to {y:?}"
                ));
            }
            Ok(())
        }
    }
}

fn positive(v: f64, what: &str) -> Result<(), String> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(format!("{what} = {v} must be positive and finite"))
    }
}

fn scalar(id: BufId, b: &Buffer, what: &str) -> Result<(), String> {
    if b.len() == 1 {
        Ok(())
    } else {
        Err(format!(
            "{what} (buffer {id}, {}) must be a scalar, has shape {:?}",
            b.name, b.shape
        ))
    }
}

/// MoE: tokens `[b, s, h]` and router indices `[b, s, top_k]` of the same tokens.
fn tokens_and_indices(plan: &Plan, x: BufId, idx: BufId) -> Result<(Vec<u64>, Vec<u64>), String> {
    let (xs, is) = (
        plan.buffers[x as usize].shape.clone(),
        plan.buffers[idx as usize].shape.clone(),
    );
    if xs.len() != 3 || is.len() != 3 || xs[..2] != is[..2] || is[2] == 0 || xs[2] == 0 {
        return Err(format!(
            "the tokens {xs:?} and the indices {is:?} are not [b, s, h] and [b, s, top_k]"
        ));
    }
    Ok((xs, is))
}
