//! Seed inputs: small built-in ones per target, and the repository's files (examples, the
//! bad-input corpus, bench models, cluster presets, the regression corpus).

use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::Dtype;

use crate::targets::{safetensors_models, Target, SET_MARKER};

/// The repository root (the fuzz crate's parent folder).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// The regression corpus of `target`: `tests/fuzz-corpus/<target>/`.
pub fn regression_dir(target: Target) -> PathBuf {
    repo_root().join("tests/fuzz-corpus").join(target.name())
}

/// The largest seed kept (longer files are cut): small seeds make fast inputs.
const SEED_MAX: usize = 1 << 16;

/// The files of `path` (a file, or every file of a folder, sorted), each cut to 64 KiB.
pub fn read_path(path: &Path) -> Vec<Vec<u8>> {
    let mut files = Vec::new();
    if path.is_dir() {
        if let Ok(entries) = std::fs::read_dir(path) {
            files = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .collect();
        }
        files.sort();
    } else if path.is_file() {
        files.push(path.to_path_buf());
    }
    files
        .iter()
        .filter_map(|f| std::fs::read(f).ok())
        .map(|mut b| {
            b.truncate(SEED_MAX);
            b
        })
        .collect()
}

/// The repository's seed files for `target`, and its regression corpus.
pub fn repo_files(target: Target) -> Vec<Vec<u8>> {
    let root = repo_root();
    let mut out = read_path(&regression_dir(target));
    let with_ext = |dir: &str, ext: &str| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(root.join(dir))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        v.retain(|p| p.extension().is_some_and(|e| e == ext));
        v.sort();
        v
    };
    match target {
        Target::ModelToml => {
            for dir in ["examples", "bench", "tests/bad-input"] {
                for p in with_ext(dir, "toml") {
                    let Ok(mut text) = std::fs::read(&p) else {
                        continue;
                    };
                    // A bad-input case's `--set` arguments (NAME.args) follow the marker.
                    if let Ok(args) = std::fs::read_to_string(p.with_extension("args")) {
                        let sets: Vec<&str> = args
                            .lines()
                            .filter(|l| *l != "--set" && !l.is_empty())
                            .collect();
                        text.extend_from_slice(SET_MARKER.as_bytes());
                        text.extend_from_slice(sets.join("\n").as_bytes());
                    }
                    out.push(text);
                }
            }
        }
        Target::ClusterToml => {
            for p in with_ext("sim/presets", "toml") {
                out.extend(read_path(&p));
            }
        }
        Target::TokensTxt => {
            if let Ok(mut text) = std::fs::read(root.join("examples/data/corpus.txt")) {
                text.truncate(2048);
                out.push(text);
            }
        }
        Target::Hostfile | Target::Plan | Target::TokensBin | Target::Safetensors => {}
    }
    out
}

/// A small model.toml that validates.
pub const TINY_MODEL: &str = "[model]\narch = \"llama\"\nlayers = 1\nhidden = 8\nheads = 2\n\
    ffn_hidden = 16\nvocab = 16\nseq_len = 4\n\n[train]\nmicro_batch = 1\nglobal_batch = 1\n";

/// Built-in seeds of `target`: small valid inputs and a few near misses.
pub fn builtin(target: Target) -> Vec<Vec<u8>> {
    let text = |v: &[&str]| v.iter().map(|s| s.as_bytes().to_vec()).collect();
    match target {
        Target::ModelToml => text(&[
            TINY_MODEL,
            &format!("{TINY_MODEL}{SET_MARKER}parallel.tp=2\ntrain.lr=1e-3"),
            "[model]\narch = \"gpt\"\nlayers = 1\nhidden = 8\nheads = 2\nvocab = 16\nseq_len = 4\n\
             [moe]\nexperts = 2\ntop_k = 1\n[parallel]\ndp = 2\npp = 1\n",
        ]),
        Target::ClusterToml => text(&[
            "preset = \"h100-sxm\"\nnodes = 2\n",
            "preset = \"a100-80g\"\ngpus_per_node = 4\n[network]\n",
        ]),
        Target::Hostfile => text(&[
            "node1 slots=4\nnode2 slots=4 max_slots=8 # two nodes\n",
            "localhost\n",
            "# hosts\na slots=1\nb max-slots=2\n\nc slots=2\n",
        ]),
        Target::Plan => Vec::new(),
        Target::TokensBin => {
            let words = |ids: &mut dyn Iterator<Item = u32>| -> Vec<u8> {
                ids.flat_map(u32::to_le_bytes).collect()
            };
            vec![
                words(&mut (0..40u32).map(|i| i * 7 % 300)),
                words(&mut (0..10u32).map(|i| i * 31 % 300)),
                words(&mut [1, 2, 3, 4, 5, 299, 300, u32::MAX].into_iter()),
            ]
        }
        Target::TokensTxt => text(&["hello, world\nhello, world\n", "abcdefghij"]),
        Target::Safetensors => safetensors_seeds(),
    }
}

/// Serialize tensors (name, dtype, shape) filled with small values.
fn safetensors_file(tensors: &[(String, Dtype, Vec<usize>)]) -> Vec<u8> {
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, dtype, shape)| {
            let n: usize = shape.iter().product();
            (0..n)
                .flat_map(|i| {
                    let x = (i % 7) as f32 * 0.25 - 0.5;
                    match dtype {
                        Dtype::F16 => half::f16::from_f32(x).to_le_bytes().to_vec(),
                        Dtype::BF16 => half::bf16::from_f32(x).to_le_bytes().to_vec(),
                        Dtype::I64 => (i as i64).to_le_bytes().to_vec(),
                        _ => x.to_le_bytes().to_vec(),
                    }
                })
                .collect()
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .zip(&data)
        .filter_map(|((name, dtype, shape), bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .ok()
                .map(|v| (name.clone(), v))
        })
        .collect();
    safetensors::serialize(views, None).unwrap_or_default()
}

/// Files for the safetensors target's models: each in F32, F16 and BF16, GPT-2 without its
/// prefix, with a known buffer, and the MoE layer in transformers 5's fused layout.
fn safetensors_seeds() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for (expected, _) in safetensors_models() {
        for dtype in [Dtype::F32, Dtype::F16, Dtype::BF16] {
            let t: Vec<_> = expected
                .iter()
                .map(|(n, s)| (n.clone(), dtype, s.clone()))
                .collect();
            out.push(safetensors_file(&t));
        }
    }
    let models = safetensors_models();
    let bare: Vec<_> = models[1]
        .0
        .iter()
        .map(|(n, s)| {
            (
                n.trim_start_matches("transformer.").to_string(),
                Dtype::F32,
                s.clone(),
            )
        })
        .collect();
    out.push(safetensors_file(&bare));
    let mut with_buffer: Vec<_> = models[0]
        .0
        .iter()
        .map(|(n, s)| (n.clone(), Dtype::F32, s.clone()))
        .collect();
    with_buffer.push((
        "model.layers.0.self_attn.rotary_emb.inv_freq".to_string(),
        Dtype::I64,
        vec![2],
    ));
    out.push(safetensors_file(&with_buffer));
    let fused = |dtype| {
        safetensors_file(&[
            (
                "model.layers.0.mlp.gate.weight".to_string(),
                dtype,
                vec![2, 4],
            ),
            (
                "model.layers.0.mlp.experts.gate_up_proj".to_string(),
                dtype,
                vec![2, 6, 4],
            ),
            (
                "model.layers.0.mlp.experts.down_proj".to_string(),
                dtype,
                vec![2, 4, 3],
            ),
        ])
    };
    out.push(fused(Dtype::F32));
    out.push(fused(Dtype::BF16));
    out
}
