//! Mixture-of-experts kernels: router, load-balancing loss, dispatch and combine.
//!
//! Forwards are compared with float64 references written as plain loops; backwards with
//! central differences of a scalar objective (`Σ R · output` for a random `R`) evaluated
//! by those references, the top-k choice held at the kernel's (it is piecewise constant).
//! Then capacity dropping, accumulation (`+=`) semantics, thread-count independence, the
//! distributed (statistics) form of the auxiliary loss, and a Mixtral block end to end
//! against a float64 transcription of transformers' `MixtralSparseMoeBlock`.

mod common;

use common::*;
use megac_kernels::*;

/// Tolerance of the gradient checks (relative to `|numeric| + rms(analytic)`).
const RTOL: f64 = 1e-5;
/// Coordinates probed per gradient check.
const PROBES: usize = 40;

// ---------------------------------------------------------------------------------
// float64 references.
// ---------------------------------------------------------------------------------

fn softmax_ref(z: &[f64]) -> Vec<f64> {
    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = z.iter().map(|v| (v - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

/// Top-k of one token's probabilities: descending, ties to the lower index.
fn top_k_ref(p: &[f64], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap().then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// Mixtral routing in f64: `(weights, indices)`.
fn router_ref(logits: &[f64], t: usize, e: usize, k: usize) -> (Vec<f64>, Vec<i32>) {
    let mut w = Vec::new();
    let mut ix = Vec::new();
    for tok in 0..t {
        let p = softmax_ref(&logits[tok * e..(tok + 1) * e]);
        let chosen = top_k_ref(&p, k);
        let s: f64 = chosen.iter().map(|&j| p[j]).sum();
        for &j in &chosen {
            w.push(p[j] / s);
            ix.push(j as i32);
        }
    }
    (w, ix)
}

/// Renormalised weights for a fixed choice of experts.
fn weights_for(logits: &[f64], e: usize, indices: &[i32], k: usize) -> Vec<f64> {
    let mut w = Vec::new();
    for (tok, ix) in indices.chunks(k).enumerate() {
        let p = softmax_ref(&logits[tok * e..(tok + 1) * e]);
        let s: f64 = ix.iter().map(|&j| p[j as usize]).sum();
        w.extend(ix.iter().map(|&j| p[j as usize] / s));
    }
    w
}

/// `coeff · E · Σ_e f_e P_e` with `f_e = count_e / (T k)` (the kernels' normalisation).
fn aux_ref(logits: &[f64], t: usize, e: usize, k: usize, indices: &[i32], coeff: f64) -> f64 {
    let mut count = vec![0.0; e];
    for &j in indices {
        count[j as usize] += 1.0;
    }
    let mut pm = vec![0.0; e];
    for tok in 0..t {
        for (a, p) in pm
            .iter_mut()
            .zip(softmax_ref(&logits[tok * e..(tok + 1) * e]))
        {
            *a += p / t as f64;
        }
    }
    coeff
        * e as f64
        * (0..e)
            .map(|x| count[x] / (t * k) as f64 * pm[x])
            .sum::<f64>()
}

/// transformers' `load_balancing_loss_func` for one layer, no mask, written as it is:
/// `tokens_per_expert = mean_t(one_hot(selected))` is `[k, E]`, summed with `P_e`.
fn aux_hf_ref(logits: &[f64], t: usize, e: usize, k: usize) -> f64 {
    let mut tokens_per_expert = vec![0.0; k * e];
    let mut router_prob = vec![0.0; e];
    for tok in 0..t {
        let p = softmax_ref(&logits[tok * e..(tok + 1) * e]);
        for (s, &j) in top_k_ref(&p, k).iter().enumerate() {
            tokens_per_expert[s * e + j] += 1.0 / t as f64;
        }
        for (r, v) in router_prob.iter_mut().zip(&p) {
            *r += v / t as f64;
        }
    }
    let mut loss = 0.0;
    for s in 0..k {
        for x in 0..e {
            loss += tokens_per_expert[s * e + x] * router_prob[x];
        }
    }
    loss * e as f64
}

/// Kept `(token, slot)` per expert, built naively: scan tokens in order per expert.
fn kept_ref(
    indices: &[i32],
    t: usize,
    k: usize,
    e: usize,
    capacity: usize,
) -> Vec<Vec<(usize, usize)>> {
    (0..e)
        .map(|x| {
            let mut v = Vec::new();
            for tok in 0..t {
                for s in 0..k {
                    if indices[tok * k + s] == x as i32 && (capacity == 0 || v.len() < capacity) {
                        v.push((tok, s));
                    }
                }
            }
            v
        })
        .collect()
}

fn combine_ref(
    weights: &[f64],
    kept: &[Vec<(usize, usize)>],
    ys: &[Vec<f64>],
    t: usize,
    k: usize,
    h: usize,
) -> Vec<f64> {
    let mut out = vec![0.0; t * h];
    for (x, list) in kept.iter().enumerate() {
        for (r, &(tok, s)) in list.iter().enumerate() {
            for c in 0..h {
                out[tok * h + c] += weights[tok * k + s] * ys[x][r * h + c];
            }
        }
    }
    out
}

/// Random distinct experts per token (for dispatch/combine tests that do not need a router).
fn random_indices(rng: &mut Rng, t: usize, k: usize, e: usize) -> Vec<i32> {
    let mut ix = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut chosen: Vec<i32> = Vec::new();
        while chosen.len() < k {
            let j = rng.below(e) as i32;
            if !chosen.contains(&j) {
                chosen.push(j);
            }
        }
        ix.extend(chosen);
    }
    ix
}

// ---------------------------------------------------------------------------------
// Router.
// ---------------------------------------------------------------------------------

#[test]
fn router_forward_matches_reference() {
    let mut rng = Rng::new(1);
    // The last case (4096 x 8) takes the threaded path.
    for &(t, e, k) in &[
        (1, 1, 1),
        (7, 8, 2),
        (33, 8, 1),
        (20, 6, 6),
        (9, 64, 8),
        (4096, 8, 2),
    ] {
        let logits = rng.normal(t * e, 2.0);
        let (mut w, mut ix) = (vec![f32::NAN; t * k], vec![-7i32; t * k]);
        router_fwd(&logits, t, e, k, &mut w, &mut ix);
        let (w_ref, ix_ref) = router_ref(&to64(&logits), t, e, k);
        assert_eq!(ix, ix_ref, "router {t}x{e} top{k}: indices");
        assert_close(
            &format!("router {t}x{e} top{k}: weights"),
            &w,
            &w_ref,
            1e-6,
            0.0,
        );
        for row in w.chunks(k) {
            let s: f64 = row.iter().map(|&v| v as f64).sum();
            assert!((s - 1.0).abs() < 1e-6, "weights sum to {s}");
        }
    }
}

#[test]
fn router_ties_go_to_the_lower_expert() {
    // Experts 1, 3 and 4 tie for the top; 0 and 2 tie below them.
    let logits = [0.5f32, 2.0, 0.5, 2.0, 2.0, -1.0];
    let mut w = [0.0f32; 4];
    let mut ix = [0i32; 4];
    router_fwd(&logits, 1, 6, 4, &mut w, &mut ix);
    assert_eq!(ix, [1, 3, 4, 0]);
    // Equal logits, equal weights.
    assert_eq!(w[0], w[1]);
    assert_eq!(w[1], w[2]);
    // All equal: the first k experts, weights 1/k.
    let mut w2 = [0.0f32; 2];
    let mut ix2 = [0i32; 2];
    router_fwd(&[3.0; 5], 1, 5, 2, &mut w2, &mut ix2);
    assert_eq!(ix2, [0, 1]);
    assert_eq!(w2, [0.5, 0.5]);
    // Huge logits stay finite (max-shifted softmax).
    router_fwd(&[1e30, -1e30, 1e30, 0.0, 5.0], 1, 5, 2, &mut w2, &mut ix2);
    assert_eq!((ix2, w2), ([0, 2], [0.5, 0.5]));
}

#[test]
fn router_backward_matches_finite_differences() {
    let mut rng = Rng::new(2);
    for &(t, e, k) in &[(5, 8, 2), (4, 6, 3), (3, 4, 4), (6, 8, 1), (2048, 8, 2)] {
        let logits = rng.normal(t * e, 1.5);
        let (mut w, mut ix) = (vec![0.0; t * k], vec![0; t * k]);
        router_fwd(&logits, t, e, k, &mut w, &mut ix);
        let dw = rng.vec(t * k, -1.0, 1.0);
        let mut dl = vec![0.0f32; t * e];
        router_bwd(&logits, t, e, k, &ix, &dw, &mut dl);
        // Unchosen experts get no gradient through the weights.
        for (tok, row) in dl.chunks(e).enumerate() {
            for (j, &g) in row.iter().enumerate() {
                if !ix[tok * k..(tok + 1) * k].contains(&(j as i32)) {
                    assert_eq!(g, 0.0, "unchosen expert {j} of token {tok} got {g}");
                }
            }
        }
        if k == 1 {
            // One expert: the renormalised weight is identically 1.
            assert!(dl.iter().all(|&g| g.abs() < 1e-7), "top-1 router gradient");
            continue;
        }
        let dw64 = to64(&dw);
        let obj = |x: &[Vec<f64>]| dot(&dw64, &weights_for(&x[0], e, &ix, k));
        check_grad(
            &format!("router {t}x{e} top{k} dlogits"),
            &mut rng,
            &[to64(&logits)],
            0,
            &dl,
            PROBES,
            RTOL,
            &obj,
        );
    }
}

// ---------------------------------------------------------------------------------
// Load-balancing loss.
// ---------------------------------------------------------------------------------

#[test]
fn aux_loss_forward_matches_reference_and_transformers() {
    let mut rng = Rng::new(3);
    for &(t, e, k) in &[(1, 4, 1), (10, 8, 2), (37, 6, 3), (3000, 16, 2)] {
        let logits = rng.normal(t * e, 1.0);
        let (mut w, mut ix) = (vec![0.0; t * k], vec![0; t * k]);
        router_fwd(&logits, t, e, k, &mut w, &mut ix);
        let l64 = to64(&logits);
        let got = moe_aux_loss_fwd(&logits, t, e, k, &ix, 0.02);
        let want = aux_ref(&l64, t, e, k, &ix, 0.02);
        assert!(
            (got - want).abs() <= 1e-6 * want.abs(),
            "aux {t}x{e} top{k}: {got} vs {want}"
        );
        // transformers' value is top_k times this one.
        let hf = aux_hf_ref(&l64, t, e, k);
        let ours = moe_aux_loss_fwd(&logits, t, e, k, &ix, k as f64);
        assert!(
            (ours - hf).abs() <= 1e-6 * hf,
            "vs transformers: {ours} vs {hf}"
        );
    }
    // Perfect balance with uniform probabilities gives coeff exactly.
    let (t, e, k) = (8, 4, 2);
    let ix: Vec<i32> = (0..t * k).map(|i| (i % e) as i32).collect();
    let loss = moe_aux_loss_fwd(&vec![0.0; t * e], t, e, k, &ix, 0.5);
    assert!((loss - 0.5).abs() < 1e-7, "balanced loss {loss}");
    assert_eq!(moe_aux_loss_fwd(&[], 0, 4, 2, &[], 1.0), 0.0);
}

#[test]
fn aux_loss_backward_matches_finite_differences() {
    let mut rng = Rng::new(4);
    for &(t, e, k) in &[(6, 4, 1), (12, 8, 2), (2, 5, 5), (4096, 8, 2)] {
        let logits = rng.normal(t * e, 1.0);
        let (mut w, mut ix) = (vec![0.0; t * k], vec![0; t * k]);
        router_fwd(&logits, t, e, k, &mut w, &mut ix);
        let (coeff, scale) = (0.3, 1.75f32);
        let mut dl = vec![0.0f32; t * e];
        moe_aux_loss_bwd(&logits, t, e, &ix, k, coeff, scale, &mut dl);
        if k == e {
            // Every expert chosen: f_e = 1/E for all, the loss is coeff whatever the logits.
            assert!(dl.iter().all(|&g| g.abs() < 1e-7), "constant loss gradient");
            continue;
        }
        let obj = |x: &[Vec<f64>]| scale as f64 * aux_ref(&x[0], t, e, k, &ix, coeff);
        check_grad(
            &format!("aux {t}x{e} top{k} dlogits"),
            &mut rng,
            &[to64(&logits)],
            0,
            &dl,
            PROBES,
            RTOL,
            &obj,
        );
    }
}

#[test]
fn aux_loss_from_global_statistics_matches_the_whole_batch() {
    // Three "ranks" hold disjoint token ranges; summing their statistics and evaluating
    // from the global ones gives the whole batch's loss, and their gradients concatenate
    // to the whole batch's gradient.
    let mut rng = Rng::new(5);
    let (t, e, k, coeff) = (50, 8, 2, 0.01);
    let logits = rng.normal(t * e, 1.0);
    let (mut w, mut ix) = (vec![0.0; t * k], vec![0; t * k]);
    router_fwd(&logits, t, e, k, &mut w, &mut ix);
    let bounds = [0, 13, 31, 50];
    let mut global = AuxStats::zeros(e);
    let mut flat = vec![0.0f64; 2 * e + 1];
    for r in 0..3 {
        let (a, b) = (bounds[r], bounds[r + 1]);
        let s = moe_aux_stats(&logits[a * e..b * e], b - a, e, k, &ix[a * k..b * k]);
        assert_eq!(s.tokens(), (b - a) as f64);
        assert_eq!(s.counts().iter().sum::<f64>(), ((b - a) * k) as f64);
        global.merge(&s);
        // The all-reduce a runtime would do, on the flat buffer.
        for (f, v) in flat.iter_mut().zip(s.as_slice()) {
            *f += v;
        }
    }
    let from_flat = AuxStats::from_slice(e, &flat);
    assert_eq!(from_flat, global);
    let whole = moe_aux_loss_fwd(&logits, t, e, k, &ix, coeff);
    let dist = moe_aux_loss_from_stats(&global, k, coeff);
    assert!((whole - dist).abs() <= 1e-12 * whole, "{whole} vs {dist}");
    let mut want = vec![0.0f32; t * e];
    moe_aux_loss_bwd(&logits, t, e, &ix, k, coeff, 1.0, &mut want);
    let mut got = vec![0.0f32; t * e];
    for r in 0..3 {
        let (a, b) = (bounds[r], bounds[r + 1]);
        let dl = &mut got[a * e..b * e];
        moe_aux_loss_bwd_from_stats(&logits[a * e..b * e], b - a, e, k, &global, coeff, 1.0, dl);
    }
    assert_eq!(got, want, "sharded gradient differs");
}

// ---------------------------------------------------------------------------------
// Dispatch and combine.
// ---------------------------------------------------------------------------------

#[test]
fn routing_and_dispatch_forward_match_reference() {
    let mut rng = Rng::new(6);
    // The last case takes the threaded paths.
    for &(t, e, k, h, cap) in &[
        (9, 4, 2, 5, 0),
        (9, 4, 2, 5, 3),
        (17, 8, 2, 3, 1),
        (12, 3, 3, 4, 7),
        (1024, 8, 2, 64, 0),
        (1024, 8, 2, 64, 200),
    ] {
        let ix = random_indices(&mut rng, t, k, e);
        let x = rng.vec(t * h, -1.0, 1.0);
        let routing = Routing::new(&ix, t, k, e, cap);
        let kept = kept_ref(&ix, t, k, e, cap);
        let rows = if cap == 0 { t } else { cap };
        let mut dropped = 0;
        for (xe, list) in kept.iter().enumerate() {
            assert_eq!(routing.rows(xe).collect::<Vec<_>>(), *list, "routing rows");
            for (r, &(tok, s)) in list.iter().enumerate() {
                assert_eq!(routing.row_of(tok, s), Some(r));
                assert_eq!(routing.expert_of(tok, s), xe);
            }
            let routed = ix.iter().filter(|&&j| j == xe as i32).count();
            dropped += routed - list.len();
            let mut out = vec![f32::NAN; rows * h];
            let n = dispatch_fwd(&x, &ix, t, h, k, xe, cap, &mut out);
            assert_eq!(n, list.len(), "dispatch count");
            let mut want = vec![0.0f32; rows * h];
            for (r, &(tok, _)) in list.iter().enumerate() {
                want[r * h..(r + 1) * h].copy_from_slice(&x[tok * h..(tok + 1) * h]);
            }
            assert_eq!(out, want, "dispatch rows (expert {xe}, cap {cap})");
            let mut out2 = vec![f32::NAN; rows * h];
            assert_eq!(dispatch_fwd_routed(&x, &routing, xe, h, &mut out2), n);
            assert_eq!(out2, want, "dispatch_fwd_routed");
        }
        assert_eq!(routing.dropped(), dropped);
        for tok in 0..t {
            for s in 0..k {
                let e_ts = routing.expert_of(tok, s);
                let in_list = kept[e_ts].contains(&(tok, s));
                assert_eq!(routing.row_of(tok, s).is_some(), in_list);
            }
        }
    }
}

#[test]
fn capacity_drops_later_tokens_and_combine_ignores_them() {
    // Tokens 0..4 all pick expert 0 first; capacity 2 keeps tokens 0 and 1 for it.
    let (t, e, k, h) = (5, 3, 2, 2);
    let ix = [0, 1, 0, 2, 0, 1, 2, 0, 1, 2];
    let routing = Routing::new(&ix, t, k, e, 2);
    assert_eq!(routing.rows(0).collect::<Vec<_>>(), [(0, 0), (1, 0)]);
    assert_eq!(routing.rows(1).collect::<Vec<_>>(), [(0, 1), (2, 1)]);
    assert_eq!(routing.rows(2).collect::<Vec<_>>(), [(1, 1), (3, 0)]);
    // (2,0)->e0, (3,1)->e0, (4,0)->e1, (4,1)->e2 are beyond capacity.
    assert_eq!(routing.dropped(), 4);
    assert_eq!(routing.row_of(2, 0), None);
    assert_eq!(routing.row_of(4, 1), None);
    let x: Vec<f32> = (0..t * h).map(|i| i as f32 + 1.0).collect();
    let mut out = vec![9.0f32; 3 * h];
    assert_eq!(dispatch_fwd(&x, &ix, t, h, k, 0, 2, &mut out), 2);
    assert_eq!(out, [1.0, 2.0, 3.0, 4.0, 0.0, 0.0]);

    // Each expert returns its row index + 1 times 10^expert in every column.
    let ys: Vec<Vec<f32>> = (0..e)
        .map(|x| {
            (0..2 * h)
                .map(|i| ((i / h) as f32 + 1.0) * 10f32.powi(x as i32))
                .collect()
        })
        .collect();
    let ys_ref: Vec<&[f32]> = ys.iter().map(|y| &y[..]).collect();
    let weights: Vec<f32> = (0..t * k)
        .map(|i| if i % 2 == 0 { 0.75 } else { 0.25 })
        .collect();
    let mut o = vec![f32::NAN; t * h];
    combine_fwd(&weights, &routing, &ys_ref, t, h, &mut o);
    let want = [
        0.75 + 0.25 * 10.0,        // token 0: e0 row 0, e1 row 0
        0.75 * 2.0 + 0.25 * 100.0, // token 1: e0 row 1, e2 row 0
        0.25 * 20.0,               // token 2: e0 dropped, e1 row 1
        0.75 * 200.0,              // token 3: e2 row 1, e0 dropped
        0.0,                       // token 4: both dropped
    ];
    for tok in 0..t {
        for c in 0..h {
            assert_eq!(o[tok * h + c], want[tok] as f32, "token {tok}");
        }
    }
    // Backward: dropped slots get no weight gradient and send nothing to the experts.
    let dout = vec![1.0f32; t * h];
    let mut dw = vec![0.0f32; t * k];
    let mut dys: Vec<Vec<f32>> = (0..e).map(|_| vec![0.0; 2 * h]).collect();
    let mut dys_ref: Vec<&mut [f32]> = dys.iter_mut().map(|d| &mut d[..]).collect();
    combine_bwd(&weights, &routing, &ys_ref, &dout, h, &mut dw, &mut dys_ref);
    assert_eq!(dw[2 * k], 0.0);
    assert_eq!(dw[3 * k + 1], 0.0);
    assert_eq!(&dw[4 * k..], [0.0, 0.0]);
    assert_eq!(dw[0], 2.0);
    assert_eq!(dys[0], [0.75, 0.75, 0.75, 0.75]);
    assert_eq!(dys[2], [0.25, 0.25, 0.75, 0.75]);
    let mut dx = vec![0.0f32; t * h];
    dispatch_bwd(&[1.0, 1.0, 2.0, 2.0, 5.0, 5.0], &routing, 0, h, &mut dx);
    assert_eq!(dx, [1.0, 1.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
}

#[test]
fn combine_forward_matches_reference() {
    let mut rng = Rng::new(7);
    for &(t, e, k, h, cap) in &[(11, 4, 2, 6, 0), (11, 4, 2, 6, 4), (1024, 8, 2, 64, 0)] {
        let ix = random_indices(&mut rng, t, k, e);
        let routing = Routing::new(&ix, t, k, e, cap);
        let kept = kept_ref(&ix, t, k, e, cap);
        let rows = if cap == 0 { t } else { cap };
        let weights = rng.vec(t * k, 0.0, 1.0);
        let ys: Vec<Vec<f32>> = (0..e).map(|_| rng.vec(rows * h, -1.0, 1.0)).collect();
        let ys_ref: Vec<&[f32]> = ys.iter().map(|y| &y[..]).collect();
        let mut out = vec![f32::NAN; t * h];
        combine_fwd(&weights, &routing, &ys_ref, t, h, &mut out);
        let ys64: Vec<Vec<f64>> = ys.iter().map(|y| to64(y)).collect();
        let want = combine_ref(&to64(&weights), &kept, &ys64, t, k, h);
        assert_close(&format!("combine {t} cap {cap}"), &out, &want, 1e-6, 1e-6);
    }
}

#[test]
fn combine_and_dispatch_backward_match_finite_differences() {
    let mut rng = Rng::new(8);
    for &(t, e, k, h, cap) in &[(7, 4, 2, 3, 0), (9, 3, 2, 4, 4), (600, 8, 2, 64, 0)] {
        let ix = random_indices(&mut rng, t, k, e);
        let routing = Routing::new(&ix, t, k, e, cap);
        let kept = kept_ref(&ix, t, k, e, cap);
        let rows = if cap == 0 { t } else { cap };
        let weights = rng.vec(t * k, 0.0, 1.0);
        let ys: Vec<Vec<f32>> = (0..e).map(|_| rng.vec(rows * h, -1.0, 1.0)).collect();
        let ys_ref: Vec<&[f32]> = ys.iter().map(|y| &y[..]).collect();
        let dout = rng.vec(t * h, -1.0, 1.0);
        let mut dw = vec![0.0f32; t * k];
        let mut dys: Vec<Vec<f32>> = (0..e).map(|_| vec![0.0; rows * h]).collect();
        {
            let mut dys_ref: Vec<&mut [f32]> = dys.iter_mut().map(|d| &mut d[..]).collect();
            combine_bwd(&weights, &routing, &ys_ref, &dout, h, &mut dw, &mut dys_ref);
        }
        // inputs: [weights, y_0, .., y_{E-1}]
        let mut inputs = vec![to64(&weights)];
        inputs.extend(ys.iter().map(|y| to64(y)));
        let d64 = to64(&dout);
        let obj = |x: &[Vec<f64>]| dot(&d64, &combine_ref(&x[0], &kept, &x[1..], t, k, h));
        let tag = format!("combine {t}x{e} cap {cap}");
        check_grad(
            &format!("{tag} dweights"),
            &mut rng,
            &inputs,
            0,
            &dw,
            PROBES,
            RTOL,
            &obj,
        );
        for x in 0..e {
            if kept[x].is_empty() {
                assert!(dys[x].iter().all(|&g| g == 0.0));
                continue;
            }
            check_grad(
                &format!("{tag} dy{x}"),
                &mut rng,
                &inputs,
                1 + x,
                &dys[x],
                PROBES,
                RTOL,
                &obj,
            );
        }

        // Dispatch backward: objective Σ_e R_e · dispatch_e(x).
        let x = rng.vec(t * h, -1.0, 1.0);
        let rs: Vec<Vec<f64>> = (0..e)
            .map(|_| to64(&rng.vec(rows * h, -1.0, 1.0)))
            .collect();
        let mut dx = vec![0.0f32; t * h];
        for (xe, r) in rs.iter().enumerate() {
            let r32: Vec<f32> = r.iter().map(|&v| v as f32).collect();
            dispatch_bwd(&r32, &routing, xe, h, &mut dx);
        }
        let obj = |xs: &[Vec<f64>]| {
            let mut total = 0.0;
            for (xe, list) in kept.iter().enumerate() {
                for (r, &(tok, _)) in list.iter().enumerate() {
                    for c in 0..h {
                        total += rs[xe][r * h + c] * xs[0][tok * h + c];
                    }
                }
            }
            total
        };
        check_grad(
            &format!("dispatch {t}x{e} cap {cap} dx"),
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

// ---------------------------------------------------------------------------------
// Accumulation and determinism.
// ---------------------------------------------------------------------------------

/// Runs `bwd` from zero once and twice, and from random `g0` once: two calls must give
/// twice one call, and `g0 + G` must show nothing was overwritten.
fn check_accumulates(name: &str, sizes: &[usize], bwd: &dyn Fn(&mut [Vec<f32>])) {
    let mut rng = Rng::new(99);
    let run = |init: &[Vec<f32>], times: usize| {
        let mut g = init.to_vec();
        for _ in 0..times {
            bwd(&mut g);
        }
        g
    };
    let zeros: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.0; n]).collect();
    let g0: Vec<Vec<f32>> = sizes.iter().map(|&n| rng.vec(n, -1.0, 1.0)).collect();
    let (once, twice, from_g0) = (run(&zeros, 1), run(&zeros, 2), run(&g0, 1));
    for o in 0..sizes.len() {
        let big = once[o].iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(big > 0.0, "{name}: output {o} received no gradient");
        let tol = 1e-6 * big;
        for i in 0..sizes[o] {
            let g = once[o][i];
            assert!(
                (twice[o][i] - 2.0 * g).abs() <= tol,
                "{name}: output {o}[{i}] not doubled"
            );
            assert!(
                (from_g0[o][i] - (g0[o][i] + g)).abs() <= tol,
                "{name}: output {o}[{i}] overwritten"
            );
        }
    }
}

#[test]
fn backward_kernels_accumulate() {
    let mut rng = Rng::new(10);
    let (t, e, k, h) = (40, 8, 2, 8);
    let logits = rng.normal(t * e, 1.0);
    let (mut w, mut ix) = (vec![0.0; t * k], vec![0; t * k]);
    router_fwd(&logits, t, e, k, &mut w, &mut ix);
    let dw = rng.vec(t * k, -1.0, 1.0);
    check_accumulates("router_bwd", &[t * e], &|g| {
        router_bwd(&logits, t, e, k, &ix, &dw, &mut g[0])
    });
    check_accumulates("moe_aux_loss_bwd", &[t * e], &|g| {
        moe_aux_loss_bwd(&logits, t, e, &ix, k, 0.1, 1.0, &mut g[0])
    });
    let stats = moe_aux_stats(&logits, t, e, k, &ix);
    check_accumulates("moe_aux_loss_bwd_from_stats", &[t * e], &|g| {
        moe_aux_loss_bwd_from_stats(&logits, t, e, k, &stats, 0.1, 1.0, &mut g[0])
    });
    let routing = Routing::new(&ix, t, k, e, 0);
    let dy = rng.vec(t * h, -1.0, 1.0);
    check_accumulates("dispatch_bwd", &[t * h], &|g| {
        dispatch_bwd(&dy, &routing, 3, h, &mut g[0])
    });
    let ys: Vec<Vec<f32>> = (0..e).map(|_| rng.vec(t * h, -1.0, 1.0)).collect();
    let ys_ref: Vec<&[f32]> = ys.iter().map(|y| &y[..]).collect();
    let dout = rng.vec(t * h, -1.0, 1.0);
    check_accumulates("combine_bwd dweights", &[t * k], &|g| {
        let mut dys: Vec<Vec<f32>> = (0..e).map(|_| vec![0.0; t * h]).collect();
        let mut dys_ref: Vec<&mut [f32]> = dys.iter_mut().map(|d| &mut d[..]).collect();
        combine_bwd(&w, &routing, &ys_ref, &dout, h, &mut g[0], &mut dys_ref);
    });
    // Only the rows in use receive gradient: check those, and that the rest stay zero.
    let used: Vec<usize> = (0..e).map(|x| routing.count(x) * h).collect();
    check_accumulates("combine_bwd dys", &used, &|g| {
        let mut dws = vec![0.0f32; t * k];
        let mut full: Vec<Vec<f32>> = g
            .iter()
            .map(|gi| {
                let mut v = gi.clone();
                v.resize(t * h, 0.0);
                v
            })
            .collect();
        let mut dys_ref: Vec<&mut [f32]> = full.iter_mut().map(|d| &mut d[..]).collect();
        combine_bwd(&w, &routing, &ys_ref, &dout, h, &mut dws, &mut dys_ref);
        for (gi, f) in g.iter_mut().zip(&full) {
            let n = gi.len();
            gi.copy_from_slice(&f[..n]);
            assert!(
                f[n..].iter().all(|&v| v == 0.0),
                "rows past the count touched"
            );
        }
    });
}

#[test]
fn results_do_not_depend_on_thread_count() {
    let mut rng = Rng::new(11);
    let (t, e, k, h) = (4096, 8, 2, 64);
    let logits = rng.normal(t * e, 1.0);
    let x = rng.vec(t * h, -1.0, 1.0);
    let dw = rng.vec(t * k, -1.0, 1.0);
    let dout = rng.vec(t * h, -1.0, 1.0);
    let all = || {
        let (mut w, mut ix) = (vec![0.0; t * k], vec![0; t * k]);
        router_fwd(&logits, t, e, k, &mut w, &mut ix);
        let mut dl = vec![0.0f32; t * e];
        router_bwd(&logits, t, e, k, &ix, &dw, &mut dl);
        let loss = moe_aux_loss_fwd(&logits, t, e, k, &ix, 0.01);
        moe_aux_loss_bwd(&logits, t, e, &ix, k, 0.01, 1.0, &mut dl);
        let routing = Routing::new(&ix, t, k, e, 1000);
        let mut ys = vec![vec![0.0f32; 1000 * h]; e];
        for (xe, y) in ys.iter_mut().enumerate() {
            dispatch_fwd_routed(&x, &routing, xe, h, y);
        }
        let ys_ref: Vec<&[f32]> = ys.iter().map(|y| &y[..]).collect();
        let mut out = vec![0.0f32; t * h];
        combine_fwd(&w, &routing, &ys_ref, t, h, &mut out);
        let mut dws = vec![0.0f32; t * k];
        let mut dys = vec![vec![0.0f32; 1000 * h]; e];
        let mut dys_ref: Vec<&mut [f32]> = dys.iter_mut().map(|d| &mut d[..]).collect();
        combine_bwd(&w, &routing, &ys_ref, &dout, h, &mut dws, &mut dys_ref);
        let mut dx = vec![0.0f32; t * h];
        for (xe, d) in dys.iter().enumerate() {
            dispatch_bwd(d, &routing, xe, h, &mut dx);
        }
        (w, ix, dl, loss, out, dws, dys, dx)
    };
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(all);
    let many = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap()
        .install(all);
    assert!(one == many, "results differ between 1 and 4 threads");
}

// ---------------------------------------------------------------------------------
// A Mixtral block end to end.
// ---------------------------------------------------------------------------------

/// Sizes and parameters of a tiny Mixtral sparse MoE block (`torch.nn.Linear` layouts:
/// gate `[E, h]`, w1 and w3 `[ffn, h]`, w2 `[h, ffn]`).
struct Block {
    t: usize,
    h: usize,
    ffn: usize,
    e: usize,
    k: usize,
}

/// transformers' `MixtralSparseMoeBlock.forward` in f64, one token at a time: router
/// logits, softmax, top-k, renormalise, `Σ w · w2(silu(w1 x) * w3 x)`.
/// `p = [x, gate, w1_0, w3_0, w2_0, w1_1, ...]`.
fn mixtral_ref(b: &Block, p: &[Vec<f64>]) -> Vec<f64> {
    let (h, ffn, e, k) = (b.h, b.ffn, b.e, b.k);
    let mut out = vec![0.0; b.t * h];
    for tok in 0..b.t {
        let x = &p[0][tok * h..(tok + 1) * h];
        let logits = linear_ref(x, &p[1], None, 1, h, e, WeightLayout::OutIn);
        let probs = softmax_ref(&logits);
        let chosen = top_k_ref(&probs, k);
        let s: f64 = chosen.iter().map(|&j| probs[j]).sum();
        for &j in &chosen {
            let (w1, w3, w2) = (&p[2 + 3 * j], &p[3 + 3 * j], &p[4 + 3 * j]);
            let g = linear_ref(x, w1, None, 1, h, ffn, WeightLayout::OutIn);
            let u = linear_ref(x, w3, None, 1, h, ffn, WeightLayout::OutIn);
            let a: Vec<f64> = g.iter().zip(&u).map(|(&g, &u)| silu_ref(g) * u).collect();
            let y = linear_ref(&a, w2, None, 1, ffn, h, WeightLayout::OutIn);
            for c in 0..h {
                out[tok * h + c] += probs[j] / s * y[c];
            }
        }
    }
    out
}

/// The block with the kernels: forward output, and for `dout` the gradients of
/// `Σ dout · out` with respect to every parameter (same order as `p`).
fn mixtral_kernels(b: &Block, p: &[Vec<f32>], dout: &[f32]) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (t, h, ffn, e, k) = (b.t, b.h, b.ffn, b.e, b.k);
    let lin = WeightLayout::OutIn;
    let x = &p[0];
    let mut logits = vec![0.0f32; t * e];
    linear_fwd(x, &p[1], None, &mut logits, t, h, e, lin);
    let (mut w, mut ix) = (vec![0.0f32; t * k], vec![0i32; t * k]);
    router_fwd(&logits, t, e, k, &mut w, &mut ix);
    let routing = Routing::new(&ix, t, k, e, 0);
    // Per expert: (xe, g, u, a, y) for the rows in use.
    let mut saved = Vec::new();
    let mut ys = Vec::new();
    for j in 0..e {
        let mut xe = vec![0.0f32; t * h];
        let n = dispatch_fwd(x, &ix, t, h, k, j, 0, &mut xe);
        assert_eq!(n, routing.count(j));
        xe.truncate(n * h);
        let (mut g, mut u, mut a) = (vec![0.0; n * ffn], vec![0.0; n * ffn], vec![0.0; n * ffn]);
        linear_fwd(&xe, &p[2 + 3 * j], None, &mut g, n, h, ffn, lin);
        linear_fwd(&xe, &p[3 + 3 * j], None, &mut u, n, h, ffn, lin);
        swiglu_fwd(&g, &u, &mut a);
        let mut y = vec![0.0f32; t * h];
        linear_fwd(&a, &p[4 + 3 * j], None, &mut y[..n * h], n, ffn, h, lin);
        ys.push(y);
        saved.push((xe, g, u, a));
    }
    let ys_ref: Vec<&[f32]> = ys.iter().map(|y| &y[..]).collect();
    let mut out = vec![0.0f32; t * h];
    combine_fwd(&w, &routing, &ys_ref, t, h, &mut out);

    // Backward.
    let mut grads: Vec<Vec<f32>> = p.iter().map(|v| vec![0.0; v.len()]).collect();
    let mut dw = vec![0.0f32; t * k];
    let mut dys: Vec<Vec<f32>> = (0..e).map(|_| vec![0.0; t * h]).collect();
    {
        let mut dys_ref: Vec<&mut [f32]> = dys.iter_mut().map(|d| &mut d[..]).collect();
        combine_bwd(&w, &routing, &ys_ref, dout, h, &mut dw, &mut dys_ref);
    }
    let mut dx = vec![0.0f32; t * h];
    for j in 0..e {
        let n = routing.count(j);
        let (xe, g, u, a) = &saved[j];
        let dy = &dys[j][..n * h];
        let mut da = vec![0.0f32; n * ffn];
        linear_bwd_data(dy, &p[4 + 3 * j], &mut da, n, ffn, h, lin);
        linear_bwd_weight(a, dy, &mut grads[4 + 3 * j], None, n, ffn, h, lin);
        let (mut dg, mut du) = (vec![0.0f32; n * ffn], vec![0.0f32; n * ffn]);
        swiglu_bwd(g, u, &da, &mut dg, &mut du);
        let mut dxe = vec![0.0f32; n * h];
        linear_bwd_data(&dg, &p[2 + 3 * j], &mut dxe, n, h, ffn, lin);
        linear_bwd_data(&du, &p[3 + 3 * j], &mut dxe, n, h, ffn, lin);
        linear_bwd_weight(xe, &dg, &mut grads[2 + 3 * j], None, n, h, ffn, lin);
        linear_bwd_weight(xe, &du, &mut grads[3 + 3 * j], None, n, h, ffn, lin);
        dispatch_bwd(&dxe, &routing, j, h, &mut dx);
    }
    let mut dlogits = vec![0.0f32; t * e];
    router_bwd(&logits, t, e, k, &ix, &dw, &mut dlogits);
    linear_bwd_data(&dlogits, &p[1], &mut dx, t, h, e, lin);
    linear_bwd_weight(x, &dlogits, &mut grads[1], None, t, h, e, lin);
    for (g, d) in grads[0].iter_mut().zip(&dx) {
        *g += d;
    }
    (out, grads)
}

#[test]
fn mixtral_block_matches_transformers_math() {
    let mut rng = Rng::new(12);
    let b = Block {
        t: 24,
        h: 16,
        ffn: 24,
        e: 4,
        k: 2,
    };
    let mut p = vec![rng.normal(b.t * b.h, 1.0), rng.normal(b.e * b.h, 0.5)];
    for _ in 0..b.e {
        p.push(rng.normal(b.ffn * b.h, 0.25));
        p.push(rng.normal(b.ffn * b.h, 0.25));
        p.push(rng.normal(b.h * b.ffn, 0.25));
    }
    let dout = rng.vec(b.t * b.h, -1.0, 1.0);
    let (out, grads) = mixtral_kernels(&b, &p, &dout);
    let p64: Vec<Vec<f64>> = p.iter().map(|v| to64(v)).collect();
    let want = mixtral_ref(&b, &p64);
    assert_close("mixtral block output", &out, &want, 1e-5, 1e-2);

    // Every parameter's gradient against central differences of the f64 block (the
    // routing is re-decided by the reference; the step is far too small to flip it).
    let d64 = to64(&dout);
    let obj = |x: &[Vec<f64>]| dot(&d64, &mixtral_ref(&b, x));
    let names = ["x", "gate"];
    for (i, g) in grads.iter().enumerate() {
        let name = if i < 2 {
            names[i].to_string()
        } else {
            let j = (i - 2) / 3;
            format!("experts.{j}.{}", ["w1", "w3", "w2"][(i - 2) % 3])
        };
        check_grad(
            &format!("mixtral d{name}"),
            &mut rng,
            &p64,
            i,
            g,
            12,
            1e-4,
            &obj,
        );
    }
}

/// The top-k probabilities as they are (Qwen2-MoE's `norm_topk_prob = false`).
fn raw_weights_for(logits: &[f64], e: usize, indices: &[i32], k: usize) -> Vec<f64> {
    let mut w = Vec::new();
    for (tok, ix) in indices.chunks(k).enumerate() {
        let p = softmax_ref(&logits[tok * e..(tok + 1) * e]);
        w.extend(ix.iter().map(|&j| p[j as usize]));
    }
    w
}

/// Without renormalisation the weights are the chosen softmax probabilities (the forward
/// picks the same experts), and every expert's logit gets a gradient through the softmax.
#[test]
fn unnormalised_router_matches_reference_and_finite_differences() {
    let mut rng = Rng::new(5);
    for &(t, e, k) in &[(5, 8, 2), (4, 6, 3), (6, 8, 1), (2048, 8, 2)] {
        let logits = rng.normal(t * e, 1.5);
        let (mut w, mut ix) = (vec![0.0; t * k], vec![0; t * k]);
        router_fwd_with(&logits, t, e, k, false, &mut w, &mut ix);
        let (mut wn, mut ixn) = (vec![0.0; t * k], vec![0; t * k]);
        router_fwd(&logits, t, e, k, &mut wn, &mut ixn);
        assert_eq!(ix, ixn, "the same experts with and without renormalisation");
        let want = raw_weights_for(&to64(&logits), e, &ix, k);
        for (a, b) in w.iter().zip(&want) {
            assert!((*a as f64 - b).abs() < 1e-6, "weight {a} vs {b}");
        }
        let dw = rng.vec(t * k, -1.0, 1.0);
        let mut dl = vec![0.0f32; t * e];
        router_bwd_with(&logits, t, e, k, false, &ix, &dw, &mut dl);
        let dw64 = to64(&dw);
        let obj = |x: &[Vec<f64>]| dot(&dw64, &raw_weights_for(&x[0], e, &ix, k));
        check_grad(
            &format!("unnormalised router {t}x{e} top{k} dlogits"),
            &mut rng,
            &[to64(&logits)],
            0,
            &dl,
            PROBES,
            RTOL,
            &obj,
        );
    }
}

/// Qwen2-MoE's shared-expert gate: `sigmoid(g[t]) · x[t, :]` against a float64 reference,
/// its backward against finite differences, and `+=` into the gradients.
#[test]
fn sigmoid_mul_matches_reference_and_finite_differences() {
    let mut rng = Rng::new(6);
    let (t, h) = (7, 5);
    let g = rng.normal(t, 2.0);
    let x = rng.normal(t * h, 1.0);
    let mut y = vec![0.0f32; t * h];
    sigmoid_mul_fwd(&g, &x, h, &mut y);
    let reference = |g: &[f64], x: &[f64]| -> Vec<f64> {
        x.iter()
            .enumerate()
            .map(|(i, &x)| x / (1.0 + (-g[i / h]).exp()))
            .collect()
    };
    for (a, b) in y.iter().zip(reference(&to64(&g), &to64(&x))) {
        assert!((*a as f64 - b).abs() < 1e-6, "{a} vs {b}");
    }
    let r = rng.vec(t * h, -1.0, 1.0);
    let (mut dg, mut dx) = (vec![0.0f32; t], vec![0.0f32; t * h]);
    sigmoid_mul_bwd(&g, &x, &r, h, &mut dg, &mut dx);
    let r64 = to64(&r);
    let obj = |v: &[Vec<f64>]| dot(&r64, &reference(&v[0], &v[1]));
    let inputs = [to64(&g), to64(&x)];
    check_grad(
        "sigmoid_mul dgate",
        &mut rng,
        &inputs,
        0,
        &dg,
        PROBES,
        RTOL,
        &obj,
    );
    check_grad(
        "sigmoid_mul dx",
        &mut rng,
        &inputs,
        1,
        &dx,
        PROBES,
        RTOL,
        &obj,
    );
    check_accumulates("sigmoid_mul_bwd", &[t, t * h], &|o| {
        let (a, b) = o.split_at_mut(1);
        sigmoid_mul_bwd(&g, &x, &r, h, &mut a[0], &mut b[0])
    });
}
