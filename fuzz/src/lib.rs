//! Fuzzing on stable Rust of every reader of user input: model.toml (+ `--set`),
//! cluster.toml, hostfiles, plan.json, token files (`.bin`, `.txt`) and safetensors.
//!
//! No coverage feedback (libFuzzer needs nightly, afl++ is not installed here): inputs are
//! seeds from the repository (examples, the bad-input corpus, presets, a compiled plan) and
//! generated files, mutated byte by byte and field by field ([`mutate`]). Input `i` of a
//! run is a pure function of (seed, `i`, corpus) ([`Corpus::input`]), so the `megac-fuzz`
//! binary can run the targets in a child process and, when one aborts (stack overflow,
//! allocation failure, a hang stopped by the watchdog), name and save the input that did it.
//!
//! Regression inputs live in `tests/fuzz-corpus/<target>/`; `tests/fuzz_regressions.rs`
//! replays them and runs a few thousand generated inputs per target.

#![warn(missing_docs)]

pub mod mutate;
pub mod seeds;
pub mod targets;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::RefCell;
use std::panic::AssertUnwindSafe;
use std::path::Path;

use mutate::Rng;
pub use targets::{load_plan, Outcome, Target};

/// The largest single allocation [`CappedAlloc`] grants by default: far above what any
/// reader needs for the fuzzer's small inputs, far below what a size read from a header
/// could ask for.
pub const DEFAULT_ALLOC_CAP: usize = 1 << 30;

/// A global allocator that refuses (returns null for) any single allocation larger than
/// [`DEFAULT_ALLOC_CAP`]: a fallible reservation then fails cleanly, an infallible one aborts
/// and the fuzzer reports the input, where without the cap the allocation might succeed by
/// overcommit and hide the bug (or take the machine's memory).
pub struct CappedAlloc;

// SAFETY: defers to the system allocator; refusing an allocation (null) is allowed.
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > DEFAULT_ALLOC_CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > DEFAULT_ALLOC_CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > DEFAULT_ALLOC_CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// The seeds of one target and what the mutator derives from them.
pub struct Corpus {
    /// The target.
    pub target: Target,
    /// Seed inputs (never empty).
    pub seeds: Vec<Vec<u8>>,
    /// Dictionary tokens: the seeds' words, extreme numbers, syntax.
    pub dict: Vec<Vec<u8>>,
    /// Seeds parsed as JSON (plan.json), for field-level mutations.
    json: Vec<serde_json::Value>,
    /// Seeds parsed as safetensors: (header JSON, data bytes).
    tensors: Vec<(serde_json::Value, Vec<u8>)>,
}

/// The largest input the mutator makes for `target`.
fn max_len(target: Target) -> usize {
    match target {
        Target::Plan => 1 << 20,
        _ => 1 << 16,
    }
}

impl Corpus {
    /// The target's built-in seeds ([`seeds::builtin`]) and the files in the repository's
    /// seed folders ([`seeds::repo_files`]), plus every file in `extra` (a file or a folder).
    pub fn new(target: Target, extra: &[&Path]) -> Corpus {
        let mut seeds = seeds::builtin(target);
        seeds.extend(seeds::repo_files(target));
        for p in extra {
            seeds.extend(seeds::read_path(p));
        }
        if seeds.is_empty() {
            seeds.push(Vec::new());
        }
        let dict = mutate::dictionary(&seeds);
        let json = match target {
            Target::Plan => seeds
                .iter()
                .filter_map(|s| serde_json::from_slice(s).ok())
                .collect(),
            _ => Vec::new(),
        };
        let tensors = match target {
            Target::Safetensors => seeds.iter().filter_map(|s| split_safetensors(s)).collect(),
            _ => Vec::new(),
        };
        Corpus {
            target,
            seeds,
            dict,
            json,
            tensors,
        }
    }

    /// Input `index` of the run seeded `seed`: a pure function of both and the corpus.
    pub fn input(&self, seed: u64, index: u64) -> Vec<u8> {
        let mut rng = Rng::for_input(seed, index);
        let max = max_len(self.target);
        // A seed as is, now and then (each seed is a valid or known-bad input).
        if rng.chance(1, 64) {
            return rng.pick(&self.seeds).clone();
        }
        if rng.chance(1, 64) {
            let most = if rng.chance(1, 2) { 16 } else { 4096 };
            let n = rng.below(most);
            return (0..n).map(|_| rng.next_u64() as u8).collect();
        }
        match self.target {
            Target::Plan if !self.json.is_empty() && rng.chance(3, 4) => {
                let mut v = rng.pick(&self.json).clone();
                mutate::mutate_json(&mut rng, &mut v);
                let mut out = serde_json::to_vec(&v).unwrap_or_default();
                if rng.chance(1, 8) {
                    mutate::mutate_bytes(&mut rng, &mut out, &self.dict, &self.seeds, max);
                }
                out
            }
            Target::Safetensors if !self.tensors.is_empty() && rng.chance(2, 3) => {
                let (header, data) = rng.pick(&self.tensors);
                let mut header = header.clone();
                let mut data = data.clone();
                let mut prefix = None;
                match rng.below(8) {
                    0..=4 => mutate::mutate_json(&mut rng, &mut header),
                    5 => {
                        let text = serde_json::to_vec(&header).unwrap_or_default();
                        let n = text.len() as u64;
                        prefix = Some(*rng.pick(&[
                            0,
                            1,
                            n.saturating_sub(1),
                            n + 1,
                            n + data.len() as u64,
                            n + data.len() as u64 + 1,
                            u64::MAX,
                            1 << 40,
                            100_000_001,
                        ]));
                    }
                    6 => {
                        let n = rng.below(data.len() + 1);
                        data.truncate(n);
                    }
                    _ => {
                        if !data.is_empty() && rng.chance(1, 2) {
                            // NaN and Inf as F32, F16 and BF16 bit patterns.
                            let i = rng.below(data.len());
                            const PATTERNS: [&[u8]; 4] = [
                                &[0, 0, 0xc0, 0x7f],
                                &[0, 0, 0x80, 0x7f],
                                &[0x00, 0x7e],
                                &[0xc0, 0x7f],
                            ];
                            let pat = *rng.pick(&PATTERNS);
                            for (k, b) in pat.iter().enumerate() {
                                if let Some(d) = data.get_mut(i + k) {
                                    *d = *b;
                                }
                            }
                        } else {
                            data.extend((0..rng.below(16)).map(|_| rng.next_u64() as u8));
                        }
                    }
                }
                let mut out = join_safetensors(&header, &data, prefix);
                if rng.chance(1, 8) {
                    mutate::mutate_bytes(&mut rng, &mut out, &self.dict, &self.seeds, max);
                }
                out
            }
            _ => {
                let mut data = rng.pick(&self.seeds).clone();
                mutate::mutate_bytes(&mut rng, &mut data, &self.dict, &self.seeds, max);
                if self.target == Target::ModelToml && rng.chance(1, 4) {
                    if !data
                        .windows(targets::SET_MARKER.len())
                        .any(|w| w == targets::SET_MARKER.as_bytes())
                    {
                        data.extend_from_slice(targets::SET_MARKER.as_bytes());
                    }
                    for _ in 0..1 + rng.below(3) {
                        let words: Vec<&[u8]> = (0..1 + rng.below(3))
                            .map(|_| rng.pick(&self.dict).as_slice())
                            .collect();
                        data.extend_from_slice(&words.join(&b"."[..]));
                        if !rng.chance(1, 16) {
                            data.push(b'=');
                        }
                        let value = if rng.chance(1, 2) {
                            mutate::EXTREME_NUMBERS[rng.below(mutate::EXTREME_NUMBERS.len())]
                                .as_bytes()
                                .to_vec()
                        } else {
                            rng.pick(&self.dict).clone()
                        };
                        data.extend_from_slice(&value);
                        data.push(b'\n');
                    }
                }
                data
            }
        }
    }
}

/// A safetensors file's header (parsed) and data, if it has that shape.
fn split_safetensors(bytes: &[u8]) -> Option<(serde_json::Value, Vec<u8>)> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let end = 8usize.checked_add(usize::try_from(n).ok()?)?;
    let header = serde_json::from_slice(bytes.get(8..end)?).ok()?;
    Some((header, bytes[end..].to_vec()))
}

/// A safetensors file from a header, data, and the length prefix (default: the header's).
fn join_safetensors(header: &serde_json::Value, data: &[u8], prefix: Option<u64>) -> Vec<u8> {
    let text = serde_json::to_vec(header).unwrap_or_default();
    let mut out = prefix.unwrap_or(text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(data);
    out
}

thread_local! {
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
    static IN_TARGET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Install (once) a panic hook that, while [`run_one`] runs a target on this thread, records
/// the message and location instead of printing (a million inputs must not print a million
/// backtraces); other panics (a failing test's assertion) go to the previous hook, and so
/// do all when `MEGAC_FUZZ_VERBOSE` is set (with `RUST_BACKTRACE=1`: where a finding panics).
pub fn install_quiet_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !IN_TARGET.with(|t| t.get()) || std::env::var_os("MEGAC_FUZZ_VERBOSE").is_some() {
                previous(info);
            }
            if !IN_TARGET.with(|t| t.get()) {
                return;
            }
            let message = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(non-string panic payload)".to_string());
            let at = info.location().map_or(String::new(), |l| {
                format!(" at {}:{}:{}", l.file(), l.line(), l.column())
            });
            LAST_PANIC.with(|p| *p.borrow_mut() = Some(format!("panic{at}: {message}")));
        }));
    });
}

/// What one input did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Accepted or rejected cleanly.
    Clean(Outcome),
    /// The reader panicked: the message and location.
    Panic(String),
}

/// Run `target` on `bytes`, catching a panic (see [`install_quiet_panic_hook`]).
pub fn run_one(target: Target, bytes: &[u8]) -> Verdict {
    IN_TARGET.with(|t| t.set(true));
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| target.run(bytes)));
    IN_TARGET.with(|t| t.set(false));
    match result {
        Ok(outcome) => Verdict::Clean(outcome),
        Err(_) => Verdict::Panic(
            LAST_PANIC
                .with(|p| p.borrow_mut().take())
                .unwrap_or_else(|| "panic".to_string()),
        ),
    }
}

/// Counts of one run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Inputs tried.
    pub tried: u64,
    /// Inputs the reader accepted.
    pub accepted: u64,
    /// Inputs the reader rejected with an error.
    pub rejected: u64,
    /// Inputs that panicked (or, in the supervised binary, aborted or hung).
    pub crashes: u64,
}

impl Stats {
    /// Count one verdict.
    pub fn count(&mut self, v: &Verdict) {
        self.tried += 1;
        match v {
            Verdict::Clean(Outcome::Accepted) => self.accepted += 1,
            Verdict::Clean(Outcome::Rejected(_)) => self.rejected += 1,
            Verdict::Panic(_) => self.crashes += 1,
        }
    }
}

/// Run inputs `range` of the run seeded `seed` in this thread; `on_crash(index, input,
/// message)` is called for each panic.
pub fn fuzz_range(
    corpus: &Corpus,
    seed: u64,
    range: std::ops::Range<u64>,
    mut on_crash: impl FnMut(u64, &[u8], &str),
) -> Stats {
    let mut stats = Stats::default();
    for index in range {
        let input = corpus.input(seed, index);
        let v = run_one(corpus.target, &input);
        if let Verdict::Panic(m) = &v {
            on_crash(index, &input, m);
        }
        stats.count(&v);
    }
    stats
}
