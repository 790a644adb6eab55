//! Launch configurations of the kernels of `kernels/cuda/`: how many blocks of how many
//! threads each kernel runs for a given size, within CUDA's limits and the kernels' own
//! assumptions (block reductions need a multiple of 32 threads, at most 1024).

/// Threads per block of the element-wise kernels.
pub const ELEMENTWISE_THREADS: u32 = 256;
/// The most blocks a grid-stride kernel (sum_squares, adamw_multi) is given.
pub const GRID_STRIDE_BLOCKS: u32 = 1024;
/// CUDA's limit on `gridDim.x`.
pub const MAX_GRID_X: u64 = (1 << 31) - 1;
/// CUDA's limit on `gridDim.y` and `gridDim.z`.
pub const MAX_GRID_YZ: u64 = 65_535;

/// One launch: a kernel's grid and block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Blocks (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads per block (x only: every kernel is one-dimensional in its block).
    pub block: u32,
}

/// What cannot be launched.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} needs {blocks} blocks, more than CUDA's {limit}")]
pub struct LaunchError {
    /// The launch's kind.
    pub what: &'static str,
    /// Blocks it would need.
    pub blocks: u64,
    /// The limit.
    pub limit: u64,
}

fn blocks(what: &'static str, n: u64, limit: u64) -> Result<u32, LaunchError> {
    if n > limit {
        return Err(LaunchError {
            what,
            blocks: n,
            limit,
        });
    }
    Ok(n.max(1) as u32)
}

/// One thread per element of `n`: `ceil(n / 256)` blocks of 256 (at least one block, so a
/// launch is always valid; the kernels check `i < n`).
pub fn elementwise(n: u64) -> Result<Launch, LaunchError> {
    Ok(Launch {
        grid: (
            blocks(
                "elementwise",
                n.div_ceil(u64::from(ELEMENTWISE_THREADS)),
                MAX_GRID_X,
            )?,
            1,
            1,
        ),
        block: ELEMENTWISE_THREADS,
    })
}

/// Threads for a block that strides over `width` elements of a row: the next multiple of
/// 32 at or above `width`, between 32 and 1024 (block_sum/block_max need whole warps).
pub fn row_threads(width: u64) -> u32 {
    (width.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// One block per row of `width` elements (norms, softmax, losses, embeddings, combine).
pub fn per_row(rows: u64, width: u64) -> Result<Launch, LaunchError> {
    Ok(Launch {
        grid: (blocks("per-row", rows, MAX_GRID_X)?, 1, 1),
        block: row_threads(width),
    })
}

/// A grid-stride reduction over `n` elements (sum_squares): at most
/// [`GRID_STRIDE_BLOCKS`] blocks of 256, each writing one partial.
pub fn grid_stride(n: u64) -> Launch {
    let b = n
        .div_ceil(u64::from(ELEMENTWISE_THREADS))
        .clamp(1, u64::from(GRID_STRIDE_BLOCKS));
    Launch {
        grid: (b as u32, 1, 1),
        block: ELEMENTWISE_THREADS,
    }
}

/// adamw_multi over `tensors` tensors of at most `largest` elements: y picks the tensor.
pub fn multi_tensor(tensors: u64, largest: u64) -> Result<Launch, LaunchError> {
    let g = grid_stride(largest);
    Ok(Launch {
        grid: (g.grid.0, blocks("multi-tensor", tensors, MAX_GRID_YZ)?, 1),
        block: g.block,
    })
}

/// The single-thread kernels (sum_partials).
pub fn single() -> Launch {
    Launch {
        grid: (1, 1, 1),
        block: 1,
    }
}

impl Launch {
    /// Threads the launch runs.
    pub fn threads(&self) -> u64 {
        u64::from(self.grid.0)
            * u64::from(self.grid.1)
            * u64::from(self.grid.2)
            * u64::from(self.block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elementwise_covers_every_element_with_whole_warps() {
        for n in [0u64, 1, 31, 255, 256, 257, 1 << 20, (1 << 20) + 3] {
            let l = elementwise(n).unwrap();
            assert!(l.threads() >= n, "{n}");
            assert!(
                l.threads() < n + 256 || n == 0,
                "{n}: at most one partial block"
            );
            assert_eq!(l.block % 32, 0);
        }
        assert!(elementwise(u64::MAX / 2).is_err());
    }

    #[test]
    fn row_blocks_are_whole_warps_of_at_most_1024() {
        assert_eq!(row_threads(0), 32);
        assert_eq!(row_threads(1), 32);
        assert_eq!(row_threads(33), 64);
        assert_eq!(row_threads(64), 64);
        assert_eq!(row_threads(4096), 1024);
        let l = per_row(7, 100).unwrap();
        assert_eq!((l.grid, l.block), ((7, 1, 1), 128));
        assert_eq!(per_row(0, 5).unwrap().grid.0, 1);
    }

    #[test]
    fn grid_stride_launches_are_capped() {
        assert_eq!(grid_stride(10).grid.0, 1);
        assert_eq!(grid_stride(1 << 30).grid.0, GRID_STRIDE_BLOCKS);
        let m = multi_tensor(40, 1000).unwrap();
        assert_eq!(m.grid, (4, 40, 1));
        assert!(multi_tensor(70_000, 1).is_err());
    }
}
