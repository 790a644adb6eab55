//! The AdamW optimizer step, mirroring `torch.optim.AdamW`'s single-tensor path.

use rayon::prelude::*;

use crate::simd::simd_dispatch;
use crate::util::{elem_chunk, PAR_MIN_ELEMS};

/// AdamW hyperparameters (`torch.optim.AdamW(lr, betas=(beta1, beta2), eps, weight_decay)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// Decay of the first-moment running average.
    pub beta1: f32,
    /// Decay of the second-moment running average.
    pub beta2: f32,
    /// Added to the bias-corrected root of the second moment.
    pub eps: f32,
    /// Decoupled weight decay (`p *= 1 - lr * weight_decay` before the update).
    pub weight_decay: f32,
}

/// The f32 scalars of one step, derived in f64 like Python derives them from floats
/// ([`step_scalars`]; the cuda backend passes them to its AdamW kernel).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScalars {
    /// `1 - lr * weight_decay`.
    pub decay: f32,
    /// Whether weight decay applies (`weight_decay != 0`).
    pub apply_decay: bool,
    /// `1 - beta1`, the lerp weight of the first moment.
    pub w1: f32,
    /// `|w1| < 0.5` (which of ATen's two lerp forms).
    pub w1_small: bool,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub w2: f32,
    /// `sqrt(1 - beta2^step)`.
    pub bc2_sqrt: f32,
    /// `eps`.
    pub eps: f32,
    /// `-lr / (1 - beta1^step)`.
    pub neg_step_size: f32,
}

simd_dispatch! {
    fn adamw_serial(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: StepScalars) {
        let n = p.len();
        let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
        for i in 0..n {
            let gi = g[i];
            let mut pi = p[i];
            if k.apply_decay {
                // param.mul_(1 - lr * weight_decay)
                pi *= k.decay;
            }
            // exp_avg.lerp_(grad, 1 - beta1): ATen's vectorized lerp is
            // fmadd(weight, end - self, self) for |weight| < 0.5, else
            // fmadd(weight - 1, end - self, end).
            let mi = if k.w1_small {
                k.w1.mul_add(gi - m[i], m[i])
            } else {
                (k.w1 - 1.0).mul_add(gi - m[i], gi)
            };
            // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2): ATen's
            // vectorized addcmul is fmadd(value * t1, t2, self).
            let vi = (k.w2 * gi).mul_add(gi, v[i] * k.beta2);
            // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            let denom = vi.sqrt() / k.bc2_sqrt + k.eps;
            // param.addcdiv_(exp_avg, denom, value=-step_size)
            pi += k.neg_step_size * mi / denom;
            m[i] = mi;
            v[i] = vi;
            p[i] = pi;
        }
    }
}

/// One AdamW step on a parameter tensor `p` with gradient `g`, first moment `m` and
/// second moment `v` (all the same length), where `step` counts from 1 (the value of
/// torch's `state["step"]` after its increment).
///
/// Mirrors `torch.optim.AdamW` (single-tensor path: not foreach, not fused, no amsgrad):
/// `p *= 1 - lr*wd; m = lerp(m, g, 1 - b1); v = v*b2 + (1 - b2)*g*g;
/// p += -(lr / (1 - b1^step)) * m / (sqrt(v) / sqrt(1 - b2^step) + eps)`, with the scalar
/// factors computed in f64 (as Python does) and rounded to f32, and the tensor math in
/// f32 in torch's order. Torch receives the hyperparameters as Python floats: it matches
/// this bit for bit when given the same f32 values (e.g. `lr = float(np.float32(lr))`).
pub fn adamw_step(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], hp: &AdamW, step: u64) {
    let n = p.len();
    assert!(
        g.len() == n && m.len() == n && v.len() == n,
        "adamw_step: length mismatch"
    );
    assert!(step >= 1, "adamw_step: step counts from 1");
    let k = step_scalars(hp, step);
    if n < PAR_MIN_ELEMS {
        return adamw_serial(p, g, m, v, k);
    }
    let c = elem_chunk(n);
    p.par_chunks_mut(c)
        .zip(g.par_chunks(c))
        .zip(m.par_chunks_mut(c))
        .zip(v.par_chunks_mut(c))
        .for_each(|(((p, g), m), v)| adamw_serial(p, g, m, v, k));
}

/// The scalars of AdamW step `step` (from 1) with hyperparameters `hp`.
pub fn step_scalars(hp: &AdamW, step: u64) -> StepScalars {
    let (lr, b1, b2, wd) = (
        hp.lr as f64,
        hp.beta1 as f64,
        hp.beta2 as f64,
        hp.weight_decay as f64,
    );
    let step = step as f64;
    let bias_correction1 = 1.0 - b1.powf(step);
    let bias_correction2 = 1.0 - b2.powf(step);
    let step_size = lr / bias_correction1;
    StepScalars {
        decay: (1.0 - lr * wd) as f32,
        apply_decay: wd != 0.0,
        w1: (1.0 - b1) as f32,
        w1_small: ((1.0 - b1) as f32).abs() < 0.5,
        beta2: hp.beta2,
        w2: (1.0 - b2) as f32,
        bc2_sqrt: bias_correction2.powf(0.5) as f32,
        eps: hp.eps,
        neg_step_size: (-step_size) as f32,
    }
}
