//! Hugging Face safetensors interop: round-trips, dtypes, GPT-2 naming, errors, atomic writes.

use std::collections::HashMap;
use std::path::Path;

use megac_runtime::hf::{is_known_buffer, load_params, save_params};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

/// Write a safetensors file with the safetensors crate: (name, dtype, shape, raw bytes).
fn write_raw(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            (
                name.to_string(),
                TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), path).unwrap();
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32_tensor<'a>(name: &'a str, shape: &[usize]) -> (&'a str, Dtype, Vec<usize>, Vec<u8>) {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|i| i as f32).collect();
    (name, Dtype::F32, shape.to_vec(), f32_bytes(&data))
}

fn spec(items: &[(&str, &[usize])]) -> Vec<(String, Vec<usize>)> {
    items
        .iter()
        .map(|(n, s)| (n.to_string(), s.to_vec()))
        .collect()
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn save_then_load_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let emb: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 3.0).collect();
    let norm = vec![1.0f32, -2.5, f32::MIN_POSITIVE, 1e30];
    let scalar = vec![42.0f32];
    save_params(
        &path,
        &[
            ("model.embed_tokens.weight".into(), vec![3, 4], &emb),
            ("model.norm.weight".into(), vec![4], &norm),
            ("scale".into(), vec![], &scalar),
        ],
    )
    .unwrap();
    assert_eq!(files_in(dir.path()), vec!["model.safetensors"]);

    // The file is what transformers writes: F32 tensors and {"format": "pt"}.
    let bytes = std::fs::read(&path).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(
        meta.metadata(),
        &Some(HashMap::from([("format".to_string(), "pt".to_string())]))
    );
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("model.norm.weight").unwrap();
    assert_eq!(t.dtype(), Dtype::F32);
    assert_eq!(t.shape(), &[4]);

    // Load in a different order than saved.
    let got = load_params(
        &path,
        &spec(&[
            ("model.norm.weight", &[4]),
            ("scale", &[]),
            ("model.embed_tokens.weight", &[3, 4]),
        ]),
        false,
    )
    .unwrap();
    assert_eq!(got, vec![norm, scalar, emb]);

    // Saving again replaces the file atomically and leaves no temporary file.
    let small = vec![7.0f32];
    save_params(&path, &[("x".into(), vec![1], &small)]).unwrap();
    assert_eq!(
        load_params(&path, &spec(&[("x", &[1])]), false).unwrap(),
        vec![small]
    );
    assert_eq!(files_in(dir.path()), vec!["model.safetensors"]);
}

#[test]
fn save_into_subdirectory() {
    let dir = tempfile::tempdir().unwrap();
    let rel = dir.path().join("sub");
    std::fs::create_dir(&rel).unwrap();
    let path = rel.join("p.safetensors");
    let data = vec![1.0f32, 2.0];
    save_params(&path, &[("w".into(), vec![2], &data)]).unwrap();
    assert_eq!(files_in(&rel), vec!["p.safetensors"]);
}

#[test]
fn bf16_and_f16_convert_to_f32() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("half.safetensors");
    let values = [1.0f32, -2.0, 0.5, 3.140625, 65504.0, -0.0];
    let bf: Vec<u8> = values
        .iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
        .collect();
    let fh: Vec<u8> = values
        .iter()
        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
        .collect();
    write_raw(
        &path,
        &[
            ("a", Dtype::BF16, vec![2, 3], bf),
            ("b", Dtype::F16, vec![6], fh),
        ],
    );
    let got = load_params(&path, &spec(&[("a", &[2, 3]), ("b", &[6])]), false).unwrap();
    let bf_expect: Vec<f32> = values
        .iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect();
    assert_eq!(got[0], bf_expect);
    assert_eq!(got[0][..4], [1.0, -2.0, 0.5, 3.140625]);
    assert_eq!(got[1], values.to_vec());
    assert!(got[1][5].is_sign_negative());
}

#[test]
fn gpt2_without_transformer_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt2.safetensors");
    write_raw(
        &path,
        &[
            f32_tensor("wte.weight", &[8, 4]),
            f32_tensor("h.0.attn.c_attn.weight", &[4, 12]),
            f32_tensor("h.0.attn.c_attn.bias", &[12]),
            // Buffers older transformers versions save: ignored.
            (
                "h.0.attn.bias",
                Dtype::BOOL,
                vec![1, 1, 2, 2],
                vec![1, 0, 1, 1],
            ),
            f32_tensor("h.0.attn.masked_bias", &[]),
        ],
    );
    let got = load_params(
        &path,
        &spec(&[
            ("transformer.wte.weight", &[8, 4]),
            ("transformer.h.0.attn.c_attn.weight", &[4, 12]),
            ("transformer.h.0.attn.c_attn.bias", &[12]),
        ]),
        true,
    )
    .unwrap();
    assert_eq!(got[0].len(), 32);
    assert_eq!(got[2], (0..12).map(|i| i as f32).collect::<Vec<_>>());
}

#[test]
fn known_buffers_and_tied_head_are_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("llama.safetensors");
    write_raw(
        &path,
        &[
            f32_tensor("model.embed_tokens.weight", &[8, 4]),
            f32_tensor("model.layers.0.self_attn.rotary_emb.inv_freq", &[2]),
            f32_tensor("lm_head.weight", &[8, 4]),
        ],
    );
    let expected = spec(&[("model.embed_tokens.weight", &[8, 4])]);
    assert_eq!(load_params(&path, &expected, true).unwrap().len(), 1);
    // Untied: lm_head.weight is a parameter the model does not have.
    let e = load_params(&path, &expected, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.ends_with("1 tensor in the file is not a parameter of this model: lm_head.weight"),
        "{e}"
    );
    // An untied model that lists lm_head.weight loads it.
    let expected = spec(&[
        ("model.embed_tokens.weight", &[8, 4]),
        ("lm_head.weight", &[8, 4]),
    ]);
    assert_eq!(load_params(&path, &expected, false).unwrap().len(), 2);

    assert!(is_known_buffer("h.3.attn.bias"));
    assert!(is_known_buffer("transformer.h.3.attn.masked_bias"));
    assert!(!is_known_buffer("h.3.attn.c_attn.bias"));
    assert!(!is_known_buffer("h.3.xattn.bias"));
}

#[test]
fn missing_tensors_are_all_listed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    write_raw(&path, &[f32_tensor("a", &[2])]);
    let mut items: Vec<(String, Vec<usize>)> = vec![("a".into(), vec![2])];
    items.extend((0..13).map(|i| (format!("layer.{i}.w"), vec![2])));
    let e = load_params(&path, &items, false).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "parameters {}: missing 13 tensors: layer.0.w, layer.1.w,",
            path.display()
        )),
        "{e}"
    );
    assert!(e.contains("layer.9.w, and 3 more"), "{e}");
    assert!(!e.contains("layer.10.w"), "{e}");

    let e = load_params(&path, &spec(&[("a", &[2]), ("b", &[2])]), false)
        .unwrap_err()
        .to_string();
    assert!(e.ends_with("missing 1 tensor: b"), "{e}");
}

#[test]
fn unexpected_tensors_are_listed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("u.safetensors");
    write_raw(
        &path,
        &[
            f32_tensor("a", &[2]),
            f32_tensor("z", &[1]),
            f32_tensor("y", &[1]),
        ],
    );
    let e = load_params(&path, &spec(&[("a", &[2]), ("b", &[1])]), false)
        .unwrap_err()
        .to_string();
    assert!(
        e.ends_with(
            "missing 1 tensor: b; 2 tensors in the file are not parameters of this model: y, z"
        ),
        "{e}"
    );
}

#[test]
fn wrong_shapes_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.safetensors");
    write_raw(
        &path,
        &[
            f32_tensor("a", &[2, 3]),
            f32_tensor("b", &[4]),
            f32_tensor("c", &[5]),
        ],
    );
    let e = load_params(
        &path,
        &spec(&[("a", &[3, 2]), ("b", &[4]), ("c", &[5, 1])]),
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.ends_with("wrong shape for 2 tensors: a has shape [2, 3], expected [3, 2], c has shape [5], expected [5, 1]"),
        "{e}"
    );
}

#[test]
fn unsupported_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.safetensors");
    write_raw(
        &path,
        &[
            ("a", Dtype::I64, vec![2], vec![0; 16]),
            f32_tensor("b", &[1]),
            ("c", Dtype::F64, vec![1], vec![0; 8]),
        ],
    );
    let e = load_params(
        &path,
        &spec(&[("a", &[2]), ("b", &[1]), ("c", &[1])]),
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.ends_with(
            "unsupported dtype for 2 tensors: a (I64), c (F64) (supported: F32, F16, BF16)"
        ),
        "{e}"
    );
}

#[test]
fn unreadable_and_corrupt_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("none.safetensors");
    let e = load_params(&path, &[], false).unwrap_err().to_string();
    assert!(e.contains("cannot read: No such file"), "{e}");

    let path = dir.path().join("junk.safetensors");
    std::fs::write(&path, b"this is not a safetensors file at all").unwrap();
    let e = load_params(&path, &[], false).unwrap_err().to_string();
    assert!(e.contains("not a valid safetensors file"), "{e}");

    // A valid file cut short.
    let good = dir.path().join("good.safetensors");
    let data = vec![1.0f32; 64];
    save_params(&good, &[("w".into(), vec![64], &data)]).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 10]).unwrap();
    let e = load_params(&cut, &spec(&[("w", &[64])]), false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a valid safetensors file"), "{e}");
    std::fs::write(&cut, &bytes[..4]).unwrap();
    assert!(load_params(&cut, &[], false).is_err());
}

#[test]
fn save_errors_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.safetensors");
    let data = vec![1.0f32; 5];
    let e = save_params(&path, &[("w".into(), vec![2, 3], &data)])
        .unwrap_err()
        .to_string();
    assert!(
        e.ends_with("tensor w: shape [2, 3] has 6 elements but 5 values were given"),
        "{e}"
    );
    let e = save_params(
        &path,
        &[("w".into(), vec![5], &data), ("w".into(), vec![5], &data)],
    )
    .unwrap_err()
    .to_string();
    assert!(e.ends_with("tensor w is given twice"), "{e}");
    let e = save_params(&path, &[("__metadata__".into(), vec![5], &data)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("reserved"), "{e}");
    assert!(files_in(dir.path()).is_empty());

    // An existing file is untouched by a failed save.
    save_params(&path, &[("w".into(), vec![5], &data)]).unwrap();
    let before = std::fs::read(&path).unwrap();
    assert!(save_params(&path, &[("w".into(), vec![6], &data)]).is_err());
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(files_in(dir.path()), vec!["out.safetensors"]);

    // A directory that does not exist is created.
    let path = dir.path().join("no/such/dir/out.safetensors");
    save_params(&path, &[("w".into(), vec![5], &data)]).unwrap();
    assert_eq!(
        files_in(&dir.path().join("no/such/dir")),
        vec!["out.safetensors"]
    );
    std::fs::remove_dir_all(dir.path().join("no")).unwrap();
    // One that cannot be: a file is in the way.
    let path = dir.path().join("out.safetensors/x.safetensors");
    let e = save_params(&path, &[("w".into(), vec![5], &data)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot create the folder"), "{e}");

    // Renaming onto a directory fails after the data was written: the temp file is removed.
    let target = dir.path().join("isdir.safetensors");
    std::fs::create_dir(&target).unwrap();
    std::fs::write(target.join("keep"), b"x").unwrap();
    let e = save_params(&target, &[("w".into(), vec![5], &data)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot rename"), "{e}");
    assert_eq!(
        files_in(dir.path()),
        vec!["isdir.safetensors", "out.safetensors"]
    );
}
