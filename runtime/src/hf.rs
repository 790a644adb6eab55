//! Hugging Face safetensors interop: load a checkpoint written by transformers'
//! `save_pretrained` (LlamaForCausalLM, MixtralForCausalLM, GPT2LMHeadModel) into the
//! parameters megac expects, and write parameters back in the same format.
//!
//! Parameter names and shapes are Hugging Face's (the Graph IR names them so), so loading is
//! a lookup by name with a shape check. What is tolerated:
//! - GPT-2 checkpoints saved at the `GPT2Model` level name tensors `h.0.attn.c_attn.weight`,
//!   `wte.weight`, ... without the `transformer.` prefix: when `transformer.X` is expected and
//!   missing but `X` is present, `X` is used.
//! - Non-parameter buffers that some transformers versions save ([`KNOWN_BUFFER_SUFFIXES`])
//!   are ignored.
//! - With tied embeddings, a duplicate [`TIED_LM_HEAD`] in the file is ignored.
//!
//! Everything else that does not match is an error listing all offending names.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::Read;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::error::RuntimeError;

/// Suffixes (at a `.` boundary) of tensors that are buffers, not parameters: GPT-2's causal
/// mask (`h.N.attn.bias`, `h.N.attn.masked_bias`) and Llama's rotary frequencies
/// (`*.rotary_emb.inv_freq`). Older transformers versions save them; loading ignores them.
pub const KNOWN_BUFFER_SUFFIXES: &[&str] =
    &["attn.bias", "attn.masked_bias", "rotary_emb.inv_freq"];

/// The output projection that tied-embedding checkpoints may carry as a copy of the token
/// embedding (Llama's `model.embed_tokens.weight`, GPT-2's `transformer.wte.weight`).
pub const TIED_LM_HEAD: &str = "lm_head.weight";

/// The prefix GPT2LMHeadModel puts before the GPT2Model tensors.
const GPT2_PREFIX: &str = "transformer.";

/// How many names an error lists before "and N more".
const LIST_MAX: usize = 10;

/// Whether `name` is a known non-parameter buffer (see [`KNOWN_BUFFER_SUFFIXES`]).
pub fn is_known_buffer(name: &str) -> bool {
    KNOWN_BUFFER_SUFFIXES.iter().any(|suffix| {
        name == *suffix
            || name
                .strip_suffix(suffix)
                .is_some_and(|head| head.ends_with('.'))
    })
}

/// Load the parameters `expected` (name and shape, in the order wanted) from the safetensors
/// file at `path`, converting F32, F16 and BF16 tensors to f32. Returns one vector per
/// expected parameter, in order, row-major.
///
/// `tied_embeddings` says the model shares its token embedding with the output projection
/// (and so does not list [`TIED_LM_HEAD`] in `expected`); a `lm_head.weight` in the file is
/// then ignored. A name in `expected` is always loaded, even if it looks like a buffer.
///
/// Errors (all as [`RuntimeError::Params`]): unreadable file, not a safetensors file,
/// missing tensors and unexpected tensors (every name, up to ten of each then a count),
/// unsupported dtypes, shape mismatches (name, expected and found shapes), NaN or infinite
/// values (each tensor with its count and first offender).
///
/// `path` may also be a sharded checkpoint ([`resolve_weights`]): a folder, or its
/// [`SHARD_INDEX`] file, whose tensors are split over several files. The shards are read
/// into one table first, so a sharded checkpoint loads exactly as the single file holding
/// the same tensors. A tensor the model needs that the index does not list is "missing";
/// the index and its shards must agree ([`read_sharded`]).
pub fn load_params(
    path: &Path,
    expected: &[(String, Vec<usize>)],
    tied_embeddings: bool,
) -> Result<Vec<Vec<f32>>, RuntimeError> {
    let err = |path: &Path, message: String| RuntimeError::Params {
        path: path.display().to_string(),
        message,
    };
    match resolve_weights(path).map_err(|m| err(path, m))? {
        Weights::File(file) => {
            let bytes = read_file(&file).map_err(|m| err(&file, m))?;
            load_params_from_bytes(
                &file.display().to_string(),
                bytes,
                expected,
                tied_embeddings,
            )
        }
        Weights::Sharded(index) => {
            let bytes = read_sharded(&index)?;
            load_params_from_bytes(
                &index.display().to_string(),
                bytes,
                expected,
                tied_embeddings,
            )
            .map_err(|e| match e {
                RuntimeError::Params { path, message } if message.starts_with("missing ") => {
                    RuntimeError::Params {
                        path,
                        message: format!("{message} (the index lists no such tensor)"),
                    }
                }
                e => e,
            })
        }
    }
}

/// The index transformers' `save_pretrained` writes beside a sharded checkpoint:
/// `{"metadata": {...}, "weight_map": {tensor name: shard file name}}`.
pub const SHARD_INDEX: &str = "model.safetensors.index.json";

/// The single file of an unsharded `save_pretrained` folder.
pub const SINGLE_FILE: &str = "model.safetensors";

/// The largest index file read (a real one is a few hundred KiB).
const MAX_SHARD_INDEX_BYTES: u64 = 64 << 20;

/// Where Hugging Face weights are read from (see [`resolve_weights`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Weights {
    /// One safetensors file.
    File(std::path::PathBuf),
    /// A sharded checkpoint: the path of its [`SHARD_INDEX`] (or another `*.index.json`).
    Sharded(std::path::PathBuf),
}

/// Whether `path` is a folder of Hugging Face weights (it holds [`SINGLE_FILE`] or
/// [`SHARD_INDEX`]), as opposed to, say, a megac checkpoint folder.
pub fn is_weights_dir(path: &Path) -> bool {
    path.is_dir() && (path.join(SINGLE_FILE).is_file() || path.join(SHARD_INDEX).is_file())
}

/// What `--init PATH` names, as transformers' `from_pretrained` reads a folder: a folder
/// holding [`SINGLE_FILE`] is that file, else one holding [`SHARD_INDEX`] is that sharded
/// checkpoint; a file whose name ends in `.index.json` is a sharded checkpoint's index;
/// any other path is one safetensors file. A folder with neither is an error (a message).
pub fn resolve_weights(path: &Path) -> Result<Weights, String> {
    if path.is_dir() {
        let single = path.join(SINGLE_FILE);
        if single.is_file() {
            return Ok(Weights::File(single));
        }
        let index = path.join(SHARD_INDEX);
        if index.is_file() {
            return Ok(Weights::Sharded(index));
        }
        return Err(format!(
            "is a folder without {SINGLE_FILE} or {SHARD_INDEX} (give a safetensors file, a \
             sharded checkpoint's index, or the folder save_pretrained wrote)"
        ));
    }
    let is_index = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with(".index.json"));
    Ok(if is_index {
        Weights::Sharded(path.to_path_buf())
    } else {
        Weights::File(path.to_path_buf())
    })
}

/// Read the sharded checkpoint whose index is `index` into the bytes of one safetensors
/// file holding every tensor of every shard (each shard's data, in shard-name order, with
/// its header's offsets moved), so that [`load_params_from_bytes`] loads it as it loads a
/// single file. Shard files are named relative to the index's folder.
///
/// Errors ([`RuntimeError::Params`], naming the index or the shard): an unreadable or
/// malformed index (serde_json's line and column), a `weight_map` entry that is not a plain
/// file name, a shard file that is missing or is not a safetensors file, a tensor the index
/// places in a shard that does not hold it, a tensor a shard holds that the index does not
/// list or places in another shard.
pub fn read_sharded(index: &Path) -> Result<Vec<u8>, RuntimeError> {
    let shown = index.display().to_string();
    let err = |message: String| RuntimeError::Params {
        path: shown.clone(),
        message,
    };
    let text = megac_ir::file::read_text(index, MAX_SHARD_INDEX_BYTES)
        .map_err(|e| err(format!("cannot read the index: {e}")))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| err(format!("not a valid index (JSON): {e}")))?;
    let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        return Err(err(
            "not a valid index: no `weight_map` object (tensor name -> shard file)".into(),
        ));
    };
    // Shard file -> the tensors the index places there.
    let mut shards: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for (tensor, file) in map {
        let Some(file) = file.as_str() else {
            return Err(err(format!(
                "not a valid index: weight_map[{tensor:?}] is {file}, not a file name"
            )));
        };
        let plain = Path::new(file)
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
        if file.is_empty() || !plain {
            return Err(err(format!(
                "weight_map[{tensor:?}] is {file:?}: a shard is a file name in the index's folder"
            )));
        }
        shards.entry(file).or_default().push(tensor);
    }
    if shards.is_empty() {
        return Err(err("the index's weight_map lists no tensor".into()));
    }
    let dir = index.parent().unwrap_or(Path::new(""));
    // First the shards' headers: check them against the index and merge them, each shard's
    // offsets moved past the data of the shards before it.
    let mut header = serde_json::Map::new();
    let mut data_len = 0u64;
    for (file, listed) in &shards {
        let path = dir.join(file);
        let shard_err = shard_error(&path);
        if !path.is_file() {
            let mut listed: Vec<String> = listed.iter().map(|s| s.to_string()).collect();
            listed.sort();
            return Err(err(format!(
                "shard {file} does not exist (the index places {} in it: {})",
                count(listed.len(), "tensor"),
                list(&listed)
            )));
        }
        let (n, file_len, shard_header) = read_header(&path).map_err(&shard_err)?;
        let mut absent: Vec<String> = listed
            .iter()
            .filter(|t| **t == "__metadata__" || !shard_header.contains_key(**t))
            .map(|t| t.to_string())
            .collect();
        absent.sort();
        if !absent.is_empty() {
            return Err(shard_err(format!(
                "the index {shown} places {} in this shard, which does not hold {}: {}",
                count(absent.len(), "tensor"),
                if absent.len() == 1 { "it" } else { "them" },
                list(&absent)
            )));
        }
        let mut unlisted: Vec<String> = shard_header
            .keys()
            .filter(|t| *t != "__metadata__")
            .filter(|t| map.get(*t).and_then(|f| f.as_str()) != Some(*file))
            .map(|t| match map.get(t).and_then(|f| f.as_str()) {
                Some(other) => format!("{t} (which the index places in {other})"),
                None => t.to_string(),
            })
            .collect();
        unlisted.sort();
        if !unlisted.is_empty() {
            return Err(shard_err(format!(
                "{} in this shard {} not listed for it in the index {shown}: {}",
                count(unlisted.len(), "tensor"),
                if unlisted.len() == 1 { "is" } else { "are" },
                list(&unlisted)
            )));
        }
        for (name, mut info) in shard_header {
            if name == "__metadata__" {
                continue;
            }
            let offsets = info.get_mut("data_offsets").and_then(|o| o.as_array_mut());
            for o in offsets.into_iter().flatten() {
                let moved = o.as_u64().and_then(|x| x.checked_add(data_len));
                *o = moved
                    .ok_or_else(|| shard_err(format!("{name}: bad data_offsets")))?
                    .into();
            }
            header.insert(name, info);
        }
        data_len += file_len - 8 - n;
    }
    let mut head =
        serde_json::to_vec(&header).map_err(|e| err(format!("cannot merge the shards: {e}")))?;
    head.resize(head.len().div_ceil(8) * 8, b' ');
    let too_large = || err("the shards are more than fits in memory".into());
    let total = usize::try_from(data_len + 8 + head.len() as u64).map_err(|_| too_large())?;
    let mut out = Vec::new();
    out.try_reserve_exact(total).map_err(|_| too_large())?;
    out.extend_from_slice(&(head.len() as u64).to_le_bytes());
    out.extend_from_slice(&head);
    // Then each shard whole (the safetensors crate checks it), its data appended.
    for file in shards.keys() {
        let path = dir.join(file);
        let shard_err = shard_error(&path);
        let bytes = read_file(&path).map_err(&shard_err)?;
        SafeTensors::deserialize(&bytes)
            .map_err(|e| shard_err(format!("not a valid safetensors file: {e}")))?;
        let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
        out.extend_from_slice(&bytes[8 + n..]);
    }
    if out.len() != total {
        return Err(err("a shard changed while it was read".into()));
    }
    Ok(out)
}

/// A [`RuntimeError::Params`] about the shard file `path`.
fn shard_error(path: &Path) -> impl Fn(String) -> RuntimeError + '_ {
    move |message| RuntimeError::Params {
        path: path.display().to_string(),
        message,
    }
}

/// The header of the safetensors file at `path`: its length in bytes, the file's length
/// and the header's JSON object (tensor name -> dtype, shape, data_offsets).
fn read_header(
    path: &Path,
) -> Result<(u64, u64, serde_json::Map<String, serde_json::Value>), String> {
    let mut file = File::open(path).map_err(|e| format!("cannot read: {e}"))?;
    let file_len = file
        .metadata()
        .map_err(|e| format!("cannot read: {e}"))?
        .len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|_| {
        "not a valid safetensors file: shorter than its 8-byte header length".to_string()
    })?;
    let n = u64::from_le_bytes(len);
    // The safetensors crate's own bound on a header.
    if n > 100_000_000 || n > file_len - 8 {
        return Err(format!(
            "not a valid safetensors file: a header of {n} bytes in a file of {file_len}"
        ));
    }
    let mut head = vec![0u8; n as usize];
    file.read_exact(&mut head)
        .map_err(|e| format!("cannot read: {e}"))?;
    let json = serde_json::from_slice(&head)
        .map_err(|e| format!("not a valid safetensors file (header JSON): {e}"))?;
    Ok((n, file_len, json))
}

/// Read a whole file into memory, reserving the memory fallibly: a file too large for
/// memory is an error, not an abort.
fn read_file(path: &Path) -> Result<Vec<u8>, String> {
    let mut file = File::open(path).map_err(|e| format!("cannot read: {e}"))?;
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut bytes = Vec::new();
    usize::try_from(size)
        .ok()
        .and_then(|n| bytes.try_reserve_exact(n).ok())
        .ok_or_else(|| {
            format!("cannot read: the file is {size} bytes, more than fits in memory")
        })?;
    file.read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    Ok(bytes)
}

/// [`load_params`] on the bytes of a safetensors file already in memory; `name` names the
/// file in messages. Never panics and never aborts on any input: every malformed file
/// (header length, header JSON, dtypes, shapes, offsets, fused expert tensors) is a
/// [`RuntimeError::Params`].
pub fn load_params_from_bytes(
    name: &str,
    mut bytes: Vec<u8>,
    expected: &[(String, Vec<usize>)],
    tied_embeddings: bool,
) -> Result<Vec<Vec<f32>>, RuntimeError> {
    let err = |message: String| RuntimeError::Params {
        path: name.to_string(),
        message,
    };
    if let Some(unfused) = unfuse_moe(&bytes).map_err(err)? {
        bytes = unfused;
    }
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| err(format!("not a valid safetensors file: {e}")))?;
    let present: HashSet<&str> = file.names().into_iter().collect();

    // Resolve each expected name to the name it has in the file.
    let mut missing = Vec::new();
    let mut resolved = Vec::with_capacity(expected.len());
    for (name, _) in expected {
        let found = if present.contains(name.as_str()) {
            Some(name.as_str())
        } else {
            name.strip_prefix(GPT2_PREFIX)
                .filter(|bare| present.contains(bare))
        };
        match found {
            Some(found) => resolved.push(found),
            None => missing.push(name.clone()),
        }
    }
    let used: HashSet<&str> = resolved.iter().copied().collect();
    let mut unexpected: Vec<String> = present
        .iter()
        .filter(|n| !used.contains(*n))
        .filter(|n| !is_known_buffer(n))
        .filter(|n| !(tied_embeddings && **n == TIED_LM_HEAD))
        .map(|n| n.to_string())
        .collect();
    unexpected.sort();
    if !missing.is_empty() || !unexpected.is_empty() {
        let mut parts = Vec::new();
        if !missing.is_empty() {
            parts.push(format!(
                "missing {}: {}",
                count(missing.len(), "tensor"),
                list(&missing)
            ));
        }
        if !unexpected.is_empty() {
            parts.push(format!(
                "{}: {}",
                if unexpected.len() == 1 {
                    "1 tensor in the file is not a parameter of this model".to_string()
                } else {
                    format!(
                        "{} tensors in the file are not parameters of this model",
                        unexpected.len()
                    )
                },
                list(&unexpected)
            ));
        }
        return Err(err(parts.join("; ")));
    }

    // Dtypes, then shapes: report every offender of the first kind that has any.
    let views: Vec<_> = resolved
        .iter()
        .map(|name| file.tensor(name))
        .collect::<Result<_, _>>()
        .map_err(|e| err(format!("not a valid safetensors file: {e}")))?;
    let bad_dtypes: Vec<String> = resolved
        .iter()
        .zip(&views)
        .filter(|(_, v)| !matches!(v.dtype(), Dtype::F32 | Dtype::F16 | Dtype::BF16))
        .map(|(name, v)| format!("{name} ({:?})", v.dtype()))
        .collect();
    if !bad_dtypes.is_empty() {
        return Err(err(format!(
            "unsupported dtype for {}: {} (supported: F32, F16, BF16)",
            count(bad_dtypes.len(), "tensor"),
            list(&bad_dtypes)
        )));
    }
    let bad_shapes: Vec<String> = expected
        .iter()
        .zip(&views)
        .filter(|((_, shape), v)| v.shape() != shape.as_slice())
        .map(|((name, shape), v)| format!("{name} has shape {:?}, expected {shape:?}", v.shape()))
        .collect();
    if !bad_shapes.is_empty() {
        return Err(err(format!(
            "wrong shape for {}: {}",
            count(bad_shapes.len(), "tensor"),
            list(&bad_shapes)
        )));
    }

    let values: Vec<Vec<f32>> = views.iter().map(|v| to_f32(v.dtype(), v.data())).collect();
    // NaN or infinite weights would make every loss NaN: name each tensor that has one.
    let non_finite: Vec<String> = resolved
        .iter()
        .zip(&values)
        .filter_map(|(name, v)| {
            let bad = v.iter().filter(|x| !x.is_finite()).count();
            let (at, x) = v.iter().enumerate().find(|(_, x)| !x.is_finite())?;
            Some(format!(
                "{name} ({bad} of {} values, the first {x} at element {at})",
                v.len()
            ))
        })
        .collect();
    if !non_finite.is_empty() {
        return Err(err(format!(
            "NaN or infinite values in {}: {}",
            count(non_finite.len(), "tensor"),
            list(&non_finite)
        )));
    }
    Ok(values)
}

/// The tensor `name` of the safetensors file at `path` (F32, F16 or BF16, as f32): its
/// shape and row-major values (`--perturb POINT:patch(FILE)` reads probe files with it).
pub fn load_tensor(path: &Path, name: &str) -> Result<(Vec<usize>, Vec<f32>), RuntimeError> {
    let err = |message: String| RuntimeError::Params {
        path: path.display().to_string(),
        message,
    };
    let bytes = read_file(path).map_err(err)?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| err(format!("not a valid safetensors file: {e}")))?;
    let view = file.tensor(name).map_err(|_| {
        let mut names: Vec<String> = file.names().into_iter().map(String::from).collect();
        names.sort();
        err(format!("has no tensor `{name}` (it has {})", list(&names)))
    })?;
    if !matches!(view.dtype(), Dtype::F32 | Dtype::F16 | Dtype::BF16) {
        return Err(err(format!(
            "{name} has dtype {:?} (supported: F32, F16, BF16)",
            view.dtype()
        )));
    }
    Ok((view.shape().to_vec(), to_f32(view.dtype(), view.data())))
}

/// transformers 5 stores Mixtral's experts fused per layer: `model.layers.{i}.mlp.gate.weight`
/// (the router), `mlp.experts.gate_up_proj` `[E, 2·ffn, h]` (rows `0..ffn` are w1, the gate;
/// rows `ffn..2·ffn` are w3, the up projection) and `mlp.experts.down_proj` `[E, h, ffn]` (w2).
/// When a file has that layout, rewrite it (in memory, as f32) with the Hub names megac uses
/// (`block_sparse_moe.gate.weight`, `block_sparse_moe.experts.{j}.w1/w2/w3.weight`).
/// Qwen2-MoE's state dict fuses its experts the same way; a file with a shared expert
/// (`mlp.shared_expert.*`, which Mixtral has not) gets Qwen2-MoE's Hub names instead
/// (`mlp.experts.{j}.gate_proj/up_proj/down_proj.weight`, the router `mlp.gate.weight` kept).
fn unfuse_moe(bytes: &[u8]) -> Result<Option<Vec<u8>>, String> {
    let file = SafeTensors::deserialize(bytes)
        .map_err(|e| format!("not a valid safetensors file: {e}"))?;
    let names: Vec<String> = file.names().into_iter().map(str::to_string).collect();
    if !names
        .iter()
        .any(|n| n.ends_with(".mlp.experts.gate_up_proj"))
    {
        return Ok(None);
    }
    let qwen = names.iter().any(|n| n.contains(".mlp.shared_expert."));
    let (block, w1n, w3n, w2n) = if qwen {
        ("mlp", "gate_proj", "up_proj", "down_proj")
    } else {
        ("block_sparse_moe", "w1", "w3", "w2")
    };
    // Every tensor of the rewritten file: name, dtype, shape, little-endian bytes. Tensors
    // that are not fused keep their dtype and bytes (the dtype check comes later).
    let mut out: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    for name in &names {
        let t = file
            .tensor(name)
            .map_err(|e| format!("not a valid safetensors file: {e}"))?;
        let shape = t.shape().to_vec();
        let fused =
            name.ends_with(".mlp.experts.gate_up_proj") || name.ends_with(".mlp.experts.down_proj");
        if fused && !matches!(t.dtype(), Dtype::F32 | Dtype::F16 | Dtype::BF16) {
            return Err(format!(
                "unsupported dtype for {name} ({:?}; supported: F32, F16, BF16)",
                t.dtype()
            ));
        }
        if let Some(layer) = name.strip_suffix(".mlp.experts.gate_up_proj") {
            let data = to_f32(t.dtype(), t.data());
            let [e, two_f, h] = shape[..] else {
                return Err(format!(
                    "{name} has shape {shape:?}, expected [experts, 2·ffn, hidden]"
                ));
            };
            if two_f % 2 != 0
                || Some(data.len()) != e.checked_mul(two_f).and_then(|n| n.checked_mul(h))
            {
                return Err(format!(
                    "{name} has shape {shape:?}, expected [experts, 2·ffn, hidden] with an even \
                     2·ffn"
                ));
            }
            let f = two_f / 2;
            for j in 0..e {
                let base = j * two_f * h;
                let w1 = &data[base..base + f * h];
                let w3 = &data[base + f * h..base + two_f * h];
                out.push((
                    format!("{layer}.{block}.experts.{j}.{w1n}.weight"),
                    Dtype::F32,
                    vec![f, h],
                    f32_bytes(w1),
                ));
                out.push((
                    format!("{layer}.{block}.experts.{j}.{w3n}.weight"),
                    Dtype::F32,
                    vec![f, h],
                    f32_bytes(w3),
                ));
            }
        } else if let Some(layer) = name.strip_suffix(".mlp.experts.down_proj") {
            let data = to_f32(t.dtype(), t.data());
            let [e, h, f] = shape[..] else {
                return Err(format!(
                    "{name} has shape {shape:?}, expected [experts, hidden, ffn]"
                ));
            };
            if Some(data.len()) != e.checked_mul(h).and_then(|n| n.checked_mul(f)) {
                return Err(format!(
                    "{name} has shape {shape:?}, expected [experts, hidden, ffn]"
                ));
            }
            for j in 0..e {
                let w2 = &data[j * h * f..(j + 1) * h * f];
                out.push((
                    format!("{layer}.{block}.experts.{j}.{w2n}.weight"),
                    Dtype::F32,
                    vec![h, f],
                    f32_bytes(w2),
                ));
            }
        } else if let Some(layer) = name.strip_suffix(".mlp.gate.weight").filter(|l| {
            !qwen
                && names
                    .iter()
                    .any(|n| n == &format!("{l}.mlp.experts.gate_up_proj"))
        }) {
            out.push((
                format!("{layer}.block_sparse_moe.gate.weight"),
                t.dtype(),
                shape,
                t.data().to_vec(),
            ));
        } else {
            out.push((name.clone(), t.dtype(), shape, t.data().to_vec()));
        }
    }
    let mut seen = HashSet::new();
    if let Some((dup, ..)) = out.iter().find(|(n, ..)| !seen.insert(n.as_str())) {
        return Err(format!(
            "{dup} is in the file both fused (mlp.experts.*) and unfused"
        ));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = out
        .iter()
        .map(|(n, dtype, shape, bytes)| {
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (n.clone(), v))
                .map_err(|e| format!("cannot unfuse {n}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize(views, None)
        .map(Some)
        .map_err(|e| format!("cannot unfuse the experts: {e}"))
}

/// Convert little-endian F32, F16 or BF16 bytes to f32 (the dtype was checked).
fn to_f32(dtype: Dtype, data: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
    }
}

/// Write `tensors` (name, shape, row-major data) to `path` as an F32 safetensors file with
/// the metadata `{"format": "pt"}`, as transformers' `save_pretrained` does, so
/// `from_pretrained` reads it back.
///
/// Missing folders are created. The write is atomic: the file is written to a temporary file
/// in the same directory,
/// synced, then renamed over `path`. On any error nothing is left behind and an existing file
/// at `path` is untouched.
///
/// Errors ([`RuntimeError::Params`]): a data length that is not the product of the shape,
/// duplicate or reserved (`__metadata__`) names, and any I/O failure.
pub fn save_params(
    path: &Path,
    tensors: &[(String, Vec<usize>, &[f32])],
) -> Result<(), RuntimeError> {
    save_params_with_metadata(path, tensors, &[])
}

/// [`save_params`] with more string entries in the header's `__metadata__` (after
/// `"format": "pt"`, which a `"format"` entry here replaces), e.g. the input tokens of a
/// `megac scope` probe file. safetensors readers ignore entries they do not know.
pub fn save_params_with_metadata(
    path: &Path,
    tensors: &[(String, Vec<usize>, &[f32])],
    metadata: &[(String, String)],
) -> Result<(), RuntimeError> {
    let err = |message: String| RuntimeError::Params {
        path: path.display().to_string(),
        message,
    };
    // Check and lay out the tensors, in name order (as the safetensors crate does).
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| tensors[a].0.cmp(&tensors[b].0));
    let mut seen = HashMap::new();
    let mut header = serde_json::Map::new();
    let mut meta = serde_json::Map::new();
    meta.insert("format".to_string(), "pt".into());
    for (key, value) in metadata {
        meta.insert(key.clone(), value.clone().into());
    }
    header.insert("__metadata__".to_string(), meta.into());
    let mut offset = 0usize;
    for &i in &order {
        let (name, shape, data) = &tensors[i];
        if name == "__metadata__" {
            return Err(err(
                "`__metadata__` is reserved and cannot name a tensor".to_string()
            ));
        }
        if seen.insert(name.as_str(), ()).is_some() {
            return Err(err(format!("tensor {name} is given twice")));
        }
        let elems = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| err(format!("tensor {name}: shape {shape:?} is too large")))?;
        if elems != data.len() {
            return Err(err(format!(
                "tensor {name}: shape {shape:?} has {elems} elements but {} values were given",
                data.len()
            )));
        }
        let end = offset + 4 * elems;
        header.insert(
            name.clone(),
            serde_json::json!({ "dtype": "F32", "shape": shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut header = serde_json::to_vec(&header)
        .map_err(|e| err(format!("cannot encode the safetensors header: {e}")))?;
    header.resize(header.len().div_ceil(8) * 8, b' ');

    megac_ir::file::write_atomic_with(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        let mut buf = Vec::with_capacity(1 << 16);
        for &i in &order {
            for chunk in tensors[i].2.chunks(1 << 14) {
                buf.clear();
                for x in chunk {
                    buf.extend_from_slice(&x.to_le_bytes());
                }
                w.write_all(&buf)?;
            }
        }
        Ok(())
    })
    .map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// `n thing` / `n things`.
fn count(n: usize, thing: &str) -> String {
    if n == 1 {
        format!("1 {thing}")
    } else {
        format!("{n} {thing}s")
    }
}

/// The first [`LIST_MAX`] items, comma separated, then `and N more`.
fn list(items: &[String]) -> String {
    let mut out = items
        .iter()
        .take(LIST_MAX)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > LIST_MAX {
        out.push_str(&format!(", and {} more", items.len() - LIST_MAX));
    }
    out
}
