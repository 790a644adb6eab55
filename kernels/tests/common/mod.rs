//! Helpers shared by the kernel tests: a deterministic RNG, float64 reference
//! implementations written as plain loops, comparison and finite-difference checkers.
#![allow(dead_code, clippy::too_many_arguments, clippy::needless_range_loop)]

use megac_kernels::WeightLayout;

/// SplitMix64: deterministic, dependency-free random numbers.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit() as f32
    }
    pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
    /// Standard normal values (Box-Muller), scaled.
    pub fn normal(&mut self, n: usize, std: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u1 = self.unit().max(1e-300);
                let u2 = self.unit();
                ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32 * std
            })
            .collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

pub fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Asserts `|got - want| <= rtol * (|want| + floor)` elementwise, where `floor` is
/// `floor_frac` times the largest |want| (so entries near zero are judged against the
/// tensor's scale rather than their own).
pub fn assert_close(name: &str, got: &[f32], want: &[f64], rtol: f64, floor_frac: f64) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let floor = floor_frac * scale;
    let mut worst = (0.0f64, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs() / (w.abs() + floor + f64::MIN_POSITIVE);
        assert!(g.is_finite(), "{name}[{i}] = {g} is not finite (want {w})");
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let i = worst.1;
    assert!(
        worst.0 <= rtol,
        "{name}: relative error {:.3e} > {rtol:.1e} at [{i}]: got {}, want {}",
        worst.0,
        got[i],
        want[i]
    );
}

/// Indices to probe in a tensor of `n` elements: all when `n <= max`, else `max` random.
pub fn probe_indices(rng: &mut Rng, n: usize, max: usize) -> Vec<usize> {
    if n <= max {
        (0..n).collect()
    } else {
        (0..max).map(|_| rng.below(n)).collect()
    }
}

/// Central differences in f64 of `objective` (a function of all inputs) with respect to
/// `inputs[which]`, at the probed indices.
pub fn numeric_grad(
    inputs: &[Vec<f64>],
    which: usize,
    idx: &[usize],
    objective: &dyn Fn(&[Vec<f64>]) -> f64,
) -> Vec<f64> {
    let mut xs = inputs.to_vec();
    idx.iter()
        .map(|&i| {
            let x0 = xs[which][i];
            let h = 1e-4 * (1.0 + x0.abs());
            xs[which][i] = x0 + h;
            let fp = objective(&xs);
            xs[which][i] = x0 - h;
            let fm = objective(&xs);
            xs[which][i] = x0;
            (fp - fm) / (2.0 * h)
        })
        .collect()
}

/// Checks an analytic (kernel) gradient against central differences of the f64
/// reference objective at up to `max_probes` coordinates: the error must be within
/// `rtol * (|numeric| + rms(analytic))`.
pub fn check_grad(
    name: &str,
    rng: &mut Rng,
    inputs: &[Vec<f64>],
    which: usize,
    analytic: &[f32],
    max_probes: usize,
    rtol: f64,
    objective: &dyn Fn(&[Vec<f64>]) -> f64,
) {
    assert_eq!(
        analytic.len(),
        inputs[which].len(),
        "{name}: gradient length"
    );
    let rms = (analytic.iter().map(|&g| (g as f64).powi(2)).sum::<f64>()
        / analytic.len().max(1) as f64)
        .sqrt();
    assert!(rms > 0.0, "{name}: gradient is identically zero");
    let idx = probe_indices(rng, analytic.len(), max_probes);
    let num = numeric_grad(inputs, which, &idx, objective);
    let mut worst = (0.0f64, 0usize);
    for (k, &i) in idx.iter().enumerate() {
        let a = analytic[i] as f64;
        let err = (a - num[k]).abs() / (num[k].abs() + rms);
        if err > worst.0 {
            worst = (err, k);
        }
    }
    let k = worst.1;
    eprintln!("{name}: worst gradient error {:.2e}", worst.0);
    assert!(
        worst.0 <= rtol,
        "{name}: gradient error {:.3e} > {rtol:.1e} at [{}]: analytic {}, numeric {} (rms {rms:.3e})",
        worst.0,
        idx[k],
        analytic[idx[k]],
        num[k]
    );
}

/// `Σ dy * y`.
pub fn dot(dy: &[f64], y: &[f64]) -> f64 {
    dy.iter().zip(y).map(|(a, b)| a * b).sum()
}

// ---------------------------------------------------------------------------------
// float64 references, written as plain loops.
// ---------------------------------------------------------------------------------

pub fn linear_ref(
    x: &[f64],
    w: &[f64],
    bias: Option<&[f64]>,
    m: usize,
    k: usize,
    n: usize,
    layout: WeightLayout,
) -> Vec<f64> {
    let mut y = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = bias.map_or(0.0, |b| b[j]);
            for kk in 0..k {
                let wv = match layout {
                    WeightLayout::OutIn => w[j * k + kk],
                    WeightLayout::InOut => w[kk * n + j],
                };
                acc += x[i * k + kk] * wv;
            }
            y[i * n + j] = acc;
        }
    }
    y
}

pub fn embedding_ref(ids: &[i32], table: &[f64], h: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(ids.len() * h);
    for &id in ids {
        out.extend_from_slice(&table[id as usize * h..(id as usize + 1) * h]);
    }
    out
}

pub fn pos_embedding_ref(x: &[f64], wpe: &[f64], b: usize, s: usize, h: usize) -> Vec<f64> {
    let mut out = vec![0.0; b * s * h];
    for bi in 0..b {
        for p in 0..s {
            for c in 0..h {
                out[(bi * s + p) * h + c] = x[(bi * s + p) * h + c] + wpe[p * h + c];
            }
        }
    }
    out
}

pub fn rms_norm_ref(x: &[f64], w: &[f64], eps: f64, rows: usize, h: usize) -> Vec<f64> {
    let mut y = vec![0.0; rows * h];
    for r in 0..rows {
        let row = &x[r * h..(r + 1) * h];
        let ms = row.iter().map(|v| v * v).sum::<f64>() / h as f64;
        let rstd = 1.0 / (ms + eps).sqrt();
        for c in 0..h {
            y[r * h + c] = w[c] * row[c] * rstd;
        }
    }
    y
}

pub fn layer_norm_ref(
    x: &[f64],
    w: &[f64],
    b: &[f64],
    eps: f64,
    rows: usize,
    h: usize,
) -> Vec<f64> {
    let mut y = vec![0.0; rows * h];
    for r in 0..rows {
        let row = &x[r * h..(r + 1) * h];
        let mean = row.iter().sum::<f64>() / h as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / h as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        for c in 0..h {
            y[r * h + c] = (row[c] - mean) * rstd * w[c] + b[c];
        }
    }
    y
}

/// HF's rope angles: `inv_freq` and `pos * inv_freq` rounded to f32 exactly as
/// `LlamaRotaryEmbedding` computes them (the spec), cos/sin then taken in f64.
pub fn rope_angles(s: usize, d: usize, theta: f32) -> Vec<f64> {
    let half = d / 2;
    let mut a = vec![0.0; s * half];
    for p in 0..s {
        for i in 0..half {
            let inv = 1.0f32 / theta.powf((2 * i) as f32 / d as f32);
            a[p * half + i] = (p as f32 * inv) as f64;
        }
    }
    a
}

pub fn rope_ref(x: &[f64], b: usize, s: usize, nh: usize, d: usize, theta: f32) -> Vec<f64> {
    let half = d / 2;
    let ang = rope_angles(s, d, theta);
    let mut y = vec![0.0; x.len()];
    for bi in 0..b {
        for p in 0..s {
            for hh in 0..nh {
                let o = ((bi * s + p) * nh + hh) * d;
                for i in 0..d {
                    let a = ang[p * half + i % half];
                    let rot = if i < half {
                        -x[o + i + half]
                    } else {
                        x[o + i - half]
                    };
                    y[o + i] = x[o + i] * a.cos() + rot * a.sin();
                }
            }
        }
    }
    y
}

/// Causal GQA attention; returns (out `[b, s, nh, d]`, lse `[b, nh, s]`).
#[allow(clippy::too_many_arguments)]
pub fn attention_ref(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    b: usize,
    s: usize,
    nh: usize,
    nkv: usize,
    d: usize,
) -> (Vec<f64>, Vec<f64>) {
    let group = nh / nkv;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0.0; b * s * nh * d];
    let mut lse = vec![0.0; b * nh * s];
    let mut sc = vec![0.0; s];
    for bi in 0..b {
        for h in 0..nh {
            let kvh = h / group;
            for i in 0..s {
                let qo = ((bi * s + i) * nh + h) * d;
                let mut mx = f64::NEG_INFINITY;
                for t in 0..=i {
                    let ko = ((bi * s + t) * nkv + kvh) * d;
                    let mut acc = 0.0;
                    for c in 0..d {
                        acc += q[qo + c] * k[ko + c];
                    }
                    sc[t] = acc * scale;
                    mx = mx.max(sc[t]);
                }
                let mut sum = 0.0;
                for t in 0..=i {
                    sc[t] = (sc[t] - mx).exp();
                    sum += sc[t];
                }
                lse[(bi * nh + h) * s + i] = mx + sum.ln();
                for t in 0..=i {
                    let vo = ((bi * s + t) * nkv + kvh) * d;
                    for c in 0..d {
                        out[qo + c] += sc[t] / sum * v[vo + c];
                    }
                }
            }
        }
    }
    (out, lse)
}

pub fn silu_ref(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

pub fn gelu_tanh_ref(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// Σ over rows of -log softmax(row)[label], skipping label -100.
pub fn cross_entropy_ref(logits: &[f64], labels: &[i32], vocab: usize) -> f64 {
    let mut total = 0.0;
    for (r, &l) in labels.iter().enumerate() {
        if l == -100 {
            continue;
        }
        let row = &logits[r * vocab..(r + 1) * vocab];
        let mx = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = mx + row.iter().map(|v| (v - mx).exp()).sum::<f64>().ln();
        total += lse - row[l as usize];
    }
    total
}
