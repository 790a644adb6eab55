//! The MPI communicator against the local one on 4 processes: bit for bit when
//! deterministic, to fp32 rounding with MPI's native collectives.
//!
//! This test runs without the libtest harness: started by `cargo test`, it starts itself
//! under `mpirun -np 4`; each of those processes runs every scenario on the [`MpiComm`]
//! with `set_deterministic(true)`, once more with MPI's native collectives, and once on an
//! in-process local world of 4 threads, and checks that its rank's deterministic results are
//! identical to the local ones (sub-groups, uneven lengths, NaN in max, all-to-all with
//! uneven splits, point-to-point order, tagged probes and receives out of order, errors),
//! and that the native ones are identical where nothing is summed and within the rounding
//! bound of a reordered sum where something is, with every member of a group holding the
//! same bits of each all-reduced sum.

use std::process::Command;

use megac_runtime::comm::Communicator;
use megac_runtime::error::RuntimeError;
use megac_runtime::local_comm::run_ranks;
use megac_runtime::mpi_comm::MpiComm;

const RANKS: usize = 4;
const CHILD: &str = "MEGAC_MPI_COLLECTIVES_CHILD";

/// Deterministic values of mixed magnitudes, so a different summation order shows.
fn values(rank: usize, n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (rank * 7919 + i * 104_729 + salt * 1_299_709) % 10_007;
            let scale = [1e-3, 1.0, 1e3, 1e-1, 7.0][(i + rank) % 5];
            (h as f32 / 10_007.0 - 0.5) * scale
        })
        .collect()
}

/// Every collective and point-to-point pattern; the results of this rank, in order.
fn scenarios(comm: &mut dyn Communicator) -> Result<Vec<Vec<f32>>, RuntimeError> {
    let r = comm.rank();
    let world: Vec<usize> = (0..RANKS).collect();
    let pairs = if r.is_multiple_of(2) { [0, 2] } else { [1, 3] }; // a "dp" group
    let halves = if r < 2 { [0, 1] } else { [2, 3] }; // a "tp" group
    let mut out = Vec::new();

    for (salt, len) in [(1, 37), (2, 2), (3, 0), (4, 1000)] {
        let mut x = values(r, len, salt);
        comm.all_reduce_sum(&world, &mut x)?;
        out.push(x);
    }
    let mut x = values(r, 29, 5);
    comm.all_reduce_sum(&pairs, &mut x)?;
    out.push(x);
    let mut x = values(r, 31, 6);
    comm.all_reduce_sum(&halves, &mut x)?;
    out.push(x);

    let mut x = values(r, 23, 7);
    if r == 2 {
        x[3] = f32::NAN;
    }
    comm.all_reduce_max(&world, &mut x)?;
    out.push(x);
    let mut x = values(r, 9, 8);
    comm.all_reduce_max(&halves, &mut x)?;
    out.push(x);

    let mut y: Vec<f64> = values(r, 13, 9)
        .iter()
        .map(|&v| f64::from(v) * 1e7)
        .collect();
    comm.all_reduce_sum_f64(&world, &mut y)?;
    out.push(
        y.iter()
            .flat_map(|v| {
                [
                    f32::from_bits((v.to_bits() >> 32) as u32),
                    f32::from_bits(v.to_bits() as u32),
                ]
            })
            .collect(),
    );
    out.push(y.iter().map(|&v| v as f32).collect());

    let send = values(r, 5, 10);
    let mut recv = vec![0.0; 10];
    comm.all_gather(&pairs, &send, &mut recv)?;
    out.push(recv);
    let mut recv = vec![0.0; 20];
    comm.all_gather(&world, &send, &mut recv)?;
    out.push(recv);

    let send = values(r, 4 * 6, 11);
    let mut recv = vec![0.0; 6];
    comm.reduce_scatter_sum(&world, &send, &mut recv)?;
    out.push(recv);
    let send = values(r, 2 * 7, 12);
    let mut recv = vec![0.0; 7];
    comm.reduce_scatter_sum(&halves, &send, &mut recv)?;
    out.push(recv);

    // All-to-all: member i sends (i + 2j) % 4 elements to member j (some zero).
    let split = |i: usize, j: usize| (i + 2 * j) % 4;
    let offsets = |sizes: Vec<usize>| {
        let mut o = vec![0];
        for s in sizes {
            o.push(o.last().unwrap() + s);
        }
        o
    };
    let send_off = offsets((0..RANKS).map(|j| split(r, j)).collect());
    let recv_off = offsets((0..RANKS).map(|j| split(j, r)).collect());
    let send = values(r, send_off[RANKS], 13);
    let mut recv = vec![0.0; recv_off[RANKS]];
    comm.all_to_all(&world, &send, &send_off, &mut recv, &recv_off)?;
    out.push(recv);
    // Within a pair: member i sends [[1, 3], [2, 0]][i][j] elements to member j.
    let split = |i: usize, j: usize| [[1, 3], [2, 0]][i][j];
    let me = halves.iter().position(|&m| m == r).unwrap();
    let send_off = offsets((0..2).map(|j| split(me, j)).collect());
    let recv_off = offsets((0..2).map(|j| split(j, me)).collect());
    let send = values(r, send_off[2], 14);
    let mut recv = vec![0.0; recv_off[2]];
    comm.all_to_all(&halves, &send, &send_off, &mut recv, &recv_off)?;
    out.push(recv);

    // Point to point: two messages around the ring, then a large exchange in both directions
    // with both sends first (send must not wait for the receiver).
    let next = (r + 1) % RANKS;
    let prev = (r + RANKS - 1) % RANKS;
    comm.send(next, &values(r, 3, 15))?;
    comm.send(next, &values(r, 4, 16))?;
    let mut a = vec![0.0; 3];
    let mut b = vec![0.0; 4];
    comm.recv(prev, &mut a)?;
    comm.recv(prev, &mut b)?;
    out.push(a);
    out.push(b);
    let peer = r ^ 1;
    comm.send(peer, &values(r, 1 << 20, 17))?;
    let mut big = vec![0.0; 1 << 20];
    comm.recv(peer, &mut big)?;
    out.push(big[..64].to_vec());
    out.push(vec![big.iter().sum()]);

    // Tagged point to point, as a dynamic pipeline uses it: two tagged messages to the next
    // rank; the receiver probes them with a tag that was never sent between them until both
    // have come (the answers go into the results: [1, 0, 1]), then receives them in the
    // other order.
    comm.send_tagged(next, 11, &values(r, 6, 19))?;
    comm.send_tagged(next, 13, &values(r, 1 << 16, 20))?;
    let wanted = [(prev, 11), (prev, 12), (prev, 13)];
    let mut answers = comm.probe_tagged(&wanted)?;
    for _ in 0..10_000 {
        if answers[0] && answers[2] {
            break;
        }
        comm.wait_for_mail(std::time::Duration::from_millis(1))?;
        answers = comm.probe_tagged(&wanted)?;
    }
    out.push(answers.iter().map(|&a| f32::from(u8::from(a))).collect());
    let mut later = vec![0.0; 1 << 16];
    comm.recv_tagged(prev, 13, &mut later)?;
    let mut first = vec![0.0; 6];
    comm.recv_tagged(prev, 11, &mut first)?;
    out.push(first);
    out.push(later[..64].to_vec());
    out.push(vec![later.iter().sum()]);
    // Received: no longer there.
    out.push(
        comm.probe_tagged(&wanted)?
            .iter()
            .map(|&a| f32::from(u8::from(a)))
            .collect(),
    );

    // Errors: a group without this rank, a receive of the wrong size.
    let other: Vec<usize> = (0..RANKS).filter(|&m| m != r).take(2).collect();
    let not_member = comm.all_reduce_sum(&other, &mut [0.0]).is_err();
    comm.send(next, &values(r, 5, 18))?;
    let wrong_size = comm.recv(prev, &mut [0.0; 4]).is_err();
    out.push(vec![
        f32::from(u8::from(not_member)),
        f32::from(u8::from(wrong_size)),
    ]);
    Ok(out)
}

fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> Result<(), String> {
    if a.len() != b.len() {
        return Err(format!("{} results against {}", a.len(), b.len()));
    }
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        let xb: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
        let yb: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
        if xb != yb {
            return Err(format!(
                "result #{k} differs:\n  mpi   {x:?}\n  local {y:?}"
            ));
        }
    }
    Ok(())
}

/// The results of [`scenarios`] that are sums: (index, group, length, salt of the values,
/// reduce-scatter or all-reduce). Index 8 (the f64 sum's bits) is left out: a reordered sum
/// may differ in its last bits.
fn sums(r: usize) -> Vec<(usize, Vec<usize>, usize, usize, bool)> {
    let world: Vec<usize> = (0..RANKS).collect();
    let pairs = if r.is_multiple_of(2) {
        vec![0, 2]
    } else {
        vec![1, 3]
    };
    let halves = if r < 2 { vec![0, 1] } else { vec![2, 3] };
    vec![
        (0, world.clone(), 37, 1, false),
        (1, world.clone(), 2, 2, false),
        (2, world.clone(), 0, 3, false),
        (3, world.clone(), 1000, 4, false),
        (4, pairs, 29, 5, false),
        (5, halves.clone(), 31, 6, false),
        (9, world.clone(), 13, 9, false),
        (12, world, 4 * 6, 11, true),
        (13, halves, 2 * 7, 12, true),
    ]
}

/// Compare rank `r`'s native results with the local ones: exact where nothing is summed;
/// within 2·members·ε·Σ|terms| (the bound of a sum in any order) where something is.
fn close_enough(r: usize, native: &[Vec<f32>], local: &[Vec<f32>]) -> Result<(), String> {
    if native.len() != local.len() {
        return Err(format!("{} results against {}", native.len(), local.len()));
    }
    let sums = sums(r);
    for (k, (x, y)) in native.iter().zip(local).enumerate() {
        if k == 8 {
            continue;
        }
        let Some((_, group, len, salt, scatter)) = sums.iter().find(|s| s.0 == k) else {
            same_bits(&native[k..=k], &local[k..=k]).map_err(|e| format!("#{k}: {e}"))?;
            continue;
        };
        let scale = if k == 9 { 1e7 } else { 1.0 };
        let mut bound = vec![0f64; *len];
        for &m in group {
            for (b, v) in bound.iter_mut().zip(values(m, *len, *salt)) {
                *b += f64::from(v.abs()) * scale;
            }
        }
        if *scatter {
            let me = group.iter().position(|&m| m == r).unwrap();
            let c = len / group.len();
            bound = bound[me * c..(me + 1) * c].to_vec();
        }
        if x.len() != y.len() || x.len() != bound.len() {
            return Err(format!(
                "result #{k}: lengths {} {} {}",
                x.len(),
                y.len(),
                bound.len()
            ));
        }
        for (i, ((a, b), s)) in x.iter().zip(y).zip(&bound).enumerate() {
            let tol = 2.0 * group.len() as f64 * f64::from(f32::EPSILON) * s;
            if (f64::from(*a) - f64::from(*b)).abs() > tol {
                return Err(format!(
                    "result #{k}[{i}]: native {a} against local {b} (bound {tol})"
                ));
            }
        }
    }
    Ok(())
}

/// Every member of each all-reduce's group holds the same bits of its result (an
/// all-gather of them over the group).
fn replicas_agree(comm: &mut dyn Communicator, native: &[Vec<f32>]) -> Result<(), String> {
    let r = comm.rank();
    for (k, group, ..) in sums(r).into_iter().filter(|s| !s.4) {
        let mine = &native[k];
        let mut all = vec![0f32; mine.len() * group.len()];
        comm.all_gather(&group, mine, &mut all)
            .map_err(|e| e.to_string())?;
        for (m, theirs) in group.iter().zip(all.chunks_exact(mine.len().max(1))) {
            if mine.is_empty() {
                break;
            }
            let (a, b): (Vec<u32>, Vec<u32>) = (
                mine.iter().map(|v| v.to_bits()).collect(),
                theirs.iter().map(|v| v.to_bits()).collect(),
            );
            if a != b {
                return Err(format!(
                    "rank {r}: result #{k} differs from rank {m}'s on group {group:?}"
                ));
            }
        }
    }
    Ok(())
}

fn child() -> Result<(), String> {
    let (universe, _) = mpi::initialize_with_threading(mpi::Threading::Serialized)
        .ok_or("MPI is already initialised")?;
    let mut comm = MpiComm::new(universe.world()).map_err(|e| e.to_string())?;
    let rank = comm.rank();
    if MpiComm::new(universe.world()).is_ok() {
        return Err("a second MpiComm in one process was allowed".to_string());
    }
    if comm.size() != RANKS {
        return Err(format!("started on {} processes", comm.size()));
    }
    if comm.deterministic() {
        return Err("the communicator is deterministic by default".to_string());
    }
    comm.set_deterministic(true);
    let got = scenarios(&mut comm).map_err(|e| format!("mpi: {e}"))?;
    comm.set_deterministic(false);
    let native = scenarios(&mut comm).map_err(|e| format!("mpi native: {e}"))?;
    replicas_agree(&mut comm, &native)?;
    let mut local =
        run_ranks(RANKS, |mut c| scenarios(&mut c)).map_err(|e| format!("local: {e}"))?;
    let want = local.swap_remove(rank);
    same_bits(&got, &want).map_err(|e| format!("rank {rank}: {e}"))?;
    close_enough(rank, &native, &want).map_err(|e| format!("rank {rank}: native: {e}"))?;
    let flags = got.last().unwrap();
    if flags != &[1.0, 1.0] {
        return Err(format!("rank {rank}: expected both errors, got {flags:?}"));
    }
    drop(comm);
    drop(universe);
    Ok(())
}

fn main() {
    if std::env::var_os(CHILD).is_some() {
        if let Err(e) = child() {
            eprintln!("{e}");
            std::process::exit(1);
        }
        return;
    }
    // `cargo test -- --list` and filters: this file is one test.
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        println!("mpi_collectives: test");
        return;
    }
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    if !filters.is_empty()
        && !filters
            .iter()
            .any(|f| "mpi_collectives".contains(f.as_str()))
    {
        return;
    }
    let exe = std::env::current_exe().expect("test executable");
    let started = std::time::Instant::now();
    let out = Command::new("mpirun")
        .args(["-np", "4", "--oversubscribe", "--bind-to", "none"])
        .args(["--mca", "pml", "ob1", "--mca", "btl", "self,vader"])
        .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
        .args(["--mca", "mpi_yield_when_idle", "1"])
        .arg(&exe)
        .env(CHILD, "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("start mpirun (install OpenMPI: apt-get install openmpi-bin libopenmpi-dev)");
    let status = out.status;
    if !status.success() {
        eprintln!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        panic!("mpi collectives on 4 processes: {status}");
    }
    println!(
        "test mpi_collectives ... ok ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
}
