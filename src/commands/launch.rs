//! `megac launch -n N [--hostfile F] PLAN_DIR [run options]`: run a plan on N processes with
//! mpirun, one process per rank (`megac run PLAN_DIR --comm mpi` in each; `--comm nccl` among
//! the run options, with `--device cuda`, makes it `--comm nccl`).
//!
//! The mpirun arguments, and why:
//!
//! - `-np N`; `--hostfile F` when given (then the ranks may span nodes).
//! - `--oversubscribe` when N exceeds this machine's cores (without a hostfile): mpirun
//!   refuses to start more processes than slots otherwise ("not enough slots"); with it also
//!   `--mca mpi_yield_when_idle 1`, so ranks waiting in MPI yield the cores they share.
//! - `--allow-run-as-root` and `OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1` in
//!   mpirun's environment, only when running as root (containers often are): OpenMPI refuses
//!   root otherwise.
//! - `--bind-to none`: OpenMPI binds each rank to one core by default when N ≤ 2, which would
//!   leave one kernel thread per rank; instead each rank gets `RAYON_NUM_THREADS` = cores / N
//!   (`-x`, without a hostfile; a `RAYON_NUM_THREADS` already set is passed on as it is).
//! - `--mca pml ob1 --mca btl self,vader` (`self,vader,tcp` with a hostfile) and
//!   `--mca btl_vader_single_copy_mechanism none`: shared memory between the ranks of a node
//!   (TCP between nodes), without UCX, InfiniBand or the cross-memory-attach single copy,
//!   which need devices or ptrace rights that containers often lack; they work everywhere.
//!   An `OMPI_MCA_<name>` environment variable for any of these overrides our choice (the
//!   `--mca` argument is left out).
//!
//! When our stderr is a terminal, `-x MEGAC_PROGRESS=1` asks rank 0 for progress lines (the
//! ranks' own stderr is a pipe to mpirun).
//!
//! Signals: SIGINT, SIGTERM and SIGHUP sent to `megac launch` are forwarded to mpirun, which
//! forwards them to the ranks and ends the job; megac then exits with mpirun's status.
//! mpirun returns the first non-zero exit code of the ranks (128 + signal when killed).

use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};

use clap::Parser;

/// Options of `megac launch`.
#[derive(clap::Args)]
pub struct LaunchArgs {
    /// Number of processes, one per rank of the plan.
    #[arg(short = 'n', long = "np", value_name = "N")]
    pub n: usize,
    /// OpenMPI hostfile, one node per line (`node1 slots=8`); without it, every process runs
    /// on this machine.
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// Plan directory written by `megac compile` (the same path on every node).
    #[arg(value_name = "PLAN_DIR")]
    pub plan: PathBuf,
    /// Options of `megac run` (see `megac run --help`), passed to every rank.
    #[arg(
        value_name = "RUN OPTIONS",
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    pub run: Vec<OsString>,
}

/// The mpirun command line (program, arguments) and the environment variables it adds.
#[derive(Debug, PartialEq)]
pub struct MpirunCommand {
    /// Environment variables set for mpirun.
    pub env: Vec<(String, String)>,
    /// mpirun's path.
    pub program: PathBuf,
    /// Every argument after the program.
    pub args: Vec<OsString>,
}

/// What the mpirun arguments depend on besides the command line.
pub struct Host {
    /// Cores this process may use.
    pub cores: usize,
    /// Whether we run as root.
    pub root: bool,
    /// Whether our stderr is a terminal (then rank 0 prints progress lines).
    pub tty: bool,
    /// Looks up an environment variable.
    pub env: fn(&str) -> Option<OsString>,
}

/// The communicator the ranks run with: `nccl` when the run options say `--comm nccl`
/// (taken out of them), else `mpi`; and the other run options.
fn split_comm(run: &[OsString]) -> (&'static str, Vec<OsString>) {
    let mut rest = Vec::new();
    let mut comm = "mpi";
    let mut i = 0;
    while i < run.len() {
        if run[i] == "--comm" && run.get(i + 1).is_some_and(|v| v == "nccl") {
            comm = "nccl";
            i += 2;
            continue;
        }
        if run[i] == "--comm=nccl" {
            comm = "nccl";
        } else {
            rest.push(run[i].clone());
        }
        i += 1;
    }
    (comm, rest)
}

/// Build the mpirun command that runs `megac run PLAN --comm mpi RUN_OPTIONS` (`exe` is this
/// megac) on `args.n` processes.
pub fn mpirun_command(args: &LaunchArgs, mpirun: &Path, exe: &Path, host: &Host) -> MpirunCommand {
    let mut env = Vec::new();
    let mut a: Vec<OsString> = Vec::new();
    let mut push = |items: &[&str]| a.extend(items.iter().map(OsString::from));
    push(&["-np", &args.n.to_string()]);
    let oversubscribe = args.hostfile.is_none() && args.n > host.cores;
    if oversubscribe {
        push(&["--oversubscribe"]);
    }
    if host.root {
        push(&["--allow-run-as-root"]);
        env.push(("OMPI_ALLOW_RUN_AS_ROOT".to_string(), "1".to_string()));
        env.push((
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM".to_string(),
            "1".to_string(),
        ));
    }
    push(&["--bind-to", "none"]);
    let btl = if args.hostfile.is_some() {
        "self,vader,tcp"
    } else {
        "self,vader"
    };
    let mut mca = vec![
        ("pml", "ob1"),
        ("btl", btl),
        ("btl_vader_single_copy_mechanism", "none"),
    ];
    if oversubscribe {
        mca.push(("mpi_yield_when_idle", "1"));
    }
    for (name, value) in mca {
        if (host.env)(&format!("OMPI_MCA_{name}")).is_none() {
            push(&["--mca", name, value]);
        }
    }
    if (host.env)("RAYON_NUM_THREADS").is_some() {
        push(&["-x", "RAYON_NUM_THREADS"]); // the user's choice, on every node
    } else if args.hostfile.is_none() {
        let threads = (host.cores / args.n.max(1)).max(1);
        push(&["-x", &format!("RAYON_NUM_THREADS={threads}")]);
    }
    // The communication timeout, and the tests' failure injection, reach every node.
    for name in ["MEGAC_COMM_TIMEOUT", "MEGAC_TEST_FAIL"] {
        if (host.env)(name).is_some() {
            push(&["-x", name]);
        }
    }
    if host.tty && (host.env)("MEGAC_PROGRESS").is_none() {
        // The ranks' stderr is a pipe to mpirun: ask rank 0 for progress lines explicitly.
        push(&["-x", "MEGAC_PROGRESS=1"]);
    }
    if let Some(f) = &args.hostfile {
        a.push("--hostfile".into());
        a.push(f.clone().into_os_string());
    }
    a.push(exe.as_os_str().to_owned());
    a.push("run".into());
    a.push(args.plan.clone().into_os_string());
    a.push("--comm".into());
    let (comm, rest) = split_comm(&args.run);
    a.push(comm.into());
    a.extend(rest);
    MpirunCommand {
        env,
        program: mpirun.to_path_buf(),
        args: a,
    }
}

impl MpirunCommand {
    /// The command as one shell line (environment assignments first).
    pub fn shell_line(&self) -> String {
        let mut words: Vec<String> = self.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        words.push(quote(self.program.as_os_str()));
        words.extend(self.args.iter().map(|a| quote(a)));
        words.join(" ")
    }
}

/// `s` quoted for a POSIX shell where needed.
fn quote(s: &OsStr) -> String {
    let s = s.to_string_lossy();
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_./=:,@%+-".contains(c));
    if plain {
        s.into_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Check an OpenMPI hostfile (`host [slots=N] [max_slots=N]` per line, `#` comments) for
/// `n` processes (see [`megac_runtime::hostfile::check_hostfile`]), as an `error: ...` line.
pub fn check_hostfile(path: &Path, text: &str, n: usize) -> Result<(), String> {
    megac_runtime::hostfile::check_hostfile(path, text, n).map_err(|e| format!("error: {e}"))
}

/// mpirun's path: `$MEGAC_MPIRUN`, else `mpirun` or `mpiexec` on PATH.
fn find_mpirun() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("MEGAC_MPIRUN") {
        return Ok(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for name in ["mpirun", "mpiexec"] {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    Err(
        "error: megac launch: mpirun is not on PATH; install OpenMPI (Debian: apt-get install \
         openmpi-bin libopenmpi-dev) or set MEGAC_MPIRUN to its path"
            .to_string(),
    )
}

/// The pid of the running mpirun, for the signal handler (0 when none).
static CHILD: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward_signal(sig: libc::c_int) {
    let pid = CHILD.load(Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

/// `megac launch`.
pub fn run(args: &LaunchArgs) -> Result<(), String> {
    // Every rank would run `megac run --comm mpi`: without MPI in this build, say so first.
    if !cfg!(feature = "mpi") {
        return Err(super::no_mpi("megac launch", None));
    }
    if args.n == 0 {
        return Err("error: megac launch: -n must be at least 1".to_string());
    }
    let (_, rest) = split_comm(&args.run);
    if rest
        .iter()
        .any(|a| a == "--comm" || a.to_string_lossy().starts_with("--comm="))
    {
        return Err(
            "error: megac launch: --comm is not a launch option (every rank runs with --comm \
             mpi, or --comm nccl with --device cuda)"
                .to_string(),
        );
    }
    // Check the run options here, once, rather than in every rank.
    let mut argv: Vec<OsString> = vec!["megac".into(), "run".into(), args.plan.clone().into()];
    argv.extend(args.run.iter().cloned());
    if let Err(e) = crate::Cli::try_parse_from(&argv) {
        return Err(format!(
            "{}(megac launch passes the options after PLAN_DIR to `megac run` on every rank)",
            e.render()
        ));
    }
    let plan = super::inspect::read_plan(&args.plan)?;
    let world = plan.mesh.world_size();
    if world != args.n {
        return Err(format!(
            "error: the plan {} has {world} rank{} but megac launch -n {} would start {} \
             process{}; use -n {world}",
            args.plan.display(),
            if world == 1 { "" } else { "s" },
            args.n,
            args.n,
            if args.n == 1 { "" } else { "es" },
        ));
    }
    if let Some(f) = &args.hostfile {
        let text = megac_ir::file::read_text(f, megac_ir::file::MAX_CONFIG_BYTES)
            .map_err(|e| format!("error: --hostfile {}: cannot read: {e}", f.display()))?;
        check_hostfile(f, &text, args.n)?;
    }
    let mpirun = find_mpirun()?;
    let exe = std::env::current_exe()
        .map_err(|e| format!("error: megac launch: cannot find this executable: {e}"))?;
    let host = Host {
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        // SAFETY: geteuid has no preconditions and cannot fail.
        root: unsafe { libc::geteuid() } == 0,
        tty: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        env: |name| std::env::var_os(name),
    };
    let cmd = mpirun_command(args, &mpirun, &exe, &host);
    eprintln!("{}", cmd.shell_line());
    let mut child = Command::new(&cmd.program)
        .args(&cmd.args)
        .envs(cmd.env.iter().map(|(k, v)| (k, v)))
        .spawn()
        .map_err(|e| {
            format!(
                "error: megac launch: cannot start {}: {e}",
                mpirun.display()
            )
        })?;
    CHILD.store(child.id() as i32, Ordering::SeqCst);
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only reads an atomic and calls kill (async-signal-safe).
        unsafe {
            libc::signal(sig, forward_signal as *const () as libc::sighandler_t);
        }
    }
    let status = child
        .wait()
        .map_err(|e| format!("error: megac launch: waiting for mpirun: {e}"))?;
    CHILD.store(0, Ordering::SeqCst);
    let code = match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        (None, None) => 1,
    };
    if code != 0 {
        // mpirun and the ranks have reported the failure (naming the rank); pass its exit
        // code on.
        let _ = std::io::stdout().flush();
        eprintln!(
            "error: megac launch: the job failed (mpirun exit status {code}); the failing rank \
             is named above"
        );
        std::process::exit(code);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(n: usize, hostfile: Option<&str>) -> LaunchArgs {
        LaunchArgs {
            n,
            hostfile: hostfile.map(PathBuf::from),
            plan: PathBuf::from("/tmp/my plan"),
            run: vec!["--steps".into(), "3".into()],
        }
    }

    fn line(a: &LaunchArgs, cores: usize, root: bool) -> String {
        let host = Host {
            cores,
            root,
            tty: false,
            env: |_| None,
        };
        mpirun_command(
            a,
            Path::new("/usr/bin/mpirun"),
            Path::new("/bin/megac"),
            &host,
        )
        .shell_line()
    }

    #[test]
    fn hostfiles_are_checked() {
        let p = Path::new("hosts");
        let ok = "# nodes\nnode1 slots=2\n\nnode2 slots=2 max_slots=4 # two more\n";
        assert_eq!(check_hostfile(p, ok, 4), Ok(()));
        assert_eq!(check_hostfile(p, "node1\nnode2\n", 64), Ok(()));
        let e = check_hostfile(p, ok, 5).unwrap_err();
        assert!(
            e.contains("4 slots on 2 hosts") && e.contains("-n 5"),
            "{e}"
        );
        let e = check_hostfile(p, "node1 slots=two\n", 1).unwrap_err();
        assert!(e.contains("hosts:1") && e.contains("slots=two"), "{e}");
        let e = check_hostfile(p, "node1 slots=1\nnode2 cpus=4\n", 1).unwrap_err();
        assert!(e.contains("hosts:2") && e.contains("cpus=4"), "{e}");
        let e = check_hostfile(p, "# nothing\n\n", 1).unwrap_err();
        assert!(e.contains("no hosts"), "{e}");
    }

    #[test]
    fn comm_nccl_replaces_mpi_for_every_rank() {
        for run in [
            vec!["--device", "cuda", "--comm", "nccl", "--steps", "3"],
            vec!["--comm=nccl", "--device", "cuda", "--steps", "3"],
        ] {
            let a = LaunchArgs {
                run: run.into_iter().map(OsString::from).collect(),
                ..args(2, None)
            };
            let l = line(&a, 16, false);
            assert!(l.ends_with("--comm nccl --device cuda --steps 3"), "{l}");
            assert!(!l.contains("--comm mpi"), "{l}");
        }
        // Any other --comm stays in the options (and `run` refuses it).
        let (comm, rest) = split_comm(&["--comm".into(), "local".into()]);
        assert_eq!(comm, "mpi");
        assert_eq!(rest.len(), 2);
    }

    #[test]
    fn mpirun_arguments() {
        assert_eq!(
            line(&args(2, None), 16, false),
            "/usr/bin/mpirun -np 2 --bind-to none --mca pml ob1 --mca btl self,vader \
             --mca btl_vader_single_copy_mechanism none -x RAYON_NUM_THREADS=8 \
             /bin/megac run '/tmp/my plan' --comm mpi --steps 3"
        );
        assert_eq!(
            line(&args(4, None), 2, true),
            "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 /usr/bin/mpirun -np 4 \
             --oversubscribe --allow-run-as-root --bind-to none --mca pml ob1 \
             --mca btl self,vader --mca btl_vader_single_copy_mechanism none \
             --mca mpi_yield_when_idle 1 -x RAYON_NUM_THREADS=1 \
             /bin/megac run '/tmp/my plan' --comm mpi --steps 3"
        );
        assert_eq!(
            line(&args(8, Some("hosts")), 2, false),
            "/usr/bin/mpirun -np 8 --bind-to none --mca pml ob1 --mca btl self,vader,tcp \
             --mca btl_vader_single_copy_mechanism none --hostfile hosts \
             /bin/megac run '/tmp/my plan' --comm mpi --steps 3"
        );
        // The user's MCA settings and thread count win; a terminal gets progress lines.
        let host = Host {
            cores: 16,
            root: false,
            tty: true,
            env: |name| {
                ["OMPI_MCA_btl", "RAYON_NUM_THREADS"]
                    .contains(&name)
                    .then(|| "x".into())
            },
        };
        let cmd = mpirun_command(
            &args(2, None),
            Path::new("mpirun"),
            Path::new("megac"),
            &host,
        );
        assert_eq!(
            cmd.shell_line(),
            "mpirun -np 2 --bind-to none --mca pml ob1 --mca btl_vader_single_copy_mechanism none \
             -x RAYON_NUM_THREADS -x MEGAC_PROGRESS=1 megac run '/tmp/my plan' --comm mpi --steps 3"
        );
    }
}
