//! The device mesh: axis sizes in rank order, and the rank geometry derived from them
//! (Megatron's RankGenerator: the first axis of the order varies fastest).
//!
//! Expert parallelism folds over the data-parallel ranks as in Megatron ("MoE parallel
//! folding"): the dense grid is tp·cp·dp·pp; `ep` does not multiply the world size.

use serde::{Deserialize, Serialize};

use crate::types::Axis;

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

    /// Size of `axis` (1 if absent).
    pub fn size(&self, axis: Axis) -> u64 {
        self.axes
            .iter()
            .find(|(a, _)| *a == axis)
            .map_or(1, |(_, n)| *n)
    }

    /// The dense grid: every axis but `ep`, in order.
    fn dense(&self) -> impl Iterator<Item = (Axis, u64)> + '_ {
        self.axes.iter().copied().filter(|(a, _)| *a != Axis::Ep)
    }

    /// Number of ranks (tp·cp·dp·pp).
    pub fn world_size(&self) -> usize {
        self.dense().map(|(_, n)| n as usize).product()
    }

    /// Index of `rank` along `axis` (0 for `ep` and absent axes).
    pub fn coord(&self, rank: usize, axis: Axis) -> usize {
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

    /// The ranks that differ from `rank` only along `axes` (its group over those axes),
    /// sorted; for one axis this is also the axis order.
    pub fn group(&self, rank: usize, axes: &[Axis]) -> Vec<usize> {
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
}
