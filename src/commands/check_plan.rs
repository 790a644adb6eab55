//! `megac check-plan`: run the plan gate (`megac_ir::gate`: indices, arenas, kernel shapes,
//! programs) and prove the plan cannot deadlock and that its messages and collectives match
//! across ranks (a simulation of all ranks with blocking semantics, see `megac_ir::check`).

use std::path::Path;

/// Check the plan in `dir` and print a one-line verdict.
pub fn run(dir: &Path) -> Result<(), String> {
    // Reading the plan runs the gate, which includes the deadlock and schedule check.
    let plan = super::inspect::read_plan(dir)?;
    let pipelined = plan.roles.iter().any(|r| r.pipeline.is_some());
    println!(
        "ok: {} ranks in {} role(s); every collective is called by all members of its group in the same order with the same sizes{}, and no rank can block forever",
        plan.rank_to_role.len(),
        plan.roles.len(),
        if pipelined {
            ", every send meets its receive with the same size, every schedule runs each micro-batch's forward and backward once"
        } else {
            ""
        }
    );
    Ok(())
}
