//! 4 MiB f32 all-reduce: megac's MPI communicator (`MpiComm::all_reduce_sum`, deterministic:
//! all-to-all + in-order sum + all-gather) against a plain `MPI_Allreduce` of the same buffer,
//! in the same run. Run under mpirun (see bench/mpi_allreduce.sh). Each iteration starts after
//! a barrier; its time is the slowest rank's; the median over the iterations is printed.

use std::time::Instant;

use megac_runtime::comm::Communicator as _;
use megac_runtime::mpi_comm::MpiComm;
use mpi::collective::SystemOperation;
use mpi::traits::*;

const ELEMS: usize = 1 << 20; // 4 MiB of f32
const WARMUP: usize = 5;
const ITERS: usize = 50;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let (universe, _) =
        mpi::initialize_with_threading(mpi::Threading::Serialized).expect("MPI initialises");
    let world = universe.world();
    let (rank, n) = (world.rank() as usize, world.size() as usize);
    let mut comm = MpiComm::new(universe.world()).expect("megac communicator");
    let group: Vec<usize> = (0..n).collect();
    let input: Vec<f32> = (0..ELEMS)
        .map(|i| (i % 97) as f32 * 0.25 + rank as f32)
        .collect();

    // Slowest rank's time of `op`, per iteration.
    let time = |op: &mut dyn FnMut()| -> f64 {
        let mut times = Vec::new();
        for it in 0..WARMUP + ITERS {
            world.barrier();
            let t0 = Instant::now();
            op();
            let mine = t0.elapsed().as_secs_f64();
            let mut slowest = 0f64;
            world.all_reduce_into(&mine, &mut slowest, SystemOperation::max());
            if it >= WARMUP {
                times.push(slowest);
            }
        }
        median(times)
    };

    let mut buf = input.clone();
    let megac = time(&mut || {
        buf.copy_from_slice(&input);
        comm.all_reduce_sum(&group, &mut buf)
            .expect("all_reduce_sum");
    });
    let megac_out = buf.clone();
    let mut out = vec![0f32; ELEMS];
    let plain = time(&mut || {
        world.all_reduce_into(&input[..], &mut out[..], SystemOperation::sum());
    });
    // Same sums (up to the reduction order MPI chooses).
    let worst = megac_out
        .iter()
        .zip(&out)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
        .fold(0f32, f32::max);
    assert!(worst < 1e-5, "results differ by {worst}");
    if rank == 0 {
        let gbs = |s: f64| (ELEMS * 4) as f64 / s / 1e9;
        println!(
            "np={n}  4 MiB f32 all-reduce (median of {ITERS}, slowest rank): megac {:.3} ms \
             ({:.2} GB/s)  MPI_Allreduce {:.3} ms ({:.2} GB/s)  ratio megac/MPI {:.2}",
            megac * 1e3,
            gbs(megac),
            plain * 1e3,
            gbs(plain),
            megac / plain
        );
    }
    drop(comm);
}
