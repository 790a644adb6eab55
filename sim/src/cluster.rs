//! The machine a plan runs on: one accelerator type, nodes of `gpus_per_node` of them,
//! NVLink-class links inside a node and a network between nodes (docs/cluster-toml.md).
//!
//! A cluster comes from a preset (`a100-80g`, `h100-sxm`, `h200`: `presets/*.toml`, each
//! citing the datasheets its numbers come from) or from a `cluster.toml`, which may start
//! from a preset (`preset = "h100-sxm"`) and override any key. Errors name the file, line and
//! column of the offending key or value.

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

use crate::cost::CostParams;
use crate::error::SimError;

/// Built-in presets: (name, cluster.toml text).
pub const PRESETS: &[(&str, &str)] = &[
    ("a100-80g", include_str!("../presets/a100-80g.toml")),
    ("h100-sxm", include_str!("../presets/h100-sxm.toml")),
    ("h200", include_str!("../presets/h200.toml")),
];

/// Number formats a device may have a peak for, in `[device.peak_tflops]`.
pub const DTYPES: &[&str] = &["fp32", "tf32", "bf16", "fp16", "fp8"];

/// One accelerator.
#[derive(Clone, Debug, PartialEq)]
pub struct Device {
    /// Marketing name, for people.
    pub name: String,
    /// Dense peak FLOP/s per number format (`fp32`, `tf32`, `bf16`, `fp16`, `fp8`).
    pub peak_flops: BTreeMap<String, f64>,
    /// Memory in bytes.
    pub memory_bytes: f64,
    /// HBM bandwidth in bytes/s.
    pub hbm_bytes_per_s: f64,
}

impl Device {
    /// Peak FLOP/s for number format `dtype` (`bf16`, `fp32`, ...); falls back to fp32 and
    /// then to the largest peak listed.
    pub fn peak(&self, dtype: &str) -> f64 {
        self.peak_flops
            .get(dtype)
            .or_else(|| self.peak_flops.get("fp32"))
            .copied()
            .unwrap_or_else(|| self.peak_flops.values().copied().fold(0.0, f64::max))
    }
}

/// A link class: bandwidth per GPU and direction, and per-message latency.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Bytes/s per GPU and direction.
    pub bytes_per_s: f64,
    /// Seconds per message (the alpha of the alpha-beta model).
    pub latency_s: f64,
}

/// A cluster: devices, how many, how they are linked, and the cost model's constants.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    /// Preset or file name, for people.
    pub name: String,
    /// Where it came from (`preset h100-sxm`, or the file path).
    pub source: String,
    /// The accelerator.
    pub device: Device,
    /// Accelerators per node.
    pub gpus_per_node: u64,
    /// Number of nodes; `None` until sized to a job ([`Cluster::fit`]).
    pub nodes: Option<u64>,
    /// Links inside a node (NVLink / NVSwitch).
    pub intra_node: Link,
    /// Links between nodes (InfiniBand / RoCE), per GPU.
    pub inter_node: Link,
    /// Cost-model constants (`[cost]`; defaults are the fitted values of docs/cluster-toml.md).
    pub cost: CostParams,
}

impl Cluster {
    /// A built-in preset by name.
    pub fn preset(name: &str) -> Result<Cluster, SimError> {
        let Some((_, text)) = PRESETS.iter().find(|(n, _)| *n == name) else {
            return Err(
                SimError::new(format!("unknown cluster preset `{name}`")).with_help(preset_help())
            );
        };
        let mut c =
            Cluster::parse(&format!("preset {name}"), text).expect("built-in presets are valid");
        c.source = format!("preset {name}");
        Ok(c)
    }

    /// `--cluster ARG`: a file when `ARG` names an existing file or looks like a path
    /// (contains `/` or ends in `.toml`), otherwise a preset name.
    pub fn load(arg: &str) -> Result<Cluster, SimError> {
        let path = std::path::Path::new(arg);
        if path.is_file() || arg.contains('/') || arg.ends_with(".toml") {
            let text =
                megac_ir::file::read_text(path, megac_ir::file::MAX_CONFIG_BYTES).map_err(|e| {
                    SimError::in_file(arg, format!("cannot read the cluster file: {e}"))
                })?;
            Cluster::parse(arg, &text)
        } else {
            Cluster::preset(arg).map_err(|e| {
                e.with_help(format!(
                    "--cluster takes a cluster.toml path or a preset name; {}",
                    preset_help()
                ))
            })
        }
    }

    /// Parse cluster.toml `text`; `file` names it in messages.
    pub fn parse(file: &str, text: &str) -> Result<Cluster, SimError> {
        let raw: RawCluster = toml::from_str(text).map_err(|e| {
            let msg = e.message().trim_end().to_string();
            let err = match e.span() {
                Some(span) => SimError::at(file, text, span.start, msg),
                None => SimError::in_file(file, msg),
            };
            err.with_help("see docs/cluster-toml.md for every key of cluster.toml")
        })?;
        let at = |pos: usize, msg: String| SimError::at(file, text, pos, msg);
        let base = match &raw.preset {
            None => None,
            Some(p) => {
                let Some((_, ptext)) = PRESETS.iter().find(|(n, _)| *n == p.get_ref()) else {
                    return Err(at(
                        p.span().start,
                        format!("unknown cluster preset `{}`", p.get_ref()),
                    )
                    .with_help(preset_help()));
                };
                Some(toml::from_str::<RawCluster>(ptext).expect("built-in presets parse"))
            }
        };
        let merged = match base {
            Some(b) => b.overlay(raw),
            None => raw,
        };
        merged.build(file, text)
    }

    /// This cluster sized for a job of `world` ranks: nodes default to
    /// `ceil(world / gpus_per_node)`; a cluster with fewer GPUs than `world` is an error.
    pub fn fit(&self, world: u64) -> Result<Cluster, SimError> {
        let mut c = self.clone();
        match self.nodes {
            None => c.nodes = Some(world.div_ceil(self.gpus_per_node).max(1)),
            Some(n) => {
                let have = n.saturating_mul(self.gpus_per_node);
                if have < world {
                    return Err(SimError::new(format!(
                        "the cluster {} ({}) is too small for the layout: it has nodes·gpus_per_node = {}·{} = {have} GPUs, the layout needs {world}",
                        self.name, self.source, n, self.gpus_per_node
                    ))
                    .with_help(format!(
                        "use at least {} nodes, or a layout with fewer ranks",
                        world.div_ceil(self.gpus_per_node)
                    )));
                }
            }
        }
        Ok(c)
    }

    /// Total GPUs (after [`Cluster::fit`]; `gpus_per_node` before), saturating at
    /// `u64::MAX`.
    pub fn gpus(&self) -> u64 {
        self.nodes.unwrap_or(1).saturating_mul(self.gpus_per_node)
    }

    /// One line for people: `h100-sxm: 16 × 8 NVIDIA H100 SXM5 80GB (80 GiB, 989 TFLOP/s bf16)`.
    pub fn describe(&self) -> String {
        format!(
            "{} ({}): {} node(s) × {} {} ({:.0} GiB, {:.0} TFLOP/s bf16, NVLink {:.0} GB/s, network {:.0} GB/s per GPU)",
            self.name,
            self.source,
            self.nodes.map_or("?".to_string(), |n| n.to_string()),
            self.gpus_per_node,
            self.device.name,
            self.device.memory_bytes / GIB,
            self.device.peak("bf16") / 1e12,
            self.intra_node.bytes_per_s / 1e9,
            self.inter_node.bytes_per_s / 1e9
        )
    }
}

/// Bytes in a GiB.
pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

fn preset_help() -> String {
    let names: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
    format!("presets: {}", names.join(", "))
}

// ---- The file format, as read (every key optional so that a preset can fill it in).

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    preset: Option<Spanned<String>>,
    name: Option<String>,
    nodes: Option<Spanned<i64>>,
    gpus_per_node: Option<Spanned<i64>>,
    device: Option<RawDevice>,
    intra_node: Option<RawLink>,
    inter_node: Option<RawLink>,
    cost: Option<RawCost>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDevice {
    name: Option<String>,
    memory_gib: Option<Spanned<f64>>,
    hbm_tb_per_s: Option<Spanned<f64>>,
    peak_tflops: Option<BTreeMap<Spanned<String>, Spanned<f64>>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLink {
    gb_per_s: Option<Spanned<f64>>,
    latency_us: Option<Spanned<f64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawCost {
    gemm_efficiency: Option<Spanned<f64>>,
    gemm_half_k: Option<Spanned<f64>>,
    gemm_fill_elements: Option<Spanned<f64>>,
    attention_fwd_efficiency: Option<Spanned<f64>>,
    attention_bwd_efficiency: Option<Spanned<f64>>,
    memory_efficiency: Option<Spanned<f64>>,
    kernel_overhead_us: Option<Spanned<f64>>,
    link_efficiency: Option<Spanned<f64>>,
    tp_comm_overlap: Option<Spanned<f64>>,
    dp_comm_overlap: Option<bool>,
    pp_comm_overlap: Option<bool>,
    reserved_memory_gib: Option<Spanned<f64>>,
}

fn pick<T>(over: Option<T>, base: Option<T>) -> Option<T> {
    over.or(base)
}

impl RawCluster {
    /// `self` (a preset) with every key `over` sets replaced.
    fn overlay(self, over: RawCluster) -> RawCluster {
        RawCluster {
            preset: over.preset,
            name: pick(over.name, self.name),
            nodes: pick(over.nodes, self.nodes),
            gpus_per_node: pick(over.gpus_per_node, self.gpus_per_node),
            device: Some(match (self.device, over.device) {
                (Some(b), Some(o)) => RawDevice {
                    name: pick(o.name, b.name),
                    memory_gib: pick(o.memory_gib, b.memory_gib),
                    hbm_tb_per_s: pick(o.hbm_tb_per_s, b.hbm_tb_per_s),
                    peak_tflops: match (b.peak_tflops, o.peak_tflops) {
                        (Some(mut b), Some(o)) => {
                            for (k, v) in o {
                                b.remove(&k);
                                b.insert(k, v);
                            }
                            Some(b)
                        }
                        (b, o) => pick(o, b),
                    },
                },
                (b, o) => b.or(o).unwrap_or_default(),
            }),
            intra_node: Some(overlay_link(self.intra_node, over.intra_node)),
            inter_node: Some(overlay_link(self.inter_node, over.inter_node)),
            cost: over.cost.or(self.cost),
        }
    }

    fn build(self, file: &str, text: &str) -> Result<Cluster, SimError> {
        let missing = |key: &str| {
            SimError::in_file(file, format!("missing key `{key}`")).with_help(format!(
                "set it, or start from a preset with `preset = \"h100-sxm\"` ({})",
                preset_help()
            ))
        };
        let positive = |v: &Spanned<f64>, key: &str| -> Result<f64, SimError> {
            let x = *v.get_ref();
            if x.is_finite() && x > 0.0 {
                Ok(x)
            } else {
                Err(SimError::at(
                    file,
                    text,
                    v.span().start,
                    format!("{key} = {x} must be a positive number"),
                ))
            }
        };
        let count = |v: &Spanned<i64>, key: &str| -> Result<u64, SimError> {
            let x = *v.get_ref();
            if x >= 1 {
                Ok(x as u64)
            } else {
                Err(SimError::at(
                    file,
                    text,
                    v.span().start,
                    format!("{key} = {x} must be a positive integer"),
                ))
            }
        };
        let gpus_per_node = match &self.gpus_per_node {
            Some(v) => count(v, "gpus_per_node")?,
            None => return Err(missing("gpus_per_node")),
        };
        let nodes = match &self.nodes {
            Some(v) => {
                let n = count(v, "nodes")?;
                if n.checked_mul(gpus_per_node).is_none() {
                    return Err(SimError::at(
                        file,
                        text,
                        v.span().start,
                        format!(
                            "nodes = {n} with gpus_per_node = {gpus_per_node} is more GPUs \
                             than megac can count (2^64)"
                        ),
                    ));
                }
                Some(n)
            }
            None => None,
        };
        let dev = self.device.unwrap_or_default();
        let memory_gib = positive(
            dev.memory_gib
                .as_ref()
                .ok_or_else(|| missing("device.memory_gib"))?,
            "device.memory_gib",
        )?;
        let hbm = positive(
            dev.hbm_tb_per_s
                .as_ref()
                .ok_or_else(|| missing("device.hbm_tb_per_s"))?,
            "device.hbm_tb_per_s",
        )?;
        let mut peak_flops = BTreeMap::new();
        for (k, v) in dev.peak_tflops.unwrap_or_default() {
            if !DTYPES.contains(&k.get_ref().as_str()) {
                return Err(SimError::at(
                    file,
                    text,
                    k.span().start,
                    format!(
                        "unknown number format `{}` in [device.peak_tflops]",
                        k.get_ref()
                    ),
                )
                .with_help(format!("known formats: {}", DTYPES.join(", "))));
            }
            let key = format!("device.peak_tflops.{}", k.get_ref());
            peak_flops.insert(k.get_ref().clone(), positive(&v, &key)? * 1e12);
        }
        if !peak_flops.contains_key("bf16") && !peak_flops.contains_key("fp32") {
            return Err(missing("device.peak_tflops.bf16"));
        }
        let link = |l: Option<RawLink>, section: &str| -> Result<Link, SimError> {
            let l = l.unwrap_or_default();
            let bw = l
                .gb_per_s
                .as_ref()
                .ok_or_else(|| missing(&format!("{section}.gb_per_s")))?;
            let lat = l
                .latency_us
                .as_ref()
                .ok_or_else(|| missing(&format!("{section}.latency_us")))?;
            let latency = *lat.get_ref();
            if !(latency.is_finite() && latency >= 0.0) {
                return Err(SimError::at(
                    file,
                    text,
                    lat.span().start,
                    format!("{section}.latency_us = {latency} must be a number ≥ 0"),
                ));
            }
            Ok(Link {
                bytes_per_s: positive(bw, &format!("{section}.gb_per_s"))? * 1e9,
                latency_s: latency / 1e6,
            })
        };
        let intra_node = link(self.intra_node, "intra_node")?;
        let inter_node = link(self.inter_node, "inter_node")?;
        let cost = build_cost(self.cost.unwrap_or_default(), file, text)?;
        let name = self.name.unwrap_or_else(|| {
            std::path::Path::new(file)
                .file_stem()
                .map_or("cluster".into(), |s| s.to_string_lossy().into_owned())
        });
        Ok(Cluster {
            name,
            source: file.to_string(),
            device: Device {
                name: dev.name.unwrap_or_else(|| "accelerator".into()),
                peak_flops,
                memory_bytes: memory_gib * GIB,
                hbm_bytes_per_s: hbm * 1e12,
            },
            gpus_per_node,
            nodes,
            intra_node,
            inter_node,
            cost,
        })
    }
}

fn overlay_link(base: Option<RawLink>, over: Option<RawLink>) -> RawLink {
    let (b, o) = (base.unwrap_or_default(), over.unwrap_or_default());
    RawLink {
        gb_per_s: pick(o.gb_per_s, b.gb_per_s),
        latency_us: pick(o.latency_us, b.latency_us),
    }
}

/// Whether 0 itself is allowed for a `[cost]` key.
#[derive(Clone, Copy, PartialEq)]
enum Zero {
    Allowed,
    Excluded,
}

fn build_cost(raw: RawCost, file: &str, text: &str) -> Result<CostParams, SimError> {
    let mut c = CostParams::default();
    let set = |v: &Option<Spanned<f64>>,
               key: &str,
               zero: Zero,
               hi: f64,
               slot: &mut f64|
     -> Result<(), SimError> {
        if let Some(v) = v {
            let x = *v.get_ref();
            let low_ok = match zero {
                Zero::Allowed => x >= 0.0,
                Zero::Excluded => x > 0.0,
            };
            if !(x.is_finite() && low_ok && x <= hi) {
                let open = if zero == Zero::Allowed { "[" } else { "(" };
                return Err(SimError::at(
                    file,
                    text,
                    v.span().start,
                    format!("cost.{key} = {x} is out of range"),
                )
                .with_help(format!("cost.{key} must be in {open}0, {hi}]")));
            }
            *slot = x;
        }
        Ok(())
    };
    use Zero::{Allowed, Excluded};
    set(
        &raw.gemm_efficiency,
        "gemm_efficiency",
        Excluded,
        1.0,
        &mut c.gemm_efficiency,
    )?;
    set(
        &raw.gemm_half_k,
        "gemm_half_k",
        Allowed,
        1e9,
        &mut c.gemm_half_k,
    )?;
    set(
        &raw.gemm_fill_elements,
        "gemm_fill_elements",
        Allowed,
        1e12,
        &mut c.gemm_fill_elements,
    )?;
    set(
        &raw.attention_fwd_efficiency,
        "attention_fwd_efficiency",
        Excluded,
        1.0,
        &mut c.attention_fwd_efficiency,
    )?;
    set(
        &raw.attention_bwd_efficiency,
        "attention_bwd_efficiency",
        Excluded,
        1.0,
        &mut c.attention_bwd_efficiency,
    )?;
    set(
        &raw.memory_efficiency,
        "memory_efficiency",
        Excluded,
        1.0,
        &mut c.memory_efficiency,
    )?;
    set(
        &raw.kernel_overhead_us,
        "kernel_overhead_us",
        Allowed,
        1e6,
        &mut c.kernel_overhead_us,
    )?;
    set(
        &raw.link_efficiency,
        "link_efficiency",
        Excluded,
        1.0,
        &mut c.link_efficiency,
    )?;
    set(
        &raw.tp_comm_overlap,
        "tp_comm_overlap",
        Allowed,
        1.0,
        &mut c.tp_comm_overlap,
    )?;
    set(
        &raw.reserved_memory_gib,
        "reserved_memory_gib",
        Allowed,
        1e6,
        &mut c.reserved_memory_gib,
    )?;
    if let Some(b) = raw.dp_comm_overlap {
        c.dp_comm_overlap = b;
    }
    if let Some(b) = raw.pp_comm_overlap {
        c.pp_comm_overlap = b;
    }
    Ok(c)
}
