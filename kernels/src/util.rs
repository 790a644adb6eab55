//! Threading helpers shared by the kernels.

/// Element count from which an elementwise kernel splits its work over rayon threads.
pub(crate) const PAR_MIN_ELEMS: usize = 1 << 15;

/// Chunk length for parallel elementwise loops over `len` elements: big enough that a
/// rayon task costs little next to its work, small enough to balance two or more cores.
pub(crate) fn elem_chunk(len: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    (len.div_ceil(4 * threads)).max(8192)
}

/// Number of rows per rayon task for row-wise kernels with rows of `width` elements, or
/// `None` when `rows * width` is too small to be worth splitting.
pub(crate) fn row_chunk(rows: usize, width: usize) -> Option<usize> {
    let total = rows.saturating_mul(width.max(1));
    if total < PAR_MIN_ELEMS || rows < 2 {
        return None;
    }
    let threads = rayon::current_num_threads().max(1);
    let by_balance = rows.div_ceil(4 * threads);
    let by_size = 4096usize.div_ceil(width.max(1));
    Some(by_balance.max(by_size).max(1))
}

/// A raw pointer that may cross threads. Kernels use it to let parallel tasks write
/// disjoint, strided regions of one output (e.g. one attention head of `[b, s, nh, d]`).
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub(crate) *mut f32);

// SAFETY: every user writes through the pointer only to regions no other task touches.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    #[inline(always)]
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// A shared raw pointer that may cross threads (read-only inputs of strided gemms).
#[derive(Clone, Copy)]
pub(crate) struct SendConstPtr(pub(crate) *const f32);

// SAFETY: only read through, while the owning slice is borrowed for the whole kernel.
unsafe impl Send for SendConstPtr {}
// SAFETY: as above.
unsafe impl Sync for SendConstPtr {}

impl SendConstPtr {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    #[inline(always)]
    pub(crate) fn get(self) -> *const f32 {
        self.0
    }
}
