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
