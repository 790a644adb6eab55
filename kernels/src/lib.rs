//! CPU kernels: the forward and backward of every op of a Llama (LlamaForCausalLM) and
//! GPT-2 (GPT2LMHeadModel) training step, in f32, numerically matching Hugging Face
//! transformers' fp32 eager math.
//!
//! Conventions shared by every kernel:
//!
//! - Tensors are contiguous row-major `f32` slices; token ids and labels are `i32`.
//! - Forward kernels overwrite their outputs.
//! - **Backward kernels accumulate** (`+=`) into every gradient output; the runtime zeroes
//!   gradients before the first contribution.
//! - Matmuls go through the `gemm` crate (with its AVX-512 kernels compiled in and picked
//!   at run time), threaded only above ~2^18 multiply-adds; everything else is split over
//!   rows (or heads) with rayon once the work is large enough to pay for it, and the
//!   exp/sigmoid-heavy loops are compiled twice (baseline and AVX2+FMA) and dispatched on
//!   the CPU's features. Reductions that produce a
//!   scalar use a fixed chunking, so results do not depend on the number of threads.
//! - Sizes are checked with `assert!`: a wrong slice length is a bug in the caller, and
//!   the kernel panics rather than reading out of bounds.
//!
//! One module per concept: [`linear`], [`embedding`], [`norm`], [`rope`], [`attention`],
//! [`activation`], [`elementwise`], [`loss`], [`optim`], and [`precision`] (rounding
//! to the 16-bit storage types of mixed precision).

#![warn(missing_docs)]

pub mod activation;
pub mod attention;
pub mod context;
pub mod cuda;
pub mod elementwise;
pub mod embedding;
pub mod kv;
pub mod linear;
pub mod loss;
pub mod moe;
pub mod norm;
pub mod optim;
pub mod perturb;
pub mod precision;
pub mod rope;
mod simd;
mod util;

pub use activation::{
    gelu_tanh_bwd, gelu_tanh_fwd, sigmoid_mul_bwd, sigmoid_mul_fwd, swiglu_bwd, swiglu_fwd,
};
pub use attention::{
    attention_bwd, attention_fwd, masked_attention_bwd, masked_attention_fwd, Mask,
};
pub use context::{
    attention_block_bwd, attention_block_fwd, attention_merge, attention_merge_into,
    attention_window_bwd, attention_window_fwd, cp_local_positions, rope_bwd_positions,
    rope_fwd_positions,
};
pub use elementwise::{accumulate, add_fwd, scale_in_place, sum_squares};
pub use embedding::{embedding_bwd, embedding_fwd, pos_embedding_bwd, pos_embedding_fwd};
pub use linear::{linear_bwd_data, linear_bwd_weight, linear_fwd, WeightLayout};
pub use loss::{cross_entropy_bwd, cross_entropy_fwd};
pub use moe::{
    combine_bwd, combine_fwd, dispatch_bwd, dispatch_fwd, dispatch_fwd_routed, moe_aux_loss_bwd,
    moe_aux_loss_bwd_from_stats, moe_aux_loss_from_stats, moe_aux_loss_fwd, moe_aux_stats,
    router_bwd, router_bwd_with, router_fwd, router_fwd_with, AuxStats, Routing,
};
pub use norm::{layer_norm_bwd, layer_norm_fwd, rms_norm_bwd, rms_norm_fwd};
pub use optim::{adamw_step, step_scalars, AdamW, StepScalars};
pub use precision::Half;
pub use rope::{default_inv_freq, rope_bwd, rope_freq, rope_fwd};
