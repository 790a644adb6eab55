//! `megac compile`: compile a model.toml into a plan directory.

use std::path::Path;

use megac_ir::plan::Plan;

use crate::ModelArgs;

/// Compile the model into a Plan (in memory).
pub fn build_plan(args: &ModelArgs) -> Result<Plan, String> {
    let spec = super::load_spec(args)?;
    // The plan records the `[cluster]`; a device that is no preset is refused now, not
    // when the plan is simulated.
    if let Some(c) = &spec.cluster {
        super::simulate::cluster_or(None, Some((c, args.model.display().to_string())))?;
    }
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = super::compile(spec, None)?;
    let graph = module
        .graph
        .as_ref()
        .ok_or("error: the pipeline built no graph")?;
    megac_codegen::emit_plan(&module.spec, graph, flops).map_err(|e| format!("error: {e}"))
}

/// Compile and write `out/plan.json`, and beside it `out/config.json`, the model's Hugging
/// Face config (`megac run --save-params` copies it beside the saved weights).
pub fn run(args: &ModelArgs, out: &Path) -> Result<(), String> {
    super::output::check_dir("-o", out)?;
    let plan = build_plan(args)?;
    megac_codegen::write_plan(&plan, out).map_err(|e| format!("error: {e}"))?;
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
                    .map(|c| c.forward.len() + c.backward.len() + c.weight.len())
                    .sum()
            });
            r.microbatch.len() + r.optimizer.len() + chunks
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
    Ok(())
}
