//! The plan validator (`megac_ir::check::check_plan`): it accepts every compiled schedule ×
//! layout combination and rejects hand-corrupted plans (swapped sends, a dropped receive, a
//! reordered collective, a wrong receive size, a schedule without a backward) with a message
//! that names the ranks, the instructions and the schedule positions.

use std::path::Path;
use std::time::Instant;

use megac_ir::check::check_plan;
use megac_ir::plan::{Instr, PipeKind, Plan};
use megac_ir::OpKind;

fn compile(file: &str, sets: &[&str]) -> Plan {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(file);
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let spec = megac_frontend::load(&path, &sets).unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true).unwrap();
    megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops)
        .unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"))
}

/// 8 layers (up to 8 chunks of one layer), 4 micro-batches per step, as tests/layouts.rs.
const PIPE: &[&str] = &[
    "train.micro_batch=2",
    "train.global_batch=8",
    "model.layers=8",
];

fn tiny(extra: &[&str]) -> Plan {
    let sets: Vec<&str> = PIPE.iter().chain(extra).copied().collect();
    compile("llama-tiny.toml", &sets)
}

fn accepts(extra: &[&str]) {
    let plan = tiny(extra);
    let start = Instant::now();
    check_plan(&plan).unwrap_or_else(|e| panic!("{extra:?}: {e}"));
    assert!(
        start.elapsed().as_secs_f64() < 1.0,
        "{extra:?}: check_plan took {:?}",
        start.elapsed()
    );
}

fn rejects(plan: &Plan, what: &str) -> String {
    match check_plan(plan) {
        Ok(()) => panic!("the validator accepts a plan with {what}"),
        Err(e) => {
            eprintln!("{what}: {e}");
            e
        }
    }
}

#[test]
fn accepts_every_static_schedule_and_pipeline_layout() {
    for layout in [
        &["parallel.pp=2", "parallel.schedule=gpipe"][..],
        &["parallel.pp=4", "parallel.schedule=gpipe"],
        &["parallel.pp=2", "parallel.schedule=1f1b"],
        &["parallel.pp=4", "parallel.schedule=1f1b"],
        &["parallel.pp=2", "parallel.schedule=zb-h1"],
        &["parallel.pp=4", "parallel.schedule=zb-h1"],
        &[
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.schedule=interleaved",
        ],
        &[
            "parallel.pp=4",
            "parallel.vpp=2",
            "parallel.schedule=interleaved",
        ],
        // 8 micro-batches: 1F1B and zero-bubble reach their steady state at pp4.
        &[
            "parallel.pp=4",
            "parallel.schedule=1f1b",
            "train.global_batch=16",
        ],
        &[
            "parallel.pp=4",
            "parallel.schedule=zb-h1",
            "train.global_batch=16",
        ],
        &[
            "parallel.pp=4",
            "parallel.vpp=2",
            "parallel.schedule=interleaved",
            "train.global_batch=16",
        ],
    ] {
        accepts(layout);
    }
}

#[test]
fn accepts_every_dpp_policy_and_pipeline_layout() {
    for policy in ["bfs", "dfs", "adaptive", "ordered"] {
        let policy = format!("parallel.dpp_policy={policy}");
        for layout in [
            &["parallel.pp=2"][..],
            &["parallel.pp=4"],
            &["parallel.pp=2", "parallel.vpp=2"],
            &["parallel.pp=4", "parallel.vpp=2"],
        ] {
            let mut sets = vec!["parallel.schedule=dpp", policy.as_str()];
            sets.extend_from_slice(layout);
            accepts(&sets);
        }
    }
}

#[test]
fn accepts_pipelines_with_tensor_sequence_and_data_parallelism() {
    accepts(&[
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.dp=2",
        "parallel.sequence_parallel=true",
    ]);
    accepts(&[
        "parallel.pp=2",
        "parallel.vpp=2",
        "parallel.schedule=interleaved",
        "parallel.tp=2",
        "parallel.dp=2",
    ]);
}

#[test]
fn accepts_layouts_without_pipelines() {
    for layout in [
        &[][..],
        &["parallel.tp=2"],
        &["parallel.dp=2"],
        &["parallel.cp=2"],
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
        &["parallel.tp=2", "parallel.dp=2", "parallel.cp=2"],
        &["parallel.dp=2", "parallel.distributed_optimizer=true"],
    ] {
        accepts(layout);
    }
}

#[test]
fn accepts_forward_backward_decoupling() {
    for layout in [
        &["parallel.pp=2", "parallel.fbd=true"][..],
        &[
            "parallel.pp=4",
            "parallel.fbd=true",
            "parallel.schedule=zb-h1",
        ],
        &[
            "parallel.pp=2",
            "parallel.fbd=true",
            "parallel.tp=2",
            "parallel.dp=2",
        ],
    ] {
        accepts(layout);
    }
}

#[test]
fn accepts_expert_parallel_moe() {
    let base = ["train.micro_batch=2", "train.global_batch=8"];
    for layout in [
        &["parallel.dp=2", "parallel.ep=2"][..],
        &["parallel.dp=4", "parallel.ep=2"],
        &["parallel.dp=4", "parallel.ep=4"],
        &["parallel.cp=2", "parallel.ep=2"],
        &["parallel.cp=2", "parallel.dp=2", "parallel.ep=4"],
        &[
            "parallel.dp=2",
            "parallel.ep=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
        ],
        &["parallel.pp=2"],
        &["parallel.pp=2", "parallel.dp=2", "parallel.ep=2"],
    ] {
        let sets: Vec<&str> = base.iter().chain(layout).copied().collect();
        let plan = compile("moe-tiny.toml", &sets);
        check_plan(&plan).unwrap_or_else(|e| panic!("{layout:?}: {e}"));
    }
}

#[test]
fn rejects_a_forward_role_that_misses_a_parameter_refresh() {
    // MegaFBD: the backward role sends the updated parameters to its twin after each step.
    let mut plan = tiny(&["parallel.pp=2", "parallel.fbd=true"]);
    let fwd = plan
        .roles
        .iter()
        .position(|r| r.name == "stage0.forward")
        .expect("a forward role");
    let Some(Instr::Recv { transfer, .. }) = plan.roles[fwd].optimizer.pop() else {
        panic!("the forward role receives parameters in its optimizer program")
    };
    let err = rejects(&plan, "a parameter refresh never received");
    let twin = plan.rank_to_role.iter().position(|&r| r == 0).unwrap();
    assert!(
        err.starts_with(&format!(
            "rank {twin} sent transfer {transfer} micro-batch 0 to rank "
        )),
        "{err}"
    );
    assert!(err.contains("(its fbd twin)"), "{err}");
}

/// The pipeline of role `r`.
fn pipe(plan: &mut Plan, r: usize) -> &mut megac_ir::plan::Pipeline {
    plan.roles[r].pipeline.as_mut().expect("a pipelined role")
}

fn is_send(i: &Instr) -> bool {
    matches!(i, Instr::Send { .. })
}

#[test]
fn rejects_a_send_moved_from_the_forward_to_the_backward() {
    // pp4: stage 1 sends activations forward (to stage 2) and gradients backward (to stage 0).
    let mut plan = tiny(&["parallel.pp=4", "parallel.schedule=1f1b"]);
    let chunk = &mut pipe(&mut plan, 1).chunks[0];
    let f = chunk
        .forward
        .iter()
        .position(is_send)
        .expect("forward send");
    let b = chunk
        .backward
        .iter()
        .position(is_send)
        .expect("backward send");
    std::mem::swap(&mut chunk.forward[f], &mut chunk.backward[b]);
    let err = rejects(&plan, "a send exchanged between forward and backward");
    assert!(err.starts_with("deadlock"), "{err}");
    // Stage 2 waits for the activation that stage 1 now sends only in its backward.
    assert!(
        err.contains(
            "rank 2 at stage2 action #0 F chunk 2 micro-batch 0, forward[0] recv of transfer"
        ),
        "{err}"
    );
    assert!(err.contains("from rank 1"), "{err}");
    // ... while stage 1 waits for stage 2's gradient: the wait-for graph's cycle.
    assert!(err.contains("; wait-for cycle: rank 1 ("), "{err}");
    assert!(
        err.contains(" -> rank 2 (stage2 action #0 F chunk 2"),
        "{err}"
    );
    assert!(err.ends_with(" -> rank 1"), "{err}");
}

#[test]
fn rejects_sends_with_swapped_transfer_ids() {
    let mut plan = tiny(&["parallel.pp=2", "parallel.schedule=1f1b"]);
    // Stage 0 sends activations (forward) and stage 1 gradients (backward): swap the ids of
    // stage 0's first forward send and stage 1's first backward send.
    let id = |instrs: &[Instr]| -> (usize, u32) {
        instrs
            .iter()
            .enumerate()
            .find_map(|(k, i)| match i {
                Instr::Send { transfer, .. } => Some((k, *transfer)),
                _ => None,
            })
            .expect("a send")
    };
    let (f, tf) = id(&pipe(&mut plan, 0).chunks[0].forward);
    let (b, tb) = id(&pipe(&mut plan, 1).chunks[0].backward);
    let set = |i: &mut Instr, t: u32| {
        if let Instr::Send { transfer, .. } = i {
            *transfer = t;
        }
    };
    set(&mut pipe(&mut plan, 0).chunks[0].forward[f], tb);
    set(&mut pipe(&mut plan, 1).chunks[0].backward[b], tf);
    let err = rejects(&plan, "swapped transfer ids");
    assert!(err.starts_with("deadlock"), "{err}");
    assert!(
        err.contains(&format!("recv of transfer {tf} from rank 0")),
        "names the transfer stage 1 waits for: {err}"
    );
    assert!(
        err.contains("rank 1 at stage1 action #0 F chunk 1 micro-batch 0"),
        "{err}"
    );
}

#[test]
fn rejects_a_dropped_receive() {
    let mut plan = tiny(&["parallel.pp=2", "parallel.schedule=1f1b"]);
    let fwd = &mut pipe(&mut plan, 1).chunks[0].forward;
    let k = fwd
        .iter()
        .position(|i| matches!(i, Instr::Recv { .. }))
        .expect("stage 1 receives its input");
    let Instr::Recv { transfer, .. } = fwd.remove(k) else {
        unreachable!()
    };
    let err = rejects(&plan, "a dropped receive");
    assert!(
        err.starts_with(&format!(
            "rank 0 sent transfer {transfer} micro-batch 0 to rank 1, which never receives it (sent at stage0 action #0 F chunk 0 micro-batch 0, forward["
        )),
        "{err}"
    );
}

#[test]
fn rejects_a_wrong_receive_size() {
    let mut plan = tiny(&["parallel.pp=2", "parallel.schedule=1f1b"]);
    let small = plan
        .buffers
        .iter()
        .position(|b| b.len() == 1)
        .expect("a scalar buffer") as u32;
    let bwd = &mut pipe(&mut plan, 0).chunks[0].backward;
    let k = bwd
        .iter()
        .position(|i| matches!(i, Instr::Recv { .. }))
        .expect("stage 0 receives its output gradient");
    let Instr::Recv { buffer, .. } = &mut bwd[k] else {
        unreachable!()
    };
    *buffer = small;
    let err = rejects(&plan, "a receive into a buffer of the wrong size");
    assert!(err.contains("micro-batch 0: rank 1 sends"), "{err}");
    assert!(err.contains("but rank 0 receives 1 ("), "{err}");
    assert!(
        err.contains("stage1 action #") && err.contains(&format!("backward[{k}] recv of transfer")),
        "both positions: {err}"
    );
}

/// Give rank `rank` its own copy of its role, to edit.
fn own_role(plan: &mut Plan, rank: usize) -> usize {
    let mut role = plan.roles[plan.rank_to_role[rank] as usize].clone();
    role.name = format!("{}-edited", role.name);
    plan.roles.push(role);
    plan.rank_to_role[rank] = (plan.roles.len() - 1) as u32;
    plan.roles.len() - 1
}

/// Swap two collectives over the same axes that differ in op or size (names in `ops`).
fn swap_collectives(plan: &Plan, program: &mut [Instr], ops: &[&str]) {
    let calls: Vec<(usize, &str, String, u64)> = program
        .iter()
        .enumerate()
        .filter_map(|(k, i)| match i {
            Instr::Kernel {
                op:
                    op @ (OpKind::AllReduce { axes }
                    | OpKind::AllGather { axes, .. }
                    | OpKind::ReduceScatter { axes, .. }),
                inputs,
                ..
            } if ops.contains(&op.name()) => Some((
                k,
                op.name(),
                format!("{axes:?}"),
                plan.buffers[inputs[0] as usize].len(),
            )),
            _ => None,
        })
        .collect();
    let (a, b) = calls
        .iter()
        .flat_map(|x| calls.iter().map(move |y| (x, y)))
        .find(|(x, y)| x.2 == y.2 && (x.1, x.3) != (y.1, y.3))
        .map(|(x, y)| (x.0, y.0))
        .expect("two different collectives on one group");
    program.swap(a, b);
}

#[test]
fn rejects_reordered_collectives() {
    // tp2 with sequence parallelism: rank 1 gets its own program with an all_gather and a
    // reduce_scatter swapped.
    let mut plan = tiny(&["parallel.tp=2", "parallel.sequence_parallel=true"]);
    let r = own_role(&mut plan, 1);
    let mut program = std::mem::take(&mut plan.roles[r].microbatch);
    swap_collectives(&plan, &mut program, &["all_gather", "reduce_scatter"]);
    plan.roles[r].microbatch = program;
    let err = rejects(&plan, "collectives swapped on one rank");
    assert!(
        err.starts_with("collective mismatch on group [0, 1], call #1: rank 0 calls reduce_scatter of 8192 elements (rank microbatch["),
        "{err}"
    );
    assert!(
        err.contains("; rank 1 calls all_gather of 4096 elements (rank-edited microbatch["),
        "{err}"
    );
}

#[test]
fn rejects_reordered_collectives_in_a_pipeline_stage() {
    // pp2 tp2 dp2 sp: rank 5 (tp 1, dp 0, stage 1) gets its own stage program with a
    // sequence-parallel all_gather and reduce_scatter swapped in its forward.
    let mut plan = tiny(&[
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.dp=2",
        "parallel.sequence_parallel=true",
    ]);
    let rank = plan.mesh.rank_with(
        plan.mesh.rank_with(0, megac_ir::Axis::Tp, 1),
        megac_ir::Axis::Pp,
        1,
    );
    let r = own_role(&mut plan, rank);
    let mut program = std::mem::take(&mut pipe(&mut plan, r).chunks[0].forward);
    swap_collectives(&plan, &mut program, &["all_gather", "reduce_scatter"]);
    pipe(&mut plan, r).chunks[0].forward = program;
    let err = rejects(
        &plan,
        "an all_gather and a reduce_scatter swapped on one rank",
    );
    let peer = plan.mesh.rank_with(rank, megac_ir::Axis::Tp, 0);
    assert!(
        err.starts_with(&format!(
            "collective mismatch on group [{peer}, {rank}], call #1: rank {peer} calls all_gather"
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!("rank {rank} calls reduce_scatter of")),
        "{err}"
    );
    assert!(
        err.contains("(stage1-edited action #0 F chunk 1 micro-batch 0, forward["),
        "{err}"
    );

    // Two data-parallel gradient all_reduces of different sizes swapped in the optimizer.
    let mut plan = tiny(&[
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.dp=2",
        "parallel.sequence_parallel=true",
    ]);
    let r = own_role(&mut plan, rank);
    let mut program = std::mem::take(&mut plan.roles[r].optimizer);
    swap_collectives(&plan, &mut program, &["all_reduce"]);
    plan.roles[r].optimizer = program;
    let err = rejects(&plan, "two all_reduces swapped on one rank");
    let peer = plan.mesh.rank_with(rank, megac_ir::Axis::Dp, 1);
    assert!(
        err.starts_with(&format!(
            "collective mismatch on group [{rank}, {peer}], call #"
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!("rank {rank} calls all_reduce of")),
        "{err}"
    );
    assert!(err.contains("(stage1-edited optimizer["), "{err}");
}

#[test]
fn rejects_action_lists_without_a_backward() {
    for (sets, kind) in [
        (
            &["parallel.pp=2", "parallel.schedule=1f1b"][..],
            PipeKind::BW,
        ),
        (
            &["parallel.pp=4", "parallel.schedule=zb-h1"][..],
            PipeKind::W,
        ),
        (
            &[
                "parallel.pp=2",
                "parallel.vpp=2",
                "parallel.schedule=dpp",
                "parallel.dpp_policy=adaptive",
            ][..],
            PipeKind::BW,
        ),
    ] {
        let mut plan = tiny(sets);
        let actions = &mut pipe(&mut plan, 1).actions;
        let k = actions
            .iter()
            .rposition(|a| a.kind == kind)
            .expect("an action of that kind");
        let gone = actions.remove(k);
        let err = rejects(&plan, "a missing backward action");
        let what = if kind == PipeKind::W {
            "weight-gradient backward (W after its B)"
        } else {
            "backward (BW, or B and W)"
        };
        assert_eq!(
            err,
            format!(
                "stage1 (rank 1): the action list never runs the {what} of chunk {} micro-batch {}",
                gone.chunk, gone.microbatch
            ),
            "{sets:?}"
        );
    }
}

#[test]
fn rejects_action_lists_out_of_order_or_with_duplicates() {
    let mut plan = tiny(&["parallel.pp=2", "parallel.schedule=1f1b"]);
    // The last stage runs F then BW per micro-batch: swap the first pair.
    let actions = &mut pipe(&mut plan, 1).actions;
    assert_eq!(
        (actions[0].kind, actions[1].kind),
        (PipeKind::F, PipeKind::BW)
    );
    actions.swap(0, 1);
    let err = rejects(&plan, "a backward before its forward");
    assert_eq!(
        err,
        "stage1 (rank 1) action #0 runs BW chunk 1 micro-batch 0 before its forward"
    );

    let mut plan = tiny(&["parallel.pp=2", "parallel.schedule=1f1b"]);
    let actions = &mut pipe(&mut plan, 0).actions;
    let first = actions[0];
    actions.push(first);
    let err = rejects(&plan, "a forward run twice");
    assert!(
        err.starts_with("stage0 (rank 0) runs F chunk 0 micro-batch 0 twice (actions #0 and #"),
        "{err}"
    );
}

#[test]
fn malformed_plans_are_errors_not_panics() {
    let base = tiny(&["parallel.pp=2", "parallel.schedule=1f1b"]);

    let mut plan = base.clone();
    let fwd = &mut pipe(&mut plan, 0).chunks[0].forward;
    let k = fwd.iter().position(is_send).unwrap();
    if let Instr::Send { buffer, .. } = &mut fwd[k] {
        *buffer = u32::MAX;
    }
    let err = rejects(&plan, "a send of a buffer that does not exist");
    assert!(err.contains("does not exist"), "{err}");

    let mut plan = base.clone();
    pipe(&mut plan, 1).chunks.clear();
    let err = rejects(&plan, "a stage without its chunk");
    assert!(err.contains("does not hold chunk 1"), "{err}");

    let mut plan = base.clone();
    pipe(&mut plan, 1).chunks[0].chunk = 2;
    let err = rejects(&plan, "actions of a chunk the stage does not hold");
    assert!(
        err.contains("the role does not hold chunk 1 (it holds [2])"),
        "{err}"
    );
    for a in pipe(&mut plan, 1).actions.iter_mut() {
        a.chunk = 2;
    }
    let err = rejects(&plan, "a chunk beyond the model's");
    assert_eq!(
        err,
        "stage1 (rank 1) holds chunk 2, but the model has 2 chunks"
    );
    for c in [0, 2] {
        let mut plan = base.clone();
        pipe(&mut plan, 1).chunks_total = 4;
        pipe(&mut plan, 1).chunks[0].chunk = c;
        for a in pipe(&mut plan, 1).actions.iter_mut() {
            a.chunk = c;
        }
        let err = rejects(&plan, "a chunk on the wrong stage");
        assert_eq!(
            err,
            format!(
                "stage1 (rank 1, pipeline rank 1) holds chunk {c}, which lives on pipeline rank 0"
            )
        );
    }

    let mut plan = base.clone();
    plan.rank_to_role[1] = 7;
    let err = rejects(&plan, "a rank without a role");
    assert!(err.contains("rank 1 has role 7"), "{err}");

    let mut plan = base.clone();
    for instr in plan.roles[0].optimizer.iter_mut() {
        if let Instr::Kernel {
            op: OpKind::GradNorm { .. },
            inputs,
            ..
        } = instr
        {
            inputs.clear();
        }
    }
    // grad_norm without inputs is still one reduction: the plan still checks.
    check_plan(&plan).unwrap();

    let mut plan = base;
    let fwd = &mut pipe(&mut plan, 1).chunks[0].forward;
    let k = fwd
        .iter()
        .position(|i| matches!(i, Instr::Recv { .. }))
        .unwrap();
    if let Instr::Recv { chunk, .. } = &mut fwd[k] {
        *chunk = 1; // from itself: the message never comes
    }
    let err = rejects(&plan, "a receive from the wrong chunk");
    assert!(err.starts_with("deadlock"), "{err}");
}

/// examples/gpt3-175b.toml as it is: 1,024 ranks (tp8 · dp8 · pp16), vpp 2, 192
/// micro-batches per step, tied embeddings, the distributed optimizer. The validator
/// simulates one rank per stage and stays well under a second.
#[test]
fn large_plans_check_fast() {
    for sets in [&[][..], &["parallel.vpp=1", "parallel.schedule=1f1b"]] {
        let plan = compile("gpt3-175b.toml", sets);
        assert_eq!(plan.rank_to_role.len(), 1024);
        let start = Instant::now();
        check_plan(&plan).unwrap();
        let took = start.elapsed();
        eprintln!("check_plan of gpt3-175b, 1,024 ranks, {sets:?}: {took:?}");
        assert!(took.as_secs_f64() < 1.0, "check_plan took {took:?}");
    }
    // bench/gpt-1t.toml: 16,384 ranks (tp8 · pp64 · dp32), one simulated per stage.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/gpt-1t.toml");
    let spec = megac_frontend::load(&path, &[]).unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true).unwrap();
    let plan = megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops)
        .unwrap_or_else(|e| panic!("gpt-1t: {e}"));
    assert_eq!(plan.rank_to_role.len(), 16_384);
    let start = Instant::now();
    check_plan(&plan).unwrap();
    let took = start.elapsed();
    eprintln!("check_plan of gpt-1t, 16,384 ranks: {took:?}");
    assert!(took.as_secs_f64() < 1.0, "check_plan took {took:?}");

    // Rank 1 with its own copy of its role: no two ranks are interchangeable any more, so
    // every one of the 1,024 ranks is simulated.
    let mut plan = compile("gpt3-175b.toml", &[]);
    own_role(&mut plan, 1);
    let start = Instant::now();
    check_plan(&plan).unwrap();
    let took = start.elapsed();
    eprintln!("check_plan of gpt3-175b, 1,024 ranks, all simulated: {took:?}");
    assert!(took.as_secs_f64() < 3.0, "check_plan took {took:?}");
}
