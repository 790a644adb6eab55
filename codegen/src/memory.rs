//! The static memory plan: activation buffers get offsets in one arena so that buffers whose
//! lifetimes overlap never overlap in memory, and buffers that are never live at the same time
//! share it.
//!
//! Lifetimes are instruction intervals over the micro-batch program followed by the optimizer
//! program; a view shares its root buffer's storage and extends its lifetime. Placement is
//! greedy best-known practice (largest first, lowest free offset), deterministic.

use std::collections::BTreeMap;

use megac_ir::plan::{BufId, Buffer, BufferClass, Instr};

/// Record in `plan`'s memory plans the cpu backend's staging area of each role
/// ([`Plan::staging_elements`]; zero in fp32 plans).
pub fn add_staging(plan: &mut megac_ir::plan::Plan) {
    let mut most = 0;
    for r in 0..plan.roles.len() {
        let bytes = plan.staging_elements(&plan.roles[r]) * 4;
        most = most.max(bytes);
        if let Some(m) = plan.roles[r].memory.as_mut() {
            m.staging_bytes = bytes;
        }
    }
    plan.memory.staging_bytes = most;
}

/// The programs whose liveness decides the plan.
pub struct Liveness {
    /// Programs in execution order.
    pub programs: Vec<Vec<Instr>>,
    /// View buffer -> root buffer.
    pub view_of: BTreeMap<BufId, BufId>,
}

/// Bytes a buffer takes in the activation arena: its size rounded up to the 4-byte unit in
/// which placements are aligned.
fn slot_bytes(b: &Buffer) -> u64 {
    (b.len() * b.dtype.size_bytes()).div_ceil(4) * 4
}

/// Peak of the activation bytes live at the same time (a lower bound for any placement).
pub fn live_peak(buffers: &[Buffer], live: &Liveness, live_to_end: &[BufId]) -> u64 {
    live_peak_where(buffers, live, live_to_end, &|_| true)
}

/// [`live_peak`] of the allocation units (root buffers) `include` accepts.
pub fn live_peak_where(
    buffers: &[Buffer],
    live: &Liveness,
    live_to_end: &[BufId],
    include: &dyn Fn(BufId) -> bool,
) -> u64 {
    let intervals = intervals(buffers, live, live_to_end, include);
    let end = intervals.values().map(|i| i.1).max().unwrap_or(0);
    let mut delta = vec![0i64; end + 2];
    for (&b, &(s, e)) in &intervals {
        let len = slot_bytes(&buffers[b as usize]) as i64;
        delta[s] += len;
        delta[e + 1] -= len;
    }
    let mut cur = 0i64;
    let mut peak = 0i64;
    for d in delta {
        cur += d;
        peak = peak.max(cur);
    }
    peak as u64
}

/// Assign offsets to every activation buffer; returns the arena size in bytes. Placement is
/// in bytes, aligned to 4; a buffer's `offset` counts elements of its own dtype (byte offset
/// / dtype size), so 4-byte buffers keep the runtime's f32 indexing and bf16 ones take half
/// the room. `live_to_end` buffers stay live to the end of the first program (results read
/// after it).
pub fn assign_offsets(buffers: &mut [Buffer], live: &Liveness, live_to_end: &[BufId]) -> u64 {
    assign_offsets_where(buffers, live, live_to_end, &|_| true)
}

/// [`assign_offsets`] for the allocation units (root buffers) `include` accepts; the others
/// keep their offsets (and every view takes its root's).
pub fn assign_offsets_where(
    buffers: &mut [Buffer],
    live: &Liveness,
    live_to_end: &[BufId],
    include: &dyn Fn(BufId) -> bool,
) -> u64 {
    let interval = intervals(buffers, live, live_to_end, include);
    // Largest first; ties by id, so the plan is deterministic.
    let mut order: Vec<(BufId, u64)> = interval
        .keys()
        .map(|&b| (b, slot_bytes(&buffers[b as usize])))
        .collect();
    order.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut placed: Vec<(u64, u64, usize, usize)> = Vec::new(); // offset, len, start, end
    let mut arena = 0u64;
    for (b, len) in order {
        let (s, e) = interval[&b];
        let mut busy: Vec<(u64, u64)> = placed
            .iter()
            .filter(|p| p.2 <= e && s <= p.3)
            .map(|p| (p.0, p.0 + p.1))
            .collect();
        busy.sort_unstable();
        // Best fit: the smallest gap between conflicting buffers that holds this one (or the
        // end of the arena), which fragments less than the first gap that fits.
        let mut best: Option<(u64, u64)> = None; // (gap size, offset)
        let mut cursor = 0u64;
        for (lo, hi) in busy {
            if lo > cursor && lo - cursor >= len {
                let gap = lo - cursor;
                if best.is_none_or(|(g, _)| gap < g) {
                    best = Some((gap, cursor));
                }
            }
            cursor = cursor.max(hi);
        }
        let offset = match best {
            Some((_, at)) => at,
            None => cursor,
        };
        placed.push((offset, len, s, e));
        arena = arena.max(offset + len);
        buffers[b as usize].offset = offset / buffers[b as usize].dtype.size_bytes().max(1);
    }
    // Views take their root's offset (converted to their own dtype's elements).
    for (&v, &r) in &live.view_of {
        let bytes = buffers[r as usize].offset * buffers[r as usize].dtype.size_bytes();
        buffers[v as usize].offset = bytes / buffers[v as usize].dtype.size_bytes().max(1);
    }
    arena
}

/// The lifetime (first and last instruction) of every activation allocation unit (a buffer
/// and its views).
fn intervals(
    buffers: &[Buffer],
    live: &Liveness,
    live_to_end: &[BufId],
    include: &dyn Fn(BufId) -> bool,
) -> BTreeMap<BufId, (usize, usize)> {
    let root = |b: BufId| *live.view_of.get(&b).unwrap_or(&b);
    let mut interval: BTreeMap<BufId, (usize, usize)> = BTreeMap::new();
    let mut t = 0usize;
    let mut first_end = 0usize;
    for (pi, program) in live.programs.iter().enumerate() {
        for instr in program {
            let touched: Vec<BufId> = instr.buffers();
            for b in touched {
                let r = root(b);
                if buffers[r as usize].class != BufferClass::Activation || !include(r) {
                    continue;
                }
                let e = interval.entry(r).or_insert((t, t));
                e.1 = e.1.max(t);
            }
            t += 1;
        }
        if pi == 0 {
            first_end = t.saturating_sub(1);
        }
    }
    for &b in live_to_end {
        if let Some(e) = interval.get_mut(&root(b)) {
            e.1 = e.1.max(first_end);
        }
    }

    interval
}
