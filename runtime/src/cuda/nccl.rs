//! The NCCL communicators of a plan: which ranks form which communicator, in what order.
//!
//! Every collective of the plan names mesh axes; its group on rank `r` is
//! `Mesh::group(r, axes)`, the sorted member list the cpu communicators reduce over (in
//! that order). NCCL needs one communicator per such group, with NCCL rank = position in
//! the member list, so that NCCL's rank order is the plan's group order. The groups over one
//! set of axes partition the ranks; [`Communicators::of_plan`] lists them.
//!
//! Bootstrap (over MPI, `megac launch --comm nccl`): rank 0 calls `ncclGetUniqueId` and
//! broadcasts the 128-byte id over `MPI_COMM_WORLD`; every rank calls `ncclCommInitRank`
//! with it (world size, its rank) for the world communicator (pipeline send/recv, whose
//! peers are world ranks); then for each axis set, in [`Communicators::of_plan`]'s order, every
//! rank calls `ncclCommSplit(world, color, key)` with its [`CommGroup::color`] and
//! [`CommGroup::key`], which makes exactly these groups with NCCL ranks in member order
//! (`key` = position). Every rank makes the same splits in the same order, as NCCL requires.
//!
//! Built: the split calls of each rank ([`Communicators::split_calls`], host logic, tested),
//! and [`NcclComms::init`], which makes the world communicator from a unique id and then the
//! splits; the executor issues a plan's collectives on them ([`super::device`]). Not built:
//! the unique id's broadcast over MPI and the multi-rank run around it (`megac launch
//! --comm nccl`). Not run on hardware.

use std::collections::BTreeSet;

use megac_ir::gate::CheckedPlan;
use megac_ir::plan::{Instr, Plan};
use megac_ir::{Axis, Mesh, OpKind};

/// One communicator: a group over `axes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommGroup {
    /// The mesh axes.
    pub axes: Vec<Axis>,
    /// The member ranks, sorted; NCCL rank `i` is `members[i]`.
    pub members: Vec<usize>,
    /// The split colour: this group's index among the groups over `axes`.
    pub color: i32,
}

impl CommGroup {
    /// `rank`'s key for `ncclCommSplit` (its NCCL rank in the group), if it is a member.
    pub fn key(&self, rank: usize) -> Option<i32> {
        self.members
            .iter()
            .position(|&r| r == rank)
            .map(|p| p as i32)
    }
}

/// Every communicator a plan needs, grouped by axis set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Communicators {
    /// Ranks of the world communicator.
    pub world: usize,
    /// For each axis set the plan communicates over (sorted), its groups (a partition of
    /// the ranks, ordered by their lowest member).
    pub splits: Vec<(Vec<Axis>, Vec<CommGroup>)>,
}

/// The axis sets `op` communicates over when its operands have these layouts
/// (`layout(i)`: input `i`'s per-dim axes).
fn op_axes<'a>(op: &OpKind, layout: impl Fn(usize) -> &'a [Vec<Axis>]) -> Option<Vec<Axis>> {
    match op {
        OpKind::AllReduce { axes }
        | OpKind::AllGather { axes, .. }
        | OpKind::ReduceScatter { axes, .. }
        | OpKind::AllToAll { axes, .. }
        | OpKind::GradNorm { axes } => Some(axes.clone()),
        _ => op
            .implicit_collective()
            .and_then(|c| c.applies(layout(c.operand)).then(|| vec![c.axis])),
    }
}

impl Communicators {
    /// The communicators of `plan` (the same on every rank).
    pub fn of_plan(plan: &CheckedPlan) -> Communicators {
        let p: &Plan = plan;
        let mut sets: BTreeSet<Vec<Axis>> = BTreeSet::new();
        for role in &p.roles {
            for instr in Plan::programs_of(role).into_iter().flatten() {
                if let Instr::Kernel { op, inputs, .. } = instr {
                    let layout = |i: usize| -> &[Vec<Axis>] {
                        inputs
                            .get(i)
                            .map_or(&[][..], |&b| p.buffers[b as usize].layout.as_slice())
                    };
                    if let Some(mut axes) = op_axes(op, layout) {
                        axes.sort_unstable();
                        axes.dedup();
                        if !axes.is_empty() {
                            sets.insert(axes);
                        }
                    }
                }
            }
        }
        let world = p.mesh.world_size();
        let splits = sets
            .into_iter()
            .map(|axes| {
                let groups = partition(&p.mesh, &axes);
                (axes, groups)
            })
            .collect();
        Communicators { world, splits }
    }

    /// The `ncclCommSplit` calls `rank` makes after the world communicator, in order:
    /// (axes, colour, key). The same axis sets in the same order on every rank; the ranks
    /// that pass one colour for one axis set are that group, keyed by member position.
    /// A rank outside every group of an axis set (none, as the groups partition the
    /// ranks) would pass `NCCL_SPLIT_NOCOLOR` (-1).
    pub fn split_calls(&self, rank: usize) -> Vec<(Vec<Axis>, i32, i32)> {
        self.splits
            .iter()
            .map(|(axes, groups)| {
                let mine = groups
                    .iter()
                    .find_map(|g| g.key(rank).map(|k| (g.color, k)));
                let (color, key) = mine.unwrap_or((-1, 0));
                (axes.clone(), color, key)
            })
            .collect()
    }

    /// The communicator of `rank`'s group over `axes` (in any order).
    pub fn group_of(&self, rank: usize, axes: &[Axis]) -> Option<&CommGroup> {
        let mut key = axes.to_vec();
        key.sort_unstable();
        key.dedup();
        self.splits
            .iter()
            .find(|(a, _)| *a == key)
            .and_then(|(_, gs)| gs.iter().find(|g| g.key(rank).is_some()))
    }
}

/// The groups over `axes`: each rank's `Mesh::group`, deduplicated, ordered by lowest
/// member, coloured by that order.
pub fn partition(mesh: &Mesh, axes: &[Axis]) -> Vec<CommGroup> {
    let mut seen = vec![false; mesh.world_size()];
    let mut groups = Vec::new();
    for r in 0..mesh.world_size() {
        if seen[r] {
            continue;
        }
        let members = mesh.group(r, axes);
        for &m in &members {
            if let Some(s) = seen.get_mut(m) {
                *s = true;
            }
        }
        groups.push(CommGroup {
            axes: axes.to_vec(),
            members,
            color: groups.len() as i32,
        });
    }
    groups
}

/// The NCCL communicators of one rank: the world's and one per axis set of the plan.
pub struct NcclComms {
    world: cudarc::nccl::sys::ncclComm_t,
    by_axes: Vec<(Vec<Axis>, cudarc::nccl::sys::ncclComm_t)>,
}

fn nccl_err(what: &str, r: cudarc::nccl::sys::ncclResult_t) -> super::CudaError {
    super::CudaError::Driver(format!("NCCL {what}: {r:?}"))
}

/// A new NCCL unique id (rank 0 makes it and sends it to the others), as its 128 bytes.
pub fn unique_id() -> Result<[u8; 128], super::CudaError> {
    // SAFETY: only opens the library.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(super::CudaError::Missing {
            what: "NCCL",
            looked_for: super::candidates("nccl"),
            hint: "pip install nvidia-nccl-cu13 and link libnccl.so -> libnccl.so.2 in a folder on LD_LIBRARY_PATH",
        });
    }
    let id = cudarc::nccl::result::get_uniqueid()
        .map_err(|e| super::CudaError::Driver(format!("NCCL ncclGetUniqueId: {e:?}")))?;
    Ok(id.internal.map(|c| c as u8))
}

impl NcclComms {
    /// Rank `rank`'s communicators: `ncclCommInitRank` of the world from `id` (every rank
    /// passes the same id), then [`Communicators::split_calls`] in order. The device's
    /// context must be current on this thread.
    pub fn init(
        comms: &Communicators,
        rank: usize,
        id: &[u8; 128],
    ) -> Result<NcclComms, super::CudaError> {
        use cudarc::nccl::sys;
        let unique = sys::ncclUniqueId {
            internal: id.map(|b| b as ::core::ffi::c_char),
        };
        let mut world: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; world size and rank as the plan's mesh.
        let r =
            unsafe { sys::ncclCommInitRank(&mut world, comms.world as i32, unique, rank as i32) };
        if r != sys::ncclResult_t::ncclSuccess {
            return Err(nccl_err("ncclCommInitRank", r));
        }
        let mut out = NcclComms {
            world,
            by_axes: Vec::new(),
        };
        for (axes, color, key) in comms.split_calls(rank) {
            let mut sub: sys::ncclComm_t = std::ptr::null_mut();
            // SAFETY: the world communicator is live; a null config inherits its settings.
            let r =
                unsafe { sys::ncclCommSplit(world, color, key, &mut sub, std::ptr::null_mut()) };
            if r != sys::ncclResult_t::ncclSuccess {
                return Err(nccl_err("ncclCommSplit", r));
            }
            out.by_axes.push((axes, sub));
        }
        Ok(out)
    }

    /// The communicator over `axes` (in any order), if the plan uses that axis set.
    pub fn get(&self, axes: &[Axis]) -> Option<cudarc::nccl::sys::ncclComm_t> {
        let mut key = axes.to_vec();
        key.sort_unstable();
        key.dedup();
        self.by_axes
            .iter()
            .find(|(a, _)| *a == key)
            .map(|&(_, c)| c)
    }

    /// The world communicator (pipeline send/recv peers are world ranks).
    pub fn world(&self) -> cudarc::nccl::sys::ncclComm_t {
        self.world
    }
}

impl Drop for NcclComms {
    fn drop(&mut self) {
        for &(_, c) in &self.by_axes {
            // SAFETY: made by init, destroyed once.
            unsafe {
                let _ = cudarc::nccl::sys::ncclCommDestroy(c);
            }
        }
        // SAFETY: as above.
        unsafe {
            let _ = cudarc::nccl::sys::ncclCommDestroy(self.world);
        }
    }
}
