//! Shape inference: the one place that knows each op's typing rule.
//!
//! The builder calls it to type new ops, the parser to type parsed ops, and the verifier to
//! check that every recorded type still agrees with its rule.

use crate::op::{OpKind, WeightLayout};
use crate::types::{DType, Dim, TensorType};

/// Result types of `kind` applied to operands of types `ins`, or why the operands are wrong.
pub fn infer_types(kind: &OpKind, ins: &[&TensorType]) -> Result<Vec<TensorType>, String> {
    let expect_arity = |n: usize| -> Result<(), String> {
        if ins.len() == n {
            Ok(())
        } else {
            Err(format!("expects {n} operands, got {}", ins.len()))
        }
    };
    match kind {
        OpKind::Embedding => {
            expect_arity(2)?;
            let (tokens, table) = (ins[0], ins[1]);
            want_dtype(tokens, DType::I32, "token ids")?;
            want_rank(table, 2, "embedding table")?;
            let mut dims = tokens.dims.clone();
            dims.push(table.dims[1].clone());
            Ok(vec![TensorType::new(table.dtype, dims)])
        }
        OpKind::PosEmbedding => {
            expect_arity(2)?;
            let (x, wpe) = (ins[0], ins[1]);
            want_rank(x, 3, "activations")?;
            want_rank(wpe, 2, "position table")?;
            if wpe.dims[0].size < x.dims[1].size || wpe.dims[1] != x.dims[2] {
                return Err(format!(
                    "position table {} does not cover activations {}",
                    shape_str(wpe),
                    shape_str(x)
                ));
            }
            Ok(vec![x.clone().replicate()])
        }
        OpKind::Linear { weight } => {
            if ins.len() != 2 && ins.len() != 3 {
                return Err(format!("expects 2 or 3 operands, got {}", ins.len()));
            }
            let (x, w) = (ins[0], ins[1]);
            let w = &expert_weight(x, w)?;
            if x.dims.is_empty() {
                return Err("input is a scalar".into());
            }
            let (in_dim, out_dim) = match weight {
                WeightLayout::OutIn => (&w.dims[1], &w.dims[0]),
                WeightLayout::InOut => (&w.dims[0], &w.dims[1]),
            };
            if x.last() != in_dim {
                return Err(format!(
                    "input's last dim {} does not match the weight's input dim {} (weight {}, w={})",
                    x.last(),
                    in_dim,
                    shape_str(w),
                    weight.as_str()
                ));
            }
            if let Some(b) = ins.get(2) {
                if b.dims.len() != 1 || &b.dims[0] != out_dim {
                    return Err(format!(
                        "bias {} does not match output dim {}",
                        shape_str(b),
                        out_dim
                    ));
                }
            }
            let mut dims = x.dims.clone();
            *dims.last_mut().expect("checked non-scalar") = out_dim.clone();
            Ok(vec![TensorType::new(x.dtype, dims)])
        }
        OpKind::RmsNorm { eps } | OpKind::LayerNorm { eps } => {
            let n = if matches!(kind, OpKind::RmsNorm { .. }) {
                2
            } else {
                3
            };
            expect_arity(n)?;
            if eps.is_nan() || *eps <= 0.0 {
                return Err(format!("eps must be positive, got {eps}"));
            }
            let x = ins[0];
            if x.dims.is_empty() {
                return Err("input is a scalar".into());
            }
            for p in &ins[1..] {
                if p.dims.len() != 1 || &p.dims[0] != x.last() {
                    return Err(format!(
                        "norm parameter {} does not match the normalised dim {}",
                        shape_str(p),
                        x.last()
                    ));
                }
            }
            Ok(vec![x.clone().replicate()])
        }
        OpKind::SplitHeads { n } => {
            expect_arity(1)?;
            let x = ins[0];
            if x.dims.is_empty() {
                return Err("input is a scalar".into());
            }
            let last = x.last();
            let Some((a, b)) = last.name.split_once('*') else {
                return Err(format!("last dim {last} is not a product `a*b`"));
            };
            if *n == 0 || !last.size.is_multiple_of(*n) {
                return Err(format!("cannot split {last} into {n} heads"));
            }
            let mut dims = x.dims[..x.dims.len() - 1].to_vec();
            dims.push(Dim::new(a, *n));
            dims.push(Dim::new(b, last.size / n));
            Ok(vec![TensorType::new(x.dtype, dims)])
        }
        OpKind::MergeHeads => {
            expect_arity(1)?;
            let x = ins[0];
            if x.dims.len() < 2 {
                return Err("input needs at least 2 dims".into());
            }
            let k = x.dims.len();
            let (a, b) = (&x.dims[k - 2], &x.dims[k - 1]);
            let mut dims = x.dims[..k - 2].to_vec();
            dims.push(Dim::new(format!("{}*{}", a.name, b.name), a.size * b.size));
            Ok(vec![TensorType::new(x.dtype, dims)])
        }
        OpKind::Split { n } => {
            expect_arity(1)?;
            let x = ins[0];
            if x.dims.is_empty() {
                return Err("input is a scalar".into());
            }
            let last = x.last();
            let prefix = format!("{n}*");
            let Some(rest) = last.name.strip_prefix(&prefix) else {
                return Err(format!("last dim {last} is not named `{n}*...`"));
            };
            if *n == 0 || !last.size.is_multiple_of(*n) {
                return Err(format!("cannot split {last} into {n} parts"));
            }
            let mut dims = x.dims.clone();
            *dims.last_mut().expect("checked non-scalar") = Dim::new(rest, last.size / n);
            let part = TensorType::new(x.dtype, dims);
            Ok(vec![part; *n as usize])
        }
        OpKind::Concat => {
            if ins.is_empty() {
                return Err("expects at least one operand".into());
            }
            let first = ins[0];
            if first.dims.is_empty() {
                return Err("operands are scalars".into());
            }
            for x in ins {
                if x.dims != first.dims || x.dtype != first.dtype {
                    return Err(format!(
                        "operands differ: {} vs {}",
                        first.dtype_shape(),
                        x.dtype_shape()
                    ));
                }
            }
            let n = ins.len() as u64;
            let last = first.last();
            let mut dims = first.dims.clone();
            *dims.last_mut().expect("checked non-scalar") =
                Dim::new(format!("{n}*{}", last.name), last.size * n);
            Ok(vec![TensorType::new(first.dtype, dims)])
        }
        OpKind::Rope { theta, scaling } | OpKind::RopeGrad { theta, scaling } => {
            expect_arity(1)?;
            if let Some(p) = scaling.as_ref().and_then(|s| s.problem()) {
                return Err(p);
            }
            want_rank(ins[0], 4, "rope input [b, s, heads, head_dim]")?;
            if !ins[0].last().size.is_multiple_of(2) {
                return Err(format!("head dim {} is odd", ins[0].last()));
            }
            if theta.is_nan() || *theta <= 0.0 {
                return Err(format!("theta must be positive, got {theta}"));
            }
            Ok(vec![ins[0].clone().replicate()])
        }
        OpKind::RopeAt { .. } | OpKind::PosEmbeddingAt | OpKind::KvAttention { .. } => {
            Err(format!(
                "`{}` is an instruction of KV-cache decoding plans (codegen::kv), never a graph op",
                kind.name()
            ))
        }
        OpKind::CausalAttention { .. } => {
            expect_arity(3)?;
            let (q, k, v) = (ins[0], ins[1], ins[2]);
            for (t, what) in [(q, "q"), (k, "k"), (v, "v")] {
                want_rank(t, 4, what)?;
            }
            if k.dims != v.dims || k.dtype != v.dtype {
                return Err(format!("k {} and v {} differ", shape_str(k), shape_str(v)));
            }
            let same = |i: usize| q.dims[i].size == k.dims[i].size;
            if !same(0) || !same(1) || q.dims[3] != k.dims[3] {
                return Err(format!(
                    "q {} and k {} disagree on batch, sequence or head dim",
                    shape_str(q),
                    shape_str(k)
                ));
            }
            if q.dims[2].size % k.dims[2].size != 0 {
                return Err(format!(
                    "{} query heads are not a multiple of {} kv heads",
                    q.dims[2].size, k.dims[2].size
                ));
            }
            let lse = TensorType::new(
                DType::F32,
                vec![q.dims[0].clone(), q.dims[2].clone(), q.dims[1].clone()],
            );
            Ok(vec![q.clone().replicate(), lse])
        }
        OpKind::Add | OpKind::SwiGlu | OpKind::GradSum => {
            expect_arity(2)?;
            if ins[0].dims != ins[1].dims || ins[0].dtype != ins[1].dtype {
                return Err(format!(
                    "operands differ: {} vs {}",
                    ins[0].dtype_shape(),
                    ins[1].dtype_shape()
                ));
            }
            Ok(vec![ins[0].clone().replicate()])
        }
        OpKind::Cast { to } => {
            expect_arity(1)?;
            Ok(vec![TensorType::new(*to, ins[0].dims.clone())])
        }
        OpKind::RepeatKv { n } | OpKind::RepeatKvGrad { n } => {
            expect_arity(1)?;
            let x = ins[0];
            want_rank(x, 4, "heads tensor [b, s, heads, head_dim]")?;
            let mut dims = x.dims.clone();
            let h = &x.dims[2];
            dims[2] = if matches!(kind, OpKind::RepeatKv { .. }) {
                Dim::new("heads", h.size * n)
            } else {
                if *n == 0 || !h.size.is_multiple_of(*n) {
                    return Err(format!("{} heads are not a multiple of {n}", h.size));
                }
                Dim::new("kv_heads", h.size / n)
            };
            Ok(vec![TensorType::new(x.dtype, dims)])
        }
        OpKind::BiasAdd => {
            expect_arity(2)?;
            let (x, b) = (ins[0], ins[1]);
            if x.dims.is_empty() || b.dims.len() != 1 || b.dims[0] != *x.last() {
                return Err(format!(
                    "bias {} does not match {}",
                    shape_str(b),
                    shape_str(x)
                ));
            }
            Ok(vec![x.clone().replicate()])
        }
        OpKind::GeluTanh => {
            expect_arity(1)?;
            Ok(vec![ins[0].clone().replicate()])
        }
        // Inserted on the laid-out graph: the result keeps the operand's layout.
        OpKind::Probe { .. } => {
            expect_arity(1)?;
            Ok(vec![ins[0].clone()])
        }
        OpKind::Perturb { action, .. } => {
            let patch = *action == crate::op::PerturbAction::Patch;
            expect_arity(if patch { 2 } else { 1 })?;
            if patch && (ins[1].dims != ins[0].dims || ins[1].dtype != ins[0].dtype) {
                return Err(format!(
                    "the replacement {} differs from the point {}",
                    shape_str(ins[1]),
                    shape_str(ins[0])
                ));
            }
            Ok(vec![ins[0].clone()])
        }
        OpKind::CrossEntropy => {
            expect_arity(2)?;
            let (logits, labels) = (ins[0], ins[1]);
            want_dtype(labels, DType::I32, "labels")?;
            if logits.dims.len() != labels.dims.len() + 1
                || logits.dims[..labels.dims.len()] != labels.dims[..]
            {
                return Err(format!(
                    "logits {} do not match labels {}",
                    shape_str(logits),
                    shape_str(labels)
                ));
            }
            Ok(vec![TensorType::scalar(DType::F32)])
        }
        OpKind::Router { top_k, .. } => {
            expect_arity(1)?;
            let logits = ins[0];
            want_rank(logits, 3, "router logits [b, s, experts]")?;
            if *top_k == 0 || *top_k > logits.dims[2].size {
                return Err(format!(
                    "top_k {top_k} must be between 1 and the {} experts",
                    logits.dims[2].size
                ));
            }
            let mut dims = logits.dims.clone();
            dims[2] = Dim::new("top_k", *top_k);
            Ok(vec![
                TensorType::new(DType::F32, dims.clone()),
                TensorType::new(DType::I32, dims),
            ])
        }
        OpKind::MoeAuxLoss { .. } => {
            expect_arity(2)?;
            let (logits, idx) = (ins[0], ins[1]);
            want_rank(logits, 3, "router logits [b, s, experts]")?;
            want_dtype(idx, DType::I32, "expert indices")?;
            want_rank(idx, 3, "expert indices [b, s, top_k]")?;
            if logits.dims[..2] != idx.dims[..2] {
                return Err("router logits and indices disagree on [b, s]".into());
            }
            Ok(vec![TensorType::scalar(DType::F32)])
        }
        OpKind::Dispatch { capacity, .. } => {
            expect_arity(2)?;
            let (x, idx) = (ins[0], ins[1]);
            want_rank(x, 3, "tokens [b, s, h]")?;
            want_dtype(idx, DType::I32, "expert indices")?;
            want_rank(idx, 3, "expert indices [b, s, top_k]")?;
            let tokens = if *capacity == 0 {
                Dim::dynamic("tokens", x.dims[0].size * x.dims[1].size)
            } else {
                Dim::new("tokens", *capacity)
            };
            Ok(vec![TensorType::new(
                x.dtype,
                vec![tokens, x.dims[2].clone()],
            )])
        }
        OpKind::DispatchExperts { experts, capacity } => {
            expect_arity(2)?;
            let (x, idx) = (ins[0], ins[1]);
            want_rank(x, 3, "tokens [b, s, h]")?;
            want_dtype(idx, DType::I32, "expert indices")?;
            want_rank(idx, 3, "expert indices [b, s, top_k]")?;
            let tokens = if *capacity == 0 {
                Dim::dynamic("tokens", x.dims[0].size * x.dims[1].size)
            } else {
                Dim::new("tokens", *capacity)
            };
            let e = Dim::new("experts", *experts);
            Ok(vec![
                TensorType::new(x.dtype, vec![e.clone(), tokens, x.dims[2].clone()]),
                TensorType::new(DType::I32, vec![e]),
            ])
        }
        OpKind::CombineExperts => {
            expect_arity(3)?;
            let (w, idx, y) = (ins[0], ins[1], ins[2]);
            want_rank(w, 3, "router weights [b, s, top_k]")?;
            if idx.dims != w.dims {
                return Err("router weights and indices differ in shape".into());
            }
            want_rank(y, 3, "expert outputs [experts, tokens, h]")?;
            let dims = vec![w.dims[0].clone(), w.dims[1].clone(), y.dims[2].clone()];
            Ok(vec![TensorType::new(y.dtype, dims)])
        }
        OpKind::Combine => {
            if ins.len() < 3 {
                return Err(format!(
                    "expects router weights, indices and expert outputs, got {} operands",
                    ins.len()
                ));
            }
            let (w, idx, ys) = (ins[0], ins[1], &ins[2..]);
            want_rank(w, 3, "router weights [b, s, top_k]")?;
            if idx.dims != w.dims {
                return Err("router weights and indices differ in shape".into());
            }
            want_rank(ys[0], 2, "expert output [tokens, h]")?;
            for y in ys {
                if y.dims.len() != 2 || y.dims[1] != ys[0].dims[1] || y.dtype != ys[0].dtype {
                    return Err(format!(
                        "expert outputs differ: {} vs {}",
                        ys[0].dtype_shape(),
                        y.dtype_shape()
                    ));
                }
            }
            let dims = vec![w.dims[0].clone(), w.dims[1].clone(), ys[0].dims[1].clone()];
            Ok(vec![TensorType::new(ys[0].dtype, dims)])
        }
        OpKind::EmbeddingGrad => {
            expect_arity(3)?;
            let (tokens, table, dy) = (ins[0], ins[1], ins[2]);
            want_dtype(tokens, DType::I32, "token ids")?;
            want_rank(table, 2, "embedding table")?;
            let mut want = tokens.dims.clone();
            want.push(table.dims[1].clone());
            if dy.dims != want {
                return Err(format!(
                    "gradient {} does not match the embedding output",
                    shape_str(dy)
                ));
            }
            Ok(vec![TensorType::new(DType::F32, table.dims.clone())])
        }
        OpKind::PosEmbeddingGrad => {
            expect_arity(2)?;
            let (wpe, dy) = (ins[0], ins[1]);
            want_rank(wpe, 2, "position table")?;
            want_rank(dy, 3, "gradient [b, s, h]")?;
            Ok(vec![TensorType::new(DType::F32, wpe.dims.clone())])
        }
        OpKind::LinearGradInput { weight } => {
            expect_arity(2)?;
            let (dy, w) = (ins[0], ins[1]);
            let w = &expert_weight(dy, w)?;
            if dy.dims.is_empty() {
                return Err("gradient is a scalar".into());
            }
            let (in_dim, out_dim) = match weight {
                WeightLayout::OutIn => (&w.dims[1], &w.dims[0]),
                WeightLayout::InOut => (&w.dims[0], &w.dims[1]),
            };
            if dy.last() != out_dim {
                return Err(format!(
                    "gradient's last dim {} is not the weight's output dim {out_dim}",
                    dy.last()
                ));
            }
            let mut dims = dy.dims.clone();
            *dims.last_mut().expect("checked non-scalar") = in_dim.clone();
            Ok(vec![TensorType::new(dy.dtype, dims)])
        }
        OpKind::LinearGradWeight { weight } => {
            expect_arity(2)?;
            let (x, dy) = (ins[0], ins[1]);
            if x.dims.is_empty() || dy.dims.len() != x.dims.len() {
                return Err(format!(
                    "input {} and gradient {} disagree",
                    shape_str(x),
                    shape_str(dy)
                ));
            }
            let mut dims = match weight {
                WeightLayout::OutIn => vec![dy.last().clone(), x.last().clone()],
                WeightLayout::InOut => vec![x.last().clone(), dy.last().clone()],
            };
            // Stacked experts: one weight gradient per expert.
            if x.dims[0].name == "experts" {
                if dy.dims[0] != x.dims[0] {
                    return Err("input and gradient disagree on the experts".into());
                }
                dims.insert(0, x.dims[0].clone());
            }
            Ok(vec![TensorType::new(DType::F32, dims)])
        }
        OpKind::BiasGrad => {
            expect_arity(1)?;
            if ins[0].dims.is_empty() {
                return Err("gradient is a scalar".into());
            }
            Ok(vec![TensorType::new(
                DType::F32,
                vec![ins[0].last().clone()],
            )])
        }
        OpKind::RmsNormGrad { .. } | OpKind::LayerNormGrad { .. } => {
            expect_arity(3)?;
            let (x, w, dy) = (ins[0], ins[1], ins[2]);
            if x.dims != dy.dims {
                return Err(format!(
                    "input {} and gradient {} differ",
                    shape_str(x),
                    shape_str(dy)
                ));
            }
            let dw = TensorType::new(DType::F32, w.dims.clone());
            let mut outs = vec![x.clone().replicate(), dw.clone()];
            if matches!(kind, OpKind::LayerNormGrad { .. }) {
                outs.push(dw);
            }
            Ok(outs)
        }
        OpKind::AttentionGrad { .. } => {
            expect_arity(6)?;
            let (q, k, v) = (ins[0], ins[1], ins[2]);
            if ins[3].dims != q.dims || ins[5].dims != q.dims {
                return Err("attention output or its gradient does not match q".into());
            }
            Ok(vec![
                q.clone().replicate(),
                k.clone().replicate(),
                v.clone().replicate(),
            ])
        }
        OpKind::SigmoidMul | OpKind::SigmoidMulGrad => {
            let fwd = matches!(kind, OpKind::SigmoidMul);
            expect_arity(if fwd { 2 } else { 3 })?;
            let (g, y) = (ins[0], ins[1]);
            let lead = |t: &TensorType| t.dims[..t.dims.len().saturating_sub(1)].to_vec();
            if g.dims.last().map(|d| d.size) != Some(1) || lead(g) != lead(y) {
                return Err(format!(
                    "gate {} must be the value's shape {} with a last dim of 1",
                    g.dtype_shape(),
                    y.dtype_shape()
                ));
            }
            if !fwd && ins[2].dims != y.dims {
                return Err("value and gradient differ in shape".into());
            }
            Ok(if fwd {
                vec![y.clone().replicate()]
            } else {
                vec![g.clone().replicate(), y.clone().replicate()]
            })
        }
        OpKind::SwiGluGrad => {
            expect_arity(3)?;
            if ins[0].dims != ins[1].dims || ins[0].dims != ins[2].dims {
                return Err("gate, up and gradient differ in shape".into());
            }
            Ok(vec![ins[0].clone().replicate(), ins[1].clone().replicate()])
        }
        OpKind::GeluTanhGrad => {
            expect_arity(2)?;
            if ins[0].dims != ins[1].dims {
                return Err("input and gradient differ in shape".into());
            }
            Ok(vec![ins[0].clone().replicate()])
        }
        OpKind::CrossEntropyGrad => {
            expect_arity(2)?;
            want_dtype(ins[1], DType::I32, "labels")?;
            Ok(vec![ins[0].clone().replicate()])
        }
        OpKind::RouterGrad { .. } | OpKind::MoeAuxLossGrad { .. } => {
            expect_arity(2)?;
            want_rank(ins[0], 3, "router logits [b, s, experts]")?;
            Ok(vec![ins[0].clone().replicate()])
        }
        OpKind::DispatchGrad { .. } => {
            expect_arity(2)?;
            let (dy, idx) = (ins[0], ins[1]);
            want_rank(dy, 2, "expert gradient [tokens, h]")?;
            want_rank(idx, 3, "expert indices [b, s, top_k]")?;
            let dims = vec![idx.dims[0].clone(), idx.dims[1].clone(), dy.dims[1].clone()];
            Ok(vec![TensorType::new(dy.dtype, dims)])
        }
        OpKind::DispatchExpertsGrad => {
            expect_arity(2)?;
            let (dy, idx) = (ins[0], ins[1]);
            want_rank(dy, 3, "expert gradients [experts, tokens, h]")?;
            want_rank(idx, 3, "expert indices [b, s, top_k]")?;
            let dims = vec![idx.dims[0].clone(), idx.dims[1].clone(), dy.dims[2].clone()];
            Ok(vec![TensorType::new(dy.dtype, dims)])
        }
        OpKind::CombineExpertsGrad => {
            expect_arity(4)?;
            Ok(vec![
                TensorType::new(DType::F32, ins[0].dims.clone()),
                ins[2].clone().replicate(),
            ])
        }
        OpKind::AllToAll { split, concat, .. } => {
            expect_arity(2)?;
            let (x, counts) = (ins[0], ins[1]);
            want_rank(x, 3, "expert tokens [experts, tokens, h]")?;
            want_dtype(counts, DType::I32, "token counts")?;
            if *split > 1 || *concat > 1 || split == concat {
                return Err(format!(
                    "splits dim {split} and concatenates dim {concat}: expected 0 and 1"
                ));
            }
            // Types are global: the exchange changes the layout, not the shape.
            Ok(vec![x.clone().replicate()])
        }
        OpKind::CombineGrad => {
            if ins.len() < 4 {
                return Err(format!(
                    "expects weights, indices, expert outputs and a gradient, got {} operands",
                    ins.len()
                ));
            }
            let mut outs = vec![TensorType::new(DType::F32, ins[0].dims.clone())];
            for y in &ins[2..ins.len() - 1] {
                outs.push((*y).clone().replicate());
            }
            Ok(outs)
        }
        OpKind::AllReduce { .. }
        | OpKind::AllGather { .. }
        | OpKind::ReduceScatter { .. }
        | OpKind::Slice { .. } => {
            // Types are global: a collective changes the layout, not the shape.
            expect_arity(1)?;
            if let OpKind::AllGather { dim, .. }
            | OpKind::ReduceScatter { dim, .. }
            | OpKind::Slice { dim, .. } = kind
            {
                if *dim as usize >= ins[0].dims.len() {
                    return Err(format!(
                        "dim {dim} is out of range for {}",
                        shape_str(ins[0])
                    ));
                }
            }
            Ok(vec![ins[0].clone().replicate()])
        }
        OpKind::GradNorm { .. } => {
            if ins.is_empty() {
                return Err("expects at least one gradient".into());
            }
            Ok(vec![TensorType::scalar(DType::F32)])
        }
        OpKind::AdamW { .. } => {
            expect_arity(3)?;
            let (p, g, norm) = (ins[0], ins[1], ins[2]);
            if p.dims != g.dims {
                return Err(format!(
                    "parameter {} and gradient {} differ",
                    shape_str(p),
                    shape_str(g)
                ));
            }
            if !norm.dims.is_empty() {
                return Err("the norm operand must be a scalar".into());
            }
            Ok(vec![p.clone().replicate()])
        }
    }
}

fn want_rank(t: &TensorType, rank: usize, what: &str) -> Result<(), String> {
    if t.dims.len() == rank {
        Ok(())
    } else {
        Err(format!(
            "{what} must have {rank} dims, got {}",
            shape_str(t)
        ))
    }
}

fn want_dtype(t: &TensorType, dtype: DType, what: &str) -> Result<(), String> {
    if t.dtype == dtype {
        Ok(())
    } else {
        Err(format!(
            "{what} must be {}, got {}",
            dtype.as_str(),
            t.dtype_shape()
        ))
    }
}

fn shape_str(t: &TensorType) -> String {
    t.dtype_shape()
}

impl TensorType {
    /// The type without layout, e.g. `f32[b=2, s=8]`.
    pub fn dtype_shape(&self) -> String {
        let dims: Vec<String> = self.dims.iter().map(Dim::to_string).collect();
        format!("{}[{}]", self.dtype.as_str(), dims.join(", "))
    }

    /// The same dtype and dims, replicated.
    pub fn replicate(self) -> TensorType {
        TensorType::new(self.dtype, self.dims)
    }
}

/// The weight a linear applies per row of `x`: `w` itself, or for stacked experts
/// (`w` is `[experts, out, in]`, `x` is `[experts, tokens, in]`) one expert's matrix.
fn expert_weight(x: &TensorType, w: &TensorType) -> Result<TensorType, String> {
    if w.dims.len() == 3 && w.dims[0].name == "experts" {
        if x.dims.len() != 3 || x.dims[0] != w.dims[0] {
            return Err(format!(
                "stacked expert weight {} needs an input [experts, tokens, in], got {}",
                shape_str(w),
                shape_str(x)
            ));
        }
        return Ok(TensorType::new(w.dtype, w.dims[1..].to_vec()));
    }
    want_rank(w, 2, "weight")?;
    Ok(w.clone())
}
