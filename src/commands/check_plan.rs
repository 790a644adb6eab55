//! `megac check-plan`: prove a compiled plan's collectives match across ranks.

use std::path::Path;

/// Check the plan in `dir` and print a one-line verdict.
pub fn run(dir: &Path) -> Result<(), String> {
    let plan = super::inspect::read_plan(dir)?;
    megac_ir::check::check_plan(&plan)
        .map_err(|e| format!("error: {}: {e}", dir.join("plan.json").display()))?;
    println!(
        "ok: {} ranks in {} role(s); every group's members make the same collective calls in the same order",
        plan.rank_to_role.len(),
        plan.roles.len()
    );
    Ok(())
}
