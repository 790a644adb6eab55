//! The device memory of one rank: one slab per arena class, laid out exactly as the plan's
//! buffer table (each buffer at the byte offset the cpu backend uses,
//! [`crate::memory::RankLayout`]), every slab starting on a 256-byte boundary, then the
//! mixed-precision staging area and the kernels' workspace. It is one allocation, made once
//! at setup; nothing is allocated inside a step.

use megac_ir::gate::CheckedPlan;
use megac_ir::plan::{BufId, BufferClass, Plan};

use crate::error::RuntimeError;
use crate::memory::RankLayout;

/// Alignment of every slab and region (cudaMalloc's own alignment).
pub const SLAB_ALIGN: u64 = 256;

/// The regions of the allocation after the five arenas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Byte offset from the allocation's start (a multiple of [`SLAB_ALIGN`]).
    pub start: u64,
    /// Bytes.
    pub bytes: u64,
}

/// Where everything of one rank lies in its device allocation.
#[derive(Clone, Debug)]
pub struct SlabLayout {
    /// The arenas in [`BufferClass::index`] order.
    pub slabs: [Region; 6],
    /// f32 copies of an instruction's 16-bit operands (the plan's `staging_elements`).
    pub staging: Region,
    /// The kernels' scratch ([`super::lower::workspace_elements`]).
    pub workspace: Region,
    /// Bytes of the whole allocation.
    pub total_bytes: u64,
    /// The rank's buffer layout (byte offsets inside each slab, chunk slots).
    pub layout: RankLayout,
    classes: Vec<BufferClass>,
}

fn round_up(x: u64) -> u64 {
    x.div_ceil(SLAB_ALIGN) * SLAB_ALIGN
}

impl SlabLayout {
    /// Lay out rank `rank` of `plan` with `workspace_bytes` of kernel scratch.
    pub fn new(
        plan: &CheckedPlan,
        rank: usize,
        workspace_bytes: u64,
    ) -> Result<SlabLayout, RuntimeError> {
        let layout = RankLayout::new(plan, rank)?;
        let p: &Plan = plan;
        let role = &p.roles[p.rank_to_role[rank] as usize];
        let overflow = || RuntimeError::Plan(format!("rank {rank}'s device memory overflows"));
        let mut at = 0u64;
        let mut region = |bytes: u64| -> Result<Region, RuntimeError> {
            let start = at;
            at = start
                .checked_add(bytes)
                .map(round_up)
                .ok_or_else(overflow)?;
            Ok(Region { start, bytes })
        };
        let mut slabs = [Region { start: 0, bytes: 0 }; 6];
        for (i, s) in slabs.iter_mut().enumerate() {
            *s = region(layout.arena_bytes[i])?;
        }
        let staging_bytes = p
            .staging_elements(role)
            .checked_mul(4)
            .ok_or_else(overflow)?;
        let staging = region(staging_bytes)?;
        let workspace = region(workspace_bytes)?;
        Ok(SlabLayout {
            slabs,
            staging,
            workspace,
            total_bytes: at,
            layout,
            classes: p.buffers.iter().map(|b| b.class).collect(),
        })
    }

    /// Byte offset of buffer `b` from the allocation's start, if this rank holds it.
    pub fn offset(&self, b: BufId) -> Option<u64> {
        let o = *self.layout.offsets.get(b as usize)?;
        (o != u64::MAX).then(|| self.slabs[self.classes[b as usize].index()].start + o)
    }

    /// Point pipeline chunk `chunk`'s activations at slot `slot`, as
    /// [`crate::memory::Memory::set_slot`] does for the cpu arenas.
    pub fn set_slot(&mut self, plan: &Plan, chunk: u32, slot: u32) {
        if let Some((base, bytes, ids)) = self.layout.slots.get(&chunk) {
            for &b in ids {
                let buf = &plan.buffers[b as usize];
                self.layout.offsets[b as usize] =
                    base + u64::from(slot) * bytes + buf.offset * buf.dtype.size_bytes();
            }
        }
    }

    /// How many held buffers start on an `align`-byte boundary, of how many held.
    pub fn aligned(&self, align: u64) -> (usize, usize) {
        let held: Vec<u64> = (0..self.classes.len() as BufId)
            .filter_map(|b| self.offset(b))
            .collect();
        (held.iter().filter(|&&o| o % align == 0).count(), held.len())
    }
}
