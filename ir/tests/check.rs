//! The plan validator on small hand-written plans: collective cycles, tagged messages,
//! repeated tags and malformed instructions.

use megac_ir::check::check_plan;
use megac_ir::plan::Plan;
use serde_json::{json, Value};

/// A plan over mesh `tp × dp` (2 × 2 unless given) with buffers of 4, 8 and 16 elements
/// and these non-pipelined roles (`[name, microbatch program]`) and rank table.
fn plan(axes: Value, roles: Value, rank_to_role: Value) -> Plan {
    let buffer = |n: u64| json!({"name": format!("b{n}"), "class": "activation", "dtype": "f32", "shape": [n], "offset": 0});
    let roles: Vec<Value> = roles
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            json!({"name": r[0], "microbatch": r[1], "optimizer": [], "inputs": {}, "results": {}})
        })
        .collect();
    let memory = json!({"param_bytes": 0, "grad_bytes": 0, "opt_state_bytes": 0,
        "activation_bytes": 0, "activation_bytes_unplanned": 0, "input_bytes": 0});
    let plan = json!({
        "schema_version": megac_ir::plan::SCHEMA_VERSION,
        "model": "hand", "arch": "llama",
        "mesh": {"axes": axes},
        "batch": {"micro_batch": 1, "global_batch": 1, "seq_len": 1, "vocab": 1,
                  "microbatches": 1, "tokens_per_step": 1},
        "train": {"steps": 1, "seed": 0, "lr": 0.0, "lr_schedule": {"kind": "constant"},
                  "precision": "fp32"},
        "buffers": [buffer(4), buffer(8), buffer(16)],
        "params": [], "roles": roles, "rank_to_role": rank_to_role,
        "memory": memory, "flops_per_step": 0.0
    });
    Plan::parse_json(&plan.to_string()).unwrap()
}

fn grid() -> Value {
    json!([["tp", 2], ["cp", 1], ["ep", 1], ["dp", 2], ["pp", 1]])
}

fn all_reduce(axes: &str, buffer: u32) -> Value {
    json!({"op": "all_reduce", "attrs": {"axes": axes}, "in": [buffer], "out": [buffer], "path": format!("ar.{axes}")})
}

#[test]
fn collectives_waiting_in_a_cycle_of_groups_deadlock() {
    let tp_dp = json!([all_reduce("tp", 0), all_reduce("dp", 1)]);
    let dp_tp = json!([all_reduce("dp", 1), all_reduce("tp", 0)]);
    // 0: tp{0,1} then dp{0,2}; 1: dp{1,3} then tp{0,1}: rank 0 waits for 1 at tp while 1
    // waits for 3 at dp; 3 (tp then dp) waits for 2 at tp{2,3}; 2 (dp then tp) waits for 0
    // at dp{0,2}: a cycle.
    let p = plan(
        grid(),
        json!([["a", tp_dp], ["b", dp_tp]]),
        json!([0, 1, 1, 0]),
    );
    let err = check_plan(&p).unwrap_err();
    assert!(err.starts_with("deadlock"), "{err}");
    for line in [
        "rank 0 at a microbatch[0] all_reduce of 4 elements, ar.tp on group [0, 1]: waits for rank 1",
        "rank 1 at b microbatch[0] all_reduce of 8 elements, ar.dp on group [1, 3]: waits for rank 3",
        "rank 2 at b microbatch[0] all_reduce of 8 elements, ar.dp on group [0, 2]: waits for rank 0",
        "rank 3 at a microbatch[0] all_reduce of 4 elements, ar.tp on group [2, 3]: waits for rank 2",
    ] {
        assert!(err.contains(line), "{line}\n{err}");
    }
    // The wait-for graph's cycle, from the lowest rank, each with its instruction.
    let cycle = "wait-for cycle: rank 0 (a microbatch[0] all_reduce of 4 elements, ar.tp) \
                 -> rank 1 (b microbatch[0] all_reduce of 8 elements, ar.dp) \
                 -> rank 3 (a microbatch[0] all_reduce of 4 elements, ar.tp) \
                 -> rank 2 (b microbatch[0] all_reduce of 8 elements, ar.dp) -> rank 0";
    assert!(err.contains(cycle), "{cycle}\n{err}");

    // The same two orders where the dp groups share one order: everything meets.
    let p = plan(
        grid(),
        json!([["a", tp_dp], ["b", dp_tp]]),
        json!([0, 0, 1, 1]),
    );
    // 0,1: tp{0,1} then dp; 2,3: dp first: rank 2 waits at dp{0,2} for 0, which is at tp
    // with 1 (both there: done), then 0 comes to dp{0,2}: done; likewise 1 and 3.
    check_plan(&p).unwrap();
}

#[test]
fn a_rank_that_finishes_early_is_named() {
    let p = plan(
        grid(),
        json!([
            ["a", [all_reduce("tp", 0), all_reduce("tp", 0)]],
            ["b", [all_reduce("tp", 0)]]
        ]),
        json!([0, 1, 0, 1]),
    );
    let err = check_plan(&p).unwrap_err();
    assert!(
        err.contains("rank 0 at a microbatch[1] all_reduce of 4 elements, ar.tp on group [0, 1]: waits for rank 1 (finished)"),
        "{err}"
    );
}

#[test]
fn transfers_match_by_tag_not_order_and_repeated_tags_queue() {
    let send = |b: u32, t: u32| json!({"op": "send", "attrs": {"chunk": "0", "transfer": t.to_string()}, "in": [b]});
    let recv = |b: u32, t: u32| json!({"op": "recv", "attrs": {"chunk": "0", "transfer": t.to_string()}, "out": [b]});
    let one = json!([["tp", 1], ["cp", 1], ["ep", 1], ["dp", 1], ["pp", 1]]);
    // A rank sends to itself (pp = 1): received in the other order, by tag.
    let p = plan(
        one.clone(),
        json!([["r", [send(0, 1), send(1, 2), recv(1, 2), recv(0, 1)]]]),
        json!([0]),
    );
    check_plan(&p).unwrap();
    // The same tag twice: received in sending order, so sizes must match in that order.
    let p = plan(
        one.clone(),
        json!([["r", [send(0, 1), send(1, 1), recv(1, 1), recv(0, 1)]]]),
        json!([0]),
    );
    let err = check_plan(&p).unwrap_err();
    assert_eq!(
        err,
        "transfer 1 micro-batch 0: rank 0 sends 4 elements (r microbatch[0] send of transfer 1 to rank 0) but rank 0 receives 8 (r microbatch[2] recv of transfer 1 from rank 0)"
    );
    // A receive before any send of its tag blocks forever.
    let p = plan(
        one.clone(),
        json!([["r", [recv(0, 1), send(0, 1)]]]),
        json!([0]),
    );
    let err = check_plan(&p).unwrap_err();
    assert!(
        err.contains(
            "rank 0 at r microbatch[0] recv of transfer 1 from rank 0: rank 0 has not sent it"
        ),
        "{err}"
    );
    // Out-of-range buffers and operands are errors, not panics.
    let p = plan(one.clone(), json!([["r", [send(9, 1)]]]), json!([0]));
    assert!(check_plan(&p)
        .unwrap_err()
        .contains("buffer 9, which does not exist"));
    let bad = json!({"op": "all_reduce", "attrs": {"axes": "tp"}, "in": [], "out": [0]});
    let p = plan(grid(), json!([["r", [bad]]]), json!([0, 0, 0, 0]));
    assert!(check_plan(&p).unwrap_err().contains("has no operand 0"));
}
