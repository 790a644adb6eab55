//! Every forward kernel against a naive float64 reference (tests/common), on sizes that
//! take both the serial and the threaded paths. Outputs are pre-filled with NaN to check
//! that forwards overwrite.

mod common;

use common::*;
use megac_kernels::*;

const RTOL: f64 = 1e-5;

fn nan(n: usize) -> Vec<f32> {
    vec![f32::NAN; n]
}

#[test]
fn linear_all_layouts_bias_and_sizes() {
    let mut rng = Rng::new(1);
    // (m, k, n): tiny, ragged, and large enough for gemm's threaded path.
    for &(m, k, n) in &[
        (1, 1, 1),
        (3, 5, 7),
        (17, 33, 9),
        (96, 80, 130),
        (200, 128, 96),
    ] {
        for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
            for with_bias in [false, true] {
                let x = rng.vec(m * k, -1.0, 1.0);
                let w = rng.vec(n * k, -1.0, 1.0);
                let bias = rng.vec(n, -1.0, 1.0);
                let mut y = nan(m * n);
                let b = with_bias.then_some(&bias[..]);
                linear_fwd(&x, &w, b, &mut y, m, k, n, layout);
                let b64 = to64(&bias);
                let want = linear_ref(
                    &to64(&x),
                    &to64(&w),
                    with_bias.then_some(&b64[..]),
                    m,
                    k,
                    n,
                    layout,
                );
                assert_close(
                    &format!("linear {m}x{k}x{n} {layout:?} bias={with_bias}"),
                    &y,
                    &want,
                    RTOL,
                    1e-1,
                );
            }
        }
    }
}

#[test]
fn linear_layouts_agree() {
    // The same math through both layouts (w transposed) gives the same result.
    let mut rng = Rng::new(2);
    let (m, k, n) = (64, 48, 40);
    let x = rng.vec(m * k, -1.0, 1.0);
    let w_oi = rng.vec(n * k, -1.0, 1.0);
    let mut w_io = vec![0.0; k * n];
    for j in 0..n {
        for kk in 0..k {
            w_io[kk * n + j] = w_oi[j * k + kk];
        }
    }
    let (mut y1, mut y2) = (nan(m * n), nan(m * n));
    linear_fwd(&x, &w_oi, None, &mut y1, m, k, n, WeightLayout::OutIn);
    linear_fwd(&x, &w_io, None, &mut y2, m, k, n, WeightLayout::InOut);
    assert_close("layouts", &y1, &to64(&y2), 1e-6, 1e-3);
}

#[test]
fn embeddings() {
    let mut rng = Rng::new(3);
    for &(tokens, vocab, h) in &[(5, 7, 3), (700, 50, 64)] {
        let table = rng.vec(vocab * h, -1.0, 1.0);
        let ids: Vec<i32> = (0..tokens).map(|_| rng.below(vocab) as i32).collect();
        let mut out = nan(tokens * h);
        embedding_fwd(&ids, &table, h, &mut out);
        assert_close(
            "embedding",
            &out,
            &embedding_ref(&ids, &to64(&table), h),
            0.0,
            0.0,
        );
    }
    for &(b, s, h, maxpos) in &[(2, 3, 4, 5), (4, 128, 96, 130)] {
        let x = rng.vec(b * s * h, -1.0, 1.0);
        let wpe = rng.vec(maxpos * h, -1.0, 1.0);
        let mut out = nan(b * s * h);
        pos_embedding_fwd(&x, &wpe, b, s, h, &mut out);
        let want = pos_embedding_ref(&to64(&x), &to64(&wpe), b, s, h);
        assert_close("pos_embedding", &out, &want, 1e-7, 0.0);
    }
}

#[test]
#[should_panic(expected = "outside the table")]
fn embedding_rejects_out_of_range_ids() {
    let mut out = vec![0.0; 2];
    embedding_fwd(&[3], &[0.0; 6], 2, &mut out);
}

#[test]
fn norms() {
    let mut rng = Rng::new(4);
    // (rows, h): serial, and threaded with several column blocks.
    for &(rows, h) in &[(3, 5), (7, 64), (300, 130)] {
        let x = rng.normal(rows * h, 2.0);
        let w = rng.vec(h, 0.5, 1.5);
        let b = rng.vec(h, -0.5, 0.5);
        let mut y = nan(rows * h);
        rms_norm_fwd(&x, &w, 1e-6, rows, h, &mut y);
        let want = rms_norm_ref(&to64(&x), &to64(&w), 1e-6, rows, h);
        assert_close(&format!("rms_norm {rows}x{h}"), &y, &want, RTOL, 1e-2);
        let mut y = nan(rows * h);
        layer_norm_fwd(&x, &w, &b, 1e-5, rows, h, &mut y);
        let want = layer_norm_ref(&to64(&x), &to64(&w), &to64(&b), 1e-5, rows, h);
        assert_close(&format!("layer_norm {rows}x{h}"), &y, &want, RTOL, 1e-2);
    }
}

#[test]
fn layer_norm_of_offset_rows() {
    // A large common offset must not cost precision (two-pass variance).
    let (rows, h) = (4, 32);
    let mut rng = Rng::new(5);
    let x: Vec<f32> = rng
        .vec(rows * h, -1.0, 1.0)
        .iter()
        .map(|v| v + 1000.0)
        .collect();
    let w = vec![1.0; h];
    let b = vec![0.0; h];
    let mut y = nan(rows * h);
    layer_norm_fwd(&x, &w, &b, 1e-5, rows, h, &mut y);
    let want = layer_norm_ref(&to64(&x), &to64(&w), &to64(&b), 1e-5, rows, h);
    assert_close("layer_norm offset", &y, &want, 1e-4, 1e-2);
}

#[test]
fn rope() {
    let mut rng = Rng::new(6);
    for &(b, s, nh, d, theta) in &[
        (1, 3, 1, 2, 10000.0f32),
        (2, 70, 4, 16, 10000.0),
        (2, 300, 2, 64, 500000.0),
    ] {
        let x = rng.vec(b * s * nh * d, -1.0, 1.0);
        let mut y = nan(x.len());
        rope_fwd(&x, b, s, nh, d, theta, &mut y);
        let want = rope_ref(&to64(&x), b, s, nh, d, theta);
        assert_close(&format!("rope {b}x{s}x{nh}x{d}"), &y, &want, RTOL, 1e-2);
    }
}

#[test]
fn rope_position_zero_is_identity() {
    let x = [0.3f32, -1.5, 2.0, 0.25];
    let mut y = [0.0f32; 4];
    rope_fwd(&x, 1, 1, 1, 4, 10000.0, &mut y);
    assert_eq!(x, y);
}

#[test]
fn attention() {
    let mut rng = Rng::new(7);
    // (b, s, nh, nkv, d): tiny, MHA, GQA with a ragged last query block, several blocks.
    for &(b, s, nh, nkv, d) in &[
        (1, 1, 1, 1, 4),
        (2, 5, 2, 2, 8),
        (2, 70, 4, 2, 16),
        (1, 150, 4, 1, 32),
        (3, 64, 2, 1, 8),
    ] {
        let q = rng.normal(b * s * nh * d, 1.0);
        let k = rng.normal(b * s * nkv * d, 1.0);
        let v = rng.normal(b * s * nkv * d, 1.0);
        let mut out = nan(q.len());
        let mut lse = nan(b * nh * s);
        attention_fwd(&q, &k, &v, b, s, nh, nkv, d, &mut out, &mut lse);
        let (want, want_lse) = attention_ref(&to64(&q), &to64(&k), &to64(&v), b, s, nh, nkv, d);
        let tag = format!("attention b{b} s{s} nh{nh} nkv{nkv} d{d}");
        assert_close(&format!("{tag} out"), &out, &want, RTOL, 1e-2);
        assert_close(&format!("{tag} lse"), &lse, &want_lse, RTOL, 1e-2);
    }
}

#[test]
fn attention_first_query_copies_first_value() {
    // Causality: query 0 sees only key 0, so its output is v[0] whatever q and k are.
    let (s, d) = (3, 4);
    let mut rng = Rng::new(8);
    let q = rng.normal(s * d, 3.0);
    let k = rng.normal(s * d, 3.0);
    let v = rng.normal(s * d, 1.0);
    let mut out = vec![0.0; s * d];
    let mut lse = vec![0.0; s];
    attention_fwd(&q, &k, &v, 1, s, 1, 1, d, &mut out, &mut lse);
    assert_eq!(&out[..d], &v[..d]);
}

#[test]
fn activations() {
    let mut rng = Rng::new(9);
    for &n in &[13, 100_000] {
        let g = rng.normal(n, 4.0);
        let u = rng.normal(n, 1.0);
        let mut y = nan(n);
        swiglu_fwd(&g, &u, &mut y);
        let want: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| silu_ref(g as f64) * u as f64)
            .collect();
        assert_close("swiglu", &y, &want, RTOL, 1e-4);
        let mut y = nan(n);
        gelu_tanh_fwd(&g, &mut y);
        let want: Vec<f64> = g.iter().map(|&x| gelu_tanh_ref(x as f64)).collect();
        assert_close("gelu_tanh", &y, &want, RTOL, 1e-4);
    }
    // Extremes: saturation without NaN or inf.
    let x = [-200.0f32, -90.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 90.0, 200.0];
    let mut y = [0.0f32; 9];
    gelu_tanh_fwd(&x, &mut y);
    let want: Vec<f64> = x.iter().map(|&v| gelu_tanh_ref(v as f64)).collect();
    assert_close("gelu extremes", &y, &want, RTOL, 1e-6);
    let ones = [1.0f32; 9];
    swiglu_fwd(&x, &ones, &mut y);
    let want: Vec<f64> = x.iter().map(|&v| silu_ref(v as f64)).collect();
    assert_close("silu extremes", &y, &want, RTOL, 1e-6);
}

#[test]
fn elementwise() {
    let mut rng = Rng::new(10);
    for &n in &[5, 70_000] {
        let a = rng.vec(n, -1.0, 1.0);
        let b = rng.vec(n, -1.0, 1.0);
        let mut y = nan(n);
        add_fwd(&a, &b, &mut y);
        let want: Vec<f64> = a
            .iter()
            .zip(&b)
            .map(|(&a, &b)| a as f64 + b as f64)
            .collect();
        assert_close("add", &y, &want, 1e-7, 1e-6);

        let mut d = a.clone();
        accumulate(&mut d, &b);
        assert_close("accumulate", &d, &want, 1e-7, 1e-6);

        let mut x = a.clone();
        scale_in_place(&mut x, -0.37);
        let want: Vec<f64> = a.iter().map(|&a| (a * -0.37) as f64).collect();
        assert_close("scale_in_place", &x, &want, 0.0, 0.0);

        let want: f64 = a.iter().map(|&v| v as f64 * v as f64).sum();
        let got = sum_squares(&a);
        assert!(
            (got - want).abs() <= 1e-12 * want,
            "sum_squares {got} vs {want}"
        );
    }
    assert_eq!(sum_squares(&[]), 0.0);
    // Large enough for several partial sums; chunked summation must stay exact-ish.
    let big = vec![0.1f32; 300_000];
    let want = 300_000.0 * (0.1f32 as f64).powi(2);
    assert!((sum_squares(&big) - want).abs() <= 1e-10 * want);
}

#[test]
fn cross_entropy() {
    let mut rng = Rng::new(11);
    for &(rows, vocab) in &[(1, 1), (3, 10), (40, 1000), (9, 5003)] {
        let logits = rng.normal(rows * vocab, 3.0);
        let mut labels: Vec<i32> = (0..rows).map(|_| rng.below(vocab) as i32).collect();
        if rows > 2 {
            labels[1] = -100;
        }
        let got = cross_entropy_fwd(&logits, &labels, rows, vocab);
        let want = cross_entropy_ref(&to64(&logits), &labels, vocab);
        assert!(
            (got - want).abs() <= 1e-6 * want.abs().max(1.0),
            "cross_entropy {rows}x{vocab}: {got} vs {want}"
        );
    }
    // Huge logits stay finite (max-shifted log-sum-exp).
    let logits = [1000.0f32, -1000.0, 999.0];
    let got = cross_entropy_fwd(&logits, &[2], 1, 3);
    let want = cross_entropy_ref(&to64(&logits), &[2], 3);
    assert!((got - want).abs() < 1e-6, "{got} vs {want}");
}
