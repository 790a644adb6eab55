//! `--init` from a sharded Hugging Face checkpoint (`model.safetensors.index.json` and
//! `model-0000X-of-0000N.safetensors`): training from the shards is bit-identical to
//! training from the single file, every command that takes `--init` reads them, and a
//! broken checkpoint is one clear error.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{megac, stderr, stdout};
use megac_runtime::train::Session;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

/// Split the safetensors file `src` into `k` shards in `dir`, as save_pretrained names them,
/// the tensors dealt round-robin in name order (so every layer spans several shards), with
/// the index beside them. Returns the index's weight_map.
fn split(src: &Path, dir: &Path, k: usize) -> BTreeMap<String, String> {
    let bytes = std::fs::read(src).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let shard = |i: usize| format!("model-{:05}-of-{k:05}.safetensors", i + 1);
    let mut map = BTreeMap::new();
    let mut total = 0usize;
    for i in 0..k {
        let views: Vec<(String, TensorView<'_>)> = names
            .iter()
            .skip(i)
            .step_by(k)
            .map(|n| (n.clone(), st.tensor(n).unwrap()))
            .collect();
        for (n, v) in &views {
            map.insert(n.clone(), shard(i));
            total += v.data().len();
        }
        let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(views, Some(meta), &dir.join(shard(i))).unwrap();
    }
    write_index(dir, &map, total);
    map
}

fn write_index(dir: &Path, map: &BTreeMap<String, String>, total: usize) {
    let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": map });
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index).unwrap(),
    )
    .unwrap();
}

/// The checked plan of fixture `name`'s model.toml.
fn checked_plan(name: &str) -> megac_ir::gate::CheckedPlan {
    let spec = megac_frontend::load(&fixture(name).join("model.toml"), &[])
        .unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true).unwrap();
    let plan =
        megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops).unwrap();
    megac_ir::gate::CheckedPlan::check(plan).unwrap()
}

/// The losses' and grad norms' bits of 2 steps from `init`, and the final parameters' bits.
fn train_bits(plan: &megac_ir::gate::CheckedPlan, name: &str, init: &Path) -> Vec<u64> {
    let data = fixture(name).join("tokens.bin");
    let mut s = Session::new(plan, data.to_str().unwrap(), Some(init)).unwrap();
    let mut bits = Vec::new();
    for step in 1..=2 {
        let (loss, norm) = s.step(step).unwrap();
        bits.extend([loss.to_bits(), norm.to_bits()]);
    }
    for p in &plan.params {
        bits.extend(
            s.mem
                .read_f32(p.buffer)
                .iter()
                .map(|x| u64::from(x.to_bits())),
        );
    }
    bits
}

#[test]
fn sharded_checkpoint_trains_bit_identical_to_the_single_file() {
    // Llama in 2 shards; Qwen2-MoE in transformers 5's fused expert layout in 3 shards (the
    // router and the fused experts of a layer land in different shards).
    for (name, file, k) in [
        ("llama", "init.safetensors", 2),
        ("qwen2_moe", "init_fused.safetensors", 3),
    ] {
        let plan = checked_plan(name);
        let single = fixture(name).join(file);
        let dir = tempfile::tempdir().unwrap();
        split(&single, dir.path(), k);
        let want = train_bits(&plan, name, &single);
        for init in [
            dir.path().to_path_buf(),
            dir.path().join("model.safetensors.index.json"),
        ] {
            assert!(
                want == train_bits(&plan, name, &init),
                "{name}: training from {} differs from training from {file}",
                init.display()
            );
        }
    }
}

#[test]
fn every_command_taking_init_reads_a_sharded_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    split(&fixture("llama").join("init.safetensors"), dir.path(), 3);
    let shards = dir.path().to_str().unwrap();
    let index = dir.path().join("model.safetensors.index.json");
    let index = index.to_str().unwrap();
    let single = "tests/golden/llama/init.safetensors";
    let toml = "tests/golden/llama/model.toml";
    let data = "tests/golden/llama/tokens.bin";
    let ok = |args: &[&str]| {
        let o = megac(args);
        assert!(o.status.success(), "megac {args:?}: {}", stderr(&o));
        stdout(&o)
    };
    let strip_seconds = |json: String| {
        let mut v: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
        for k in ["seconds", "weights", "tokens_per_s"] {
            v.as_object_mut().unwrap().remove(k);
        }
        v
    };
    // eval: a folder of HF weights is not taken for a megac checkpoint folder.
    let eval = |init: &str| {
        strip_seconds(ok(&[
            "eval", toml, "--init", init, "--data", data, "--iters", "1", "--format", "json",
        ]))
    };
    assert_eq!(eval(single), eval(shards));
    let generate = |init: &str| {
        strip_seconds(ok(&[
            "generate",
            toml,
            "--init",
            init,
            "--tokens",
            "5,17,99",
            "--max-new-tokens",
            "4",
            "--format",
            "json",
        ]))
    };
    assert_eq!(generate(single), generate(index));
    let tmp = tempfile::tempdir().unwrap();
    let scope = |init: &str, out: &str| {
        let out = tmp.path().join(out);
        ok(&[
            "scope",
            toml,
            "--init",
            init,
            "--tokens",
            "5,17,99",
            "--probe",
            "logits",
            "-o",
            out.to_str().unwrap(),
        ]);
        let bytes = std::fs::read(&out).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        st.tensor("logits").unwrap().data().to_vec()
    };
    assert_eq!(
        scope(single, "a.safetensors"),
        scope(shards, "b.safetensors")
    );
    // train (and run, which shares its options) through the CLI: the same losses.
    let train = |init: &str, report: &str| {
        let report = tmp.path().join(report);
        ok(&[
            "train",
            toml,
            "--init",
            init,
            "--data",
            data,
            "--steps",
            "2",
            "--report",
            report.to_str().unwrap(),
        ]);
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        r["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["loss"].as_f64().unwrap().to_bits())
            .collect::<Vec<_>>()
    };
    assert_eq!(train(single, "a.json"), train(index, "b.json"));
}

/// `megac train` of the Llama fixture from `init`: fails with one error line (no panic),
/// returned.
fn train_error(init: &Path) -> String {
    let o = megac(&[
        "train",
        "tests/golden/llama/model.toml",
        "--init",
        init.to_str().unwrap(),
        "--data",
        "tests/golden/llama/tokens.bin",
        "--steps",
        "1",
    ]);
    let err = stderr(&o);
    assert!(!o.status.success(), "megac train --init {init:?} succeeded");
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn broken_sharded_checkpoints_are_clear_errors() {
    let src = fixture("llama").join("init.safetensors");
    let fresh = || {
        let dir = tempfile::tempdir().unwrap();
        let map = split(&src, dir.path(), 3);
        (dir, map)
    };
    let shard2 = "model-00002-of-00003.safetensors";

    // A shard file that is not there.
    let (dir, _) = fresh();
    std::fs::remove_file(dir.path().join(shard2)).unwrap();
    let e = train_error(dir.path());
    assert!(
        e.contains("model.safetensors.index.json")
            && e.contains(&format!("shard {shard2} does not exist")),
        "{e}"
    );

    // A tensor the index places in a shard that does not hold it.
    let (dir, mut map) = fresh();
    map.insert("model.layers.0.mlp.extra.weight".into(), shard2.into());
    write_index(dir.path(), &map, 0);
    let e = train_error(dir.path());
    assert!(
        e.contains(shard2)
            && e.contains("places 1 tensor in this shard, which does not hold it")
            && e.contains("model.layers.0.mlp.extra.weight"),
        "{e}"
    );

    // A tensor a shard holds that the index does not list.
    let (dir, mut map) = fresh();
    let dropped = "model.norm.weight";
    let holder = map.remove(dropped).unwrap();
    write_index(dir.path(), &map, 0);
    let e = train_error(dir.path());
    assert!(
        e.contains(&holder)
            && e.contains("1 tensor in this shard is not listed")
            && e.contains(dropped),
        "{e}"
    );

    // A tensor of the model in neither the index nor any shard: missing, named.
    let (dir, mut map) = fresh();
    let holder = map.remove(dropped).unwrap();
    write_index(dir.path(), &map, 0);
    let path = dir.path().join(&holder);
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != dropped)
        .collect();
    safetensors::serialize_to_file(kept, None, &path).unwrap();
    let e = train_error(dir.path());
    assert!(
        e.contains(&format!(
            "missing 1 tensor: {dropped} (the index lists no such tensor)"
        )),
        "{e}"
    );

    // A malformed index: serde_json's line and column.
    let (dir, _) = fresh();
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        "{\"weight_map\": {\n  \"a\": }",
    )
    .unwrap();
    let e = train_error(&dir.path().join("model.safetensors.index.json"));
    assert!(
        e.contains("not a valid index") && e.contains("line 2"),
        "{e}"
    );

    // A shard named outside the index's folder.
    let (dir, mut map) = fresh();
    map.insert(dropped.into(), "../model.safetensors".into());
    write_index(dir.path(), &map, 0);
    let e = train_error(dir.path());
    assert!(
        e.contains("a shard is a file name in the index's folder"),
        "{e}"
    );

    // A folder with neither model.safetensors nor the index.
    let empty = tempfile::tempdir().unwrap();
    let e = train_error(empty.path());
    assert!(e.contains("is a folder without model.safetensors"), "{e}");
}
