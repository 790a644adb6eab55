//! Rank memory: one arena per buffer class, sized by the plan's static memory plan.
//! Kernels get slices of buffers; the planner guarantees that a kernel's outputs never
//! overlap its inputs, so handing out a mutable slice next to shared ones is sound.

use std::collections::BTreeMap;

use megac_ir::plan::{BufId, Buffer, BufferClass, Plan};
use megac_ir::DType;

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
            let slot = &mut need[class_index(b.class)];
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
        if need[class_index(BufferClass::Activation)] * 4 > planned {
            return Err(RuntimeError::Plan(format!(
                "activation buffers need {} bytes but the memory plan has {planned}",
                need[class_index(BufferClass::Activation)] * 4,
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

    /// An f32 buffer, read-only.
    pub fn f32(&self, b: BufId) -> &[f32] {
        let (class, off, len) = self.range(b);
        // SAFETY: bounds were checked in `new`; no mutable slice of this range is alive
        // while a kernel reads it (the planner never overlaps a kernel's inputs and outputs).
        unsafe { std::slice::from_raw_parts(self.arena_ptr(class).add(off), len) }
    }

    /// An f32 buffer, writable.
    #[allow(clippy::mut_from_ref)]
    pub fn f32_mut(&self, b: BufId) -> &mut [f32] {
        let (class, off, len) = self.range(b);
        // SAFETY: as in `f32`; outputs of one kernel are distinct, non-overlapping buffers.
        unsafe { std::slice::from_raw_parts_mut(self.arena_ptr(class).add(off), len) }
    }

    /// An i32 (input) buffer.
    pub fn i32(&self, b: BufId) -> &[i32] {
        let (class, off, len) = self.range(b);
        if class == BufferClass::Activation {
            // SAFETY: in bounds (checked in `new`); f32 and i32 have the same size and
            // alignment and every bit pattern is a valid i32.
            return unsafe {
                std::slice::from_raw_parts(self.arena_ptr(class).add(off) as *const i32, len)
            };
        }
        &self.input[off..off + len]
    }

    /// An i32 activation buffer (MoE expert indices), writable.
    #[allow(clippy::mut_from_ref)]
    pub fn i32_act_mut(&self, b: BufId) -> &mut [i32] {
        let (class, off, len) = self.range(b);
        assert_eq!(
            class,
            BufferClass::Activation,
            "i32_act_mut on a {class:?} buffer"
        );
        // SAFETY: as in `i32`; the planner never overlaps a kernel's outputs with its inputs.
        unsafe { std::slice::from_raw_parts_mut(self.arena_ptr(class).add(off) as *mut i32, len) }
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

fn class_index(c: BufferClass) -> usize {
    match c {
        BufferClass::Param => 0,
        BufferClass::Grad => 1,
        BufferClass::OptState => 2,
        BufferClass::Activation => 3,
        BufferClass::Input => 4,
    }
}

fn bad(b: &Buffer, what: &str) -> RuntimeError {
    RuntimeError::Plan(format!("buffer {} {what}", b.name))
}
