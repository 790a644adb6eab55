//! `megac scope view`: read a probe file written by `megac scope` (and optionally its
//! `--report`) and write one self-contained HTML page that shows it (the page itself:
//! `render::scope_view`).
//!
//! What the page gets, per layer: the attention probabilities (`layers.{i}.attn.probs`) as
//! base64 float32, the logit lens (`layers.{i}.lens.tokens` / `.probs`); the top 5 of
//! `logits`; the input tokens from the file's metadata (`megac.tokens`, written by
//! `megac scope`; files made before it carry none); the report as it is. Large files are cut
//! to their first positions ([`ViewArgs::max_positions`], and so that the attention fits in
//! [`ATTENTION_BUDGET`] values), which the page says.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};

/// Options of `megac scope view`.
#[derive(clap::Args)]
pub struct ViewArgs {
    /// A probe file written by `megac scope -o` (its attn.probs, lens and logits are shown;
    /// the other points are listed).
    #[arg(value_name = "OUT.safetensors")]
    pub probes: PathBuf,
    /// The perturbation report written by the same `megac scope` run (`--report`): its
    /// figures, per-position KL, and the clean vs perturbed next-token distributions.
    #[arg(long, value_name = "R.json")]
    pub report: Option<PathBuf>,
    /// The HTML file to write (checked before any work; written atomically).
    #[arg(short = 'o', long = "output", value_name = "view.html")]
    pub output: PathBuf,
    /// Show at most the first N positions (fewer when the attention maps of every layer and
    /// head would not fit in the page's budget of 1,048,576 values; the page says so).
    #[arg(long, default_value_t = 128, value_name = "N")]
    pub max_positions: usize,
    /// Show token ids below 256 as the bytes they stand for (the byte-level tokens of
    /// `--prompt` and of `.txt` data); on by itself when the probe file records a --prompt.
    #[arg(long)]
    pub bytes: bool,
}

/// The most attention values (layers × heads × positions²) a page embeds: 4 MiB of float32.
pub const ATTENTION_BUDGET: usize = 1 << 20;

/// How many tokens the page lists for `logits` per position (as the lens keeps).
const LOGITS_TOP_K: usize = 5;

/// One tensor of the probe file, as float32.
struct Tensor {
    shape: Vec<usize>,
    values: Vec<f32>,
}

/// `megac scope view`.
pub fn run(args: &ViewArgs) -> Result<(), String> {
    super::output::check_file("-o", &args.output)?;
    if args.max_positions == 0 {
        return Err("error: --max-positions must be at least 1".into());
    }
    let shown = args.probes.display().to_string();
    let bytes = std::fs::read(&args.probes).map_err(|e| format!("error: {shown}: {e}"))?;
    let (tensors, metadata) = read_probes(&bytes).map_err(|e| format!("error: {shown}: {e}"))?;
    let report = match &args.report {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("error: {}: {e}", path.display()))?;
            let value: Value = serde_json::from_str(&text).map_err(|e| {
                format!(
                    "error: {}:{}:{}: not JSON: {e}",
                    path.display(),
                    e.line(),
                    e.column()
                )
            })?;
            Some((path, value))
        }
        None => None,
    };
    let file_name = args
        .probes
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| shown.clone());
    let data = page_data(
        &file_name,
        &tensors,
        &metadata,
        report.as_ref().map(|(p, v)| (p.as_path(), v)),
        args,
    )
    .map_err(|e| format!("error: {shown}: {e}"))?;
    let html = crate::render::scope_view::page(&data);
    super::output::write_file(&args.output, &html)?;
    println!(
        "wrote {}: {} of {} position(s), {} layer(s){}",
        args.output.display(),
        data["shown"],
        data["n"],
        data["layers"].as_array().map_or(0, Vec::len),
        if report.is_some() {
            ", with the report"
        } else {
            ""
        }
    );
    Ok(())
}

/// The float32 tensors of a safetensors file and its `__metadata__`.
#[allow(clippy::type_complexity)]
fn read_probes(
    bytes: &[u8],
) -> Result<(BTreeMap<String, Tensor>, HashMap<String, String>), String> {
    let (_, meta) = SafeTensors::read_metadata(bytes)
        .map_err(|e| format!("not a valid safetensors file: {e}"))?;
    let file = SafeTensors::deserialize(bytes)
        .map_err(|e| format!("not a valid safetensors file: {e}"))?;
    let mut tensors = BTreeMap::new();
    for (name, view) in file.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(format!(
                "tensor {name} is {:?}; megac scope writes F32 tensors only",
                view.dtype()
            ));
        }
        let values = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        tensors.insert(
            name,
            Tensor {
                shape: view.shape().to_vec(),
                values,
            },
        );
    }
    Ok((tensors, meta.metadata().clone().unwrap_or_default()))
}

/// The layer index of `layers.{i}.{rest}`.
fn layer_of<'a>(name: &'a str, rest: &str) -> Option<(usize, &'a str)> {
    let tail = name.strip_prefix("layers.")?;
    let (i, r) = tail.split_once('.')?;
    (r == rest).then_some(())?;
    Some((i.parse().ok()?, i))
}

/// What the page embeds (render::scope_view reads it in JavaScript).
fn page_data(
    file_name: &str,
    tensors: &BTreeMap<String, Tensor>,
    metadata: &HashMap<String, String>,
    report: Option<(&Path, &Value)>,
    args: &ViewArgs,
) -> Result<Value, String> {
    // The number of positions: every tensor's position dim must agree.
    let mut n: Option<(usize, String)> = None;
    let mut agree = |len: usize, what: &str| -> Result<(), String> {
        match &n {
            Some((m, first)) if *m != len => Err(format!(
                "{what} has {len} positions but {first} has {m}: not one probe run"
            )),
            Some(_) => Ok(()),
            None => {
                n = Some((len, what.to_string()));
                Ok(())
            }
        }
    };
    let tokens: Option<Vec<u32>> = match metadata.get("megac.tokens") {
        Some(text) => {
            let ids = text
                .split(',')
                .map(|t| t.trim().parse::<u32>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("metadata megac.tokens {text:?}: {e}"))?;
            agree(ids.len(), "the metadata's megac.tokens")?;
            Some(ids)
        }
        None => None,
    };
    let mut attn: BTreeMap<usize, &Tensor> = BTreeMap::new();
    let mut lens: BTreeMap<usize, (&Tensor, &Tensor)> = BTreeMap::new();
    let mut listed = Vec::new();
    for (name, t) in tensors {
        listed.push(json!([name, t.shape]));
        let rank3 = t.shape.len() == 3 && t.shape[0] == 1;
        if let Some((i, _)) = layer_of(name, "attn.probs") {
            let [1, _, q, k] = t.shape[..] else {
                return Err(format!(
                    "{name} has shape {:?}, not [1, heads, n, n]",
                    t.shape
                ));
            };
            if q != k {
                return Err(format!(
                    "{name} has shape {:?}, not [1, heads, n, n]",
                    t.shape
                ));
            }
            agree(q, name)?;
            attn.insert(i, t);
        } else if let Some((i, idx)) = layer_of(name, "lens.tokens") {
            let probs_name = format!("layers.{idx}.lens.probs");
            let probs = tensors
                .get(&probs_name)
                .ok_or_else(|| format!("{name} is there but {probs_name} is not"))?;
            if !rank3 || probs.shape != t.shape {
                return Err(format!(
                    "{name} {:?} and {probs_name} {:?} must both be [1, n, k]",
                    t.shape, probs.shape
                ));
            }
            agree(t.shape[1], name)?;
            lens.insert(i, (t, probs));
        } else if name == "logits" || name == "embed" || name.starts_with("layers.") {
            if !rank3 {
                return Err(format!("{name} has shape {:?}, not [1, n, d]", t.shape));
            }
            agree(t.shape[1], name)?;
        }
    }
    let logits = tensors.get("logits");
    if attn.is_empty() && lens.is_empty() && logits.is_none() {
        return Err("nothing to show: the file has no layers.*.attn.probs, layers.*.lens or \
             logits (probe them: --probe 'layers.*.attn.probs' --probe 'layers.*.lens' --probe logits)"
            .to_string());
    }
    let n = n.map_or(0, |(n, _)| n);

    // Positions shown: the first `shown`, within --max-positions and the attention budget.
    let head_maps: usize = attn.values().map(|t| t.shape[1]).sum();
    let mut shown = n.min(args.max_positions);
    let mut notes = Vec::new();
    if head_maps * shown * shown > ATTENTION_BUDGET {
        shown = ((ATTENTION_BUDGET / head_maps) as f64)
            .sqrt()
            .floor()
            .max(1.0) as usize;
        notes.push(format!(
            "the attention maps of {} layer(s), {head_maps} head map(s) in all, are cut to \
             their first {shown} positions to fit the page's budget of {ATTENTION_BUDGET} values",
            attn.len()
        ));
    }
    if shown < n {
        notes.insert(
            0,
            format!(
                "showing positions 0 to {} of {n} (--max-positions {})",
                shown - 1,
                args.max_positions
            ),
        );
    }

    // Per layer: the attention maps' first `shown` rows and columns, and the lens.
    let mut layer_ids: Vec<usize> = attn.keys().chain(lens.keys()).copied().collect();
    layer_ids.sort_unstable();
    layer_ids.dedup();
    let mut layers = Vec::new();
    for i in layer_ids {
        let mut layer = json!({ "index": i });
        if let Some(t) = attn.get(&i) {
            let heads = t.shape[1];
            let mut cut = Vec::with_capacity(heads * shown * shown);
            for h in 0..heads {
                for q in 0..shown {
                    let row = (h * n + q) * n;
                    cut.extend_from_slice(&t.values[row..row + shown]);
                }
            }
            layer["heads"] = json!(heads);
            layer["attn"] = json!(crate::render::scope_view::base64_f32(&cut));
        }
        if let Some((tok, probs)) = lens.get(&i) {
            layer["lens"] = top_list(tok, probs, shown)?;
        }
        layers.push(layer);
    }
    let logits_top = match logits {
        Some(t) => {
            let vocab = t.shape[2];
            let (mut ids, mut ps) = (Vec::new(), Vec::new());
            for q in 0..shown {
                let p = softmax(&t.values[q * vocab..(q + 1) * vocab]);
                for i in top_k(&p, LOGITS_TOP_K) {
                    ids.push(json!(i));
                    ps.push(json!(p[i] as f32));
                }
            }
            json!({ "k": LOGITS_TOP_K.min(vocab), "tokens": ids, "probs": ps })
        }
        None => Value::Null,
    };
    let report = match report {
        Some((path, value)) => check_report(value, n, shown)
            .map_err(|e| format!("with the report {}: {e}", path.display()))?,
        None => Value::Null,
    };
    let prompt = metadata.get("megac.prompt");
    let perturb: Vec<&str> = metadata
        .get("megac.perturb")
        .map(|p| p.lines().collect())
        .unwrap_or_default();
    Ok(json!({
        "file": file_name,
        "model": metadata.get("megac.model"),
        "prompt": prompt,
        "perturb": perturb,
        "seed": metadata.get("megac.seed"),
        "n": n,
        "shown": shown,
        "notes": notes,
        "tokens": tokens.map(|t| t[..shown].to_vec()),
        "bytes": args.bytes || prompt.is_some(),
        "layers": layers,
        "logits": logits_top,
        "tensors": listed,
        "report": report,
    }))
}

/// A lens's top-k lists for the first `shown` positions: `{"k", "tokens", "probs"}`, flat.
fn top_list(tokens: &Tensor, probs: &Tensor, shown: usize) -> Result<Value, String> {
    let k = tokens.shape[2];
    let ids = tokens.values[..shown * k]
        .iter()
        .map(|&x| {
            if x >= 0.0 && x.fract() == 0.0 && x < 16_777_216.0 {
                Ok(json!(x as u32))
            } else {
                Err(format!("a lens token id is {x}, not a token id"))
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(json!({ "k": k, "tokens": ids, "probs": &probs.values[..shown * k] }))
}

/// The report's figures, checked, with `per_position` cut to the first `shown` positions.
fn check_report(report: &Value, n: usize, shown: usize) -> Result<Value, String> {
    let number = |key: &str| {
        report
            .get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("no number \"{key}\" (is it a `megac scope --report` file?)"))
    };
    let mut out = json!({
        "clean_loss": number("clean_loss")?,
        "perturbed_loss": number("perturbed_loss")?,
        "kl": number("kl")?,
        "top1_agreement": number("top1_agreement")?,
    });
    let per = report
        .get("per_position")
        .and_then(Value::as_array)
        .ok_or("no \"per_position\" list")?;
    if per.len() != n {
        return Err(format!(
            "it has {} positions but the probe file {n}: not the same run",
            per.len()
        ));
    }
    for (t, p) in per.iter().enumerate() {
        for key in ["kl", "clean_top1", "perturbed_top1"] {
            if p.get(key).and_then(Value::as_f64).is_none() {
                return Err(format!("per_position[{t}] has no number \"{key}\""));
            }
        }
    }
    out["per_position"] = json!(per[..shown]);
    Ok(out)
}

/// Softmax of a row of logits, in float64.
pub fn softmax(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
    let exp: Vec<f64> = row.iter().map(|&x| (f64::from(x) - max).exp()).collect();
    let sum: f64 = exp.iter().sum();
    exp.into_iter().map(|e| e / sum).collect()
}

/// The indices of the `k` largest values, largest first, the lowest index first on a tie.
pub fn top_k(values: &[f64], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}
