//! `megac compile`: compile a model.toml into a plan directory.

use std::path::Path;

use megac_ir::plan::{Plan, PlanKind};

use crate::ModelArgs;

/// Compile the model into a Plan (in memory).
pub fn build_plan(args: &ModelArgs) -> Result<Plan, String> {
    build_plan_of(args, PlanKind::Train)
}

/// Compile the model into a plan of `kind`: a training plan, or a forward-only inference
/// plan (the `build` and `shard` passes, no gradient or optimizer memory).
pub fn build_plan_of(args: &ModelArgs, kind: PlanKind) -> Result<Plan, String> {
    build_plan_with(args, kind, &megac_passes::Instrument::default())
}

/// [`build_plan_of`] with the probes and perturbations of `instrument` (the `perturb` and
/// `probe` passes; `megac scope`, `megac train --perturb`).
pub fn build_plan_with(
    args: &ModelArgs,
    kind: PlanKind,
    instrument: &megac_passes::Instrument,
) -> Result<Plan, String> {
    let spec = super::load_spec(args)?;
    // The plan records the `[cluster]`; a device that is no preset is refused now, not
    // when the plan is simulated.
    if let Some(c) = &spec.cluster {
        super::simulate::cluster_or(None, Some((c, args.model.display().to_string())))?;
    }
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = match kind {
        PlanKind::Train => megac_passes::run_pipeline_with(spec, instrument.clone(), None, true)
            .map_err(|e| format!("error: {e}"))?,
        PlanKind::Inference => megac_passes::run_inference_pipeline_with(spec, instrument.clone())
            .map_err(|e| format!("error: {e}"))?,
    };
    let graph = module
        .graph
        .as_ref()
        .ok_or("error: the pipeline built no graph")?;
    match kind {
        PlanKind::Train => megac_codegen::emit_plan(&module.spec, graph, flops),
        PlanKind::Inference => megac_codegen::emit_inference_plan(&module.spec, graph, flops),
    }
    .map_err(|e| format!("error: {e}"))
}

/// What `--emit` adds beside plan.json.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Emit {
    /// One MLIR module per role, `role-<name>.mlir` (feature `mlir`).
    Mlir,
}

/// The MLIR modules of `plan` (file name, text), verified; only in a build with `mlir`.
#[cfg(feature = "mlir")]
fn mlir_modules(plan: &Plan) -> Result<Vec<(String, String)>, String> {
    megac_codegen::mlir::emit_modules(plan).map_err(|e| format!("error: {e}"))
}

#[cfg(not(feature = "mlir"))]
fn mlir_modules(_: &Plan) -> Result<Vec<(String, String)>, String> {
    Err(NO_MLIR.to_string())
}

/// The answer to `--emit mlir` in a build without the feature.
#[cfg(not(feature = "mlir"))]
const NO_MLIR: &str = "error: --emit mlir needs megac built with the `mlir` feature (LLVM/MLIR 22: see the README's setup, then `cargo build --release --features mlir`)";

/// Compile and write `out/plan.json`, and beside it `out/config.json`, the model's Hugging
/// Face config (`megac run --save-params` copies it beside the saved weights); with
/// `--emit mlir` also each role's MLIR module, all verified before anything is written.
/// With `kv_cache`, the KV-cache plan `megac generate` runs (`super::generate::compile_kv`).
pub fn run(
    args: &ModelArgs,
    out: &Path,
    emit: Option<Emit>,
    kind: PlanKind,
    kv_cache: bool,
) -> Result<(), String> {
    #[cfg(not(feature = "mlir"))]
    if emit == Some(Emit::Mlir) {
        return Err(NO_MLIR.to_string());
    }
    super::output::check_dir("-o", out)?;
    let plan = if kv_cache {
        let window = super::generate::compile_forward(args)?;
        super::generate::compile_kv(args, &window)?.into_inner()
    } else {
        build_plan_of(args, kind)?
    };
    let modules = match emit {
        Some(Emit::Mlir) => mlir_modules(&plan)?,
        None => Vec::new(),
    };
    megac_codegen::write_plan(&plan, out).map_err(|e| format!("error: {e}"))?;
    for (name, text) in &modules {
        super::output::write_file(&out.join(name), text)?;
    }
    let spec = super::load_spec(args)?;
    super::output::write_file(
        &out.join("config.json"),
        &megac_frontend::hf::export_config(&spec),
    )?;
    let instrs: usize = plan
        .roles
        .iter()
        .map(|r| {
            let chunks: usize = r.pipeline.as_ref().map_or(0, |p| {
                p.chunks
                    .iter()
                    .map(|c| c.forward.len() + c.backward.len() + c.weight.len() + c.decode.len())
                    .sum()
            });
            r.microbatch.len()
                + r.optimizer.len()
                + chunks
                + r.decode.as_ref().map_or(0, |d| d.step.len())
        })
        .sum();
    println!(
        "wrote {}: {} rank(s), {} instructions, {} parameters, {:.1} MiB per rank (see `megac inspect {}`)",
        out.join("plan.json").display(),
        plan.rank_to_role.len(),
        instrs,
        plan.params.iter().map(|p| p.shape.iter().product::<u64>()).sum::<u64>(),
        plan.memory.total() as f64 / (1u64 << 20) as f64,
        out.display()
    );
    if !modules.is_empty() {
        println!(
            "wrote {} MLIR module(s) in {}: {}",
            modules.len(),
            out.display(),
            modules
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}
