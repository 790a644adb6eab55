//! End-to-end gradient check: the compiled backward (autodiff pass, codegen, runtime, kernels)
//! against central finite differences of the compiled forward, for both architectures.

use std::path::Path;

use megac_runtime::train::Session;

fn plan(file: &str, sets: &[&str]) -> megac_ir::gate::CheckedPlan {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(file);
    let spec = megac_frontend::load(&path, &sets).unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true).unwrap();
    let plan =
        megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops).unwrap();
    megac_ir::gate::CheckedPlan::check(plan).unwrap()
}

/// Loss of micro-batch 0 of step 1 (gradients accumulate as a side effect; callers zero them).
fn loss(s: &mut Session) -> f64 {
    s.mem.zero_grads();
    s.microbatch(1, 0).unwrap()
}

fn check(file: &str, recompute: &str) {
    check_with(file, recompute, 10.0, 1e-2);
}

fn check_with(file: &str, recompute: &str, weight_scale: f32, eps: f32) {
    check_sets(file, recompute, weight_scale, eps, &[]);
}

fn check_sets(file: &str, recompute: &str, weight_scale: f32, eps: f32, extra: &[&str]) {
    let recompute = format!("train.recompute=\"{recompute}\"");
    let mut sets = vec![
        "model.layers=2",
        "model.seq_len=8",
        "train.micro_batch=2",
        "train.global_batch=2",
        "model.vocab=64",
        &recompute,
    ];
    sets.extend_from_slice(extra);
    let plan = plan(file, &sets);
    let mut s = Session::new(&plan, "synthetic", None).unwrap();
    // Larger weights than the default init make every path matter.
    for p in &plan.params {
        for (i, x) in s.mem.buffer_mut(p.buffer).iter_mut().enumerate() {
            if p.shape.len() == 2 {
                *x *= weight_scale;
            } else {
                *x += 0.1 * ((i % 7) as f32 - 3.0);
            }
        }
    }
    loss(&mut s);
    let grads: Vec<Vec<f32>> = plan
        .params
        .iter()
        .map(|p| {
            s.mem
                .f32(p.grad.expect("a training plan's gradient"))
                .to_vec()
        })
        .collect();
    let mut worst = (0.0f64, String::new());
    for (p, g) in plan.params.iter().zip(&grads) {
        let n = g.len();
        // A few elements per parameter, including the largest-gradient one.
        let argmax = (0..n)
            .max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs()))
            .unwrap();
        for i in [0, n / 3, n - 1, argmax] {
            let orig = s.mem.f32(p.buffer)[i];
            s.mem.buffer_mut(p.buffer)[i] = orig + eps;
            let up = loss(&mut s);
            s.mem.buffer_mut(p.buffer)[i] = orig - eps;
            let down = loss(&mut s);
            s.mem.buffer_mut(p.buffer)[i] = orig;
            let numeric = (up - down) / (2.0 * f64::from(eps));
            let analytic = f64::from(g[i]);
            let err = (numeric - analytic).abs() / (numeric.abs().max(analytic.abs()) + 2e-3);
            if err > worst.0 {
                worst = (
                    err,
                    format!(
                        "{}[{i}]: analytic {analytic:.6e}, numeric {numeric:.6e}",
                        p.name
                    ),
                );
            }
        }
    }
    assert!(
        worst.0 < 0.05,
        "{file} ({recompute}): worst relative error {:.3}: {}",
        worst.0,
        worst.1
    );
}

#[test]
fn llama_gradients_match_finite_differences() {
    check("llama-tiny.toml", "none");
}

#[test]
fn gpt_gradients_match_finite_differences() {
    check("gpt-tiny.toml", "none");
}

#[test]
fn recomputed_gradients_match_finite_differences() {
    check("llama-tiny.toml", "full");
    check("gpt-tiny.toml", "selective");
}

/// Mixtral-style MoE: router (softmax, top-2, renormalisation), load-balancing loss,
/// dispatch, experts, combine.
#[test]
fn moe_gradients_match_finite_differences() {
    // Every expert chosen (top_k = experts): finite differences cannot flip a routing
    // choice, yet the router's softmax and renormalisation, the load-balancing loss,
    // dispatch and combine are all on the path. (The kernels' own tests cover top-k < E.)
    check_sets("moe-tiny.toml", "none", 10.0, 1e-2, &["model.moe.top_k=4"]);
}
