//! How the ranks on one host share its cores: each rank runs its program on a rayon pool of
//! its own, `cores / ranks` threads (at least one), as each GPU of a node is its own device.
//! With one global pool, the ranks' kernels would queue behind each other's, and a rank's
//! compute would run on threads that are not its own, so `--scan` could not tell a rank's
//! busy time from its wait for a CPU (`scan::Event::duration`).
//!
//! While recording, ranks of one thread each also take turns on the cores ([`Crossover`]):
//! a host's cores do not run equally fast (on a 2-vCPU VM the same loop took 0.35 s on one
//! and 0.48 s on the other at the same moment), and a rank left on the slower one would look
//! like a slow rank to any comparison with its peers.

/// `RAYON_NUM_THREADS`, where set to a positive count.
fn rayon_threads_env() -> Option<usize> {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
}

/// Threads each of `ranks` ranks on this host gets: `RAYON_NUM_THREADS` (the host's total,
/// where set) or the available parallelism, divided evenly, at least 1.
pub fn per_rank(ranks: usize) -> usize {
    let total = rayon_threads_env()
        .or_else(|| std::thread::available_parallelism().ok().map(usize::from))
        .unwrap_or(1);
    (total / ranks.max(1)).max(1)
}

/// Run `f` on a fresh rayon pool of `threads` threads named `rank-R-K` (the program and its
/// kernels' parallel loops stay on them); where the pool cannot be built, on the caller's
/// thread with the global pool.
pub fn on_own_pool<T: Send>(rank: usize, threads: usize, f: impl FnOnce() -> T + Send) -> T {
    match rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |k| format!("rank-{rank}-{k}"))
        .build()
    {
        Ok(pool) => pool.install(f),
        Err(_) => f(),
    }
}

/// An MPI process's share: make the global pool `RAYON_NUM_THREADS` threads (as `megac
/// launch` sets it: the process's share), else `per_rank(local ranks)`, with this (the main)
/// thread as one of them, so the rank's kernels run on the thread that runs its program. The
/// local ranks are the launcher's count of processes on this host ([`mpi_local_slot`]), 1
/// where it gives none. A no-op if the global pool already runs.
pub fn share_host_as_process() {
    // `megac launch` passes each process its share as RAYON_NUM_THREADS (cores / N); one
    // set by hand is the process's too.
    let threads =
        rayon_threads_env().unwrap_or_else(|| per_rank(mpi_local_slot().map_or(1, |(_, n)| n)));
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .use_current_thread()
        .build_global();
}

/// The local ranks on this host as an MPI launcher counts them: (this process's index among
/// them, their number), from `OMPI_COMM_WORLD_LOCAL_RANK`/`_SIZE` or MPICH's
/// `MPI_LOCALRANKID`/`MPI_LOCALNRANKS`; `None` where neither is set.
pub fn mpi_local_slot() -> Option<(usize, usize)> {
    let var = |k: &str| std::env::var(k).ok()?.parse::<usize>().ok();
    [
        ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ]
    .iter()
    .find_map(|(i, n)| Some((var(i)?, var(n)?)))
    .filter(|&(i, n)| i < n)
}

/// The cores the calling thread may run on (its affinity mask); empty if it cannot be read.
#[cfg(target_os = "linux")]
fn affinity() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity writes at most its size,
    // and CPU_ISSET reads it below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Restrict the calling thread to `cores` (a failure leaves it where it is).
#[cfg(target_os = "linux")]
fn pin(cores: &[usize]) {
    // SAFETY: `set` is a valid cpu_set_t; the cores come from `affinity`, below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cores {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// The cores this process may run on: the affinity mask when first asked (before any rank
/// pinned itself: a thread's mask is its own, and new threads inherit the process's).
#[cfg(target_os = "linux")]
fn host_cores() -> &'static [usize] {
    static CORES: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();
    CORES.get_or_init(affinity)
}

/// Which core a rotated rank runs each step on: at step `s`, `cores[(slot + s) % cores.len()]`.
/// The rule [`Crossover`] pins by, and the one `megac scan` reads back from the rank files
/// (`placement`) to tell which ranks shared a core in a step.
#[derive(Clone, Debug, PartialEq)]
pub struct CoreTurns {
    /// The rank's index among the host's ranks.
    pub slot: usize,
    /// The cores taken in turn (at least one).
    pub cores: Vec<usize>,
}

impl CoreTurns {
    /// The core of step `step`.
    pub fn core(&self, step: u64) -> usize {
        self.cores[(self.slot as u64 + step) as usize % self.cores.len()]
    }
}

/// The host's name (`/proc/sys/kernel/hostname`; empty where it cannot be read): ranks of
/// one host share its cores, ranks of two hosts share none.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Crossover placement of a rank whose program and kernels run on one thread (the host has
/// no more cores than ranks): at step `s` the rank with index `slot` among the host's ranks
/// runs on core `slot + s` (mod `period`) of the first `period` = min(cores, ranks) cores
/// ([`CoreTurns`]). Over any `period` consecutive steps every rank has run one step on each
/// of those cores, so a core's speed is no rank's: `megac scan` compares a rank with its
/// peers over such blocks of steps (the rank files' `rotation`). Used while recording
/// (`--trace`, `--scan`).
#[derive(Clone, Debug, PartialEq)]
pub struct Crossover {
    turns: CoreTurns,
}

impl Crossover {
    /// The placement of the rank with index `slot` of `ranks` on this host, when it runs on
    /// one thread (the current rayon pool has one) and there are at least two cores and two
    /// ranks to rotate; else `None`.
    pub fn new(slot: usize, ranks: usize) -> Option<Crossover> {
        #[cfg(target_os = "linux")]
        {
            let cores = host_cores();
            let period = cores.len().min(ranks);
            (rayon::current_num_threads() == 1 && period >= 2 && slot < ranks).then(|| Crossover {
                turns: CoreTurns {
                    slot,
                    cores: cores[..period].to_vec(),
                },
            })
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = (slot, ranks);
            None
        }
    }

    /// Steps over which every rank has visited every core once.
    pub fn period(&self) -> usize {
        self.turns.cores.len()
    }

    /// The rank's turns on the cores.
    pub fn turns(&self) -> &CoreTurns {
        &self.turns
    }

    /// The core the rank runs step `step` on.
    pub fn core(&self, step: u64) -> usize {
        self.turns.core(step)
    }

    /// Let the calling thread run on every core of the host again (before the closing clock
    /// sync: pinned ranks sharing a core answer a ping late, and the alignment's residual
    /// grew from 3 to 18 µs at the 99th percentile on local threads).
    pub fn release(&self) {
        #[cfg(target_os = "linux")]
        pin(host_cores());
    }

    /// Pin the calling thread (the rank's) to its core for step `step`. A failure leaves
    /// the thread where it is (the comparison is then only as fair as the scheduler).
    pub fn enter_step(&self, step: u64) {
        #[cfg(target_os = "linux")]
        pin(&[self.core(step)]);
        #[cfg(not(target_os = "linux"))]
        let _ = step;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_pool_has_its_own_threads() {
        let (inside, name) = on_own_pool(3, 1, || {
            (
                rayon::current_num_threads(),
                std::thread::current().name().map(str::to_string),
            )
        });
        assert_eq!(inside, 1);
        assert_eq!(name.as_deref(), Some("rank-3-0"));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn crossover_takes_turns_on_the_cores_and_pins_the_thread() {
        let cores = host_cores().to_vec();
        // Off a one-thread pool there is no placement.
        let many = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        assert_eq!(many.install(|| Crossover::new(0, 4)), None);
        let got = on_own_pool(0, 1, || {
            let x = Crossover::new(1, 4)?;
            x.enter_step(2);
            let pinned = affinity();
            Some((x, pinned))
        });
        if cores.len() < 2 {
            assert!(got.is_none(), "one core: nothing to rotate");
            return;
        }
        let (x, pinned) = got.unwrap();
        let period = cores.len().min(4);
        assert_eq!(x.period(), period);
        assert_eq!(pinned, vec![cores[(1 + 2) % period]]);
        // Over any `period` consecutive steps, each rank visits every core once.
        for slot in 0..4 {
            let x = Crossover {
                turns: CoreTurns {
                    slot,
                    cores: cores[..period].to_vec(),
                },
            };
            let mut seen: Vec<usize> = (5..5 + period as u64).map(|s| x.core(s)).collect();
            seen.sort_unstable();
            assert_eq!(seen, cores[..period].to_vec());
        }
    }

    #[test]
    fn ranks_divide_the_cores() {
        let one = per_rank(1);
        assert!(one >= 1);
        assert_eq!(per_rank(one * 4), 1);
        assert_eq!(per_rank(0), one);
    }
}
