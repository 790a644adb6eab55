//! Layout validity: the one home of model.toml's cross-key rules (model shape, tensor,
//! pipeline, data, sequence, context and expert parallelism, and the cluster's size).
//!
//! [`check`] returns every rule a [`ModelSpec`] breaks, each a typed [`Violation`] with the
//! values involved, in a fixed order (the order the frontend reports them in). The frontend
//! (`frontend/src/validate.rs`) renders the first with the location of its [`Violation::key`]
//! and a help line; the simulator's layout search (`sim/src/search.rs::enumerate`) keeps
//! only the layouts with none. [`divisors`] is the one factorisation both use.

use crate::spec::{Arch, ModelSpec, Schedule};

/// The divisors of `n` in increasing order (in O(√n): sizes go up to 10⁹).
pub fn divisors(n: u64) -> Vec<u64> {
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

/// One broken rule, with the values that break it.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Violation {
    /// `model.hidden` is not a multiple of `model.heads`.
    #[error("hidden {hidden} is not divisible by heads {heads}")]
    HiddenNotDivisibleByHeads {
        /// `model.hidden`.
        hidden: u64,
        /// `model.heads`.
        heads: u64,
    },
    /// `model.kv_heads` does not divide `model.heads`.
    #[error("kv_heads {kv_heads} does not divide heads {heads}")]
    KvHeadsNotDividingHeads {
        /// `model.kv_heads`.
        kv_heads: u64,
        /// `model.heads`.
        heads: u64,
    },
    /// GPT-2 has no grouped-query attention: `kv_heads` must equal `heads`.
    #[error(
        "kv_heads {kv_heads} differs from heads {heads}, but GPT has no grouped-query attention"
    )]
    GptGroupedQuery {
        /// `model.kv_heads`.
        kv_heads: u64,
        /// `model.heads`.
        heads: u64,
    },
    /// RoPE rotates pairs of dims: the head size must be even (llama).
    #[error(
        "head size {head_dim} (hidden {hidden} / heads {heads}) is odd, but RoPE rotates pairs"
    )]
    OddRopeHeadDim {
        /// `hidden / heads`.
        head_dim: u64,
        /// `model.hidden`.
        hidden: u64,
        /// `model.heads`.
        heads: u64,
    },
    /// GPT-2's head size is `hidden / heads` (its `c_attn` packs q, k, v of `hidden` each).
    #[error(
        "head_dim {head_dim} differs from hidden {hidden} / heads {heads}, but GPT-2 derives it"
    )]
    GptHeadDim {
        /// `model.head_dim`.
        head_dim: u64,
        /// `model.hidden`.
        hidden: u64,
        /// `model.heads`.
        heads: u64,
    },
    /// A key whose Hugging Face class exists only in another family (`qkv_bias` is
    /// Qwen2's, `qk_norm` Qwen3's, `sliding_window` Mistral's).
    #[error("model.{key} needs arch {needs}, not {arch}")]
    KeyNeedsArch {
        /// The key under `[model]`.
        key: &'static str,
        /// The family whose class has it.
        needs: Arch,
        /// `model.arch`.
        arch: Arch,
    },
    /// `[model.rope_scaling]` without RoPE (GPT-2 has learned positions).
    #[error("[model.rope_scaling] needs RoPE, but arch {arch} has learned positions")]
    RopeScalingWithoutRope {
        /// `model.arch`.
        arch: Arch,
    },
    /// `[model.rope_scaling]`'s parameters make no rewrite.
    #[error("{problem}")]
    RopeScalingInvalid {
        /// What is wrong.
        problem: String,
    },
    /// `[model.moe]` needs the llama (Mixtral) or qwen2_moe architecture.
    #[error("[model.moe] needs arch llama or qwen2_moe, not {arch}")]
    MoeNeedsLlama {
        /// `model.arch`.
        arch: Arch,
    },
    /// tp does not divide an expert's intermediate size (`model.moe.ffn_hidden` or
    /// `shared_ffn_hidden`).
    #[error("tp {tp} does not divide model.moe.{key} {value}")]
    TpNotDividingExpertFfn {
        /// `parallel.tp`.
        tp: u64,
        /// The key under `[model.moe]`.
        key: &'static str,
        /// Its value.
        value: u64,
    },
    /// `arch = "qwen2_moe"` without `[model.moe]`.
    #[error("arch qwen2_moe needs [model.moe]")]
    Qwen2MoeNeedsMoe,
    /// A `[model.moe]` key the family's Hugging Face class cannot express (a shared expert
    /// under Mixtral, an ungated one under Qwen2-MoE, ...).
    #[error("model.moe.{key} = {value}: {why}")]
    MoeKeyVsArch {
        /// The key under `[model.moe]`.
        key: &'static str,
        /// Its value, as text.
        value: String,
        /// `model.arch`.
        arch: Arch,
        /// Why the class cannot express it.
        why: &'static str,
        /// What to do instead.
        help: &'static str,
    },
    /// `model.moe.first_dense_layers` leaves no MoE layer.
    #[error("first_dense_layers {first} leaves no MoE layer of {layers}")]
    FirstDenseLayersTooMany {
        /// `model.moe.first_dense_layers`.
        first: u64,
        /// `model.layers`.
        layers: u64,
    },
    /// `model.moe.top_k` exceeds the expert count.
    #[error("top_k {top_k} exceeds experts {experts}")]
    TopKExceedsExperts {
        /// `model.moe.top_k`.
        top_k: u64,
        /// `model.moe.experts`.
        experts: u64,
    },
    /// `model.moe.layer_freq` exceeds the layer count.
    #[error("layer_freq {layer_freq} exceeds layers {layers}")]
    LayerFreqExceedsLayers {
        /// `model.moe.layer_freq`.
        layer_freq: u64,
        /// `model.layers`.
        layers: u64,
    },
    /// `parallel.tp` does not divide `model.heads`.
    #[error("tp {tp} does not divide heads {heads}")]
    TpNotDividingHeads {
        /// `parallel.tp`.
        tp: u64,
        /// `model.heads`.
        heads: u64,
    },
    /// `parallel.tp` neither divides nor is a multiple of `model.kv_heads`.
    #[error("tp {tp} neither divides nor is a multiple of kv_heads {kv_heads}")]
    TpVersusKvHeads {
        /// `parallel.tp`.
        tp: u64,
        /// `model.kv_heads`.
        kv_heads: u64,
    },
    /// `parallel.tp` does not divide `model.ffn_hidden`.
    #[error("tp {tp} does not divide ffn_hidden {ffn_hidden}")]
    TpNotDividingFfn {
        /// `parallel.tp`.
        tp: u64,
        /// `model.ffn_hidden`.
        ffn_hidden: u64,
    },
    /// `parallel.stage_layers` lists a count per chunk, but not `pp·vpp` of them.
    #[error("stage_layers lists {given} chunks but pp·vpp = {pp}·{vpp}")]
    StageLayersCount {
        /// Entries given.
        given: u64,
        /// `parallel.pp`.
        pp: u64,
        /// `parallel.vpp`.
        vpp: u64,
    },
    /// `parallel.stage_layers` does not add up to `model.layers`.
    #[error("stage_layers adds up to {sum} layers but layers = {layers}")]
    StageLayersSum {
        /// Their sum.
        sum: u64,
        /// `model.layers`.
        layers: u64,
    },
    /// A balanced split needs at least one layer per chunk.
    #[error("layers {layers} cannot fill pp·vpp = {pp}·{vpp} chunks")]
    TooFewLayersToBalance {
        /// `model.layers`.
        layers: u64,
        /// `parallel.pp`.
        pp: u64,
        /// `parallel.vpp`.
        vpp: u64,
    },
    /// The even split needs `pp·vpp` to divide `model.layers`.
    #[error("layers {layers} is not divisible by pp·vpp = {pp}·{vpp}")]
    LayersNotDivisibleByChunks {
        /// `model.layers`.
        layers: u64,
        /// `parallel.pp`.
        pp: u64,
        /// `parallel.vpp`.
        vpp: u64,
    },
    /// Virtual chunks need pipeline parallelism.
    #[error("vpp {vpp} needs pp >= 2, but pp = {pp}")]
    VppWithoutPp {
        /// `parallel.vpp`.
        vpp: u64,
        /// `parallel.pp`.
        pp: u64,
    },
    /// The interleaved schedule needs virtual chunks.
    #[error("the interleaved schedule needs vpp > 1, but vpp = {vpp}")]
    InterleavedWithoutVpp {
        /// `parallel.vpp`.
        vpp: u64,
    },
    /// Only interleaved and dpp run virtual chunks.
    #[error("schedule {} does not run virtual chunks (vpp = {vpp})", schedule.as_str())]
    ScheduleWithoutVirtualChunks {
        /// `parallel.schedule`.
        schedule: Schedule,
        /// `parallel.vpp`.
        vpp: u64,
    },
    /// `train.global_batch` is not a multiple of `micro_batch·dp`.
    #[error("global_batch {global_batch} is not divisible by micro_batch·dp = {micro_batch}·{dp}")]
    GlobalBatchNotDivisible {
        /// `train.global_batch`.
        global_batch: u64,
        /// `train.micro_batch`.
        micro_batch: u64,
        /// `parallel.dp`.
        dp: u64,
    },
    /// Interleaved micro-batches run in groups of pp (`interleaved`, and `dpp` with the
    /// `ordered` policy over virtual chunks, which runs interleaved's order).
    #[error("interleaved: {microbatches} micro-batches per step is not a multiple of pp = {pp}")]
    InterleavedMicrobatches {
        /// Micro-batches per step and data-parallel rank.
        microbatches: u64,
        /// `train.global_batch`.
        global_batch: u64,
        /// `train.micro_batch`.
        micro_batch: u64,
        /// `parallel.dp`.
        dp: u64,
        /// `parallel.pp`.
        pp: u64,
        /// Whether the schedule is `dpp` with the `ordered` policy (else `interleaved`).
        ordered: bool,
    },
    /// Context and sequence parallelism together split the sequence in `2·cp·tp` pieces.
    #[error("seq_len {seq_len} is not divisible by 2·cp·tp = 2·{cp}·{tp}")]
    SeqLenVersusCpTp {
        /// `model.seq_len`.
        seq_len: u64,
        /// `parallel.cp`.
        cp: u64,
        /// `parallel.tp`.
        tp: u64,
    },
    /// Sequence parallelism splits the sequence over tp.
    #[error("seq_len {seq_len} is not divisible by tp {tp} (sequence parallelism)")]
    SeqLenVersusTp {
        /// `model.seq_len`.
        seq_len: u64,
        /// `parallel.tp`.
        tp: u64,
    },
    /// Context parallelism splits the sequence in `2·cp` chunks.
    #[error("seq_len {seq_len} is not divisible by 2·cp = 2·{cp}")]
    SeqLenVersusCp {
        /// `model.seq_len`.
        seq_len: u64,
        /// `parallel.cp`.
        cp: u64,
    },
    /// Expert parallelism without experts.
    #[error("ep {ep} but the model has no experts")]
    EpWithoutMoe {
        /// `parallel.ep`.
        ep: u64,
    },
    /// `parallel.ep` does not divide the expert count.
    #[error("ep {ep} does not divide experts {experts}")]
    EpNotDividingExperts {
        /// `parallel.ep`.
        ep: u64,
        /// `model.moe.experts`.
        experts: u64,
        /// `parallel.dp` (ep folds over dp·cp).
        dp: u64,
        /// `parallel.cp`.
        cp: u64,
    },
    /// Expert parallelism folds over dp·cp.
    #[error("ep {ep} does not divide dp·cp = {dp}·{cp}")]
    EpNotDividingDpCp {
        /// `parallel.ep`.
        ep: u64,
        /// `model.moe.experts`.
        experts: u64,
        /// `parallel.dp`.
        dp: u64,
        /// `parallel.cp`.
        cp: u64,
    },
    /// Token dropping with context parallelism.
    #[error("capacity_factor {capacity_factor} with cp {cp}: token dropping needs cp = 1")]
    CapacityFactorWithCp {
        /// `model.moe.capacity_factor`.
        capacity_factor: f64,
        /// `parallel.cp`.
        cp: u64,
    },
    /// Tensor-parallel MoE needs sequence parallelism (as in Megatron).
    #[error("MoE with tp {tp} needs sequence parallelism")]
    MoeTpWithoutSp {
        /// `parallel.tp`.
        tp: u64,
    },
    /// The layout needs more ranks than `[cluster]` has.
    #[error("the layout needs {need} ranks but the cluster has {nodes}·{gpus_per_node}")]
    ClusterTooSmall {
        /// Ranks the layout needs (tp·pp·dp·cp, ×2 with FBD).
        need: u64,
        /// `parallel.tp`.
        tp: u64,
        /// `parallel.pp`.
        pp: u64,
        /// `parallel.dp`.
        dp: u64,
        /// `parallel.cp`.
        cp: u64,
        /// `parallel.fbd`.
        fbd: bool,
        /// `cluster.nodes`.
        nodes: u64,
        /// `cluster.gpus_per_node`.
        gpus_per_node: u64,
    },
}

impl Violation {
    /// The model.toml key most likely to be wrong (where the frontend points).
    pub fn key(&self) -> &'static str {
        use Violation::*;
        match self {
            HiddenNotDivisibleByHeads { .. } => "model.hidden",
            OddRopeHeadDim {
                head_dim,
                hidden,
                heads,
            } => {
                if head_dim * heads == *hidden {
                    "model.hidden"
                } else {
                    "model.head_dim"
                }
            }
            GptHeadDim { .. } => "model.head_dim",
            KeyNeedsArch { key, .. } => match *key {
                "qkv_bias" => "model.qkv_bias",
                "qk_norm" => "model.qk_norm",
                _ => "model.sliding_window",
            },
            RopeScalingWithoutRope { .. } | RopeScalingInvalid { .. } => "model.rope_scaling",
            KvHeadsNotDividingHeads { .. } | GptGroupedQuery { .. } => "model.kv_heads",
            MoeNeedsLlama { .. } => "model.moe",
            Qwen2MoeNeedsMoe => "model.arch",
            MoeKeyVsArch { key, .. } => match *key {
                "ffn_hidden" => "model.moe.ffn_hidden",
                "shared_ffn_hidden" => "model.moe.shared_ffn_hidden",
                "shared_expert_gate" => "model.moe.shared_expert_gate",
                "norm_topk_prob" => "model.moe.norm_topk_prob",
                "layer_freq" => "model.moe.layer_freq",
                _ => "model.moe.first_dense_layers",
            },
            FirstDenseLayersTooMany { .. } => "model.moe.first_dense_layers",
            TpNotDividingExpertFfn { .. } => "parallel.tp",
            TopKExceedsExperts { .. } => "model.moe.top_k",
            LayerFreqExceedsLayers { .. } => "model.moe.layer_freq",
            TpNotDividingHeads { .. } | TpVersusKvHeads { .. } | TpNotDividingFfn { .. } => {
                "parallel.tp"
            }
            StageLayersCount { .. } | StageLayersSum { .. } | TooFewLayersToBalance { .. } => {
                "parallel.stage_layers"
            }
            LayersNotDivisibleByChunks { vpp, .. } => {
                if *vpp > 1 {
                    "parallel.vpp"
                } else {
                    "parallel.pp"
                }
            }
            VppWithoutPp { .. } => "parallel.vpp",
            InterleavedWithoutVpp { .. } | ScheduleWithoutVirtualChunks { .. } => {
                "parallel.schedule"
            }
            GlobalBatchNotDivisible { .. } | InterleavedMicrobatches { .. } => "train.global_batch",
            SeqLenVersusCpTp { .. } | SeqLenVersusTp { .. } => "model.seq_len",
            SeqLenVersusCp { .. } => "parallel.cp",
            EpWithoutMoe { .. } | EpNotDividingExperts { .. } | EpNotDividingDpCp { .. } => {
                "parallel.ep"
            }
            CapacityFactorWithCp { .. } => "model.moe.capacity_factor",
            MoeTpWithoutSp { .. } => "parallel.sequence_parallel",
            ClusterTooSmall { .. } => "cluster.nodes",
        }
    }
}

/// Tensor-parallel sizes the model's shape allows (they divide heads and ffn_hidden, and
/// divide or are a multiple of kv_heads).
pub fn valid_tp(spec: &ModelSpec) -> Vec<u64> {
    let m = &spec.model;
    divisors(m.heads)
        .into_iter()
        .filter(|&tp| tp_fits(spec, tp))
        .collect()
}

/// Context-parallel sizes a sequence of `seq_len` allows (2·cp chunks, or no split).
pub fn valid_cp(seq_len: u64) -> Vec<u64> {
    divisors(seq_len)
        .into_iter()
        .filter(|&cp| cp == 1 || seq_len.is_multiple_of(2 * cp))
        .collect()
}

/// Expert-parallel sizes that divide both `experts` and dp·cp (ep folds over them).
pub fn valid_ep(experts: u64, dp: u64, cp: u64) -> Vec<u64> {
    divisors(dp.saturating_mul(cp))
        .into_iter()
        .filter(|&ep| experts.is_multiple_of(ep))
        .collect()
}

/// Whether kv_heads and ffn_hidden allow `tp` (heads is the caller's).
fn tp_fits(spec: &ModelSpec, tp: u64) -> bool {
    let m = &spec.model;
    (m.kv_heads.is_multiple_of(tp) || tp.is_multiple_of(m.kv_heads))
        && m.ffn_hidden.is_multiple_of(tp)
}

/// Every rule of model.toml that `spec` breaks, in the order the frontend reports them
/// (model shape, tp, pipeline, batch, sequence and context, experts, cluster); empty when
/// the spec is valid. Never panics, whatever the sizes.
pub fn check(spec: &ModelSpec) -> Vec<Violation> {
    use Violation::*;
    let m = &spec.model;
    let p = &spec.parallel;
    let t = &spec.train;
    let mut out = Vec::new();

    // Model shape. An explicit head size (other than hidden / heads) frees hidden from
    // being a multiple of heads in the llama-like families.
    if !m.hidden.is_multiple_of(m.heads)
        && (m.arch == Arch::Gpt || m.head_dim == m.hidden / m.heads)
    {
        out.push(HiddenNotDivisibleByHeads {
            hidden: m.hidden,
            heads: m.heads,
        });
    }
    if !m.heads.is_multiple_of(m.kv_heads) {
        out.push(KvHeadsNotDividingHeads {
            kv_heads: m.kv_heads,
            heads: m.heads,
        });
    }
    if m.arch == Arch::Gpt && m.kv_heads != m.heads {
        out.push(GptGroupedQuery {
            kv_heads: m.kv_heads,
            heads: m.heads,
        });
    }
    if m.arch == Arch::Gpt && m.hidden.is_multiple_of(m.heads) && m.head_dim != m.hidden / m.heads {
        out.push(GptHeadDim {
            head_dim: m.head_dim,
            hidden: m.hidden,
            heads: m.heads,
        });
    }
    if m.arch.llama_like() && !m.head_dim.is_multiple_of(2) {
        out.push(OddRopeHeadDim {
            head_dim: m.head_dim,
            hidden: m.hidden,
            heads: m.heads,
        });
    }
    for (key, set, needs) in [
        ("qkv_bias", m.qkv_bias, Arch::Qwen2),
        ("qk_norm", m.qk_norm, Arch::Qwen3),
        ("sliding_window", m.sliding_window.is_some(), Arch::Mistral),
    ] {
        // Qwen2-MoE has Qwen2's q/k/v biases.
        let also = key == "qkv_bias" && m.arch == Arch::Qwen2Moe;
        if set && m.arch != needs && !also {
            out.push(KeyNeedsArch {
                key,
                needs,
                arch: m.arch,
            });
        }
    }
    if let Some(r) = &m.rope_scaling {
        if !m.arch.llama_like() {
            out.push(RopeScalingWithoutRope { arch: m.arch });
        } else if let Some(problem) = r.problem() {
            out.push(RopeScalingInvalid { problem });
        }
    }
    if m.arch == Arch::Qwen2Moe && m.moe.is_none() {
        out.push(Qwen2MoeNeedsMoe);
    }
    if let Some(moe) = &m.moe {
        if !matches!(m.arch, Arch::Llama | Arch::Qwen2Moe) {
            out.push(MoeNeedsLlama { arch: m.arch });
        }
        let arch = m.arch;
        let mut bad = |key, value: String, why, help| {
            out.push(MoeKeyVsArch {
                key,
                value,
                arch,
                why,
                help,
            })
        };
        if arch == Arch::Llama {
            const HELP: &str =
                "MixtralForCausalLM has none: use arch = \"qwen2_moe\" or remove the key";
            if moe.shared_ffn_hidden > 0 {
                bad(
                    "shared_ffn_hidden",
                    moe.shared_ffn_hidden.to_string(),
                    "a shared expert",
                    HELP,
                );
            } else if moe.shared_expert_gate {
                bad(
                    "shared_expert_gate",
                    "true".into(),
                    "a shared-expert gate",
                    HELP,
                );
            } else if !moe.norm_topk_prob {
                bad(
                    "norm_topk_prob",
                    "false".into(),
                    "unnormalised top-k weights",
                    "MixtralForCausalLM always renormalises the top-k weights: remove the key",
                );
            } else if moe.first_dense_layers > 0 {
                bad(
                    "first_dense_layers",
                    moe.first_dense_layers.to_string(),
                    "dense first layers",
                    HELP,
                );
            } else if moe.ffn_hidden != m.ffn_hidden {
                bad(
                    "ffn_hidden",
                    moe.ffn_hidden.to_string(),
                    "an expert size apart from the dense one",
                    "MixtralForCausalLM has one intermediate_size: set model.ffn_hidden instead",
                );
            }
        } else if arch == Arch::Qwen2Moe {
            if moe.layer_freq != 1 {
                bad(
                    "layer_freq",
                    moe.layer_freq.to_string(),
                    "MoE layers every few layers from layer 0",
                    "Qwen2MoeForCausalLM's decoder_sparse_step counts from layer 1: use layer_freq = 1 (with first_dense_layers for dense layers)",
                );
            } else if moe.shared_ffn_hidden == 0 {
                bad(
                    "shared_ffn_hidden",
                    "0".into(),
                    "no shared expert",
                    "Qwen2MoeForCausalLM always has a shared expert: set shared_ffn_hidden (Qwen1.5-MoE-A2.7B: 5632)",
                );
            } else if !moe.shared_expert_gate {
                bad(
                    "shared_expert_gate",
                    "false".into(),
                    "an ungated shared expert",
                    "Qwen2MoeForCausalLM always gates its shared expert: remove the key",
                );
            }
        } else if moe.shared_expert_gate && moe.shared_ffn_hidden == 0 {
            bad(
                "shared_expert_gate",
                "true".into(),
                "a gate without a shared expert",
                "set shared_ffn_hidden or remove shared_expert_gate",
            );
        }
        if moe.first_dense_layers >= m.layers {
            out.push(FirstDenseLayersTooMany {
                first: moe.first_dense_layers,
                layers: m.layers,
            });
        }
        if moe.top_k > moe.experts {
            out.push(TopKExceedsExperts {
                top_k: moe.top_k,
                experts: moe.experts,
            });
        }
        if moe.layer_freq > m.layers {
            out.push(LayerFreqExceedsLayers {
                layer_freq: moe.layer_freq,
                layers: m.layers,
            });
        }
    }

    // Tensor parallelism.
    if !m.heads.is_multiple_of(p.tp) {
        out.push(TpNotDividingHeads {
            tp: p.tp,
            heads: m.heads,
        });
    }
    if !m.kv_heads.is_multiple_of(p.tp) && !p.tp.is_multiple_of(m.kv_heads) {
        out.push(TpVersusKvHeads {
            tp: p.tp,
            kv_heads: m.kv_heads,
        });
    }
    if !m.ffn_hidden.is_multiple_of(p.tp) {
        out.push(TpNotDividingFfn {
            tp: p.tp,
            ffn_hidden: m.ffn_hidden,
        });
    }
    if let Some(moe) = &m.moe {
        for (key, value) in [
            ("ffn_hidden", moe.ffn_hidden),
            ("shared_ffn_hidden", moe.shared_ffn_hidden),
        ] {
            if !value.is_multiple_of(p.tp) {
                out.push(TpNotDividingExpertFfn {
                    tp: p.tp,
                    key,
                    value,
                });
            }
        }
    }

    // Pipeline parallelism.
    let chunks = p.pp.saturating_mul(p.vpp);
    if !p.stage_layers.is_empty() {
        let given = p.stage_layers.len() as u64;
        if given != chunks {
            out.push(StageLayersCount {
                given,
                pp: p.pp,
                vpp: p.vpp,
            });
        }
        let sum = p
            .stage_layers
            .iter()
            .fold(0u64, |a, &b| a.saturating_add(b));
        if sum != m.layers {
            out.push(StageLayersSum {
                sum,
                layers: m.layers,
            });
        }
    } else if p.balance_stages {
        if m.layers < chunks {
            out.push(TooFewLayersToBalance {
                layers: m.layers,
                pp: p.pp,
                vpp: p.vpp,
            });
        }
    } else if !m.layers.is_multiple_of(chunks) {
        out.push(LayersNotDivisibleByChunks {
            layers: m.layers,
            pp: p.pp,
            vpp: p.vpp,
        });
    }
    if p.vpp > 1 && p.pp < 2 {
        out.push(VppWithoutPp {
            vpp: p.vpp,
            pp: p.pp,
        });
    }
    if p.schedule == Schedule::Interleaved && p.vpp < 2 {
        out.push(InterleavedWithoutVpp { vpp: p.vpp });
    }
    if p.vpp > 1 && !matches!(p.schedule, Schedule::Interleaved | Schedule::Dpp) {
        out.push(ScheduleWithoutVirtualChunks {
            schedule: p.schedule,
            vpp: p.vpp,
        });
    }

    // Batch.
    let per_step = t.micro_batch.saturating_mul(p.dp);
    if !t.global_batch.is_multiple_of(per_step) {
        out.push(GlobalBatchNotDivisible {
            global_batch: t.global_batch,
            micro_batch: t.micro_batch,
            dp: p.dp,
        });
    }
    let microbatches = t.global_batch.checked_div(per_step).unwrap_or(0);
    let ordered =
        p.schedule == Schedule::Dpp && p.dpp_policy == crate::spec::DppPolicy::Ordered && p.vpp > 1;
    if (p.schedule == Schedule::Interleaved || ordered) && !microbatches.is_multiple_of(p.pp) {
        out.push(InterleavedMicrobatches {
            microbatches,
            global_batch: t.global_batch,
            micro_batch: t.micro_batch,
            dp: p.dp,
            pp: p.pp,
            ordered,
        });
    }

    // Sequence and context parallelism.
    let sp = p.sequence_parallel && p.tp > 1;
    let two_cp = p.cp.saturating_mul(2);
    if sp && p.cp > 1 && !m.seq_len.is_multiple_of(two_cp.saturating_mul(p.tp)) {
        out.push(SeqLenVersusCpTp {
            seq_len: m.seq_len,
            cp: p.cp,
            tp: p.tp,
        });
    }
    if sp && !m.seq_len.is_multiple_of(p.tp) {
        out.push(SeqLenVersusTp {
            seq_len: m.seq_len,
            tp: p.tp,
        });
    }
    if p.cp > 1 && !m.seq_len.is_multiple_of(two_cp) {
        out.push(SeqLenVersusCp {
            seq_len: m.seq_len,
            cp: p.cp,
        });
    }

    // Expert parallelism.
    match &m.moe {
        None if p.ep > 1 => out.push(EpWithoutMoe { ep: p.ep }),
        None => {}
        Some(moe) => {
            let dp_cp = p.dp.saturating_mul(p.cp);
            if !moe.experts.is_multiple_of(p.ep) {
                out.push(EpNotDividingExperts {
                    ep: p.ep,
                    experts: moe.experts,
                    dp: p.dp,
                    cp: p.cp,
                });
            }
            if !dp_cp.is_multiple_of(p.ep) {
                out.push(EpNotDividingDpCp {
                    ep: p.ep,
                    experts: moe.experts,
                    dp: p.dp,
                    cp: p.cp,
                });
            }
            if p.cp > 1 && moe.capacity_factor > 0.0 {
                out.push(CapacityFactorWithCp {
                    capacity_factor: moe.capacity_factor,
                    cp: p.cp,
                });
            }
            if p.tp > 1 && !p.sequence_parallel {
                out.push(MoeTpWithoutSp { tp: p.tp });
            }
        }
    }

    // Cluster.
    if let Some(cl) = &spec.cluster {
        let have = cl.nodes.saturating_mul(cl.gpus_per_node);
        let need = [p.tp, p.pp, p.dp, p.cp, if p.fbd { 2 } else { 1 }]
            .into_iter()
            .fold(1u64, u64::saturating_mul);
        if need > have {
            out.push(ClusterTooSmall {
                need,
                tp: p.tp,
                pp: p.pp,
                dp: p.dp,
                cp: p.cp,
                fbd: p.fbd,
                nodes: cl.nodes,
                gpus_per_node: cl.gpus_per_node,
            });
        }
    }
    out
}
