//! Every backward kernel against central differences (in f64) of the float64 reference
//! forward: for a random `dy`, the kernel's gradients of `L = Σ dy · f(inputs)` must match
//! the numeric gradients of `L` at probed coordinates, within `rtol` relative to
//! `|numeric| + rms(analytic)`. The numeric gradients are good to ~1e-9 here, so the
//! tolerance (1e-5) measures the f32 kernels' own rounding, observed at most ~9e-7
//! (gelu); a wrong formula gives errors of order 1.

mod common;

use common::*;
use megac_kernels::*;

/// Gradient tolerance (relative, see module doc).
const RTOL: f64 = 1e-5;
/// Coordinates probed per tensor.
const PROBES: usize = 48;

#[test]
fn linear_grads_both_layouts_with_and_without_bias() {
    let mut rng = Rng::new(21);
    // Small, ragged, and large enough for gemm's threaded path.
    for &(m, k, n) in &[(2, 3, 4), (13, 7, 29), (96, 80, 130)] {
        for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
            for with_bias in [false, true] {
                let x = rng.vec(m * k, -1.0, 1.0);
                let w = rng.vec(n * k, -1.0, 1.0);
                let bias = rng.vec(n, -1.0, 1.0);
                let dy = rng.vec(m * n, -1.0, 1.0);
                let mut dx = vec![0.0; m * k];
                let mut dw = vec![0.0; n * k];
                let mut db = vec![0.0; n];
                linear_bwd_data(&dy, &w, &mut dx, m, k, n, layout);
                linear_bwd_weight(
                    &x,
                    &dy,
                    &mut dw,
                    with_bias.then_some(&mut db[..]),
                    m,
                    k,
                    n,
                    layout,
                );
                let dy64 = to64(&dy);
                let obj = |t: &[Vec<f64>]| {
                    let b = with_bias.then_some(&t[2][..]);
                    dot(&dy64, &linear_ref(&t[0], &t[1], b, m, k, n, layout))
                };
                let inputs = [to64(&x), to64(&w), to64(&bias)];
                let tag = format!("linear {m}x{k}x{n} {layout:?} bias={with_bias}");
                check_grad(
                    &format!("{tag} dx"),
                    &mut rng,
                    &inputs,
                    0,
                    &dx,
                    PROBES,
                    RTOL,
                    &obj,
                );
                check_grad(
                    &format!("{tag} dw"),
                    &mut rng,
                    &inputs,
                    1,
                    &dw,
                    PROBES,
                    RTOL,
                    &obj,
                );
                if with_bias {
                    check_grad(
                        &format!("{tag} db"),
                        &mut rng,
                        &inputs,
                        2,
                        &db,
                        PROBES,
                        RTOL,
                        &obj,
                    );
                } else {
                    assert!(db.iter().all(|&v| v == 0.0));
                }
            }
        }
    }
}

#[test]
fn embedding_grads() {
    let mut rng = Rng::new(22);
    let (tokens, vocab, h) = (40, 9, 6); // many repeated ids
    let table = rng.vec(vocab * h, -1.0, 1.0);
    let ids: Vec<i32> = (0..tokens).map(|_| rng.below(vocab) as i32).collect();
    let dout = rng.vec(tokens * h, -1.0, 1.0);
    let mut dtable = vec![0.0; vocab * h];
    embedding_bwd(&ids, &dout, h, &mut dtable);
    let d64 = to64(&dout);
    let obj = |t: &[Vec<f64>]| dot(&d64, &embedding_ref(&ids, &t[0], h));
    check_grad(
        "embedding dtable",
        &mut rng,
        &[to64(&table)],
        0,
        &dtable,
        1000,
        RTOL,
        &obj,
    );

    for &(b, s, h, maxpos) in &[(3, 5, 4, 8), (4, 100, 96, 100)] {
        let x = rng.vec(b * s * h, -1.0, 1.0);
        let wpe = rng.vec(maxpos * h, -1.0, 1.0);
        let dout = rng.vec(b * s * h, -1.0, 1.0);
        let mut dx = vec![0.0; b * s * h];
        let mut dwpe = vec![0.0; maxpos * h];
        pos_embedding_bwd(&dout, b, s, h, &mut dx, &mut dwpe);
        let d64 = to64(&dout);
        let obj = |t: &[Vec<f64>]| dot(&d64, &pos_embedding_ref(&t[0], &t[1], b, s, h));
        let inputs = [to64(&x), to64(&wpe[..s * h])];
        check_grad(
            "pos_embedding dx",
            &mut rng,
            &inputs,
            0,
            &dx,
            PROBES,
            RTOL,
            &obj,
        );
        check_grad(
            "pos_embedding dwpe",
            &mut rng,
            &inputs,
            1,
            &dwpe[..s * h],
            PROBES,
            RTOL,
            &obj,
        );
        assert!(
            dwpe[s * h..].iter().all(|&v| v == 0.0),
            "rows past s untouched"
        );
    }
}

#[test]
fn norm_grads() {
    let mut rng = Rng::new(23);
    // Serial, and threaded with several column blocks (h > 64).
    for &(rows, h) in &[(5, 37), (300, 130)] {
        let x = rng.normal(rows * h, 1.5);
        let w = rng.vec(h, 0.5, 1.5);
        let b = rng.vec(h, -0.5, 0.5);
        let dy = rng.vec(rows * h, -1.0, 1.0);
        let d64 = to64(&dy);

        let (mut dx, mut dw) = (vec![0.0; rows * h], vec![0.0; h]);
        rms_norm_bwd(&x, &w, &dy, 1e-6, rows, h, &mut dx, &mut dw);
        let obj = |t: &[Vec<f64>]| dot(&d64, &rms_norm_ref(&t[0], &t[1], 1e-6, rows, h));
        let inputs = [to64(&x), to64(&w)];
        check_grad(
            &format!("rms_norm {rows}x{h} dx"),
            &mut rng,
            &inputs,
            0,
            &dx,
            PROBES,
            RTOL,
            &obj,
        );
        check_grad(
            &format!("rms_norm {rows}x{h} dw"),
            &mut rng,
            &inputs,
            1,
            &dw,
            PROBES,
            RTOL,
            &obj,
        );

        let (mut dx, mut dw, mut db) = (vec![0.0; rows * h], vec![0.0; h], vec![0.0; h]);
        layer_norm_bwd(&x, &w, &dy, 1e-5, rows, h, &mut dx, &mut dw, &mut db);
        let obj = |t: &[Vec<f64>]| dot(&d64, &layer_norm_ref(&t[0], &t[1], &t[2], 1e-5, rows, h));
        let inputs = [to64(&x), to64(&w), to64(&b)];
        check_grad(
            &format!("layer_norm {rows}x{h} dx"),
            &mut rng,
            &inputs,
            0,
            &dx,
            PROBES,
            RTOL,
            &obj,
        );
        check_grad(
            &format!("layer_norm {rows}x{h} dw"),
            &mut rng,
            &inputs,
            1,
            &dw,
            PROBES,
            RTOL,
            &obj,
        );
        check_grad(
            &format!("layer_norm {rows}x{h} db"),
            &mut rng,
            &inputs,
            2,
            &db,
            PROBES,
            RTOL,
            &obj,
        );
    }
}

#[test]
fn rope_grads() {
    let mut rng = Rng::new(24);
    for &(b, s, nh, d) in &[(1, 4, 1, 4), (2, 70, 4, 16)] {
        let x = rng.vec(b * s * nh * d, -1.0, 1.0);
        let dy = rng.vec(x.len(), -1.0, 1.0);
        let mut dx = vec![0.0; x.len()];
        rope_bwd(&dy, b, s, nh, d, 10000.0, &mut dx);
        let d64 = to64(&dy);
        let obj = |t: &[Vec<f64>]| dot(&d64, &rope_ref(&t[0], b, s, nh, d, 10000.0));
        check_grad(
            &format!("rope {b}x{s}x{nh}x{d}"),
            &mut rng,
            &[to64(&x)],
            0,
            &dx,
            PROBES,
            RTOL,
            &obj,
        );
    }
}

#[test]
fn attention_grads_mha_and_gqa() {
    let mut rng = Rng::new(25);
    // (b, s, nh, nkv, d): MHA; GQA nh=4/nkv=2 with s=70 (a full 64-query block plus a
    // ragged one); MQA with exactly one block.
    for &(b, s, nh, nkv, d) in &[(2, 6, 2, 2, 4), (2, 70, 4, 2, 8), (1, 64, 3, 1, 8)] {
        let q = rng.normal(b * s * nh * d, 1.0);
        let k = rng.normal(b * s * nkv * d, 1.0);
        let v = rng.normal(b * s * nkv * d, 1.0);
        let dout = rng.vec(q.len(), -1.0, 1.0);
        let mut out = vec![0.0; q.len()];
        let mut lse = vec![0.0; b * nh * s];
        attention_fwd(&q, &k, &v, b, s, nh, nkv, d, &mut out, &mut lse);
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        attention_bwd(
            &q, &k, &v, &out, &lse, &dout, b, s, nh, nkv, d, &mut dq, &mut dk, &mut dv,
        );
        let d64 = to64(&dout);
        let obj = |t: &[Vec<f64>]| {
            dot(
                &d64,
                &attention_ref(&t[0], &t[1], &t[2], b, s, nh, nkv, d).0,
            )
        };
        let inputs = [to64(&q), to64(&k), to64(&v)];
        let tag = format!("attention b{b} s{s} nh{nh} nkv{nkv} d{d}");
        check_grad(
            &format!("{tag} dq"),
            &mut rng,
            &inputs,
            0,
            &dq,
            PROBES,
            RTOL,
            &obj,
        );
        check_grad(
            &format!("{tag} dk"),
            &mut rng,
            &inputs,
            1,
            &dk,
            PROBES,
            RTOL,
            &obj,
        );
        check_grad(
            &format!("{tag} dv"),
            &mut rng,
            &inputs,
            2,
            &dv,
            PROBES,
            RTOL,
            &obj,
        );
        if s > 64 {
            // The last keys (inside the ragged block, seen by few queries) in full: sample 0,
            // positions s-2 and s-1, for k and v.
            let tail: Vec<usize> = ((s - 2) * nkv * d..s * nkv * d).collect();
            for (which, grad) in [(1, &dk), (2, &dv)] {
                let rms = (grad.iter().map(|&g| (g as f64).powi(2)).sum::<f64>()
                    / grad.len() as f64)
                    .sqrt();
                let num = numeric_grad(&inputs, which, &tail, &obj);
                for (j, &i) in tail.iter().enumerate() {
                    let err = (grad[i] as f64 - num[j]).abs() / (num[j].abs() + rms);
                    assert!(
                        err < RTOL,
                        "{tag} input {which} tail [{i}]: {} vs {}",
                        grad[i],
                        num[j]
                    );
                }
            }
        }
    }
}

#[test]
fn activation_grads() {
    let mut rng = Rng::new(26);
    for &n in &[50, 40_000] {
        let g = rng.normal(n, 3.0);
        let u = rng.normal(n, 1.0);
        let dy = rng.vec(n, -1.0, 1.0);
        let d64 = to64(&dy);
        let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
        swiglu_bwd(&g, &u, &dy, &mut dg, &mut du);
        let obj = |t: &[Vec<f64>]| {
            let y: Vec<f64> = t[0]
                .iter()
                .zip(&t[1])
                .map(|(&g, &u)| silu_ref(g) * u)
                .collect();
            dot(&d64, &y)
        };
        let inputs = [to64(&g), to64(&u)];
        check_grad(
            "swiglu dgate",
            &mut rng,
            &inputs,
            0,
            &dg,
            PROBES,
            RTOL,
            &obj,
        );
        check_grad("swiglu dup", &mut rng, &inputs, 1, &du, PROBES, RTOL, &obj);

        let mut dx = vec![0.0; n];
        gelu_tanh_bwd(&g, &dy, &mut dx);
        let obj = |t: &[Vec<f64>]| {
            let y: Vec<f64> = t[0].iter().map(|&x| gelu_tanh_ref(x)).collect();
            dot(&d64, &y)
        };
        check_grad(
            "gelu_tanh dx",
            &mut rng,
            &[to64(&g)],
            0,
            &dx,
            PROBES,
            RTOL,
            &obj,
        );
    }
}

#[test]
fn cross_entropy_grads() {
    let mut rng = Rng::new(27);
    for &(rows, vocab) in &[(4, 7), (40, 1000)] {
        let logits = rng.normal(rows * vocab, 2.0);
        let mut labels: Vec<i32> = (0..rows).map(|_| rng.below(vocab) as i32).collect();
        labels[1] = -100;
        let scale = 1.0 / (rows - 1) as f32;
        let mut dl = vec![0.0; rows * vocab];
        cross_entropy_bwd(&logits, &labels, rows, vocab, scale, &mut dl);
        let obj = |t: &[Vec<f64>]| scale as f64 * cross_entropy_ref(&t[0], &labels, vocab);
        let inputs = [to64(&logits)];
        check_grad(
            &format!("cross_entropy {rows}x{vocab}"),
            &mut rng,
            &inputs,
            0,
            &dl,
            200,
            RTOL,
            &obj,
        );
        // The label entries (the only negative ones) are always probed.
        let idx: Vec<usize> = (0..rows)
            .filter(|&r| r != 1)
            .map(|r| r * vocab + labels[r] as usize)
            .collect();
        let num = numeric_grad(&inputs, 0, &idx, &obj);
        for (j, &i) in idx.iter().enumerate() {
            assert!(
                (dl[i] as f64 - num[j]).abs() < 1e-5,
                "label entry {i}: {} vs {}",
                dl[i],
                num[j]
            );
        }
        assert!(
            dl[vocab..2 * vocab].iter().all(|&v| v == 0.0),
            "ignored row gets no gradient"
        );
    }
}

#[test]
fn add_backward_is_accumulate() {
    // y = a + b: both inputs receive dy, through `accumulate`.
    let mut rng = Rng::new(28);
    let n = 40;
    let (a, b, dy) = (
        rng.vec(n, -1.0, 1.0),
        rng.vec(n, -1.0, 1.0),
        rng.vec(n, -1.0, 1.0),
    );
    let mut da = vec![0.0; n];
    accumulate(&mut da, &dy);
    let d64 = to64(&dy);
    let obj = |t: &[Vec<f64>]| {
        let y: Vec<f64> = t[0].iter().zip(&t[1]).map(|(a, b)| a + b).collect();
        dot(&d64, &y)
    };
    check_grad(
        "add da",
        &mut rng,
        &[to64(&a), to64(&b)],
        0,
        &da,
        PROBES,
        RTOL,
        &obj,
    );
}
