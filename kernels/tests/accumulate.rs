//! Accumulation semantics: every backward adds into its gradient outputs. Starting from
//! random (non-zero) gradients `g0`, one call gives `g0 + G` and a second `g0 + 2G`, and
//! from zero, two calls give exactly twice one call (up to one rounding).

mod common;

use common::*;
use megac_kernels::*;

/// Runs `bwd` on gradients initialised to `init`, returning them.
fn run(init: &[Vec<f32>], times: usize, bwd: &dyn Fn(&mut [Vec<f32>])) -> Vec<Vec<f32>> {
    let mut g = init.to_vec();
    for _ in 0..times {
        bwd(&mut g);
    }
    g
}

/// Checks `bwd` accumulates into every output of the given sizes.
fn check_accumulates(name: &str, sizes: &[usize], bwd: &dyn Fn(&mut [Vec<f32>])) {
    let mut rng = Rng::new(99);
    let zeros: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.0; n]).collect();
    let g0: Vec<Vec<f32>> = sizes.iter().map(|&n| rng.vec(n, -1.0, 1.0)).collect();
    let once = run(&zeros, 1, bwd);
    let twice = run(&zeros, 2, bwd);
    let from_g0 = run(&g0, 1, bwd);
    let from_g0_twice = run(&g0, 2, bwd);
    for t in 0..sizes.len() {
        let big = once[t].iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(big > 0.0, "{name}: output {t} received no gradient");
        let tol = 1e-6 * big;
        for i in 0..sizes[t] {
            let (g, o) = (once[t][i], g0[t][i]);
            assert!(
                (twice[t][i] - 2.0 * g).abs() <= tol,
                "{name}: output {t}[{i}] not doubled"
            );
            assert!(
                (from_g0[t][i] - (o + g)).abs() <= tol,
                "{name}: output {t}[{i}] overwritten"
            );
            assert!(
                (from_g0_twice[t][i] - (o + 2.0 * g)).abs() <= 2.0 * tol,
                "{name}: output {t}[{i}] after two calls"
            );
        }
    }
}

#[test]
fn linear() {
    let mut rng = Rng::new(1);
    for &(m, k, n) in &[(5, 6, 7), (96, 80, 130)] {
        let (x, w, dy) = (
            rng.vec(m * k, -1.0, 1.0),
            rng.vec(n * k, -1.0, 1.0),
            rng.vec(m * n, -1.0, 1.0),
        );
        for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
            check_accumulates("linear_bwd_data", &[m * k], &|g| {
                linear_bwd_data(&dy, &w, &mut g[0], m, k, n, layout)
            });
            check_accumulates("linear_bwd_weight", &[n * k, n], &|g| {
                let (dw, db) = g.split_at_mut(1);
                linear_bwd_weight(&x, &dy, &mut dw[0], Some(&mut db[0]), m, k, n, layout)
            });
        }
    }
}

#[test]
fn embeddings() {
    let mut rng = Rng::new(2);
    let (tokens, vocab, h) = (30, 8, 5);
    let ids: Vec<i32> = (0..tokens).map(|_| rng.below(vocab) as i32).collect();
    let dout = rng.vec(tokens * h, -1.0, 1.0);
    check_accumulates("embedding_bwd", &[vocab * h], &|g| {
        embedding_bwd(&ids, &dout, h, &mut g[0])
    });
    let (b, s, h) = (3, 6, 4);
    let dout = rng.vec(b * s * h, -1.0, 1.0);
    check_accumulates("pos_embedding_bwd", &[b * s * h, s * h], &|g| {
        let (dx, dw) = g.split_at_mut(1);
        pos_embedding_bwd(&dout, b, s, h, &mut dx[0], &mut dw[0])
    });
}

#[test]
fn norms() {
    let mut rng = Rng::new(3);
    for &(rows, h) in &[(4, 9), (300, 130)] {
        let (x, w, dy) = (
            rng.normal(rows * h, 1.0),
            rng.vec(h, 0.5, 1.5),
            rng.vec(rows * h, -1.0, 1.0),
        );
        check_accumulates("rms_norm_bwd", &[rows * h, h], &|g| {
            let (dx, dw) = g.split_at_mut(1);
            rms_norm_bwd(&x, &w, &dy, 1e-6, rows, h, &mut dx[0], &mut dw[0])
        });
        check_accumulates("layer_norm_bwd", &[rows * h, h, h], &|g| {
            let (dx, rest) = g.split_at_mut(1);
            let (dw, db) = rest.split_at_mut(1);
            layer_norm_bwd(
                &x, &w, &dy, 1e-5, rows, h, &mut dx[0], &mut dw[0], &mut db[0],
            )
        });
    }
}

#[test]
fn rope() {
    let mut rng = Rng::new(4);
    let (b, s, nh, d) = (2, 5, 3, 8);
    let dy = rng.vec(b * s * nh * d, -1.0, 1.0);
    check_accumulates("rope_bwd", &[dy.len()], &|g| {
        rope_bwd(&dy, b, s, nh, d, 10000.0, &mut g[0])
    });
}

#[test]
fn attention() {
    let mut rng = Rng::new(5);
    let (b, s, nh, nkv, d) = (2, 70, 4, 2, 8);
    let (q, k, v) = (
        rng.normal(b * s * nh * d, 1.0),
        rng.normal(b * s * nkv * d, 1.0),
        rng.normal(b * s * nkv * d, 1.0),
    );
    let dout = rng.vec(q.len(), -1.0, 1.0);
    let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; b * nh * s]);
    attention_fwd(&q, &k, &v, b, s, nh, nkv, d, &mut out, &mut lse);
    check_accumulates("attention_bwd", &[q.len(), k.len(), v.len()], &|g| {
        let (dq, rest) = g.split_at_mut(1);
        let (dk, dv) = rest.split_at_mut(1);
        attention_bwd(
            &q, &k, &v, &out, &lse, &dout, b, s, nh, nkv, d, &mut dq[0], &mut dk[0], &mut dv[0],
        )
    });
}

#[test]
fn activations_and_loss() {
    let mut rng = Rng::new(6);
    let n = 50;
    let (a, u, dy) = (
        rng.normal(n, 2.0),
        rng.normal(n, 1.0),
        rng.vec(n, -1.0, 1.0),
    );
    check_accumulates("swiglu_bwd", &[n, n], &|g| {
        let (dg, du) = g.split_at_mut(1);
        swiglu_bwd(&a, &u, &dy, &mut dg[0], &mut du[0])
    });
    check_accumulates("gelu_tanh_bwd", &[n], &|g| {
        gelu_tanh_bwd(&a, &dy, &mut g[0])
    });
    check_accumulates("accumulate", &[n], &|g| accumulate(&mut g[0], &dy));
    let (rows, vocab) = (6, 11);
    let logits = rng.normal(rows * vocab, 2.0);
    let labels: Vec<i32> = (0..rows).map(|r| (r * 3 % vocab) as i32).collect();
    check_accumulates("cross_entropy_bwd", &[rows * vocab], &|g| {
        cross_entropy_bwd(&logits, &labels, rows, vocab, 0.5, &mut g[0])
    });
}
