//! `megac`: the command-line interface (see `megac --help` and DESIGN.md's command line
//! contract). Each subcommand lives in `commands/`; errors are rendered once, here.

mod commands;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// A compiler and runtime for distributed LLM training.
#[derive(Parser)]
#[command(name = "megac", version, about, long_about = None)]
#[command(
    after_help = "Examples:\n  megac check examples/llama-tiny.toml\n  megac dump examples/gpt-tiny.toml --set parallel.tp=2\n  megac passes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Options shared by every command that reads a model.toml.
#[derive(clap::Args)]
pub struct ModelArgs {
    /// Path to the model description (see docs/model-toml.md).
    #[arg(value_name = "MODEL.toml")]
    pub model: PathBuf,
    /// Override a model.toml key, e.g. `--set parallel.tp=2` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a model.toml and print a one-screen summary (parameters, FLOPs, layout, ranks).
    #[command(after_help = "Example:\n  megac check examples/llama3-8b.toml --set parallel.tp=4")]
    Check {
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Print the IR of a model after a pass (default: after the last pass).
    #[command(after_help = "Example:\n  megac dump examples/llama-tiny.toml --after build")]
    Dump {
        #[command(flatten)]
        model: ModelArgs,
        /// Stop after this pass (see `megac passes`).
        #[arg(long, value_name = "PASS")]
        after: Option<String>,
    },
    /// List the compiler's passes in pipeline order.
    #[command(after_help = "Example:\n  megac passes")]
    Passes,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check { model } => commands::check::run(&model),
        Command::Dump { model, after } => commands::dump::run(&model, after.as_deref()),
        Command::Passes => commands::passes::run(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprint!("{message}");
            if !message.ends_with('\n') {
                eprintln!();
            }
            ExitCode::FAILURE
        }
    }
}
