//! Activations: SwiGLU (Llama MLP) and GPT-2's tanh-approximated GELU (`gelu_new`).

use rayon::prelude::*;

use crate::simd::{sigmoid, sigmoid_pair, simd_dispatch};
use crate::util::{elem_chunk, PAR_MIN_ELEMS};

/// `sqrt(2 / pi)` as GPT-2's `gelu_new` rounds it to f32.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic coefficient of the tanh approximation.
const GELU_C: f32 = 0.044_715;

simd_dispatch! {
    fn swiglu_fwd_serial(gate: &[f32], up: &[f32], y: &mut [f32]) {
        for ((y, &g), &u) in y.iter_mut().zip(gate).zip(up) {
            // torch's silu: x / (1 + exp(-x)).
            *y = (g / (1.0 + crate::simd::exp(-g))) * u;
        }
    }
}

simd_dispatch! {
    fn swiglu_bwd_serial(gate: &[f32], up: &[f32], dy: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
        let n = dgate.len();
        let (gate, up, dy, dup) = (&gate[..n], &up[..n], &dy[..n], &mut dup[..n]);
        for i in 0..n {
            let (g, u, d) = (gate[i], up[i], dy[i]);
            let (sg, one_minus) = sigmoid_pair(g);
            dup[i] += d * (g * sg);
            // d silu / dg = sg * (1 + g * (1 - sg)).
            dgate[i] += d * u * (sg * (1.0 + g * one_minus));
        }
    }
}

simd_dispatch! {
    fn gelu_fwd_serial(x: &[f32], y: &mut [f32]) {
        for (y, &x) in y.iter_mut().zip(x) {
            // 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x³).
            let u = SQRT_2_OVER_PI * (x + GELU_C * (x * x * x));
            *y = x * sigmoid(2.0 * u);
        }
    }
}

simd_dispatch! {
    fn gelu_bwd_serial(x: &[f32], dy: &[f32], dx: &mut [f32]) {
        for ((dx, &x), &dy) in dx.iter_mut().zip(x).zip(dy) {
            let x2 = x * x;
            let u = SQRT_2_OVER_PI * (x + GELU_C * (x2 * x));
            let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x2);
            let (sg, one_minus) = sigmoid_pair(2.0 * u);
            // d/dx [x σ(2u)] = σ(2u) + 2 x σ(2u) (1 - σ(2u)) u'.
            *dx += dy * (sg + 2.0 * x * sg * one_minus * du);
        }
    }
}

/// `y = silu(gate) * up` with `silu(g) = g / (1 + e^-g)` (`LlamaMLP`'s
/// `act_fn(gate_proj(x)) * up_proj(x)`). Overwrites `y`.
pub fn swiglu_fwd(gate: &[f32], up: &[f32], y: &mut [f32]) {
    assert!(
        gate.len() == y.len() && up.len() == y.len(),
        "swiglu_fwd: length mismatch"
    );
    if y.len() < PAR_MIN_ELEMS {
        return swiglu_fwd_serial(gate, up, y);
    }
    let c = elem_chunk(y.len());
    y.par_chunks_mut(c)
        .zip(gate.par_chunks(c))
        .zip(up.par_chunks(c))
        .for_each(|((y, g), u)| swiglu_fwd_serial(g, u, y));
}

/// Backward of [`swiglu_fwd`]: `dgate += dy * up * silu'(gate)`, `dup += dy * silu(gate)`.
pub fn swiglu_bwd(gate: &[f32], up: &[f32], dy: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    let n = gate.len();
    assert!(
        up.len() == n && dy.len() == n && dgate.len() == n && dup.len() == n,
        "swiglu_bwd: length mismatch"
    );
    if n < PAR_MIN_ELEMS {
        return swiglu_bwd_serial(gate, up, dy, dgate, dup);
    }
    let c = elem_chunk(n);
    dgate
        .par_chunks_mut(c)
        .zip(dup.par_chunks_mut(c))
        .zip(gate.par_chunks(c))
        .zip(up.par_chunks(c))
        .zip(dy.par_chunks(c))
        .for_each(|((((dg, du), g), u), dy)| swiglu_bwd_serial(g, u, dy, dg, du));
}

/// GPT-2's `gelu_new`: `y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³)))`, evaluated
/// as the equal `x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x³))`, which avoids the
/// cancellation in `1 + tanh` for negative `x`. Overwrites `y`.
pub fn gelu_tanh_fwd(x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "gelu_tanh_fwd: length mismatch");
    if y.len() < PAR_MIN_ELEMS {
        return gelu_fwd_serial(x, y);
    }
    let c = elem_chunk(y.len());
    y.par_chunks_mut(c)
        .zip(x.par_chunks(c))
        .for_each(|(y, x)| gelu_fwd_serial(x, y));
}

/// Backward of [`gelu_tanh_fwd`]: `dx += dy * gelu'(x)`.
pub fn gelu_tanh_bwd(x: &[f32], dy: &[f32], dx: &mut [f32]) {
    assert!(
        x.len() == dx.len() && dy.len() == dx.len(),
        "gelu_tanh_bwd: length mismatch"
    );
    if dx.len() < PAR_MIN_ELEMS {
        return gelu_bwd_serial(x, dy, dx);
    }
    let c = elem_chunk(dx.len());
    dx.par_chunks_mut(c)
        .zip(x.par_chunks(c))
        .zip(dy.par_chunks(c))
        .for_each(|((dx, x), dy)| gelu_bwd_serial(x, dy, dx));
}

/// `y[t, :] = sigmoid(gate[t]) * x[t, :]` for `gate` of one logit per row of `x` (`h` wide):
/// Qwen2-MoE's `F.sigmoid(shared_expert_gate(x)) * shared_expert(x)`, with the crate's
/// `1 / (1 + exp(-g))` (its polynomial `exp`, as the fused kernels compute it). Overwrites `y`.
pub fn sigmoid_mul_fwd(gate: &[f32], x: &[f32], h: usize, y: &mut [f32]) {
    assert!(
        x.len() == y.len() && gate.len() * h == x.len(),
        "sigmoid_mul_fwd: length mismatch"
    );
    for ((y, x), &g) in y.chunks_mut(h).zip(x.chunks(h)).zip(gate) {
        let s = sigmoid(g);
        for (y, &x) in y.iter_mut().zip(x) {
            *y = s * x;
        }
    }
}

/// Backward of [`sigmoid_mul_fwd`]: `dgate[t] += s(1-s) · Σ_j dy[t,j] x[t,j]`,
/// `dx += s · dy` with `s = sigmoid(gate[t])`.
pub fn sigmoid_mul_bwd(
    gate: &[f32],
    x: &[f32],
    dy: &[f32],
    h: usize,
    dgate: &mut [f32],
    dx: &mut [f32],
) {
    assert!(
        x.len() == dy.len() && dx.len() == x.len() && gate.len() * h == x.len(),
        "sigmoid_mul_bwd: length mismatch"
    );
    assert_eq!(dgate.len(), gate.len(), "sigmoid_mul_bwd: length mismatch");
    for ((((dx, x), dy), &g), dg) in dx
        .chunks_mut(h)
        .zip(x.chunks(h))
        .zip(dy.chunks(h))
        .zip(gate)
        .zip(dgate.iter_mut())
    {
        let s = sigmoid(g);
        let mut dot = 0.0f64;
        for ((dx, &x), &dy) in dx.iter_mut().zip(x).zip(dy) {
            *dx += s * dy;
            dot += (dy * x) as f64;
        }
        *dg += (s * (1.0 - s)) * dot as f32;
    }
}
