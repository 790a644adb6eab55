//! Rank memory: one arena per buffer class, sized by the plan's static memory plan.
//! Kernels get slices of buffers; the plan gate proves that a kernel's outputs never
//! overlap its inputs (except the in-place kernels), so the executor may hold a mutable
//! slice next to shared ones. All raw-pointer access is in one audited function,
//! `Memory::slice_of`; `debug_assert_disjoint` re-checks the gate's proof in debug builds.
//!
//! Offsets are in elements of the buffer's own dtype (byte address = offset × size), so an
//! arena holds f32, i32 and 16-bit buffers side by side. Kernels compute in f32: before a
//! kernel with bf16/fp16 operands the executor *stages* them (`stage`: each is widened
//! exactly into a scratch area sized once here), the kernel sees f32 slices of the scratch,
//! and `unstage` rounds its outputs once into their 16-bit storage.

use std::cell::UnsafeCell;
use std::collections::BTreeMap;

use megac_ir::plan::{BufId, Buffer, BufferClass, Plan};
use megac_ir::{DType, OpKind};
use megac_kernels::precision::{self, Half};

use crate::error::RuntimeError;

/// Where rank `rank`'s buffers lie: each buffer's byte offset in its class's arena (the
/// plan's offset plus any rank-dependent part, pipeline activations in their chunk's first
/// slot) and each arena's size. The one computation of a rank's layout: the cpu backend's
/// arenas ([`Memory::new`]) and the cuda backend's device slabs use it.
#[derive(Clone, Debug)]
pub struct RankLayout {
    /// Byte offset of every buffer in its arena; `u64::MAX` for the buffers this rank does
    /// not hold (another stage's, or one its role never touches).
    pub offsets: Vec<u64>,
    /// Pipeline chunks: chunk -> (first slot's byte offset, bytes per slot, its buffers).
    pub slots: BTreeMap<u32, (u64, u64, Vec<BufId>)>,
    /// Bytes each arena needs, indexed by [`BufferClass::index`].
    pub arena_bytes: [u64; 6],
}

impl RankLayout {
    /// Lay out rank `rank`'s buffers of `plan`, checking that each lies inside its arena,
    /// aligned to its element size, in a class that can hold its dtype.
    pub fn new(
        plan: &megac_ir::gate::CheckedPlan,
        rank: usize,
    ) -> Result<RankLayout, RuntimeError> {
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
        let programs = Plan::programs_of(role);
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
        // Arena sizes in bytes; every offset below is a byte offset.
        let mut need = [0u64; 6];
        let mut offsets = Vec::with_capacity(plan.buffers.len());
        let mut slots: BTreeMap<u32, (u64, u64, Vec<BufId>)> = BTreeMap::new();
        for (id, b) in plan.buffers.iter().enumerate() {
            if b.stage.is_some_and(|s| s != stage) || !used[id] {
                // Another pipeline stage's buffer, or one this role never touches (an FBD
                // forward role's gradients): this rank holds nothing for it.
                offsets.push(u64::MAX);
                continue;
            }
            let size = b.dtype.size_bytes();
            let elems = match &b.rank_offset {
                None => b.offset,
                Some(r) => {
                    let coord = r.index(&plan.mesh, rank);
                    coord
                        .checked_mul(r.stride)
                        .and_then(|x| x.checked_add(b.offset))
                        .ok_or_else(|| bad(b, "overflows"))?
                }
            };
            let mut offset = elems.checked_mul(size).ok_or_else(|| bad(b, "overflows"))?;
            let mut end = elems
                .checked_add(b.len())
                .and_then(|x| x.checked_mul(size))
                .ok_or_else(|| bad(b, "overflows"))?;
            if let Some(c) = b.chunk {
                let &(base, elems, n) = chunk_info.get(&c).ok_or_else(|| {
                    bad(
                        b,
                        &format!("belongs to chunk {c}, which rank {rank} does not run"),
                    )
                })?;
                // A chunk's slots are counted in 4-byte words.
                let (base, slot) = (base * 4, elems * 4);
                if end > slot {
                    return Err(bad(
                        b,
                        &format!("does not fit the {elems} words of a chunk-{c} slot"),
                    ));
                }
                offset += base;
                end = slot
                    .checked_mul(u64::from(n))
                    .and_then(|x| x.checked_add(base))
                    .ok_or_else(|| bad(b, "overflows"))?;
                slots
                    .entry(c)
                    .or_insert((base, slot, Vec::new()))
                    .2
                    .push(id as BufId);
            }
            if offset % size != 0 {
                return Err(bad(b, "is not aligned to its element size"));
            }
            offsets.push(offset);
            let slot = &mut need[b.class.index()];
            *slot = (*slot).max(end);
            let int = b.dtype == DType::I32;
            // i32 lives in the input arena (token ids) or, as MoE expert indices, in the
            // activation arena (4-byte slots, reinterpreted); f32 inputs (activation
            // patching's replacements, `patch:POINT`) in the input arena likewise.
            if int && !matches!(b.class, BufferClass::Input | BufferClass::Activation)
                || !int && b.class == BufferClass::Input && b.dtype != DType::F32
            {
                return Err(bad(b, "has a dtype this runtime cannot hold in its class"));
            }
        }
        // Every buffer this rank's programs touch must be one it holds.
        for instr in programs.iter().copied().flatten() {
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
        if need[BufferClass::Activation.index()] > planned {
            return Err(RuntimeError::Plan(format!(
                "activation buffers need {} bytes but the memory plan has {planned}",
                need[BufferClass::Activation.index()],
            )));
        }
        Ok(RankLayout {
            offsets,
            slots,
            arena_bytes: need,
        })
    }
}

/// The arenas of one rank.
pub struct Memory {
    buffers: Vec<Buffer>,
    /// Each buffer's byte offset in its arena for this rank (the plan's offset plus any
    /// rank-dependent part, plus the chunk slot's start for pipeline activations).
    offsets: Vec<u64>,
    /// Pipeline chunks: chunk -> (first slot's byte offset, bytes per slot, its buffers).
    slots: BTreeMap<u32, (u64, u64, Vec<BufId>)>,
    param: Vec<f32>,
    grad: Vec<f32>,
    opt: Vec<f32>,
    act: Vec<f32>,
    input: Vec<i32>,
    /// KV-cache decoding: the caches (persistent between steps).
    kv: Vec<f32>,
    /// The widened copies of the 16-bit operands of the kernel being run.
    staging: UnsafeCell<Staging>,
    /// The rank's fused kernels (`crate::fusion`; none when fusion is off).
    fused: crate::fusion::Fused,
}

/// f32 copies of 16-bit buffers, made for one kernel call.
struct Staging {
    /// Sized once by `Memory::new` to the largest instruction's 16-bit operands.
    scratch: Vec<f32>,
    /// (buffer, start in `scratch`) of each staged buffer.
    entries: Vec<(BufId, usize)>,
}

/// The 16-bit format of a dtype, if it is one.
fn half_of(d: DType) -> Option<Half> {
    match d {
        DType::Bf16 => Some(Half::Bf16),
        DType::F16 => Some(Half::F16),
        _ => None,
    }
}

impl Memory {
    /// Allocate rank `rank`'s arenas of `plan` (zeroed) and check every buffer it holds lies
    /// inside its arena. In a pipelined plan the rank holds only its stage's buffers, and each
    /// of its chunks' activations once per slot.
    pub fn new(plan: &megac_ir::gate::CheckedPlan, rank: usize) -> Result<Memory, RuntimeError> {
        let RankLayout {
            offsets,
            slots,
            arena_bytes: need,
        } = RankLayout::new(plan, rank)?;
        let fused = crate::fusion::Fused::build(plan, rank)?;
        let plan: &Plan = plan;
        let role = &plan.roles[plan.rank_to_role[rank] as usize];
        // Scratch for the widest instruction's 16-bit operands (each distinct buffer once).
        let scratch = plan.staging_elements(role);
        let words = |bytes: u64| bytes.div_ceil(4);
        Ok(Memory {
            fused,
            buffers: plan.buffers.clone(),
            offsets,
            slots,
            param: zeroed(words(need[0]), "parameter")?,
            grad: zeroed(words(need[1]), "gradient")?,
            opt: zeroed(words(need[2]), "optimizer state")?,
            act: zeroed(words(need[3]), "activation")?,
            input: zeroed(words(need[4]), "input")?,
            kv: zeroed(words(need[5]), "KV cache")?,
            staging: UnsafeCell::new(Staging {
                scratch: zeroed(scratch, "mixed-precision scratch")?,
                entries: Vec::with_capacity(16),
            }),
        })
    }

    /// Whether this rank holds buffer `b` (a pipeline stage holds only its own).
    pub fn holds(&self, b: BufId) -> bool {
        self.offsets.get(b as usize).is_some_and(|&o| o != u64::MAX)
    }

    /// Point the activations of pipeline chunk `chunk` at its slot `slot` (the micro-batch
    /// that runs next keeps its activations there until its backward is done).
    pub fn set_slot(&mut self, chunk: u32, slot: u32) {
        if let Some((base, bytes, ids)) = self.slots.get(&chunk) {
            for &b in ids {
                let buf = &self.buffers[b as usize];
                self.offsets[b as usize] =
                    base + u64::from(slot) * bytes + buf.offset * buf.dtype.size_bytes();
            }
        }
    }

    /// The buffer table entry of `b`.
    pub fn buffer(&self, b: BufId) -> &Buffer {
        &self.buffers[b as usize]
    }

    /// (class, byte offset, bytes) of buffer `b` on this rank.
    fn range(&self, b: BufId) -> (BufferClass, usize, usize) {
        let buf = &self.buffers[b as usize];
        (
            buf.class,
            self.offsets[b as usize] as usize,
            (buf.len() * buf.dtype.size_bytes()) as usize,
        )
    }

    /// The one place a buffer's slice is made from an arena's raw pointer: its storage, as
    /// elements of `T` (f32, i32 or the raw bits of a 16-bit float; `T`'s size is the
    /// buffer's element size). Every other accessor goes through here; callers downgrade to
    /// `&[T]` when they only read.
    ///
    /// Soundness rests on two facts, one proved per plan and one per call site:
    /// - In bounds and aligned: `new` placed every buffer this rank holds inside its arena
    ///   (checked, overflow-free) at a byte offset that is a multiple of its element size
    ///   (the arenas are 4-aligned), and `set_slot` moves chunk buffers only between the
    ///   slots `new` sized. The arenas are never resized after `new`.
    /// - No aliasing: the only callers that take a mutable slice through `&self` are the
    ///   executor's (`f32_mut`, `i32_act_mut`, staging are `pub(crate)`), and it takes one only of
    ///   the buffer a `zero`/`recv` instruction writes or of an output of the kernel it
    ///   runs (and `adamw`'s gradient input, which it clips, disjoint from its outputs).
    ///   The plan reached the executor as a [`megac_ir::gate::CheckedPlan`], whose check
    ///   proves a kernel's outputs overlap neither each other nor its inputs, except the
    ///   in-place kernels of [`megac_ir::gate::in_place_ok`]; for those the executor holds
    ///   only the mutable slice. `debug_assert_disjoint` re-checks that proof on this
    ///   rank's actual offsets in debug builds before every kernel.
    #[allow(clippy::mut_from_ref)]
    fn slice_of<T: Word>(&self, b: BufId) -> &mut [T] {
        let (class, off, bytes) = self.range(b);
        let size = self.buffers[b as usize].dtype.size_bytes() as usize;
        assert_eq!(
            size,
            std::mem::size_of::<T>(),
            "buffer {b} ({}) accessed as {}-byte elements",
            self.buffers[b as usize].dtype.as_str(),
            std::mem::size_of::<T>()
        );
        let (ptr, arena) = match class {
            BufferClass::Param => (self.param.as_ptr() as *mut u8, self.param.len()),
            BufferClass::Grad => (self.grad.as_ptr() as *mut u8, self.grad.len()),
            BufferClass::OptState => (self.opt.as_ptr() as *mut u8, self.opt.len()),
            BufferClass::Activation => (self.act.as_ptr() as *mut u8, self.act.len()),
            BufferClass::KvCache => (self.kv.as_ptr() as *mut u8, self.kv.len()),
            BufferClass::Input => {
                assert!(
                    T::IS_I32 || self.buffers[b as usize].dtype == DType::F32,
                    "non-i32 access to the i32 input buffer {b}"
                );
                (self.input.as_ptr() as *mut u8, self.input.len())
            }
        };
        assert!(
            off.checked_add(bytes).is_some_and(|end| end <= arena * 4) && off % size == 0,
            "buffer {b} lies outside its arena"
        );
        // SAFETY: see above: in bounds of a live arena of 4-byte words, aligned for `T`
        // (every bit pattern is valid for f32, i32 and u16), and not aliased while the
        // returned slice is used.
        unsafe { std::slice::from_raw_parts_mut(ptr.add(off) as *mut T, bytes / size) }
    }

    /// The f32 view of buffer `b`: its storage, or for a 16-bit buffer the widened copy
    /// the executor staged for the kernel it runs.
    #[allow(clippy::mut_from_ref)]
    fn f32_view(&self, b: BufId) -> &mut [f32] {
        if !self.buffers[b as usize].dtype.is_half() {
            return self.slice_of(b);
        }
        // SAFETY: `staging` is only mutated by `stage`/`unstage`, which the executor calls
        // between kernels, never while a slice handed out here is alive; the scratch
        // is never resized after `new`. Distinct staged buffers get disjoint scratch
        // ranges, so the aliasing argument of `slice_of` carries over.
        let st = unsafe { &mut *self.staging.get() };
        let &(_, start) = st
            .entries
            .iter()
            .find(|(id, _)| *id == b)
            .unwrap_or_else(|| panic!("16-bit buffer {b} used by a kernel without staging"));
        let len = self.buffers[b as usize].len() as usize;
        let ptr = st.scratch.as_mut_ptr();
        // SAFETY: `stage` reserved `start..start + len` of the scratch for `b`.
        unsafe { std::slice::from_raw_parts_mut(ptr.add(start), len) }
    }

    /// Widen every distinct 16-bit buffer among an instruction's `inputs` and `outputs` into
    /// the scratch, so that kernels see them as f32 (see [`Memory::unstage`]). Returns
    /// whether any was staged (never in a plan without 16-bit buffers: no scratch).
    pub(crate) fn stage(&self, inputs: &[BufId], outputs: &[BufId]) -> bool {
        // SAFETY: called between kernels: no slice of the scratch is alive.
        let st = unsafe { &mut *self.staging.get() };
        st.entries.clear();
        if st.scratch.is_empty() {
            return false;
        }
        let mut next = 0usize;
        for &b in inputs.iter().chain(outputs) {
            let buf = &self.buffers[b as usize];
            let Some(kind) = half_of(buf.dtype) else {
                continue;
            };
            if st.entries.iter().any(|(id, _)| *id == b) {
                continue;
            }
            let len = buf.len() as usize;
            let bits: &[u16] = self.slice_of(b);
            precision::widen(kind, bits, &mut st.scratch[next..next + len]);
            st.entries.push((b, next));
            next += len;
        }
        !st.entries.is_empty()
    }

    /// Round the staged copies of the 16-bit buffers among `outputs` once into their
    /// storage, and forget every staged copy.
    pub(crate) fn unstage(&self, outputs: &[BufId]) {
        // SAFETY: called after the kernel returned: no slice of the scratch is alive.
        let st = unsafe { &mut *self.staging.get() };
        for &(b, start) in &st.entries {
            if !outputs.contains(&b) {
                continue;
            }
            let buf = &self.buffers[b as usize];
            let kind = half_of(buf.dtype).expect("only 16-bit buffers are staged");
            let len = buf.len() as usize;
            let bits: &mut [u16] = self.slice_of(b);
            precision::narrow(kind, &st.scratch[start..start + len], bits);
        }
        st.entries.clear();
    }

    /// The rank's fused kernels.
    pub(crate) fn fused(&self) -> &crate::fusion::Fused {
        &self.fused
    }

    /// Buffer `b`'s storage as (pointer, elements), for a fused kernel that reads and
    /// writes it in place (16-bit buffers as their raw bits: the kernel widens them).
    #[cfg(feature = "mlir")]
    pub(crate) fn raw(&self, b: BufId) -> (*mut u8, i64) {
        match self.buffers[b as usize].dtype.size_bytes() {
            2 => {
                let s = self.slice_of::<u16>(b);
                (s.as_mut_ptr() as *mut u8, s.len() as i64)
            }
            _ => {
                let s = self.slice_of::<f32>(b);
                (s.as_mut_ptr() as *mut u8, s.len() as i64)
            }
        }
    }

    /// Set buffer `b` to zero (any dtype).
    pub(crate) fn zero(&self, b: BufId) {
        match self.buffers[b as usize].dtype.size_bytes() {
            2 => self.slice_of::<u16>(b).fill(0),
            _ => self.slice_of::<f32>(b).fill(0.0),
        }
    }

    /// Buffer `b`'s values as f32 (16-bit values widened exactly).
    pub fn read_f32(&self, b: BufId) -> Vec<f32> {
        match half_of(self.buffers[b as usize].dtype) {
            Some(kind) => {
                let bits: &[u16] = self.slice_of(b);
                bits.iter().map(|&x| kind.to_f32(x)).collect()
            }
            None => self.slice_of::<f32>(b).to_vec(),
        }
    }

    /// Store `values` into buffer `b` (rounded once for a 16-bit buffer).
    pub fn write_f32(&mut self, b: BufId, values: &[f32]) {
        match half_of(self.buffers[b as usize].dtype) {
            Some(kind) => precision::narrow(kind, values, self.slice_of(b)),
            None => self.slice_of::<f32>(b).copy_from_slice(values),
        }
    }

    /// A 16-bit buffer's bit patterns, writable (None for any other dtype): the bits the
    /// kernels read, for the weight faults of `megac train --perturb`.
    pub fn half_bits_mut(&mut self, b: BufId) -> Option<(Half, &mut [u16])> {
        let kind = half_of(self.buffers[b as usize].dtype)?;
        Some((kind, self.slice_of(b)))
    }

    /// An f32 buffer, read-only (a 16-bit buffer only while staged for a kernel).
    pub fn f32(&self, b: BufId) -> &[f32] {
        self.f32_view(b)
    }

    /// An f32 buffer, writable through a shared `Memory`: the executor's access to the
    /// buffer an instruction writes (see `slice_of` for why this is sound).
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn f32_mut(&self, b: BufId) -> &mut [f32] {
        self.f32_view(b)
    }

    /// An f32 buffer, writable: the safe access for code that owns the memory (tests,
    /// tools); the exclusive borrow of `self` rules out any other slice. 16-bit buffers
    /// are written with [`Memory::write_f32`].
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
        self.slice_of(b)
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

    /// The raw bytes of arena `class` (the cuda backend uploads them into its slabs).
    pub fn arena_bytes(&self, class: BufferClass) -> &[u8] {
        fn bytes<T>(v: &[T]) -> &[u8] {
            // SAFETY: f32 and i32 arenas: plain 4-byte words, every byte initialised.
            unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
        }
        match class {
            BufferClass::Param => bytes(&self.param),
            BufferClass::Grad => bytes(&self.grad),
            BufferClass::OptState => bytes(&self.opt),
            BufferClass::Activation => bytes(&self.act),
            BufferClass::Input => bytes(&self.input),
            BufferClass::KvCache => bytes(&self.kv),
        }
    }
}

impl Memory {
    /// The raw bytes of arena `class`, writable (the cuda backend downloads its slabs into
    /// them, e.g. the trained parameters before saving).
    pub fn arena_bytes_mut(&mut self, class: BufferClass) -> &mut [u8] {
        fn bytes<T>(v: &mut [T]) -> &mut [u8] {
            // SAFETY: f32 and i32 arenas: plain 4-byte words, any bytes are a valid value.
            unsafe {
                std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v))
            }
        }
        match class {
            BufferClass::Param => bytes(&mut self.param),
            BufferClass::Grad => bytes(&mut self.grad),
            BufferClass::OptState => bytes(&mut self.opt),
            BufferClass::Activation => bytes(&mut self.act),
            BufferClass::Input => bytes(&mut self.input),
            BufferClass::KvCache => bytes(&mut self.kv),
        }
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

/// The element types a buffer is viewed as: at most 4 bytes and 4-aligned (the arenas'
/// alignment), every bit pattern valid.
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
/// The bits of a bf16/fp16 element.
impl Word for u16 {
    const IS_I32: bool = false;
}

fn bad(b: &Buffer, what: &str) -> RuntimeError {
    RuntimeError::Plan(format!("buffer {} {what}", b.name))
}
