//! megac's MPI communicator against plain MPI, in the same run: all-reduce, reduce-scatter
//! and all-gather of a 4 MiB and a 4 KiB f32 buffer (the all-reduce's buffer; a
//! reduce-scatter's input and an all-gather's output), each as a raw MPI call
//! (`MPI_Allreduce`, `MPI_Reduce_scatter_block`, `MPI_Allgather`), through `MpiComm` with
//! MPI's native collectives (the default) and through `MpiComm` with `set_deterministic(true)`
//! (`--deterministic`: all-to-all, in-order sum, all-gather). Run under mpirun (see
//! bench/mpi_allreduce.sh). The three are interleaved iteration by iteration (the order
//! rotating), so a loaded machine slows them alike; each timed call starts after a barrier,
//! its time is the slowest rank's, and the median over the iterations is printed.
//! `MEGAC_BENCH_ITERS` scales the iteration counts (default 1).

use std::time::Instant;

use megac_runtime::comm::Communicator as _;
use megac_runtime::mpi_comm::MpiComm;
use mpi::collective::SystemOperation;
use mpi::traits::*;

const WARMUP: usize = 10;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[derive(Clone, Copy, PartialEq)]
enum Op {
    AllReduce,
    ReduceScatter,
    AllGather,
}

fn main() {
    let (universe, _) =
        mpi::initialize_with_threading(mpi::Threading::Serialized).expect("MPI initialises");
    let world = universe.world();
    let (rank, n) = (world.rank() as usize, world.size() as usize);
    let mut comm = MpiComm::new(universe.world()).expect("megac communicator");
    let group: Vec<usize> = (0..n).collect();
    let scale: f64 = std::env::var("MEGAC_BENCH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0);
    if rank == 0 {
        println!(
            "np={n}: median ms of the slowest rank (ratio to raw MPI); raw MPI, megac native, \
             megac --deterministic interleaved"
        );
    }
    for (elems, iters) in [(1usize << 20, 100usize), (1 << 10, 2000)] {
        let iters = ((iters as f64 * scale) as usize).max(5);
        let elems = elems / n * n;
        for op in [Op::AllReduce, Op::ReduceScatter, Op::AllGather] {
            let (send_len, recv_len) = match op {
                Op::AllReduce => (elems, elems),
                Op::ReduceScatter => (elems, elems / n),
                Op::AllGather => (elems / n, elems),
            };
            let input: Vec<f32> = (0..send_len)
                .map(|i| (i % 97) as f32 * 0.25 + rank as f32 * 0.001)
                .collect();
            let mut buf = input.clone();
            let mut out = vec![0f32; recv_len];
            let mut times: [Vec<f64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
            let mut results: [Vec<f32>; 3] = [Vec::new(), Vec::new(), Vec::new()];
            for it in 0..WARMUP + iters {
                for k in 0..3 {
                    let v = (k + it) % 3; // rotate the order
                    buf.copy_from_slice(&input);
                    comm.set_deterministic(v == 2);
                    world.barrier();
                    let t0 = Instant::now();
                    match (v, op) {
                        (0, Op::AllReduce) => {
                            world.all_reduce_into(&input[..], &mut out[..], SystemOperation::sum())
                        }
                        (0, Op::ReduceScatter) => world.reduce_scatter_block_into(
                            &input[..],
                            &mut out[..],
                            SystemOperation::sum(),
                        ),
                        (0, Op::AllGather) => world.all_gather_into(&input[..], &mut out[..]),
                        (_, Op::AllReduce) => {
                            comm.all_reduce_sum(&group, &mut buf).expect("all_reduce_sum")
                        }
                        (_, Op::ReduceScatter) => comm
                            .reduce_scatter_sum(&group, &input, &mut out)
                            .expect("reduce_scatter_sum"),
                        (_, Op::AllGather) => {
                            comm.all_gather(&group, &input, &mut out).expect("all_gather")
                        }
                    }
                    let mine = t0.elapsed().as_secs_f64();
                    let mut slowest = 0f64;
                    world.all_reduce_into(&mine, &mut slowest, SystemOperation::max());
                    if it >= WARMUP {
                        times[v].push(slowest);
                    }
                    if it == 0 {
                        results[v] = if op == Op::AllReduce && v != 0 {
                            buf.clone()
                        } else {
                            out.clone()
                        };
                    }
                }
            }
            // The same sums, up to the reduction order.
            for v in 1..3 {
                let worst = results[v]
                    .iter()
                    .zip(&results[0])
                    .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
                    .fold(0f32, f32::max);
                assert!(worst < 1e-5, "results differ by {worst}");
            }
            let [raw, native, det] = times.map(median);
            if rank == 0 {
                let name = match op {
                    Op::AllReduce => "all-reduce",
                    Op::ReduceScatter => "reduce-scatter",
                    Op::AllGather => "all-gather",
                };
                let size = if elems * 4 >= 1 << 20 {
                    format!("{} MiB", elems * 4 >> 20)
                } else {
                    format!("{} KiB", elems * 4 >> 10)
                };
                println!(
                    "np={n} {name:<15} {size:>6} x{iters:<5} raw {:>8.3} ms  native {:>8.3} ms \
                     ({:.2}x)  deterministic {:>8.3} ms ({:.2}x)",
                    raw * 1e3,
                    native * 1e3,
                    native / raw,
                    det * 1e3,
                    det / raw
                );
            }
        }
    }
    drop(comm);
}
