//! `megac checkpoint inspect|export`: read a checkpoint written by `--save`.

use std::path::{Path, PathBuf};

use megac_runtime::checkpoint::{Checkpoint, Kind};

/// What to do with a checkpoint.
#[derive(clap::Subcommand)]
pub enum Action {
    /// Print a checkpoint's step, the layout it was saved in, its files and its tensors.
    Inspect {
        /// A checkpoint folder (its latest complete step) or a step folder.
        #[arg(value_name = "DIR")]
        dir: PathBuf,
        /// Machine-readable output (the index itself).
        #[arg(long)]
        json: bool,
    },
    /// Write a checkpoint's weights as Hugging Face safetensors (the names and shapes
    /// `--save-params` writes).
    Export {
        /// A checkpoint folder (its latest complete step) or a step folder.
        #[arg(value_name = "DIR")]
        dir: PathBuf,
        /// The safetensors file to write (missing folders are created).
        #[arg(short = 'o', long = "output", value_name = "FILE.safetensors")]
        output: PathBuf,
    },
}

/// Run `action`.
pub fn run(action: &Action) -> Result<(), String> {
    match action {
        Action::Inspect { dir, json } => inspect(dir, *json),
        Action::Export { dir, output } => export(dir, output),
    }
}

fn open(dir: &Path) -> Result<Checkpoint, String> {
    Checkpoint::open(dir).map_err(|e| format!("error: checkpoint {e}"))
}

fn inspect(dir: &Path, json: bool) -> Result<(), String> {
    let ckpt = open(dir)?;
    let ix = &ckpt.index;
    if json {
        let text = serde_json::to_string_pretty(ix).map_err(|e| format!("error: {e}"))?;
        println!("{text}");
        return Ok(());
    }
    let layout: Vec<String> = ix
        .mesh
        .axes
        .iter()
        .filter(|(_, n)| *n > 1)
        .map(|(a, n)| format!("{}={n}", a.as_str()))
        .collect();
    let bytes: u64 = ix.files.iter().map(|f| f.bytes).sum();
    println!("checkpoint {}", ckpt.dir.display());
    println!("  model          {} ({})", ix.model, ix.arch);
    println!(
        "  step           {} ({} samples consumed)",
        ix.step, ix.consumed_samples
    );
    println!(
        "  layout         {} ({} rank{}){}",
        if layout.is_empty() {
            "single device".to_string()
        } else {
            layout.join(" ")
        },
        ix.mesh.world_size(),
        if ix.mesh.world_size() == 1 { "" } else { "s" },
        if ix.distributed_optimizer {
            ", distributed optimizer"
        } else {
            ""
        }
    );
    println!("  precision      {}", ix.precision);
    println!("  lr             {:e} at step {}", ix.last_lr, ix.step);
    if let Some(s) = &ix.loss_scaler {
        println!(
            "  loss scale     {}",
            megac_runtime::scaler::fmt_scale(s.scale)
        );
    }
    println!(
        "  files          {} ({:.2} MiB, checksums verified)",
        ix.files.len(),
        bytes as f64 / (1u64 << 20) as f64
    );
    println!("  plan           {}", ix.plan_fingerprint);
    println!("  tensors        {}", ix.tensors.len());
    for t in &ix.tensors {
        let kinds: Vec<&str> = Kind::ALL
            .iter()
            .map(|k| k.name())
            .filter(|k| t.pieces.get(*k).is_some_and(|p| !p.is_empty()))
            .collect();
        let elems: u64 = t.shape.iter().product();
        println!(
            "    {:<48} {:<14} {:>10} elems  {}",
            t.name,
            format!("{:?}", t.shape),
            elems,
            kinds.join(",")
        );
    }
    Ok(())
}

fn export(dir: &Path, output: &Path) -> Result<(), String> {
    super::output::check_file("-o", output)?;
    let ckpt = open(dir)?;
    let tensors = ckpt
        .hf_tensors(Kind::Param)
        .map_err(|e| format!("error: checkpoint {e}"))?;
    let refs: Vec<(String, Vec<usize>, &[f32])> = tensors
        .iter()
        .map(|(n, s, v)| (n.clone(), s.clone(), v.as_slice()))
        .collect();
    // The config is read (and checked to be JSON) before anything is written.
    let config_path = ckpt.dir.join(megac_runtime::checkpoint::HF_CONFIG);
    let config = if config_path.is_file() {
        let text = megac_ir::file::read_text(&config_path, megac_ir::file::MAX_CONFIG_BYTES)
            .map_err(|e| format!("error: {}: {e}", config_path.display()))?;
        serde_json::from_str::<serde_json::Value>(&text)
            .map_err(|e| format!("error: {}: not JSON: {e}", config_path.display()))?;
        Some(text)
    } else {
        None
    };
    let dir = match output.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let config_out = dir.join("config.json");
    if config.is_some() && config_out.is_dir() {
        return Err(format!(
            "error: {}: is a folder; the Hugging Face config goes there",
            config_out.display()
        ));
    }
    megac_runtime::hf::save_params(output, &refs).map_err(|e| format!("error: {e}"))?;
    println!(
        "exported {} tensors of step {} to {}",
        refs.len(),
        ckpt.index.step,
        output.display()
    );
    match config {
        Some(text) => {
            super::output::write_file(&config_out, &text)?;
            println!("wrote the Hugging Face config to {}", config_out.display());
        }
        None => println!(
            "note: {} holds no config.json (a checkpoint from before megac saved it); \
             only the weights were exported",
            ckpt.dir.display()
        ),
    }
    Ok(())
}
