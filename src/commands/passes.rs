//! `megac passes`: list the pipeline.

/// Print each pass with its description.
pub fn run() -> Result<(), String> {
    let passes = megac_passes::pipeline();
    let width = passes.iter().map(|p| p.name.len()).max().unwrap_or(0);
    for (i, p) in passes.iter().enumerate() {
        println!("{:>2}. {:width$}  {}", i + 1, p.name, p.description);
    }
    println!("then codegen (megac compile) lowers the graph to a plan (not graph passes; stages and schedule are megac_ir::pipeline):");
    for (name, what) in [
        ("stages", "pp > 1: layers per pipeline chunk (parallel.stage_layers, \"balanced\" by cost, or even)"),
        ("schedule", "per-stage action lists (gpipe, 1f1b, interleaved, zb-h1, dpp) over F/B/W segments"),
        ("pipeline", "stage roles: chunk segments, tagged send/recv, per-stage optimizer and memory, FBD forward roles"),
        ("memory", "liveness placement of activations (one slot per micro-batch in flight), buckets, ZeRO-1"),
        ("fuse", "groups of consecutive elementwise/row-reduction instructions run as one kernel (MLIR JIT in `mlir` builds; plan unchanged; megac dump --after fuse)"),
    ] {
        println!("    {name:width$}  {what}");
    }
    Ok(())
}
