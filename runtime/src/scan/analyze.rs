//! `megac scan`: read a trace directory's rank files, align their clocks, merge them into one
//! Chrome/Perfetto timeline, and find slow ranks and slow links.
//!
//! **Alignment.** A traced run plays [`SYNC_ROUNDS`](super::SYNC_ROUNDS) ping-pongs between
//! rank 0 and every other rank before its first step and after its last; per end, the round
//! with the shortest turnaround gives the rank's offset (within half that turnaround), and the
//! two ends its drift ([`sync_fit`]). Ranks without ping-pongs (older traces) are fitted to
//! the causal bounds of their collectives and messages ([`align`], [`fit_bounds`]).
//!
//! **Slow rank.** Durations are busy times ([`Event::duration`]). When the ranks took turns
//! on the cores (the rank files' `rotation` P > 1, `crate::threads::Crossover`), each rank's
//! compute over every block of P judged steps is divided by its peers' (the same role);
//! a rank is named when the interquartile mean over at least [`MIN_BLOCKS`] blocks reaches
//! [`MIN_BLOCK_SLOWDOWN`], it is not plainly waiting for others ([`WAITS_MORE`]), and (short
//! of [`GROSS`]) it was slower than the peers that shared its core step by step
//! ([`MIN_MATE_SLOWDOWN`], from the files' `placement`).
//! Otherwise, per compute segment (the same program position on the ranks that run the
//! same role program, in every step but the first, warm-up one), a rank's log-duration is
//! compared with the median of its peers'; a slow rank is slower in nearly every segment,
//! noise in about half. A rank is named when the one-sided sign test over its segments
//! reaches [`FALSE_ALARM`] (Bonferroni over the ranks), its slowdown (the score: per step its
//! compute against its peers' median per segment, the median over the steps) is at least
//! [`MIN_SLOWDOWN`], and the collective-wait inversion agrees: it waits the least
//! (arrives last) in at least [`LATE`]× the share of its collectives an even split would
//! give, or its mean wait is at most [`WAITS_LESS`] of its peers' median
//! ([`detect_slow_ranks`]). **Slow link.** Sends never wait for their
//! receiver, so a send's duration is the link's: per pair of ranks and message size, the
//! lower quartile of its send times (a slow link delays every send, a preempted sender only
//! some) is compared with the median of the other pairs' that send messages of that size;
//! a pair scoring at least [`SLOW_LINK`], between two ranks whose compute is normal (neither
//! a slow rank), is a slow link.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::{Event, Kind, Placement, RankHeader, COLLECTIVES, FORMAT};

/// The chance, per run and over all its ranks together, that the sign test names a healthy
/// rank whose segments are slower or faster than its peers' at random (each rank is tested
/// at this over the number of ranks).
///
/// 5·10⁻³: half the issue's 1% false-alarm goal, the rest left for correlated noise (time
/// slices spanning consecutive segments), which the test assumes away.
pub const FALSE_ALARM: f64 = 5e-3;
/// A rank whose median segment is less than this much slower than its peers' is not named,
/// however consistent: small real differences (a slower core) are not faults.
pub const MIN_SLOWDOWN: f64 = 1.05;
/// Rotated ranks (a trace's `rotation` above 1) are judged over blocks of that many steps,
/// each rank having run one step of a block on each core; a rank is named from this many
/// complete blocks on.
pub const MIN_BLOCKS: usize = 3;
/// A rotated rank below [`GROSS`] is named only when, in the steps a peer ran on its core
/// beside it, its compute was at least this much slower than that peer's
/// (`core_mate_ratio`): the cores' speeds change from step to step, so over blocks of two
/// steps a healthy pair sharing a core reads 1.06–1.09 together now and then, each of the
/// two within a few percent of the other. Measured on llama-tiny dp4 (17 steps,
/// `jitter:0.05`, 200 runs each, 2026-12-07): healthy ranks read at most 1.051 at the 99th
/// percentile, 1.1× ranks named by their blocks at least 1.03 in 191 of 192.
pub const MIN_MATE_SLOWDOWN: f64 = 1.03;
/// The least slowdown (interquartile mean over its blocks) a rotated rank is named at.
/// Calibrated on llama-tiny traces of this project's 2-core machines (`bench/scan_levels.py`:
/// 17 steps, 100 healthy and 100 1.1x runs each of dp4 and cp2 dp2): at 1.05, 2–3 healthy
/// runs in 100 named a rank; at 1.06, none, and 91–100 of the 1.1x ranks were named.
pub const MIN_BLOCK_SLOWDOWN: f64 = 1.06;
/// A rank at least this much slower than its peers (the same slowdown) is named without the
/// sign test, when the inversion agrees at [`GROSS_LATE`]: a gross straggler whose few
/// segments cannot reach the test's level (dp4 llama-tiny over 4 judged steps: 16 segments,
/// of which the short ones, where an injected slowdown was measured to show little, can
/// come out either way).
pub const GROSS: f64 = 1.3;
/// The late share (against an even split) a [`GROSS`] rank needs; 1.25 rather than more so
/// that two slow ranks sharing two-member groups, each last at about 70% of them, are both
/// named.
pub const GROSS_LATE: f64 = 1.25;
/// A slow-rank candidate is named when it arrived last at least this many times as often as
/// an even split of last arrivals gives: the inversion corroborates the sign test (a rank
/// that arrives last less often than chance is not holding the others up), it does not
/// have to be strong on its own (a 1.1× rank among noisy peers is last at only some of its
/// collectives).
pub const LATE: f64 = 1.0;
/// Or it is named when its mean collective wait is at most this fraction of its peers'
/// median.
pub const WAITS_LESS: f64 = 0.5;
/// A rotated rank is not named when it arrived last less often than an even split and its
/// mean collective wait is at least this multiple of its peers' median (it waits for them).
pub const WAITS_MORE: f64 = 2.0;
/// A pair scoring at least this transfer-time ratio against the other pairs is a slow link.
/// 2 rather than 3: on llama-tiny pp2 × dp2 (17 steps, `jitter:0.05`, 200 runs a cell,
/// 2026-12-07) an injected 2× link scored 3.48 at the 5th percentile alone but 2.85 beside
/// a 1.5× slow rank, where 3 missed the link in 10.5% of runs; no healthy or slow-rank run's
/// link reached 2 (at 1.5, one of 200 1.2× slow-rank runs did).
pub const SLOW_LINK: f64 = 2.0;

/// Why a trace directory cannot be scanned: the file (or folder) and what is wrong.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ScanError {
    /// The rank file or trace directory.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

/// A rank file's `placement` (`null`, or absent in older files: not rotated): `{"host":
/// name, "slot": k, "cores": [c, ...]}`, one core per step of the `rotation`.
fn parse_placement(v: &serde_json::Value, rotation: u64) -> Result<Option<Placement>, String> {
    if v.is_null() {
        return Ok(None);
    }
    let bad = || {
        format!(
            "\"placement\" must be null or {{\"host\": name, \"slot\": k, \"cores\": [one core per \
             step of the rotation ({rotation})]}}, not {v}"
        )
    };
    let host = v["host"].as_str().ok_or_else(bad)?.to_string();
    let slot = v["slot"].as_u64().ok_or_else(bad)? as usize;
    let cores = v["cores"]
        .as_array()
        .ok_or_else(bad)?
        .iter()
        .map(|c| c.as_u64().map(|c| c as usize))
        .collect::<Option<Vec<usize>>>()
        .filter(|c| c.len() as u64 == rotation)
        .ok_or_else(bad)?;
    Ok(Some(Placement {
        host,
        turns: crate::threads::CoreTurns { slot, cores },
    }))
}

/// One rank's file, parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct RankTrace {
    /// Who the rank is.
    pub header: RankHeader,
    /// Events the buffer had no room for.
    pub dropped: u64,
    /// The groups its collectives ran on (an event's `a`).
    pub groups: Vec<Vec<usize>>,
    /// Its events, as recorded.
    pub events: Vec<Event>,
}

impl RankTrace {
    /// "rank 5 (tp1 dp0 pp1)": tp, dp and pp always, other axes when larger than 1.
    pub fn label(&self) -> String {
        label(&self.header)
    }
}

/// "rank 5 (tp1 dp0 pp1)": tp, dp and pp always, other axes when larger than 1.
pub fn label(header: &RankHeader) -> String {
    let coords: Vec<String> = header
        .coords
        .iter()
        .filter(|(a, _, n)| *n > 1 || matches!(a.as_str(), "tp" | "dp" | "pp"))
        .map(|(a, c, _)| format!("{a}{c}"))
        .collect();
    format!("rank {} ({})", header.rank, coords.join(" "))
}

/// The largest rank file `read_dir` reads (1 GiB).
const MAX_RANK_FILE: u64 = 1 << 30;

/// Read every `rank-N.json` of `dir` (ranks 0..world, each once).
pub fn read_dir(dir: &Path) -> Result<Vec<RankTrace>, ScanError> {
    let dir_err = |message: String| ScanError {
        path: dir.display().to_string(),
        message,
    };
    let entries =
        std::fs::read_dir(dir).map_err(|e| dir_err(format!("cannot read the folder: {e}")))?;
    let mut files: BTreeMap<usize, PathBuf> = BTreeMap::new();
    for e in entries {
        let e = e.map_err(|e| dir_err(format!("cannot read the folder: {e}")))?;
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(n) = name
            .strip_prefix("rank-")
            .and_then(|s| s.strip_suffix(".json"))
            .and_then(|s| s.parse::<usize>().ok())
        {
            files.insert(n, e.path());
        }
    }
    if files.is_empty() {
        return Err(dir_err(
            "no rank-N.json files (write them with `megac train|run ... --trace DIR`)".into(),
        ));
    }
    let mut ranks = Vec::new();
    for (n, path) in &files {
        ranks.push(read_rank(path, *n)?);
    }
    let world = ranks[0].header.world;
    for r in &ranks {
        if r.header.world != world {
            return Err(ScanError {
                path: files[&r.header.rank].display().to_string(),
                message: format!(
                    "a world of {} ranks, but rank-{}.json has {world}",
                    r.header.world, ranks[0].header.rank
                ),
            });
        }
    }
    if let Some(missing) = (0..world).find(|r| !files.contains_key(r)) {
        return Err(dir_err(format!(
            "the run had {world} ranks but rank-{missing}.json is missing"
        )));
    }
    if let Some(&extra) = files.keys().find(|&&r| r >= world) {
        return Err(ScanError {
            path: files[&extra].display().to_string(),
            message: format!("rank {extra} is outside the run's {world} ranks"),
        });
    }
    Ok(ranks)
}

/// Parse one rank file; `n` is the rank its name says.
pub fn read_rank(path: &Path, n: usize) -> Result<RankTrace, ScanError> {
    let err = |message: String| ScanError {
        path: path.display().to_string(),
        message,
    };
    let text = megac_ir::file::read_text(path, MAX_RANK_FILE).map_err(|e| err(e.to_string()))?;
    parse_rank(&text, n).map_err(err)
}

/// Parse the text of a rank file of rank `n`.
pub fn parse_rank(text: &str, n: usize) -> Result<RankTrace, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not a megac rank file: {e}"))?;
    if v["format"] != FORMAT {
        return Err(format!(
            "not a megac rank file (its \"format\" is {}, expected \"{FORMAT}\")",
            v["format"]
        ));
    }
    let uint = |key: &str| {
        v[key]
            .as_u64()
            .ok_or_else(|| format!("\"{key}\" must be a non-negative integer"))
    };
    let (rank, world, role, steps, dropped) = (
        uint("rank")? as usize,
        uint("world")? as usize,
        uint("role")? as usize,
        uint("steps")?,
        uint("dropped")?,
    );
    if rank != n {
        return Err(format!(
            "the file is named for rank {n} but holds rank {rank}"
        ));
    }
    if world == 0 || rank >= world {
        return Err(format!("rank {rank} is outside its world of {world} ranks"));
    }
    let coords = v["coords"]
        .as_array()
        .ok_or("\"coords\" must be a list")?
        .iter()
        .map(|c| match (c[0].as_str(), c[1].as_u64(), c[2].as_u64()) {
            (Some(a), Some(i), Some(s)) if i < s => Ok((a.to_string(), i as usize, s as usize)),
            _ => Err(format!(
                "bad coordinate {c} (expected [\"axis\", index, size])"
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let groups = v["groups"]
        .as_array()
        .ok_or("\"groups\" must be a list")?
        .iter()
        .map(|g| {
            let members: Option<Vec<usize>> = g
                .as_array()
                .map(|m| m.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
                .unwrap_or(None);
            match members {
                Some(m) if m.contains(&rank) && m.iter().all(|&x| x < world) => Ok(m),
                _ => Err(format!(
                    "bad group {g} (a list of ranks below {world} holding rank {rank})"
                )),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let list = v["events"].as_array().ok_or("\"events\" must be a list")?;
    let mut events = Vec::with_capacity(list.len());
    for (i, e) in list.iter().enumerate() {
        let bad = |why: &str| format!("events[{i}] {e}: {why}");
        let a = e
            .as_array()
            .filter(|a| a.len() == 8 || a.len() == 9)
            .ok_or_else(|| bad("expected [kind, t0, t1, step, a, b, seq, bytes, cpu_wait]"))?;
        let kind = a[0]
            .as_str()
            .and_then(Kind::from_name)
            .ok_or_else(|| bad("unknown kind"))?;
        let (t0, t1) = match (a[1].as_i64(), a[2].as_i64()) {
            (Some(t0), Some(t1)) if t1 >= t0 => (t0, t1),
            _ => return Err(bad("t0 and t1 must be integers with t0 <= t1")),
        };
        let num = |j: usize| {
            a[j].as_u64()
                .ok_or_else(|| bad("fields 3..9 must be non-negative integers"))
        };
        let ev = Event {
            kind,
            t0,
            t1,
            step: num(3)? as u32,
            a: num(4)? as u32,
            b: num(5)? as u32,
            seq: num(6)?,
            bytes: num(7)?,
            // Files written before the field was added have 8 fields: wall times only.
            cpu_wait: if a.len() == 9 { num(8)? } else { 0 },
        };
        match kind {
            Kind::Collective if ev.a as usize >= groups.len() => {
                return Err(bad(&format!("group {} of {}", ev.a, groups.len())))
            }
            Kind::Collective if ev.b as usize >= COLLECTIVES.len() => {
                return Err(bad("unknown collective"))
            }
            Kind::Send | Kind::Recv if ev.a as usize >= world || ev.a as usize == rank => {
                return Err(bad("the peer must be another rank of the world"))
            }
            _ => {}
        }
        events.push(ev);
    }
    // Files written before rotation was recorded: ranks were not rotated.
    let rotation = match &v["rotation"] {
        serde_json::Value::Null => 1,
        r => r
            .as_u64()
            .filter(|&p| p >= 1)
            .ok_or("\"rotation\" must be a positive integer")?,
    };
    let placement = parse_placement(&v["placement"], rotation)?;
    Ok(RankTrace {
        header: RankHeader {
            rank,
            world,
            role,
            coords,
            steps,
            rotation,
            placement,
        },
        dropped,
        groups,
        events,
    })
}

/// Each rank's clock against rank 0's: `recorded_r = (1 + drift[r])·t + offset_ns[r]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Clock {
    /// Offsets in ns.
    pub offset_ns: Vec<f64>,
    /// Drifts (fractions).
    pub drift: Vec<f64>,
    /// Per rank, the bounds its fit used (collectives and messages; 0 for rank 0, ranks
    /// aligned by ping-pong and unaligned ranks).
    pub anchors: Vec<usize>,
    /// Per rank aligned by ping-pong, the largest error its drift can have (a fraction, from
    /// the best rounds' turnarounds, [`SyncFit::drift_bound`]); `None` for other ranks.
    pub drift_bound: Vec<Option<f64>>,
    /// Per rank, how it was aligned: `reference` (rank 0), `ping-pong` ([`sync_fit`]),
    /// `bounds` (collectives and messages, [`fit_bounds`]) or `none`.
    pub method: Vec<&'static str>,
}

impl Clock {
    /// Rank `r`'s recorded time `x` on rank 0's clock.
    pub fn align(&self, r: usize, x: i64) -> f64 {
        (x as f64 - self.offset_ns[r]) / (1.0 + self.drift[r])
    }
}

/// Collective instances: (members, call number) -> per member (rank, enter, exit).
type Instances = BTreeMap<(Vec<usize>, u64), Vec<(usize, i64, i64)>>;

fn instances(ranks: &[RankTrace]) -> Instances {
    let mut map: Instances = BTreeMap::new();
    for r in ranks {
        for e in r.events.iter().filter(|e| e.kind == Kind::Collective) {
            let g = &r.groups[e.a as usize];
            if g.len() > 1 {
                map.entry((g.clone(), e.seq))
                    .or_default()
                    .push((r.header.rank, e.t0, e.t1));
            }
        }
    }
    map
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// One causal bound on a rank's clock against rank 0's at rank-0 time `t`:
/// `lo <= offset + drift·t <= hi` (either side may be infinite).
#[derive(Clone, Copy, Debug)]
struct Bound {
    t: f64,
    lo: f64,
    hi: f64,
}

/// The offset and drift that leave the widest margin inside every bound, less half the offset
/// change the drift makes over the bounds' span (the width of the feasible offsets is a
/// concave function of the drift; searched over ±2000 ppm); the offset is the middle of the feasible interval at that drift. None
/// without bounds on both sides.
fn fit_bounds(bounds: &[Bound]) -> Option<(f64, f64)> {
    if !bounds.iter().any(|b| b.lo.is_finite()) || !bounds.iter().any(|b| b.hi.is_finite()) {
        return None;
    }
    let tm = bounds.iter().map(|b| b.t).sum::<f64>() / bounds.len() as f64;
    let interval = |d: f64| {
        let lo = bounds
            .iter()
            .filter(|b| b.lo.is_finite())
            .map(|b| b.lo - d * (b.t - tm))
            .fold(f64::NEG_INFINITY, f64::max);
        let hi = bounds
            .iter()
            .filter(|b| b.hi.is_finite())
            .map(|b| b.hi - d * (b.t - tm))
            .fold(f64::INFINITY, f64::min);
        (lo, hi)
    };
    let width = |d: f64| {
        let (lo, hi) = interval(d);
        hi - lo
    };
    // The widest feasible band over drifts of ±2000 ppm in steps of 0.5 ppm, less half the
    // offset change the drift makes over the bounds' time span: few bounds leave the band
    // open along the drift, and a drift is kept only where the bounds call for it.
    let span = bounds.iter().map(|b| b.t).fold(f64::NEG_INFINITY, f64::max)
        - bounds.iter().map(|b| b.t).fold(f64::INFINITY, f64::min);
    let score = |d: f64| width(d) - 0.5 * d.abs() * span;
    let d = (-4000..=4000)
        .map(|i| f64::from(i) * 0.5e-6)
        .max_by(|&a, &b| {
            score(a)
                .total_cmp(&score(b))
                .then(b.abs().total_cmp(&a.abs()))
        })
        .unwrap_or(0.0);
    let (lo, hi) = interval(d);
    // offset + d·(t - tm) = mid  ->  offset at t = 0.
    Some((0.5 * (lo + hi) - d * tm, d))
}

/// A ping-pong alignment of one rank's clock ([`sync_fit`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SyncFit {
    /// The rank's offset (ns) at rank 0's time zero.
    pub offset_ns: f64,
    /// The rank's drift (a fraction).
    pub drift: f64,
    /// The largest error `drift` can have: half of each phase's best turnaround over the
    /// time between the phases (0 with one phase, whose drift is not measured but set to 0).
    pub drift_bound: f64,
}

/// Rank `r`'s clock against rank 0's from the ping-pongs of
/// [`super::ScanComm::sync_clocks`]: per phase, the round with the shortest turnaround (rank
/// 0's round trip less the peer's hold) gives one point, rank 0's midpoint against the
/// peer's, off by at most half that turnaround (the round trip's asymmetry). The two phases'
/// points (before the first step, after the last) give the offset and the drift; one phase
/// gives the offset only. None without ping-pongs.
pub fn sync_fit(ranks: &[RankTrace], r: usize) -> Option<SyncFit> {
    if r == 0 || r >= ranks.len() {
        return None;
    }
    let zero: BTreeMap<(u32, u64), (i64, i64)> = ranks[0]
        .events
        .iter()
        .filter(|e| e.kind == Kind::Sync && e.a as usize == r)
        .map(|e| ((e.b, e.seq), (e.t0, e.t1)))
        .collect();
    // Per phase: (turnaround, rank 0's midpoint, the peer's midpoint) of the best round.
    let mut best: BTreeMap<u32, (f64, f64, f64)> = BTreeMap::new();
    for e in ranks[r]
        .events
        .iter()
        .filter(|e| e.kind == Kind::Sync && e.a == 0)
    {
        let Some(&(a0, a1)) = zero.get(&(e.b, e.seq)) else {
            continue;
        };
        let turn = (a1 - a0) as f64 - (e.t1 - e.t0) as f64;
        let point = (
            turn,
            0.5 * (a0 as f64 + a1 as f64),
            0.5 * (e.t0 as f64 + e.t1 as f64),
        );
        let b = best.entry(e.b).or_insert(point);
        if turn < b.0 {
            *b = point;
        }
    }
    let points: Vec<(f64, f64, f64)> = best.values().map(|p| (p.1, p.2, p.0)).collect();
    let offset_only = |t: f64, x: f64| SyncFit {
        offset_ns: x - t,
        drift: 0.0,
        drift_bound: 0.0,
    };
    match points.as_slice() {
        [] => None,
        [(t, x, _)] => Some(offset_only(*t, *x)),
        [(t0, x0, turn0), .., (t1, x1, turn1)] if t1 - t0 > 0.0 => {
            let rate = (x1 - x0) / (t1 - t0);
            Some(SyncFit {
                offset_ns: x0 - rate * t0,
                drift: rate - 1.0,
                drift_bound: 0.5 * (turn0.max(0.0) + turn1.max(0.0)) / (t1 - t0),
            })
        }
        [(t, x, _), ..] => Some(offset_only(*t, *x)),
    }
}

/// Sends matched to receives: (from, to, send enter, recv exit), by (from, to, tag, order).
fn messages(ranks: &[RankTrace]) -> Vec<(usize, usize, i64, i64)> {
    let mut sends: BTreeMap<(usize, usize, u64), Vec<i64>> = BTreeMap::new();
    for r in ranks {
        for e in r.events.iter().filter(|e| e.kind == Kind::Send) {
            sends
                .entry((r.header.rank, e.a as usize, e.seq))
                .or_default()
                .push(e.t0);
        }
    }
    let mut out = Vec::new();
    for r in ranks {
        let mut seen: BTreeMap<(usize, u64), usize> = BTreeMap::new();
        for e in r.events.iter().filter(|e| e.kind == Kind::Recv) {
            let from = e.a as usize;
            let k = seen.entry((from, e.seq)).or_default();
            if let Some(&t) = sends
                .get(&(from, r.header.rank, e.seq))
                .and_then(|v| v.get(*k))
            {
                out.push((from, r.header.rank, t, e.t1));
            }
            *k += 1;
        }
    }
    out
}

/// Estimate every rank's offset and drift against rank 0 from causality: a collective
/// completes at one instant T after every member entered and before any left, and a message
/// is received after it was sent. Each collective a rank shares with aligned ranks bounds
/// its clock at T from both sides (`enter_r - T_hi <= offset + drift·T <= exit_r - T_lo`,
/// with T_lo the aligned members' latest enter and T_hi their earliest exit); each message
/// from one side. Ranks are aligned one at a time, the one with the most bounds first; its
/// fit is a line through them ([`fit_bounds`]). A rank with no bounds on one
/// side keeps offset 0 and drift 0.
pub fn align(ranks: &[RankTrace]) -> Clock {
    let n = ranks.len();
    let inst = instances(ranks);
    let msgs = messages(ranks);
    let mut clock = Clock {
        offset_ns: vec![0.0; n],
        drift: vec![0.0; n],
        drift_bound: vec![None; n],
        anchors: vec![0; n],
        method: vec!["none"; n],
    };
    let mut aligned = vec![false; n];
    if n > 0 {
        aligned[0] = true;
        clock.method[0] = "reference";
    }
    // Ranks that played ping-pong with rank 0 are aligned by it; the others by bounds.
    for (r, done) in aligned.iter_mut().enumerate().skip(1) {
        if let Some(fit) = sync_fit(ranks, r) {
            clock.offset_ns[r] = fit.offset_ns;
            clock.drift[r] = fit.drift;
            clock.drift_bound[r] = Some(fit.drift_bound);
            clock.method[r] = "ping-pong";
            *done = true;
        }
    }
    let bounds_of = |r: usize, aligned: &[bool], clock: &Clock| {
        let mut out = Vec::new();
        for members in inst.values() {
            let Some(&(_, xe, xx)) = members.iter().find(|m| m.0 == r) else {
                continue;
            };
            let others: Vec<(f64, f64)> = members
                .iter()
                .filter(|m| m.0 != r && aligned[m.0])
                .map(|m| (clock.align(m.0, m.1), clock.align(m.0, m.2)))
                .collect();
            if others.is_empty() {
                continue;
            }
            let t_lo = others.iter().map(|o| o.0).fold(f64::NEG_INFINITY, f64::max);
            let t_hi = others.iter().map(|o| o.1).fold(f64::INFINITY, f64::min);
            out.push(Bound {
                t: 0.5 * (t_lo + t_hi),
                lo: xe as f64 - t_hi,
                hi: xx as f64 - t_lo,
            });
        }
        for &(from, to, sent, got) in &msgs {
            if to == r && aligned[from] {
                // got_r >= sent (aligned): offset + drift·t <= got - sent.
                let t = clock.align(from, sent);
                out.push(Bound {
                    t,
                    lo: f64::NEG_INFINITY,
                    hi: got as f64 - t,
                });
            } else if from == r && aligned[to] {
                let t = clock.align(to, got);
                out.push(Bound {
                    t,
                    lo: sent as f64 - t,
                    hi: f64::INFINITY,
                });
            }
        }
        out
    };
    loop {
        let best = (0..n)
            .filter(|&r| !aligned[r])
            .map(|r| (r, bounds_of(r, &aligned, &clock)))
            .filter(|(_, b)| {
                b.iter().any(|b| b.lo.is_finite()) && b.iter().any(|b| b.hi.is_finite())
            })
            .max_by_key(|(r, b)| (b.len(), std::cmp::Reverse(*r)));
        let Some((r, bounds)) = best else { break };
        if let Some((o, d)) = fit_bounds(&bounds) {
            clock.offset_ns[r] = o;
            clock.drift[r] = d;
            clock.method[r] = "bounds";
        }
        clock.anchors[r] = bounds.len();
        aligned[r] = true;
    }
    clock
}

/// A fault `megac scan` found.
#[derive(Clone, Debug, PartialEq)]
pub struct Finding {
    /// `slow-rank` or `slow-link`.
    pub kind: &'static str,
    /// The rank, or the link's two ranks.
    pub ranks: Vec<usize>,
    /// The compute slowdown against its peers (slow rank) or transfer-time ratio
    /// against other links (slow link).
    pub score: f64,
    /// The first step whose ratio reached the threshold ([`MIN_SLOWDOWN`] for a rank: its
    /// compute that step against its peers' median per segment).
    pub first_step: u64,
    /// Slow rank: the share of its collectives it arrived last at.
    pub late_share: Option<f64>,
}

/// What `megac scan` reports.
#[derive(Clone, Debug, PartialEq)]
pub struct Scan {
    /// Steps in the trace.
    pub steps: u64,
    /// The ranks' labels (`rank 5 (tp1 dp0 pp1)`).
    pub labels: Vec<String>,
    /// The faults found, slow ranks first, highest score first.
    pub findings: Vec<Finding>,
    /// The clock alignment.
    pub clock: Clock,
    /// Events dropped for lack of buffer space, per rank.
    pub dropped: Vec<u64>,
    /// Per rank, the evidence: its compute slowdown against its peers (None without
    /// peers) and the share of its collectives it arrived last at (None without collectives).
    pub per_rank: Vec<(Option<f64>, Option<f64>)>,
    /// The ranks MegatronApp's heuristic calls abnormal ([`megatronapp_baseline`]).
    pub baseline: Vec<usize>,
}

/// Align and detect.
pub fn scan(ranks: &[RankTrace]) -> Scan {
    let clock = align(ranks);
    let steps = ranks.iter().map(|r| r.header.steps).max().unwrap_or(0);
    let (mut findings, per_rank) = slow_ranks(ranks, steps);
    let slow: Vec<usize> = findings.iter().flat_map(|f| f.ranks.clone()).collect();
    findings.extend(slow_links(ranks, &slow));
    Scan {
        steps,
        labels: ranks.iter().map(RankTrace::label).collect(),
        findings,
        clock,
        dropped: ranks.iter().map(|r| r.dropped).collect(),
        per_rank,
        baseline: megatronapp_baseline(ranks, steps),
    }
}

/// MegatronApp's published heuristic (`scripts/aggregate.py`, `try_detect`), on megac's
/// events, as the baseline of `bench/scan.sh`. Stage 1: among the data-parallel ranks of
/// each (pp, tp) position, for every step after the first and every event index, the
/// shortest collective is flagged when under 0.9× the mean of the others (MegatronApp's
/// `loss`/`allreduce`) and the longest compute segment when over 1.1× (its `backward`); a
/// rank flagged more than 5 times is a suspect. Stage 2: a suspect is abnormal when, in more
/// than 40% of its collectives, it waited under 0.9× the mean of the other members
/// (MegatronApp uses the tp all-reduces; megac's collectives of every group stand in, so
/// dp-only layouts are not left without evidence).
pub fn megatronapp_baseline(ranks: &[RankTrace], steps: u64) -> Vec<usize> {
    let n = ranks.len();
    let coord = |r: usize, axis: &str| {
        ranks[r]
            .header
            .coords
            .iter()
            .find(|c| c.0 == axis)
            .map_or(0, |c| c.1)
    };
    // Per rank and step: durations of its collectives and compute segments, in order.
    let series = |r: usize, kind: Kind, step: u64| -> Vec<f64> {
        ranks[r]
            .events
            .iter()
            .filter(|e| e.kind == kind && u64::from(e.step) == step)
            .map(Event::duration)
            .collect()
    };
    let mut flags = vec![0usize; n];
    let mut positions: BTreeMap<(usize, usize, usize), Vec<usize>> = BTreeMap::new();
    for (r, t) in ranks.iter().enumerate() {
        positions
            .entry((t.header.role, coord(r, "pp"), coord(r, "tp")))
            .or_default()
            .push(r);
    }
    for group in positions.values().filter(|g| g.len() > 1) {
        for step in analysed(steps) {
            for (kind, shortest) in [(Kind::Collective, true), (Kind::Compute, false)] {
                let all: Vec<Vec<f64>> = group.iter().map(|&r| series(r, kind, step)).collect();
                let len = all.iter().map(Vec::len).min().unwrap_or(0);
                for i in 0..len {
                    let d: Vec<f64> = all.iter().map(|v| v[i]).collect();
                    let pick = (0..d.len())
                        .min_by(|&a, &b| {
                            if shortest {
                                d[a].total_cmp(&d[b])
                            } else {
                                d[b].total_cmp(&d[a])
                            }
                        })
                        .unwrap_or(0);
                    let others = (d.iter().sum::<f64>() - d[pick]) / (d.len() - 1) as f64;
                    let flagged = if shortest {
                        d[pick] < 0.9 * others
                    } else {
                        d[pick] > 1.1 * others
                    };
                    if flagged {
                        flags[group[pick]] += 1;
                    }
                }
            }
        }
    }
    let inst = instances(ranks);
    let mut out = Vec::new();
    for r in (0..n).filter(|&r| flags[r] > 5) {
        let (mut all, mut short) = (0usize, 0usize);
        for members in inst.values() {
            let Some(me) = members.iter().find(|m| m.0 == r) else {
                continue;
            };
            let others: Vec<f64> = members
                .iter()
                .filter(|m| m.0 != r)
                .map(|m| (m.2 - m.1) as f64)
                .collect();
            all += 1;
            if ((me.2 - me.1) as f64) < 0.9 * others.iter().sum::<f64>() / others.len() as f64 {
                short += 1;
            }
        }
        if all > 0 && short as f64 > 0.4 * all as f64 {
            out.push(r);
        }
    }
    out
}

/// Steps the detectors look at: all but the first (warm-up) when there are more.
fn analysed(steps: u64) -> std::ops::RangeInclusive<u64> {
    if steps > 1 {
        2..=steps
    } else {
        1..=steps
    }
}

/// Slow-rank findings, and per rank (compute slowdown against its peers, late share).
pub type SlowRanks = (Vec<Finding>, Vec<(Option<f64>, Option<f64>)>);

/// One rank's compute segments: (step, segment index in the step) → ns. Ranks of one role
/// run the same program, so the same key is the same program position on each of them.
pub type Segments = BTreeMap<(u64, u32), f64>;

/// A rank's collective-wait tally: the collectives it arrived last at (waited the least),
/// the collectives it took part in, and the number of last arrivals an even split would give
/// it (the sum of 1/members).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Late {
    /// Collectives it arrived last at.
    pub last: usize,
    /// Collectives it took part in.
    pub total: usize,
    /// The last arrivals an even split would give.
    pub expected: f64,
    /// Its waits in those collectives, summed (ns).
    pub wait: f64,
}

impl Late {
    /// Its mean wait per collective (NaN without collectives).
    pub fn mean_wait(&self) -> f64 {
        if self.total == 0 {
            f64::NAN
        } else {
            self.wait / self.total as f64
        }
    }
}

/// Add collective instances to `late` (indexed by rank): each instance is its members'
/// (rank, wait in ns); the member that waited the least arrived last. Instances of fewer than
/// two members are skipped.
pub fn tally_late<'a>(late: &mut [Late], instances: impl IntoIterator<Item = &'a [(usize, i64)]>) {
    for members in instances {
        if members.len() < 2 {
            continue;
        }
        let last = members.iter().min_by_key(|m| m.1).map(|m| m.0).unwrap_or(0);
        for m in members {
            late[m.0].total += 1;
            late[m.0].expected += 1.0 / members.len() as f64;
            late[m.0].wait += m.1 as f64;
            if m.0 == last {
                late[m.0].last += 1;
            }
        }
    }
}

fn slow_ranks(ranks: &[RankTrace], steps: u64) -> SlowRanks {
    let n = ranks.len();
    let segments: Vec<Segments> = ranks
        .iter()
        .map(|r| {
            r.events
                .iter()
                .filter(|e| e.kind == Kind::Compute)
                .map(|e| ((u64::from(e.step), e.a), e.duration()))
                .collect()
        })
        .collect();
    let mut late = vec![Late::default(); n];
    let waits: Vec<Vec<(usize, i64)>> = instances(ranks)
        .into_values()
        .map(|m| m.iter().map(|&(r, t0, t1)| (r, t1 - t0)).collect())
        .collect();
    tally_late(&mut late, waits.iter().map(Vec::as_slice));
    let roles: Vec<usize> = ranks.iter().map(|r| r.header.role).collect();
    let block = ranks.iter().map(|r| r.header.rotation).max().unwrap_or(1);
    let placements: Vec<Option<Placement>> =
        ranks.iter().map(|r| r.header.placement.clone()).collect();
    detect_slow_ranks(
        &roles,
        &segments,
        analysed(steps),
        &late,
        block,
        &placements,
    )
}

/// `P(X ≥ k)` for `X ~ Binomial(n, 1/2)`: the one-sided sign test's p-value of `k` positive
/// signs out of `n`.
pub fn sign_test(n: usize, k: usize) -> f64 {
    if k == 0 {
        return 1.0;
    }
    if k > n {
        return 0.0;
    }
    // ln C(n, i) − n ln 2, summed from the top in log space (n runs to thousands).
    let ln_half = n as f64 * std::f64::consts::LN_2;
    let mut ln_c = 0.0; // ln C(n, n)
    let mut total = 0.0;
    for i in (k..=n).rev() {
        total += (ln_c - ln_half).exp();
        // C(n, i-1) = C(n, i) · i / (n − i + 1)
        ln_c += (i as f64).ln() - ((n - i + 1) as f64).ln();
    }
    total.min(1.0)
}

/// The least slowdown a rank is named at: [`MIN_BLOCK_SLOWDOWN`] over blocks of rotated
/// steps, [`MIN_SLOWDOWN`] over steps of unrotated ranks.
fn naming_level(block: u64) -> f64 {
    if block > 1 {
        MIN_BLOCK_SLOWDOWN
    } else {
        MIN_SLOWDOWN
    }
}

/// One rank's evidence against its peers over the judged steps.
struct Evidence {
    /// Segments slower than the peers' median, and faster.
    slower: usize,
    faster: usize,
    /// Per block of `block` consecutive steps (a step when ranks were not rotated), its
    /// compute time divided by the sum of its peers' median per segment: the slowdown,
    /// weighted by duration within a block (near-empty segments, a few µs of timer noise
    /// where a wait's overshoot can read as 30×, do not set it). Over the complete blocks,
    /// their interquartile mean for rotated ranks, else the median (both robust to a block
    /// or step that noise spoilt).
    ratio: f64,
    /// The complete blocks the ratio is the median of.
    blocks: usize,
    /// The first step of the first block whose own ratio reached the naming level.
    first: Option<u64>,
}

fn evidence(
    r: usize,
    peers: &[usize],
    segments: &[Segments],
    range: &std::ops::RangeInclusive<u64>,
    block: u64,
) -> Option<Evidence> {
    // Per step: (own ns, peers' median ns) summed over its segments.
    let mut per_step: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    let (mut slower, mut faster) = (0usize, 0usize);
    let mut others = Vec::with_capacity(peers.len());
    for (&(s, k), &mine) in segments[r].range((*range.start(), 0)..=(*range.end(), u32::MAX)) {
        others.clear();
        others.extend(
            peers
                .iter()
                .filter_map(|&p| segments[p].get(&(s, k)))
                .map(|&d| d.max(1.0).ln()),
        );
        let m = median(&mut others);
        if m.is_nan() {
            continue;
        }
        let x = mine.max(1.0).ln() - m;
        slower += usize::from(x > 0.0);
        faster += usize::from(x < 0.0);
        let e = per_step.entry(s).or_default();
        e.0 += mine.max(1.0);
        e.1 += m.exp();
    }
    // Blocks of `block` consecutive steps from the first judged one; only complete ones
    // count (a rotated rank has then run on each core once).
    let block = block.max(1);
    let mut per_block: BTreeMap<u64, (f64, f64, u64)> = BTreeMap::new();
    for (&s, &(a, b)) in &per_step {
        let e = per_block
            .entry((s - range.start()) / block)
            .or_insert((0.0, 0.0, 0));
        e.0 += a;
        e.1 += b;
        e.2 += 1;
    }
    per_block.retain(|_, e| e.2 == block);
    if per_block.is_empty() {
        return None;
    }
    let least = naming_level(block);
    let first = per_block
        .iter()
        .find_map(|(&k, &(a, b, _))| (a >= least * b).then_some(range.start() + k * block));
    let mut ratios: Vec<f64> = per_block.values().map(|&(a, b, _)| a / b).collect();
    // Rotated ranks: the interquartile mean of the blocks' log-ratios (a vCPU's speed
    // changes within a block, so a block can still read ±40%; the outer quarters on each
    // side are left out, the middle half averaged). Steps of wall times: the median.
    let ratio = if block > 1 {
        interquartile_mean(&ratios)
    } else {
        median(&mut ratios)
    };
    Some(Evidence {
        slower,
        faster,
        ratio,
        blocks: ratios.len(),
        first,
    })
}

/// The slow-rank detector `megac scan` and `--scan` share. `roles[r]` is rank r's role,
/// `segments[r]` its compute segments, `late[r]` its collective-wait tally; the steps judged
/// are `range`.
///
/// `block` is the ranks' rotation over the cores (1: not rotated). Rotated ranks are
/// judged over blocks of `block` steps: per block, the rank's compute divided by the sum of
/// its peers' median per segment; the interquartile mean over the complete blocks (at least
/// [`MIN_BLOCKS`]) must reach [`MIN_BLOCK_SLOWDOWN`], and a rank plainly waiting for others
/// (last less often than an even split, mean wait at least [`WAITS_MORE`]× its peers') is
/// not named.
///
/// Unrotated ranks: per segment (the same program position on every rank of a role, in
/// every judged step) a rank's log-duration is compared with the median of its peers' (the
/// other ranks of its role). A slow rank is slower in nearly every segment, noise in about half: the one-sided
/// sign test over its segments ([`sign_test`]) must reach [`FALSE_ALARM`] divided by the
/// number of ranks (Bonferroni), and its slowdown (the `score`: per step its compute divided
/// by the sum of its peers' median per segment, the median over the steps) must be at least
/// [`MIN_SLOWDOWN`]; or, without the test, its slowdown is at least [`GROSS`] and, in its
/// collectives (it needs some), it arrived last at least [`GROSS_LATE`]× as often as an even
/// split gives. The collective-wait
/// inversion must not contradict either:
/// a rank with collectives is named only when it arrived last at least [`LATE`]× as often as
/// an even split gives, or its mean wait is at most [`WAITS_LESS`] of its peers' median.
/// Within a role the most significant rank is named first, then the rest tested again with
/// the named ranks left out of their peers where three healthy peers remain (or where
/// keeping them would leave a median of two), so a second slow rank is not judged against a
/// median the first one drags.
pub fn detect_slow_ranks(
    roles: &[usize],
    segments: &[Segments],
    range: std::ops::RangeInclusive<u64>,
    late: &[Late],
    block: u64,
    placements: &[Option<Placement>],
) -> SlowRanks {
    let n = roles.len();
    let alpha = FALSE_ALARM / n.max(1) as f64;
    let mut out = Vec::new();
    let mut per_rank: Vec<(Option<f64>, Option<f64>)> = late
        .iter()
        .map(|l| (None, (l.total > 0).then(|| l.last as f64 / l.total as f64)))
        .collect();
    let mut role_ids: Vec<usize> = roles.to_vec();
    role_ids.sort_unstable();
    role_ids.dedup();
    for role in role_ids {
        let members: Vec<usize> = (0..n).filter(|&r| roles[r] == role).collect();
        if members.len() < 2 {
            continue;
        }
        let mut named: Vec<usize> = Vec::new();
        loop {
            let mut best: Option<(usize, f64, Evidence)> = None;
            for &r in members.iter().filter(|r| !named.contains(r)) {
                let others: Vec<usize> = members.iter().copied().filter(|&p| p != r).collect();
                let healthy: Vec<usize> = others
                    .iter()
                    .copied()
                    .filter(|p| !named.contains(p))
                    .collect();
                // The healthy peers, if there are three (a median that one preempted segment
                // does not move); else all peers if they are three (a named rank among them
                // is outvoted); else the healthy ones (the median of two is their mean, which
                // a named rank would drag).
                let peers = if healthy.len() >= 3 || (others.len() < 3 && !healthy.is_empty()) {
                    healthy
                } else {
                    others.clone()
                };
                let Some(ev) = evidence(r, &peers, segments, &range, block) else {
                    continue;
                };
                if named.is_empty() {
                    per_rank[r].0 = Some(ev.ratio);
                }
                // Rotated ranks: the slowdown over blocks (each segment's sign follows the
                // core it ran on, not the rank). Else the sign test over segments. `p` orders
                // the candidates: the most significant (or slowest) first.
                let (p, significant) = if block > 1 {
                    (
                        1.0 / ev.ratio,
                        ev.blocks >= MIN_BLOCKS
                            && ev.ratio >= naming_level(block)
                            && (ev.ratio >= GROSS
                                || core_mate_ratio(r, &others, segments, &range, placements)
                                    .is_none_or(|m| m >= MIN_MATE_SLOWDOWN)),
                    )
                } else {
                    let p = sign_test(ev.slower + ev.faster, ev.slower);
                    (p, p <= alpha && ev.ratio >= naming_level(block))
                };
                // Rotated ranks' busy times need no corroboration, only no contradiction (in
                // a pipeline a slow last stage holds up its first stage, which then arrives
                // last at the data-parallel all-reduce: the late arriver is not always the
                // straggler). Else the inversion must agree.
                let agrees = if block > 1 {
                    !waits_for_others(r, &peers, late)
                } else {
                    inverted(r, &peers, late, LATE)
                };
                let candidate = (significant && agrees)
                    || (ev.ratio >= GROSS
                        && late[r].total > 0
                        && inverted(r, &peers, late, GROSS_LATE));
                if candidate && best.as_ref().is_none_or(|b| p < b.1) {
                    best = Some((r, p, ev));
                }
            }
            let Some((r, _, ev)) = best else {
                break;
            };
            named.push(r);
            out.push(Finding {
                kind: "slow-rank",
                ranks: vec![r],
                score: ev.ratio,
                first_step: ev.first.unwrap_or(*range.start()),
                late_share: per_rank[r].1,
            });
        }
    }
    out.sort_by(|a, b| b.score.total_cmp(&a.score));
    (out, per_rank)
}

/// Rank `r`'s compute against its core-mates': per judged step, its compute over the
/// segments the peers (`peers`) that ran on its core in that step also ran, divided by the
/// sum of their median per segment; the interquartile mean of the steps' ratios. A slow
/// rank is slower than the peer beside it; a core that ran slow for a while slowed both.
/// None when no step had such a peer (ranks alone on their cores, placements unknown).
fn core_mate_ratio(
    r: usize,
    peers: &[usize],
    segments: &[Segments],
    range: &std::ops::RangeInclusive<u64>,
    placements: &[Option<Placement>],
) -> Option<f64> {
    let mine = placements.get(r)?.as_ref()?;
    let mut ratios = Vec::new();
    let mut mates = Vec::with_capacity(peers.len());
    let mut values = Vec::with_capacity(peers.len());
    for s in range.clone() {
        mates.clear();
        mates.extend(peers.iter().copied().filter(|&p| {
            placements
                .get(p)
                .and_then(Option::as_ref)
                .is_some_and(|q| mine.shares_core(q, s))
        }));
        if mates.is_empty() {
            continue;
        }
        let (mut own, mut theirs) = (0.0, 0.0);
        for (&(_, k), &d) in segments[r].range((s, 0)..=(s, u32::MAX)) {
            values.clear();
            values.extend(mates.iter().filter_map(|&p| segments[p].get(&(s, k))));
            let m = median(&mut values);
            if m.is_nan() {
                continue;
            }
            own += d.max(1.0);
            theirs += m.max(1.0);
        }
        if theirs > 0.0 {
            ratios.push(own / theirs);
        }
    }
    if ratios.is_empty() {
        return None;
    }
    Some(interquartile_mean(&ratios))
}

/// The interquartile mean of positive ratios, taken of their logarithms: the outer quarter
/// on each side left out, the middle half's geometric mean. NaN when empty.
fn interquartile_mean(ratios: &[f64]) -> f64 {
    let mut logs: Vec<f64> = ratios.iter().map(|r| r.ln()).collect();
    logs.sort_by(f64::total_cmp);
    let k = logs.len() / 4;
    let middle = &logs[k..logs.len() - k];
    (middle.iter().sum::<f64>() / middle.len() as f64).exp()
}

/// The inversion's contradiction: a rank that arrived last less often than an even split
/// gives and waited on the mean at least [`WAITS_MORE`] as long as its peers' median is
/// waiting for others, not holding them up.
fn waits_for_others(r: usize, peers: &[usize], late: &[Late]) -> bool {
    let l = late[r];
    if l.total == 0 || l.last as f64 >= l.expected {
        return false;
    }
    let m = peers_median_wait(peers, late);
    m > 0.0 && l.mean_wait() >= WAITS_MORE * m
}

/// The median of `peers`' mean collective waits (NaN when none has collectives).
fn peers_median_wait(peers: &[usize], late: &[Late]) -> f64 {
    let mut peer_waits: Vec<f64> = peers
        .iter()
        .map(|&p| late[p].mean_wait())
        .filter(|w| w.is_finite())
        .collect();
    median(&mut peer_waits)
}

/// The collective-wait inversion: a straggler arrives last, or (several stragglers sharing
/// groups take turns at arriving last) waits at most [`WAITS_LESS`] as long as its peers on
/// the median. A rank without collectives is not contradicted.
fn inverted(r: usize, peers: &[usize], late: &[Late], share: f64) -> bool {
    let Late {
        last,
        total,
        expected,
        ..
    } = late[r];
    if total == 0 {
        return true;
    }
    let m = peers_median_wait(peers, late);
    let waits_less = m > 0.0 && late[r].mean_wait() <= WAITS_LESS * m;
    last as f64 >= share * expected || waits_less
}

/// A pair of ranks (lower first) and a message size.
pub type PairSize = ((usize, usize), u64);

/// Send durations per pair of ranks and message size: (step, ns) of every send.
pub type Sends = BTreeMap<PairSize, Vec<(u64, f64)>>;

fn slow_links(ranks: &[RankTrace], slow_ranks: &[usize]) -> Vec<Finding> {
    let mut sends: Sends = BTreeMap::new();
    for r in ranks {
        let me = r.header.rank;
        for e in r.events.iter().filter(|e| e.kind == Kind::Send) {
            let p = e.a as usize;
            let pair = (me.min(p), me.max(p));
            sends
                .entry((pair, e.bytes))
                .or_default()
                .push((u64::from(e.step), e.duration()));
        }
    }
    detect_slow_links(&sends, slow_ranks)
}

/// The slow-link detector `megac scan` and `--scan` share: per pair and message size, the
/// lower quartile of its send times (a slow link delays every send, a preempted sender only
/// some) against the median of the other pairs' for that size; a pair whose median ratio is
/// at least [`SLOW_LINK`], neither of whose ranks is in `slow_ranks`, is a finding.
pub fn detect_slow_links(sends: &Sends, slow_ranks: &[usize]) -> Vec<Finding> {
    let medians: BTreeMap<((usize, usize), u64), f64> = sends
        .iter()
        .map(|(k, v)| {
            // The lower quartile: a slow link delays every send, a preempted sender only some.
            let mut d: Vec<f64> = v.iter().map(|x| x.1).collect();
            d.sort_by(f64::total_cmp);
            (*k, d[d.len() / 4])
        })
        .collect();
    // Per pair: ratio against the other pairs with the same message size.
    let mut per_pair: BTreeMap<(usize, usize), (Vec<f64>, u64)> = BTreeMap::new();
    for (&(pair, bytes), &m) in &medians {
        let mut others: Vec<f64> = medians
            .iter()
            .filter(|((p, b), _)| *b == bytes && *p != pair)
            .map(|(_, &v)| v)
            .collect();
        let reference = median(&mut others);
        if reference.is_nan() || reference <= 0.0 {
            continue;
        }
        let first = sends[&(pair, bytes)]
            .iter()
            .filter(|(_, d)| *d >= SLOW_LINK * reference)
            .map(|(s, _)| *s)
            .min()
            .unwrap_or(0);
        let e = per_pair.entry(pair).or_insert((Vec::new(), u64::MAX));
        e.0.push(m / reference);
        e.1 = e.1.min(first);
    }
    let mut out = Vec::new();
    for ((a, b), (mut ratios, first)) in per_pair {
        let score = median(&mut ratios);
        if score >= SLOW_LINK && !slow_ranks.contains(&a) && !slow_ranks.contains(&b) {
            out.push(Finding {
                kind: "slow-link",
                ranks: vec![a, b],
                score,
                first_step: first,
                late_share: None,
            });
        }
    }
    out.sort_by(|a, b| b.score.total_cmp(&a.score));
    out
}

impl Scan {
    /// The JSON report of `megac scan --format json`.
    pub fn to_json(&self) -> String {
        let round = |x: f64, k: f64| (x * k).round() / k;
        let findings: Vec<serde_json::Value> = self
            .findings
            .iter()
            .map(|f| {
                let mut j = serde_json::json!({
                    "kind": f.kind, "ranks": f.ranks, "score": round(f.score, 1000.0),
                    "first_step": f.first_step,
                });
                if let Some(l) = f.late_share {
                    j["late_share"] = serde_json::json!(round(l, 1000.0));
                }
                j
            })
            .collect();
        let v = serde_json::json!({
            "steps": self.steps,
            "ranks": self.labels.len(),
            "findings": findings,
            "clock": {
                "offsets_us": self.clock.offset_ns.iter().map(|o| round(o / 1e3, 1000.0)).collect::<Vec<_>>(),
                "drift_ppm": self.clock.drift.iter().map(|d| round(d * 1e6, 1000.0)).collect::<Vec<_>>(),
                "drift_bound_ppm": self.clock.drift_bound.iter().map(|b| b.map(|b| round(b * 1e6, 1000.0))).collect::<Vec<_>>(),
                "anchors": self.clock.anchors,
                "method": self.clock.method,
            },
            "dropped_events": self.dropped,
            "baseline_megatronapp": self.baseline,
            "per_rank": self.per_rank.iter().map(|(c, l)| serde_json::json!({
                "compute_ratio": c.map(|x| round(x, 1000.0)),
                "late_share": l.map(|x| round(x, 1000.0)),
            })).collect::<Vec<_>>(),
        });
        let mut s = serde_json::to_string_pretty(&v).expect("scan serializes");
        s.push('\n');
        s
    }

    /// The text report.
    pub fn to_text(&self) -> String {
        let mut s = format!("{} ranks, {} steps\n", self.labels.len(), self.steps);
        if self.findings.is_empty() {
            s.push_str("no slow rank or slow link found\n");
        }
        for f in &self.findings {
            match f.kind {
                "slow-rank" => {
                    let r = f.ranks[0];
                    s.push_str(&format!(
                        "slow-rank: {}: compute {:.2}x its peers' (same role), from step {}",
                        self.labels[r], f.score, f.first_step
                    ));
                    if let Some(l) = f.late_share {
                        s.push_str(&format!(
                            "; last to arrive at {:.0}% of its collectives",
                            100.0 * l
                        ));
                    }
                    s.push('\n');
                }
                _ => s.push_str(&format!(
                    "slow-link: {} <-> {}: sends {:.2}x slower than other links', from step {}\n",
                    self.labels[f.ranks[0]], self.labels[f.ranks[1]], f.score, f.first_step
                )),
            }
        }
        s.push_str("clock (against rank 0):\n");
        for (r, label) in self.labels.iter().enumerate().skip(1) {
            let how = match (self.clock.method[r], self.clock.drift_bound[r]) {
                ("bounds", _) => format!("{} bounds", self.clock.anchors[r]),
                ("ping-pong", Some(b)) if b > 0.0 => {
                    format!("ping-pong, drift ±{:.2} ppm", b * 1e6)
                }
                (m, _) => m.to_string(),
            };
            s.push_str(&format!(
                "  {label}: offset {:+.1} us, drift {:+.2} ppm ({how})\n",
                self.clock.offset_ns[r] / 1e3,
                self.clock.drift[r] * 1e6,
            ));
        }
        let dropped: u64 = self.dropped.iter().sum();
        if dropped > 0 {
            s.push_str(&format!(
                "warning: {dropped} events were dropped (the ranks' buffers were full)\n"
            ));
        }
        s
    }
}

/// The merged, aligned timeline as a Chrome trace (Perfetto): one process per rank named by
/// its coordinates, a compute and a communication thread, flow arrows from each send to its
/// receive and from each collective's last arriver to the members that waited for it.
pub fn chrome_trace(ranks: &[RankTrace], clock: &Clock) -> String {
    use serde_json::json;
    let t_min = ranks
        .iter()
        .flat_map(|r| {
            r.events
                .iter()
                .map(move |e| clock.align(r.header.rank, e.t0))
        })
        .fold(f64::INFINITY, f64::min);
    let us = |r: usize, x: i64| ((clock.align(r, x) - t_min) / 1e3 * 1000.0).round() / 1000.0;
    let mut out: Vec<serde_json::Value> = Vec::new();
    for r in ranks {
        let pid = r.header.rank;
        out.push(
            json!({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": r.label()}}),
        );
        out.push(json!({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}));
        out.push(json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "compute"}}));
        out.push(json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "communication"}}));
        for e in &r.events {
            let name = match e.kind {
                Kind::Step => format!("step {}", e.step),
                Kind::Forward | Kind::Backward | Kind::Weight | Kind::BackwardWeight => {
                    format!("{}{}.{}", e.kind.name(), e.a, e.b)
                }
                Kind::Microbatch => format!("mb {}", e.b),
                Kind::Collective => {
                    format!("{} {:?}", COLLECTIVES[e.b as usize], r.groups[e.a as usize])
                }
                Kind::Send => format!("send -> {}", e.a),
                Kind::Recv => format!("recv <- {}", e.a),
                k => k.name().to_string(),
            };
            let mut args = json!({"step": e.step});
            if e.kind.is_comm() {
                args["bytes"] = json!(e.bytes);
                args["seq"] = json!(e.seq);
            }
            if e.cpu_wait > 0 {
                // What the detectors compare: the time without the waits for a CPU.
                args["busy_us"] = json!((e.duration() / 1e3 * 1e3).round() / 1e3);
            }
            out.push(json!({
                "name": name, "cat": e.kind.name(), "ph": "X", "pid": pid,
                "tid": if e.kind.is_comm() { 1 } else { 0 },
                "ts": us(pid, e.t0), "dur": ((us(pid, e.t1) - us(pid, e.t0)) * 1000.0).round() / 1000.0,
                "args": args,
            }));
        }
    }
    // Flows: send -> recv.
    let mut flow = 0u64;
    for (from, to, sent, got) in messages(ranks) {
        flow += 1;
        out.push(json!({"name": "transfer", "cat": "flow", "ph": "s", "id": flow, "pid": from, "tid": 1, "ts": us(from, sent)}));
        out.push(json!({"name": "transfer", "cat": "flow", "ph": "f", "bp": "e", "id": flow, "pid": to, "tid": 1, "ts": us(to, got)}));
    }
    // Flows: a collective's last arriver -> each member that waited for it.
    for members in instances(ranks).values() {
        let Some(&(last, enter, _)) = members
            .iter()
            .max_by(|a, b| clock.align(a.0, a.1).total_cmp(&clock.align(b.0, b.1)))
        else {
            continue;
        };
        for &(m, _, exit) in members.iter().filter(|m| m.0 != last) {
            flow += 1;
            out.push(json!({"name": "waited for", "cat": "flow", "ph": "s", "id": flow, "pid": last, "tid": 1, "ts": us(last, enter)}));
            out.push(json!({"name": "waited for", "cat": "flow", "ph": "f", "bp": "e", "id": flow, "pid": m, "tid": 1, "ts": us(m, exit)}));
        }
    }
    let v = json!({"traceEvents": out, "displayTimeUnit": "ms"});
    let mut s = serde_json::to_string(&v).expect("trace serializes");
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sign_test_is_the_binomial_tail() {
        // P(Bin(4, 1/2) >= 3) = (4 + 1) / 16.
        assert!((sign_test(4, 3) - 5.0 / 16.0).abs() < 1e-12);
        assert_eq!(sign_test(10, 0), 1.0);
        assert!((sign_test(12, 12) - 0.5f64.powi(12)).abs() < 1e-15);
        // Large n stays finite and monotone.
        let (a, b) = (sign_test(2000, 1050), sign_test(2000, 1100));
        assert!(a > b && b > 0.0 && a < 0.5, "{a} {b}");
    }

    /// Rank segments with multiplicative noise (1 + 0.1·|z|, and one segment in twenty
    /// preempted, 3× longer), 7 steps × 4 segments each, rank r slowed by `slow[r]`.
    fn noisy_segments(slow: &[f64], seed: u64) -> Vec<Segments> {
        let mut state = seed;
        let mut next = move || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
        };
        slow.iter()
            .map(|&f| {
                let mut m = Segments::new();
                for s in 2..=8u64 {
                    for k in 0..4u32 {
                        // |z| of a standard normal by Box-Muller.
                        let z = (-2.0 * next().max(1e-12).ln()).sqrt()
                            * (std::f64::consts::TAU * next()).cos();
                        let pre = if next() < 0.05 { 3.0 } else { 1.0 };
                        let base = 1e6 * (1.0 + f64::from(k));
                        m.insert((s, k), base * f * (1.0 + 0.1 * z.abs()) * pre);
                    }
                }
                m
            })
            .collect()
    }

    #[test]
    fn the_sign_test_names_a_slightly_slow_rank_and_no_healthy_one() {
        let roles = [0; 4];
        let late = [Late::default(); 4];
        let named = |slow: &[f64], seed| -> Vec<usize> {
            let segs = noisy_segments(slow, seed);
            let (f, _) = detect_slow_ranks(&roles, &segs, 2..=8, &late, 1, &[]);
            let mut r: Vec<usize> = f.iter().map(|f| f.ranks[0]).collect();
            r.sort_unstable();
            r
        };
        let (mut healthy, mut one, mut two) = (0, 0, 0);
        for seed in 0..50 {
            healthy += usize::from(named(&[1.0; 4], seed).is_empty());
            one += usize::from(named(&[1.0, 1.0, 1.2, 1.0], seed) == [2]);
            two += usize::from(named(&[1.5, 1.0, 1.0, 1.5], seed) == [0, 3]);
        }
        // Healthy noise (independent here) names a rank at most at the chosen rate; 1.2×
        // and two 1.5× ranks are found (not always: with 28 segments the test needs 23
        // slower, and a preempted healthy peer beside the other slow rank puts a slow
        // rank's segment against a slow median).
        assert_eq!(healthy, 50);
        assert!(one >= 45, "1.2x found in {one} of 50");
        assert!(two >= 45, "two 1.5x found in {two} of 50");
    }

    /// Four rotated ranks on two cores (rank r runs step s on core (r + s) mod 2), one core
    /// 1.4× slower than the other in every step, noise of ±2% per segment, 16 judged steps.
    fn rotated_segments(slow: &[f64]) -> Vec<Segments> {
        slow.iter()
            .enumerate()
            .map(|(r, &f)| {
                let mut m = Segments::new();
                for s in 2..=17u64 {
                    let core = if (r as u64 + s).is_multiple_of(2) {
                        1.0
                    } else {
                        1.4
                    };
                    for k in 0..4u32 {
                        let noise = 1.0
                            + 0.02 * (((r as u64 * 31 + s * 7 + u64::from(k)) % 5) as f64 - 2.0)
                                / 2.0;
                        m.insert((s, k), 1e6 * (1.0 + f64::from(k)) * f * core * noise);
                    }
                }
                m
            })
            .collect()
    }

    #[test]
    fn rotated_ranks_are_judged_over_blocks_that_cancel_the_cores() {
        let roles = [0; 4];
        let late = [Late::default(); 4];
        let named = |slow: &[f64], block| -> Vec<(usize, f64)> {
            let (f, _) =
                detect_slow_ranks(&roles, &rotated_segments(slow), 2..=17, &late, block, &[]);
            f.iter().map(|f| (f.ranks[0], f.score)).collect()
        };
        // Healthy: every rank is 1.4x its peers' median in half its steps, yet over blocks
        // of two steps (one on each core) no rank is slow.
        assert_eq!(named(&[1.0; 4], 2), []);
        // A 1.1x rank is named, with its slowdown, and no other.
        let found = named(&[1.0, 1.0, 1.1, 1.0], 2);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].0, 2);
        assert!((found[0].1 - 1.1).abs() < 0.02, "{found:?}");
        // Judged step by step instead, the core's speed, not the fault, sets the signs: the
        // sign test cannot name the 1.1x rank.
        assert_eq!(named(&[1.0, 1.0, 1.1, 1.0], 1), []);
        // Fewer than MIN_BLOCKS complete blocks name nothing short of a gross straggler.
        let (f, _) = detect_slow_ranks(
            &roles,
            &rotated_segments(&[1.0, 1.0, 1.1, 1.0]),
            2..=6,
            &late,
            2,
            &[],
        );
        assert_eq!(f.len(), 0, "{f:?}");
    }

    #[test]
    fn ranks_that_shared_a_core_and_ran_slow_together_are_not_named() {
        let roles = [0; 4];
        let late = [Late::default(); 4];
        // Where rank r ran each step: core (r + s) mod 2 of one host, so ranks 0 and 2
        // share a core in every step, and 1 and 3.
        let placements: Vec<Option<Placement>> = (0..4)
            .map(|slot| {
                Some(Placement {
                    host: "h".into(),
                    turns: crate::threads::CoreTurns {
                        slot,
                        cores: vec![0, 1],
                    },
                })
            })
            .collect();
        let named = |slow: &[f64], placements: &[Option<Placement>]| -> Vec<usize> {
            let segs = rotated_segments(slow);
            let (f, _) = detect_slow_ranks(&roles, &segs, 2..=17, &late, 2, placements);
            let mut r: Vec<usize> = f.iter().map(|f| f.ranks[0]).collect();
            r.sort_unstable();
            r
        };
        // Ranks 1 and 3 both 1.07x their peers over the blocks, as when their core ran slow
        // in their steps: each is no slower than the rank beside it, so neither is named;
        // without the placements both are.
        assert_eq!(
            named(&[1.0, 1.07, 1.0, 1.07], &placements),
            Vec::<usize>::new()
        );
        assert_eq!(named(&[1.0, 1.07, 1.0, 1.07], &[]), [1, 3]);
        // A 1.1x rank is slower than the rank beside it: named.
        assert_eq!(named(&[1.0, 1.0, 1.1, 1.0], &placements), [2]);
        // Two gross stragglers sharing a core are named all the same.
        assert_eq!(named(&[1.0, 1.5, 1.0, 1.5], &placements), [1, 3]);
        // Ranks of two hosts share no core: on hosts of their own, 1 and 3 are named.
        let apart: Vec<Option<Placement>> = placements
            .iter()
            .enumerate()
            .map(|(r, p)| {
                let mut p = p.clone()?;
                p.host = format!("h{r}");
                Some(p)
            })
            .collect();
        assert_eq!(named(&[1.0, 1.07, 1.0, 1.07], &apart), [1, 3]);
    }

    #[test]
    fn a_rotated_rank_that_waits_for_its_peers_is_not_named() {
        let roles = [0; 4];
        let segs = rotated_segments(&[1.0, 1.0, 1.1, 1.0]);
        // Rank 2 never arrived last and waited 3x as long as its peers: it is waiting for
        // them, so its slow compute is not what holds the job up.
        let mut late = [Late {
            last: 4,
            total: 12,
            expected: 3.0,
            wait: 12e5,
        }; 4];
        late[2] = Late {
            last: 0,
            total: 12,
            expected: 3.0,
            wait: 36e5,
        };
        let (f, _) = detect_slow_ranks(&roles, &segs, 2..=17, &late, 2, &[]);
        assert_eq!(f.len(), 0, "{f:?}");
        // Arriving last as often as the others, it is named.
        late[2].last = 3;
        let (f, _) = detect_slow_ranks(&roles, &segs, 2..=17, &late, 2, &[]);
        assert_eq!(f.iter().map(|f| f.ranks[0]).collect::<Vec<_>>(), [2]);
    }

    #[test]
    fn the_widest_margin_fit_recovers_offset_and_drift() {
        // A collective every 10 ms for 5 s; T on rank 0's clock; rank r's clock reads
        // (1 + 200 ppm)·T + 50 ms. Its enter is before T (it waited, or arrived last 1 us
        // before), its exit after (woken 3..40 us late); the aligned peers' enter/exit bracket
        // T the same way.
        let mut bounds = Vec::new();
        for i in 0..500u64 {
            let t = i as f64 * 1e7;
            let skew = |x: f64| x * (1.0 + 200e-6) + 50e6;
            let late = 1_000.0 + (i * 7919 % 37) as f64 * 1_000.0;
            let (enter_r, exit_r) = if i % 2 == 0 {
                (t - 1_000.0, t + late)
            } else {
                (t - 3e5, t + 3_000.0)
            };
            let (t_lo, t_hi) = if i % 2 == 0 {
                (t - 2e5, t + late)
            } else {
                (t - 1_000.0, t + 2_000.0)
            };
            bounds.push(Bound {
                t: 0.5 * (t_lo + t_hi),
                lo: skew(enter_r) - t_hi,
                hi: skew(exit_r) - t_lo,
            });
        }
        let (o, d) = fit_bounds(&bounds).unwrap();
        let err = |t: f64| (o + d * t) - (50e6 + 200e-6 * t);
        assert!(
            err(0.0).abs() < 5_000.0 && err(5e9).abs() < 5_000.0,
            "offset {o} drift {d}"
        );
        assert!((d - 200e-6).abs() < 2e-6, "drift {d}");
        assert!(fit_bounds(&bounds[..0]).is_none());
    }

    /// Ping-pongs at two ends of a run, rank 1's clock 50 ms ahead and 200 ppm fast: the
    /// round with the shortest turnaround (ping 5 µs, pong 6 µs) decides, within half its
    /// asymmetry (0.5 µs), at both ends, and so the drift.
    #[test]
    fn the_shortest_ping_pong_gives_offset_and_drift() {
        let skew = |t: f64| (t * (1.0 + 200e-6) + 50e6) as i64;
        let header = |rank| RankHeader {
            rank,
            world: 2,
            role: 0,
            coords: vec![],
            steps: 1,
            rotation: 1,
            placement: None,
        };
        let mut ranks: Vec<RankTrace> = (0..2)
            .map(|r| RankTrace {
                header: header(r),
                dropped: 0,
                groups: vec![],
                events: vec![],
            })
            .collect();
        for (phase, start) in [(0u32, 1e6), (1, 2e9)] {
            for i in 0..16u64 {
                let t0 = start + i as f64 * 1e5;
                let (ping, pong) = if i == 7 {
                    (5_000.0, 6_000.0)
                } else {
                    (5_000.0 + (i * 37 % 11) as f64 * 4_000.0, 30_000.0)
                };
                let at = t0 + ping;
                let ev = |t0: i64, t1: i64, peer: u32| Event {
                    kind: Kind::Sync,
                    t0,
                    t1,
                    step: 0,
                    a: peer,
                    b: phase,
                    seq: i,
                    bytes: 0,
                    cpu_wait: 0,
                };
                ranks[0].events.push(ev(t0 as i64, (at + pong) as i64, 1));
                ranks[1].events.push(ev(skew(at), skew(at), 0));
            }
        }
        let fit = sync_fit(&ranks, 1).unwrap();
        let (o, d) = (fit.offset_ns, fit.drift);
        // The bound holds the fit's real error (200 ppm injected).
        assert!((d - 200e-6).abs() <= fit.drift_bound, "{fit:?}");
        assert!(fit.drift_bound > 0.0 && fit.drift_bound < 1e-5, "{fit:?}");
        for t in [1e6, 2e9] {
            let err = (o + (1.0 + d) * t) - (50e6 + (1.0 + 200e-6) * t);
            assert!(err.abs() < 1_000.0, "at {t}: {err} ns");
        }
        let c = align(&ranks);
        assert_eq!(c.method, ["reference", "ping-pong"]);
        assert!(sync_fit(&ranks[..1], 1).is_none());
    }

    #[test]
    fn bad_rank_files_say_what_is_wrong() {
        let e = |t: &str| parse_rank(t, 0).unwrap_err();
        assert!(e("{").contains("not a megac rank file"));
        assert!(e(r#"{"format":"x"}"#).contains("expected \"megac-scan/1\""));
        let ok = r#"{"format":"megac-scan/1","rank":0,"world":2,"role":0,"coords":[["dp",0,2]],"steps":1,"dropped":0,"groups":[[0,1]],"events":[["coll",5,9,1,0,0,1,4]]}"#;
        assert_eq!(parse_rank(ok, 0).unwrap().events.len(), 1);
        assert!(parse_rank(ok, 1).unwrap_err().contains("named for rank 1"));
        let bad = ok.replace("[\"coll\",5,9", "[\"coll\",9,5");
        assert!(e(&bad).contains("t0 <= t1"), "{}", e(&bad));
        let bad = ok.replace("[\"coll\",5,9,1,0", "[\"coll\",5,9,1,3");
        assert!(e(&bad).contains("group 3 of 1"));
        // Files without `rotation` and `cpu_wait` (8-field events) are older: not rotated,
        // wall times. The ninth field is the wait for a CPU that `duration` leaves out.
        let old = parse_rank(ok, 0).unwrap();
        assert_eq!((old.header.rotation, old.events[0].cpu_wait), (1, 0));
        let new = ok
            .replace("\"steps\":1,", "\"steps\":1,\"rotation\":2,")
            .replace("[\"coll\",5,9,1,0,0,1,4]", "[\"compute\",5,9,1,0,0,0,0,3]");
        let t = parse_rank(&new, 0).unwrap();
        assert_eq!((t.header.rotation, t.events[0].duration()), (2, 1.0));
        let bad = new.replace("\"rotation\":2", "\"rotation\":0");
        assert!(e(&bad).contains("\"rotation\" must be a positive integer"));
        // A placement: the host, the slot, one core per step of the rotation.
        assert_eq!(t.header.placement, None);
        let placed = new.replace(
            "\"rotation\":2,",
            "\"rotation\":2,\"placement\":{\"host\":\"n1\",\"slot\":3,\"cores\":[4,6]},",
        );
        let p = parse_rank(&placed, 0).unwrap().header.placement.unwrap();
        assert_eq!(
            (p.host.as_str(), p.turns.core(1), p.turns.core(2)),
            ("n1", 4, 6)
        );
        let bad = placed.replace("[4,6]", "[4]");
        assert!(
            e(&bad).contains("one core per step of the rotation (2)"),
            "{}",
            e(&bad)
        );
        let bad = placed.replace("\"host\":\"n1\"", "\"host\":1");
        assert!(e(&bad).contains("\"placement\" must be null or"));
    }
}
