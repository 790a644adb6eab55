//! Rank memory: one arena per buffer class, sized by the plan's static memory plan.
//! Kernels get slices of buffers; the planner guarantees that a kernel's outputs never
//! overlap its inputs, so handing out a mutable slice next to shared ones is sound.

use megac_ir::plan::{BufId, Buffer, BufferClass, Plan};
use megac_ir::DType;

use crate::error::RuntimeError;

/// The arenas of one rank.
pub struct Memory {
    buffers: Vec<Buffer>,
    /// Each buffer's offset for this rank (the plan's offset plus any rank-dependent part).
    offsets: Vec<u64>,
    param: Vec<f32>,
    grad: Vec<f32>,
    opt: Vec<f32>,
    act: Vec<f32>,
    input: Vec<i32>,
}

impl Memory {
    /// Allocate rank `rank`'s arenas of `plan` (zeroed) and check every buffer lies inside
    /// its arena.
    pub fn new(plan: &Plan, rank: usize) -> Result<Memory, RuntimeError> {
        let mut need = [0u64; 5];
        let mut offsets = Vec::with_capacity(plan.buffers.len());
        for b in &plan.buffers {
            let offset = match &b.rank_offset {
                None => b.offset,
                Some(r) => {
                    let coord = plan.mesh.coord(rank, r.axis) as u64;
                    coord
                        .checked_mul(r.stride)
                        .and_then(|x| x.checked_add(b.offset))
                        .ok_or_else(|| bad(b, "overflows"))?
                }
            };
            offsets.push(offset);
            let end = offset
                .checked_add(b.len())
                .ok_or_else(|| bad(b, "overflows"))?;
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
        if need[class_index(BufferClass::Activation)] * 4 > plan.memory.activation_bytes {
            return Err(RuntimeError::Plan(format!(
                "activation buffers need {} bytes but the memory plan has {}",
                need[class_index(BufferClass::Activation)] * 4,
                plan.memory.activation_bytes
            )));
        }
        let alloc = |n: u64| vec![0.0f32; n as usize];
        Ok(Memory {
            buffers: plan.buffers.clone(),
            offsets,
            param: alloc(need[0]),
            grad: alloc(need[1]),
            opt: alloc(need[2]),
            act: alloc(need[3]),
            input: vec![0; need[4] as usize],
        })
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
