//! KV-cache decoding kernels: the rows of a block written into a layer's key or value cache
//! at their positions, a block's queries attending the cached keys, and learned positions
//! added at explicit positions. The runtime's `kv_attention` and `pos_embedding_at`
//! instructions call them; `rope_at` is [`crate::rope::rope_freq`] at the block's positions.

/// Write row `i` of `x` (`rows × row` values) into row `pos[i]` of `cache` (`capacity ×
/// row`); rows at or past the capacity are padding and are not written. Every other row of
/// the cache keeps its value.
pub fn cache_write(cache: &mut [f32], x: &[f32], pos: &[u32], row: usize) {
    let capacity = cache.len() / row.max(1);
    for (i, &p) in pos.iter().enumerate() {
        let p = p as usize;
        if p < capacity && (i + 1) * row <= x.len() {
            cache[p * row..(p + 1) * row].copy_from_slice(&x[i * row..(i + 1) * row]);
        }
    }
}

/// The cached keys a block at positions `pos` attends: `0 ..= max(pos)`, at most `capacity`.
pub fn cached_keys(pos: &[u32], capacity: usize) -> usize {
    pos.iter()
        .map(|&p| p as usize + 1)
        .max()
        .unwrap_or(0)
        .min(capacity)
}

/// Attention of one sequence's block of `s` queries `q[s, nh, d]` at positions `q_pos` over
/// the first `keys` rows of the caches `ck`, `cv` (`[capacity, nkv, d]`, key `j` at
/// position `j`): query `i` attends key `j` iff `j <= q_pos[i]` and, with `window > 0`,
/// `q_pos[i] - j < window`. Writes `out[s, nh, d]` and `lse[nh, s]`, as
/// [`crate::context::attention_window_fwd`] over the cached prefix.
#[allow(clippy::too_many_arguments)]
pub fn cached_attention(
    q: &[f32],
    ck: &[f32],
    cv: &[f32],
    q_pos: &[u32],
    keys: usize,
    window: u32,
    nh: usize,
    nkv: usize,
    d: usize,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let s = q_pos.len();
    let row = nkv * d;
    let k_pos: Vec<u32> = (0..keys as u32).collect();
    crate::context::attention_window_fwd(
        q,
        &ck[..keys * row],
        &cv[..keys * row],
        q_pos,
        &k_pos,
        window,
        1,
        s,
        keys,
        nh,
        nkv,
        d,
        out,
        lse,
    );
}

/// `y[i] = x[i] + wpe[pos[i % pos.len()]]` per row of width `h` (`wpe` of `wpe.len() / h`
/// rows; a position at or past its end takes the last row: padding, whose values are
/// unused).
pub fn add_positions(x: &[f32], wpe: &[f32], pos: &[u32], h: usize, y: &mut [f32]) {
    let rows = wpe.len() / h.max(1);
    for (i, (xr, yr)) in x.chunks_exact(h).zip(y.chunks_exact_mut(h)).enumerate() {
        let p = (pos[i % pos.len().max(1)] as usize).min(rows.saturating_sub(1));
        crate::add_fwd(xr, &wpe[p * h..(p + 1) * h], yr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writing then attending at each position equals attention over the whole prefix.
    #[test]
    fn cached_attention_equals_full_prefix() {
        let (s, nh, nkv, d) = (6usize, 2usize, 1usize, 4usize);
        let val = |i: usize| ((i * 37 % 23) as f32 - 11.0) / 7.0;
        let q: Vec<f32> = (0..s * nh * d).map(val).collect();
        let k: Vec<f32> = (0..s * nkv * d).map(|i| val(i + 5)).collect();
        let v: Vec<f32> = (0..s * nkv * d).map(|i| val(i + 9)).collect();
        let pos: Vec<u32> = (0..s as u32).collect();
        let (mut full, mut lse) = (vec![0f32; s * nh * d], vec![0f32; nh * s]);
        crate::context::attention_window_fwd(
            &q, &k, &v, &pos, &pos, 0, 1, s, s, nh, nkv, d, &mut full, &mut lse,
        );
        let (mut ck, mut cv) = (vec![0f32; 8 * nkv * d], vec![0f32; 8 * nkv * d]);
        let row = nkv * d;
        for t in 0..s {
            let p = [t as u32];
            cache_write(&mut ck, &k[t * row..(t + 1) * row], &p, row);
            cache_write(&mut cv, &v[t * row..(t + 1) * row], &p, row);
            let (mut o, mut l) = (vec![0f32; nh * d], vec![0f32; nh]);
            let keys = cached_keys(&p, 8);
            assert_eq!(keys, t + 1);
            let qt = &q[t * nh * d..(t + 1) * nh * d];
            cached_attention(qt, &ck, &cv, &p, keys, 0, nh, nkv, d, &mut o, &mut l);
            for (a, b) in o.iter().zip(&full[t * nh * d..(t + 1) * nh * d]) {
                assert!((a - b).abs() <= 1e-6, "position {t}: {a} vs {b}");
            }
        }
        // Padding past the capacity is not written.
        let before = ck.clone();
        cache_write(&mut ck, &k[..row], &[8], row);
        assert_eq!(ck, before);
    }
}
