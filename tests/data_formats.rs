//! Real data against its references: the Hugging Face tokenizer of tests/golden/tokenizer/
//! gives the ids the Python `tokenizers` package gives (tests/golden/make_tokenizer.py), and
//! Megatron datasets give megatron-core's GPTDataset / BlendedDataset indices and samples
//! (tests/golden/megatron_data.py).

use std::path::{Path, PathBuf};

use megac_runtime::data::megatron::{split_matrix, DataSplit, MegatronData, MegatronOptions};
use megac_runtime::data::tokenizer::TextTokenizer;
use megac_runtime::data::{DataOptions, DataSource};
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn golden(rel: &str) -> Value {
    let text = std::fs::read_to_string(root().join(rel)).expect("golden file");
    serde_json::from_str(&text).expect("golden JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn tokenizer_path() -> PathBuf {
    root().join("tests/golden/tokenizer/tokenizer.json")
}

fn tokens_of(src: &DataSource) -> Vec<u32> {
    match src {
        DataSource::Tokens { tokens, .. } => tokens.clone(),
        other => panic!("expected tokens, got {}", other.name()),
    }
}

#[test]
fn tokenizer_gives_the_python_ids() {
    let g = golden("tests/golden/tokenizer/ids.json");
    let tok = TextTokenizer::open(&tokenizer_path(), None).unwrap();
    assert_eq!(
        u64::from(tok.vocab_size()),
        g["vocab_size"].as_u64().unwrap()
    );
    // tokenizer_config.json's eos_token.
    assert_eq!(tok.eos(), Some((0, "<|endoftext|>")));
    for case in g["encode"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(tok.encode(text).unwrap(), ids(&case["ids"]), "{text:?}");
    }
    for case in g["decode"].as_array().unwrap() {
        assert_eq!(
            tok.decode(&ids(&case["ids"])).unwrap(),
            case["text"].as_str().unwrap()
        );
    }
}

#[test]
fn txt_and_jsonl_documents_are_the_python_stream() {
    let g = golden("tests/golden/tokenizer/ids.json");
    let opts = DataOptions {
        tokenizer: Some(tokenizer_path()),
        ..Default::default()
    };
    for (file, key) in [("docs.txt", "docs_txt"), ("docs.jsonl", "docs_jsonl")] {
        let path = root().join("tests/golden/tokenizer").join(file);
        let src = DataSource::open_with(path.to_str().unwrap(), &opts, 4, 384, 0).unwrap();
        assert_eq!(tokens_of(&src), ids(&g[key]), "{file}");
    }
    let corpus = root().join("examples/data/corpus.txt");
    let src = DataSource::open_with(corpus.to_str().unwrap(), &opts, 64, 384, 0).unwrap();
    let tokens = tokens_of(&src);
    assert_eq!(
        tokens.len() as u64,
        g["corpus_txt_tokens"].as_u64().unwrap()
    );
    assert_eq!(tokens[..64], ids(&g["corpus_txt_first_ids"])[..]);
    let eos_count = tokens.iter().filter(|&&t| t == 0).count() as u64;
    assert_eq!(eos_count, g["corpus_txt_documents"].as_u64().unwrap());
}

/// A copy of the tokenizer in a folder of its own (no tokenizer_config.json), with `edit`
/// applied to its JSON text.
fn tokenizer_copy(dir: &Path, edit: impl Fn(String) -> String) -> PathBuf {
    let text = std::fs::read_to_string(tokenizer_path()).unwrap();
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, edit(text)).unwrap();
    path
}

#[test]
fn eos_comes_from_the_config_a_special_name_or_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let path = tokenizer_copy(dir.path(), |t| t);
    // No tokenizer_config.json: the special token named <|endoftext|>.
    let tok = TextTokenizer::open(&path, None).unwrap();
    assert_eq!(tok.eos(), Some((0, "<|endoftext|>")));
    // --eos by text and by id.
    let tok = TextTokenizer::open(&path, Some("<pad>")).unwrap();
    assert_eq!(tok.eos(), Some((1, "<pad>")));
    let tok = TextTokenizer::open(&path, Some("1")).unwrap();
    assert_eq!(tok.eos(), Some((1, "<pad>")));
    let e = TextTokenizer::open(&path, Some("<nope>")).unwrap_err();
    assert!(e.message.contains("--eos <nope>"), "{}", e.message);
    // No name it knows: text data needs --eos.
    let other = tempfile::tempdir().unwrap();
    let renamed = tokenizer_copy(other.path(), |t| t.replace("<|endoftext|>", "<|doc|>"));
    let tok = TextTokenizer::open(&renamed, None).unwrap();
    assert_eq!(tok.eos(), None);
    let opts = DataOptions {
        tokenizer: Some(renamed.clone()),
        ..Default::default()
    };
    let docs = root().join("tests/golden/tokenizer/docs.txt");
    let e = DataSource::open_with(docs.to_str().unwrap(), &opts, 4, 384, 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--eos TOKEN"), "{e}");
    let opts = DataOptions {
        eos: Some("<|doc|>".into()),
        ..opts
    };
    let src = DataSource::open_with(docs.to_str().unwrap(), &opts, 4, 384, 0).unwrap();
    // Three paragraphs, each followed by the renamed EOS (id 0; the literal <|endoftext|>
    // in the text is plain text now).
    let tokens = tokens_of(&src);
    assert_eq!(tokens.iter().filter(|&&t| t == 0).count(), 3);
    assert_eq!(tokens.last(), Some(&0));
}

fn prefix(name: &str) -> String {
    root()
        .join("tests/golden/megatron")
        .join(name)
        .to_str()
        .unwrap()
        .to_string()
}

fn split_part(i: u64) -> DataSplit {
    match i {
        0 => DataSplit::Train,
        1 => DataSplit::Valid,
        _ => DataSplit::Test,
    }
}

/// sum((position + 1) * token), the reference's per-sample checksum.
fn checksum(tokens: &[u32]) -> u64 {
    tokens
        .iter()
        .enumerate()
        .map(|(i, &t)| (i as u64 + 1) * u64::from(t))
        .sum()
}

/// Every sample of `data` against the reference's first samples and checksums.
fn compare_samples(name: &str, data: &MegatronData, case: &Value, seq: usize) {
    assert_eq!(data.len(), case["len"].as_u64().unwrap(), "{name}: len");
    for (i, want) in case["first_samples"].as_array().unwrap().iter().enumerate() {
        let mut got = Vec::new();
        data.sample_into(i as u64, &mut got);
        assert_eq!(got, ids(want), "{name}: sample {i}");
    }
    for (i, want) in case["checksums"].as_array().unwrap().iter().enumerate() {
        let mut got = Vec::new();
        data.sample_into(i as u64, &mut got);
        assert_eq!(got.len(), seq + 1);
        assert_eq!(checksum(&got), want.as_u64().unwrap(), "{name}: sample {i}");
    }
}

#[test]
fn megatron_samples_are_megatron_cores() {
    let g = golden("tests/golden/megatron/reference.json");
    let cases = g["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let seq = case["seq_length"].as_u64().unwrap() as usize;
        let opts = MegatronOptions {
            split: case["split"].as_str().unwrap(),
            which: split_part(case["split_index"].as_u64().unwrap()),
            num_samples: Some(case["num_samples"].as_u64().unwrap()),
            seq_len: seq,
            seed: case["seed"].as_u64().unwrap() as u32,
            vocab: 384,
        };
        let spec = case["data"].as_str().unwrap();
        if name == "blend" {
            let spec = format!("0.3 {} 0.7 {}", prefix("a"), prefix("b"));
            let data = MegatronData::open_blend(&spec, &opts).unwrap();
            let MegatronData::Blend(b) = &data else {
                panic!("a blend")
            };
            let want_w: Vec<f64> = case["weights"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| w.as_f64().unwrap())
                .collect();
            assert_eq!(b.weights(), &want_w[..]);
            let lens: Vec<u64> = b.datasets().iter().map(|d| d.len()).collect();
            assert_eq!(
                lens,
                ids(&case["dataset_lens"])
                    .iter()
                    .map(|&x| u64::from(x))
                    .collect::<Vec<_>>()
            );
            let di: Vec<u32> = b.dataset_index().iter().map(|&x| u32::from(x)).collect();
            assert_eq!(di, ids(&case["dataset_index"]));
            let dsi: Vec<u32> = b.dataset_sample_index().iter().map(|&x| x as u32).collect();
            assert_eq!(dsi, ids(&case["dataset_sample_index"]));
            compare_samples(name, &data, case, seq);
        } else {
            let data = MegatronData::open_single(&prefix(spec), &opts).unwrap();
            let MegatronData::Single(d) = &data else {
                panic!("one dataset")
            };
            let doc: Vec<u32> = d.document_index().iter().map(|&x| x as u32).collect();
            assert_eq!(doc, ids(&case["document_index"]), "{name}: document index");
            let sample: Vec<[i64; 2]> = case["sample_index"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| [p[0].as_i64().unwrap(), p[1].as_i64().unwrap()])
                .collect();
            assert_eq!(d.sample_index(), &sample[..], "{name}: sample index");
            let shuffle: Vec<u32> = d.shuffle_index().iter().map(|&x| x as u32).collect();
            assert_eq!(
                shuffle,
                ids(&case["shuffle_index"]),
                "{name}: shuffle index"
            );
            compare_samples(name, &data, case, seq);
        }
    }
}

/// Through `DataSource` (what training uses): global sample `i` is Megatron's train sample
/// `i`, inputs its first seq_len tokens and labels its last seq_len.
#[test]
fn data_source_batches_are_megatron_samples_in_order() {
    let g = golden("tests/golden/megatron/reference.json");
    let case = &g["cases"][0];
    assert_eq!(case["name"], "single-300");
    let opts = DataOptions {
        split: "90,10,0".into(),
        samples: Some(300),
        ..Default::default()
    };
    let src = DataSource::open_with(&prefix("a"), &opts, 32, 384, 1234).unwrap();
    assert_eq!(src.samples_in_file(32), Some(338));
    // Step 1 of a global batch of 8 starts at global sample 8.
    let (mut inputs, mut labels) = (vec![0i32; 8 * 32], vec![0i32; 8 * 32]);
    src.fill_batch(8, 32, &mut inputs, &mut labels);
    for (row, want) in case["first_samples"].as_array().unwrap()[8..16]
        .iter()
        .enumerate()
    {
        let want: Vec<i32> = ids(want).into_iter().map(|t| t as i32).collect();
        assert_eq!(inputs[row * 32..(row + 1) * 32], want[..32]);
        assert_eq!(labels[row * 32..(row + 1) * 32], want[1..]);
    }
    let blend = format!("0.3 {} 0.7 {}", prefix("a"), prefix("b"));
    let opts = DataOptions {
        split: "90,10,0".into(),
        samples: Some(200),
        ..Default::default()
    };
    let src = DataSource::open_with(&blend, &opts, 32, 384, 1234).unwrap();
    assert_eq!(src.samples_in_file(32), Some(200));
}

#[test]
fn megatron_checks_the_vocab_and_the_split() {
    let opts = DataOptions::default();
    let e = DataSource::open_with(&prefix("a"), &opts, 32, 300, 1234)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("a.bin") && e.contains("out of range for vocab 300"),
        "{e}"
    );
    let e = DataSource::open_with(&prefix("a"), &opts, 32, 384, 1 << 40)
        .unwrap_err()
        .to_string();
    assert!(e.contains("32-bit seed"), "{e}");
    let opts = DataOptions {
        split: "0,1,0".into(),
        ..Default::default()
    };
    let e = DataSource::open_with(&prefix("a"), &opts, 32, 384, 1234)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no documents"), "{e}");
    assert_eq!(split_matrix("969,30,1").unwrap()[0].unwrap().0, 0.0);
}

/// `megac train` on a Megatron dataset and on tokenized .jsonl text runs (a real model, two
/// steps) and reports finite losses.
#[test]
fn train_runs_on_megatron_data_and_tokenized_text() {
    let dir = tempfile::tempdir().unwrap();
    let blend = format!("0.3 {} 0.7 {}", prefix("a"), prefix("b"));
    let jsonl = root().join("tests/golden/tokenizer/docs.jsonl");
    let tok = tokenizer_path();
    let runs: Vec<Vec<String>> = vec![
        vec![
            "--data".into(),
            prefix("a"),
            "--split".into(),
            "90,10,0".into(),
        ],
        vec!["--data".into(), blend],
        vec![
            "--data".into(),
            jsonl.to_str().unwrap().into(),
            "--tokenizer".into(),
            tok.to_str().unwrap().into(),
        ],
    ];
    for (i, extra) in runs.iter().enumerate() {
        let report = dir.path().join(format!("r{i}.json"));
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_megac"))
            .current_dir(root())
            .args(["train", "examples/llama-tiny.toml", "--steps", "2"])
            .args(["--set", "model.vocab=384", "--set", "model.seq_len=16"])
            .args(extra)
            .arg("--report")
            .arg(&report)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        let steps = r["steps"].as_array().unwrap();
        assert_eq!(steps.len(), 2);
        for s in steps {
            let loss = s["loss"].as_f64().unwrap();
            // Near ln(384) = 5.95 for a fresh model.
            assert!(
                loss.is_finite() && loss > 4.0 && loss < 8.0,
                "{extra:?}: {loss}"
            );
        }
    }
}

/// `megac generate --tokenizer` encodes the prompt as the Python tokenizer does and decodes
/// the new tokens with it; `megac scope --tokenizer` reads the same ids; a tokenizer larger
/// than the model's vocab is one error.
#[test]
fn generate_and_scope_use_the_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let init = dir.path().join("w.safetensors");
    let tok = tokenizer_path();
    let tok = tok.to_str().unwrap();
    let sets = ["--set", "model.vocab=384", "--set", "model.seq_len=16"];
    let megac = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_megac"))
            .current_dir(root())
            .args(args)
            .output()
            .unwrap()
    };
    let out = megac(
        &[
            &["train", "examples/llama-tiny.toml", "--steps", "1"][..],
            &sets,
            &["--save-params", init.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let g = golden("tests/golden/tokenizer/ids.json");
    let hello = &g["encode"][0];
    assert_eq!(hello["text"], "Hello world");
    let base = [
        &[
            "generate",
            "examples/llama-tiny.toml",
            "--init",
            init.to_str().unwrap(),
        ][..],
        &sets,
        &[
            "--prompt",
            "Hello world",
            "--max-new-tokens",
            "3",
            "--format",
            "json",
        ],
    ]
    .concat();
    let out = megac(&[&base[..], &["--tokenizer", tok]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ids(&v["prompt_tokens"]), ids(&hello["ids"]));
    let new = ids(&v["tokens"]);
    assert_eq!(new.len(), 3);
    let t = TextTokenizer::open(&tokenizer_path(), None).unwrap();
    assert_eq!(v["text"].as_str().unwrap(), t.decode(&new).unwrap());
    // Without it, the prompt is its bytes.
    let out = megac(&base);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ids(&v["prompt_tokens"]).len(), "Hello world".len());
    // scope: one position per tokenizer id.
    let probe = dir.path().join("p.safetensors");
    let out = megac(
        &[
            &[
                "scope",
                "examples/llama-tiny.toml",
                "--init",
                init.to_str().unwrap(),
            ][..],
            &sets,
            &[
                "--prompt",
                "Hello world",
                "--tokenizer",
                tok,
                "--probe",
                "embed",
            ],
            &["-o", probe.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("of {} token(s)", ids(&hello["ids"]).len())),
        "{stdout}"
    );
    // The model's vocab (256 here) must hold the tokenizer's 384 ids.
    let small = dir.path().join("small.safetensors");
    let out = megac(&[
        "train",
        "examples/llama-tiny.toml",
        "--steps",
        "1",
        "--set",
        "model.seq_len=16",
        "--save-params",
        small.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let out = megac(&[
        "generate",
        "examples/llama-tiny.toml",
        "--set",
        "model.seq_len=16",
        "--init",
        small.to_str().unwrap(),
        "--prompt",
        "Hello",
        "--tokenizer",
        tok,
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("error: tokenizer ") && err.contains("more than the model's vocab 256"),
        "{err}"
    );
}
