//! The plan validator: proves before a run that the plan cannot deadlock and that every
//! message and collective matches, by simulating all ranks with blocking semantics.
//!
//! The order of every collective, send and receive is fixed at compile time (the plan's
//! programs and, for pipelines, the schedule's action lists), so the ranks need no run-time
//! coordinator to agree on it: this check proves the agreement once, before any run.
//!
//! **Event streams.** A rank runs its role's programs: without a pipeline, the micro-batch
//! program once (it repeats identically for every micro-batch) and then the optimizer
//! program; with one, for each action of `pipeline.actions` in order, the segments of its
//! chunk (`F` forward, `B` backward, `W` weight, `BW` backward then weight) with the
//! action's micro-batch, and then the optimizer program. The events of a stream are
//! - collectives: the explicit ones (`all_reduce`, `all_gather`, `reduce_scatter`, the group
//!   reduction of `grad_norm`) and the ones kernels make implicitly (the vocab-parallel
//!   cross-entropy reduces over tp, context-parallel attention exchanges over cp, MoE's
//!   all-to-all exchanges token counts and rows over ep); a group of fewer than two members
//!   is no communication;
//! - `Send`: to the rank with the same mesh coordinates but the pipeline one, which is
//!   `chunk % pp` (with `twin`, to the MegaFBD twin: the other fbd coordinate); tagged
//!   (transfer, micro-batch), as many elements as the buffer; the optimizer program's
//!   transfers (FBD's parameter refresh) are tagged with micro-batch 0 on both sides;
//! - `Recv`: from the rank that holds `chunk` (or the twin), with the same kind of tag.
//!
//! **Blocking semantics.** Sends never wait: they deposit their message. A receive proceeds
//! once the message with its tag from its peer is there (tags match messages, not arrival
//! order) and must have the sent element count. A collective proceeds when every member of
//! its group is at a collective on that group; they must agree on the op and the element
//! count. If no rank can move while some have not finished, the plan deadlocks: the error
//! lists every blocked rank with its instruction and its schedule position. When every rank
//! has finished, every message must have been received. The error also names a cycle of the
//! blocked ranks' wait-for graph (petgraph's strongly connected components: each rank waits
//! for the sender of its receive or the members missing from its collective), rank by rank
//! with its instruction, when the ranks wait on each other rather than on a finished one. Because ranks are deterministic and
//! a receive names its peer and tag, the outcome does not depend on the order in which the
//! simulation moves ranks: passing proves the absence of deadlock for every timing.
//!
//! **Schedules.** Each pipelined role's action list must run, for every chunk it holds and
//! every micro-batch, the forward once and the backward once (`BW`, or `B` then `W`), the
//! forward before the backward; MegaFBD's forward roles (`fbd-forward`) run the forwards
//! only. For `dpp` plans the reference order (`actions`) is checked; the dynamic runtime
//! only reorders it as inputs arrive (its tensor- and context-parallel peers agree on each
//! choice), so the order it checks is one the runtime may take.
//!
//! **Speed.** Ranks whose coordinates differ only along mesh axes on which the role table
//! does not vary run identical programs; by symmetry they stay in lockstep, so the
//! simulation runs one representative of each (the ranks whose coordinates along those axes
//! are 0) and treats collectives over only those axes as agreed. Candidates are tp, cp and
//! dp (dp and cp not where expert groups, blocks of the dp·cp ranks, communicate); never pp
//! or fbd, which transfers address. A 1,024-rank plan with 16 pipeline stages simulates 16
//! ranks.

use std::collections::{HashMap, HashSet, VecDeque};

use petgraph::algo::tarjan_scc;
use petgraph::graph::{DiGraph, NodeIndex};

use crate::op::OpKind;
use crate::plan::{Instr, PipeAction, PipeKind, Plan, Role};
use crate::types::Axis;

/// Check `plan`: the first violation, with ranks, instructions and schedule positions.
pub fn check_plan(plan: &Plan) -> Result<(), String> {
    plan.mesh
        .validate()
        .map_err(|e| format!("mesh.axes: {e}"))?;
    for (i, b) in plan.buffers.iter().enumerate() {
        b.check_extent(&plan.mesh)
            .map_err(|e| format!("buffers[{i}] ({}): {e}", b.name))?;
    }
    let world = plan.mesh.world_size();
    if plan.rank_to_role.len() != world {
        return Err(format!(
            "the mesh has {world} ranks but the rank table lists {}",
            plan.rank_to_role.len()
        ));
    }
    for (rank, &role) in plan.rank_to_role.iter().enumerate() {
        if role as usize >= plan.roles.len() {
            return Err(format!("rank {rank} has role {role}, which does not exist"));
        }
    }
    let mut roles = plan
        .roles
        .iter()
        .map(|role| RoleProg::build(plan, role))
        .collect::<Result<Vec<_>, String>>()?;
    // Expert groups are blocks of the dp·cp ranks: keep dp and cp out of the symmetry.
    let expert = bit(Axis::Ep) | bit(Axis::Edp);
    let uses_expert = roles.iter().any(|r| {
        r.segments.iter().any(|s| {
            s.events
                .iter()
                .any(|e| matches!(e.kind, Ev::Coll { mask, .. } if mask & expert != 0))
        })
    });
    let mut free = free_axes(plan);
    if uses_expert {
        free &= !(bit(Axis::Dp) | bit(Axis::Cp));
    }
    // Collectives over free axes only are among identical copies of a rank: they agree.
    for role in &mut roles {
        for seg in &mut role.segments {
            seg.events
                .retain(|e| !matches!(e.kind, Ev::Coll { mask, .. } if mask & !free == 0));
        }
    }
    for (r, role) in plan.roles.iter().enumerate() {
        if let Some(rank) = plan.rank_to_role.iter().position(|&x| x as usize == r) {
            check_actions(plan, role, rank)?;
            check_placement(plan, role, rank)?;
        }
    }
    Sim::new(plan, &roles, free).run()
}

/// Bit of a mesh axis in an axis mask.
fn bit(axis: Axis) -> u8 {
    match axis {
        Axis::Tp => 1,
        Axis::Cp => 2,
        Axis::Dp => 4,
        Axis::Pp => 8,
        Axis::Ep => 16,
        Axis::Edp => 32,
        Axis::Fbd => 64,
    }
}

const AXES: [Axis; 7] = [
    Axis::Tp,
    Axis::Cp,
    Axis::Dp,
    Axis::Pp,
    Axis::Ep,
    Axis::Edp,
    Axis::Fbd,
];

fn axes_of(mask: u8) -> Vec<Axis> {
    AXES.into_iter().filter(|&a| mask & bit(a) != 0).collect()
}

/// The axes among tp, cp and dp (of size > 1) along which the role table is constant: ranks
/// that differ only along them run the same programs. The pipeline and fbd axes are never
/// free (transfers address absolute coordinates along them).
fn free_axes(plan: &Plan) -> u8 {
    let mesh = &plan.mesh;
    let mut free = 0;
    for axis in [Axis::Tp, Axis::Cp, Axis::Dp] {
        if mesh.size(axis) < 2 {
            continue;
        }
        let constant = (0..plan.rank_to_role.len()).all(|r| {
            let base = mesh.rank_with(r, axis, 0);
            plan.rank_to_role.get(base) == Some(&plan.rank_to_role[r])
        });
        if constant {
            free |= bit(axis);
        }
    }
    free
}

/// One communication event of a role's program.
#[derive(Clone, Debug)]
struct Event {
    /// Index of the instruction in its program.
    index: usize,
    kind: Ev,
}

#[derive(Clone, Debug)]
enum Ev {
    /// A collective over the axes of `mask` (only axes of size > 1).
    Coll {
        mask: u8,
        what: String,
        elements: u64,
    },
    Send {
        chunk: u32,
        transfer: u32,
        /// To the rank's FBD twin rather than the holder of `chunk`.
        twin: bool,
        elements: u64,
    },
    Recv {
        chunk: u32,
        transfer: u32,
        /// From the rank's FBD twin rather than the holder of `chunk`.
        twin: bool,
        elements: u64,
    },
}

/// A program of a role and the events it makes.
struct Segment<'a> {
    /// `microbatch`, `optimizer`, `forward`, `backward` or `weight`.
    label: &'static str,
    instrs: &'a [Instr],
    events: Vec<Event>,
}

/// One entry of a rank's stream: a segment run for a micro-batch, by an action.
#[derive(Clone, Copy)]
struct Step {
    segment: usize,
    microbatch: u32,
    /// Index into `pipeline.actions`.
    action: Option<usize>,
}

/// A role's programs, reduced to events, and its stream of segments.
struct RoleProg<'a> {
    role: &'a Role,
    segments: Vec<Segment<'a>>,
    steps: Vec<Step>,
}

impl<'a> RoleProg<'a> {
    fn build(plan: &Plan, role: &'a Role) -> Result<RoleProg<'a>, String> {
        let seg = |label: &'static str, instrs: &'a [Instr]| -> Result<Segment<'a>, String> {
            Ok(Segment {
                label,
                instrs,
                events: events(plan, instrs)
                    .map_err(|e| format!("role {}: {label}: {e}", role.name))?,
            })
        };
        let mut segments = Vec::new();
        let mut steps = Vec::new();
        match &role.pipeline {
            None => {
                segments.push(seg("microbatch", &role.microbatch)?);
                steps.push(Step {
                    segment: 0,
                    microbatch: 0,
                    action: None,
                });
            }
            Some(pipe) => {
                let mut index: HashMap<u32, usize> = HashMap::new();
                for (k, c) in pipe.chunks.iter().enumerate() {
                    if index.insert(c.chunk, k).is_some() {
                        return Err(format!("role {} holds chunk {} twice", role.name, c.chunk));
                    }
                    segments.push(seg("forward", &c.forward)?);
                    segments.push(seg("backward", &c.backward)?);
                    segments.push(seg("weight", &c.weight)?);
                }
                for (i, a) in pipe.actions.iter().enumerate() {
                    let k = *index.get(&a.chunk).ok_or_else(|| {
                        format!(
                            "{} action #{i} ({}): the role does not hold chunk {} (it holds {:?})",
                            role.name,
                            show_action(a),
                            a.chunk,
                            pipe.chunks.iter().map(|c| c.chunk).collect::<Vec<_>>()
                        )
                    })?;
                    let parts: &[usize] = match a.kind {
                        PipeKind::F => &[0],
                        PipeKind::B => &[1],
                        PipeKind::W => &[2],
                        PipeKind::BW => &[1, 2],
                    };
                    for &p in parts {
                        steps.push(Step {
                            segment: 3 * k + p,
                            microbatch: a.microbatch,
                            action: Some(i),
                        });
                    }
                }
            }
        }
        segments.push(seg("optimizer", &role.optimizer)?);
        steps.push(Step {
            segment: segments.len() - 1,
            microbatch: 0,
            action: None,
        });
        Ok(RoleProg {
            role,
            segments,
            steps,
        })
    }
}

/// The events of `instrs`: transfers, and collectives over groups of more than one rank.
fn events(plan: &Plan, instrs: &[Instr]) -> Result<Vec<Event>, String> {
    let len = |b: u32, what: &str, index: usize| -> Result<u64, String> {
        plan.buffers
            .get(b as usize)
            .map(|buf| buf.len())
            .ok_or_else(|| format!("[{index}] {what} uses buffer {b}, which does not exist"))
    };
    let mut out = Vec::new();
    for (index, instr) in instrs.iter().enumerate() {
        match instr {
            Instr::Kernel { op, inputs, .. } => {
                let calls =
                    communication(plan, op, inputs).map_err(|e| format!("[{index}] {e}"))?;
                for (axes, what, elements) in calls {
                    let mask = axes
                        .iter()
                        .filter(|&&a| plan.mesh.size(a) > 1)
                        .fold(0, |m, &a| m | bit(a));
                    if mask == 0 {
                        continue;
                    }
                    out.push(Event {
                        index,
                        kind: Ev::Coll {
                            mask,
                            what,
                            elements,
                        },
                    });
                }
            }
            Instr::Send {
                buffer,
                chunk,
                transfer,
                twin,
            } => out.push(Event {
                index,
                kind: Ev::Send {
                    chunk: *chunk,
                    transfer: *transfer,
                    twin: *twin,
                    elements: len(*buffer, "send", index)?,
                },
            }),
            Instr::Recv {
                buffer,
                chunk,
                transfer,
                twin,
            } => out.push(Event {
                index,
                kind: Ev::Recv {
                    chunk: *chunk,
                    transfer: *transfer,
                    twin: *twin,
                    elements: len(*buffer, "recv", index)?,
                },
            }),
            Instr::Zero { .. } => {}
        }
    }
    Ok(out)
}

fn show_action(a: &PipeAction) -> String {
    format!(
        "{:?} chunk {} micro-batch {}",
        a.kind, a.chunk, a.microbatch
    )
}

/// A pipelined role's action list runs, for every chunk it holds and every micro-batch, the
/// forward once and the backward once (`BW`, or `B` then `W`), in that order.
fn check_actions(plan: &Plan, role: &Role, rank: usize) -> Result<(), String> {
    let Some(pipe) = &role.pipeline else {
        return Ok(());
    };
    let m = plan.batch.microbatches;
    let at = format!("{} (rank {rank})", role.name);
    // MegaFBD's forward roles run forwards only; their twins run the backwards. So do
    // every role of an inference plan.
    let forward_only =
        pipe.schedule == "fbd-forward" || plan.kind == crate::plan::PlanKind::Inference;
    // (chunk, micro-batch) -> positions of F, B, W, BW.
    let mut seen: HashMap<(u32, u32), [Option<usize>; 4]> = HashMap::new();
    for (i, a) in pipe.actions.iter().enumerate() {
        if u64::from(a.microbatch) >= m {
            return Err(format!(
                "{at} action #{i} ({}): a step has {m} micro-batches",
                show_action(a)
            ));
        }
        let slot = match a.kind {
            PipeKind::F => 0,
            PipeKind::B => 1,
            PipeKind::W => 2,
            PipeKind::BW => 3,
        };
        let entry = seen.entry((a.chunk, a.microbatch)).or_default();
        if let Some(prev) = entry[slot] {
            return Err(format!(
                "{at} runs {} twice (actions #{prev} and #{i})",
                show_action(a)
            ));
        }
        let [f, b, w, bw] = *entry;
        let problem = match a.kind {
            PipeKind::F => None,
            _ if forward_only => Some("in a forward-only role (fbd-forward, or an inference plan)"),
            PipeKind::B | PipeKind::BW if f.is_none() => Some("before its forward"),
            PipeKind::B if bw.is_some() => Some("after its whole backward (BW)"),
            PipeKind::BW if b.is_some() || w.is_some() => {
                Some("after a split backward (B or W) of the same micro-batch")
            }
            PipeKind::W if bw.is_some() => Some("after its whole backward (BW)"),
            PipeKind::W if b.is_none() => Some("before its input-gradient backward (B)"),
            _ => None,
        };
        if let Some(problem) = problem {
            return Err(format!(
                "{at} action #{i} runs {} {problem}",
                show_action(a)
            ));
        }
        entry[slot] = Some(i);
    }
    for c in &pipe.chunks {
        for j in 0..m {
            let j = j as u32;
            let what = |kind: &str| {
                format!(
                    "{at}: the action list never runs the {kind} of chunk {} micro-batch {j}",
                    c.chunk
                )
            };
            let Some(&[f, b, w, bw]) = seen.get(&(c.chunk, j)) else {
                return Err(what("forward"));
            };
            if f.is_none() {
                return Err(what("forward"));
            }
            if forward_only {
                continue;
            }
            match (b, w, bw) {
                (_, _, Some(_)) | (Some(_), Some(_), None) => {}
                (Some(_), None, None) => {
                    return Err(what("weight-gradient backward (W after its B)"))
                }
                _ => return Err(what("backward (BW, or B and W)")),
            }
        }
    }
    Ok(())
}

/// A role's chunks live on its pipeline rank: chunk c on pipeline rank c % pp.
fn check_placement(plan: &Plan, role: &Role, rank: usize) -> Result<(), String> {
    let Some(pipe) = &role.pipeline else {
        return Ok(());
    };
    let pp = plan.mesh.size(Axis::Pp).max(1);
    let here = plan.mesh.coord(rank, Axis::Pp) as u64;
    for c in &pipe.chunks {
        if c.chunk >= pipe.chunks_total {
            return Err(format!(
                "{} (rank {rank}) holds chunk {}, but the model has {} chunks",
                role.name, c.chunk, pipe.chunks_total
            ));
        }
        let owner = u64::from(crate::mesh::chunk_owner(
            c.chunk,
            u32::try_from(pp).unwrap_or(u32::MAX),
        ));
        if owner != here {
            return Err(format!(
                "{} (rank {rank}, pipeline rank {here}) holds chunk {}, which lives on pipeline rank {}",
                role.name,
                c.chunk,
                owner
            ));
        }
    }
    Ok(())
}

/// A message: (source, destination, transfer, micro-batch).
type MsgKey = (usize, usize, u32, u32);

/// A group: its lowest rank and the axes mask.
type GroupKey = (usize, u8);

/// Where a rank is in its stream.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Pos {
    step: usize,
    event: usize,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Wait {
    Running,
    Recv(MsgKey),
    /// At a collective on the group with this index in `Sim::groups`.
    Coll(u32),
    Done,
}

const UNSET: u32 = u32::MAX;

struct RankState {
    rank: usize,
    role: usize,
    pos: Pos,
    wait: Wait,
    /// Per axes mask, the index of the rank's group in `Sim::groups` (UNSET: not yet made).
    group_of: [u32; 128],
}

struct Sent {
    elements: u64,
    /// Index of the sender in `Sim::ranks`.
    from: usize,
    pos: Pos,
}

struct GroupState {
    key: GroupKey,
    /// Indices into `Sim::ranks` of the simulated members, by ascending rank.
    members: Vec<usize>,
    arrived: usize,
    calls: u64,
}

/// FxHash (rustc's hasher): the simulation hashes a message key per transfer.
#[derive(Default, Clone, Copy)]
struct FxHasher(u64);

impl std::hash::Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

type FxMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<FxHasher>>;

struct Sim<'p, 'a> {
    plan: &'p Plan,
    roles: &'a [RoleProg<'p>],
    /// The simulated ranks (one per class of identical ranks), by ascending rank.
    ranks: Vec<RankState>,
    /// Rank -> index into `ranks` (usize::MAX when not simulated).
    index: Vec<usize>,
    /// Messages sent and not yet received (the first one of each tag).
    messages: FxMap<MsgKey, Sent>,
    /// Further messages with a tag already pending, in sending order.
    repeated: FxMap<MsgKey, VecDeque<Sent>>,
    groups: Vec<GroupState>,
    group_index: FxMap<GroupKey, u32>,
    queue: VecDeque<usize>,
}

impl<'p, 'a> Sim<'p, 'a> {
    fn new(plan: &'p Plan, roles: &'a [RoleProg<'p>], free: u8) -> Sim<'p, 'a> {
        let world = plan.rank_to_role.len();
        let mut index = vec![usize::MAX; world];
        let mut ranks = Vec::new();
        let free_axes = axes_of(free);
        for (rank, slot) in index.iter_mut().enumerate() {
            if free_axes.iter().all(|&a| plan.mesh.coord(rank, a) == 0) {
                *slot = ranks.len();
                ranks.push(RankState {
                    rank,
                    role: plan.rank_to_role[rank] as usize,
                    pos: Pos { step: 0, event: 0 },
                    wait: Wait::Running,
                    group_of: [UNSET; 128],
                });
            }
        }
        let queue = (0..ranks.len()).collect();
        Sim {
            plan,
            roles,
            ranks,
            index,
            messages: FxMap::default(),
            repeated: FxMap::default(),
            groups: Vec::new(),
            group_index: FxMap::default(),
            queue,
        }
    }

    fn run(mut self) -> Result<(), String> {
        while let Some(i) = self.queue.pop_front() {
            self.advance(i)?;
        }
        let blocked: Vec<usize> = (0..self.ranks.len())
            .filter(|&i| self.ranks[i].wait != Wait::Done)
            .collect();
        if !blocked.is_empty() {
            return Err(self.deadlock(&blocked));
        }
        if let Some(((src, dst, transfer, mb), sent)) =
            self.messages.iter().min_by_key(|(k, _)| **k)
        {
            return Err(format!(
                "rank {src} sent transfer {transfer} micro-batch {mb} to rank {dst}, which never receives it (sent at {})",
                self.position(sent.from, sent.pos)
            ));
        }
        Ok(())
    }

    /// The event at `pos` of rank `i`, after skipping to the next non-empty step (None when
    /// the stream has ended).
    fn current(&self, i: usize) -> Option<(Pos, &'a Event, Step)> {
        let role = &self.roles[self.ranks[i].role];
        let mut pos = self.ranks[i].pos;
        loop {
            let step = *role.steps.get(pos.step)?;
            if let Some(ev) = role.segments[step.segment].events.get(pos.event) {
                return Some((pos, ev, step));
            }
            pos = Pos {
                step: pos.step + 1,
                event: 0,
            };
        }
    }

    /// The peer of a transfer ([`crate::Mesh::transfer_peer`]).
    fn peer(&self, rank: usize, chunk: u32, twin: bool) -> usize {
        self.plan.mesh.transfer_peer(rank, chunk, twin)
    }

    /// Run rank `i` until it blocks or finishes.
    fn advance(&mut self, i: usize) -> Result<(), String> {
        let rank = self.ranks[i].rank;
        loop {
            let Some((pos, ev, step)) = self.current(i) else {
                self.ranks[i].wait = Wait::Done;
                return Ok(());
            };
            self.ranks[i].pos = pos;
            let next = Pos {
                step: pos.step,
                event: pos.event + 1,
            };
            match &ev.kind {
                Ev::Send {
                    chunk,
                    transfer,
                    twin,
                    elements,
                } => {
                    let peer = self.peer(rank, *chunk, *twin);
                    let key = (rank, peer, *transfer, step.microbatch);
                    let sent = Sent {
                        elements: *elements,
                        from: i,
                        pos,
                    };
                    match self.messages.entry(key) {
                        std::collections::hash_map::Entry::Vacant(v) => {
                            v.insert(sent);
                        }
                        std::collections::hash_map::Entry::Occupied(_) => {
                            self.repeated.entry(key).or_default().push_back(sent);
                        }
                    }
                    if let Some(&p) = self.index.get(peer) {
                        if p != usize::MAX && self.ranks[p].wait == Wait::Recv(key) {
                            self.ranks[p].wait = Wait::Running;
                            self.queue.push_back(p);
                        }
                    }
                    self.ranks[i].pos = next;
                }
                Ev::Recv {
                    chunk,
                    transfer,
                    twin,
                    elements,
                } => {
                    let peer = self.peer(rank, *chunk, *twin);
                    let key = (peer, rank, *transfer, step.microbatch);
                    let Some(sent) = self.messages.remove(&key) else {
                        self.ranks[i].wait = Wait::Recv(key);
                        return Ok(());
                    };
                    if let Some(queue) = self.repeated.get_mut(&key) {
                        if let Some(next) = queue.pop_front() {
                            self.messages.insert(key, next);
                        }
                    }
                    if sent.elements != *elements {
                        return Err(format!(
                            "transfer {transfer} micro-batch {}: rank {peer} sends {} elements ({}) but rank {rank} receives {} ({})",
                            step.microbatch,
                            sent.elements,
                            self.position(sent.from, sent.pos),
                            elements,
                            self.position(i, pos)
                        ));
                    }
                    self.ranks[i].pos = next;
                }
                Ev::Coll { mask, .. } => {
                    let g = self.group(i, *mask);
                    self.ranks[i].wait = Wait::Coll(g);
                    let group = &mut self.groups[g as usize];
                    group.arrived += 1;
                    if group.arrived == group.members.len() {
                        self.release(g)?;
                    }
                    return Ok(());
                }
            }
        }
    }

    /// The index of rank `i`'s group over the axes of `mask`, made on first use.
    fn group(&mut self, i: usize, mask: u8) -> u32 {
        let cached = self.ranks[i].group_of[usize::from(mask & 127)];
        if cached != UNSET {
            return cached;
        }
        let rank = self.ranks[i].rank;
        // Groups over the same axes partition the ranks: the lowest member names one.
        let all = self.plan.mesh.group(rank, &axes_of(mask));
        let key = (all.first().copied().unwrap_or(rank), mask);
        let g = match self.group_index.get(&key) {
            Some(&g) => g,
            None => {
                // The simulated members; the others are copies of them.
                let members = all
                    .iter()
                    .filter_map(|&r| self.index.get(r).copied())
                    .filter(|&x| x != usize::MAX)
                    .collect();
                let g = self.groups.len() as u32;
                self.groups.push(GroupState {
                    key,
                    members,
                    arrived: 0,
                    calls: 0,
                });
                self.group_index.insert(key, g);
                g
            }
        };
        self.ranks[i].group_of[usize::from(mask & 127)] = g;
        g
    }

    /// Every member is at a collective on group `g`: check they agree and move them on.
    fn release(&mut self, g: u32) -> Result<(), String> {
        let group = &mut self.groups[g as usize];
        group.arrived = 0;
        group.calls += 1;
        let members = std::mem::take(&mut group.members);
        let call = |s: &Self, i: usize| -> (Pos, &'a str, u64) {
            match s.current(i) {
                Some((
                    pos,
                    Event {
                        kind: Ev::Coll { what, elements, .. },
                        ..
                    },
                    _,
                )) => (pos, what.as_str(), *elements),
                _ => unreachable!("a rank waiting at a collective"),
            }
        };
        let first = call(self, members[0]);
        for &m in &members[1..] {
            let other = call(self, m);
            if (other.1, other.2) != (first.1, first.2) {
                let group = &self.groups[g as usize];
                return Err(format!(
                    "collective mismatch on group {}, call #{}: rank {} calls {} of {} elements ({}, {}); rank {} calls {} of {} elements ({}, {})",
                    self.show_group(group.key),
                    group.calls,
                    self.ranks[members[0]].rank,
                    first.1,
                    first.2,
                    self.place(members[0], first.0),
                    self.path(members[0], first.0),
                    self.ranks[m].rank,
                    other.1,
                    other.2,
                    self.place(m, other.0),
                    self.path(m, other.0)
                ));
            }
        }
        for &m in &members {
            let st = &mut self.ranks[m];
            st.wait = Wait::Running;
            st.pos.event += 1;
            self.queue.push_back(m);
        }
        self.groups[g as usize].members = members;
        Ok(())
    }

    fn show_group(&self, (base, mask): GroupKey) -> String {
        let ranks = self.plan.mesh.group(base, &axes_of(mask));
        if ranks.len() <= 16 {
            format!("{ranks:?}")
        } else {
            let head: Vec<String> = ranks[..4].iter().map(|r| r.to_string()).collect();
            format!(
                "[{}, .., {}] ({} ranks)",
                head.join(", "),
                ranks[ranks.len() - 1],
                ranks.len()
            )
        }
    }

    /// Where rank `i` is at `pos`: its role, schedule action, program and instruction.
    fn place(&self, i: usize, pos: Pos) -> String {
        let role = &self.roles[self.ranks[i].role];
        let Some(step) = role.steps.get(pos.step) else {
            return format!("{} (finished)", role.role.name);
        };
        let seg = &role.segments[step.segment];
        let index = seg.events.get(pos.event).map_or(0, |e| e.index);
        let mut out = role.role.name.clone();
        if let (Some(a), Some(pipe)) = (step.action, &role.role.pipeline) {
            out += &format!(" action #{a} {},", show_action(&pipe.actions[a]));
        }
        out + &format!(" {}[{index}]", seg.label)
    }

    /// The provenance path of rank `i`'s instruction at `pos` (empty for transfers).
    fn path(&self, i: usize, pos: Pos) -> &'p str {
        let role = &self.roles[self.ranks[i].role];
        let seg = role.steps.get(pos.step).map(|s| &role.segments[s.segment]);
        match seg.and_then(|s| s.events.get(pos.event).map(|e| s.instrs.get(e.index))) {
            Some(Some(Instr::Kernel { path, .. })) => path,
            _ => "",
        }
    }

    /// [`Sim::place`] and what the instruction does.
    fn position(&self, i: usize, pos: Pos) -> String {
        let role = &self.roles[self.ranks[i].role];
        let place = self.place(i, pos);
        let Some(ev) = role
            .steps
            .get(pos.step)
            .and_then(|s| role.segments[s.segment].events.get(pos.event))
        else {
            return place;
        };
        let rank = self.ranks[i].rank;
        match &ev.kind {
            Ev::Coll { what, elements, .. } => {
                format!(
                    "{place} {what} of {elements} elements, {}",
                    self.path(i, pos)
                )
            }
            Ev::Send {
                chunk,
                transfer,
                twin,
                ..
            } => format!(
                "{place} send of transfer {transfer} to rank {}{}",
                self.peer(rank, *chunk, *twin),
                if *twin { " (its fbd twin)" } else { "" }
            ),
            Ev::Recv {
                chunk,
                transfer,
                twin,
                ..
            } => format!(
                "{place} recv of transfer {transfer} from rank {}{}",
                self.peer(rank, *chunk, *twin),
                if *twin { " (its fbd twin)" } else { "" }
            ),
        }
    }

    fn deadlock(&self, blocked: &[usize]) -> String {
        const SHOWN: usize = 8;
        let mut lines = Vec::new();
        for &i in blocked.iter().take(SHOWN) {
            let st = &self.ranks[i];
            let mut line = format!("rank {} at {}", st.rank, self.position(i, st.pos));
            match st.wait {
                Wait::Recv((src, ..)) => {
                    line += &format!(": rank {src} ");
                    let p = self.index.get(src).copied().unwrap_or(usize::MAX);
                    line += match self.ranks.get(p).map(|s| s.wait) {
                        Some(Wait::Done) => "has finished without sending it",
                        _ => "has not sent it",
                    };
                }
                Wait::Coll(gi) => {
                    let g = &self.groups[gi as usize];
                    let waiting: Vec<String> = g
                        .members
                        .iter()
                        .filter(|&&m| self.ranks[m].wait != Wait::Coll(gi))
                        .map(|&m| {
                            let s = &self.ranks[m];
                            if s.wait == Wait::Done {
                                format!("rank {} (finished)", s.rank)
                            } else {
                                format!("rank {}", s.rank)
                            }
                        })
                        .collect();
                    line += &format!(
                        " on group {}: waits for {}",
                        self.show_group(g.key),
                        waiting.join(", ")
                    );
                }
                Wait::Running | Wait::Done => {}
            }
            lines.push(line);
        }
        let more = if blocked.len() > SHOWN {
            format!("; and {} more blocked ranks", blocked.len() - SHOWN)
        } else {
            String::new()
        };
        let cycle = match self.wait_for_cycle(blocked) {
            Some(c) => {
                let mut steps: Vec<String> = c
                    .iter()
                    .map(|&i| {
                        let st = &self.ranks[i];
                        format!("rank {} ({})", st.rank, self.position(i, st.pos))
                    })
                    .collect();
                steps.push(format!("rank {}", self.ranks[c[0]].rank));
                format!("; wait-for cycle: {}", steps.join(" -> "))
            }
            None => String::new(),
        };
        format!(
            "deadlock: no rank can proceed under blocking semantics; {}{more}{cycle}",
            lines.join("; ")
        )
    }

    /// A cycle of the blocked ranks' wait-for graph (an edge from a rank to each rank it
    /// waits for: the sender of its receive, the members not yet at its collective), as
    /// indices into `ranks`, from its lowest rank; `None` when the ranks wait on finished
    /// ones instead.
    fn wait_for_cycle(&self, blocked: &[usize]) -> Option<Vec<usize>> {
        let mut g = DiGraph::<usize, ()>::new();
        let node: HashMap<usize, NodeIndex> = blocked.iter().map(|&i| (i, g.add_node(i))).collect();
        for &i in blocked {
            let targets: Vec<usize> = match self.ranks[i].wait {
                Wait::Recv((src, ..)) => self
                    .index
                    .get(src)
                    .copied()
                    .filter(|&p| p != usize::MAX)
                    .into_iter()
                    .collect(),
                Wait::Coll(gi) => self.groups[gi as usize]
                    .members
                    .iter()
                    .copied()
                    .filter(|&m| self.ranks[m].wait != Wait::Coll(gi))
                    .collect(),
                Wait::Running | Wait::Done => Vec::new(),
            };
            for t in targets {
                if let Some(&n) = node.get(&t) {
                    g.update_edge(node[&i], n, ());
                }
            }
        }
        let scc = tarjan_scc(&g)
            .into_iter()
            .filter(|c| c.len() > 1 || g.contains_edge(c[0], c[0]))
            .min_by_key(|c| c.iter().map(|&n| g[n]).min())?;
        let inside: HashSet<NodeIndex> = scc.iter().copied().collect();
        let start = *scc.iter().min_by_key(|&&n| g[n])?;
        let (mut path, mut seen) = (vec![start], HashMap::from([(start, 0usize)]));
        let mut cur = start;
        loop {
            let next = g
                .neighbors(cur)
                .filter(|n| inside.contains(n))
                .min_by_key(|&n| g[n])?;
            if let Some(&k) = seen.get(&next) {
                return Some(path[k..].iter().map(|&n| g[n]).collect());
            }
            seen.insert(next, path.len());
            path.push(next);
            cur = next;
        }
    }
}

/// The communication `op` makes: (group axes, description, elements).
fn communication(
    plan: &Plan,
    op: &OpKind,
    inputs: &[u32],
) -> Result<Vec<(Vec<Axis>, String, u64)>, String> {
    let input = |k: usize| -> Result<u32, String> {
        inputs
            .get(k)
            .copied()
            .ok_or_else(|| format!("`{}` has no operand {k}", op.name()))
    };
    let buffer = |b: u32| {
        plan.buffers
            .get(b as usize)
            .ok_or_else(|| format!("`{}` reads buffer {b}, which does not exist", op.name()))
    };
    // The axis of the kernel's implicit collective, when its operand is split so that it
    // makes one.
    let implicit = || -> Result<Option<Axis>, String> {
        match op.implicit_collective() {
            Some(c) if c.applies(&buffer(input(c.operand)?)?.layout) => Ok(Some(c.axis)),
            _ => Ok(None),
        }
    };
    Ok(match op {
        OpKind::AllReduce { axes }
        | OpKind::AllGather { axes, .. }
        | OpKind::ReduceScatter { axes, .. } => {
            vec![(
                axes.clone(),
                op.name().to_string(),
                buffer(input(0)?)?.len(),
            )]
        }
        OpKind::GradNorm { axes } => vec![(axes.clone(), "grad_norm".into(), 1)],
        // Expert parallelism: the members exchange their token counts, then the token rows
        // (variable split sizes, bounded by the buffers, which every member sizes alike).
        OpKind::AllToAll { axes, .. } => vec![
            (
                axes.clone(),
                "all_gather (token counts)".into(),
                buffer(input(1)?)?.len(),
            ),
            (axes.clone(), "all_to_all".into(), buffer(input(0)?)?.len()),
        ],
        // MoE under context parallelism sums the load-balancing statistics over cp.
        OpKind::MoeAuxLoss { .. } | OpKind::MoeAuxLossGrad { .. } => {
            if let Some(axis) = implicit()? {
                let logits = buffer(input(0)?)?;
                let experts = logits.shape.last().copied().unwrap_or(0);
                vec![(
                    vec![axis],
                    format!("{} (context-parallel statistics)", op.name()),
                    2 * experts + 1,
                )]
            } else {
                Vec::new()
            }
        }
        OpKind::CrossEntropy | OpKind::CrossEntropyGrad => {
            let logits = buffer(input(0)?)?;
            if let Some(axis) = implicit()? {
                let rows = logits.len() / logits.shape.last().copied().unwrap_or(1).max(1);
                vec![(vec![axis], format!("{} (vocab-parallel)", op.name()), rows)]
            } else {
                Vec::new()
            }
        }
        OpKind::CausalAttention { .. } | OpKind::AttentionGrad { .. } => {
            if let Some(axis) = implicit()? {
                let kv = buffer(input(1)?)?.len();
                vec![(vec![axis], format!("{} (context-parallel)", op.name()), kv)]
            } else {
                Vec::new()
            }
        }
        _ => Vec::new(),
    })
}
