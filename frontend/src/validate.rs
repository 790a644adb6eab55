//! Cross-key validation: the rules a user would otherwise learn from a crash deep in a run
//! (the checklist of ../shared/reference/megatron-lm.md §12). The rules themselves live in
//! one home, `megac_ir::rules::check` (the layout search filters on the same function);
//! this module renders the first violated rule: it points at the key most likely to be
//! wrong, names the values involved (marking defaults) and says what would be valid.

use megac_ir::rules::{self, divisors, valid_cp, valid_ep, valid_tp, Violation};
use megac_ir::spec::ModelSpec;

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

fn list(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
}

/// Check the rules that involve more than one key; the first broken one is the error.
pub fn validate(file: &str, spec: &ModelSpec, origins: &Origins) -> Result<(), SpecError> {
    let c = Checker { file, origins };
    match rules::check(spec).first() {
        None => Ok(()),
        Some(v) => {
            let (message, help) = render(&c, spec, v);
            Err(c.err(v.key(), message, help))
        }
    }
}

/// The message and help of violation `v` of `spec`.
fn render(c: &Checker<'_>, spec: &ModelSpec, v: &Violation) -> (String, String) {
    match *v {
        // Model shape.
        Violation::HiddenNotDivisibleByHeads { hidden, heads } => (
            format!(
                "{} is not divisible by {}",
                c.show("model.hidden", hidden),
                c.show("model.heads", heads)
            ),
            format!(
                "the head size is hidden / heads; valid head counts for hidden {}: {}",
                hidden,
                list(&divisors(hidden))
            ),
        ),
        Violation::KvHeadsNotDividingHeads { kv_heads, heads } => (
            format!(
                "{} does not divide {}",
                c.show("model.kv_heads", kv_heads),
                c.show("model.heads", heads)
            ),
            format!(
                "each key/value head serves heads / kv_heads query heads; valid kv_heads: {}",
                list(&divisors(heads))
            ),
        ),
        Violation::GptGroupedQuery { kv_heads, heads } => (
            format!(
                "{} but arch = \"gpt\" (GPT2LMHeadModel) has no grouped-query attention",
                c.show("model.kv_heads", kv_heads)
            ),
            format!("remove kv_heads or set it to heads = {heads}"),
        ),
        Violation::OddRopeHeadDim {
            head_dim,
            hidden,
            heads,
        } if head_dim * heads == hidden => (
            format!(
                "head size {head_dim} (= hidden {hidden} / heads {heads}) is odd, but RoPE rotates pairs of dims"
            ),
            "choose hidden and heads so that hidden / heads is even".into(),
        ),
        Violation::OddRopeHeadDim { head_dim, .. } => (
            format!(
                "{} is odd, but RoPE rotates pairs of dims",
                c.show("model.head_dim", head_dim)
            ),
            "use an even head_dim".into(),
        ),
        Violation::GptHeadDim {
            head_dim,
            hidden,
            heads,
        } => (
            format!(
                "{} differs from hidden {hidden} / heads {heads}, but arch = \"gpt\" (GPT2LMHeadModel) derives the head size",
                c.show("model.head_dim", head_dim)
            ),
            format!("remove head_dim or set it to {}", hidden / heads),
        ),
        Violation::KeyNeedsArch { key, needs, arch } => (
            format!(
                "model.{key} is set, but {} ({}) has no such option",
                c.show("model.arch", format!("\"{arch}\"")),
                arch.hf_class(spec.model.moe.is_some())
            ),
            format!(
                "{key} belongs to arch = \"{needs}\" ({}); remove it or change the arch",
                needs.hf_class(false)
            ),
        ),
        Violation::RopeScalingWithoutRope { arch } => (
            format!(
                "[model.rope_scaling] is set, but {} has learned positions, not RoPE",
                c.show("model.arch", format!("\"{arch}\""))
            ),
            "remove [model.rope_scaling]".into(),
        ),
        Violation::RopeScalingInvalid { ref problem } => (
            format!("[model.rope_scaling]: {problem}"),
            "llama3 needs factor, low_freq_factor < high_freq_factor and original_max_position_embeddings, all positive (Llama 3.1: 8, 1, 4, 8192)".into(),
        ),
        Violation::MoeNeedsLlama { arch } => (
            format!(
                "[model.moe] needs arch = \"llama\" (Mixtral) or \"qwen2_moe\", but {}",
                c.show("model.arch", format!("\"{arch}\""))
            ),
            "set model.arch = \"llama\" or \"qwen2_moe\", or remove [model.moe]".into(),
        ),
        Violation::Qwen2MoeNeedsMoe => (
            format!(
                "{} (Qwen2MoeForCausalLM) needs [model.moe]",
                c.show("model.arch", "\"qwen2_moe\"")
            ),
            "add [model.moe] (experts, top_k, shared_ffn_hidden) or use arch = \"qwen2\"".into(),
        ),
        Violation::MoeKeyVsArch {
            key,
            ref value,
            arch,
            why,
            help,
        } => (
            format!(
                "{} asks for {why}, but {} ({}) has no such option",
                c.show(&format!("model.moe.{key}"), value),
                c.show("model.arch", format!("\"{arch}\"")),
                arch.hf_class(true)
            ),
            help.into(),
        ),
        Violation::TpNotDividingExpertFfn { tp, key, value } => (
            format!(
                "{} does not divide {}",
                c.show("parallel.tp", tp),
                c.show(&format!("model.moe.{key}"), value)
            ),
            format!("tp splits every expert's intermediate size: use a tp dividing {value}"),
        ),
        Violation::FirstDenseLayersTooMany { first, layers } => (
            format!(
                "{} leaves no MoE layer of {}",
                c.show("model.moe.first_dense_layers", first),
                c.show("model.layers", layers)
            ),
            format!("first_dense_layers must be below {layers}"),
        ),
        Violation::TopKExceedsExperts { top_k, experts } => (
            format!(
                "{} exceeds {}",
                c.show("model.moe.top_k", top_k),
                c.show("model.moe.experts", experts)
            ),
            format!("top_k must be between 1 and {experts}"),
        ),
        Violation::LayerFreqExceedsLayers { layer_freq, layers } => (
            format!(
                "{} exceeds {}",
                c.show("model.moe.layer_freq", layer_freq),
                c.show("model.layers", layers)
            ),
            format!("layer_freq must be between 1 and {layers}"),
        ),

        // Tensor parallelism.
        Violation::TpNotDividingHeads { tp, heads } => (
            format!(
                "{} does not divide {}",
                c.show("parallel.tp", tp),
                c.show("model.heads", heads)
            ),
            format!("valid tp for this model: {}", list(&valid_tp(spec))),
        ),
        Violation::TpVersusKvHeads { tp, kv_heads } => (
            format!(
                "{} neither divides nor is a multiple of {}",
                c.show("parallel.tp", tp),
                c.show("model.kv_heads", kv_heads)
            ),
            format!(
                "kv heads are split over tp, or replicated when tp is a multiple of them; valid tp for this model: {}",
                list(&valid_tp(spec))
            ),
        ),
        Violation::TpNotDividingFfn { tp, ffn_hidden } => (
            format!(
                "{} does not divide {}",
                c.show("parallel.tp", tp),
                c.show("model.ffn_hidden", ffn_hidden)
            ),
            format!("valid tp for this model: {}", list(&valid_tp(spec))),
        ),

        // Pipeline parallelism.
        Violation::StageLayersCount { given, pp, vpp } => (
            format!(
                "parallel.stage_layers lists {given} chunk{} but pp·vpp = {}·{} = {}",
                if given == 1 { "" } else { "s" },
                pp,
                vpp,
                pp * vpp
            ),
            "give one layer count per pipeline chunk, in chunk order".into(),
        ),
        Violation::StageLayersSum { sum, layers } => (
            format!(
                "parallel.stage_layers adds up to {sum} layers but {}",
                c.show("model.layers", layers)
            ),
            "the chunks together hold every layer exactly once".into(),
        ),
        Violation::TooFewLayersToBalance { layers, pp, vpp } => (
            format!(
                "{} cannot fill pp·vpp = {}·{} = {} pipeline chunks",
                c.show("model.layers", layers),
                pp,
                vpp,
                pp * vpp
            ),
            "every chunk holds at least one layer: lower pp or vpp".into(),
        ),
        Violation::LayersNotDivisibleByChunks { layers, pp, vpp } => {
            let pps: Vec<u64> = divisors(layers)
                .into_iter()
                .filter(|d| d % vpp == 0)
                .map(|d| d / vpp)
                .filter(|&pp| vpp == 1 || pp >= 2)
                .collect();
            let vpps: Vec<u64> = if layers.is_multiple_of(pp) {
                divisors(layers / pp)
            } else {
                Vec::new()
            };
            let mut options = Vec::new();
            if !pps.is_empty() {
                options.push(format!("with vpp = {} valid pp: {}", vpp, list(&pps)));
            }
            if vpp > 1 && !vpps.is_empty() {
                options.push(format!("with pp = {} valid vpp: {}", pp, list(&vpps)));
            }
            if options.is_empty() {
                options.push(format!("pp·vpp must divide {layers}"));
            }
            (
                format!(
                    "{} is not divisible by pp·vpp = {}·{} = {}",
                    c.show("model.layers", layers),
                    pp,
                    vpp,
                    pp * vpp
                ),
                format!(
                    "every pipeline chunk holds the same number of layers unless parallel.stage_layers lists them (or is \"balanced\"); {}",
                    options.join("; ")
                ),
            )
        }
        Violation::VppWithoutPp { vpp, pp } => (
            format!(
                "{} needs pipeline parallelism, but {}",
                c.show("parallel.vpp", vpp),
                c.show("parallel.pp", pp)
            ),
            "virtual pipeline chunks interleave over pipeline ranks: set pp >= 2 or vpp = 1".into(),
        ),
        Violation::InterleavedWithoutVpp { vpp } => (
            format!(
                "{} needs vpp > 1, but {}",
                c.show("parallel.schedule", "\"interleaved\""),
                c.show("parallel.vpp", vpp)
            ),
            "set parallel.vpp to 2 or more, or use schedule = \"1f1b\"".into(),
        ),
        Violation::ScheduleWithoutVirtualChunks { schedule, vpp } => (
            format!(
                "{} does not run virtual pipeline chunks ({})",
                c.show("parallel.schedule", format!("\"{}\"", schedule.as_str())),
                c.show("parallel.vpp", vpp)
            ),
            "with vpp > 1 use schedule = \"interleaved\" or \"dpp\"".into(),
        ),

        // Batch.
        Violation::GlobalBatchNotDivisible {
            global_batch,
            micro_batch,
            dp,
        } => {
            let per_step = micro_batch * dp;
            let valid: Vec<u64> = (1..=4).map(|k| k * per_step).collect();
            (
                format!(
                    "{} is not divisible by micro_batch·dp = {}·{} = {per_step}",
                    c.show("train.global_batch", global_batch),
                    micro_batch,
                    dp
                ),
                format!(
                    "each data-parallel rank runs global_batch / (micro_batch·dp) micro-batches; valid global_batch: {}, ...",
                    list(&valid)
                ),
            )
        }
        Violation::InterleavedMicrobatches {
            microbatches,
            global_batch,
            micro_batch,
            dp,
            pp,
            ordered,
        } => (
            format!(
                "{}: {microbatches} micro-batches per step (global_batch {global_batch} / (micro_batch {micro_batch} · dp {dp})) is not a multiple of pp = {pp}",
                if ordered {
                    "dpp_policy ordered (interleaved's order)"
                } else {
                    "interleaved schedule"
                }
            ),
            format!(
                "Megatron runs interleaved micro-batches in groups of pp; use a global_batch that is a multiple of {}",
                (micro_batch * dp).saturating_mul(pp)
            ),
        ),

        // Sequence and context parallelism.
        Violation::SeqLenVersusCpTp { seq_len, cp, tp } => (
            format!(
                "{} is not divisible by 2·cp·tp = 2·{}·{} = {}",
                c.show("model.seq_len", seq_len),
                cp,
                tp,
                2 * cp * tp
            ),
            format!(
                "context parallelism splits the sequence in 2·cp chunks and sequence parallelism splits each over tp; use a seq_len that is a multiple of {}",
                2 * cp * tp
            ),
        ),
        Violation::SeqLenVersusTp { seq_len, tp } => (
            format!(
                "{} is not divisible by {} (sequence_parallel = true)",
                c.show("model.seq_len", seq_len),
                c.show("parallel.tp", tp)
            ),
            "sequence parallelism splits the sequence over tp; use a multiple of tp or set sequence_parallel = false".into(),
        ),
        Violation::SeqLenVersusCp { seq_len, cp } => (
            format!(
                "{} is not divisible by 2·cp = 2·{} = {}",
                c.show("model.seq_len", seq_len),
                cp,
                2 * cp
            ),
            format!(
                "context parallelism splits the sequence in 2·cp chunks for causal load balance; valid cp for seq_len {}: {}",
                seq_len,
                list(&valid_cp(seq_len))
            ),
        ),

        // Expert parallelism.
        Violation::EpWithoutMoe { ep } => (
            format!("{} but the model has no [model.moe]", c.show("parallel.ep", ep)),
            "expert parallelism needs experts: add [model.moe] or set ep = 1".into(),
        ),
        Violation::EpNotDividingExperts {
            ep,
            experts,
            dp,
            cp,
        } => (
            format!(
                "{} does not divide {}",
                c.show("parallel.ep", ep),
                c.show("model.moe.experts", experts)
            ),
            format!(
                "experts are split evenly over ep, and ep folds over dp·cp = {}; valid ep: {}",
                dp * cp,
                list(&valid_ep(experts, dp, cp))
            ),
        ),
        Violation::EpNotDividingDpCp {
            ep,
            experts,
            dp,
            cp,
        } => (
            format!(
                "{} does not divide dp·cp = {}·{} = {}",
                c.show("parallel.ep", ep),
                dp,
                cp,
                dp * cp
            ),
            format!(
                "expert parallelism folds over the data-parallel ranks (as in Megatron); valid ep: {}",
                list(&valid_ep(experts, dp, cp))
            ),
        ),
        Violation::CapacityFactorWithCp {
            capacity_factor,
            cp,
        } => (
            format!(
                "{} with {}",
                c.show("model.moe.capacity_factor", capacity_factor),
                c.show("parallel.cp", cp)
            ),
            "token dropping keeps the first tokens of a micro-batch, which context parallelism splits over ranks; use a dropless MoE (capacity_factor = 0) with cp, or cp = 1".into(),
        ),
        Violation::MoeTpWithoutSp { tp } => (
            format!(
                "MoE with {} needs sequence_parallel = true",
                c.show("parallel.tp", tp)
            ),
            "Megatron requires sequence parallelism for tensor-parallel MoE layers; set parallel.sequence_parallel = true".into(),
        ),

        // Cluster.
        Violation::ClusterTooSmall {
            need,
            tp,
            pp,
            dp,
            cp,
            fbd,
            nodes,
            gpus_per_node,
        } => (
            format!(
                "the layout needs {need} ranks (tp·pp·dp·cp = {}·{}·{}·{}{}) but the cluster has nodes·gpus_per_node = {}·{} = {}",
                tp,
                pp,
                dp,
                cp,
                if fbd { ", ×2 for FBD roles" } else { "" },
                nodes,
                gpus_per_node,
                nodes.saturating_mul(gpus_per_node)
            ),
            format!(
                "use at least {} nodes, or a smaller layout",
                need.div_ceil(gpus_per_node)
            ),
        ),
    }
}
