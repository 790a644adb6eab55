//! The device mesh: axis sizes in rank order, and the rank geometry derived from them
//! (Megatron's RankGenerator: the first axis of the order varies fastest).
//!
//! Expert parallelism folds over the data-parallel ranks as in Megatron ("MoE parallel
//! folding"): the dense grid is tp·cp·dp·pp; `ep` does not multiply the world size.
//!
//! **Expert groups.** Take a rank's dp·cp group (the ranks that differ from it only along dp
//! and cp) in rank order and let `d` be the rank's position in it. With `n = ep`, the
//! rank's expert-parallel coordinate is `d mod n` and its expert-data-parallel coordinate
//! `d / n`: the expert-parallel group ([`Axis::Ep`]) is the `n` consecutive members
//! `⌊d/n⌋·n .. ⌊d/n⌋·n + n - 1` of the dp·cp group, and the expert-data-parallel group
//! ([`Axis::Edp`], the ranks holding the same experts, which reduce their gradients) is
//! every `n`-th member starting at `d mod n`. Under Megatron's order `tp-cp-ep-dp-pp` this is
//! its expert rank generator (expert tp = tp, `ep` right after `cp`): the ep group is made of
//! consecutive ranks (stride tp) within the dp·cp ranks, e.g. with cp = 2 and ep = 2 it is
//! the cp group. Experts are tensor-parallel (or replicated) over tp, so an ep group never
//! spans tp.
//!
//! **Pipeline chunks.** The model's `pp·vpp` chunks are placed as Megatron's interleaved
//! schedule places them: chunk `c` lives on pipeline rank `c % pp`, as its `c / pp`-th local
//! chunk ([`chunk_owner`], [`local_chunk`], [`global_chunk`]; [`Mesh::chunk_peer`] for the
//! rank). This is the one home of the placement: the stage split and schedules
//! ([`crate::pipeline`]), codegen, the plan validator, the runtime and the simulator call it.

use serde::{Deserialize, Serialize};

use crate::types::Axis;

/// The pipeline rank that holds chunk `chunk` of a model split over `pp` pipeline ranks:
/// `chunk % pp` (a `pp` of 0 counts as 1).
pub fn chunk_owner(chunk: u32, pp: u32) -> u32 {
    chunk % pp.max(1)
}

/// Chunk `chunk`'s index among its owner's chunks, in model order: `chunk / pp`.
pub fn local_chunk(chunk: u32, pp: u32) -> u32 {
    chunk / pp.max(1)
}

/// The global index of local chunk `local` of pipeline rank `rank`: `local·pp + rank`.
pub fn global_chunk(local: u32, rank: u32, pp: u32) -> u32 {
    local * pp + rank
}

/// Axis sizes in rank order, innermost (stride 1) first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mesh {
    /// `(axis, size)` pairs, innermost first; `ep` is listed for display, but it folds over
    /// dp·cp and takes no place in the dense rank grid.
    pub axes: Vec<(Axis, u64)>,
}

impl Mesh {
    /// A mesh of one device.
    pub fn single() -> Mesh {
        Mesh {
            axes: Axis::ALL.iter().map(|&a| (a, 1)).collect(),
        }
    }

    /// Size of `axis` (1 if absent; `edp` is dp·cp/ep).
    pub fn size(&self, axis: Axis) -> u64 {
        if axis == Axis::Edp {
            let ep = self.size(Axis::Ep).max(1);
            return self.size(Axis::Dp) * self.size(Axis::Cp) / ep;
        }
        self.axes
            .iter()
            .find(|(a, _)| *a == axis)
            .map_or(1, |(_, n)| *n)
    }

    /// The dense grid: every axis but `ep`, in order.
    fn dense(&self) -> impl Iterator<Item = (Axis, u64)> + '_ {
        self.axes.iter().copied().filter(|(a, _)| *a != Axis::Ep)
    }

    /// Check what every other method assumes of a mesh read from a file: each axis listed
    /// once, `edp` not listed (it is derived), sizes at least 1, a world size (tp·cp·dp·pp)
    /// that fits in `usize`, and `ep` dividing dp·cp.
    pub fn validate(&self) -> Result<(), String> {
        let mut world = 1usize;
        for (i, &(axis, n)) in self.axes.iter().enumerate() {
            let name = axis.as_str();
            if self.axes[..i].iter().any(|(a, _)| *a == axis) {
                return Err(format!("axis {name} is listed twice"));
            }
            if axis == Axis::Edp {
                return Err("edp is derived from dp, cp and ep and cannot be listed".to_string());
            }
            if n == 0 {
                return Err(format!("axis {name} has size 0 (sizes are at least 1)"));
            }
            if axis != Axis::Ep {
                world = usize::try_from(n)
                    .ok()
                    .and_then(|n| world.checked_mul(n))
                    .ok_or_else(|| {
                        format!("the world size (tp·cp·dp·pp) overflows at {name} = {n}")
                    })?;
            }
        }
        let data = self.size(Axis::Dp) * self.size(Axis::Cp);
        let ep = self.size(Axis::Ep);
        if !data.is_multiple_of(ep) {
            return Err(format!("ep = {ep} does not divide dp·cp = {data}"));
        }
        Ok(())
    }

    /// Number of ranks (tp·cp·dp·pp).
    pub fn world_size(&self) -> usize {
        self.dense().map(|(_, n)| n as usize).product()
    }

    /// Index of `rank` along `axis` (0 for absent axes); `ep` and `edp` as the module
    /// documentation derives them from the rank's place in its dp·cp group.
    pub fn coord(&self, rank: usize, axis: Axis) -> usize {
        if matches!(axis, Axis::Ep | Axis::Edp) {
            let n = self.size(Axis::Ep).max(1) as usize;
            let d = self.data_position(rank);
            return if axis == Axis::Ep { d % n } else { d / n };
        }
        let mut stride = 1usize;
        for (a, n) in self.dense() {
            if a == axis {
                return rank / stride % n as usize;
            }
            stride *= n as usize;
        }
        0
    }

    /// The rank with `rank`'s coordinates except `coord` along `axis`.
    pub fn rank_with(&self, rank: usize, axis: Axis, coord: usize) -> usize {
        let mut stride = 1usize;
        for (a, n) in self.dense() {
            if a == axis {
                let old = rank / stride % n as usize;
                return rank - old * stride + coord * stride;
            }
            stride *= n as usize;
        }
        rank
    }

    /// The rank that holds pipeline chunk `chunk` among `rank`'s pipeline group: `rank`'s
    /// coordinates, with the pipeline one [`chunk_owner`]'s.
    pub fn chunk_peer(&self, rank: usize, chunk: u32) -> usize {
        let pp = u32::try_from(self.size(Axis::Pp)).unwrap_or(u32::MAX);
        self.rank_with(rank, Axis::Pp, chunk_owner(chunk, pp) as usize)
    }

    /// The peer of a pipeline transfer from `rank` for chunk `chunk`: with `twin`, the
    /// MegaFBD twin (the same coordinates, the other fbd one); otherwise [`Mesh::chunk_peer`].
    pub fn transfer_peer(&self, rank: usize, chunk: u32, twin: bool) -> usize {
        if twin {
            let fbd = self.coord(rank, Axis::Fbd);
            return self.rank_with(rank, Axis::Fbd, 1 - fbd.min(1));
        }
        self.chunk_peer(rank, chunk)
    }

    /// `rank`'s position in its dp·cp group (rank order).
    fn data_position(&self, rank: usize) -> usize {
        let mut stride = 1usize;
        let mut d = 0usize;
        let mut scale = 1usize;
        for (a, n) in self.dense() {
            if matches!(a, Axis::Dp | Axis::Cp) {
                d += (rank / stride % n as usize) * scale;
                scale *= n as usize;
            }
            stride *= n as usize;
        }
        d
    }

    /// The ranks that differ from `rank` only along `axes` (its group over those axes),
    /// sorted; for one axis this is also the axis order. `ep` and `edp` fold over dp·cp
    /// (module documentation); `ep` with `edp` is the dp·cp group.
    pub fn group(&self, rank: usize, axes: &[Axis]) -> Vec<usize> {
        let (ep, edp) = (axes.contains(&Axis::Ep), axes.contains(&Axis::Edp));
        if !ep && !edp {
            return self.dense_group(rank, axes);
        }
        let mut rest: Vec<Axis> = axes
            .iter()
            .copied()
            .filter(|a| !matches!(a, Axis::Ep | Axis::Edp))
            .collect();
        if ep && edp {
            rest.extend([Axis::Dp, Axis::Cp]);
            return self.dense_group(rank, &rest);
        }
        let n = self.size(Axis::Ep).max(1) as usize;
        let mut out = Vec::new();
        for r in self.dense_group(rank, &rest) {
            let data = self.dense_group(r, &[Axis::Dp, Axis::Cp]);
            let d = self.data_position(r);
            if ep {
                out.extend_from_slice(&data[d / n * n..(d / n + 1) * n]);
            } else {
                out.extend(data.iter().skip(d % n).step_by(n));
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    fn dense_group(&self, rank: usize, axes: &[Axis]) -> Vec<usize> {
        let mut stride = 1usize;
        let mut base = rank;
        let mut dims = Vec::new();
        for (a, n) in self.dense() {
            if axes.contains(&a) {
                base -= self.coord(rank, a) * stride;
                dims.push((stride, n as usize));
            }
            stride *= n as usize;
        }
        let mut ranks = vec![base];
        for (stride, n) in dims {
            ranks = ranks
                .iter()
                .flat_map(|&r| (0..n).map(move |i| r + i * stride))
                .collect();
        }
        ranks.sort_unstable();
        ranks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Megatron's example (megatron-lm.md §0.1): world 16, tp=cp=dp=pp=2, order tp-cp-ep-dp-pp.
    #[test]
    fn megatron_groups() {
        let m = Mesh {
            axes: vec![
                (Axis::Tp, 2),
                (Axis::Cp, 2),
                (Axis::Ep, 1),
                (Axis::Dp, 2),
                (Axis::Pp, 2),
            ],
        };
        assert_eq!(m.world_size(), 16);
        assert_eq!(m.group(0, &[Axis::Tp]), vec![0, 1]);
        assert_eq!(m.group(14, &[Axis::Tp]), vec![14, 15]);
        assert_eq!(m.group(1, &[Axis::Cp]), vec![1, 3]);
        assert_eq!(m.group(5, &[Axis::Cp]), vec![5, 7]);
        assert_eq!(m.group(1, &[Axis::Dp]), vec![1, 5]);
        assert_eq!(m.group(8, &[Axis::Dp]), vec![8, 12]);
        assert_eq!(m.group(3, &[Axis::Dp, Axis::Cp]), vec![1, 3, 5, 7]);
        assert_eq!(m.group(7, &[Axis::Pp]), vec![7, 15]);
        assert_eq!(m.coord(13, Axis::Pp), 1);
        assert_eq!(m.coord(13, Axis::Dp), 1);
        assert_eq!(m.coord(13, Axis::Cp), 0);
        assert_eq!(m.coord(13, Axis::Tp), 1);
    }

    /// Expert groups fold over dp·cp: ep takes consecutive members of the dp·cp group.
    #[test]
    fn expert_groups() {
        let m = Mesh {
            axes: vec![
                (Axis::Tp, 2),
                (Axis::Cp, 2),
                (Axis::Ep, 2),
                (Axis::Dp, 2),
                (Axis::Pp, 1),
            ],
        };
        // dp·cp group of rank 0: [0, 2, 4, 6]; ep pairs (0, 2) and (4, 6) = the cp groups.
        assert_eq!(m.group(0, &[Axis::Ep]), vec![0, 2]);
        assert_eq!(m.group(4, &[Axis::Ep]), vec![4, 6]);
        assert_eq!(m.group(0, &[Axis::Edp]), vec![0, 4]);
        assert_eq!(m.group(3, &[Axis::Edp]), vec![3, 7]);
        assert_eq!(m.group(1, &[Axis::Tp, Axis::Ep]), vec![0, 1, 2, 3]);
        assert_eq!(m.group(5, &[Axis::Ep, Axis::Edp]), vec![1, 3, 5, 7]);
        assert_eq!(m.coord(6, Axis::Ep), 1);
        assert_eq!(m.coord(6, Axis::Edp), 1);
        assert_eq!(m.coord(5, Axis::Ep), 0);
        assert_eq!(m.size(Axis::Edp), 2);
        let dp4 = Mesh {
            axes: vec![(Axis::Tp, 1), (Axis::Ep, 4), (Axis::Dp, 4)],
        };
        assert_eq!(dp4.group(2, &[Axis::Ep]), vec![0, 1, 2, 3]);
        assert_eq!(dp4.group(2, &[Axis::Edp]), vec![2]);
        assert_eq!(dp4.coord(3, Axis::Ep), 3);
        for r in 0..8 {
            for axis in [Axis::Ep, Axis::Edp] {
                let g = m.group(r, &[axis]);
                let coords: Vec<usize> = g.iter().map(|&x| m.coord(x, axis)).collect();
                assert_eq!(
                    coords,
                    (0..g.len()).collect::<Vec<_>>(),
                    "rank {r} {axis:?}"
                );
            }
        }
    }
}
