//! `megac schedule`: the pipeline schedule of a layout, per rank, with its bubble.
//!
//! Plans do not carry pipelines yet, so this command reads a model.toml (its `[parallel]`
//! pp, vpp, schedule and dpp_policy, and the micro-batches per step) and shows the schedule
//! the compiler will give each pipeline rank, simulated with unit costs (F = B = W = 1).

use megac_ir::spec::{DppPolicy, Schedule};
use megac_passes::schedule::{self, Costs, ScheduleKind};

use crate::ModelArgs;

/// Print the schedule as text (one row per rank) or as JSON (DESIGN.md's contract).
pub fn run(args: &ModelArgs, format: &str, with_comm: bool) -> Result<(), String> {
    let spec = super::load_spec(args)?;
    let p = &spec.parallel;
    let kind = match p.schedule {
        Schedule::Gpipe => ScheduleKind::GPipe,
        Schedule::OneFOneB => ScheduleKind::OneFOneB,
        Schedule::Interleaved => ScheduleKind::Interleaved,
        Schedule::ZbH1 => ScheduleKind::ZbH1,
        Schedule::Dpp => ScheduleKind::Dpp(match p.dpp_policy {
            DppPolicy::Bfs => schedule::DppPolicy::Bfs,
            DppPolicy::Dfs => schedule::DppPolicy::Dfs,
            DppPolicy::Adaptive => schedule::DppPolicy::Adaptive { cap: None },
        }),
    };
    let (pp, vpp) = (p.pp as u32, p.vpp as u32);
    let m = spec.train.microbatches(p.dp) as u32;
    let lists = schedule::schedule(kind, pp, vpp, m).map_err(|e| format!("error: {e}"))?;
    schedule::validate(&lists, pp, vpp, m)
        .map_err(|e| format!("error: the schedule does not validate: {e}"))?;
    let timeline = schedule::simulate(&lists, Costs::unit()).map_err(|e| format!("error: {e}"))?;
    match format {
        "json" => println!("{}", schedule::render_json(&lists, vpp, &timeline)),
        "text" => {
            println!(
                "{} schedule: pp={pp} vpp={vpp}, {m} micro-batches per step, unit costs (F = B = W = 1)",
                p.schedule.as_str()
            );
            print!("{}", schedule::render_text(&lists, vpp, with_comm));
            println!(
                "bubble fraction {:.4} (idle over total time, all ranks)",
                timeline.bubble_fraction
            );
        }
        other => return Err(format!("error: --format {other}: expected text or json")),
    }
    Ok(())
}
