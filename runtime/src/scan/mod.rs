//! MegaScan: per-rank event records (`--trace DIR` writes `DIR/rank-N.json`), fault
//! injection (`--inject`), and their analysis (`analyze`: clock alignment, the merged
//! timeline, slow-rank and slow-link detection for `megac scan`).
//!
//! Recording: every rank's communicator is wrapped in a [`ScanComm`], which times every
//! collective and transfer, and the compute between them (a *segment*: the kernels a program
//! runs between two communications), and applies the rank's injected faults there. The
//! session adds pipeline actions, micro-batches, data loading, optimizer steps and steps.
//! Events go into a buffer preallocated from the plan's size; the hot path takes two clock
//! readings and writes one fixed-size record, never allocating (a full buffer counts drops).
//! Times are nanoseconds of one monotonic clock per process (an `Instant` taken once), as the
//! rank *records* them: `clock:R:MS:PPM` shifts and stretches rank R's records only.

pub mod analyze;
pub mod inject;
pub mod online;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::comm::Communicator;
use crate::error::RuntimeError;
pub use inject::{Inject, InjectError, RankFaults};

/// What an event is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// A whole optimizer step.
    Step,
    /// Loading a micro-batch's data (`b` = micro-batch).
    Data,
    /// A micro-batch's forward and backward (non-pipelined plans; `b` = micro-batch).
    Microbatch,
    /// Pipeline forward (`a` = chunk, `b` = micro-batch).
    Forward,
    /// Pipeline input-gradient backward.
    Backward,
    /// Pipeline weight-gradient backward.
    Weight,
    /// Pipeline whole backward (input and weight gradients).
    BackwardWeight,
    /// The optimizer program.
    Optimizer,
    /// Kernels between two communications (`a` = compute segment index in the step).
    Compute,
    /// A collective (`a` = group id, `b` = [`Coll`] code, `seq` = call number on the group).
    Collective,
    /// A send (`a` = peer, `seq` = tag).
    Send,
    /// A receive (`a` = peer, `seq` = tag).
    Recv,
    /// One clock-sync ping-pong ([`ScanComm::sync_clocks`]; `a` = peer, `b` = phase, `seq` =
    /// round): on rank 0 from sending the ping to receiving the pong, on the peer from
    /// receiving the ping to sending the pong.
    Sync,
}

impl Kind {
    const ALL: [Kind; 13] = [
        Kind::Step,
        Kind::Data,
        Kind::Microbatch,
        Kind::Forward,
        Kind::Backward,
        Kind::Weight,
        Kind::BackwardWeight,
        Kind::Optimizer,
        Kind::Compute,
        Kind::Collective,
        Kind::Send,
        Kind::Recv,
        Kind::Sync,
    ];

    /// The name in rank files.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Step => "step",
            Kind::Data => "data",
            Kind::Microbatch => "mb",
            Kind::Forward => "F",
            Kind::Backward => "B",
            Kind::Weight => "W",
            Kind::BackwardWeight => "BW",
            Kind::Optimizer => "optimizer",
            Kind::Compute => "compute",
            Kind::Collective => "coll",
            Kind::Send => "send",
            Kind::Recv => "recv",
            Kind::Sync => "sync",
        }
    }

    /// The kind named `s`.
    pub fn from_name(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == s)
    }

    /// Whether the event sits on the communication thread of the merged timeline.
    pub fn is_comm(self) -> bool {
        matches!(
            self,
            Kind::Collective | Kind::Send | Kind::Recv | Kind::Sync
        )
    }
}

/// A collective's kind (an event's `b`).
pub const COLLECTIVES: [&str; 6] = [
    "all_reduce_sum",
    "all_reduce_max",
    "all_reduce_sum_f64",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
];

/// One record: fixed size, no heap.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Event {
    /// What it is.
    pub kind: Kind,
    /// Start and end, recorded ns.
    pub t0: i64,
    /// End.
    pub t1: i64,
    /// 1-based step (0 outside steps).
    pub step: u32,
    /// Chunk, group id or peer (see [`Kind`]).
    pub a: u32,
    /// Micro-batch or collective code.
    pub b: u32,
    /// Collective call number or message tag.
    pub seq: u64,
    /// Bytes moved (this rank's send side).
    pub bytes: u64,
    /// Compute segments: ns of the event that were not the rank's busy time (its thread
    /// waiting for a CPU, see [`ScanComm::end_segment`]); sends and receives: ns its thread
    /// waited for a CPU (run delay); 0 otherwise.
    pub cpu_wait: u64,
}

impl Event {
    /// How long the event took, ns: the wall time less `cpu_wait`. For a compute segment its
    /// busy time, what the rank's device spent on it (injected slowness included); for a
    /// transfer, the time it took without the sender's or receiver's waits for a CPU. Another
    /// rank's thread holding the core lengthens neither.
    pub fn duration(&self) -> f64 {
        ((self.t1 - self.t0) as f64 - self.cpu_wait as f64).max(0.0)
    }
}

/// The process's time zero, and the wall-clock time (ns since the Unix epoch) read with it.
fn epoch_pair() -> (Instant, i128) {
    static EPOCH: OnceLock<(Instant, i128)> = OnceLock::new();
    *EPOCH.get_or_init(|| {
        let t = Instant::now();
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        (t, wall)
    })
}

/// The process's time zero.
fn epoch() -> Instant {
    epoch_pair().0
}

/// A rank's preallocated event buffer and its recorded clock.
#[derive(Debug)]
pub struct Recorder {
    events: Vec<Event>,
    dropped: u64,
    /// Groups seen, in order of first use, with their next call number.
    groups: Vec<(Vec<usize>, u64)>,
    offset_ns: f64,
    drift: f64,
    /// The current step.
    pub step: u32,
    segment: u32,
    /// Index of the current step's first event.
    step_start: usize,
}

impl Recorder {
    /// A buffer for `capacity` events; `offset_ns`/`drift` skew the recorded clock.
    pub fn new(capacity: usize, offset_ns: f64, drift: f64) -> Recorder {
        epoch();
        Recorder {
            events: Vec::with_capacity(capacity),
            dropped: 0,
            groups: Vec::with_capacity(16),
            offset_ns,
            drift,
            step: 0,
            segment: 0,
            step_start: 0,
        }
    }

    /// The recorded time of `t`.
    pub fn stamp(&self, t: Instant) -> i64 {
        let ns = t.saturating_duration_since(epoch()).as_nanos() as f64;
        (ns + self.offset_ns + self.drift * ns) as i64
    }

    /// Record an event from `t0` to `t1` (dropped, and counted, when the buffer is full).
    #[allow(clippy::too_many_arguments)]
    pub fn push(
        &mut self,
        kind: Kind,
        t0: Instant,
        t1: Instant,
        a: u32,
        b: u32,
        seq: u64,
        bytes: u64,
    ) {
        self.put(kind, t0, t1, [a, b], seq, bytes, 0);
    }

    /// Record compute segment `i` from `t0` to `t1`, its thread `cpu_wait` ns of it waiting
    /// for a CPU.
    pub fn push_compute(&mut self, t0: Instant, t1: Instant, i: u32, cpu_wait: u64) {
        self.put(Kind::Compute, t0, t1, [i, 0], 0, 0, cpu_wait);
    }

    /// Record a send or receive with `peer`, its thread `cpu_wait` ns of it waiting for a CPU.
    #[allow(clippy::too_many_arguments)]
    pub fn push_transfer(
        &mut self,
        kind: Kind,
        t0: Instant,
        t1: Instant,
        peer: u32,
        tag: u64,
        bytes: u64,
        cpu_wait: u64,
    ) {
        self.put(kind, t0, t1, [peer, 0], tag, bytes, cpu_wait);
    }

    #[allow(clippy::too_many_arguments)]
    fn put(
        &mut self,
        kind: Kind,
        t0: Instant,
        t1: Instant,
        [a, b]: [u32; 2],
        seq: u64,
        bytes: u64,
        cpu_wait: u64,
    ) {
        if self.events.len() == self.events.capacity() {
            self.dropped += 1;
            return;
        }
        let e = Event {
            kind,
            t0: self.stamp(t0),
            t1: self.stamp(t1),
            step: self.step,
            a,
            b,
            seq,
            bytes,
            cpu_wait,
        };
        self.events.push(e);
    }

    /// Start a step: compute segments count from 0 again.
    pub fn begin_step(&mut self, step: u64) {
        self.step = step as u32;
        self.segment = 0;
        self.step_start = self.events.len();
    }

    /// The events of the current step so far.
    pub fn step_events(&self) -> &[Event] {
        &self.events[self.step_start.min(self.events.len())..]
    }

    /// The members of the group with id `id` (an event's `a` for collectives).
    pub fn group(&self, id: u32) -> &[usize] {
        &self.groups[id as usize].0
    }

    /// Forget the events recorded so far (`--scan` without `--trace` keeps one step's);
    /// groups and their call numbers stay.
    pub fn clear_events(&mut self) {
        self.events.clear();
        self.step_start = 0;
    }

    /// The group's id and its next call number (a group's first use allocates, once).
    fn call(&mut self, group: &[usize]) -> (u32, u64) {
        let i = match self.groups.iter().position(|g| g.0 == group) {
            Some(i) => i,
            None => {
                self.groups.push((group.to_vec(), 0));
                self.groups.len() - 1
            }
        };
        self.groups[i].1 += 1;
        (i as u32, self.groups[i].1)
    }

    /// The events recorded so far.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// This rank's file (`rank-N.json`): the header, the groups, then one array per event.
    pub fn to_json(&self, header: &RankHeader) -> String {
        use std::fmt::Write;
        let mut s = String::with_capacity(64 * self.events.len() + 512);
        let coords: Vec<String> = header
            .coords
            .iter()
            .map(|(a, c, n)| format!("[\"{a}\",{c},{n}]"))
            .collect();
        let groups: Vec<String> = self.groups.iter().map(|g| format!("{:?}", g.0)).collect();
        let placement = header.placement.as_ref().map_or("null".to_string(), |p| {
            format!(
                "{{\"host\":{},\"slot\":{},\"cores\":{:?}}}",
                serde_json::Value::from(p.host.as_str()),
                p.turns.slot,
                p.turns.cores
            )
        });
        let _ = write!(
            s,
            "{{\"format\":\"{FORMAT}\",\"rank\":{},\"world\":{},\"role\":{},\"coords\":[{}],\
             \"steps\":{},\"rotation\":{},\"placement\":{},\"dropped\":{},\"true_clock\":{{\
             \"epoch_unix_ns\":{},\"offset_ns\":{},\"drift\":{}}},\"groups\":[{}],\"events\":[",
            header.rank,
            header.world,
            header.role,
            coords.join(","),
            header.steps,
            header.rotation,
            placement,
            self.dropped,
            epoch_pair().1,
            self.offset_ns,
            self.drift,
            groups.join(",")
        );
        for (i, e) in self.events.iter().enumerate() {
            let _ = write!(
                s,
                "{}\n[\"{}\",{},{},{},{},{},{},{},{}]",
                if i == 0 { "" } else { "," },
                e.kind.name(),
                e.t0,
                e.t1,
                e.step,
                e.a,
                e.b,
                e.seq,
                e.bytes,
                e.cpu_wait
            );
        }
        s.push_str("]}\n");
        s
    }
}

/// The format tag of rank files.
pub const FORMAT: &str = "megac-scan/1";

/// What a rank file says about its rank.
#[derive(Clone, Debug, PartialEq)]
pub struct RankHeader {
    /// World rank.
    pub rank: usize,
    /// World size.
    pub world: usize,
    /// The plan role it runs (ranks of one role run the same program).
    pub role: usize,
    /// (axis, coordinate, axis size) for every mesh axis.
    pub coords: Vec<(String, usize, usize)>,
    /// Steps run.
    pub steps: u64,
    /// Steps over which the rank took a turn on each core it rotated over
    /// ([`crate::threads::Crossover`]); 1 when it was not rotated. `megac scan` compares
    /// ranks over blocks of this many steps.
    pub rotation: u64,
    /// Where a rotated rank ran each step (`None` when not rotated, or in older files).
    pub placement: Option<Placement>,
}

/// Where a rotated rank ran: its host and its turns on the host's cores.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    /// The host's name ([`crate::threads::host_name`]).
    pub host: String,
    /// The core of each step.
    pub turns: crate::threads::CoreTurns,
}

impl Placement {
    /// Whether two ranks ran step `step` on the same core of the same host.
    pub fn shares_core(&self, other: &Placement, step: u64) -> bool {
        self.host == other.host && self.turns.core(step) == other.turns.core(step)
    }
}

/// The nominal wire time of a slow link's transfer: 5 µs + bytes / 1 GB/s.
fn wire(bytes: u64) -> Duration {
    Duration::from_nanos(5_000 + bytes)
}

/// Wait until `until`: sleep all but the last 100 µs (a sleep overshoots by tens of µs),
/// yield the rest. An injected slowdown is a slow device, which takes no CPU from the other
/// ranks: spinning through it would, on a machine with more ranks than cores, slow the
/// healthy ranks too and hide the fault.
fn wait_until(until: Instant) {
    loop {
        let now = Instant::now();
        if now >= until {
            return;
        }
        let left = until - now;
        if left > Duration::from_micros(200) {
            std::thread::sleep(left - Duration::from_micros(100));
        } else {
            std::thread::yield_now();
        }
    }
}

/// The calling thread's scheduler clocks: the ns it has run on a CPU (its thread CPU clock)
/// and the ns it has waited runnable for one (its run delay, Linux's
/// `/proc/thread-self/schedstat`). The file is opened on the first reading, by the thread
/// that runs the rank's program (which stays on its thread), and read again at each segment
/// and transfer boundary (one `pread`, 1.6 µs with the clock read). Where it cannot be read
/// (not Linux, no schedstat), every reading is `None` and durations are wall times.
#[derive(Debug, Default)]
struct ThreadClock {
    file: Option<std::fs::File>,
    unavailable: bool,
    /// Whether the rank's kernels run on this one thread (its rayon pool has one), found at
    /// the first reading.
    one_thread: bool,
}

/// One reading of a [`ThreadClock`].
#[derive(Clone, Copy, Debug, Default)]
struct ThreadTimes {
    /// Time on a CPU, ns (without a VM's steal, where the kernel accounts it).
    on_cpu: u64,
    /// Time runnable but waiting for a CPU, ns.
    run_delay: u64,
}

impl ThreadClock {
    #[cfg(not(target_os = "linux"))]
    fn now(&mut self) -> Option<ThreadTimes> {
        None
    }

    #[cfg(target_os = "linux")]
    fn now(&mut self) -> Option<ThreadTimes> {
        use std::os::unix::fs::FileExt;
        if self.unavailable {
            return None;
        }
        if self.file.is_none() {
            self.file = std::fs::File::open("/proc/thread-self/schedstat").ok();
            self.one_thread = rayon::current_num_threads() == 1;
        }
        // schedstat's own run time is brought up to date only at scheduler events, so a
        // running thread reads its CPU time from the thread CPU clock; the run delay is up to
        // date whenever the thread runs (it is added when the thread gets a CPU).
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid timespec for the call to write.
        let cpu_ok = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0;
        let mut buf = [0u8; 96];
        let got = self.file.as_ref().and_then(|f| f.read_at(&mut buf, 0).ok());
        let times = got.filter(|_| cpu_ok).and_then(|n| {
            let run_delay = std::str::from_utf8(&buf[..n])
                .ok()?
                .split_ascii_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some(ThreadTimes {
                on_cpu: ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64,
                run_delay,
            })
        });
        if times.is_none() {
            self.unavailable = true;
            self.file = None;
        }
        times
    }

    /// The busy ns of `wall` ns between readings `start` and `end` (see
    /// [`ScanComm::end_segment`]): the CPU time on a one-thread rank, else the wall time less
    /// the run delay; the wall time without both readings.
    fn busy(&self, start: Option<ThreadTimes>, end: Option<ThreadTimes>, wall: u64) -> u64 {
        match (start, end) {
            (Some(a), Some(b)) if self.one_thread => b.on_cpu.saturating_sub(a.on_cpu),
            (Some(a), Some(b)) => wall.saturating_sub(b.run_delay.saturating_sub(a.run_delay)),
            _ => wall,
        }
    }
}

/// A communicator that records and injects (see the module doc).
pub struct ScanComm {
    inner: Box<dyn Communicator>,
    /// The rank's records (None when not tracing).
    pub rec: Option<Recorder>,
    faults: RankFaults,
    /// Start of the compute segment in progress, and the thread's clocks then.
    segment: Option<(Instant, Option<ThreadTimes>)>,
    clock: ThreadClock,
    /// `--scan`: the online detector (needs `rec`).
    online: Option<online::Online>,
    /// While recording, the rank's turns on the host's cores.
    placement: Option<crate::threads::Crossover>,
    /// Whether the events are written at the end (`--trace`); else each step's are dropped
    /// once `--scan` has summarised them.
    keep_events: bool,
}

impl ScanComm {
    /// Wrap `inner`; records into `rec` when given, applies `faults`.
    pub fn new(
        inner: Box<dyn Communicator>,
        rec: Option<Recorder>,
        faults: RankFaults,
    ) -> ScanComm {
        ScanComm {
            inner,
            rec,
            faults,
            segment: None,
            clock: ThreadClock::default(),
            online: None,
            placement: None,
            keep_events: true,
        }
    }

    /// Rotate the rank over the host's cores, one step on each in turn (see
    /// [`crate::threads::Crossover`]), from the next [`ScanComm::begin_step`].
    pub fn place(&mut self, placement: Option<crate::threads::Crossover>) {
        self.placement = placement;
    }

    /// Steps over which the rank visits each of its cores once (1 when not rotated).
    pub fn rotation(&self) -> u64 {
        self.placement.as_ref().map_or(1, |p| p.period() as u64)
    }

    /// Where the rank ran each step, when rotated (for its file's header).
    pub fn placement(&self) -> Option<Placement> {
        self.placement.as_ref().map(|p| Placement {
            host: crate::threads::host_name(),
            turns: p.turns().clone(),
        })
    }

    /// A step begins: records count its segments from 0, and a rotated rank moves to the
    /// step's core.
    pub fn begin_step(&mut self, step: u64) {
        if let Some(r) = &mut self.rec {
            r.begin_step(step);
        }
        if let Some(p) = &self.placement {
            p.enter_step(step);
        }
    }

    /// Turn on online detection (`--scan`; the recorder must be on): every rank summarises
    /// each step ([`ScanComm::end_step`]), rank 0 judges. `keep_events` false (no `--trace`)
    /// drops each step's events once summarised.
    pub fn watch(&mut self, online: online::Online, keep_events: bool) {
        self.online = Some(online);
        self.keep_events = keep_events;
    }

    /// A step is done: with `--scan`, exchange this rank's summary of it (one fixed-size
    /// all-reduce on the world, not recorded) and, on rank 0, run the detector; returns the
    /// warning lines of the findings new at this step (empty on other ranks).
    pub fn end_step(&mut self, step: u64) -> Result<Vec<String>, RuntimeError> {
        let (Some(online), Some(rec)) = (&mut self.online, &mut self.rec) else {
            return Ok(Vec::new());
        };
        let warnings = online.end_step(step, rec, self.inner.as_mut())?;
        if !self.keep_events {
            rec.clear_events();
        }
        Ok(warnings)
    }

    /// Clock sync for `megac scan`'s alignment, called by every rank at the same point (phase
    /// 0 before the first step, phase 1 after the last; a no-op when not recording): rank 0
    /// plays [`SYNC_ROUNDS`] ping-pongs with each other rank in turn, each side recording
    /// every round as a [`Kind::Sync`] event (rank 0: ping sent to pong received; the peer:
    /// ping received to pong sent). The round with the shortest turnaround bounds the
    /// offset most tightly (`analyze::align`). Not recorded as transfers, never injected.
    pub fn sync_clocks(&mut self, phase: u32) -> Result<(), RuntimeError> {
        if self.rec.is_none() {
            return Ok(());
        }
        if let Some(p) = &self.placement {
            p.release();
        }
        let (me, n) = (self.inner.rank(), self.inner.size());
        let mut buf = [0f32; 1];
        for peer in 1..n {
            if me != 0 && me != peer {
                continue;
            }
            for round in 0..SYNC_ROUNDS {
                let (t0, t1, other) = if me == 0 {
                    let t0 = Instant::now();
                    self.inner.send_tagged(peer, SYNC_TAG, &buf)?;
                    self.inner.recv_tagged(peer, SYNC_TAG, &mut buf)?;
                    (t0, Instant::now(), peer)
                } else {
                    self.inner.recv_tagged(0, SYNC_TAG, &mut buf)?;
                    let t0 = Instant::now();
                    self.inner.send_tagged(0, SYNC_TAG, &buf)?;
                    (t0, t0, 0)
                };
                if let Some(r) = &mut self.rec {
                    r.push(Kind::Sync, t0, t1, other as u32, phase, round, 0);
                }
            }
        }
        Ok(())
    }

    /// A program starts running kernels.
    pub fn begin_segment(&mut self) {
        let times = if self.rec.is_some() || self.faults.slows() {
            self.clock.now()
        } else {
            None
        };
        self.segment = Some((Instant::now(), times));
    }

    /// The kernels since [`ScanComm::begin_segment`] are done: slow them as injected, record
    /// them.
    ///
    /// The segment's *busy* time is what the rank's device spent on it. With one thread per
    /// rank (the rank's program and kernels on one thread, `crate::threads`) it is the
    /// thread's time on a CPU: waiting for a core held by another rank, or a VM's vCPU being
    /// taken by its host, does not count. With more threads it is the wall time less the
    /// thread's wait for a CPU. Without schedstat it is the wall time. An injected slowdown
    /// F holds the rank F − 1 times the busy time more, as a device F times slower would,
    /// and that time is busy too. The record keeps the wall time and, as `cpu_wait`, the
    /// rest: [`Event::duration`] is the busy time.
    pub fn end_segment(&mut self) {
        let Some((t0, start)) = self.segment.take() else {
            return;
        };
        let mut t1 = Instant::now();
        let end = start.and_then(|_| self.clock.now());
        let wall = (t1 - t0).as_nanos() as u64;
        let mut busy = self.clock.busy(start, end, wall);
        if self.faults.slows() {
            let f = self.faults.compute_factor();
            if f > 1.0 {
                let added = Duration::from_nanos(busy).mul_f64(f - 1.0);
                wait_until(t1 + added);
                t1 = Instant::now();
                busy += added.as_nanos() as u64;
            }
        }
        if let Some(r) = &mut self.rec {
            let i = r.segment;
            r.segment += 1;
            let wall = (t1 - t0).as_nanos() as u64;
            r.push_compute(t0, t1, i, wall.saturating_sub(busy));
        }
    }

    /// Record an event of the session's (no-op when not tracing).
    pub fn record(&mut self, kind: Kind, t0: Instant, a: u32, b: u32) {
        if let Some(r) = &mut self.rec {
            r.push(kind, t0, Instant::now(), a, b, 0, 0);
        }
    }

    fn collective<T>(
        &mut self,
        code: u32,
        group: &[usize],
        bytes: usize,
        op: impl FnOnce(&mut dyn Communicator) -> Result<T, RuntimeError>,
    ) -> Result<T, RuntimeError> {
        let running = self.segment.is_some();
        self.end_segment();
        let t0 = Instant::now();
        let out = op(self.inner.as_mut());
        if let Some(r) = &mut self.rec {
            let (g, seq) = r.call(group);
            r.push(
                Kind::Collective,
                t0,
                Instant::now(),
                g,
                code,
                seq,
                bytes as u64,
            );
        }
        if running {
            self.begin_segment();
        }
        out
    }

    fn transfer(
        &mut self,
        send: bool,
        peer: usize,
        tag: u64,
        bytes: usize,
        op: impl FnOnce(&mut dyn Communicator) -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        let running = self.segment.is_some();
        self.end_segment();
        let start = self.rec.as_ref().and_then(|_| self.clock.now());
        let t0 = Instant::now();
        let out = op(self.inner.as_mut());
        let f = self.faults.link_factor(peer);
        if f > 1.0 {
            let now = Instant::now();
            let base = if send {
                wire(bytes as u64).max(now - t0)
            } else {
                wire(bytes as u64)
            };
            wait_until(now + base.mul_f64(f - 1.0));
        }
        let t1 = Instant::now();
        // The time the thread waited for a CPU (a receiver it woke on its core ran first) is
        // not the link's.
        let waited = match (start, self.clock.now().filter(|_| start.is_some())) {
            (Some(a), Some(b)) => b.run_delay.saturating_sub(a.run_delay),
            _ => 0,
        };
        if let Some(r) = &mut self.rec {
            let kind = if send { Kind::Send } else { Kind::Recv };
            r.push_transfer(kind, t0, t1, peer as u32, tag, bytes as u64, waited);
        }
        if running {
            self.begin_segment();
        }
        out
    }
}

/// The tag of [`ScanComm::sync_clocks`]' messages (no plan transfer uses it).
pub const SYNC_TAG: u64 = u64::MAX - 1;

/// Ping-pong rounds per rank and phase of [`ScanComm::sync_clocks`].
pub const SYNC_ROUNDS: u64 = 16;

/// The tag of untagged sends and receives in rank files.
pub const UNTAGGED: u64 = u64::MAX;

impl Communicator for ScanComm {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn all_reduce_sum(&mut self, group: &[usize], data: &mut [f32]) -> Result<(), RuntimeError> {
        let n = data.len() * 4;
        self.collective(0, group, n, |c| c.all_reduce_sum(group, data))
    }

    fn all_reduce_max(&mut self, group: &[usize], data: &mut [f32]) -> Result<(), RuntimeError> {
        let n = data.len() * 4;
        self.collective(1, group, n, |c| c.all_reduce_max(group, data))
    }

    fn all_reduce_sum_f64(
        &mut self,
        group: &[usize],
        data: &mut [f64],
    ) -> Result<(), RuntimeError> {
        let n = data.len() * 8;
        self.collective(2, group, n, |c| c.all_reduce_sum_f64(group, data))
    }

    fn all_gather(
        &mut self,
        group: &[usize],
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), RuntimeError> {
        let n = send.len() * 4;
        self.collective(3, group, n, |c| c.all_gather(group, send, recv))
    }

    fn reduce_scatter_sum(
        &mut self,
        group: &[usize],
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), RuntimeError> {
        let n = send.len() * 4;
        self.collective(4, group, n, |c| c.reduce_scatter_sum(group, send, recv))
    }

    fn all_to_all(
        &mut self,
        group: &[usize],
        send: &[f32],
        send_offsets: &[usize],
        recv: &mut [f32],
        recv_offsets: &[usize],
    ) -> Result<(), RuntimeError> {
        let n = send.len() * 4;
        self.collective(5, group, n, |c| {
            c.all_to_all(group, send, send_offsets, recv, recv_offsets)
        })
    }

    fn send(&mut self, to: usize, data: &[f32]) -> Result<(), RuntimeError> {
        self.transfer(true, to, UNTAGGED, data.len() * 4, |c| c.send(to, data))
    }

    fn recv(&mut self, from: usize, data: &mut [f32]) -> Result<(), RuntimeError> {
        let n = data.len() * 4;
        self.transfer(false, from, UNTAGGED, n, |c| c.recv(from, data))
    }

    fn send_tagged(&mut self, to: usize, tag: u64, data: &[f32]) -> Result<(), RuntimeError> {
        self.transfer(true, to, tag, data.len() * 4, |c| {
            c.send_tagged(to, tag, data)
        })
    }

    fn recv_tagged(&mut self, from: usize, tag: u64, data: &mut [f32]) -> Result<(), RuntimeError> {
        let n = data.len() * 4;
        self.transfer(false, from, tag, n, |c| c.recv_tagged(from, tag, data))
    }

    fn probe_tagged(&mut self, wanted: &[(usize, u64)]) -> Result<Vec<bool>, RuntimeError> {
        self.inner.probe_tagged(wanted)
    }

    fn wait_for_mail(&mut self, timeout: std::time::Duration) -> Result<(), RuntimeError> {
        self.inner.wait_for_mail(timeout)
    }

    fn progress(&mut self) {
        self.inner.progress();
    }

    fn scan(&mut self) -> Option<&mut ScanComm> {
        Some(self)
    }
}

/// Room for the events of `steps` steps of `plan`'s `role`: every instruction of its programs
/// may end a compute segment and make one communication, once per micro-batch.
pub fn capacity(plan: &megac_ir::plan::Plan, role: usize, steps: u64) -> usize {
    let r = &plan.roles[role];
    let mut per_mb = r.microbatch.len();
    let mut actions = 0;
    if let Some(p) = &r.pipeline {
        per_mb += p
            .chunks
            .iter()
            .map(|c| c.forward.len() + c.backward.len() + c.weight.len())
            .sum::<usize>();
        actions = p.actions.len();
    }
    let m = plan.batch.microbatches as usize;
    let per_step = 2 * (per_mb * m + r.optimizer.len()) + 3 * actions + 4 * m + 64;
    (per_step * steps as usize + 4096).min(1 << 24)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hot path: two clock readings and one record. Prints ns per event (`bench/scan.sh`
    /// turns it into the overhead bound); asserts a loose 2 µs so a loaded machine passes.
    #[test]
    fn recording_an_event_is_cheap_and_never_allocates() {
        let n = 200_000;
        let mut r = Recorder::new(n, 0.0, 0.0);
        let cap = r.events.capacity();
        let t = Instant::now();
        for i in 0..n {
            let t0 = Instant::now();
            r.push(Kind::Compute, t0, Instant::now(), i as u32, 0, 0, 0);
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        println!("recording cost: {ns:.1} ns per event");
        assert_eq!(r.events.capacity(), cap, "the buffer never grows");
        r.push(Kind::Compute, t, t, 0, 0, 0, 0);
        assert_eq!(
            (r.events.len(), r.dropped),
            (n, 1),
            "a full buffer drops and counts"
        );
        assert!(ns < 2_000.0, "{ns} ns per event");
        // A segment or transfer boundary also reads the thread's clocks (the thread CPU
        // clock and schedstat's run delay): printed for bench/scan.sh, loosely bounded.
        let mut clock = ThreadClock::default();
        let reads = 20_000;
        let t = Instant::now();
        let mut seen = 0u64;
        for _ in 0..reads {
            seen = seen.wrapping_add(clock.now().map_or(0, |c| c.on_cpu));
        }
        let per_read = t.elapsed().as_nanos() as f64 / reads as f64;
        println!("thread clock reading: {per_read:.1} ns ({seen} summed)");
        assert!(per_read < 50_000.0, "{per_read} ns per reading");
    }

    /// A segment's duration on a one-thread rank is its busy time: CPU spent counts, a
    /// sleep does not (on a CPU rank the kernels never sleep, so a sleep is a wait that is not
    /// the rank's work); an injected 2x slowdown doubles it. Linux only (schedstat and the
    /// thread CPU clock).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_one_thread_rank_times_its_segments_by_busy_time() {
        fn spin(d: Duration) {
            let t = Instant::now();
            let mut x = 0u64;
            while t.elapsed() < d {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        }
        let durations = crate::threads::on_own_pool(0, 1, || {
            let faults = RankFaults::of(
                &[Inject::SlowRank {
                    rank: 1,
                    factor: 2.0,
                }],
                1,
            );
            let mut plain = ScanComm::new(
                Box::new(crate::comm::SingleRank),
                Some(Recorder::new(8, 0.0, 0.0)),
                RankFaults::default(),
            );
            let mut slow = ScanComm::new(
                Box::new(crate::comm::SingleRank),
                Some(Recorder::new(8, 0.0, 0.0)),
                faults,
            );
            plain.begin_segment();
            spin(Duration::from_millis(30));
            plain.end_segment();
            plain.begin_segment();
            std::thread::sleep(Duration::from_millis(30));
            plain.end_segment();
            slow.begin_segment();
            spin(Duration::from_millis(30));
            slow.end_segment();
            let d = |c: &ScanComm| -> Vec<(f64, f64)> {
                c.rec
                    .as_ref()
                    .unwrap()
                    .events()
                    .iter()
                    .map(|e| (e.duration() / 1e6, (e.t1 - e.t0) as f64 / 1e6))
                    .collect()
            };
            (d(&plain), d(&slow))
        });
        let ([spun, slept], [slowed]) = (&durations.0[..], &durations.1[..]) else {
            panic!("{durations:?}");
        };
        // Busy time: the CPU the spin got (all of it on a quiet core; a loaded one takes
        // some away); a sleep is next to none.
        assert!(spun.0 > 5.0 && spun.0 <= spun.1 + 0.01, "{durations:?}");
        assert!(slept.0 < 3.0 && slept.1 >= 29.0, "{durations:?}");
        // The injected slowdown holds the rank as long again as its busy time after the
        // 30 ms spin (wall = 30 ms + busy), and that counts as busy: duration = 2 × busy.
        let added = slowed.1 - 30.0;
        assert!(slowed.0 > 10.0, "{durations:?}");
        assert!((slowed.0 / 2.0 - added).abs() < 5.0, "{durations:?}");
    }

    #[test]
    fn the_recorded_clock_is_skewed_as_injected() {
        let r = Recorder::new(1, 50e6, 200e-6);
        let plain = Recorder::new(1, 0.0, 0.0);
        let t = Instant::now();
        let (a, b) = (r.stamp(t), plain.stamp(t));
        let want = b as f64 * (1.0 + 200e-6) + 50e6;
        assert!((a as f64 - want).abs() < 2.0, "{a} vs {want}");
    }
}
