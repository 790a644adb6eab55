//! Cross-key validation: the rules a user would otherwise learn from a crash deep in a run
//! (the checklist of ../shared/reference/megatron-lm.md §12). Each error points at the key
//! most likely to be wrong, names the values involved and says what would be valid.

use megac_ir::spec::{Arch, ModelSpec, Schedule};

use crate::error::{Origin, SpecError};
use crate::schema::Origins;

struct Checker<'a> {
    file: &'a str,
    origins: &'a Origins,
}

impl Checker<'_> {
    /// Where `key` was written; for a default, where its section was (`[cluster]`).
    fn at(&self, key: &str) -> Origin {
        let mut key = key;
        loop {
            if let Some(o) = self.origins.get(key) {
                return o.clone();
            }
            match key.rsplit_once('.') {
                Some((parent, _)) => key = parent,
                None => return Origin::Default,
            }
        }
    }

    fn err(&self, key: &str, message: String, help: String) -> SpecError {
        SpecError::new(self.file, self.at(key), message).with_help(help)
    }

    /// The value of `key` as the user sees it, marking defaults.
    fn show(&self, key: &str, value: impl std::fmt::Display) -> String {
        match self.origins.get(key) {
            Some(_) => format!("{key} = {value}"),
            None => format!("{key} = {value} (default)"),
        }
    }
}

/// The divisors of `n` in increasing order (in O(√n): sizes go up to 10⁹).
fn divisors(n: u64) -> Vec<u64> {
    let (mut low, mut high) = (Vec::new(), Vec::new());
    let mut d = 1;
    while d * d <= n {
        if n.is_multiple_of(d) {
            low.push(d);
            if d * d != n {
                high.push(n / d);
            }
        }
        d += 1;
    }
    low.extend(high.into_iter().rev());
    low
}

fn list(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
}

/// Valid tensor-parallel sizes for the model (heads, kv_heads, ffn_hidden and experts' ffn).
fn valid_tp(spec: &ModelSpec) -> Vec<u64> {
    let m = &spec.model;
    divisors(m.heads)
        .into_iter()
        .filter(|&tp| {
            (m.kv_heads.is_multiple_of(tp) || tp % m.kv_heads == 0)
                && m.ffn_hidden.is_multiple_of(tp)
        })
        .collect()
}

/// Check the rules that involve more than one key.
pub fn validate(file: &str, spec: &ModelSpec, origins: &Origins) -> Result<(), SpecError> {
    let c = Checker { file, origins };
    let m = &spec.model;
    let p = &spec.parallel;
    let t = &spec.train;

    // Model shape.
    if !m.hidden.is_multiple_of(m.heads) {
        return Err(c.err(
            "model.hidden",
            format!(
                "{} is not divisible by {}",
                c.show("model.hidden", m.hidden),
                c.show("model.heads", m.heads)
            ),
            format!(
                "the head size is hidden / heads; valid head counts for hidden {}: {}",
                m.hidden,
                list(&divisors(m.hidden))
            ),
        ));
    }
    if !m.heads.is_multiple_of(m.kv_heads) {
        return Err(c.err(
            "model.kv_heads",
            format!(
                "{} does not divide {}",
                c.show("model.kv_heads", m.kv_heads),
                c.show("model.heads", m.heads)
            ),
            format!(
                "each key/value head serves heads / kv_heads query heads; valid kv_heads: {}",
                list(&divisors(m.heads))
            ),
        ));
    }
    if m.arch == Arch::Gpt && m.kv_heads != m.heads {
        return Err(c.err(
            "model.kv_heads",
            format!(
                "{} but arch = \"gpt\" (GPT2LMHeadModel) has no grouped-query attention",
                c.show("model.kv_heads", m.kv_heads)
            ),
            format!("remove kv_heads or set it to heads = {}", m.heads),
        ));
    }
    if m.arch == Arch::Llama && !m.head_dim().is_multiple_of(2) {
        return Err(c.err(
            "model.hidden",
            format!(
                "head size {} (= hidden {} / heads {}) is odd, but RoPE rotates pairs of dims",
                m.head_dim(),
                m.hidden,
                m.heads
            ),
            "choose hidden and heads so that hidden / heads is even".into(),
        ));
    }
    if let Some(moe) = &m.moe {
        if m.arch != Arch::Llama {
            return Err(c.err(
                "model.moe",
                format!(
                    "[model.moe] needs arch = \"llama\" (Mixtral), but {}",
                    c.show("model.arch", format!("\"{}\"", m.arch))
                ),
                "set model.arch = \"llama\" or remove [model.moe]".into(),
            ));
        }
        if moe.top_k > moe.experts {
            return Err(c.err(
                "model.moe.top_k",
                format!(
                    "{} exceeds {}",
                    c.show("model.moe.top_k", moe.top_k),
                    c.show("model.moe.experts", moe.experts)
                ),
                format!("top_k must be between 1 and {}", moe.experts),
            ));
        }
        if moe.layer_freq > m.layers {
            return Err(c.err(
                "model.moe.layer_freq",
                format!(
                    "{} exceeds {}",
                    c.show("model.moe.layer_freq", moe.layer_freq),
                    c.show("model.layers", m.layers)
                ),
                format!("layer_freq must be between 1 and {}", m.layers),
            ));
        }
    }

    // Tensor parallelism.
    if !m.heads.is_multiple_of(p.tp) {
        return Err(c.err(
            "parallel.tp",
            format!(
                "{} does not divide {}",
                c.show("parallel.tp", p.tp),
                c.show("model.heads", m.heads)
            ),
            format!("valid tp for this model: {}", list(&valid_tp(spec))),
        ));
    }
    if !m.kv_heads.is_multiple_of(p.tp) && !p.tp.is_multiple_of(m.kv_heads) {
        return Err(c.err(
            "parallel.tp",
            format!(
                "{} neither divides nor is a multiple of {}",
                c.show("parallel.tp", p.tp),
                c.show("model.kv_heads", m.kv_heads)
            ),
            format!(
                "kv heads are split over tp, or replicated when tp is a multiple of them; valid tp for this model: {}",
                list(&valid_tp(spec))
            ),
        ));
    }
    if !m.ffn_hidden.is_multiple_of(p.tp) {
        return Err(c.err(
            "parallel.tp",
            format!(
                "{} does not divide {}",
                c.show("parallel.tp", p.tp),
                c.show("model.ffn_hidden", m.ffn_hidden)
            ),
            format!("valid tp for this model: {}", list(&valid_tp(spec))),
        ));
    }

    // Pipeline parallelism.
    let chunks = p.pp * p.vpp;
    if !p.stage_layers.is_empty() {
        let given = p.stage_layers.len() as u64;
        let sum: u64 = p.stage_layers.iter().sum();
        if given != chunks {
            return Err(c.err(
                "parallel.stage_layers",
                format!(
                    "parallel.stage_layers lists {given} chunk{} but pp·vpp = {}·{} = {chunks}",
                    if given == 1 { "" } else { "s" },
                    p.pp,
                    p.vpp
                ),
                "give one layer count per pipeline chunk, in chunk order".into(),
            ));
        }
        if sum != m.layers {
            return Err(c.err(
                "parallel.stage_layers",
                format!(
                    "parallel.stage_layers adds up to {sum} layers but {}",
                    c.show("model.layers", m.layers)
                ),
                "the chunks together hold every layer exactly once".into(),
            ));
        }
    } else if p.balance_stages {
        if m.layers < chunks {
            return Err(c.err(
                "parallel.stage_layers",
                format!(
                    "{} cannot fill pp·vpp = {}·{} = {chunks} pipeline chunks",
                    c.show("model.layers", m.layers),
                    p.pp,
                    p.vpp
                ),
                "every chunk holds at least one layer: lower pp or vpp".into(),
            ));
        }
    } else if !m.layers.is_multiple_of(chunks) {
        let key = if p.vpp > 1 {
            "parallel.vpp"
        } else {
            "parallel.pp"
        };
        let pps: Vec<u64> = divisors(m.layers)
            .into_iter()
            .filter(|d| d % p.vpp == 0)
            .map(|d| d / p.vpp)
            .filter(|&pp| p.vpp == 1 || pp >= 2)
            .collect();
        let vpps: Vec<u64> = if m.layers.is_multiple_of(p.pp) {
            divisors(m.layers / p.pp)
        } else {
            Vec::new()
        };
        let mut options = Vec::new();
        if !pps.is_empty() {
            options.push(format!("with vpp = {} valid pp: {}", p.vpp, list(&pps)));
        }
        if p.vpp > 1 && !vpps.is_empty() {
            options.push(format!("with pp = {} valid vpp: {}", p.pp, list(&vpps)));
        }
        if options.is_empty() {
            options.push(format!("pp·vpp must divide {}", m.layers));
        }
        return Err(c.err(
            key,
            format!(
                "{} is not divisible by pp·vpp = {}·{} = {chunks}",
                c.show("model.layers", m.layers),
                p.pp,
                p.vpp
            ),
            format!(
                "every pipeline chunk holds the same number of layers unless parallel.stage_layers lists them (or is \"balanced\"); {}",
                options.join("; ")
            ),
        ));
    }
    if p.vpp > 1 && p.pp < 2 {
        return Err(c.err(
            "parallel.vpp",
            format!(
                "{} needs pipeline parallelism, but {}",
                c.show("parallel.vpp", p.vpp),
                c.show("parallel.pp", p.pp)
            ),
            "virtual pipeline chunks interleave over pipeline ranks: set pp >= 2 or vpp = 1".into(),
        ));
    }
    if p.schedule == Schedule::Interleaved && p.vpp < 2 {
        return Err(c.err(
            "parallel.schedule",
            format!(
                "{} needs vpp > 1, but {}",
                c.show("parallel.schedule", "\"interleaved\""),
                c.show("parallel.vpp", p.vpp)
            ),
            "set parallel.vpp to 2 or more, or use schedule = \"1f1b\"".into(),
        ));
    }
    if p.vpp > 1 && !matches!(p.schedule, Schedule::Interleaved | Schedule::Dpp) {
        return Err(c.err(
            "parallel.schedule",
            format!(
                "{} does not run virtual pipeline chunks ({})",
                c.show("parallel.schedule", format!("\"{}\"", p.schedule.as_str())),
                c.show("parallel.vpp", p.vpp)
            ),
            "with vpp > 1 use schedule = \"interleaved\" or \"dpp\"".into(),
        ));
    }

    // Batch.
    let per_step = t.micro_batch * p.dp;
    if !t.global_batch.is_multiple_of(per_step) {
        let valid: Vec<u64> = (1..=4).map(|k| k * per_step).collect();
        return Err(c.err(
            "train.global_batch",
            format!(
                "{} is not divisible by micro_batch·dp = {}·{} = {per_step}",
                c.show("train.global_batch", t.global_batch),
                t.micro_batch,
                p.dp
            ),
            format!(
                "each data-parallel rank runs global_batch / (micro_batch·dp) micro-batches; valid global_batch: {}, ...",
                list(&valid)
            ),
        ));
    }
    let microbatches = t.microbatches(p.dp);
    if p.schedule == Schedule::Interleaved && !microbatches.is_multiple_of(p.pp) {
        return Err(c.err(
            "train.global_batch",
            format!(
                "interleaved schedule: {microbatches} micro-batches per step (global_batch {} / (micro_batch {} · dp {})) is not a multiple of pp = {}",
                t.global_batch, t.micro_batch, p.dp, p.pp
            ),
            format!(
                "Megatron runs interleaved micro-batches in groups of pp; use a global_batch that is a multiple of {}",
                per_step.saturating_mul(p.pp)
            ),
        ));
    }

    // Sequence and context parallelism.
    let sp = p.sequence_parallel && p.tp > 1;
    if sp && p.cp > 1 && !m.seq_len.is_multiple_of(2 * p.cp * p.tp) {
        return Err(c.err(
            "model.seq_len",
            format!(
                "{} is not divisible by 2·cp·tp = 2·{}·{} = {}",
                c.show("model.seq_len", m.seq_len),
                p.cp,
                p.tp,
                2 * p.cp * p.tp
            ),
            format!(
                "context parallelism splits the sequence in 2·cp chunks and sequence parallelism splits each over tp; use a seq_len that is a multiple of {}",
                2 * p.cp * p.tp
            ),
        ));
    }
    if sp && !m.seq_len.is_multiple_of(p.tp) {
        return Err(c.err(
            "model.seq_len",
            format!(
                "{} is not divisible by {} (sequence_parallel = true)",
                c.show("model.seq_len", m.seq_len),
                c.show("parallel.tp", p.tp)
            ),
            "sequence parallelism splits the sequence over tp; use a multiple of tp or set sequence_parallel = false".into(),
        ));
    }
    if p.cp > 1 && !m.seq_len.is_multiple_of(2 * p.cp) {
        return Err(c.err(
            "parallel.cp",
            format!(
                "{} is not divisible by 2·cp = 2·{} = {}",
                c.show("model.seq_len", m.seq_len),
                p.cp,
                2 * p.cp
            ),
            format!(
                "context parallelism splits the sequence in 2·cp chunks for causal load balance; valid cp for seq_len {}: {}",
                m.seq_len,
                list(&divisors(m.seq_len).into_iter().filter(|cp| m.seq_len.is_multiple_of(2 * cp) || *cp == 1).collect::<Vec<_>>())
            ),
        ));
    }

    // Expert parallelism.
    match &m.moe {
        None if p.ep > 1 => {
            return Err(c.err(
                "parallel.ep",
                format!(
                    "{} but the model has no [model.moe]",
                    c.show("parallel.ep", p.ep)
                ),
                "expert parallelism needs experts: add [model.moe] or set ep = 1".into(),
            ))
        }
        None => {}
        Some(moe) => {
            let valid_ep: Vec<u64> = divisors(p.dp * p.cp)
                .into_iter()
                .filter(|e| moe.experts % e == 0)
                .collect();
            if moe.experts % p.ep != 0 {
                return Err(c.err(
                    "parallel.ep",
                    format!(
                        "{} does not divide {}",
                        c.show("parallel.ep", p.ep),
                        c.show("model.moe.experts", moe.experts)
                    ),
                    format!(
                        "experts are split evenly over ep, and ep folds over dp·cp = {}; valid ep: {}",
                        p.dp * p.cp,
                        list(&valid_ep)
                    ),
                ));
            }
            if !(p.dp * p.cp).is_multiple_of(p.ep) {
                return Err(c.err(
                    "parallel.ep",
                    format!(
                        "{} does not divide dp·cp = {}·{} = {}",
                        c.show("parallel.ep", p.ep),
                        p.dp,
                        p.cp,
                        p.dp * p.cp
                    ),
                    format!(
                        "expert parallelism folds over the data-parallel ranks (as in Megatron); valid ep: {}",
                        list(&valid_ep)
                    ),
                ));
            }
            if p.cp > 1 && moe.capacity_factor > 0.0 {
                return Err(c.err(
                    "model.moe.capacity_factor",
                    format!(
                        "{} with {}",
                        c.show("model.moe.capacity_factor", moe.capacity_factor),
                        c.show("parallel.cp", p.cp)
                    ),
                    "token dropping keeps the first tokens of a micro-batch, which context parallelism splits over ranks; use a dropless MoE (capacity_factor = 0) with cp, or cp = 1".into(),
                ));
            }
            if p.tp > 1 && !p.sequence_parallel {
                return Err(c.err(
                    "parallel.sequence_parallel",
                    format!(
                        "MoE with {} needs sequence_parallel = true",
                        c.show("parallel.tp", p.tp)
                    ),
                    "Megatron requires sequence parallelism for tensor-parallel MoE layers; set parallel.sequence_parallel = true".into(),
                ));
            }
        }
    }

    // Cluster.
    if let Some(cl) = &spec.cluster {
        let have = cl.nodes.saturating_mul(cl.gpus_per_node);
        // world_size() without overflow: each factor is at most MAX_SIZE.
        let need = [p.tp, p.pp, p.dp, p.cp, if p.fbd { 2 } else { 1 }]
            .into_iter()
            .fold(1u64, u64::saturating_mul);
        if need > have {
            return Err(c.err(
                "cluster.nodes",
                format!(
                    "the layout needs {need} ranks (tp·pp·dp·cp = {}·{}·{}·{}{}) but the cluster has nodes·gpus_per_node = {}·{} = {have}",
                    p.tp,
                    p.pp,
                    p.dp,
                    p.cp,
                    if p.fbd { ", ×2 for FBD roles" } else { "" },
                    cl.nodes,
                    cl.gpus_per_node
                ),
                format!(
                    "use at least {} nodes, or a smaller layout",
                    need.div_ceil(cl.gpus_per_node)
                ),
            ));
        }
    }
    Ok(())
}
