//! `megac-fuzz`: run the fuzz targets (see the crate documentation).
//!
//! ```text
//! megac-fuzz run [--target NAME|all] [--iters N] [--seed S] [--seeds PATH]... [--out DIR] [--timeout SECS]
//! megac-fuzz replay --target NAME FILE...
//! megac-fuzz list
//! ```
//!
//! `run` supervises a worker process that runs the inputs: a panic is caught in the worker
//! and its input saved; when the worker dies (stack overflow, failed allocation, a hang
//! stopped by its watchdog), the supervisor reads the index of the input it was running
//! from a state file, regenerates and saves that input, and restarts the worker after it.
//! Findings go to `DIR/<target>/`; the exit status is 1 when there was any.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use megac_fuzz::{Corpus, Stats, Target, Verdict};

#[global_allocator]
static ALLOC: megac_fuzz::CappedAlloc = megac_fuzz::CappedAlloc;

/// The worker's exit status when its watchdog stops a hung input.
const EXIT_HANG: i32 = 86;

struct Opts {
    targets: Vec<Target>,
    iters: u64,
    seed: u64,
    seeds: Vec<PathBuf>,
    out: PathBuf,
    timeout: u64,
    start: u64,
    state: Option<PathBuf>,
    files: Vec<PathBuf>,
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        targets: Target::ALL.to_vec(),
        iters: 10_000,
        seed: 1,
        seeds: Vec::new(),
        out: PathBuf::from("target/fuzz-findings"),
        timeout: 20,
        start: 0,
        state: None,
        files: Vec::new(),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().cloned().ok_or(format!("{a} needs a value"));
        let number = |v: String| {
            v.replace('_', "")
                .parse::<u64>()
                .map_err(|e| format!("{a} {v}: {e}"))
        };
        match a.as_str() {
            "--target" => {
                let v = value()?;
                o.targets = if v == "all" {
                    Target::ALL.to_vec()
                } else {
                    vec![Target::from_name(&v)
                        .ok_or(format!("unknown target `{v}` (see `megac-fuzz list`)"))?]
                };
            }
            "--iters" => o.iters = number(value()?)?,
            "--seed" => o.seed = number(value()?)?,
            "--start" => o.start = number(value()?)?,
            "--timeout" => o.timeout = number(value()?)?,
            "--seeds" => o.seeds.push(PathBuf::from(value()?)),
            "--out" => o.out = PathBuf::from(value()?),
            "--state" => o.state = Some(PathBuf::from(value()?)),
            f if !f.starts_with("--") => o.files.push(PathBuf::from(f)),
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(o)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((cmd, rest)) = args.split_first() else {
        eprintln!("usage: megac-fuzz run|replay|list [options] (see the source's doc comment)");
        return ExitCode::from(2);
    };
    let opts = match parse(rest) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("megac-fuzz: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match cmd.as_str() {
        "list" => {
            for t in Target::ALL {
                println!("{}", t.name());
            }
            Ok(true)
        }
        "run" => supervise(&opts),
        "worker" => worker(&opts),
        "replay" => replay(&opts),
        other => Err(format!("unknown command `{other}`")),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("megac-fuzz: {e}");
            ExitCode::from(2)
        }
    }
}

fn seed_paths(opts: &Opts) -> Vec<&Path> {
    opts.seeds.iter().map(PathBuf::as_path).collect()
}

/// Save a finding: `DIR/<target>/<kind>-<index>-<hash>` and a `.txt` with the message.
fn save(out: &Path, target: Target, kind: &str, index: u64, input: &[u8], message: &str) {
    let dir = out.join(target.name());
    let _ = std::fs::create_dir_all(&dir);
    let name = format!("{kind}-{index}-{:016x}", megac_fuzz::targets::fnv1a(input));
    let _ = std::fs::write(dir.join(&name), input);
    let _ = std::fs::write(dir.join(format!("{name}.txt")), format!("{message}\n"));
    eprintln!(
        "megac-fuzz: {}: {kind} on input {index} ({} bytes), saved as {}: {message}",
        target.name(),
        input.len(),
        dir.join(&name).display()
    );
}

/// `run`: one supervised worker per target, restarted after each input that kills it.
fn supervise(opts: &Opts) -> Result<bool, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    std::fs::create_dir_all(&opts.out).map_err(|e| format!("{}: {e}", opts.out.display()))?;
    let mut clean = true;
    println!(
        "{:<13} {:>10} {:>10} {:>10} {:>8} {:>9} {:>9}",
        "target", "inputs", "rejected", "accepted", "crashes", "wall s", "inputs/s"
    );
    for &target in &opts.targets {
        let corpus = Corpus::new(target, &seed_paths(opts));
        let state = opts.out.join(format!(".{}.state", target.name()));
        let t0 = Instant::now();
        let mut total = Stats::default();
        let mut start = opts.start;
        let end = opts.start + opts.iters;
        while start < end {
            let _ = std::fs::remove_file(&state);
            let mut cmd = Command::new(&exe);
            cmd.arg("worker")
                .args(["--target", target.name()])
                .args(["--start", &start.to_string()])
                .args(["--iters", &(end - start).to_string()])
                .args(["--seed", &opts.seed.to_string()])
                .args(["--timeout", &opts.timeout.to_string()])
                .arg("--out")
                .arg(&opts.out)
                .arg("--state")
                .arg(&state);
            for s in &opts.seeds {
                cmd.arg("--seeds").arg(s);
            }
            let output = cmd
                .stdin(Stdio::null())
                .stderr(Stdio::inherit())
                .output()
                .map_err(|e| format!("cannot start the worker: {e}"))?;
            let stdout = String::from_utf8_lossy(&output.stdout);
            if output.status.success() {
                let n: Vec<u64> = stdout
                    .lines()
                    .find_map(|l| l.strip_prefix("STATS "))
                    .map(|l| l.split(' ').filter_map(|x| x.parse().ok()).collect())
                    .unwrap_or_default();
                let [tried, accepted, rejected, crashes] = n[..] else {
                    return Err(format!("the worker printed no STATS line: {stdout}"));
                };
                total.tried += tried;
                total.accepted += accepted;
                total.rejected += rejected;
                total.crashes += crashes;
                break;
            }
            // The worker died: find the input it was running from the state file.
            let mut buf = [0u8; 32];
            let read = std::fs::File::open(&state)
                .and_then(|f| f.read_exact_at(&mut buf, 0))
                .is_ok();
            if !read {
                return Err(format!(
                    "the worker died ({}) before its first input",
                    output.status
                ));
            }
            let word =
                |i: usize| u64::from_le_bytes(buf[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
            let (index, accepted, rejected, crashes) = (word(0), word(1), word(2), word(3));
            total.tried += index - start + 1;
            total.accepted += accepted;
            total.rejected += rejected;
            total.crashes += crashes + 1;
            let kind = if output.status.code() == Some(EXIT_HANG) {
                "hang"
            } else {
                "abort"
            };
            let input = corpus.input(opts.seed, index);
            save(
                &opts.out,
                target,
                kind,
                index,
                &input,
                &format!("the worker died: {}", output.status),
            );
            start = index + 1;
        }
        let wall = t0.elapsed().as_secs_f64();
        println!(
            "{:<13} {:>10} {:>10} {:>10} {:>8} {:>9.1} {:>9.0}",
            target.name(),
            total.tried,
            total.rejected,
            total.accepted,
            total.crashes,
            wall,
            total.tried as f64 / wall.max(1e-9)
        );
        let _ = std::io::stdout().flush();
        let _ = std::fs::remove_file(&state);
        clean &= total.crashes == 0;
    }
    Ok(clean)
}

/// `worker`: run inputs `start .. start + iters` of one target in this process.
fn worker(opts: &Opts) -> Result<bool, String> {
    let [target] = opts.targets[..] else {
        return Err("worker needs one --target".to_string());
    };
    let state_path = opts.state.as_ref().ok_or("worker needs --state")?;
    let state = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(state_path)
        .map_err(|e| format!("{}: {e}", state_path.display()))?;
    let corpus = Corpus::new(target, &seed_paths(opts));
    megac_fuzz::install_quiet_panic_hook();

    // The watchdog: an input that runs longer than --timeout ends the worker.
    let current = Arc::new(AtomicU64::new(u64::MAX));
    let since = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    {
        let (current, since) = (current.clone(), since.clone());
        let timeout = opts.timeout.max(1);
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(500));
            let i = current.load(Ordering::SeqCst);
            let started = since.load(Ordering::SeqCst);
            let now = t0.elapsed().as_millis() as u64;
            if i != u64::MAX
                && current.load(Ordering::SeqCst) == i
                && now.saturating_sub(started) > timeout * 1000
            {
                eprintln!("megac-fuzz: input {i} ran for more than {timeout} s: a hang");
                std::process::exit(EXIT_HANG);
            }
        });
    }

    let mut stats = Stats::default();
    let mut per_message = std::collections::HashMap::<String, u32>::new();
    let end = opts.start + opts.iters;
    let progress_every = 250_000;
    for index in opts.start..end {
        let mut words = [0u8; 32];
        for (k, v) in [index, stats.accepted, stats.rejected, stats.crashes]
            .iter()
            .enumerate()
        {
            words[k * 8..k * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        state
            .write_at(&words, 0)
            .map_err(|e| format!("{}: {e}", state_path.display()))?;
        since.store(t0.elapsed().as_millis() as u64, Ordering::SeqCst);
        current.store(index, Ordering::SeqCst);
        let input = corpus.input(opts.seed, index);
        let v = megac_fuzz::run_one(target, &input);
        if let Verdict::Panic(m) = &v {
            // Keep the first three inputs per distinct panic.
            let n = per_message.entry(m.clone()).or_default();
            *n += 1;
            if *n <= 3 {
                save(&opts.out, target, "panic", index, &input, m);
            }
        }
        stats.count(&v);
        if (index + 1 - opts.start).is_multiple_of(progress_every) {
            eprintln!(
                "megac-fuzz: {}: {} inputs ({:.0}/s)",
                target.name(),
                index + 1 - opts.start,
                (index + 1 - opts.start) as f64 / t0.elapsed().as_secs_f64()
            );
        }
    }
    current.store(u64::MAX, Ordering::SeqCst);
    println!(
        "STATS {} {} {} {}",
        stats.tried, stats.accepted, stats.rejected, stats.crashes
    );
    Ok(true)
}

/// `replay`: run files through one target and print each verdict.
fn replay(opts: &Opts) -> Result<bool, String> {
    let [target] = opts.targets[..] else {
        return Err("replay needs one --target".to_string());
    };
    megac_fuzz::install_quiet_panic_hook();
    let mut clean = true;
    for f in &opts.files {
        let bytes = std::fs::read(f).map_err(|e| format!("{}: {e}", f.display()))?;
        match megac_fuzz::run_one(target, &bytes) {
            Verdict::Clean(o) => println!("{}: {o:?}", f.display()),
            Verdict::Panic(m) => {
                clean = false;
                println!("{}: CRASH {m}", f.display());
            }
        }
    }
    Ok(clean)
}
