//! Context-parallel kernels (src/context.rs): position-aware RoPE, block attention masked
//! by global position, the log-sum-exp merge of partial results, and the block backward
//! driven by the final (merged) `out`/`lse`; also the full mask of the shared masked block
//! kernel. Checked against the single-device kernels, against a float64 reference, by
//! finite differences, and in a simulated CP run.

mod common;

use common::*;
use megac_kernels::*;

const THETA: f32 = 10000.0;
const RTOL: f64 = 1e-5;
const PROBES: usize = 48;

fn nan(n: usize) -> Vec<f32> {
    vec![f32::NAN; n]
}

fn iota(n: usize) -> Vec<u32> {
    (0..n as u32).collect()
}

fn rms(x: &[f32]) -> f64 {
    (x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / x.len().max(1) as f64).sqrt()
}

/// `|got - want| <= tol * (|want| + rms(want))` elementwise; `-inf` must match `-inf`.
fn assert_near(name: &str, got: &[f32], want: &[f32], tol: f64) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let finite: Vec<f32> = want.iter().copied().filter(|v| v.is_finite()).collect();
    let floor = rms(&finite);
    let mut worst = (0.0f64, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w == f32::NEG_INFINITY {
            assert_eq!(g, w, "{name}[{i}]: got {g}, want -inf");
            continue;
        }
        assert!(g.is_finite(), "{name}[{i}] = {g} is not finite (want {w})");
        let err = (g as f64 - w as f64).abs() / (w.abs() as f64 + floor + f64::MIN_POSITIVE);
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let i = worst.1;
    assert!(
        worst.0 <= tol,
        "{name}: relative error {:.3e} > {tol:.1e} at [{i}]: got {}, want {}",
        worst.0,
        got[i],
        want[i]
    );
}

/// Rows `positions` of each sample of a `[b, s, w]` tensor, as `[b, positions.len(), w]`.
fn gather_rows(x: &[f32], b: usize, s: usize, w: usize, positions: &[u32]) -> Vec<f32> {
    assert_eq!(x.len(), b * s * w);
    let mut out = Vec::with_capacity(b * positions.len() * w);
    for bi in 0..b {
        for &p in positions {
            let o = (bi * s + p as usize) * w;
            out.extend_from_slice(&x[o..o + w]);
        }
    }
    out
}

/// `dst[b, positions[i], :] += src[b, i, :]`.
fn scatter_add_rows(dst: &mut [f32], src: &[f32], b: usize, s: usize, w: usize, positions: &[u32]) {
    let n = positions.len();
    assert_eq!(src.len(), b * n * w);
    for bi in 0..b {
        for (i, &p) in positions.iter().enumerate() {
            let (o, so) = ((bi * s + p as usize) * w, (bi * n + i) * w);
            for c in 0..w {
                dst[o + c] += src[so + c];
            }
        }
    }
}

/// Columns `positions` of each `[s]` row of a `[rows, s]` tensor (lse is `[b, nh, s]`).
fn gather_cols(x: &[f32], rows: usize, s: usize, positions: &[u32]) -> Vec<f32> {
    assert_eq!(x.len(), rows * s);
    let mut out = Vec::with_capacity(rows * positions.len());
    for r in 0..rows {
        out.extend(positions.iter().map(|&p| x[r * s + p as usize]));
    }
    out
}

/// Concatenates per-rank `[b, n_r, w]` tensors along the sequence (an all-gather).
fn concat_seq(parts: &[Vec<f32>], b: usize, w: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for bi in 0..b {
        for p in parts {
            let n = p.len() / (b * w);
            out.extend_from_slice(&p[bi * n * w..(bi + 1) * n * w]);
        }
    }
    out
}

/// Rows `lo..hi` of each sample of a `[b, s, w]` tensor.
fn seq_slice(x: &[f32], b: usize, s: usize, w: usize, lo: usize, hi: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(b * (hi - lo) * w);
    for bi in 0..b {
        out.extend_from_slice(&x[(bi * s + lo) * w..(bi * s + hi) * w]);
    }
    out
}

/// Float64 reference of [`attention_block_fwd`]: returns (out, lse) with `out = 0`,
/// `lse = -inf` for queries that see no key.
#[allow(clippy::too_many_arguments)]
fn block_ref(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    q_pos: &[u32],
    k_pos: &[u32],
    b: usize,
    sq: usize,
    sk: usize,
    nh: usize,
    nkv: usize,
    d: usize,
) -> (Vec<f64>, Vec<f64>) {
    window_ref(q, k, v, q_pos, k_pos, 0, b, sq, sk, nh, nkv, d)
}

/// [`block_ref`] under a sliding window (query `i` sees key `j` iff `k_pos[j] <= q_pos[i]`
/// and `q_pos[i] - k_pos[j] < window`; 0: no window), written from the definition.
#[allow(clippy::too_many_arguments)]
fn window_ref(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    q_pos: &[u32],
    k_pos: &[u32],
    window: u32,
    b: usize,
    sq: usize,
    sk: usize,
    nh: usize,
    nkv: usize,
    d: usize,
) -> (Vec<f64>, Vec<f64>) {
    let group = nh / nkv;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0.0; b * sq * nh * d];
    let mut lse = vec![f64::NEG_INFINITY; b * nh * sq];
    for bi in 0..b {
        for h in 0..nh {
            let kvh = h / group;
            for i in 0..sq {
                let qo = ((bi * sq + i) * nh + h) * d;
                let allowed: Vec<usize> = (0..sk)
                    .filter(|&j| {
                        k_pos[j] <= q_pos[i] && (window == 0 || q_pos[i] - k_pos[j] < window)
                    })
                    .collect();
                if allowed.is_empty() {
                    continue;
                }
                let sc: Vec<f64> = allowed
                    .iter()
                    .map(|&j| {
                        let ko = ((bi * sk + j) * nkv + kvh) * d;
                        (0..d).map(|c| q[qo + c] * k[ko + c]).sum::<f64>() * scale
                    })
                    .collect();
                let mx = sc.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
                let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
                let sum: f64 = e.iter().sum();
                lse[(bi * nh + h) * sq + i] = mx + sum.ln();
                for (t, &j) in allowed.iter().enumerate() {
                    let vo = ((bi * sk + j) * nkv + kvh) * d;
                    for c in 0..d {
                        out[qo + c] += e[t] / sum * v[vo + c];
                    }
                }
            }
        }
    }
    (out, lse)
}

struct Fwd {
    out: Vec<f32>,
    lse: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn block_fwd(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_pos: &[u32],
    k_pos: &[u32],
    b: usize,
    nh: usize,
    nkv: usize,
    d: usize,
) -> Fwd {
    let (sq, sk) = (q_pos.len(), k_pos.len());
    let mut out = nan(b * sq * nh * d);
    let mut lse = nan(b * nh * sq);
    attention_block_fwd(
        q, k, v, q_pos, k_pos, b, sq, sk, nh, nkv, d, &mut out, &mut lse,
    );
    Fwd { out, lse }
}

/// Key blocks of the load-balanced layout: block `r` holds chunks `r` and `2cp-1-r`.
fn rank_blocks(s: usize, cp: usize) -> Vec<Vec<u32>> {
    (0..cp).map(|r| cp_local_positions(s, cp, r)).collect()
}

#[test]
fn local_positions_are_load_balanced() {
    assert_eq!(
        cp_local_positions(16, 2, 0),
        vec![0, 1, 2, 3, 12, 13, 14, 15]
    );
    assert_eq!(cp_local_positions(16, 2, 1), vec![4, 5, 6, 7, 8, 9, 10, 11]);
    assert_eq!(cp_local_positions(8, 1, 0), iota(8));
    let mut all: Vec<u32> = (0..4).flat_map(|r| cp_local_positions(24, 4, r)).collect();
    all.sort_unstable();
    assert_eq!(all, iota(24));
}

/// (g) RoPE at explicit positions equals RoPE on the full sequence at those rows, forward
/// and (accumulating) backward, bit for bit.
#[test]
fn rope_positions_match_full_sequence() {
    let mut rng = Rng::new(101);
    for &(b, s, nh, d) in &[(1, 8, 1, 4), (2, 48, 3, 16), (2, 256, 4, 64)] {
        let x = rng.normal(b * s * nh * d, 1.0);
        let w = nh * d;
        let mut y = nan(x.len());
        rope_fwd(&x, b, s, nh, d, THETA, &mut y);
        let dy = rng.normal(x.len(), 1.0);
        let seed = rng.normal(x.len(), 1.0);
        let mut dx = seed.clone();
        rope_bwd(&dy, b, s, nh, d, THETA, &mut dx);

        // Positions 0..s: identical to rope_fwd / rope_bwd.
        let mut y2 = nan(x.len());
        rope_fwd_positions(&x, b, s, nh, d, THETA, &iota(s), &mut y2);
        assert_eq!(y2, y, "rope_fwd_positions(0..s) != rope_fwd");
        let mut dx2 = seed.clone();
        rope_bwd_positions(&dy, b, s, nh, d, THETA, &iota(s), &mut dx2);
        assert_eq!(dx2, dx, "rope_bwd_positions(0..s) != rope_bwd");

        // Load-balanced CP positions and an arbitrary (shuffled, repeated) set.
        let mut sets: Vec<Vec<u32>> = (0..2).map(|r| cp_local_positions(s, 2, r)).collect();
        sets.push((0..s / 2).map(|_| rng.below(s) as u32).collect());
        for pos in sets {
            let n = pos.len();
            let xl = gather_rows(&x, b, s, w, &pos);
            let mut yl = nan(xl.len());
            rope_fwd_positions(&xl, b, n, nh, d, THETA, &pos, &mut yl);
            assert_eq!(yl, gather_rows(&y, b, s, w, &pos), "rope fwd at {pos:?}");
            let dyl = gather_rows(&dy, b, s, w, &pos);
            let seedl = gather_rows(&seed, b, s, w, &pos);
            let mut dxl = seedl.clone();
            rope_bwd_positions(&dyl, b, n, nh, d, THETA, &pos, &mut dxl);
            // rope_bwd at those rows, accumulated onto the same seed.
            let mut full = vec![0.0; x.len()];
            rope_bwd(&dy, b, s, nh, d, THETA, &mut full);
            let want: Vec<f32> = gather_rows(&full, b, s, w, &pos)
                .iter()
                .zip(&seedl)
                .map(|(&g, &sd)| sd + g)
                .collect();
            assert_eq!(dxl, want, "rope bwd at {pos:?}");
        }
    }
}

/// (a) With positions 0..s and every key, the block kernels are the causal attention
/// kernels (MHA, GQA, MQA; one and several query blocks), backward accumulating.
#[test]
fn full_positions_match_causal_attention() {
    let mut rng = Rng::new(102);
    for &(b, s, nh, nkv, d) in &[
        (1, 6, 2, 2, 4),
        (2, 70, 4, 2, 8),
        (1, 130, 3, 1, 16),
        (2, 64, 8, 2, 64),
    ] {
        let q = rng.normal(b * s * nh * d, 1.0);
        let k = rng.normal(b * s * nkv * d, 1.0);
        let v = rng.normal(b * s * nkv * d, 1.0);
        let dout = rng.normal(q.len(), 1.0);
        let tag = format!("b{b} s{s} nh{nh} nkv{nkv} d{d}");

        let mut out = nan(q.len());
        let mut lse = nan(b * nh * s);
        attention_fwd(&q, &k, &v, b, s, nh, nkv, d, &mut out, &mut lse);
        let pos = iota(s);
        let f = block_fwd(&q, &k, &v, &pos, &pos, b, nh, nkv, d);
        assert_near(&format!("{tag} out"), &f.out, &out, 1e-6);
        assert_near(&format!("{tag} lse"), &f.lse, &lse, 1e-6);

        let seeds = [
            rng.normal(q.len(), 1.0),
            rng.normal(k.len(), 1.0),
            rng.normal(v.len(), 1.0),
        ];
        let (mut dq, mut dk, mut dv) = (seeds[0].clone(), seeds[1].clone(), seeds[2].clone());
        attention_bwd(
            &q, &k, &v, &out, &lse, &dout, b, s, nh, nkv, d, &mut dq, &mut dk, &mut dv,
        );
        let (mut dq2, mut dk2, mut dv2) = (seeds[0].clone(), seeds[1].clone(), seeds[2].clone());
        attention_block_bwd(
            &q, &k, &v, &f.out, &f.lse, &dout, &pos, &pos, b, s, s, nh, nkv, d, &mut dq2, &mut dk2,
            &mut dv2,
        );
        assert_near(&format!("{tag} dq"), &dq2, &dq, 1e-6);
        assert_near(&format!("{tag} dk"), &dk2, &dk, 1e-6);
        assert_near(&format!("{tag} dv"), &dv2, &dv, 1e-6);
    }
}

/// (b, c, e) Keys split into the load-balanced blocks (2 and 4 ranks) and into single
/// chunks: per-block forwards merged by log-sum-exp equal the full causal attention, and
/// the block backwards with the merged out/lse sum to the full backward.
#[test]
fn key_blocks_merge_to_full_attention() {
    let mut rng = Rng::new(103);
    for &(b, s, nh, nkv, d, cp) in &[
        (2, 16, 4, 2, 8, 2),
        (2, 32, 4, 2, 8, 4),
        (1, 24, 2, 2, 16, 2),
        (1, 160, 6, 2, 8, 2),
    ] {
        let q = rng.normal(b * s * nh * d, 1.0);
        let k = rng.normal(b * s * nkv * d, 1.0);
        let v = rng.normal(b * s * nkv * d, 1.0);
        let dout = rng.normal(q.len(), 1.0);
        let mut out = nan(q.len());
        let mut lse = nan(b * nh * s);
        attention_fwd(&q, &k, &v, b, s, nh, nkv, d, &mut out, &mut lse);
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        attention_bwd(
            &q, &k, &v, &out, &lse, &dout, b, s, nh, nkv, d, &mut dq, &mut dk, &mut dv,
        );

        let c = s / (2 * cp);
        let chunks: Vec<Vec<u32>> = (0..2 * cp)
            .map(|i| (i * c..(i + 1) * c).map(|p| p as u32).collect())
            .collect();
        // Blocks in ring order (rank 0's chunks, rank 1's, ...) and the single chunks in
        // reverse order (the later ones first: their lse is -inf for early queries).
        let splits = [rank_blocks(s, cp), chunks.into_iter().rev().collect()];
        let qpos = iota(s);
        let wk = nkv * d;
        for blocks in &splits {
            let tag = format!("b{b} s{s} nh{nh} nkv{nkv} d{d} blocks {}", blocks.len());
            // Forward: merge out-of-place pairwise, and in place as a ring does.
            let parts: Vec<Fwd> = blocks
                .iter()
                .map(|kp| {
                    let kb = gather_rows(&k, b, s, wk, kp);
                    let vb = gather_rows(&v, b, s, wk, kp);
                    block_fwd(&q, &kb, &vb, &qpos, kp, b, nh, nkv, d)
                })
                .collect();
            let mut acc_out = parts[0].out.clone();
            let mut acc_lse = parts[0].lse.clone();
            for p in &parts[1..] {
                attention_merge_into(&mut acc_out, &mut acc_lse, &p.out, &p.lse, b, s, nh, d);
            }
            assert_near(&format!("{tag} merged out"), &acc_out, &out, 2e-6);
            assert_near(&format!("{tag} merged lse"), &acc_lse, &lse, 2e-6);
            let mut m_out = parts[0].out.clone();
            let mut m_lse = parts[0].lse.clone();
            for p in &parts[1..] {
                let (mut o2, mut l2) = (nan(m_out.len()), nan(m_lse.len()));
                attention_merge(
                    &m_out, &m_lse, &p.out, &p.lse, b, s, nh, d, &mut o2, &mut l2,
                );
                (m_out, m_lse) = (o2, l2);
            }
            assert_eq!(
                m_out, acc_out,
                "{tag}: attention_merge != attention_merge_into"
            );
            assert_eq!(
                m_lse, acc_lse,
                "{tag}: attention_merge != attention_merge_into"
            );

            // Backward per block with the merged (final) out and lse.
            let (mut dq2, mut dk2, mut dv2) =
                (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
            for kp in blocks {
                let kb = gather_rows(&k, b, s, wk, kp);
                let vb = gather_rows(&v, b, s, wk, kp);
                let (mut dkb, mut dvb) = (vec![0.0; kb.len()], vec![0.0; vb.len()]);
                attention_block_bwd(
                    &q,
                    &kb,
                    &vb,
                    &acc_out,
                    &acc_lse,
                    &dout,
                    &qpos,
                    kp,
                    b,
                    s,
                    kp.len(),
                    nh,
                    nkv,
                    d,
                    &mut dq2,
                    &mut dkb,
                    &mut dvb,
                );
                scatter_add_rows(&mut dk2, &dkb, b, s, wk, kp);
                scatter_add_rows(&mut dv2, &dvb, b, s, wk, kp);
            }
            assert_near(&format!("{tag} dq"), &dq2, &dq, 5e-6);
            assert_near(&format!("{tag} dk"), &dk2, &dk, 5e-6);
            assert_near(&format!("{tag} dv"), &dv2, &dv, 5e-6);
        }
    }
}

/// (d) A simulated CP run, S = 16, cp = 2 (chunks of 4; rank 0 holds chunks 0 and 3, rank
/// 1 chunks 1 and 2), RoPE included: each rank ropes its local q/k at their global
/// positions, then attends (all-gather variant, K/V in rank order or in global order; ring
/// variant, one block per rank merged). Local out/lse rows equal those of the full causal
/// attention; dq/dk/dv (dk/dv summed over ranks, back through RoPE) equal the full
/// gradients.
#[test]
fn cp_simulation_matches_full_attention() {
    let (b, s, nh, nkv, d, cp) = (2, 16, 4, 2, 8, 2);
    let mut rng = Rng::new(104);
    let (wq, wk) = (nh * d, nkv * d);
    let q = rng.normal(b * s * wq, 1.0);
    let k = rng.normal(b * s * wk, 1.0);
    let v = rng.normal(b * s * wk, 1.0);
    let dout = rng.normal(q.len(), 1.0);

    // Single device: rope, causal attention, and back.
    let (mut qr, mut kr) = (nan(q.len()), nan(k.len()));
    rope_fwd(&q, b, s, nh, d, THETA, &mut qr);
    rope_fwd(&k, b, s, nkv, d, THETA, &mut kr);
    let mut out = nan(q.len());
    let mut lse = nan(b * nh * s);
    attention_fwd(&qr, &kr, &v, b, s, nh, nkv, d, &mut out, &mut lse);
    let (mut dqr, mut dkr, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    attention_bwd(
        &qr, &kr, &v, &out, &lse, &dout, b, s, nh, nkv, d, &mut dqr, &mut dkr, &mut dv,
    );
    let (mut dq, mut dk) = (vec![0.0; q.len()], vec![0.0; k.len()]);
    rope_bwd(&dqr, b, s, nh, d, THETA, &mut dq);
    rope_bwd(&dkr, b, s, nkv, d, THETA, &mut dk);

    let pos: Vec<Vec<u32>> = rank_blocks(s, cp);
    assert_eq!(pos[0], vec![0, 1, 2, 3, 12, 13, 14, 15]);
    assert_eq!(pos[1], vec![4, 5, 6, 7, 8, 9, 10, 11]);
    let n = s / cp;
    // Each rank's local tensors after RoPE at its global positions.
    let local = |x: &[f32], w: usize, r: usize| gather_rows(x, b, s, w, &pos[r]);
    let roped = |x: &[f32], heads: usize, r: usize| {
        let mut y = nan(b * n * heads * d);
        rope_fwd_positions(x, b, n, heads, d, THETA, &pos[r], &mut y);
        y
    };
    let q_loc: Vec<Vec<f32>> = (0..cp).map(|r| roped(&local(&q, wq, r), nh, r)).collect();
    let k_loc: Vec<Vec<f32>> = (0..cp).map(|r| roped(&local(&k, wk, r), nkv, r)).collect();
    let v_loc: Vec<Vec<f32>> = (0..cp).map(|r| local(&v, wk, r)).collect();
    let dout_loc: Vec<Vec<f32>> = (0..cp).map(|r| local(&dout, wq, r)).collect();

    for variant in ["all-gather rank order", "all-gather global order", "ring"] {
        // Per rank: final out/lse, dq (pre-rope), and dk/dv contributions for every
        // rank's keys (indexed by owner), summed over ranks at the end (reduce-scatter).
        let mut dk_to: Vec<Vec<f32>> = (0..cp).map(|_| vec![0.0; b * n * wk]).collect();
        let mut dv_to: Vec<Vec<f32>> = (0..cp).map(|_| vec![0.0; b * n * wk]).collect();
        for r in 0..cp {
            let (o_r, l_r, dq_r) = match variant {
                "ring" => {
                    // Steps t = 0..cp: the block of rank (r - t) mod cp arrives.
                    let order: Vec<usize> = (0..cp).map(|t| (r + cp - t) % cp).collect();
                    let mut acc: Option<Fwd> = None;
                    for &src in &order {
                        let f = block_fwd(
                            &q_loc[r],
                            &k_loc[src],
                            &v_loc[src],
                            &pos[r],
                            &pos[src],
                            b,
                            nh,
                            nkv,
                            d,
                        );
                        acc = Some(match acc {
                            None => f,
                            Some(mut a) => {
                                attention_merge_into(
                                    &mut a.out, &mut a.lse, &f.out, &f.lse, b, n, nh, d,
                                );
                                a
                            }
                        });
                    }
                    let a = acc.unwrap();
                    let mut dq_r = vec![0.0; b * n * wq];
                    for &src in &order {
                        attention_block_bwd(
                            &q_loc[r],
                            &k_loc[src],
                            &v_loc[src],
                            &a.out,
                            &a.lse,
                            &dout_loc[r],
                            &pos[r],
                            &pos[src],
                            b,
                            n,
                            n,
                            nh,
                            nkv,
                            d,
                            &mut dq_r,
                            &mut dk_to[src],
                            &mut dv_to[src],
                        );
                    }
                    (a.out, a.lse, dq_r)
                }
                _ => {
                    let global = variant.ends_with("global order");
                    let (kg, vg, kpos) = if global {
                        // Every rank's rows put back at their global positions.
                        let (mut kg, mut vg) = (vec![0.0; b * s * wk], vec![0.0; b * s * wk]);
                        for src in 0..cp {
                            scatter_add_rows(&mut kg, &k_loc[src], b, s, wk, &pos[src]);
                            scatter_add_rows(&mut vg, &v_loc[src], b, s, wk, &pos[src]);
                        }
                        (kg, vg, iota(s))
                    } else {
                        let kpos: Vec<u32> = pos.concat();
                        (concat_seq(&k_loc, b, wk), concat_seq(&v_loc, b, wk), kpos)
                    };
                    let f = block_fwd(&q_loc[r], &kg, &vg, &pos[r], &kpos, b, nh, nkv, d);
                    let mut dq_r = vec![0.0; b * n * wq];
                    let (mut dkg, mut dvg) = (vec![0.0; kg.len()], vec![0.0; vg.len()]);
                    attention_block_bwd(
                        &q_loc[r],
                        &kg,
                        &vg,
                        &f.out,
                        &f.lse,
                        &dout_loc[r],
                        &pos[r],
                        &kpos,
                        b,
                        n,
                        s,
                        nh,
                        nkv,
                        d,
                        &mut dq_r,
                        &mut dkg,
                        &mut dvg,
                    );
                    // Reduce-scatter: each owner's rows of the gathered gradient.
                    for src in 0..cp {
                        let (dks, dvs) = if global {
                            (
                                gather_rows(&dkg, b, s, wk, &pos[src]),
                                gather_rows(&dvg, b, s, wk, &pos[src]),
                            )
                        } else {
                            (
                                seq_slice(&dkg, b, s, wk, src * n, (src + 1) * n),
                                seq_slice(&dvg, b, s, wk, src * n, (src + 1) * n),
                            )
                        };
                        for (a, x) in dk_to[src].iter_mut().zip(&dks) {
                            *a += x;
                        }
                        for (a, x) in dv_to[src].iter_mut().zip(&dvs) {
                            *a += x;
                        }
                    }
                    (f.out, f.lse, dq_r)
                }
            };
            let tag = format!("{variant} rank {r}");
            assert_near(
                &format!("{tag} out"),
                &o_r,
                &gather_rows(&out, b, s, wq, &pos[r]),
                2e-6,
            );
            assert_near(
                &format!("{tag} lse"),
                &l_r,
                &gather_cols(&lse, b * nh, s, &pos[r]),
                2e-6,
            );
            let mut dq_raw = vec![0.0; dq_r.len()];
            rope_bwd_positions(&dq_r, b, n, nh, d, THETA, &pos[r], &mut dq_raw);
            assert_near(
                &format!("{tag} dq"),
                &dq_raw,
                &gather_rows(&dq, b, s, wq, &pos[r]),
                5e-6,
            );
        }
        for r in 0..cp {
            let tag = format!("{variant} rank {r}");
            let mut dk_raw = vec![0.0; dk_to[r].len()];
            rope_bwd_positions(&dk_to[r], b, n, nkv, d, THETA, &pos[r], &mut dk_raw);
            assert_near(
                &format!("{tag} dk"),
                &dk_raw,
                &gather_rows(&dk, b, s, wk, &pos[r]),
                5e-6,
            );
            assert_near(
                &format!("{tag} dv"),
                &dv_to[r],
                &gather_rows(&dv, b, s, wk, &pos[r]),
                5e-6,
            );
        }
    }
}

/// (f, e, h) Finite differences of the block kernels with arbitrary (shuffled, repeated)
/// positions, GQA, and queries that see no key: forward against the float64 reference;
/// backward of one block, and of several blocks driven by the merged out/lse, against
/// central differences of the reference.
#[test]
fn block_gradients_by_finite_differences() {
    let mut rng = Rng::new(105);
    // (b, sq, sk, nh, nkv, d)
    for &(b, sq, sk, nh, nkv, d) in &[(2, 5, 7, 4, 2, 4), (1, 70, 9, 4, 2, 8), (2, 6, 80, 2, 1, 8)]
    {
        let q = rng.normal(b * sq * nh * d, 1.0);
        let k = rng.normal(b * sk * nkv * d, 1.0);
        let v = rng.normal(b * sk * nkv * d, 1.0);
        let dout = rng.vec(q.len(), -1.0, 1.0);
        // Keys at shuffled positions 2..2+sk (with a repeat); queries at random positions
        // in 0..sk+4 with the first at 0 (sees no key).
        let mut k_pos: Vec<u32> = (2..2 + sk as u32).collect();
        for i in (1..sk).rev() {
            k_pos.swap(i, rng.below(i + 1));
        }
        k_pos[sk - 1] = k_pos[0];
        let mut q_pos: Vec<u32> = (0..sq).map(|_| rng.below(sk + 4) as u32).collect();
        q_pos[0] = 0;
        let tag = format!("b{b} sq{sq} sk{sk} nh{nh} nkv{nkv} d{d}");

        let f = block_fwd(&q, &k, &v, &q_pos, &k_pos, b, nh, nkv, d);
        let (ro, rl) = block_ref(
            &to64(&q),
            &to64(&k),
            &to64(&v),
            &q_pos,
            &k_pos,
            b,
            sq,
            sk,
            nh,
            nkv,
            d,
        );
        assert_close(&format!("{tag} out"), &f.out, &ro, RTOL, 1e-2);
        for (i, (&g, &w)) in f.lse.iter().zip(&rl).enumerate() {
            if w == f64::NEG_INFINITY {
                assert_eq!(g, f32::NEG_INFINITY, "{tag} lse[{i}]");
            } else {
                assert!(
                    (g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "{tag} lse[{i}]: {g} vs {w}"
                );
            }
        }

        let d64 = to64(&dout);
        let obj = |t: &[Vec<f64>]| {
            dot(
                &d64,
                &block_ref(&t[0], &t[1], &t[2], &q_pos, &k_pos, b, sq, sk, nh, nkv, d).0,
            )
        };
        let inputs = [to64(&q), to64(&k), to64(&v)];

        // One block.
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        attention_block_bwd(
            &q, &k, &v, &f.out, &f.lse, &dout, &q_pos, &k_pos, b, sq, sk, nh, nkv, d, &mut dq,
            &mut dk, &mut dv,
        );
        // Three key blocks (keys 0..a, a..c, c..sk), merged, backward per block.
        let cuts = [0, sk / 3, 2 * sk / 3, sk];
        let wk = nkv * d;
        let mut acc: Option<Fwd> = None;
        for w in cuts.windows(2) {
            let (kb, vb) = (
                seq_slice(&k, b, sk, wk, w[0], w[1]),
                seq_slice(&v, b, sk, wk, w[0], w[1]),
            );
            let p = block_fwd(&q, &kb, &vb, &q_pos, &k_pos[w[0]..w[1]], b, nh, nkv, d);
            acc = Some(match acc {
                None => p,
                Some(mut a) => {
                    attention_merge_into(&mut a.out, &mut a.lse, &p.out, &p.lse, b, sq, nh, d);
                    a
                }
            });
        }
        let a = acc.unwrap();
        assert_near(&format!("{tag} 3-block out"), &a.out, &f.out, 2e-6);
        assert_near(&format!("{tag} 3-block lse"), &a.lse, &f.lse, 2e-6);
        let (mut dq3, mut dk3, mut dv3) =
            (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        for w in cuts.windows(2) {
            let (kb, vb) = (
                seq_slice(&k, b, sk, wk, w[0], w[1]),
                seq_slice(&v, b, sk, wk, w[0], w[1]),
            );
            let n = w[1] - w[0];
            let (mut dkb, mut dvb) = (vec![0.0; kb.len()], vec![0.0; vb.len()]);
            attention_block_bwd(
                &q,
                &kb,
                &vb,
                &a.out,
                &a.lse,
                &dout,
                &q_pos,
                &k_pos[w[0]..w[1]],
                b,
                sq,
                n,
                nh,
                nkv,
                d,
                &mut dq3,
                &mut dkb,
                &mut dvb,
            );
            let kp: Vec<u32> = (w[0] as u32..w[1] as u32).collect();
            scatter_add_rows(&mut dk3, &dkb, b, sk, wk, &kp);
            scatter_add_rows(&mut dv3, &dvb, b, sk, wk, &kp);
        }

        for (label, grads) in [
            ("1 block", [&dq, &dk, &dv]),
            ("3 blocks", [&dq3, &dk3, &dv3]),
        ] {
            for (which, (name, g)) in ["dq", "dk", "dv"].iter().zip(grads).enumerate() {
                check_grad(
                    &format!("{tag} {label} {name}"),
                    &mut rng,
                    &inputs,
                    which,
                    g,
                    PROBES,
                    RTOL,
                    &obj,
                );
            }
        }
        // Queries that see no key get no gradient.
        for bi in 0..b {
            for (i, &qp) in q_pos.iter().enumerate() {
                if k_pos.iter().all(|&kp| kp > qp) {
                    let o = (bi * sq + i) * nh * d;
                    assert!(
                        dq[o..o + nh * d].iter().all(|&x| x == 0.0),
                        "{tag} dq row {i}"
                    );
                    assert!(
                        dq3[o..o + nh * d].iter().all(|&x| x == 0.0),
                        "{tag} dq3 row {i}"
                    );
                }
            }
        }
    }
}

/// (h) Queries with no allowed key: forward writes exactly 0 and -inf (over NaN-filled
/// outputs), an empty key block too; the backward leaves their gradients and every key's
/// untouched; merging treats a -inf side as absent, whatever its `out` holds.
#[test]
fn rows_without_keys() {
    let (b, sq, sk, nh, nkv, d) = (2, 4, 3, 4, 2, 8);
    let mut rng = Rng::new(106);
    let q = rng.normal(b * sq * nh * d, 1.0);
    let k = rng.normal(b * sk * nkv * d, 1.0);
    let v = rng.normal(b * sk * nkv * d, 1.0);
    let dout = rng.normal(q.len(), 1.0);
    let (w, wk) = (nh * d, nkv * d);

    // Keys at 10, 11, 12: queries at 3 and 9 see nothing, 10 sees one key, 20 all three.
    let q_pos = [3u32, 10, 9, 20];
    let k_pos = [12u32, 10, 11];
    let f = block_fwd(&q, &k, &v, &q_pos, &k_pos, b, nh, nkv, d);
    for bi in 0..b {
        for h in 0..nh {
            for (i, &qp) in q_pos.iter().enumerate() {
                let l = f.lse[(bi * nh + h) * sq + i];
                let o = &f.out[(bi * sq + i) * w + h * d..][..d];
                if qp < 10 {
                    assert_eq!(l, f32::NEG_INFINITY);
                    assert!(o.iter().all(|&x| x == 0.0), "row {i} out {o:?}");
                } else {
                    assert!(l.is_finite());
                }
                if qp == 10 {
                    // One key (index 1): out is exactly its value row, lse its score.
                    let vo = &v[(bi * sk + 1) * wk + (h / 2) * d..][..d];
                    assert_near("single key out", o, vo, 1e-6);
                }
            }
        }
    }

    // Backward: the empty rows get no dq; seeds show accumulation and nothing NaN.
    let seeds = [
        rng.normal(q.len(), 1.0),
        rng.normal(k.len(), 1.0),
        rng.normal(v.len(), 1.0),
    ];
    let (mut dq, mut dk, mut dv) = (seeds[0].clone(), seeds[1].clone(), seeds[2].clone());
    attention_block_bwd(
        &q, &k, &v, &f.out, &f.lse, &dout, &q_pos, &k_pos, b, sq, sk, nh, nkv, d, &mut dq, &mut dk,
        &mut dv,
    );
    for bi in 0..b {
        for i in [0usize, 2] {
            let o = (bi * sq + i) * w;
            assert_eq!(dq[o..o + w], seeds[0][o..o + w], "empty row {i} got a dq");
        }
        let o = (bi * sq + 1) * w;
        assert_ne!(dq[o..o + w], seeds[0][o..o + w], "row 1 got no dq");
    }
    assert!(dq.iter().chain(&dk).chain(&dv).all(|x| x.is_finite()));

    // Every query blind (all lse -inf): the backward adds nothing.
    let blind = [0u32, 1, 2, 3];
    let fb = block_fwd(&q, &k, &v, &blind, &k_pos, b, nh, nkv, d);
    assert!(fb.lse.iter().all(|&l| l == f32::NEG_INFINITY));
    assert!(fb.out.iter().all(|&x| x == 0.0));
    let (mut dq2, mut dk2, mut dv2) = (seeds[0].clone(), seeds[1].clone(), seeds[2].clone());
    attention_block_bwd(
        &q, &k, &v, &fb.out, &fb.lse, &dout, &blind, &k_pos, b, sq, sk, nh, nkv, d, &mut dq2,
        &mut dk2, &mut dv2,
    );
    assert_eq!(dq2, seeds[0]);
    assert_eq!(dk2, seeds[1]);
    assert_eq!(dv2, seeds[2]);

    // An empty key block.
    let fe = block_fwd(&q, &[], &[], &q_pos, &[], b, nh, nkv, d);
    assert!(fe.lse.iter().all(|&l| l == f32::NEG_INFINITY));
    assert!(fe.out.iter().all(|&x| x == 0.0));
    let mut dq3 = seeds[0].clone();
    attention_block_bwd(
        &q,
        &[],
        &[],
        &f.out,
        &f.lse,
        &dout,
        &q_pos,
        &[],
        b,
        sq,
        0,
        nh,
        nkv,
        d,
        &mut dq3,
        &mut [],
        &mut [],
    );
    assert_eq!(dq3, seeds[0]);

    // Merge: a -inf side is ignored (even with NaN out); both -inf gives 0 / -inf.
    let s = sq;
    let ln = b * nh * s;
    let out_a = rng.normal(q.len(), 1.0);
    let lse_a: Vec<f32> = (0..ln)
        .map(|i| {
            if i % 3 == 0 {
                f32::NEG_INFINITY
            } else {
                rng.uniform(-2.0, 2.0)
            }
        })
        .collect();
    let lse_b: Vec<f32> = (0..ln)
        .map(|i| {
            if i % 2 == 0 {
                f32::NEG_INFINITY
            } else {
                rng.uniform(-2.0, 2.0)
            }
        })
        .collect();
    let mut out_b = rng.normal(q.len(), 1.0);
    let mut out_a2 = out_a.clone();
    for bi in 0..b {
        for h in 0..nh {
            for i in 0..s {
                let li = (bi * nh + h) * s + i;
                let o = (bi * s + i) * w + h * d;
                if lse_b[li] == f32::NEG_INFINITY {
                    out_b[o..o + d].fill(f32::NAN);
                }
                if lse_a[li] == f32::NEG_INFINITY {
                    out_a2[o..o + d].fill(f32::NAN);
                }
            }
        }
    }
    let (mut out, mut lse) = (nan(q.len()), nan(ln));
    attention_merge(
        &out_a2, &lse_a, &out_b, &lse_b, b, s, nh, d, &mut out, &mut lse,
    );
    for bi in 0..b {
        for h in 0..nh {
            for i in 0..s {
                let li = (bi * nh + h) * s + i;
                let o = (bi * s + i) * w + h * d;
                let (la, lb) = (lse_a[li], lse_b[li]);
                let got = &out[o..o + d];
                match (la == f32::NEG_INFINITY, lb == f32::NEG_INFINITY) {
                    (true, true) => {
                        assert_eq!(lse[li], f32::NEG_INFINITY);
                        assert!(got.iter().all(|&x| x == 0.0));
                    }
                    (true, false) => {
                        assert_eq!(lse[li], lb);
                        assert_eq!(got, &out_b[o..o + d]);
                    }
                    (false, true) => {
                        assert_eq!(lse[li], la);
                        assert_eq!(got, &out_a[o..o + d]);
                    }
                    (false, false) => {
                        let (la, lb) = (la as f64, lb as f64);
                        let m = la.max(lb);
                        let l = m + ((la - m).exp() + (lb - m).exp()).ln();
                        assert!((lse[li] as f64 - l).abs() <= 1e-6 * (1.0 + l.abs()));
                        let (wa, wb) = ((la - l).exp(), (lb - l).exp());
                        for c in 0..d {
                            let want = wa * out_a[o + c] as f64 + wb * out_b[o + c] as f64;
                            assert!(
                                (got[c] as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                                "merge [{li}, {c}]: {} vs {want}",
                                got[c]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The full mask of the shared masked block kernel: every query sees every key, so it
/// equals the float64 reference with every key visible, and its backward equals the
/// positional backward with every key visible.
#[test]
fn full_mask_matches_reference() {
    let mut rng = Rng::new(107);
    // (b, sq, sk, nh, nkv, d)
    for &(b, sq, sk, nh, nkv, d) in &[(2, 5, 7, 4, 2, 4), (1, 70, 9, 4, 2, 8), (2, 6, 80, 2, 1, 8)]
    {
        let q = rng.normal(b * sq * nh * d, 1.0);
        let k = rng.normal(b * sk * nkv * d, 1.0);
        let v = rng.normal(b * sk * nkv * d, 1.0);
        let dout = rng.vec(q.len(), -1.0, 1.0);
        let (q_pos, k_pos) = (vec![sk as u32; sq], iota(sk));
        let tag = format!("full b{b} sq{sq} sk{sk} nh{nh} nkv{nkv} d{d}");

        let (mut out, mut lse) = (nan(q.len()), nan(b * nh * sq));
        masked_attention_fwd(
            &q,
            &k,
            &v,
            Mask::Full,
            b,
            sq,
            sk,
            nh,
            nkv,
            d,
            &mut out,
            &mut lse,
        );
        let (ro, rl) = block_ref(
            &to64(&q),
            &to64(&k),
            &to64(&v),
            &q_pos,
            &k_pos,
            b,
            sq,
            sk,
            nh,
            nkv,
            d,
        );
        assert_close(&format!("{tag} out"), &out, &ro, RTOL, 1e-2);
        for (i, (&g, &w)) in lse.iter().zip(&rl).enumerate() {
            assert!(
                (g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{tag} lse[{i}]: {g} vs {w}"
            );
        }

        let zeros = |n| vec![0.0f32; n];
        let (mut dq, mut dk, mut dv) = (zeros(q.len()), zeros(k.len()), zeros(v.len()));
        masked_attention_bwd(
            &q,
            &k,
            &v,
            &out,
            &lse,
            &dout,
            Mask::Full,
            b,
            sq,
            sk,
            nh,
            nkv,
            d,
            &mut dq,
            &mut dk,
            &mut dv,
        );
        let (mut pq, mut pk, mut pv) = (zeros(q.len()), zeros(k.len()), zeros(v.len()));
        attention_block_bwd(
            &q, &k, &v, &out, &lse, &dout, &q_pos, &k_pos, b, sq, sk, nh, nkv, d, &mut pq, &mut pk,
            &mut pv,
        );
        assert_near(&format!("{tag} dq"), &dq, &pq, 1e-5);
        assert_near(&format!("{tag} dk"), &dk, &pk, 1e-5);
        assert_near(&format!("{tag} dv"), &dv, &pv, 1e-5);
    }
}

/// Sliding-window attention (Mistral's: query q sees keys q-window+1 ..= q) over a whole
/// sequence matches the float64 reference and differs from plain causal attention; split
/// into the key blocks of cp = 2 ranks (each query block against every key block, merged by
/// log-sum-exp, backward per block with the final out/lse) it gives the whole sequence's
/// results and gradients.
#[test]
fn sliding_window_attention_matches_the_reference_and_splits_over_key_blocks() {
    let (b, s, nh, nkv, d, window) = (2, 16, 4, 2, 8, 5u32);
    let mut rng = Rng::new(41);
    let q = rng.normal(b * s * nh * d, 1.0);
    let k = rng.normal(b * s * nkv * d, 1.0);
    let v = rng.normal(b * s * nkv * d, 1.0);
    let pos = iota(s);
    let mut out = nan(b * s * nh * d);
    let mut lse = nan(b * nh * s);
    attention_window_fwd(
        &q, &k, &v, &pos, &pos, window, b, s, s, nh, nkv, d, &mut out, &mut lse,
    );
    let (want_out, want_lse) = window_ref(
        &to64(&q),
        &to64(&k),
        &to64(&v),
        &pos,
        &pos,
        window,
        b,
        s,
        s,
        nh,
        nkv,
        d,
    );
    assert_close("window out", &out, &want_out, RTOL, 1e-2);
    assert_close("window lse", &lse, &want_lse, RTOL, 1e-2);
    let causal = block_fwd(&q, &k, &v, &pos, &pos, b, nh, nkv, d);
    assert!(rms(&causal.out) > 0.0);
    let diff: f64 = causal
        .out
        .iter()
        .zip(&out)
        .map(|(a, b)| f64::from(a - b).abs())
        .fold(0.0, f64::max);
    assert!(
        diff > 1e-2,
        "the window must change the result (max diff {diff})"
    );

    // Whole-sequence backward.
    let dout = rng.normal(b * s * nh * d, 1.0);
    let (mut dq, mut dk, mut dv) = (
        vec![0f32; q.len()],
        vec![0f32; k.len()],
        vec![0f32; v.len()],
    );
    attention_window_bwd(
        &q, &k, &v, &out, &lse, &dout, &pos, &pos, window, b, s, s, nh, nkv, d, &mut dq, &mut dk,
        &mut dv,
    );
    // cp = 2: rank r holds the rows at cp_local_positions(s, 2, r); every query block meets
    // every key block.
    let blocks = rank_blocks(s, 2);
    let (mut dq2, mut dk2, mut dv2) = (
        vec![0f32; q.len()],
        vec![0f32; k.len()],
        vec![0f32; v.len()],
    );
    for qp in &blocks {
        let sl = qp.len();
        let ql = gather_rows(&q, b, s, nh * d, qp);
        let dol = gather_rows(&dout, b, s, nh * d, qp);
        // Forward over the key blocks, merged.
        let mut acc: Option<(Vec<f32>, Vec<f32>)> = None;
        for kp in &blocks {
            let kl = gather_rows(&k, b, s, nkv * d, kp);
            let vl = gather_rows(&v, b, s, nkv * d, kp);
            let mut o = nan(b * sl * nh * d);
            let mut l = nan(b * nh * sl);
            attention_window_fwd(
                &ql, &kl, &vl, qp, kp, window, b, sl, sl, nh, nkv, d, &mut o, &mut l,
            );
            acc = Some(match acc {
                None => (o, l),
                Some((mut ao, mut al)) => {
                    attention_merge_into(&mut ao, &mut al, &o, &l, b, sl, nh, d);
                    (ao, al)
                }
            });
        }
        let (ol, ll) = acc.unwrap();
        assert_near(
            "window out by blocks",
            &ol,
            &gather_rows(&out, b, s, nh * d, qp),
            1e-5,
        );
        let mut dql = vec![0f32; ql.len()];
        for kp in &blocks {
            let kl = gather_rows(&k, b, s, nkv * d, kp);
            let vl = gather_rows(&v, b, s, nkv * d, kp);
            let mut dkl = vec![0f32; kl.len()];
            let mut dvl = vec![0f32; vl.len()];
            attention_window_bwd(
                &ql, &kl, &vl, &ol, &ll, &dol, qp, kp, window, b, sl, sl, nh, nkv, d, &mut dql,
                &mut dkl, &mut dvl,
            );
            scatter_add_rows(&mut dk2, &dkl, b, s, nkv * d, kp);
            scatter_add_rows(&mut dv2, &dvl, b, s, nkv * d, kp);
        }
        scatter_add_rows(&mut dq2, &dql, b, s, nh * d, qp);
    }
    assert_near("window dq by blocks", &dq2, &dq, 1e-5);
    assert_near("window dk by blocks", &dk2, &dk, 1e-5);
    assert_near("window dv by blocks", &dv2, &dv, 1e-5);
}
