//! AdamW: a hand-computed two-step example, PyTorch's own results (bit patterns recorded
//! from `torch.optim.AdamW(foreach=False)`), and a large tensor (threaded path) against a
//! float64 transcription of the update.

mod common;

use common::*;
use megac_kernels::{adamw_step, AdamW};

/// Distance in units in the last place between two finite f32 of the same sign.
fn ulps(a: f32, b: f32) -> u32 {
    if a == b {
        return 0;
    }
    assert_eq!(a.is_sign_negative(), b.is_sign_negative(), "{a} vs {b}");
    (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
}

#[test]
fn hand_computed_two_steps() {
    // Hyperparameters exact in binary, so the f32 struct holds them exactly:
    // lr 1/8, betas (3/4, 15/16), eps 2^-10, weight decay 1/16; p = 1, g = 0.5 then -0.25.
    // Step 1: p = 1 * (1 - 1/128) = 0.9921875; m = 0.25 * 0.5 = 0.125;
    //   v = 0.0625 * 0.25 = 0.015625; bc1 = 0.25, bc2 = 0.0625, step size 0.5;
    //   denom = sqrt(0.015625) / sqrt(0.0625) + 2^-10 = 0.5009765625;
    //   p = 0.9921875 - 0.5 * 0.125 / 0.5009765625 = 0.8674311647173489.
    // Step 2: p = 0.8674311647173489 * 0.9921875; m = 0.09375 - 0.0625 = 0.03125;
    //   v = 0.9375 * 0.015625 + 0.0625 * 0.0625 = 0.0185546875; bc1 = 0.4375,
    //   bc2 = 0.12109375, step size 0.125 / 0.4375 = 0.2857142857142857;
    //   denom = sqrt(0.0185546875 / 0.12109375) + 2^-10 = 0.3914406806294064 + 2^-10;
    //   p = 0.8606543...  - 0.2857142857 * 0.03125 / 0.3924172431 = 0.8379016087430996.
    let hp = AdamW {
        lr: 0.125,
        beta1: 0.75,
        beta2: 0.9375,
        eps: 1.0 / 1024.0,
        weight_decay: 0.0625,
    };
    let (mut p, mut m, mut v) = ([1.0f32], [0.0f32], [0.0f32]);
    adamw_step(&mut p, &[0.5], &mut m, &mut v, &hp, 1);
    // A few f32 roundings away from the exact value.
    let close = |got: f32, want: f64| (got as f64 - want).abs() <= 4e-7 * want.abs();
    assert!(close(p[0], 0.8674311647173489), "step 1 p = {}", p[0]);
    assert_eq!((m[0], v[0]), (0.125, 0.015625), "step 1 moments are exact");
    adamw_step(&mut p, &[-0.25], &mut m, &mut v, &hp, 2);
    assert!(close(p[0], 0.8379016087430996), "step 2 p = {}", p[0]);
    assert_eq!(
        (m[0], v[0]),
        (0.03125, 19.0 / 1024.0),
        "step 2 moments are exact"
    );
}

#[test]
fn matches_torch_within_one_ulp() {
    // torch.optim.AdamW([p], lr=f32(3e-4), betas=(f32(0.9), f32(0.95)), eps=f32(1e-8),
    // weight_decay=f32(0.1), foreach=False), three steps; f32 bit patterns of p, m, v.
    let hp = AdamW {
        lr: 3e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut p = [0.5f32, -1.25, 3.0, 1e-3, -0.0625, 2.5, -7.0, 0.125];
    let grads: [[f32; 8]; 3] = [
        [0.1, -0.2, 0.05, 1e-4, 0.0, -3.0, 2.0, 1e-6],
        [-0.05, 0.3, 0.05, -1e-4, 0.01, -2.5, -1.0, 2e-6],
        [0.2, 0.2, -0.7, 5e-5, -0.01, 1.0, 0.5, -1e-6],
    ];
    let (mut m, mut v) = ([0.0f32; 8], [0.0f32; 8]);
    for (i, g) in grads.iter().enumerate() {
        adamw_step(&mut p, g, &mut m, &mut v, &hp, i as u64 + 1);
    }
    let want_p = [
        0x3effaeba, 0xbf9ff99b, 0x403ff46e, 0x3a2dc576, 0xbd8069a1, 0x40200906, 0xc0dffed0,
        0x3dfe8706,
    ];
    let want_m = [
        0x3cc154cc, 0x3cfc504d, 0xbd7bb303, 0x368992bd, 0xb8d1b724, 0xbebc6a81, 0x3df9db26,
        0x342cdf5a,
    ];
    let want_v = [
        0x3b286d75, 0x3c0461fd, 0x3cca99db, 0x30907b94, 0x372393f0, 0x3f40c49f, 0x3e7645a5,
        0x2aa082da,
    ];
    for i in 0..8 {
        let (wp, wm, wv) = (
            f32::from_bits(want_p[i]),
            f32::from_bits(want_m[i]),
            f32::from_bits(want_v[i]),
        );
        assert!(ulps(p[i], wp) <= 1, "p[{i}] = {} vs torch {wp}", p[i]);
        assert!(ulps(m[i], wm) <= 1, "m[{i}] = {} vs torch {wm}", m[i]);
        assert!(ulps(v[i], wv) <= 1, "v[{i}] = {} vs torch {wv}", v[i]);
    }
}

#[test]
fn large_tensor_against_f64_formula() {
    let mut rng = Rng::new(7);
    let n = 100_003; // threaded, ragged chunks
    let hp = AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut p = rng.normal(n, 1.0);
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let (mut p64, mut m64, mut v64) = (to64(&p), vec![0.0f64; n], vec![0.0f64; n]);
    let (lr, b1, b2, eps, wd) = (
        hp.lr as f64,
        hp.beta1 as f64,
        hp.beta2 as f64,
        hp.eps as f64,
        hp.weight_decay as f64,
    );
    for step in 1..=3u64 {
        let g = rng.normal(n, 0.01);
        adamw_step(&mut p, &g, &mut m, &mut v, &hp, step);
        let (bc1, bc2) = (1.0 - b1.powi(step as i32), 1.0 - b2.powi(step as i32));
        for i in 0..n {
            let gi = g[i] as f64;
            p64[i] *= 1.0 - lr * wd;
            m64[i] = b1 * m64[i] + (1.0 - b1) * gi;
            v64[i] = b2 * v64[i] + (1.0 - b2) * gi * gi;
            p64[i] -= lr / bc1 * m64[i] / (v64[i].sqrt() / bc2.sqrt() + eps);
        }
    }
    assert_close("adamw p", &p, &p64, 1e-6, 1e-3);
    assert_close("adamw m", &m, &m64, 1e-5, 1e-2);
    assert_close("adamw v", &v, &v64, 1e-5, 1e-2);
}

#[test]
fn zero_weight_decay_and_zero_gradient() {
    // No decay, zero gradient from zero moments: nothing moves.
    let hp = AdamW {
        lr: 0.5,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let mut p = [1.5f32, -2.0];
    let (mut m, mut v) = ([0.0f32; 2], [0.0f32; 2]);
    adamw_step(&mut p, &[0.0, 0.0], &mut m, &mut v, &hp, 1);
    assert_eq!(p, [1.5, -2.0]);
}
