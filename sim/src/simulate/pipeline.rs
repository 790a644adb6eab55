//! Simulation of a pipelined plan: every pipeline stage's role at once.
//!
//! Each stage role (ranks of one stage run the same program, so it is simulated once) runs
//! its pipeline actions: a static schedule's action list in order, or, for `dpp`, the
//! highest-priority task whose inputs have arrived (as `runtime/src/pipeline.rs` does).
//! Within an action every segment instruction runs as in a non-pipelined role (one compute
//! stream, one communication stream per group, the overlap switches of the cost model). A
//! `Send` posts its message, tagged (transfer, micro-batch), on the point-to-point link
//! between the two stages (alpha-beta over NVLink when the rank order keeps them in one
//! node, else the network; one message at a time per direction); the sender goes on at
//! once, or waits for the transfer without `pp_comm_overlap`. A `Recv` waits for the
//! matching message's arrival. Stages are advanced together, always the one whose next
//! action can start earliest, so a dynamic stage sees exactly the messages that have arrived
//! when it chooses.
//!
//! After its last action a stage runs its optimizer program; the gradient norm, reduced over
//! the pipeline too, waits for every stage. Data-parallel gradient reductions overlapping the
//! backward start with the last backward of the chunk whose gradients they reduce.
//!
//! Under unit costs ([`CostMode::Unit`]) an `F`, `B` or `W` action takes 1 and `BW` 2,
//! communication and the optimizer nothing: the pipeline schedules' bubble formulas.

use std::collections::{BTreeMap, HashMap};

use megac_ir::mesh::{chunk_owner, local_chunk};
use megac_ir::op::OpKind;
use megac_ir::plan::{BufferClass, ChunkProgram, Instr, PipeAction, PipeKind, Pipeline, Role};
use megac_ir::rng::SplitMix64;
use megac_ir::spec::DppTask;
use megac_ir::types::Axis;

use super::{overlaps, Ctx, RoleReport, RoleSim, TraceEvent, Work, PHASE_STREAM};
use crate::cost::{Coll, CostMode, Group};
use crate::error::SimError;

type Ranges = super::Ranges;

/// Trace stream of pipeline transfers.
const PP_STREAM: u32 = 98;

/// What [`simulate_pipeline`] found.
pub(super) struct PipelineResult {
    /// Per role, in role order.
    pub roles: Vec<RoleReport>,
    /// Idle over total compute time of the pipeline phase, all ranks.
    pub bubble_fraction: f64,
    /// `static` or `dynamic`.
    pub execution: &'static str,
    /// The pipeline phase as simulated (from the step's start to the last stage's last
    /// action), and [`order_bound`]'s floor under it; `None` with FBD forward roles.
    pub phase: Option<PhaseBound>,
}

/// How long the pipeline phase took, and how short any order of the same actions could make it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PhaseBound {
    /// The simulated pipeline phase, seconds.
    pub seconds: f64,
    /// The lower bound of [`order_bound`], seconds.
    pub bound_seconds: f64,
}

/// What [`order_bound`] needs of one stage: its chunks, its actions' total time, whether it
/// splits the backward (B and W actions).
pub struct StageWork {
    /// The chunks the stage holds.
    pub chunks: Vec<u32>,
    /// The sum of its actions' durations (receive waits excluded).
    pub work: f64,
    /// Whether it runs W actions apart from B.
    pub split_backward: bool,
}

/// The shortest pipeline phase any order of the same actions could reach, with the
/// durations they took: no stage can start before micro-batch 0 went forward through every
/// chunk below its first (the fastest forward of each), nor finish before its own actions
/// and, unless it splits the backward, the backward through those chunks again (a stage's
/// last action is a backward of one of its chunks, which the chunks below must follow).
/// `f_min`/`b_min`: each chunk's fastest forward and backward (B or BW) action, seconds.
pub fn order_bound(
    stages: &[StageWork],
    f_min: &BTreeMap<u32, f64>,
    b_min: &BTreeMap<u32, f64>,
) -> f64 {
    let below = |mins: &BTreeMap<u32, f64>, first: u32| -> f64 {
        mins.range(..first).map(|(_, &t)| t).sum()
    };
    stages
        .iter()
        .filter_map(|s| {
            let first = *s.chunks.iter().min()?;
            let drain = if s.split_backward {
                0.0
            } else {
                below(b_min, first)
            };
            Some(below(f_min, first) + s.work + drain)
        })
        .fold(0.0, f64::max)
}

/// One segment (forward, backward or weight) of a chunk, ready to run.
struct Seg<'a> {
    instrs: &'a [Instr],
    work: Vec<Work>,
    rng: Vec<(Ranges, Ranges)>,
    /// Transfers the segment receives.
    recvs: Vec<u32>,
}

struct ChunkSim<'a> {
    prog: &'a ChunkProgram,
    f: Seg<'a>,
    b: Seg<'a>,
    w: Seg<'a>,
    /// Gradient ranges the chunk's backward writes.
    grads: Ranges,
}

/// One stage's simulation state.
struct Stage<'a> {
    ri: usize,
    stage: u32,
    ranks: usize,
    rep_rank: usize,
    role: &'a Role,
    pipe: &'a Pipeline,
    chunks: BTreeMap<u32, ChunkSim<'a>>,
    sim: RoleSim,
    /// Static: next action. Dynamic: every task and whether it is done.
    pc: usize,
    tasks: Vec<PipeAction>,
    /// Each task's place in the plan's reference order (`ordered`'s priority).
    positions: Vec<u32>,
    done: Vec<bool>,
    f_done: Vec<(u32, u32)>,
    inflight: BTreeMap<u32, u32>,
    inflight_total: u32,
    peak_inflight: u32,
    /// Action time (from the end of its receive waits to its end), pipeline phase.
    work: f64,
    first_mb: f64,
    /// Per chunk, its fastest forward and backward (B or BW) action ([`order_bound`]).
    f_min: BTreeMap<u32, f64>,
    b_min: BTreeMap<u32, f64>,
    /// Whether it ran a W action.
    split_backward: bool,
    last_bwd: BTreeMap<u32, f64>,
    pipe_end: f64,
    finished: bool,
    /// `--jitter`: this stage's random stream and relative standard deviation.
    jitter: Option<(SplitMix64, f64)>,
}

fn kind_name(k: PipeKind) -> &'static str {
    match k {
        PipeKind::F => "F",
        PipeKind::B => "B",
        PipeKind::W => "W",
        PipeKind::BW => "BW",
    }
}

/// Arena ranges of `ids`, activations of a chunk shifted by the chunk's base (so that two
/// chunks' activations never look alike).
fn ranges_of(ctx: &Ctx, ids: &[u32], base: &BTreeMap<u32, u64>) -> Ranges {
    ids.iter()
        .filter_map(|&b| ctx.plan.buffers.get(b as usize))
        .map(|b| {
            // Chunk slots start at 4-byte arena units; offsets count the dtype's elements.
            let shift = 4 * b.chunk.and_then(|c| base.get(&c)).copied().unwrap_or(0);
            let size = b.dtype.size_bytes();
            (
                b.class,
                shift + b.offset * size,
                shift + (b.offset + b.len()) * size,
            )
        })
        .collect()
}

fn instr_ranges(ctx: &Ctx, i: &Instr, base: &BTreeMap<u32, u64>) -> (Ranges, Ranges) {
    match i {
        Instr::Zero { buffer } | Instr::Recv { buffer, .. } => {
            (Vec::new(), ranges_of(ctx, &[*buffer], base))
        }
        Instr::Send { buffer, .. } => (ranges_of(ctx, &[*buffer], base), Vec::new()),
        Instr::Kernel {
            inputs, outputs, ..
        } => (ranges_of(ctx, inputs, base), ranges_of(ctx, outputs, base)),
    }
}

fn unit_work(w: Work) -> Work {
    match w {
        Work::Collective { axes, .. } => Work::Collective { time: 0.0, axes },
        Work::Compute(_) => Work::Compute(0.0),
        Work::Nothing => Work::Nothing,
    }
}

fn seg<'a>(
    ctx: &mut Ctx,
    instrs: &'a [Instr],
    base: &BTreeMap<u32, u64>,
) -> Result<Seg<'a>, SimError> {
    let unit = ctx.cost.mode == CostMode::Unit;
    let mut work = Vec::with_capacity(instrs.len());
    for i in instrs {
        let w = ctx.work(i)?;
        work.push(if unit { unit_work(w) } else { w });
    }
    let rng = instrs.iter().map(|i| instr_ranges(ctx, i, base)).collect();
    let recvs = instrs
        .iter()
        .filter_map(|i| match i {
            Instr::Recv {
                transfer,
                twin: false,
                ..
            } => Some(*transfer),
            _ => None,
        })
        .collect();
    Ok(Seg {
        instrs,
        work,
        rng,
        recvs,
    })
}

/// Messages posted so far: (transfer, micro-batch) → arrival time.
type Messages = HashMap<(u32, u32), f64>;

impl<'a> Stage<'a> {
    fn dynamic(&self) -> bool {
        self.pipe.dpp.is_some()
    }

    fn chunk(&self, c: u32) -> Result<&ChunkSim<'a>, SimError> {
        self.chunks.get(&c).ok_or_else(|| {
            SimError::new(format!(
                "malformed plan: role {} has an action on chunk {c}, which it does not hold",
                self.role.name
            ))
        })
    }

    /// Transfers an action receives.
    fn recvs(&self, a: PipeAction) -> Result<Vec<u32>, SimError> {
        let c = self.chunk(a.chunk)?;
        Ok(match a.kind {
            PipeKind::F => c.f.recvs.clone(),
            PipeKind::B => c.b.recvs.clone(),
            PipeKind::W => c.w.recvs.clone(),
            PipeKind::BW => c.b.recvs.iter().chain(&c.w.recvs).copied().collect(),
        })
    }

    /// When every message of `a` has arrived, or None while one is not even sent.
    fn arrival(&self, a: PipeAction, msgs: &Messages) -> Result<Option<f64>, SimError> {
        let mut t = 0.0f64;
        for tr in self.recvs(a)? {
            match msgs.get(&(tr, a.microbatch)) {
                Some(&x) => t = t.max(x),
                None => return Ok(None),
            }
        }
        Ok(Some(t))
    }

    /// Dynamic execution: whether the task may run as far as this rank is concerned.
    fn locally_ready(&self, a: PipeAction) -> bool {
        match a.kind {
            PipeKind::F => {
                let slots = self.chunks.get(&a.chunk).map_or(0, |c| c.prog.slots);
                self.inflight.get(&a.chunk).copied().unwrap_or(0) < slots.max(1)
            }
            _ => self.f_done.contains(&(a.chunk, a.microbatch)),
        }
    }

    /// The earliest time this stage can start its next action, None while it waits for a
    /// message nobody has sent yet.
    fn next_time(&self, msgs: &Messages) -> Result<Option<f64>, SimError> {
        let now = self.sim.compute_free;
        if !self.dynamic() {
            let a = self.pipe.actions[self.pc];
            return Ok(self.arrival(a, msgs)?.map(|t| t.max(now)));
        }
        let mut best: Option<f64> = None;
        for (i, &a) in self.tasks.iter().enumerate() {
            if self.done[i] || !self.locally_ready(a) {
                continue;
            }
            if let Some(t) = self.arrival(a, msgs)? {
                let t = t.max(now);
                best = Some(best.map_or(t, |b: f64| b.min(t)));
            }
        }
        Ok(best)
    }

    /// MegaDPP's choice at `t` (as runtime/src/pipeline.rs): a ready backward before any
    /// forward, later chunks' backwards first; breadth-first orders by chunk then
    /// micro-batch, depth-first by micro-batch then chunk; adaptive is breadth-first while
    /// fewer than `cap` micro-batches are in flight on the rank; `ordered` takes the ready
    /// task placed earliest in the plan's reference order.
    fn pick(&self, t: f64, msgs: &Messages) -> Result<Option<usize>, SimError> {
        let Some(dpp) = &self.pipe.dpp else {
            return Ok(None);
        };
        let n = self.pipe.chunks.len() as u32;
        let per = (self.pipe.chunks_total / n.max(1)).max(1);
        let key = |i: usize| {
            let a = &self.tasks[i];
            dpp.policy.priority(
                self.inflight_total,
                dpp.cap,
                DppTask {
                    backward: a.kind != PipeKind::F,
                    local_chunk: local_chunk(a.chunk, per),
                    local_chunks: n,
                    microbatch: a.microbatch,
                    position: self.positions[i],
                },
            )
        };
        let mut best: Option<usize> = None;
        for (i, a) in self.tasks.iter().enumerate() {
            if self.done[i] || !self.locally_ready(*a) {
                continue;
            }
            if self.arrival(*a, msgs)?.is_some_and(|x| x <= t)
                && best.is_none_or(|b| key(i) < key(b))
            {
                best = Some(i);
            }
        }
        Ok(best)
    }
}

/// Links between stages: per (from, to) when the link is free again.
struct Links {
    free: HashMap<(u32, u32), f64>,
}

/// Simulate every stage of a pipelined plan together.
pub(super) fn simulate_pipeline(
    ctx: &mut Ctx,
    trace: bool,
    events: &mut Vec<TraceEvent>,
    names: &mut BTreeMap<u32, String>,
) -> Result<PipelineResult, SimError> {
    let plan = ctx.plan;
    let cost = ctx.cost;
    let params = cost.params().clone();
    let unit = cost.mode == CostMode::Unit;
    let m = plan.batch.microbatches.max(1);
    let pp = plan.mesh.size(Axis::Pp).max(1) as u32;
    let gpn = cost.cluster.gpus_per_node.max(1) as usize;

    // 1. One stage per role.
    let mut stages: Vec<Stage> = Vec::new();
    for (ri, role) in plan.roles.iter().enumerate() {
        let Some(pipe) = &role.pipeline else {
            return Err(SimError::new(format!(
                "malformed plan: role {} has no pipeline program, but other roles do",
                role.name
            )));
        };
        let ranks: Vec<usize> = (0..plan.rank_to_role.len())
            .filter(|&r| plan.rank_to_role[r] as usize == ri)
            .collect();
        let Some(&rep_rank) = ranks.first() else {
            return Err(SimError::new(format!(
                "malformed plan: no rank runs role {}",
                role.name
            )));
        };
        if plan.mesh.coord(rep_rank, Axis::Fbd) == 1 {
            // An FBD forward role runs ahead on its own ranks, forward only; its stage
            // inputs are taken as arrived when the backward role needs them.
            continue;
        }
        let stage = plan.mesh.coord(rep_rank, Axis::Pp) as u32;
        if let Some(&r) = ranks
            .iter()
            .find(|&&r| plan.mesh.coord(r, Axis::Pp) as u32 != stage)
        {
            return Err(SimError::new(format!(
                "malformed plan: role {} runs on ranks {rep_rank} and {r} of different pipeline stages",
                role.name
            )));
        }
        let base: BTreeMap<u32, u64> = pipe
            .chunks
            .iter()
            .map(|c| (c.chunk, c.activation_base))
            .collect();
        let mut chunks = BTreeMap::new();
        for c in &pipe.chunks {
            if chunk_owner(c.chunk, pp) != stage {
                return Err(SimError::new(format!(
                    "malformed plan: role {} (pipeline stage {stage}) holds chunk {}, which lives on stage {}",
                    role.name,
                    c.chunk,
                    chunk_owner(c.chunk, pp)
                )));
            }
            let f = seg(ctx, &c.forward, &base)?;
            let b = seg(ctx, &c.backward, &base)?;
            let w = seg(ctx, &c.weight, &base)?;
            let grads = b
                .rng
                .iter()
                .chain(&w.rng)
                .flat_map(|(_, outs)| outs.iter().copied())
                .filter(|r| r.0 == BufferClass::Grad)
                .collect();
            chunks.insert(
                c.chunk,
                ChunkSim {
                    prog: c,
                    f,
                    b,
                    w,
                    grads,
                },
            );
        }
        let tasks: Vec<PipeAction> = if pipe.dpp.is_some() {
            pipe.chunks
                .iter()
                .flat_map(|c| {
                    (0..m as u32).flat_map(move |j| {
                        [PipeKind::F, PipeKind::BW].map(|kind| PipeAction {
                            kind,
                            chunk: c.chunk,
                            microbatch: j,
                        })
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        let n_tasks = tasks.len();
        let positions = pipe.positions(&tasks);
        let empty = if pipe.dpp.is_some() {
            n_tasks == 0
        } else {
            pipe.actions.is_empty()
        };
        stages.push(Stage {
            ri,
            stage,
            ranks: ranks.len(),
            rep_rank,
            role,
            pipe,
            chunks,
            sim: RoleSim::new(ri, usize::MAX, trace, m, &params),
            pc: 0,
            tasks,
            positions,
            done: vec![false; n_tasks],
            f_done: Vec::new(),
            inflight: BTreeMap::new(),
            inflight_total: 0,
            peak_inflight: 0,
            work: 0.0,
            first_mb: 0.0,
            f_min: BTreeMap::new(),
            b_min: BTreeMap::new(),
            split_backward: false,
            last_bwd: BTreeMap::new(),
            pipe_end: 0.0,
            finished: empty,
            jitter: cost.jitter.map(|j| (j.stream(rep_rank), j.std)),
        });
    }
    let stage_index: BTreeMap<u32, usize> = stages
        .iter()
        .enumerate()
        .map(|(i, s)| (s.stage, i))
        .collect();
    let dynamic = stages.iter().any(|s| s.dynamic());

    // 2. The pipeline phase, all stages together.
    let mut msgs: Messages = HashMap::new();
    let mut links = Links {
        free: HashMap::new(),
    };
    loop {
        let mut pick: Option<(f64, usize)> = None;
        for (i, st) in stages.iter().enumerate() {
            if st.finished {
                continue;
            }
            if let Some(t) = st.next_time(&msgs)? {
                if pick.is_none_or(|(pt, _)| t < pt) {
                    pick = Some((t, i));
                }
            }
        }
        let Some((t, i)) = pick else {
            if stages.iter().all(|s| s.finished) {
                break;
            }
            return Err(deadlock(&stages, &msgs));
        };
        let st = &mut stages[i];
        let action = if st.dynamic() {
            if t > st.sim.compute_free {
                st.sim.compute_free = t;
            }
            let Some(k) = st.pick(t, &msgs)? else {
                return Err(SimError::new(format!(
                    "internal: pipeline stage {} has no ready task at {t}",
                    st.stage
                )));
            };
            st.done[k] = true;
            if st.done.iter().all(|&d| d) {
                st.finished = true;
            }
            st.tasks[k]
        } else {
            let a = st.pipe.actions[st.pc];
            st.pc += 1;
            if st.pc == st.pipe.actions.len() {
                st.finished = true;
            }
            a
        };
        run_action(
            st,
            action,
            ctx,
            &stage_index,
            &mut msgs,
            &mut links,
            unit,
            params.pp_comm_overlap,
            gpn,
            events,
            names,
        )?;
        if st.finished {
            st.pipe_end = st.sim.compute_free;
        }
    }
    let makespan = stages.iter().map(|s| s.pipe_end).fold(0.0, f64::max);
    // The order bound needs every chunk's forward and backward on its stage's role: FBD's
    // forward roles are not simulated here.
    let phase = (stages.len() == plan.roles.len()).then(|| {
        let mut f_min = BTreeMap::new();
        let mut b_min = BTreeMap::new();
        for st in &stages {
            f_min.extend(st.f_min.iter().map(|(&c, &t)| (c, t)));
            b_min.extend(st.b_min.iter().map(|(&c, &t)| (c, t)));
        }
        let work: Vec<StageWork> = stages
            .iter()
            .map(|st| StageWork {
                chunks: st.chunks.keys().copied().collect(),
                work: st.work,
                split_backward: st.split_backward,
            })
            .collect();
        PhaseBound {
            seconds: makespan,
            bound_seconds: order_bound(&work, &f_min, &b_min),
        }
    });

    // 3. The optimizer: each stage after its last action; the gradient norm (reduced over
    // the pipeline) waits for every stage.
    let mut opt_start = Vec::with_capacity(stages.len());
    let mut opt_data = Vec::with_capacity(stages.len());
    for st in stages.iter_mut() {
        st.sim.grad_ready = st
            .chunks
            .iter()
            .map(|(c, ch)| (ch.grads.clone(), st.last_bwd.get(c).copied().unwrap_or(0.0)))
            .collect();
        st.sim.bwd_start_last = st.last_bwd.values().copied().fold(0.0, f64::max);
        let prog = &st.role.optimizer;
        let mut work = Vec::with_capacity(prog.len());
        for i in prog {
            let w = ctx.work(i)?;
            work.push(if unit { unit_work(w) } else { w });
        }
        let rng: Vec<(Ranges, Ranges)> = prog
            .iter()
            .map(|i| instr_ranges(ctx, i, &BTreeMap::new()))
            .collect();
        opt_start.push(st.sim.compute_free);
        opt_data.push((work, rng));
    }
    let split: Vec<usize> = stages
        .iter()
        .map(|st| {
            st.role
                .optimizer
                .iter()
                .position(|i| {
                    matches!(i, Instr::Kernel { op: OpKind::GradNorm { axes }, .. } if axes.contains(&Axis::Pp))
                })
                .unwrap_or(st.role.optimizer.len())
        })
        .collect();
    let mut sync = 0.0f64;
    for (k, st) in stages.iter_mut().enumerate() {
        let (work, rng) = &opt_data[k];
        let prog = &st.role.optimizer;
        for i in 0..split[k] {
            st.sim
                .exec(&prog[i], &work[i], &rng[i], true, trace, events, names);
        }
        let mut ready = st.sim.compute_free;
        if let Some(r) = rng.get(split[k]) {
            for c in &st.sim.inflight {
                if overlaps(&c.ranges, &r.0) {
                    ready = ready.max(c.end);
                }
            }
        }
        if split[k] < prog.len() {
            sync = sync.max(ready);
        }
    }
    let mut roles: Vec<Option<RoleReport>> = vec![None; plan.roles.len()];
    let (mut idle_sum, mut total_sum) = (0.0, 0.0);
    for (k, st) in stages.iter_mut().enumerate() {
        let (work, rng) = &opt_data[k];
        let prog = &st.role.optimizer;
        let mut sync_wait = 0.0;
        if split[k] < prog.len() && sync > st.sim.compute_free {
            sync_wait = sync - st.sim.compute_free;
            st.sim.waited += sync_wait;
            st.sim.compute_free = sync;
        }
        for i in split[k]..prog.len() {
            st.sim
                .exec(&prog[i], &work[i], &rng[i], true, trace, events, names);
        }
        let mut end = st.sim.compute_free;
        for c in &st.sim.inflight {
            end = end.max(c.end);
        }
        if st.sim.deferred_end > 0.0 {
            // The stage's fastest forward (none: no window).
            let window = st.f_min.values().copied().reduce(f64::min).unwrap_or(0.0);
            end = end.max(st.sim.deferred_end - window);
        }
        let idle = (makespan - st.work).max(0.0);
        idle_sum += idle * st.ranks as f64;
        total_sum += makespan * st.ranks as f64;
        let mem = plan.memory_of(st.rep_rank);
        if trace {
            events.push(TraceEvent {
                name: "optimizer".into(),
                detail: "optimizer".into(),
                start: opt_start[k],
                dur: st.sim.compute_free - opt_start[k],
                role: st.ri,
                stream: PHASE_STREAM,
            });
        }
        roles[st.ri] = Some(RoleReport {
            name: st.role.name.clone(),
            ranks: st.ranks,
            step_seconds: end,
            compute_seconds: st.sim.busy,
            exposed_comm_seconds: st.sim.waited + (end - st.sim.compute_free).max(0.0),
            comm_seconds: std::mem::take(&mut st.sim.comm_total),
            microbatch_seconds: st.first_mb,
            optimizer_seconds: st.sim.compute_free - opt_start[k] - sync_wait,
            kernels: st.sim.kernels,
            memory_bytes: mem.total(),
            activation_live_bytes: mem.activation_bytes_live,
            stage: Some(st.stage),
            bubble_fraction: if makespan > 0.0 { idle / makespan } else { 0.0 },
            peak_inflight: st.peak_inflight,
        });
    }
    if trace {
        names
            .entry(PP_STREAM)
            .or_insert_with(|| "pipeline transfers".to_string());
    }
    // FBD forward roles run ahead of their backward twins: report them with the twin's
    // step time and their own memory.
    for ri in 0..roles.len() {
        if roles[ri].is_some() {
            continue;
        }
        let role = &plan.roles[ri];
        let ranks: Vec<usize> = (0..plan.rank_to_role.len())
            .filter(|&r| plan.rank_to_role[r] as usize == ri)
            .collect();
        let Some(&rep) = ranks.first() else {
            return Err(SimError::new(format!(
                "malformed plan: no rank runs role {}",
                role.name
            )));
        };
        let stage = plan.mesh.coord(rep, Axis::Pp) as u32;
        let twin = roles
            .iter()
            .flatten()
            .find(|r| r.stage == Some(stage))
            .cloned()
            .ok_or_else(|| {
                SimError::new(format!(
                    "malformed plan: role {} has no backward twin on stage {stage}",
                    role.name
                ))
            })?;
        let mem = plan.memory_of(rep);
        roles[ri] = Some(RoleReport {
            name: role.name.clone(),
            ranks: ranks.len(),
            memory_bytes: mem.total(),
            activation_live_bytes: mem.activation_bytes_live,
            ..twin
        });
    }
    Ok(PipelineResult {
        roles: roles.into_iter().flatten().collect(),
        bubble_fraction: if total_sum > 0.0 {
            idle_sum / total_sum
        } else {
            0.0
        },
        execution: if dynamic { "dynamic" } else { "static" },
        phase,
    })
}

/// Run one action of stage `st`: its segments' instructions, receives waiting for their
/// messages and sends posting theirs.
#[allow(clippy::too_many_arguments)]
fn run_action(
    st: &mut Stage,
    a: PipeAction,
    ctx: &Ctx,
    stage_index: &BTreeMap<u32, usize>,
    msgs: &mut Messages,
    links: &mut Links,
    unit: bool,
    pp_overlap: bool,
    gpn: usize,
    events: &mut Vec<TraceEvent>,
    names: &mut BTreeMap<u32, String>,
) -> Result<(), SimError> {
    let plan = ctx.plan;
    let cost = ctx.cost;
    let pp = plan.mesh.size(Axis::Pp).max(1) as u32;
    let m = plan.batch.microbatches.max(1);
    let j = a.microbatch;
    let detail = st.sim.trace && (j == 0 || u64::from(j) + 1 == m || m <= 4);
    let start = st.sim.compute_free;
    let mut waited_recv = 0.0;
    // `--jitter`: this action's compute takes `slow` times its cost.
    let slow = match &mut st.jitter {
        Some((rng, std)) if *std > 0.0 => 1.0 + *std * rng.normal().abs(),
        _ => 1.0,
    };
    let unit_cost = slow
        * match a.kind {
            PipeKind::BW => 2.0,
            _ => 1.0,
        };
    let mut charged = !unit;
    // The chunk's segments for this action (taken out to avoid borrowing `st` twice).
    let ch = st.chunks.remove(&a.chunk).ok_or_else(|| {
        SimError::new(format!(
            "malformed plan: role {} has an action on chunk {}, which it does not hold",
            st.role.name, a.chunk
        ))
    })?;
    let segs: Vec<&Seg> = match a.kind {
        PipeKind::F => vec![&ch.f],
        PipeKind::B => vec![&ch.b],
        PipeKind::W => vec![&ch.w],
        PipeKind::BW => vec![&ch.b, &ch.w],
    };
    let result = (|| -> Result<(), SimError> {
        for s in &segs {
            for (k, instr) in s.instrs.iter().enumerate() {
                match instr {
                    // From the FBD twin (the forward role runs ahead): no wait.
                    Instr::Recv { twin: true, .. } | Instr::Send { twin: true, .. } => {}
                    Instr::Recv { transfer, .. } => {
                        let Some(&arrival) = msgs.get(&(*transfer, j)) else {
                            return Err(SimError::new(format!(
                                "internal: stage {} receives transfer {transfer} of micro-batch {j} before it is sent",
                                st.stage
                            )));
                        };
                        if arrival > st.sim.compute_free {
                            waited_recv += arrival - st.sim.compute_free;
                            st.sim.compute_free = arrival;
                        }
                    }
                    Instr::Send {
                        buffer,
                        chunk,
                        transfer,
                        ..
                    } => {
                        if !charged {
                            st.sim.compute_free += unit_cost;
                            st.sim.busy += unit_cost;
                            charged = true;
                        }
                        let dst = chunk_owner(*chunk, pp);
                        if !stage_index.contains_key(&dst) {
                            return Err(SimError::new(format!(
                                "malformed plan: stage {} sends transfer {transfer} to chunk {chunk}, whose stage {dst} has no role",
                                st.stage
                            )));
                        }
                        let b = plan.buffers.get(*buffer as usize).ok_or_else(|| {
                            SimError::new(format!(
                                "malformed plan: buffer {buffer} does not exist ({} buffers)",
                                plan.buffers.len()
                            ))
                        })?;
                        let bytes = (b.len() * b.dtype.size_bytes()) as f64;
                        let t = if unit || dst == st.stage {
                            0.0
                        } else {
                            let peer = plan.mesh.chunk_peer(st.rep_rank, *chunk);
                            let same_node = peer / gpn == st.rep_rank / gpn;
                            let group = Group {
                                size: 2,
                                per_node: if same_node { 2 } else { 1 },
                            };
                            cost.collective(Coll::SendRecv, bytes, group)
                        };
                        let mut ready = st.sim.compute_free;
                        let ins = &s.rng[k].0;
                        for c in &st.sim.inflight {
                            if overlaps(&c.ranges, ins) {
                                ready = ready.max(c.end);
                            }
                        }
                        let link = links.free.entry((st.stage, dst)).or_insert(0.0);
                        let begin = ready.max(*link);
                        let arrival = begin + t;
                        *link = arrival;
                        msgs.insert((*transfer, j), arrival);
                        if t > 0.0 {
                            *st.sim.comm_total.entry("pp".into()).or_insert(0.0) += t;
                            if !pp_overlap {
                                st.sim.waited += arrival - st.sim.compute_free;
                                st.sim.compute_free = arrival;
                            }
                            if detail {
                                events.push(TraceEvent {
                                    name: "send".into(),
                                    detail: format!("transfer {transfer} to stage {dst}"),
                                    start: begin,
                                    dur: t,
                                    role: st.ri,
                                    stream: PP_STREAM,
                                });
                                names
                                    .entry(PP_STREAM)
                                    .or_insert_with(|| "pipeline transfers".to_string());
                            }
                        }
                    }
                    _ => {
                        let slowed;
                        let work = match s.work[k] {
                            Work::Compute(t) if slow != 1.0 => {
                                slowed = Work::Compute(t * slow);
                                &slowed
                            }
                            ref w => w,
                        };
                        st.sim
                            .exec(instr, work, &s.rng[k], false, detail, events, names);
                    }
                }
            }
        }
        Ok(())
    })();
    st.chunks.insert(a.chunk, ch);
    result?;
    if !charged {
        st.sim.compute_free += unit_cost;
        st.sim.busy += unit_cost;
    }
    let end = st.sim.compute_free;
    let dur = end - start - waited_recv;
    st.work += dur;
    if j == 0 {
        st.first_mb += dur;
    }
    let begin = start + waited_recv;
    match a.kind {
        PipeKind::F => {
            let t = st.f_min.entry(a.chunk).or_insert(dur);
            *t = t.min(dur);
            st.f_done.push((a.chunk, j));
            *st.inflight.entry(a.chunk).or_insert(0) += 1;
            st.inflight_total += 1;
            st.peak_inflight = st.peak_inflight.max(st.inflight_total);
        }
        PipeKind::B | PipeKind::BW => {
            st.last_bwd.insert(a.chunk, begin);
            let t = st.b_min.entry(a.chunk).or_insert(dur);
            *t = t.min(dur);
        }
        PipeKind::W => st.split_backward = true,
    }
    let last = match a.kind {
        PipeKind::BW | PipeKind::W => true,
        PipeKind::B => st
            .chunks
            .get(&a.chunk)
            .is_some_and(|c| c.w.instrs.is_empty()),
        PipeKind::F => false,
    };
    if last {
        if let Some(n) = st.inflight.get_mut(&a.chunk) {
            *n = n.saturating_sub(1);
        }
        st.inflight_total = st.inflight_total.saturating_sub(1);
    }
    if st.sim.trace {
        events.push(TraceEvent {
            name: format!("{}{}.{}", kind_name(a.kind), a.chunk, j),
            detail: format!("chunk {} micro-batch {j}", a.chunk),
            start: begin,
            dur,
            role: st.ri,
            stream: PHASE_STREAM,
        });
    }
    Ok(())
}

/// The deadlock error: what each unfinished stage waits for.
fn deadlock(stages: &[Stage], msgs: &Messages) -> SimError {
    let mut parts = Vec::new();
    for st in stages.iter().filter(|s| !s.finished) {
        if st.dynamic() {
            parts.push(format!(
                "stage {} has no task whose inputs can arrive",
                st.stage
            ));
            continue;
        }
        let a = st.pipe.actions[st.pc];
        let missing: Vec<String> = st
            .recvs(a)
            .unwrap_or_default()
            .into_iter()
            .filter(|t| !msgs.contains_key(&(*t, a.microbatch)))
            .map(|t| t.to_string())
            .collect();
        parts.push(format!(
            "stage {} at action {} ({}{}.{}) waits for transfer(s) {} of micro-batch {}",
            st.stage,
            st.pc,
            kind_name(a.kind),
            a.chunk,
            a.microbatch,
            missing.join(", "),
            a.microbatch
        ));
    }
    SimError::new(format!(
        "pipeline deadlock in the simulated schedule: {}",
        parts.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two stages, chunks 0 and 2 on the first, 1 and 3 on the second (interleaved): the
    /// second stage waits for chunk 0's fastest forward and, without split backward, ends with
    /// chunk 0's fastest backward after it; the first stage has no chunk below its own.
    #[test]
    fn the_bound_charges_the_chunks_below_a_stage_once_each_way() {
        let f_min = BTreeMap::from([(0, 1.5), (1, 1.0), (2, 1.0), (3, 1.0)]);
        let b_min = BTreeMap::from([(0, 2.5), (1, 2.0), (2, 2.0), (3, 2.0)]);
        let stage = |chunks: Vec<u32>, work: f64, split_backward: bool| StageWork {
            chunks,
            work,
            split_backward,
        };
        let fused = [
            stage(vec![0, 2], 20.0, false),
            stage(vec![1, 3], 18.0, false),
        ];
        // max(0 + 20 + 0, 1.5 + 18 + 2.5)
        assert_eq!(order_bound(&fused, &f_min, &b_min), 22.0);
        let split = [stage(vec![0, 2], 20.0, true), stage(vec![1, 3], 18.0, true)];
        // max(20, 1.5 + 18): a W may be a stage's last action.
        assert_eq!(order_bound(&split, &f_min, &b_min), 20.0);
        assert_eq!(order_bound(&[], &f_min, &b_min), 0.0);
    }
}
