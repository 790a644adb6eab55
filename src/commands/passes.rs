//! `megac passes`: list the pipeline.

/// Print each pass with its description.
pub fn run() -> Result<(), String> {
    let passes = megac_passes::pipeline();
    let width = passes.iter().map(|p| p.name.len()).max().unwrap_or(0);
    for (i, p) in passes.iter().enumerate() {
        println!("{:>2}. {:width$}  {}", i + 1, p.name, p.description);
    }
    Ok(())
}
