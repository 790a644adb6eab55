//! Graph IR: building, printing, parsing back, and the verifier's rejections.

use megac_ir::{
    parse_graph, print_graph, verify, DType, Dim, Graph, IrError, Mesh, OpId, OpKind, TensorType,
    ValueDef, ValueId, VerifyError, WeightLayout,
};

fn ty(dtype: DType, dims: &[(&str, u64)]) -> TensorType {
    TensorType::new(dtype, dims.iter().map(|&(n, s)| Dim::new(n, s)).collect())
}

/// A small attention block: embedding, projections, heads, rope, attention, loss.
fn sample() -> Graph {
    let mut g = Graph::new("sample", Mesh::single());
    let tokens = g.add_input("tokens", ty(DType::I32, &[("b", 2), ("s", 8)]));
    let labels = g.add_input("labels", ty(DType::I32, &[("b", 2), ("s", 8)]));
    let wte = g.add_param("wte", ty(DType::F32, &[("vocab", 32), ("h", 16)]));
    let x = g
        .add_op1(OpKind::Embedding, &[tokens, wte], "embed")
        .unwrap();
    let wq = g.add_param("wq", ty(DType::F32, &[("heads*head_dim", 16), ("h", 16)]));
    let lin = OpKind::Linear {
        weight: WeightLayout::OutIn,
    };
    let q = g.add_op1(lin.clone(), &[x, wq], "q").unwrap();
    let q4 = g
        .add_op1(OpKind::SplitHeads { n: 4 }, &[q], "attn")
        .unwrap();
    let qr = g
        .add_op1(
            OpKind::Rope {
                theta: 10000.0,
                scaling: None,
            },
            &[q4],
            "attn.rope",
        )
        .unwrap();
    let a = g
        .add_op1(
            OpKind::CausalAttention { window: 0 },
            &[qr, qr, q4],
            "attn.core",
        )
        .unwrap();
    let m = g.add_op1(OpKind::MergeHeads, &[a], "attn").unwrap();
    let wo = g.add_param("wo", ty(DType::F32, &[("h", 16), ("heads*head_dim", 16)]));
    let o = g.add_op1(lin.clone(), &[m, wo], "o").unwrap();
    let r = g.add_op1(OpKind::Add, &[x, o], "residual").unwrap();
    let logits = g.add_op1(lin, &[r, wte], "lm_head").unwrap();
    let loss = g
        .add_op1(OpKind::CrossEntropy, &[logits, labels], "loss")
        .unwrap();
    g.add_output("loss", loss);
    g
}

#[test]
fn built_graph_verifies_and_round_trips() {
    let g = sample();
    verify(&g).unwrap();
    let text = print_graph(&g);
    let back = parse_graph(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(back, g);
    assert_eq!(print_graph(&back), text);
}

#[test]
fn shape_inference_rejects_mismatched_linear() {
    let mut g = Graph::new("bad", Mesh::single());
    let x = g.add_input("x", ty(DType::F32, &[("b", 2), ("h", 16)]));
    let w = g.add_param("w", ty(DType::F32, &[("ffn", 8), ("h", 12)]));
    let err = g
        .add_op1(
            OpKind::Linear {
                weight: WeightLayout::OutIn,
            },
            &[x, w],
            "mlp",
        )
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("linear at mlp") && msg.contains("h=16") && msg.contains("h=12"),
        "{msg}"
    );
}

#[test]
fn verifier_rejects_use_before_definition() {
    let mut g = sample();
    // Make the first op read the result of the last op.
    let last = *g.ops.last().unwrap().outputs.first().unwrap();
    g.ops[0].inputs[0] = last;
    let err = verify(&g).unwrap_err();
    assert!(
        matches!(err.errors()[0], VerifyError::UndefinedValue { value, .. } if value == last),
        "{err}"
    );
    assert!(err.to_string().contains("not defined before use"), "{err}");
}

#[test]
fn verifier_rejects_wrong_recorded_type() {
    let mut g = sample();
    let out = g.ops[1].outputs[0];
    g.values[out.0 as usize].ty = ty(DType::F32, &[("b", 2), ("s", 8), ("heads*head_dim", 15)]);
    let err = verify(&g).unwrap_err();
    assert!(
        matches!(&err.errors()[0], VerifyError::TypeMismatch { value, .. } if *value == out),
        "{err}"
    );
    assert!(err.to_string().contains("but its operands give"), "{err}");
}

#[test]
fn verifier_rejects_duplicate_parameter_names_and_dangling_outputs() {
    let mut g = sample();
    if let ValueDef::Param(name) = &mut g.values[2].def {
        *name = "wq".into();
    }
    let err = verify(&g).unwrap_err();
    assert!(
        matches!(err.errors(), [VerifyError::DuplicateParam { name, .. }] if name == "wq"),
        "{err}"
    );

    let mut g = sample();
    g.outputs.push(("ghost".into(), ValueId(999)));
    let err = verify(&g).unwrap_err();
    assert!(
        matches!(err.errors(), [VerifyError::UndefinedOutput { name, .. }] if name == "ghost"),
        "{err}"
    );
}

#[test]
fn verifier_reports_every_violation_not_just_the_first() {
    let mut g = sample();
    // Three distinct violations: a duplicate parameter name, an op without provenance,
    // and a dangling graph output.
    if let ValueDef::Param(name) = &mut g.values[2].def {
        *name = "wq".into();
    }
    g.ops[1].path.clear();
    g.outputs.push(("ghost".into(), ValueId(999)));
    let err = verify(&g).unwrap_err();
    let errs = err.errors();
    assert_eq!(errs.len(), 3, "{err}");
    assert!(
        matches!(&errs[0], VerifyError::DuplicateParam { value, name } if *value == ValueId(4) && name == "wq"),
        "{err}"
    );
    assert!(
        matches!(&errs[1], VerifyError::MissingProvenance { op } if op.id == OpId(1)),
        "{err}"
    );
    assert!(
        matches!(&errs[2], VerifyError::UndefinedOutput { name, value } if name == "ghost" && *value == ValueId(999)),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.starts_with("3 errors: "), "{text}");
    assert!(
        text.contains("declared twice")
            && text.contains("no provenance path")
            && text.contains("ghost"),
        "{text}"
    );
}

#[test]
fn verifier_rejects_results_that_do_not_point_back() {
    let mut g = sample();
    g.ops[1].outputs[0] = ValueId(0);
    assert!(verify(&g).is_err());
}

fn parse_err(text: &str) -> (usize, usize, String) {
    match parse_graph(text) {
        Err(IrError::Parse { line, col, message }) => (line, col, message),
        other => panic!("expected a parse error, got {other:?}"),
    }
}

#[test]
fn parser_reports_line_and_column() {
    let good = print_graph(&sample());
    // Unknown op.
    let bad = good.replace("= embedding(", "= embeding(");
    let (line, col, msg) = parse_err(&bad);
    let want_line = bad.lines().position(|l| l.contains("embeding")).unwrap() + 1;
    assert_eq!(line, want_line);
    assert_eq!(
        col,
        bad.lines().nth(line - 1).unwrap().find("embeding").unwrap() + 1
    );
    assert!(msg.contains("unknown op `embeding`"), "{msg}");

    // A written type that disagrees with inference.
    let bad = good.replacen("f32[b=2, s=8, h=16] {R}", "f32[b=2, s=8, h=17] {R}", 1);
    let (_, _, msg) = parse_err(&bad);
    assert!(msg.contains("disagrees with the inferred"), "{msg}");

    // Use of an undefined value.
    let bad = good.replace("embedding(%0, %2)", "embedding(%0, %77)");
    let (_, _, msg) = parse_err(&bad);
    assert!(msg.contains("%77 is used before it is defined"), "{msg}");

    // Missing closing brace.
    let bad = good.trim_end().trim_end_matches('}').to_string();
    let (_, _, msg) = parse_err(&bad);
    assert!(msg.contains("missing closing"), "{msg}");

    // Missing provenance.
    let line = good.lines().find(|l| l.contains("= add(")).unwrap();
    let bad = good.replace(line, line.split('#').next().unwrap());
    let (_, _, msg) = parse_err(&bad);
    assert!(msg.contains("expected `#`"), "{msg}");
}

#[test]
fn layouts_print_and_parse() {
    let mut g = sample();
    let v = g.ops[0].outputs[0];
    let t = &mut g.values[v.0 as usize].ty;
    t.layout.shards[0] = vec![megac_ir::Axis::Dp];
    t.layout.shards[2] = vec![megac_ir::Axis::Cp, megac_ir::Axis::Tp];
    t.layout.partial = vec![megac_ir::Axis::Tp];
    let text = print_graph(&g);
    assert!(
        text.contains("f32[b=2, s=8, h=16] {b:dp, h:cp+tp, partial:tp}"),
        "{text}"
    );
    assert_eq!(parse_graph(&text).unwrap(), g);
}

/// A plan's `dpp.policy` is the policy's model.toml name (plans stay byte-identical), and
/// an unknown name is an error rather than a silent adaptive policy.
#[test]
fn dpp_policy_serializes_as_its_name() {
    use megac_ir::plan::DppExec;
    use megac_ir::spec::DppPolicy;
    for (policy, name) in [
        (DppPolicy::Bfs, "bfs"),
        (DppPolicy::Dfs, "dfs"),
        (DppPolicy::Adaptive { cap: None }, "adaptive"),
        (DppPolicy::Ordered, "ordered"),
    ] {
        let exec = DppExec { policy, cap: 4 };
        let json = serde_json::to_string(&exec).unwrap();
        assert_eq!(json, format!("{{\"policy\":\"{name}\",\"cap\":4}}"));
        assert_eq!(serde_json::from_str::<DppExec>(&json).unwrap(), exec);
    }
    let err = serde_json::from_str::<DppExec>("{\"policy\":\"bfz\",\"cap\":0}").unwrap_err();
    assert!(
        err.to_string()
            .contains("unknown dpp policy `bfz` (expected bfs, dfs, adaptive or ordered)"),
        "{err}"
    );
}

/// MegaDPP's priority: backwards first (later chunks first), then breadth- or depth-first;
/// `ordered` by the place in the reference order alone.
#[test]
fn dpp_priority_orders_backwards_first_then_by_policy() {
    use megac_ir::spec::{dpp_priority, DppPolicy, DppTask};
    let t = |backward, local_chunk, microbatch| DppTask {
        backward,
        local_chunk,
        local_chunks: 2,
        microbatch,
        position: 0,
    };
    let at = |task: DppTask, position| DppTask { position, ..task };
    // A forward placed before a backward goes first under `ordered`, last under the others.
    let (f, b) = (at(t(false, 0, 0), 3), at(t(true, 1, 0), 7));
    assert!(DppPolicy::Ordered.priority(0, 2, f) < DppPolicy::Ordered.priority(0, 2, b));
    for p in [
        DppPolicy::Bfs,
        DppPolicy::Dfs,
        DppPolicy::Adaptive { cap: None },
    ] {
        assert!(p.priority(0, 2, b) < p.priority(0, 2, f), "{p}");
        assert_eq!(
            p.priority(1, 2, f),
            dpp_priority(p.breadth_first(1, 2), f),
            "{p}"
        );
    }
    assert!(dpp_priority(true, t(true, 0, 3)) < dpp_priority(true, t(false, 0, 0)));
    assert!(dpp_priority(true, t(true, 1, 3)) < dpp_priority(true, t(true, 0, 0)));
    assert!(dpp_priority(true, t(false, 0, 3)) < dpp_priority(true, t(false, 1, 0)));
    assert!(dpp_priority(false, t(false, 1, 0)) < dpp_priority(false, t(false, 0, 1)));
    let adaptive = DppPolicy::Adaptive { cap: None };
    assert!(adaptive.breadth_first(1, 2) && !adaptive.breadth_first(2, 2));
    assert!(DppPolicy::Adaptive { cap: Some(0) }.breadth_first(0, 2));
    assert!(DppPolicy::Bfs.breadth_first(99, 1) && !DppPolicy::Dfs.breadth_first(0, 1));
}

/// Chunk placement: chunk c on pipeline rank c % pp as its c / pp-th local chunk, and the
/// transfer peer is the rank with the same coordinates on that pipeline rank.
#[test]
fn chunk_placement_round_trips() {
    use megac_ir::mesh::{chunk_owner, global_chunk, local_chunk};
    for pp in 1..5 {
        for c in 0..3 * pp {
            assert_eq!(global_chunk(local_chunk(c, pp), chunk_owner(c, pp), pp), c);
        }
    }
    let mesh = Mesh {
        axes: vec![
            (megac_ir::Axis::Tp, 2),
            (megac_ir::Axis::Dp, 1),
            (megac_ir::Axis::Pp, 4),
        ],
    };
    // Rank 3 is tp 1, pp 1; chunk 6 lives on pp 2: rank 5.
    assert_eq!(mesh.chunk_peer(3, 6), 5);
    assert_eq!(mesh.transfer_peer(3, 6, false), 5);
}

/// Atomic writes: folders are made, a file is replaced whole, and a failed write leaves the
/// old file and no temporary behind.
#[test]
fn write_atomic_replaces_whole_or_not_at_all() {
    use megac_ir::file::{write_atomic, write_atomic_with, WriteError};
    let dir = std::env::temp_dir().join(format!("megac-ir-atomic-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let path = dir.join("a/b/plan.json");
    write_atomic(&path, "one").unwrap();
    write_atomic(&path, b"two").unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "two");
    let e = write_atomic_with(&path, |w| {
        w.write_all(b"half")?;
        Err(std::io::Error::other("the writer failed"))
    })
    .unwrap_err();
    assert!(matches!(e, WriteError::Write(_)), "{e}");
    assert_eq!(e.to_string(), "cannot write: the writer failed");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "two");
    let left: Vec<_> = std::fs::read_dir(dir.join("a/b")).unwrap().collect();
    assert_eq!(left.len(), 1, "a temporary file was left behind");
    assert!(matches!(
        write_atomic(std::path::Path::new(".."), "x"),
        Err(WriteError::NotAFile)
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}
