//! Helpers of the kernels that communicate: context-parallel positions and K/V exchange
//! (all-gather and ring), the vocab-parallel cross-entropy's reductions, the member-major
//! reordering of gathered tensors, and where a rank's part of a split dim lies
//! (`dim_positions`, and from it the elements a `perturb` changes).

use megac_ir::plan::BufId;
use megac_kernels as k;

use crate::comm::Communicator;
use crate::error::RuntimeError;
use crate::memory::Memory;

/// Global positions under context parallelism: this rank's tokens, every rank's tokens in
/// group order, and the cp group.
pub(crate) struct CpPositions {
    pub(crate) local: Vec<u32>,
    pub(crate) all: Vec<u32>,
    pub(crate) group: Vec<usize>,
    /// This rank's index in `group`.
    pub(crate) me: usize,
}

/// If dim `dim` of buffer `b` is split over cp, the positions of the load-balanced chunks.
pub(crate) fn cp_positions(
    mem: &Memory,
    b: BufId,
    dim: usize,
    mesh: &megac_ir::Mesh,
    rank: usize,
) -> Option<CpPositions> {
    let buf = mem.buffer(b);
    let split = buf
        .layout
        .get(dim)
        .is_some_and(|axes| axes.contains(&megac_ir::Axis::Cp));
    if !split {
        return None;
    }
    let cp = mesh.size(megac_ir::Axis::Cp) as usize;
    let s = buf.shape[dim] as usize * cp;
    let group = mesh.group(rank, &[megac_ir::Axis::Cp]);
    let me = mesh.coord(rank, megac_ir::Axis::Cp);
    let all = (0..cp)
        .flat_map(|m| k::context::cp_local_positions(s, cp, m))
        .collect();
    Some(CpPositions {
        local: k::context::cp_local_positions(s, cp, me),
        all,
        group,
        me,
    })
}

/// Pass `bufs` one step around the ring `group` (to the next member, from the previous),
/// in place. Even members send first and odd members receive first, so the exchange cannot
/// deadlock even on communicators whose sends block.
pub(crate) fn ring_pass(
    comm: &mut dyn Communicator,
    group: &[usize],
    me: usize,
    bufs: &mut [&mut Vec<f32>],
) -> Result<(), RuntimeError> {
    let n = group.len();
    let (next, prev) = (group[(me + 1) % n], group[(me + n - 1) % n]);
    for buf in bufs.iter_mut() {
        let mut incoming = vec![0f32; buf.len()];
        if me.is_multiple_of(2) {
            comm.send(next, buf)?;
            comm.recv(prev, &mut incoming)?;
        } else {
            comm.recv(prev, &mut incoming)?;
            comm.send(next, buf)?;
        }
        **buf = incoming;
    }
    Ok(())
}

/// All-gather a `[b, s_local, ..]` tensor along the sequence over `group`: the result is
/// `[b, members · s_local, ..]` with each member's tokens in group order.
pub(crate) fn gather_seq(
    comm: &mut dyn Communicator,
    group: &[usize],
    x: &[f32],
    b: usize,
    block: usize,
) -> Result<Vec<f32>, RuntimeError> {
    let n = group.len();
    let mut member_major = vec![0f32; x.len() * n];
    comm.all_gather(group, x, &mut member_major)?;
    let mut out = vec![0f32; x.len() * n];
    scatter_member_major(&member_major, &mut out, n, b, block);
    Ok(out)
}

/// If dim `dim` of buffer `b` is split over tp (any dim of any buffer; today the vocabulary
/// rows of an embedding table and the vocabulary columns of the logits), this rank's part
/// of it in global indices: (first index, length).
pub(crate) fn tp_split(
    mem: &Memory,
    b: BufId,
    dim: usize,
    mesh: &megac_ir::Mesh,
    rank: usize,
) -> Option<(usize, usize)> {
    let buf = mem.buffer(b);
    let split = buf
        .layout
        .get(dim)
        .is_some_and(|axes| axes.contains(&megac_ir::Axis::Tp));
    split.then(|| {
        let len = buf.shape[dim] as usize;
        (mesh.coord(rank, megac_ir::Axis::Tp) * len, len)
    })
}

/// Per-row statistics of a vocab-parallel cross-entropy: the global log-sum-exp and the
/// target logit, reduced over the tp group.
pub(crate) struct RowStats {
    pub(crate) lse: f32,
    pub(crate) target: f32,
}

/// Columns of a vocab-parallel shard starting at `start` that are real vocabulary (the rest
/// is padding, excluded from the softmax).
pub(crate) fn real_columns(v: usize, start: usize, vocab: usize) -> usize {
    vocab.saturating_sub(start).min(v)
}

pub(crate) fn vocab_parallel_stats(
    logits: &[f32],
    labels: &[i32],
    v: usize,
    start: usize,
    vocab: usize,
    members: &[usize],
    comm: &mut dyn Communicator,
) -> Result<Vec<RowStats>, RuntimeError> {
    let rows = labels.len();
    let real = real_columns(v, start, vocab);
    let mut max: Vec<f32> = logits
        .chunks_exact(v)
        .map(|r| r[..real].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)))
        .collect();
    comm.all_reduce_max(members, &mut max)?;
    // [sum of exp, target logit] per row, summed over the group in f64.
    let mut sums = vec![0f64; 2 * rows];
    for (i, r) in logits.chunks_exact(v).enumerate() {
        sums[2 * i] = r[..real]
            .iter()
            .map(|&x| f64::from((x - max[i]).exp()))
            .sum();
        let local = labels[i] as i64 - start as i64;
        if (0..v as i64).contains(&local) {
            sums[2 * i + 1] = f64::from(r[local as usize]);
        }
    }
    comm.all_reduce_sum_f64(members, &mut sums)?;
    Ok((0..rows)
        .map(|i| RowStats {
            lse: max[i] + sums[2 * i].ln() as f32,
            target: sums[2 * i + 1] as f32,
        })
        .collect())
}

/// `[member, outer, block]` -> `[outer, member, block]`.
pub(crate) fn scatter_member_major(
    src: &[f32],
    dst: &mut [f32],
    members: usize,
    outer: usize,
    block: usize,
) {
    for m in 0..members {
        for o in 0..outer {
            let from = (m * outer + o) * block;
            let to = (o * members + m) * block;
            dst[to..to + block].copy_from_slice(&src[from..from + block]);
        }
    }
}

/// `[outer, member, block]` -> `[member, outer, block]`.
pub(crate) fn gather_member_major(
    src: &[f32],
    dst: &mut [f32],
    members: usize,
    outer: usize,
    block: usize,
) {
    for m in 0..members {
        for o in 0..outer {
            let from = (o * members + m) * block;
            let to = (m * outer + o) * block;
            dst[to..to + block].copy_from_slice(&src[from..from + block]);
        }
    }
}

/// Expert parallelism's all-to-all of stacked expert token rows over `group` (`n` members,
/// `e` experts, `e / n` local experts per member, `h` values per row). The members first
/// all-gather their per-expert token counts (`counts`, this rank's), so every split size is
/// known on both sides.
///
/// `to_experts`: `x` is `[e, rows_in, h]` (this rank's tokens, the first `counts[ex]` rows of
/// each expert in use) and `y` is `[e / n, n · rows_in, h]`: for each local expert, the rows
/// of member 0, then member 1, ... packed, the rest zero. Otherwise the mirror: `x` is
/// `[e / n, rows, h]` as packed above and `y` is `[e, rows_out, h]`, each expert's rows back
/// at the top of its block (the rest zero).
#[allow(clippy::too_many_arguments)]
pub(crate) fn expert_all_to_all(
    comm: &mut dyn Communicator,
    group: &[usize],
    counts: &[i32],
    x: &[f32],
    x_rows: usize,
    y: &mut [f32],
    y_rows: usize,
    h: usize,
    to_experts: bool,
) -> Result<(), RuntimeError> {
    let n = group.len();
    let me = group.iter().position(|&r| r == comm.rank()).unwrap_or(0);
    let e = counts.len();
    if n == 0 || !e.is_multiple_of(n) {
        return Err(RuntimeError::Plan(format!(
            "all_to_all: {e} experts do not split over {n} ranks"
        )));
    }
    let local = e / n;
    let mine: Vec<f32> = counts.iter().map(|&c| c.max(0) as f32).collect();
    let mut all = vec![0f32; e * n];
    comm.all_gather(group, &mine, &mut all)?;
    // Rows member `m` routes to expert `ex`.
    let cnt = |m: usize, ex: usize| all[m * e + ex] as usize;
    let too_many =
        (0..n).any(|m| (0..e).any(|ex| cnt(m, ex) > if to_experts { x_rows } else { y_rows }));
    if too_many {
        return Err(RuntimeError::Plan(
            "all_to_all: more routed tokens than expert buffer rows".into(),
        ));
    }
    // Where member m's rows start in local expert j's packed block.
    let start = |m: usize, j: usize| (0..m).map(|p| cnt(p, me * local + j)).sum::<usize>();
    let mut send = Vec::new();
    let mut send_offsets = vec![0usize];
    let mut recv_offsets = vec![0usize];
    for m in 0..n {
        let rows: usize = if to_experts {
            for ex in m * local..(m + 1) * local {
                let at = ex * x_rows * h;
                send.extend_from_slice(&x[at..at + cnt(me, ex) * h]);
            }
            (0..local).map(|j| cnt(m, me * local + j)).sum()
        } else {
            for j in 0..local {
                let at = (j * x_rows + start(m, j)) * h;
                send.extend_from_slice(&x[at..at + cnt(m, me * local + j) * h]);
            }
            (m * local..(m + 1) * local).map(|ex| cnt(me, ex)).sum()
        };
        send_offsets.push(send.len());
        recv_offsets.push(recv_offsets[m] + rows * h);
    }
    let mut recv = vec![0f32; recv_offsets[n]];
    comm.all_to_all(group, &send, &send_offsets, &mut recv, &recv_offsets)?;
    y.fill(0.0);
    for (m, &first) in recv_offsets[..n].iter().enumerate() {
        let mut at = first;
        if to_experts {
            for j in 0..local {
                let c = cnt(m, me * local + j) * h;
                let dst = (j * y_rows + start(m, j)) * h;
                y[dst..dst + c].copy_from_slice(&recv[at..at + c]);
                at += c;
            }
        } else {
            for ex in m * local..(m + 1) * local {
                let c = cnt(me, ex) * h;
                let dst = ex * y_rows * h;
                y[dst..dst + c].copy_from_slice(&recv[at..at + c]);
                at += c;
            }
        }
    }
    Ok(())
}

/// The global index of each of the `local` entries this rank holds of a dim split over
/// `axes` (outermost first): contiguous parts in mesh order, except that a dim whose
/// outermost axis is cp (the sequence under context parallelism) is split over cp into the
/// load-balanced chunks (`megac_kernels::context::cp_local_positions`: chunk r and chunk
/// 2·cp-1-r), and the axes after cp split each cp rank's part contiguously. Ascending.
pub(crate) fn dim_positions(
    mesh: &megac_ir::Mesh,
    rank: usize,
    axes: &[megac_ir::Axis],
    local: usize,
) -> Vec<usize> {
    let part = axes.iter().fold(0usize, |p, &ax| {
        p * mesh.size(ax) as usize + mesh.coord(rank, ax)
    });
    let first = part * local;
    let contiguous: Vec<usize> = (first..first + local).collect();
    if axes.first() != Some(&megac_ir::Axis::Cp) {
        return contiguous;
    }
    let parts: usize = axes.iter().map(|&a| mesh.size(a) as usize).product();
    let cp = mesh.size(megac_ir::Axis::Cp) as usize;
    let s = local * parts;
    if !s.is_multiple_of(2 * cp) {
        return contiguous;
    }
    // Entry j of the cp ranks' parts laid end to end (cp rank m's 2c positions at
    // m·2c..) is at global position all[j].
    let all: Vec<u32> = (0..cp)
        .flat_map(|m| k::context::cp_local_positions(s, cp, m))
        .collect();
    contiguous.iter().map(|&j| all[j] as usize).collect()
}

/// The elements a `perturb` changes in a rank's part of shape `shape` split by `layout`:
/// every element (`tokens` = 0), or the rows of the first `tokens` positions of the first
/// sample (`[b, s, rest..]`), counted from this rank's sequence shard (its positions ascend:
/// under cp the load-balanced chunks); the cpu backend (`exec/scope.rs`) and the cuda
/// lowering both count them here.
pub fn perturbed_elements(
    mesh: &megac_ir::Mesh,
    rank: usize,
    shape: &[u64],
    layout: &[Vec<megac_ir::Axis>],
    tokens: u64,
) -> u64 {
    let total: u64 = shape.iter().product();
    if tokens == 0 {
        return total;
    }
    let row: u64 = shape.get(2..).map_or(1, |r| r.iter().product());
    let local = shape.get(1).copied().unwrap_or(1) as usize;
    let axes = layout.get(1).cloned().unwrap_or_default();
    let real = dim_positions(mesh, rank, &axes, local)
        .iter()
        .filter(|&&p| p < tokens as usize)
        .count() as u64;
    (real * row).min(total)
}

#[cfg(test)]
mod tests {
    use super::dim_positions;
    use megac_ir::{Axis, Mesh};

    #[test]
    fn dim_positions_undo_the_load_balanced_chunks() {
        // tp2 × cp2 (tp innermost): rank r has tp coordinate r % 2, cp coordinate r / 2.
        let mesh = Mesh {
            axes: vec![
                (Axis::Tp, 2),
                (Axis::Cp, 2),
                (Axis::Ep, 1),
                (Axis::Dp, 1),
                (Axis::Pp, 1),
            ],
        };
        // 8 positions over cp2: chunks of 2, rank 0 holds chunks 0 and 3, rank 1 chunks 1, 2.
        assert_eq!(dim_positions(&mesh, 0, &[Axis::Cp], 4), [0, 1, 6, 7]);
        assert_eq!(dim_positions(&mesh, 2, &[Axis::Cp], 4), [2, 3, 4, 5]);
        // Sequence parallelism under cp: tp splits each cp rank's part contiguously.
        let cp_tp = [Axis::Cp, Axis::Tp];
        let all: Vec<Vec<usize>> = (0..4).map(|r| dim_positions(&mesh, r, &cp_tp, 2)).collect();
        assert_eq!(all, [vec![0, 1], vec![6, 7], vec![2, 3], vec![4, 5]]);
        // No cp: contiguous parts in mesh order; unsplit: everything.
        assert_eq!(dim_positions(&mesh, 1, &[Axis::Tp], 3), [3, 4, 5]);
        assert_eq!(dim_positions(&mesh, 3, &[], 3), [0, 1, 2]);
    }
}
