//! The multi-rank local communicator: every collective against a serial computation on 1–4
//! ranks, bit-identical results, overlapping groups of a 2×2 mesh, point-to-point ordering, and
//! errors instead of hangs (mismatches, deadlocks, finished, failed and panicking ranks).

use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use megac_runtime::comm::Communicator;
use megac_runtime::error::RuntimeError;
use megac_runtime::local_comm::{run_ranks, LocalComm, LocalWorld};

/// A value with untidy low bits, so that a different summation order gives a different sum.
fn value(rank: usize, i: usize) -> f32 {
    let k = (rank * 7919 + i * 104_729 + 13) % 10_007;
    (k as f32 / 37.0 - 100.0) * (1.0 + (i % 7) as f32 * 1e-3)
}

fn values(rank: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| value(rank, i)).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn world(n: usize) -> Vec<usize> {
    (0..n).collect()
}

fn plan(message: &str) -> RuntimeError {
    RuntimeError::Plan(message.to_string())
}

/// Serial sum of `inputs` in order (the first contribution first).
fn serial_sum(inputs: &[Vec<f32>]) -> Vec<f32> {
    let mut out = inputs[0].clone();
    for x in &inputs[1..] {
        for (o, v) in out.iter_mut().zip(x) {
            *o += v;
        }
    }
    out
}

#[test]
fn all_reduce_sum_matches_serial_on_1_to_4_ranks() {
    for n in 1..=4 {
        let len = 257;
        let out = run_ranks(n, |mut c| {
            let mut x = values(c.rank(), len);
            c.all_reduce_sum(&world(n), &mut x)?;
            Ok(x)
        })
        .unwrap();
        let inputs: Vec<_> = (0..n).map(|r| values(r, len)).collect();
        let expected = bits(&serial_sum(&inputs));
        for (rank, x) in out.iter().enumerate() {
            assert_eq!(bits(x), expected, "n={n} rank {rank}");
        }
    }
}

#[test]
fn all_reduce_sum_is_bit_identical_across_members_and_order_sensitive_inputs() {
    // Values whose sum depends on the order: 1e8 + 1 - 1e8 + ... ; every member still agrees.
    let n = 4;
    let out = run_ranks(n, |mut c| {
        let r = c.rank();
        let mut x: Vec<f32> = (0..64)
            .map(|i| match (r + i) % 4 {
                0 => 1e8,
                1 => 1.0 + i as f32 * 0.25,
                2 => -1e8,
                _ => 3.0e-3 * i as f32,
            })
            .collect();
        c.all_reduce_sum(&world(n), &mut x)?;
        Ok(bits(&x))
    })
    .unwrap();
    for x in &out[1..] {
        assert_eq!(*x, out[0]);
    }
}

#[test]
fn all_reduce_max_matches_serial_and_propagates_nan() {
    for n in 1..=4 {
        let out = run_ranks(n, |mut c| {
            let mut x = values(c.rank(), 100);
            c.all_reduce_max(&world(n), &mut x)?;
            Ok(x)
        })
        .unwrap();
        let expected: Vec<f32> = (0..100)
            .map(|i| (0..n).map(|r| value(r, i)).fold(f32::MIN, f32::max))
            .collect();
        for x in &out {
            assert_eq!(bits(x), bits(&expected), "n={n}");
        }
    }
    let out = run_ranks(3, |mut c| {
        let mut x = vec![-1.0, c.rank() as f32];
        if c.rank() == 1 {
            x[0] = f32::NAN;
        }
        c.all_reduce_max(&[0, 1, 2], &mut x)?;
        Ok(x)
    })
    .unwrap();
    for x in &out {
        assert!(x[0].is_nan());
        assert_eq!(x[1], 2.0);
    }
}

#[test]
fn all_reduce_sum_f64_matches_serial() {
    for n in 1..=4 {
        let out = run_ranks(n, |mut c| {
            let r = c.rank() as f64;
            let mut x = vec![0.1 * (r + 1.0), 1e16 * (r - 1.5), 1.0 / (r + 3.0)];
            c.all_reduce_sum_f64(&world(n), &mut x)?;
            Ok(x)
        })
        .unwrap();
        let mut expected = [0.0f64; 3];
        for r in 0..n {
            let r = r as f64;
            let x = [0.1 * (r + 1.0), 1e16 * (r - 1.5), 1.0 / (r + 3.0)];
            for (e, v) in expected.iter_mut().zip(x) {
                // The first contribution first: 0.0 + x is x exactly.
                *e += v;
            }
        }
        for x in &out {
            let got: Vec<u64> = x.iter().map(|v| v.to_bits()).collect();
            let want: Vec<u64> = expected.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "n={n}");
        }
    }
}

#[test]
fn all_gather_concatenates_in_group_order() {
    for n in 1..=4 {
        for len in [0, 1, 33] {
            let out = run_ranks(n, |mut c| {
                let send = values(c.rank(), len);
                let mut recv = vec![f32::NAN; n * len];
                c.all_gather(&world(n), &send, &mut recv)?;
                Ok(recv)
            })
            .unwrap();
            let expected: Vec<f32> = (0..n).flat_map(|r| values(r, len)).collect();
            for x in &out {
                assert_eq!(bits(x), bits(&expected), "n={n} len={len}");
            }
        }
    }
}

#[test]
fn reduce_scatter_sum_keeps_member_chunks_of_the_serial_sum() {
    for n in 1..=4 {
        let chunk = 17;
        let out = run_ranks(n, |mut c| {
            let send = values(c.rank(), n * chunk);
            let mut recv = vec![f32::NAN; chunk];
            c.reduce_scatter_sum(&world(n), &send, &mut recv)?;
            Ok(recv)
        })
        .unwrap();
        let inputs: Vec<_> = (0..n).map(|r| values(r, n * chunk)).collect();
        let sum = serial_sum(&inputs);
        for (rank, x) in out.iter().enumerate() {
            assert_eq!(
                bits(x),
                bits(&sum[rank * chunk..(rank + 1) * chunk]),
                "n={n} rank {rank}"
            );
        }
    }
}

/// Elements member `i` sends to member `j` (zero for some pairs).
fn split(i: usize, j: usize) -> usize {
    (i + 2 * j) % 3 + usize::from(i == 3 && j == 0) * 5
}

fn offsets(sizes: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut out = vec![0];
    for s in sizes {
        out.push(out.last().unwrap() + s);
    }
    out
}

fn element(i: usize, j: usize, k: usize) -> f32 {
    (i * 1000 + j * 100 + k) as f32
}

#[test]
fn all_to_all_with_uneven_and_empty_splits() {
    for n in 1..=4 {
        let out = run_ranks(n, |mut c| {
            let me = c.rank();
            let send_off = offsets((0..n).map(|j| split(me, j)));
            let recv_off = offsets((0..n).map(|j| split(j, me)));
            let send: Vec<f32> = (0..n)
                .flat_map(|j| (0..split(me, j)).map(move |k| element(me, j, k)))
                .collect();
            let mut recv = vec![f32::NAN; *recv_off.last().unwrap()];
            c.all_to_all(&world(n), &send, &send_off, &mut recv, &recv_off)?;
            Ok(recv)
        })
        .unwrap();
        for (me, recv) in out.iter().enumerate() {
            let expected: Vec<f32> = (0..n)
                .flat_map(|j| (0..split(j, me)).map(move |k| element(j, me, k)))
                .collect();
            assert_eq!(*recv, expected, "n={n} rank {me}");
        }
        if n >= 2 {
            assert!((0..n).any(|i| (0..n).any(|j| split(i, j) == 0)));
        }
    }
}

#[test]
fn overlapping_tp_and_dp_groups_of_a_2x2_mesh() {
    // rank = dp * 2 + tp; tp groups [0, 1], [2, 3]; dp groups [0, 2], [1, 3].
    let iterations = 300;
    let len = 24;
    let out = run_ranks(4, |mut c| {
        let r = c.rank();
        let (dp, tp) = (r / 2, r % 2);
        let tp_group = [2 * dp, 2 * dp + 1];
        let dp_group = [tp, tp + 2];
        let mut log = Vec::new();
        for it in 0..iterations {
            let mut x = values(r + it, len);
            c.all_reduce_sum(&tp_group, &mut x)?;
            let mut gathered = vec![0.0; 2 * len];
            c.all_gather(&dp_group, &x, &mut gathered)?;
            let mut rs = vec![0.0; len / 2];
            c.reduce_scatter_sum(&dp_group, &x, &mut rs)?;
            log.push((gathered, rs));
        }
        Ok(log)
    })
    .unwrap();
    for it in 0..iterations {
        let tp_sum =
            |dp: usize| serial_sum(&[values(2 * dp + it, len), values(2 * dp + 1 + it, len)]);
        let gathered: Vec<f32> = [tp_sum(0), tp_sum(1)].concat();
        let total = serial_sum(&[tp_sum(0), tp_sum(1)]);
        for (r, log) in out.iter().enumerate() {
            let (g, rs) = &log[it];
            assert_eq!(bits(g), bits(&gathered), "iteration {it} rank {r}");
            let k = r / 2; // position in the dp group
            assert_eq!(bits(rs), bits(&total[k * len / 2..(k + 1) * len / 2]));
        }
    }
}

#[test]
fn sends_are_buffered_and_received_in_fifo_order() {
    let barrier = Barrier::new(2);
    let out = run_ranks(2, |mut c| {
        if c.rank() == 0 {
            for m in 0..5 {
                let msg: Vec<f32> = (0..m + 1).map(|k| (m * 10 + k) as f32).collect();
                c.send(1, &msg)?;
            }
            // The receiver has not started receiving before every send returned.
            barrier.wait();
            let mut back = [0.0; 2];
            c.recv(1, &mut back)?;
            Ok(vec![back.to_vec()])
        } else {
            barrier.wait();
            let mut got = Vec::new();
            for m in 0..5 {
                let mut buf = vec![0.0; m + 1];
                c.recv(0, &mut buf)?;
                got.push(buf);
            }
            c.send(0, &[7.0, 8.0])?;
            Ok(got)
        }
    })
    .unwrap();
    assert_eq!(out[0], vec![vec![7.0, 8.0]]);
    for (m, msg) in out[1].iter().enumerate() {
        let expected: Vec<f32> = (0..m + 1).map(|k| (m * 10 + k) as f32).collect();
        assert_eq!(*msg, expected);
    }
}

#[test]
fn a_ring_of_sends_on_3_ranks() {
    let out = run_ranks(3, |mut c| {
        let (r, n) = (c.rank(), c.size());
        let mut acc = vec![r as f32];
        let mut buf = [r as f32];
        for _ in 0..n - 1 {
            c.send((r + 1) % n, &buf)?;
            c.recv((r + n - 1) % n, &mut buf)?;
            acc.push(buf[0]);
        }
        Ok(acc)
    })
    .unwrap();
    assert_eq!(
        out,
        vec![
            vec![0.0, 2.0, 1.0],
            vec![1.0, 0.0, 2.0],
            vec![2.0, 1.0, 0.0]
        ]
    );
}

#[test]
fn receiving_a_message_of_the_wrong_length_is_an_error() {
    let out = run_ranks(2, |mut c| {
        if c.rank() == 0 {
            c.send(1, &[1.0, 2.0, 3.0])?;
            Ok(None)
        } else {
            Ok(c.recv(0, &mut [0.0; 4]).err())
        }
    })
    .unwrap();
    assert_eq!(
        out[1],
        Some(plan(
            "rank 1 expects 4 elements from rank 0, but message #1 has 3"
        ))
    );
}

/// Run `f` on `n` ranks, each returning its communicator result as a value (errors included),
/// with a bound on the wall time (a hang would exceed it).
fn outcomes(
    n: usize,
    f: impl Fn(&mut LocalComm) -> Result<(), RuntimeError> + Sync,
) -> Vec<Result<(), RuntimeError>> {
    let start = Instant::now();
    let out = run_ranks(n, |mut c| Ok(f(&mut c))).unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    out
}

#[test]
fn a_different_op_is_a_mismatch_on_both_ranks() {
    let out = outcomes(2, |c| {
        if c.rank() == 0 {
            c.all_reduce_sum(&[0, 1], &mut [1.0; 4])?;
            c.all_reduce_sum(&[0, 1], &mut [1.0; 4])?;
            c.all_reduce_sum(&[0, 1], &mut [1.0; 128])
        } else {
            c.all_reduce_sum(&[0, 1], &mut [1.0; 4])?;
            c.all_reduce_sum(&[0, 1], &mut [1.0; 4])?;
            c.all_gather(&[0, 1], &[1.0; 64], &mut [0.0; 128])
        }
    });
    let expected = plan(
        "collective mismatch on group [0, 1], call #3: rank 0 called all_reduce_sum of 128 \
         elements, rank 1 called all_gather of 64 elements",
    );
    assert_eq!(out, vec![Err(expected.clone()), Err(expected)]);
}

#[test]
fn a_different_size_is_a_mismatch_on_both_ranks() {
    let out = outcomes(3, |c| {
        let n = if c.rank() == 2 { 16 } else { 8 };
        c.all_reduce_max(&[0, 1, 2], &mut vec![0.0; n])
    });
    for (rank, o) in out.iter().enumerate() {
        let message = o.as_ref().unwrap_err().to_string();
        assert!(
            message.starts_with("plan: collective mismatch on group [0, 1, 2], call #1: "),
            "rank {rank}: {message}"
        );
        assert!(
            message.contains("rank 2 called all_reduce_max of 16 elements"),
            "{message}"
        );
        assert!(
            message.contains("called all_reduce_max of 8 elements"),
            "{message}"
        );
    }
}

#[test]
fn all_to_all_splits_that_do_not_pair_up_are_a_mismatch() {
    let out = outcomes(2, |c| {
        // Rank 0 sends 2 to rank 1, but rank 1 expects 3 from rank 0.
        if c.rank() == 0 {
            c.all_to_all(&[0, 1], &[0.0; 3], &[0, 1, 3], &mut [0.0; 2], &[0, 1, 2])
        } else {
            c.all_to_all(&[0, 1], &[0.0; 3], &[0, 1, 3], &mut [0.0; 5], &[0, 3, 5])
        }
    });
    let expected = plan(
        "collective mismatch on group [0, 1], call #1: rank 0 called all_to_all sending [1, 2] \
         receiving [1, 1], rank 1 called all_to_all sending [1, 2] receiving [3, 2] (rank 0 \
         sends 2 elements to rank 1, which expects 3)",
    );
    assert_eq!(out, vec![Err(expected.clone()), Err(expected)]);
}

#[test]
fn recv_against_a_collective_is_a_reported_deadlock() {
    let out = outcomes(2, |c| {
        c.all_reduce_sum(&[0, 1], &mut [1.0])?;
        if c.rank() == 0 {
            c.recv(1, &mut [0.0; 3])
        } else {
            c.all_reduce_sum(&[0, 1], &mut [1.0])
        }
    });
    let expected = plan(
        "deadlock: rank 0 waits in recv from rank 1; rank 1 waits in all_reduce_sum on [0, 1] \
         (call #2)",
    );
    assert_eq!(out, vec![Err(expected.clone()), Err(expected)]);
}

#[test]
fn collectives_on_crossed_groups_deadlock_with_every_rank_named() {
    // Ranks 0, 1 wait on [0, 1] and [1, 2] in opposite orders with rank 2.
    let out = outcomes(3, |c| match c.rank() {
        0 => c.all_reduce_sum(&[0, 1], &mut [1.0]),
        1 => c.all_reduce_sum(&[1, 2], &mut [1.0]),
        _ => c.all_reduce_sum(&[0, 2], &mut [1.0]),
    });
    let expected = plan(
        "deadlock: rank 0 waits in all_reduce_sum on [0, 1] (call #1); rank 1 waits in \
         all_reduce_sum on [1, 2] (call #1); rank 2 waits in all_reduce_sum on [0, 2] (call #1)",
    );
    assert_eq!(
        out,
        vec![Err(expected.clone()), Err(expected.clone()), Err(expected)]
    );
}

#[test]
fn waiting_for_a_finished_rank_is_an_error_naming_it() {
    let out = outcomes(3, |c| match c.rank() {
        0 => {
            c.all_reduce_sum(&[0, 1], &mut [1.0])?;
            c.all_reduce_sum(&[0, 1], &mut [1.0])
        }
        1 => c.all_reduce_sum(&[0, 1], &mut [1.0]),
        _ => {
            c.all_reduce_sum(&[2], &mut [1.0])?;
            c.recv(1, &mut [0.0])
        }
    });
    assert_eq!(out[1], Ok(()));
    assert_eq!(
        out[0],
        Err(plan(
            "rank 1 finished without joining all_reduce_sum on [0, 1] call #2"
        ))
    );
    assert_eq!(
        out[2],
        Err(plan(
            "rank 1 finished without sending to rank 2, which waits in recv of 1 elements \
             (message #1 from rank 1)"
        ))
    );
}

#[test]
fn a_message_sent_before_finishing_is_still_received() {
    let out = run_ranks(2, |mut c| {
        let mut x = [0.0];
        if c.rank() == 0 {
            c.send(1, &[4.0])?;
        } else {
            std::thread::sleep(Duration::from_millis(20));
            c.recv(0, &mut x)?;
        }
        Ok(x[0])
    })
    .unwrap();
    assert_eq!(out, vec![0.0, 4.0]);
}

#[test]
fn a_failed_rank_releases_the_others_and_its_error_is_returned() {
    let seen = Mutex::new(Vec::new());
    let start = Instant::now();
    let result = run_ranks(4, |mut c| {
        let r = c.rank();
        let out = match r {
            3 => {
                std::thread::sleep(Duration::from_millis(30));
                Err(RuntimeError::Unsupported("boom".to_string()))
            }
            2 => c.recv(3, &mut [0.0]),
            _ => c.all_reduce_sum(&[0, 1, 3], &mut [1.0]),
        };
        seen.lock().unwrap().push((r, out.clone()));
        out
    });
    assert!(start.elapsed() < Duration::from_secs(10));
    assert_eq!(result, Err(RuntimeError::Unsupported("boom".to_string())));
    let mut seen = seen.into_inner().unwrap();
    seen.sort_by_key(|(r, _)| *r);
    for (r, out) in &seen[..3] {
        assert_eq!(*out, Err(plan("rank 3 failed: boom")), "rank {r}");
    }
}

#[test]
fn the_first_failure_in_time_wins_not_the_lowest_rank() {
    let result: Result<Vec<()>, _> = run_ranks(4, |c| match c.rank() {
        0 => {
            std::thread::sleep(Duration::from_millis(100));
            Err(plan("late"))
        }
        3 => Err(plan("early")),
        _ => Ok(()),
    });
    assert_eq!(result, Err(plan("early")));
}

#[test]
fn operations_after_a_failure_fail_too() {
    let seen = Mutex::new(None);
    let result = run_ranks(2, |mut c| {
        if c.rank() == 1 {
            return Err(plan("gone"));
        }
        std::thread::sleep(Duration::from_millis(30));
        *seen.lock().unwrap() = Some((c.send(1, &[1.0]), c.all_reduce_sum(&[0], &mut [1.0])));
        Ok(())
    });
    assert_eq!(result, Err(plan("gone")));
    let failed = Err(plan("rank 1 failed: gone"));
    assert_eq!(seen.into_inner().unwrap(), Some((failed.clone(), failed)));
}

#[test]
fn a_panicking_rank_is_reported_and_releases_the_others() {
    let start = Instant::now();
    let seen = Mutex::new(None);
    let result = run_ranks(2, |mut c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(20));
            panic!("kaboom");
        }
        let out = c.all_reduce_sum(&[0, 1], &mut [1.0]);
        *seen.lock().unwrap() = Some(out.clone());
        out
    });
    assert!(start.elapsed() < Duration::from_secs(10));
    assert_eq!(result, Err(plan("rank 1 panicked: kaboom")));
    assert_eq!(
        seen.into_inner().unwrap(),
        Some(Err(plan("rank 1 failed: rank 1 panicked: kaboom")))
    );
}

#[test]
fn bad_arguments_are_errors_without_waiting() {
    let out = run_ranks(2, |mut c| {
        let mut x = [1.0; 4];
        Ok(vec![
            c.all_reduce_sum(&[1, 0], &mut x),
            c.all_reduce_sum(&[0, 1, 2], &mut x),
            c.all_reduce_sum(&[1 - c.rank()], &mut x),
            c.all_gather(&[0, 1], &[1.0; 3], &mut [0.0; 5]),
            c.reduce_scatter_sum(&[0, 1], &[1.0; 3], &mut [0.0; 1]),
            c.all_to_all(&[0, 1], &[1.0; 3], &[0, 2], &mut [0.0; 3], &[0, 1, 3]),
            c.all_to_all(&[0, 1], &[1.0; 3], &[0, 2, 3], &mut [0.0; 3], &[0, 1, 3]),
            c.send(2, &x),
            c.recv(5, &mut x),
        ])
    })
    .unwrap();
    let messages: Vec<String> = out[0]
        .iter()
        .map(|e| e.as_ref().unwrap_err().to_string())
        .collect();
    assert_eq!(
        messages,
        [
            "plan: all_reduce_sum on group [1, 0]: ranks must be sorted and distinct",
            "plan: all_reduce_sum on group [0, 1, 2]: rank 2 is outside the world of 2 ranks",
            "plan: rank 0 calls all_reduce_sum on group [1], which it is not a member of",
            "plan: rank 0: all_gather on group [0, 1] of 3 elements needs a receive buffer of 6, \
             not 5",
            "plan: rank 0: reduce_scatter_sum on group [0, 1] of 3 elements needs a receive \
             buffer of 3 / 2, not 1",
            "plan: rank 0: all_to_all on group [0, 1]: send offsets [0, 2] must have 3 \
             non-decreasing entries from 0 to the buffer length 3",
            "plan: rank 0: all_to_all on group [0, 1] sends 2 elements to itself but expects 1",
            "plan: rank 0 sends to rank 2, outside the world of 2 ranks",
            "plan: rank 0 receives from rank 5, outside the world of 2 ranks",
        ]
    );
    assert!(out[1].iter().all(Result::is_err));
}

#[test]
fn a_world_built_by_hand_runs_on_plain_threads() {
    let comms = LocalWorld::new(3);
    assert_eq!(comms.len(), 3);
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut c| {
            std::thread::spawn(move || {
                let mut x = [c.rank() as f32 + 1.0];
                c.all_reduce_sum(&[0, 1, 2], &mut x).map(|()| x[0])
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), Ok(6.0));
    }
    // Dropping a rank's communicator finishes it: the others are released.
    let mut comms = LocalWorld::new(2);
    let mut c0 = comms.remove(0);
    drop(comms);
    assert_eq!(
        c0.all_reduce_sum(&[0, 1], &mut [1.0]),
        Err(plan(
            "rank 1 finished without joining all_reduce_sum on [0, 1] call #1"
        ))
    );
}

#[test]
fn communicators_are_send() {
    fn is_send<T: Send>() {}
    is_send::<LocalComm>();
}
