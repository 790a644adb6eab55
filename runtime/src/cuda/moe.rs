//! The routing tables of the MoE kernels (`kernels/cuda/moe.cu`), built on the host.
//!
//! Which token goes to which expert row (the capacity, the drop order) is the cpu backend's
//! own [`megac_kernels::moe::Routing`], rebuilt from the router's indices as
//! `crate::exec`'s `routing` does (capacity = the expert buffer's rows when fewer than the
//! tokens, else dropless). The executor copies the indices to the host when it reaches a
//! [`Route`] (a synchronisation of the stream), builds the tables here and copies them into
//! the instruction's workspace; the kernels then move the rows. Everything here is host
//! logic: the tests evaluate the kernels' loops over these tables and compare them with the
//! cpu's `dispatch_fwd_routed`, `dispatch_bwd`, `combine_fwd` and `combine_bwd`.

use megac_ir::plan::BufId;
use megac_kernels::moe::Routing;

/// One table built from a routing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Table {
    /// i32 per row of the (stacked) buffers of experts `first..first + count`
    /// (`count · rows` rows): the row's source token, -1 for an unused row
    /// (`moe_gather_rows`).
    Sources {
        /// First expert.
        first: usize,
        /// Experts.
        count: usize,
        /// Workspace byte offset.
        at: u64,
    },
    /// i32 per (token, slot): its row in the stacked buffer of experts `first..first +
    /// count` (`(expert - first) · rows + row`), -1 when the slot goes elsewhere or was
    /// dropped (`moe_scatter_add_rows`).
    Rows {
        /// First expert.
        first: usize,
        /// Experts.
        count: usize,
        /// Workspace byte offset.
        at: u64,
    },
    /// u64 per (token, slot): the device address of its expert row in `bufs` (one stacked
    /// `[E, rows, h]` buffer, or one `[rows, h]` buffer per expert), 0 when dropped
    /// (`moe_combine_fwd`/`moe_combine_bwd`).
    Addresses {
        /// The expert buffers.
        bufs: Vec<BufId>,
        /// Elements per row.
        h: u64,
        /// Workspace byte offset.
        at: u64,
    },
    /// i32 per expert: the rows in use, written into plan buffer `buf` (dispatch_experts'
    /// counts).
    Counts {
        /// The counts buffer.
        buf: BufId,
    },
}

/// Build the routing of a layer on the host, then `tables`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// The router's indices `[t, top_k]` (i32).
    pub indices: BufId,
    /// Slots per token.
    pub top_k: usize,
    /// Experts: `Some(n)`, or `None` for `1 + max(hint, the largest index)` (single-expert
    /// dispatch, as the cpu backend counts them).
    pub experts: Option<usize>,
    /// The expert for `experts: None`.
    pub hint: usize,
    /// Rows of each expert's buffer.
    pub rows: usize,
    /// What to build.
    pub tables: Vec<Table>,
}

/// An index the router cannot have produced.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("MoE routing: {0}")]
pub struct RouteError(pub String);

impl Route {
    /// The routing of `indices`, checked (every index in range, no expert twice per token)
    /// so that building it cannot panic.
    pub fn routing(&self, indices: &[i32]) -> Result<Routing, RouteError> {
        let k = self.top_k.max(1);
        if !indices.len().is_multiple_of(k) {
            return Err(RouteError(format!(
                "{} indices are not [t, {k}]",
                indices.len()
            )));
        }
        let t = indices.len() / k;
        let experts = self.experts.unwrap_or_else(|| {
            1 + self
                .hint
                .max(indices.iter().copied().max().unwrap_or(0).max(0) as usize)
        });
        for (tok, ix) in indices.chunks(k).enumerate() {
            for (slot, &j) in ix.iter().enumerate() {
                if j < 0 || j as usize >= experts {
                    return Err(RouteError(format!(
                        "token {tok} slot {slot} names expert {j} of {experts}"
                    )));
                }
                if ix[..slot].contains(&j) {
                    return Err(RouteError(format!("token {tok} chooses expert {j} twice")));
                }
            }
        }
        let capacity = if self.rows < t { self.rows } else { 0 };
        Ok(Routing::new(indices, t, k, experts, capacity))
    }
}

/// [`Table::Sources`]: `count · rows` source tokens.
pub fn sources(r: &Routing, first: usize, count: usize, rows: usize) -> Vec<i32> {
    let mut out = vec![-1i32; count * rows];
    for e in first..(first + count).min(r.experts()) {
        for (row, (tok, _)) in r.rows(e).enumerate().take(rows) {
            out[(e - first) * rows + row] = tok as i32;
        }
    }
    out
}

/// [`Table::Rows`]: per (token, slot), its row among experts `first..first + count`.
pub fn rows(r: &Routing, first: usize, count: usize, rows: usize) -> Vec<i32> {
    let k = r.top_k();
    let mut out = vec![-1i32; r.tokens() * k];
    for t in 0..r.tokens() {
        for s in 0..k {
            let e = r.expert_of(t, s);
            if (first..first + count).contains(&e) {
                if let Some(row) = r.row_of(t, s) {
                    out[t * k + s] = ((e - first) * rows + row) as i32;
                }
            }
        }
    }
    out
}

/// [`Table::Addresses`] before resolution: per (token, slot), `(buffer, element offset)`
/// of its row (buffer 0 and `(e · rows + row) · h` when `stacked`, else buffer `e` and
/// `row · h`), None when dropped.
pub fn addresses(r: &Routing, stacked: bool, rows: usize, h: u64) -> Vec<Option<(usize, u64)>> {
    let k = r.top_k();
    let mut out = vec![None; r.tokens() * k];
    for t in 0..r.tokens() {
        for s in 0..k {
            let e = r.expert_of(t, s);
            out[t * k + s] = r.row_of(t, s).map(|row| {
                if stacked {
                    (0, (e * rows + row) as u64 * h)
                } else {
                    (e, row as u64 * h)
                }
            });
        }
    }
    out
}

/// [`Table::Counts`]: rows in use per expert.
pub fn counts(r: &Routing) -> Vec<i32> {
    (0..r.experts()).map(|e| r.count(e) as i32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use megac_kernels::moe as cpu;

    /// Deterministic pseudo-random numbers.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            self.0 >> 33
        }
        fn f(&mut self) -> f32 {
            (self.next() % 2000) as f32 / 1000.0 - 1.0
        }
    }

    /// `t` tokens' top-k choices among `e` experts (distinct per token), skewed to expert
    /// 0 so that a capacity drops some.
    fn indices(rng: &mut Lcg, t: usize, e: usize, k: usize) -> Vec<i32> {
        let mut out = Vec::new();
        for _ in 0..t {
            let mut chosen: Vec<i32> = Vec::new();
            if rng.next().is_multiple_of(2) {
                chosen.push(0);
            }
            while chosen.len() < k {
                let j = (rng.next() % e as u64) as i32;
                if !chosen.contains(&j) {
                    chosen.push(j);
                }
            }
            out.extend(chosen);
        }
        out
    }

    /// moe_gather_rows over `src`.
    fn gather(x: &[f32], src: &[i32], h: usize) -> Vec<f32> {
        let mut out = vec![0f32; src.len() * h];
        for (r, &t) in src.iter().enumerate() {
            for j in 0..h {
                out[r * h + j] = if t >= 0 { x[t as usize * h + j] } else { 0.0 };
            }
        }
        out
    }

    /// moe_scatter_add_rows over `row`.
    fn scatter_add(dy: &[f32], row: &[i32], k: usize, h: usize, dx: &mut [f32]) {
        for t in 0..dx.len() / h {
            for j in 0..h {
                for s in 0..k {
                    let r = row[t * k + s];
                    if r >= 0 {
                        dx[t * h + j] += dy[r as usize * h + j];
                    }
                }
            }
        }
    }

    #[test]
    fn dispatch_tables_move_the_rows_the_cpu_kernels_move() {
        let mut rng = Lcg(7);
        let (t, e, k, h) = (24, 4, 2, 3);
        let x: Vec<f32> = (0..t * h).map(|_| rng.f()).collect();
        let idx = indices(&mut rng, t, e, k);
        // Dropless (rows >= t) and with a capacity that drops.
        for rows_per in [t, 5] {
            let route = Route {
                indices: 0,
                top_k: k,
                experts: Some(e),
                hint: 0,
                rows: rows_per,
                tables: Vec::new(),
            };
            let r = route.routing(&idx).unwrap();
            assert_eq!(r.capacity() > 0, rows_per < t);
            if rows_per < t {
                assert!(r.dropped() > 0, "the capacity drops some slots");
            }
            // Stacked forward: every expert's block.
            let got = gather(&x, &sources(&r, 0, e, rows_per), h);
            for ex in 0..e {
                let mut want = vec![0f32; rows_per * h];
                cpu::dispatch_fwd_routed(&x, &r, ex, h, &mut want);
                assert_eq!(&got[ex * rows_per * h..(ex + 1) * rows_per * h], &want[..]);
                // One expert's own table.
                assert_eq!(gather(&x, &sources(&r, ex, 1, rows_per), h), want);
            }
            // Backward, one expert and stacked.
            let dy: Vec<f32> = (0..e * rows_per * h).map(|_| rng.f()).collect();
            let mut want = vec![0.5f32; t * h];
            for ex in 0..e {
                let block = &dy[ex * rows_per * h..(ex + 1) * rows_per * h];
                cpu::dispatch_bwd(block, &r, ex, h, &mut want);
            }
            let mut stacked = vec![0.5f32; t * h];
            scatter_add(&dy, &rows(&r, 0, e, rows_per), k, h, &mut stacked);
            assert_eq!(stacked, want);
            let mut one = vec![0.5f32; t * h];
            let mut one_want = vec![0.5f32; t * h];
            let block = &dy[2 * rows_per * h..3 * rows_per * h];
            cpu::dispatch_bwd(block, &r, 2, h, &mut one_want);
            scatter_add(block, &rows(&r, 2, 1, rows_per), k, h, &mut one);
            assert_eq!(one, one_want);
            let c = counts(&r);
            assert_eq!(c.len(), e);
            assert_eq!(
                c.iter().sum::<i32>() as usize,
                t * k - r.dropped(),
                "every kept slot has a row"
            );
        }
    }

    #[test]
    fn combine_addresses_are_the_rows_the_cpu_kernels_read_and_write() {
        let mut rng = Lcg(11);
        let (t, e, k, h) = (20, 3, 2, 4);
        let idx = indices(&mut rng, t, e, k);
        let w: Vec<f32> = (0..t * k).map(|_| rng.f()).collect();
        let dout: Vec<f32> = (0..t * h).map(|_| rng.f()).collect();
        for rows_per in [t, 6] {
            let route = Route {
                indices: 0,
                top_k: k,
                experts: Some(e),
                hint: 0,
                rows: rows_per,
                tables: Vec::new(),
            };
            let r = route.routing(&idx).unwrap();
            let ys: Vec<Vec<f32>> = (0..e)
                .map(|_| (0..rows_per * h).map(|_| rng.f()).collect())
                .collect();
            let refs: Vec<&[f32]> = ys.iter().map(|y| y.as_slice()).collect();
            let mut want = vec![0f32; t * h];
            cpu::combine_fwd(&w, &r, &refs, t, h, &mut want);
            let stacked: Vec<f32> = ys.concat();
            for (tab, is_stacked) in [
                (addresses(&r, true, rows_per, h as u64), true),
                (addresses(&r, false, rows_per, h as u64), false),
            ] {
                let row = |i: usize| -> Option<&[f32]> {
                    tab[i].map(|(b, off)| {
                        let off = off as usize;
                        if is_stacked {
                            assert_eq!(b, 0);
                            &stacked[off..off + h]
                        } else {
                            &ys[b][off..off + h]
                        }
                    })
                };
                // moe_combine_fwd: f64 sum of weight · row, in slot order.
                let mut got = vec![0f32; t * h];
                for tok in 0..t {
                    for j in 0..h {
                        let mut acc = 0f64;
                        for s in 0..k {
                            if let Some(y) = row(tok * k + s) {
                                acc += f64::from(w[tok * k + s]) * f64::from(y[j]);
                            }
                        }
                        got[tok * h + j] = acc as f32;
                    }
                }
                for (a, b) in got.iter().zip(&want) {
                    assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{a} vs {b}");
                }
            }
            // Backward: the rows written are the cpu's.
            let mut dw_want = vec![0f32; t * k];
            let mut dys_want: Vec<Vec<f32>> = vec![vec![0f32; rows_per * h]; e];
            {
                let mut d: Vec<&mut [f32]> =
                    dys_want.iter_mut().map(|v| v.as_mut_slice()).collect();
                cpu::combine_bwd(&w, &r, &refs, &dout, h, &mut dw_want, &mut d);
            }
            let tab = addresses(&r, false, rows_per, h as u64);
            let mut dw = vec![0f32; t * k];
            let mut dys: Vec<Vec<f32>> = vec![vec![0f32; rows_per * h]; e];
            for tok in 0..t {
                for s in 0..k {
                    if let Some((b, off)) = tab[tok * k + s] {
                        let off = off as usize;
                        let mut dot = 0f32;
                        for j in 0..h {
                            dot += dout[tok * h + j] * ys[b][off + j];
                            dys[b][off + j] += w[tok * k + s] * dout[tok * h + j];
                        }
                        dw[tok * k + s] += dot;
                    }
                }
            }
            assert_eq!(dys, dys_want);
            for (a, b) in dw.iter().zip(&dw_want) {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn indices_the_router_cannot_produce_are_errors_not_panics() {
        let route = Route {
            indices: 0,
            top_k: 2,
            experts: Some(3),
            hint: 0,
            rows: 4,
            tables: Vec::new(),
        };
        assert!(route
            .routing(&[0, 3])
            .unwrap_err()
            .0
            .contains("expert 3 of 3"));
        assert!(route.routing(&[1, 1]).unwrap_err().0.contains("twice"));
        assert!(route.routing(&[1, -1]).is_err());
        assert!(route.routing(&[1]).is_err());
        // Experts counted from the indices, as the cpu's single-expert dispatch.
        let open = Route {
            experts: None,
            hint: 1,
            ..route
        };
        assert_eq!(open.routing(&[0, 5]).unwrap().experts(), 6);
        assert_eq!(open.routing(&[0, 1]).unwrap().experts(), 2);
    }
}
