//! The fuzz targets: one function per reader of user input, `fn(&[u8]) -> Outcome`.
//!
//! Each target feeds the bytes to the reader exactly as megac does after reading the file
//! (text readers get the bytes only when they are UTF-8, as `read_to_string` does), then
//! exercises what the reader promises about an accepted input (e.g. a data source yields
//! samples, loaded tensors have their shapes' sizes). A reader passes when it returns a value
//! or a typed error with a non-empty message; a panic, an abort, a hang or an empty
//! message is a finding.

use std::path::Path;

use megac_ir::plan::Plan;
use megac_runtime::data::{DataSource, TokenFormat};

/// What a reader made of one input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The reader accepted the input.
    Accepted,
    /// The reader rejected the input with this error message.
    Rejected(String),
}

/// A reader of user input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// model.toml, then `--set key=value` overrides (`megac_frontend::parse_str`).
    ModelToml,
    /// cluster.toml (`megac_sim::cluster::Cluster::parse`, then `fit`).
    ClusterToml,
    /// An OpenMPI hostfile (`megac launch --hostfile`).
    Hostfile,
    /// plan.json, through the plan gate ([`load_plan`]).
    Plan,
    /// A `.bin` token file (little-endian u32 ids).
    TokensBin,
    /// A `.txt` token file (byte-level tokens).
    TokensTxt,
    /// A safetensors file for `--init` (`megac_runtime::hf`).
    Safetensors,
}

/// The line that separates model.toml text from `--set` arguments in a [`Target::ModelToml`]
/// input: every line after it is one `--set` argument. (A TOML comment, so the text before
/// it is the file as written.)
pub const SET_MARKER: &str = "\n#--set\n";

impl Target {
    /// Every target, in the order the bench runs them.
    pub const ALL: [Target; 7] = [
        Target::ModelToml,
        Target::ClusterToml,
        Target::Hostfile,
        Target::Plan,
        Target::TokensBin,
        Target::TokensTxt,
        Target::Safetensors,
    ];

    /// The target's name (command line, corpus folder).
    pub fn name(self) -> &'static str {
        match self {
            Target::ModelToml => "model-toml",
            Target::ClusterToml => "cluster-toml",
            Target::Hostfile => "hostfile",
            Target::Plan => "plan",
            Target::TokensBin => "tokens-bin",
            Target::TokensTxt => "tokens-txt",
            Target::Safetensors => "safetensors",
        }
    }

    /// The target named `name`, if any.
    pub fn from_name(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Feed `bytes` to the target's reader.
    pub fn run(self, bytes: &[u8]) -> Outcome {
        match self {
            Target::ModelToml => model_toml(bytes),
            Target::ClusterToml => cluster_toml(bytes),
            Target::Hostfile => hostfile(bytes),
            Target::Plan => plan(bytes),
            Target::TokensBin => tokens(bytes, TokenFormat::Bin),
            Target::TokensTxt => tokens(bytes, TokenFormat::Txt),
            Target::Safetensors => safetensors(bytes),
        }
    }
}

/// `Err(message)` as an outcome, checking the message says something.
fn outcome(result: Result<(), String>) -> Outcome {
    match result {
        Ok(()) => Outcome::Accepted,
        Err(message) => {
            assert!(!message.trim().is_empty(), "a reader's error says nothing");
            Outcome::Rejected(message)
        }
    }
}

/// The bytes as text, or the error `read_to_string` gives.
fn text(bytes: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(bytes).map_err(|e| format!("stream did not contain valid UTF-8: {e}"))
}

/// model.toml text and `--set` arguments (see [`SET_MARKER`]).
fn model_toml(bytes: &[u8]) -> Outcome {
    outcome(text(bytes).and_then(|t| {
        let (toml, sets) = t.split_once(SET_MARKER).unwrap_or((t, ""));
        let sets: Vec<String> = sets.lines().map(str::to_string).collect();
        megac_frontend::parse_str("fuzz.toml", toml, &sets)
            .map(|_| ())
            .map_err(|e| e.render())
    }))
}

/// cluster.toml text; an accepted cluster is then sized for a few job sizes.
fn cluster_toml(bytes: &[u8]) -> Outcome {
    outcome(text(bytes).and_then(|t| {
        let cluster =
            megac_sim::cluster::Cluster::parse("cluster.toml", t).map_err(|e| e.to_string())?;
        let _ = cluster.describe();
        for world in [1, 7, 1 << 20, u64::MAX] {
            if let Ok(c) = cluster.fit(world) {
                let _ = c.gpus();
            }
        }
        Ok(())
    }))
}

/// A hostfile, checked for a few process counts.
fn hostfile(bytes: &[u8]) -> Outcome {
    outcome(text(bytes).and_then(|t| {
        let path = Path::new("hosts");
        let mut first = Ok(());
        for n in [4, 1, 0, usize::MAX] {
            let r = megac_runtime::hostfile::check_hostfile(path, t, n).map_err(|e| e.to_string());
            if n == 4 {
                first = r;
            }
        }
        first
    }))
}

/// The plan gate the `plan` target drives (`megac_ir::gate`): everything the runtime does
/// with a plan.json's text before it runs it.
pub fn load_plan(text: &str) -> Result<Plan, String> {
    Plan::from_json(text)
        .map(megac_ir::gate::CheckedPlan::into_inner)
        .map_err(|e| e.to_string())
}

fn plan(bytes: &[u8]) -> Outcome {
    outcome(text(bytes).and_then(|t| load_plan(t).map(|_| ())))
}

/// FNV-1a, to derive the reader's parameters from the input deterministically.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A token file; `seq_len`, `vocab` and the size hint are drawn from the input's hash (mostly
/// small, sometimes extreme). An accepted source must give samples of in-range ids.
fn tokens(bytes: &[u8], format: TokenFormat) -> Outcome {
    let h = fnv1a(bytes);
    const SEQ: [usize; 8] = [4, 4, 4, 1, 7, 64, 0, usize::MAX];
    const VOCAB: [u32; 8] = [300, 300, 1000, 256, 1, 0, 1 << 31, u32::MAX];
    let seq_len = SEQ[(h & 7) as usize];
    let vocab = VOCAB[((h >> 3) & 7) as usize];
    let hint = match (h >> 6) & 15 {
        0 => u64::MAX,
        1 => 0,
        _ => bytes.len() as u64,
    };
    let source = match DataSource::from_reader("fuzz", format, bytes, hint, seq_len, vocab) {
        Ok(s) => s,
        Err(e) => return outcome(Err(e.to_string())),
    };
    let count = source.samples_in_file(seq_len).unwrap_or(0);
    assert!(count > 0, "an accepted token file holds no sample");
    let mut inputs = vec![0i32; seq_len];
    let mut labels = vec![0i32; seq_len];
    for index in [0, 1, count, u64::MAX] {
        source.sample(index, seq_len, &mut inputs, &mut labels);
        assert!(
            inputs
                .iter()
                .chain(&labels)
                .all(|&t| t >= 0 && (t as u32) < vocab),
            "a sample holds an id out of range"
        );
    }
    Outcome::Accepted
}

/// A model's parameters as `megac_runtime::hf::load_params` takes them: (name, shape) in
/// order, and whether the embeddings are tied.
pub type Params = (Vec<(String, Vec<usize>)>, bool);

/// The parameters the safetensors target asks for: a dense Llama, a GPT-2 (`transformer.`
/// prefix, tied) and a MoE layer.
pub fn safetensors_models() -> Vec<Params> {
    let named = |v: &[(&str, &[usize])]| -> Vec<(String, Vec<usize>)> {
        v.iter().map(|(n, s)| (n.to_string(), s.to_vec())).collect()
    };
    vec![
        (
            named(&[
                ("model.embed_tokens.weight", &[8, 4]),
                ("model.norm.weight", &[4]),
                ("lm_head.weight", &[8, 4]),
            ]),
            false,
        ),
        (
            named(&[
                ("transformer.wte.weight", &[8, 4]),
                ("transformer.h.0.attn.c_attn.weight", &[4, 12]),
            ]),
            true,
        ),
        (
            named(&[
                ("model.layers.0.block_sparse_moe.gate.weight", &[2, 4]),
                (
                    "model.layers.0.block_sparse_moe.experts.0.w1.weight",
                    &[3, 4],
                ),
                (
                    "model.layers.0.block_sparse_moe.experts.0.w2.weight",
                    &[4, 3],
                ),
                (
                    "model.layers.0.block_sparse_moe.experts.0.w3.weight",
                    &[3, 4],
                ),
                (
                    "model.layers.0.block_sparse_moe.experts.1.w1.weight",
                    &[3, 4],
                ),
                (
                    "model.layers.0.block_sparse_moe.experts.1.w2.weight",
                    &[4, 3],
                ),
                (
                    "model.layers.0.block_sparse_moe.experts.1.w3.weight",
                    &[3, 4],
                ),
            ]),
            false,
        ),
    ]
}

/// A safetensors file, loaded as each of [`safetensors_models`]; accepted when one of them
/// loads, and then every tensor must have its shape's number of elements.
fn safetensors(bytes: &[u8]) -> Outcome {
    let mut first_err = None;
    let mut accepted = false;
    for (expected, tied) in safetensors_models() {
        match megac_runtime::hf::load_params_from_bytes(
            "fuzz.safetensors",
            bytes.to_vec(),
            &expected,
            tied,
        ) {
            Ok(values) => {
                assert_eq!(values.len(), expected.len(), "one vector per parameter");
                for ((name, shape), v) in expected.iter().zip(&values) {
                    assert_eq!(
                        v.len(),
                        shape.iter().product::<usize>(),
                        "{name}: loaded length differs from the shape"
                    );
                }
                accepted = true;
            }
            Err(e) => {
                first_err.get_or_insert(e.to_string());
            }
        }
    }
    if accepted {
        Outcome::Accepted
    } else {
        outcome(Err(first_err.unwrap_or_default()))
    }
}
