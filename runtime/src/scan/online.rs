//! `--scan`: `megac scan`'s detectors ([`super::analyze::detect_slow_ranks`],
//! [`super::analyze::detect_slow_links`]) run while training, ranks over a rolling window of
//! the last [`WINDOW`] steps, links over the last [`LINK_WINDOW`].
//!
//! After every step each rank condenses its records of the step into one fixed-size row of
//! f64s: the durations of its first [`MAX_SEGMENTS`] compute segments, and up to
//! [`MAX_COLLECTIVES`] collectives (group, call number, wait) and [`MAX_SENDS`] sends (peer,
//! bytes, duration). Rank 0 collects the rows with one
//! all-reduce of a table of a row per rank, on the world, in which every other rank adds
//! zeros (so the sum is exact in any reduction order; it goes around the recording, so
//! traces do not show it). Under local threads and MPI alike that is `ranks × row` values per
//! step (20 KiB for 4 ranks). Rank 0 matches the collectives by (group, call number), tallies
//! who arrived last, and judges the window as `megac scan` judges a whole trace; a finding
//! not reported before becomes one warning line, a slow rank only from a score of
//! [`WARN_SLOWDOWN`]. The first step (warm-up) is not judged, and
//! a window judges ranks once it holds [`MIN_STEPS`] steps, links once it holds
//! [`MIN_LINK_STEPS`].

use std::collections::{BTreeMap, VecDeque};

use super::analyze::{detect_slow_links, detect_slow_ranks, tally_late, Late, Segments, Sends};
use super::{Event, Kind, Recorder};
use crate::comm::Communicator;
use crate::error::RuntimeError;

/// Steps in the rolling window.
pub const WINDOW: usize = 8;
/// Steps a window must hold before it is judged.
pub const MIN_STEPS: usize = 3;
/// Steps of sends the slow-link test judges (the last ones, from [`MIN_LINK_STEPS`] on). A
/// send on local threads takes the world's lock, and over a few steps a healthy pair's
/// sends can all have waited for it: on the kept healthy pp2 dp2 traces of
/// bench/scan_detect.py (local threads, 200 runs, 2026-12-07) some 8-step window read 2 or
/// more in 19 runs, the windows from step 2 of at least 6 steps in 2, the whole runs in
/// none (over MPI: none in any window).
pub const LINK_WINDOW: usize = 32;
/// The least score of a slow link `--scan` warns of; `megac scan` names links from
/// [`super::analyze::SLOW_LINK`] (2). In `--scan` runs of healthy llama-tiny pp2 dp2 on local
/// threads (2026-12-07, 100 runs, 20 steps) a pair read 2.05–2.60 over the link window in
/// 5 runs, while an injected 2× link read 10 (its wait is at least the nominal wire time,
/// several times a local copy); a warning is an alarm to act on, as for ranks
/// ([`WARN_SLOWDOWN`]).
pub const WARN_LINK: f64 = 3.0;
/// Steps of sends the slow-link test needs (a 2× link was found from 6 steps in all 200
/// kept runs, local and MPI).
pub const MIN_LINK_STEPS: usize = 6;
/// The least slowdown (`score`) of a slow rank `--scan` warns of; `megac scan` names ranks
/// from [`super::analyze::MIN_SLOWDOWN`] on. Online the detector judges a window after every
/// step, and on a host with more rank threads than cores healthy ranks run 1.05–1.25× their
/// peers for stretches of many steps (measured: with the offline level, 12 of 40 healthy
/// 20-step tp2 × dp2 runs of llama-tiny on 2 cores warned, at scores up to 1.24, most of them
/// last to arrive at over half of their collectives: real, passing stragglers of the
/// scheduler's making). A warning is an alarm to act on, so it waits for a slowdown beyond
/// that range; the trace (`--trace`, then `megac scan`) shows the smaller ones.
pub const WARN_SLOWDOWN: f64 = 1.3;
/// Compute segments of one step a rank reports (later ones are left out of the test).
pub const MAX_SEGMENTS: usize = 64;
/// Collectives of one step a rank reports (more are left out of the tally).
pub const MAX_COLLECTIVES: usize = 128;
/// Sends of one step a rank reports (more are left out).
pub const MAX_SENDS: usize = 64;

/// Values in one rank's row: segment count, collective count, send count, the segments'
/// ns, then the collectives' and sends' entries.
const ROW: usize = 3 + MAX_SEGMENTS + 3 * MAX_COLLECTIVES + 3 * MAX_SENDS;
/// Where a row's collectives start.
const COLLS_AT: usize = 3 + MAX_SEGMENTS;
/// Where a row's sends start.
const SENDS_AT: usize = COLLS_AT + 3 * MAX_COLLECTIVES;

/// A group's key in rows, the same on every member: a 52-bit FNV-1a hash of its ranks
/// (exact in an f64).
fn group_key(members: &[usize]) -> f64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &r in members {
        for b in (r as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    (h >> 12) as f64
}

/// This rank's row for a step's events (`group` gives a collective's members).
fn summarise<'a>(events: &[Event], group: impl Fn(u32) -> &'a [usize], row: &mut [f64]) {
    row.fill(0.0);
    let (mut segs, mut colls, mut sends) = (0usize, 0usize, 0usize);
    for e in events {
        let d = e.duration();
        match e.kind {
            // Segments are numbered from 0 in each step, in program order.
            Kind::Compute if (e.a as usize) < MAX_SEGMENTS => {
                row[3 + e.a as usize] = d;
                segs = segs.max(e.a as usize + 1);
            }
            Kind::Collective if colls < MAX_COLLECTIVES => {
                let members = group(e.a);
                if members.len() > 1 {
                    let at = COLLS_AT + 3 * colls;
                    row[at..at + 3].copy_from_slice(&[group_key(members), e.seq as f64, d]);
                    colls += 1;
                }
            }
            Kind::Send if sends < MAX_SENDS => {
                let at = SENDS_AT + 3 * sends;
                row[at..at + 3].copy_from_slice(&[f64::from(e.a), e.bytes as f64, d]);
                sends += 1;
            }
            _ => {}
        }
    }
    row[0] = segs as f64;
    row[1] = colls as f64;
    row[2] = sends as f64;
}

/// One judged step: per rank its compute segments' ns, the step's collective-wait tally, and
/// its sends.
struct Step {
    step: u64,
    segments: Vec<Vec<f64>>,
    late: Vec<Late>,
    sends: Vec<((usize, usize), u64, f64)>,
}

/// The online detector of one rank (rank 0 judges; the others only send their rows).
pub struct Online {
    rank: usize,
    world: usize,
    roles: Vec<usize>,
    labels: Vec<String>,
    /// The first step of the run (warm-up: not judged).
    first: u64,
    table: Vec<f64>,
    window: VecDeque<Step>,
    /// Findings already reported: (kind, ranks).
    reported: Vec<(&'static str, Vec<usize>)>,
    /// Steps per block of the slow-rank test (the ranks' rotation over the cores).
    block: u64,
}

impl Online {
    /// The detector of `rank`; `roles[r]` and `labels[r]` are rank r's role and label
    /// ("rank 2 (tp0 dp1 pp0)"); `first` is the run's first step.
    pub fn new(
        rank: usize,
        roles: Vec<usize>,
        labels: Vec<String>,
        first: u64,
        block: u64,
    ) -> Online {
        let world = roles.len();
        Online {
            block,
            rank,
            world,
            roles,
            labels,
            first,
            table: vec![0.0; world * ROW],
            window: VecDeque::with_capacity(LINK_WINDOW + 1),
            reported: Vec::new(),
        }
    }

    /// Exchange this rank's summary of `step` (every rank calls it after every step, on the
    /// unrecorded communicator `comm`) and, on rank 0, judge the window; returns the new
    /// warnings.
    pub fn end_step(
        &mut self,
        step: u64,
        rec: &Recorder,
        comm: &mut dyn Communicator,
    ) -> Result<Vec<String>, RuntimeError> {
        let (n, me) = (self.world, self.rank);
        self.table.fill(0.0);
        summarise(
            rec.step_events(),
            |id| rec.group(id),
            &mut self.table[me * ROW..(me + 1) * ROW],
        );
        if n > 1 {
            let world: Vec<usize> = (0..n).collect();
            comm.all_reduce_sum_f64(&world, &mut self.table)?;
        }
        if me != 0 || step <= self.first {
            return Ok(Vec::new());
        }
        let decoded = self.decode(step);
        self.window.push_back(decoded);
        if self.window.len() > LINK_WINDOW {
            self.window.pop_front();
        }
        if self.window.len() < MIN_STEPS {
            return Ok(Vec::new());
        }
        Ok(self.judge(step))
    }

    /// The step's rows, decoded and matched.
    fn decode(&self, step: u64) -> Step {
        let n = self.world;
        let rows: Vec<&[f64]> = self.table.chunks_exact(ROW).collect();
        let mut instances: BTreeMap<(u64, u64), Vec<(usize, i64)>> = BTreeMap::new();
        let mut sends = Vec::new();
        for (r, row) in rows.iter().enumerate() {
            let colls = (row[1] as usize).min(MAX_COLLECTIVES);
            for c in row[COLLS_AT..COLLS_AT + 3 * colls].chunks_exact(3) {
                instances
                    .entry((c[0] as u64, c[1] as u64))
                    .or_default()
                    .push((r, c[2] as i64));
            }
            let count = (row[2] as usize).min(MAX_SENDS);
            for s in row[SENDS_AT..SENDS_AT + 3 * count].chunks_exact(3) {
                let peer = s[0] as usize;
                sends.push(((r.min(peer), r.max(peer)), s[1] as u64, s[2]));
            }
        }
        let mut late = vec![Late::default(); n];
        tally_late(&mut late, instances.values().map(Vec::as_slice));
        Step {
            step,
            segments: rows
                .iter()
                .map(|row| row[3..3 + (row[0] as usize).min(MAX_SEGMENTS)].to_vec())
                .collect(),
            late,
            sends,
        }
    }

    /// Run the detectors over the window; warnings for findings not reported before.
    fn judge(&mut self, step: u64) -> Vec<String> {
        let n = self.world;
        let mut segments: Vec<Segments> = vec![BTreeMap::new(); n];
        let mut late = vec![Late::default(); n];
        let mut sends: Sends = BTreeMap::new();
        let ranks_from = self.window.len().saturating_sub(WINDOW);
        for (i, s) in self.window.iter().enumerate() {
            for &(pair, bytes, d) in &s.sends {
                sends.entry((pair, bytes)).or_default().push((s.step, d));
            }
            if i < ranks_from {
                continue;
            }
            for r in 0..n {
                for (k, &d) in s.segments[r].iter().enumerate() {
                    segments[r].insert((s.step, k as u32), d);
                }
                late[r].last += s.late[r].last;
                late[r].total += s.late[r].total;
                late[r].expected += s.late[r].expected;
                late[r].wait += s.late[r].wait;
            }
        }
        let from = self.window.get(ranks_from).map_or(step, |s| s.step);
        let links_from = self.window.front().map_or(step, |s| s.step);
        let (mut findings, _) =
            detect_slow_ranks(&self.roles, &segments, from..=step, &late, self.block, &[]);
        // Slow links are judged between ranks whose compute is normal: every rank the
        // detector named is left out, warned of or not.
        let slow: Vec<usize> = findings.iter().flat_map(|f| f.ranks.clone()).collect();
        findings.retain(|f| f.score >= WARN_SLOWDOWN);
        if self.window.len() >= MIN_LINK_STEPS {
            let links = detect_slow_links(&sends, &slow);
            findings.extend(links.into_iter().filter(|f| f.score >= WARN_LINK));
        }
        let mut out = Vec::new();
        for f in findings {
            if self
                .reported
                .iter()
                .any(|(k, r)| *k == f.kind && *r == f.ranks)
            {
                continue;
            }
            let line = match f.kind {
                "slow-rank" => format!(
                    "warning: --scan: step {step}: slow-rank {}: score {:.2} (compute against \
                     its peers', steps {from}-{step}, from step {}){}",
                    self.labels[f.ranks[0]],
                    f.score,
                    f.first_step,
                    f.late_share.map_or(String::new(), |l| format!(
                        "; last to arrive at {:.0}% of its collectives",
                        100.0 * l
                    )),
                ),
                _ => format!(
                    "warning: --scan: step {step}: slow-link {} <-> {}: score {:.2} (sends \
                     against other links', steps {links_from}-{step}, from step {})",
                    self.labels[f.ranks[0]], self.labels[f.ranks[1]], f.score, f.first_step
                ),
            };
            self.reported.push((f.kind, f.ranks));
            out.push(line);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Rank 0's detector fed rows by hand for steps 1–6: rank 2's four segments a step take
    /// `slow` ms, its peers' 10, and it arrives last at every collective; (step, line) of
    /// every warning.
    fn warnings(slow: u64) -> Vec<(u64, String)> {
        let n = 4;
        let labels: Vec<String> = (0..n).map(|r| format!("rank {r}")).collect();
        let mut online = Online::new(0, vec![0; n], labels, 1, 1);
        let group: Vec<usize> = (0..n).collect();
        let mut seen = Vec::new();
        for step in 1..=6u64 {
            online.table.fill(0.0);
            for r in 0..n {
                let mut rec = Recorder::new(16, 0.0, 0.0);
                rec.begin_step(step);
                let t = Instant::now();
                let ms = |x: u64| t + Duration::from_millis(x);
                let d = if r == 2 { slow } else { 10 };
                for k in 0..4 {
                    rec.push(Kind::Compute, ms(d * k), ms(d * (k + 1)), k as u32, 0, 0, 0);
                }
                let c = 4 * d;
                // Everyone waits for rank 2: its own wait is the shortest.
                let (g, seq) = rec.call(&group);
                let wait = if r == 2 { 1 } else { 7 };
                rec.push(Kind::Collective, ms(c), ms(c + wait), g, 0, seq, 64);
                let row = &mut online.table[r * ROW..(r + 1) * ROW];
                summarise(rec.step_events(), |id| rec.group(id), row);
            }
            if step > 1 {
                let decoded = online.decode(step);
                online.window.push_back(decoded);
                if online.window.len() >= MIN_STEPS {
                    seen.extend(online.judge(step).into_iter().map(|w| (step, w)));
                }
            }
        }
        seen
    }

    /// A 1.6× rank is named once, at the third judged step, when its 12 segments reach the
    /// sign test.
    #[test]
    fn the_window_names_a_slow_rank_once() {
        let seen = warnings(16);
        assert_eq!(seen.len(), 1, "{seen:?}");
        let (step, line) = &seen[0];
        assert_eq!(*step, 4);
        assert!(
            line.contains("step 4: slow-rank rank 2: score 1.60"),
            "{line}"
        );
        assert!(!line.contains('\n'));
    }

    /// A 1.2× rank, which `megac scan`'s detector names over the same steps, is below
    /// [`WARN_SLOWDOWN`]: no warning.
    #[test]
    fn a_rank_below_the_warning_level_is_not_warned_of() {
        assert_eq!(warnings(12), []);
        let segments: Vec<Segments> = (0..4u64)
            .map(|r| {
                let d = if r == 2 { 12e6 } else { 10e6 };
                (2..=6u64)
                    .flat_map(|s| (0..4u32).map(move |k| ((s, k), d)))
                    .collect()
            })
            .collect();
        let late: Vec<Late> = (0..4)
            .map(|r| Late {
                last: if r == 2 { 5 } else { 0 },
                total: 5,
                expected: 1.25,
                wait: if r == 2 { 5e6 } else { 35e6 },
            })
            .collect();
        let (found, _) = detect_slow_ranks(&[0; 4], &segments, 2..=6, &late, 1, &[]);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].ranks, [2]);
        assert!((found[0].score - 1.2).abs() < 1e-9, "{}", found[0].score);
    }

    #[test]
    fn group_keys_are_exact_and_distinct() {
        let a = group_key(&[0, 1]);
        assert_eq!(a, group_key(&[0, 1]));
        assert_ne!(a, group_key(&[0, 2]));
        assert!(a < 2f64.powi(53) && a.fract() == 0.0);
    }
}
