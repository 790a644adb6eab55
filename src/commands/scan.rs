//! `megac scan DIR`: align, detect and merge a traced run (`megac_runtime::scan::analyze`).

use std::path::PathBuf;

use megac_runtime::scan::analyze;

/// Options of `megac scan`.
#[derive(clap::Args)]
pub struct ScanArgs {
    /// A trace directory written by `megac train|run|launch ... --trace DIR`.
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// Report format on standard output: `text` or `json` ({"steps", "ranks", "findings":
    /// [{"kind": "slow-rank"|"slow-link", "ranks", "score", "first_step"}], "clock":
    /// {"offsets_us", "drift_ppm", "method"}}).
    #[arg(long, default_value = "text", value_name = "text|json")]
    pub format: String,
    /// Write the merged, clock-aligned timeline of every rank as a Chrome trace (opens in
    /// Perfetto): a process per rank, compute and communication threads, flow arrows.
    #[arg(short = 'o', long = "output", value_name = "TRACE.json")]
    pub output: Option<PathBuf>,
    /// Draw the merged, aligned timeline as an SVG (a compute and a communication lane per
    /// rank; the ranks a finding names in red).
    #[arg(long, value_name = "FILE.svg")]
    pub svg: Option<PathBuf>,
}

/// Run `megac scan`.
pub fn run(args: &ScanArgs) -> Result<(), String> {
    if !matches!(args.format.as_str(), "text" | "json") {
        return Err(format!(
            "error: --format {}: expected text or json",
            args.format
        ));
    }
    if let Some(o) = &args.output {
        super::output::check_file("-o", o)?;
    }
    if let Some(o) = &args.svg {
        super::output::check_file("--svg", o)?;
    }
    let ranks = analyze::read_dir(&args.dir).map_err(|e| format!("error: {e}"))?;
    let report = analyze::scan(&ranks);
    if let Some(o) = &args.output {
        super::output::write_file(o, &analyze::chrome_trace(&ranks, &report.clock))?;
    }
    if let Some(o) = &args.svg {
        super::output::write_file(o, &crate::render::scan::render_svg(&ranks, &report))?;
    }
    if args.format == "json" {
        print!("{}", report.to_json());
    } else {
        print!("{}", report.to_text());
    }
    Ok(())
}
