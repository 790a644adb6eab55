//! Rank memory: one arena per buffer class, sized by the plan's static memory plan.
//! Kernels get slices of buffers; the plan gate proves that a kernel's outputs never
//! overlap its inputs (except the in-place kernels), so the executor may hold a mutable
//! slice next to shared ones. All raw-pointer access is in one audited function,
//! `Memory::slice_of`; `debug_assert_disjoint` re-checks the gate's proof in debug builds.

use std::collections::BTreeMap;

use megac_ir::plan::{BufId, Buffer, BufferClass, Plan};
use megac_ir::{DType, OpKind};

use crate::error::RuntimeError;

/// The arenas of one rank.
pub struct Memory {
    buffers: Vec<Buffer>,
    /// Each buffer's offset for this rank (the plan's offset plus any rank-dependent part,
    /// plus the chunk slot's start for pipeline activations).
    offsets: Vec<u64>,
    /// Pipeline chunks: chunk -> (first slot's offset, elements per slot, its buffers).
    slots: BTreeMap<u32, (u64, u64, Vec<BufId>)>,
    param: Vec<f32>,
    grad: Vec<f32>,
    opt: Vec<f32>,
    act: Vec<f32>,
    input: Vec<i32>,
}

impl Memory {
    /// Allocate rank `rank`'s arenas of `plan` (zeroed) and check every buffer it holds lies
    /// inside its arena. In a pipelined plan the rank holds only its stage's buffers, and each
    /// of its chunks' activations once per slot.
    pub fn new(plan: &megac_ir::gate::CheckedPlan, rank: usize) -> Result<Memory, RuntimeError> {
        let plan: &Plan = plan;
        let stage = plan.mesh.coord(rank, megac_ir::Axis::Pp) as u32;
        let role = plan
            .rank_to_role
            .get(rank)
            .and_then(|&r| plan.roles.get(r as usize))
            .ok_or_else(|| RuntimeError::Plan(format!("rank {rank} has no role")))?;
        let mut chunk_info: BTreeMap<u32, (u64, u64, u32)> = BTreeMap::new();
        if let Some(p) = &role.pipeline {
            for c in &p.chunks {
                chunk_info.insert(c.chunk, (c.activation_base, c.activation_elems, c.slots));
            }
        }
        // What the role's programs touch, and the parameters (initialised, saved).
        let mut programs: Vec<&[megac_ir::plan::Instr]> = vec![&role.microbatch, &role.optimizer];
        if let Some(p) = &role.pipeline {
            for c in &p.chunks {
                programs.extend([&c.forward[..], &c.backward[..], &c.weight[..]]);
            }
        }
        let mut used = vec![false; plan.buffers.len()];
        for instr in programs.iter().copied().flatten() {
            for b in instr.buffers() {
                if let Some(u) = used.get_mut(b as usize) {
                    *u = true;
                }
            }
        }
        for p in &plan.params {
            for b in std::iter::once(p.buffer).chain(p.tied_copies.iter().copied()) {
                if let Some(u) = used.get_mut(b as usize) {
                    *u = true;
                }
            }
        }
        // The data inputs it is fed and the results it reports, even if no instruction
        // of its programs touches them (the gate checks them like the others).
        for &b in role.inputs.values().chain(role.results.values()) {
            if let Some(u) = used.get_mut(b as usize) {
                *u = true;
            }
        }
        let mut need = [0u64; 5];
        let mut offsets = Vec::with_capacity(plan.buffers.len());
        let mut slots: BTreeMap<u32, (u64, u64, Vec<BufId>)> = BTreeMap::new();
        for (id, b) in plan.buffers.iter().enumerate() {
            if b.stage.is_some_and(|s| s != stage) || !used[id] {
                // Another pipeline stage's buffer, or one this role never touches (an FBD
                // forward role's gradients): this rank holds nothing for it.
                offsets.push(u64::MAX);
                continue;
            }
            let mut offset = match &b.rank_offset {
                None => b.offset,
                Some(r) => {
                    let coord = plan.mesh.coord(rank, r.axis) as u64;
                    coord
                        .checked_mul(r.stride)
                        .and_then(|x| x.checked_add(b.offset))
                        .ok_or_else(|| bad(b, "overflows"))?
                }
            };
            let mut end = offset
                .checked_add(b.len())
                .ok_or_else(|| bad(b, "overflows"))?;
            if let Some(c) = b.chunk {
                let &(base, elems, n) = chunk_info.get(&c).ok_or_else(|| {
                    bad(
                        b,
                        &format!("belongs to chunk {c}, which rank {rank} does not run"),
                    )
                })?;
                if end > elems {
                    return Err(bad(
                        b,
                        &format!("does not fit the {elems} elements of a chunk-{c} slot"),
                    ));
                }
                offset += base;
                end = elems
                    .checked_mul(u64::from(n))
                    .and_then(|x| x.checked_add(base))
                    .ok_or_else(|| bad(b, "overflows"))?;
                slots
                    .entry(c)
                    .or_insert((base, elems, Vec::new()))
                    .2
                    .push(id as BufId);
            }
            offsets.push(offset);
            let slot = &mut need[b.class.index()];
            *slot = (*slot).max(end);
            let int = b.dtype == DType::I32;
            // i32 lives in the input arena (token ids) or, as MoE expert indices, in the
            // activation arena (4-byte slots, reinterpreted).
            if int && !matches!(b.class, BufferClass::Input | BufferClass::Activation)
                || !int && b.class == BufferClass::Input
            {
                return Err(bad(b, "has a dtype this runtime cannot hold in its class"));
            }
            if b.dtype == DType::Bf16 {
                return Err(RuntimeError::Unsupported(
                    "precision = \"bf16\" plans need bf16 kernels, which the cpu backend does not have yet; compile with train.precision = \"fp32\"".into(),
                ));
            }
        }
        // Every buffer this rank's programs touch must be one it holds.
        for instr in programs.into_iter().flatten() {
            for b in instr.buffers() {
                let held = offsets.get(b as usize).is_some_and(|&o| o != u64::MAX);
                if !held {
                    return Err(RuntimeError::Plan(format!(
                        "rank {rank} (pipeline stage {stage}) runs an instruction on buffer {b}, which it does not hold"
                    )));
                }
            }
        }
        let planned = plan.memory_of(rank).activation_bytes;
        if need[BufferClass::Activation.index()] * 4 > planned {
            return Err(RuntimeError::Plan(format!(
                "activation buffers need {} bytes but the memory plan has {planned}",
                need[BufferClass::Activation.index()] * 4,
            )));
        }
        Ok(Memory {
            buffers: plan.buffers.clone(),
            offsets,
            slots,
            param: zeroed(need[0], "parameter")?,
            grad: zeroed(need[1], "gradient")?,
            opt: zeroed(need[2], "optimizer state")?,
            act: zeroed(need[3], "activation")?,
            input: zeroed(need[4], "input")?,
        })
    }

    /// Whether this rank holds buffer `b` (a pipeline stage holds only its own).
    pub fn holds(&self, b: BufId) -> bool {
        self.offsets.get(b as usize).is_some_and(|&o| o != u64::MAX)
    }

    /// Point the activations of pipeline chunk `chunk` at its slot `slot` (the micro-batch
    /// that runs next keeps its activations there until its backward is done).
    pub fn set_slot(&mut self, chunk: u32, slot: u32) {
        if let Some((base, elems, ids)) = self.slots.get(&chunk) {
            for &b in ids {
                self.offsets[b as usize] =
                    base + u64::from(slot) * elems + self.buffers[b as usize].offset;
            }
        }
    }

    /// The buffer table entry of `b`.
    pub fn buffer(&self, b: BufId) -> &Buffer {
        &self.buffers[b as usize]
    }

    fn range(&self, b: BufId) -> (BufferClass, usize, usize) {
        let buf = &self.buffers[b as usize];
        (
            buf.class,
            self.offsets[b as usize] as usize,
            buf.len() as usize,
        )
    }

    fn arena_ptr(&self, class: BufferClass) -> *mut f32 {
        let v = match class {
            BufferClass::Param => &self.param,
            BufferClass::Grad => &self.grad,
            BufferClass::OptState => &self.opt,
            BufferClass::Activation => &self.act,
            BufferClass::Input => unreachable!("input buffers are i32"),
        };
        v.as_ptr() as *mut f32
    }

    /// The one place a buffer's slice is made from an arena's raw pointer (f32 arenas; an
    /// i32 buffer of the activation arena is reinterpreted). Every other accessor goes
    /// through here; callers downgrade to `&[T]` when they only read.
    ///
    /// Soundness rests on two facts, one proved per plan and one per call site:
    /// - In bounds: `new` placed every buffer this rank holds inside its arena (checked,
    ///   overflow-free), and `set_slot` moves chunk buffers only between the slots `new`
    ///   sized. The arenas are never resized after `new`.
    /// - No aliasing: the only callers that take a mutable slice through `&self` are the
    ///   executor's (`f32_mut`, `i32_act_mut` are `pub(crate)`), and it takes one only of
    ///   the buffer a `zero`/`recv` instruction writes or of an output of the kernel it
    ///   runs (and `adamw`'s gradient input, which it clips, disjoint from its outputs).
    ///   The plan reached the executor as a [`megac_ir::gate::CheckedPlan`], whose check
    ///   proves a kernel's outputs overlap neither each other nor its inputs, except the
    ///   in-place kernels of [`megac_ir::gate::in_place_ok`]; for those the executor holds
    ///   only the mutable slice. `debug_assert_disjoint` re-checks that proof on this
    ///   rank's actual offsets in debug builds before every kernel.
    #[allow(clippy::mut_from_ref)]
    fn slice_of<T: Word>(&self, b: BufId) -> &mut [T] {
        let (class, off, len) = self.range(b);
        let ptr = if class == BufferClass::Input {
            assert!(T::IS_I32, "f32 access to the i32 input buffer {b}");
            self.input.as_ptr() as *mut i32 as *mut T
        } else {
            self.arena_ptr(class) as *mut T
        };
        let arena = match class {
            BufferClass::Param => self.param.len(),
            BufferClass::Grad => self.grad.len(),
            BufferClass::OptState => self.opt.len(),
            BufferClass::Activation => self.act.len(),
            BufferClass::Input => self.input.len(),
        };
        debug_assert!(off.checked_add(len).is_some_and(|end| end <= arena));
        // SAFETY: see above: in bounds of a live arena of 4-byte elements (f32 and i32 share
        // size and alignment, and every bit pattern is valid for both), and not aliased
        // while the returned slice is used.
        unsafe { std::slice::from_raw_parts_mut(ptr.add(off), len) }
    }

    /// An f32 buffer, read-only.
    pub fn f32(&self, b: BufId) -> &[f32] {
        self.slice_of(b)
    }

    /// An f32 buffer, writable through a shared `Memory`: the executor's access to the
    /// buffer an instruction writes (see `slice_of` for why this is sound).
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn f32_mut(&self, b: BufId) -> &mut [f32] {
        self.slice_of(b)
    }

    /// An f32 buffer, writable: the safe access for code that owns the memory (tests,
    /// tools); the exclusive borrow of `self` rules out any other slice.
    pub fn buffer_mut(&mut self, b: BufId) -> &mut [f32] {
        self.slice_of(b)
    }

    /// An i32 buffer (token ids in the input arena, MoE expert indices in the activation
    /// arena).
    pub fn i32(&self, b: BufId) -> &[i32] {
        self.slice_of(b)
    }

    /// An i32 activation buffer (MoE expert indices), writable by the kernel that outputs it.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn i32_act_mut(&self, b: BufId) -> &mut [i32] {
        let class = self.buffers[b as usize].class;
        assert_eq!(
            class,
            BufferClass::Activation,
            "i32_act_mut on a {class:?} buffer"
        );
        self.slice_of(b)
    }

    /// Debug builds: assert, on this rank's offsets, what the gate proved for the kernel
    /// `op` and makes the executor's mutable slices sound: its outputs overlap neither each
    /// other nor its inputs, except where [`megac_ir::gate::in_place_ok`] allows.
    pub(crate) fn debug_assert_disjoint(&self, op: &OpKind, inputs: &[BufId], outputs: &[BufId]) {
        if !cfg!(debug_assertions) {
            return;
        }
        for (k, &o) in outputs.iter().enumerate() {
            for (j, &x) in inputs.iter().enumerate() {
                assert!(
                    megac_ir::gate::in_place_ok(op, j, k, x == o) || !self.overlaps(o, x),
                    "`{}`: output {k} (buffer {o}) overlaps input {j} (buffer {x})",
                    op.name()
                );
            }
            for (j, &p) in outputs[..k].iter().enumerate() {
                assert!(
                    !self.overlaps(o, p),
                    "`{}`: output {k} (buffer {o}) overlaps output {j} (buffer {p})",
                    op.name()
                );
            }
        }
    }

    /// Whether buffers `a` and `b` share an element on this rank (same arena, intersecting
    /// ranges; empty buffers overlap nothing).
    fn overlaps(&self, a: BufId, b: BufId) -> bool {
        let ((ca, sa, la), (cb, sb, lb)) = (self.range(a), self.range(b));
        ca == cb && la > 0 && lb > 0 && sa < sb + lb && sb < sa + la
    }

    /// An i32 (input) buffer, writable (the data loader fills it).
    pub fn i32_mut(&mut self, b: BufId) -> &mut [i32] {
        let (_, off, len) = self.range(b);
        &mut self.input[off..off + len]
    }

    /// Zero every gradient.
    pub fn zero_grads(&mut self) {
        self.grad.fill(0.0);
    }

    /// Bytes allocated, by arena: (params, grads, optimizer state, activations, inputs).
    pub fn bytes(&self) -> [u64; 5] {
        [
            self.param.len() as u64 * 4,
            self.grad.len() as u64 * 4,
            self.opt.len() as u64 * 4,
            self.act.len() as u64 * 4,
            self.input.len() as u64 * 4,
        ]
    }
}

/// A zeroed arena of `n` elements, or an error (not an abort) when it cannot be allocated.
fn zeroed<T: Clone + Default>(n: u64, what: &str) -> Result<Vec<T>, RuntimeError> {
    let fail = || {
        RuntimeError::Unsupported(format!(
            "cannot allocate the {what} arena of {n} elements ({} bytes): not enough memory",
            n.saturating_mul(4)
        ))
    };
    let n = usize::try_from(n).map_err(|_| fail())?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| fail())?;
    v.resize(n, T::default());
    Ok(v)
}

/// The element types an arena holds: 4 bytes, 4-aligned, every bit pattern valid.
trait Word: Copy {
    /// Whether this is `i32` (the input arena's type).
    const IS_I32: bool;
}
impl Word for f32 {
    const IS_I32: bool = false;
}
impl Word for i32 {
    const IS_I32: bool = true;
}

fn bad(b: &Buffer, what: &str) -> RuntimeError {
    RuntimeError::Plan(format!("buffer {} {what}", b.name))
}
