//! `megac import-hf CONFIG.json -o model.toml`: the `[model]` section of a Hugging Face
//! config (`megac_frontend::hf::import_config`), checked by loading it back.

use std::path::Path;

/// Read `config`, write its model.toml to `out`, and validate what was written.
pub fn run(config: &Path, out: &Path) -> Result<(), String> {
    super::output::check_file("-o", out)?;
    let file = config.display().to_string();
    let text = megac_ir::file::read_text(config, megac_ir::file::MAX_CONFIG_BYTES)
        .map_err(|e| format!("error: {file}: cannot read the file: {e}"))?;
    let toml = megac_frontend::hf::import_config(&file, &text).map_err(|e| e.render())?;
    // What is written must load as a model.toml (its own validation, e.g. head sizes).
    let name = out.display().to_string();
    megac_frontend::parse_str(&name, &toml, &[]).map_err(|e| e.render())?;
    super::output::write_file(out, &toml)?;
    println!("wrote {name} from {file}");
    Ok(())
}
