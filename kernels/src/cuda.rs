//! CUDA C sources of the GPU kernels (`kernels/cuda/*.cu`), compiled at run time with NVRTC
//! by the runtime (`megac_runtime::cuda`). They are header-free: NVRTC 13 ships no headers,
//! so 16-bit floats are `unsigned short` with explicit conversions, and every file is
//! compiled after [`PRELUDE`] (the conversions and block reductions they share).
//!
//! Compiled on the CPU (`tests/cuda.rs`); not run on a GPU yet.

/// Definitions every kernel file uses, prepended to each before compilation.
pub const PRELUDE: &str = include_str!("../cuda/prelude.cu");

/// One kernel file: its name, its source, and the `extern "C"` kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct CudaSource {
    /// File name under `kernels/cuda/`.
    pub name: &'static str,
    /// The file's text (without [`PRELUDE`]).
    pub source: &'static str,
    /// The kernels it defines, as the PTX names them.
    pub kernels: &'static [&'static str],
}

impl CudaSource {
    /// The text NVRTC compiles: [`PRELUDE`] then the file.
    pub fn program(&self) -> String {
        format!("{PRELUDE}\n{}", self.source)
    }
}

/// Every kernel file.
pub const SOURCES: &[CudaSource] = &[
    CudaSource {
        name: "cast.cu",
        source: include_str!("../cuda/cast.cu"),
        kernels: &[
            "cast_f32_to_bf16",
            "cast_bf16_to_f32",
            "cast_f32_to_f16",
            "cast_f16_to_f32",
        ],
    },
    CudaSource {
        name: "activation.cu",
        source: include_str!("../cuda/activation.cu"),
        kernels: &["swiglu_fwd", "swiglu_bwd"],
    },
    CudaSource {
        name: "norm.cu",
        source: include_str!("../cuda/norm.cu"),
        kernels: &[
            "rms_norm_fwd",
            "layer_norm_fwd",
            "rms_norm_bwd_dx",
            "layer_norm_bwd_dx",
            "norm_dw",
        ],
    },
    CudaSource {
        name: "kv.cu",
        source: include_str!("../cuda/kv.cu"),
        kernels: &["rope_at", "pos_embedding_at"],
    },
    CudaSource {
        name: "scope.cu",
        source: include_str!("../cuda/scope.cu"),
        kernels: &[
            "perturb_scale",
            "perturb_sum_squares",
            "perturb_noise",
            "perturb_bitflip",
            "perturb_zero_head",
        ],
    },
    CudaSource {
        name: "rope.cu",
        source: include_str!("../cuda/rope.cu"),
        kernels: &["rope_apply"],
    },
    CudaSource {
        name: "optim.cu",
        source: include_str!("../cuda/optim.cu"),
        kernels: &[
            "adamw_step",
            "sum_squares",
            "sum_partials",
            "grad_norm_finish",
            "adamw_multi",
        ],
    },
    CudaSource {
        name: "loss.cu",
        source: include_str!("../cuda/loss.cu"),
        kernels: &[
            "cross_entropy_fwd",
            "cross_entropy_bwd",
            "ce_row_max",
            "ce_row_sumexp",
            "ce_rows_loss",
            "ce_mean",
            "ce_vp_bwd",
        ],
    },
    CudaSource {
        name: "embedding.cu",
        source: include_str!("../cuda/embedding.cu"),
        kernels: &[
            "embedding_fwd",
            "embedding_bwd",
            "pos_embedding_fwd",
            "pos_embedding_bwd",
        ],
    },
    CudaSource {
        name: "softmax.cu",
        source: include_str!("../cuda/softmax.cu"),
        kernels: &["masked_softmax_fwd", "masked_softmax_bwd"],
    },
    CudaSource {
        name: "elementwise.cu",
        source: include_str!("../cuda/elementwise.cu"),
        kernels: &[
            "add_fwd",
            "accumulate",
            "scale_in_place",
            "bias_add",
            "column_sum_acc",
            "gelu_tanh_fwd",
            "gelu_tanh_bwd",
            "sigmoid_mul_fwd",
            "sigmoid_mul_bwd",
            "copy_columns",
            "repeat_kv_fwd",
            "repeat_kv_bwd",
            "transpose_heads",
        ],
    },
    CudaSource {
        name: "moe.cu",
        source: include_str!("../cuda/moe.cu"),
        kernels: &[
            "router_fwd",
            "router_bwd",
            "moe_gather_rows",
            "moe_scatter_add_rows",
            "moe_combine_fwd",
            "moe_combine_bwd",
            "moe_aux_stats",
            "moe_aux_loss_finish",
            "moe_aux_loss_bwd",
        ],
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Every listed kernel is defined `extern "C"` in its file, and every `extern "C"`
    /// kernel of a file is listed (so the runtime can load each by name).
    #[test]
    fn every_kernel_is_listed_once() {
        for s in SOURCES {
            let defined: Vec<&str> = s
                .source
                .split("extern \"C\" __global__ void ")
                .skip(1)
                .map(|rest| rest.split('(').next().unwrap().trim())
                .collect();
            let mut listed = s.kernels.to_vec();
            let mut found = defined.clone();
            listed.sort_unstable();
            found.sort_unstable();
            assert_eq!(listed, found, "{}", s.name);
        }
        let mut all: Vec<&str> = SOURCES
            .iter()
            .flat_map(|s| s.kernels.iter().copied())
            .collect();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "kernel names are unique");
    }
}
