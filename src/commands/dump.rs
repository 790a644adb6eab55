//! `megac dump`: print the IR after a pass.

use std::io::Write;

use crate::ModelArgs;

/// Compile up to `after` and print the IR (rank `rank`'s local view if given).
/// `probes` and `perturb` are what the `probe` and `perturb` passes insert (none: they
/// change nothing).
pub fn run(
    args: &ModelArgs,
    after: Option<&str>,
    rank: Option<usize>,
    probes: &[String],
    perturb: &[String],
) -> Result<(), String> {
    if after == Some("fuse") {
        // The fusion pass runs on the plan's instruction streams: its groups, per role.
        let plan = super::compile::build_plan(args)?;
        let _ = std::io::stdout()
            .lock()
            .write_all(megac_codegen::fuse::dump(&plan).as_bytes());
        return Ok(());
    }
    let spec = super::load_spec(args)?;
    let instrument = megac_passes::Instrument {
        probes: probes.to_vec(),
        perturbations: perturb
            .iter()
            .map(|p| {
                megac_runtime::perturb::TrainPerturbation::parse(p)
                    .map_err(|e| format!("error: {e}"))
            })
            .collect::<Result<_, _>>()?,
        train: true,
        ..Default::default()
    };
    let module = megac_passes::run_pipeline_with(spec, instrument, after, true)
        .map_err(|e| format!("error: {e}"))?;
    let text = match (rank, &module.graph) {
        (Some(r), Some(g)) => {
            let local = g
                .localize(r)
                .map_err(|e| format!("error: --rank {r}: {e}"))?;
            megac_ir::print_graph(&local)
        }
        _ => module.dump(),
    };
    let mut out = std::io::stdout().lock();
    // A closed pipe (`megac dump ... | head`) is not an error worth a message.
    let _ = out.write_all(text.as_bytes());
    Ok(())
}
