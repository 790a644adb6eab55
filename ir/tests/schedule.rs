//! Tests of the pipeline schedules: bubble formulas, peaks, validator, DPP policies.

use megac_ir::pipeline::*;

const FIXED: [ScheduleKind; 4] = [
    ScheduleKind::GPipe,
    ScheduleKind::OneFOneB,
    ScheduleKind::Interleaved,
    ScheduleKind::ZbH1,
];

fn all_kinds() -> Vec<ScheduleKind> {
    let mut k = FIXED.to_vec();
    k.push(ScheduleKind::Dpp(DppPolicy::Bfs));
    k.push(ScheduleKind::Dpp(DppPolicy::Dfs));
    k.push(ScheduleKind::Dpp(DppPolicy::Adaptive { cap: None }));
    k.push(ScheduleKind::Dpp(DppPolicy::Adaptive { cap: Some(1) }));
    k
}

fn run(kind: ScheduleKind, pp: u32, vpp: u32, m: u32) -> (Vec<Vec<Action>>, Timeline) {
    let l = schedule(kind, pp, vpp, m).unwrap();
    let t = simulate(&l, Costs::unit()).unwrap();
    (l, t)
}

fn forwards(list: &[Action]) -> Vec<(u32, u32)> {
    list.iter()
        .filter(|a| a.kind == ActionKind::F)
        .map(|a| (a.chunk, a.microbatch))
        .collect()
}

/// Unit costs f = b = w = 1 (fused BW = 2): every rank idles (p-1)(f+b+w) = 3(p-1) of the
/// makespan 3(m+p-1), so the bubble fraction is exactly (p-1)/(m+p-1) of total time.
/// One row per rank, `rank r | F0 F1 B0 ...` (compute actions only, chunks shown when
/// `show_chunk`): the order a schedule gives each rank.
fn rows(lists: &[Vec<Action>], show_chunk: bool) -> String {
    let mut out = String::new();
    for (r, list) in lists.iter().enumerate() {
        let tokens: Vec<String> = list
            .iter()
            .filter(|a| a.is_compute())
            .map(|a| a.token(show_chunk))
            .collect();
        out.push_str(&format!("rank {r} | {}\n", tokens.join(" ")));
    }
    out
}

#[test]
fn gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1() {
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        for pp in 1..=4u32 {
            for m in [1, 2, 3, 4, 8, 12u32] {
                let (_, t) = run(kind, pp, 1, m);
                let (p, mf) = (pp as f64, m as f64);
                assert_eq!(t.makespan, 3.0 * (mf + p - 1.0), "{kind:?} pp{pp} m{m}");
                for r in &t.ranks {
                    assert_eq!(r.idle, 3.0 * (p - 1.0));
                    assert_eq!(r.busy, 3.0 * mf);
                }
                assert_eq!(t.bubble_fraction, (p - 1.0) / (mf + p - 1.0));
            }
        }
    }
}

/// Interleaved, per-chunk unit costs: every rank idles 3(p-1), i.e. (p-1)(t_f+t_b) with the
/// per-chunk times, against an ideal 3·v·m: idle/ideal = (p-1)/(v·m) exactly (Megatron §2.7),
/// and of total time (p-1)/(v·m+p-1).
#[test]
fn interleaved_bubble_is_p_minus_1_over_v_m() {
    for pp in 1..=4u32 {
        for vpp in 2..=3u32 {
            for m in [pp, 2 * pp, 3 * pp] {
                let (_, t) = run(ScheduleKind::Interleaved, pp, vpp, m);
                let (p, v, mf) = (pp as f64, vpp as f64, m as f64);
                for r in &t.ranks {
                    assert_eq!(r.idle, 3.0 * (p - 1.0), "pp{pp} v{vpp} m{m}");
                    assert_eq!(r.idle / r.busy, (p - 1.0) / (v * mf));
                }
                assert_eq!(t.bubble_fraction, (p - 1.0) / (v * mf + p - 1.0));
            }
        }
    }
}

/// ZB-H1, f = b = w = 1, m >= p: every rank idles (p-1)(f+b-w) = p-1, a third of 1F1B's
/// 3(p-1); bubble fraction (p-1)/(3m+p-1), below 1F1B's (p-1)/(m+p-1).
#[test]
fn zb_h1_bubble_is_a_third_of_1f1b() {
    for pp in 2..=4u32 {
        for m in [pp, pp + 1, 2 * pp, 12] {
            let (_, zb) = run(ScheduleKind::ZbH1, pp, 1, m);
            let (_, ofob) = run(ScheduleKind::OneFOneB, pp, 1, m);
            let (p, mf) = (pp as f64, m as f64);
            for (z, o) in zb.ranks.iter().zip(&ofob.ranks) {
                assert_eq!(z.idle, p - 1.0, "pp{pp} m{m}");
                assert_eq!(3.0 * z.idle, o.idle);
            }
            assert_eq!(zb.bubble_fraction, (p - 1.0) / (3.0 * mf + p - 1.0));
            assert!(zb.bubble_fraction < ofob.bubble_fraction);
        }
    }
    // The standard setting p = 4, m = 8: 3/27 against 9/33.
    let (_, zb) = run(ScheduleKind::ZbH1, 4, 1, 8);
    assert_eq!(zb.bubble_fraction, 3.0 / 27.0);
}

#[test]
fn zb_h1_defers_w_into_the_bubbles_at_1f1b_memory() {
    let (l, _) = run(ScheduleKind::ZbH1, 4, 1, 8);
    let text = rows(&l, false);
    let lines: Vec<&str> = text.lines().collect();
    // The paper's ZB-H1: the first stage runs F B W in the steady state, the last defers
    // its W into the warm-up bubbles and the cool-down.
    assert_eq!(
        lines[0],
        "rank 0 | F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7"
    );
    assert_eq!(
        lines[3],
        "rank 3 | F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"
    );
    // 1F1B's peak activation memory: no rank ever holds more than pp micro-batches whose F
    // is done and whose W is not.
    for pp in [2u32, 4, 8] {
        for m in [1u32, 2, 4, 8, 16, 24] {
            let (lists, _) = run(ScheduleKind::ZbH1, pp, 1, m);
            for (r, list) in lists.iter().enumerate() {
                let mut held = 0u32;
                for a in list {
                    match a.kind {
                        ActionKind::F => held += 1,
                        ActionKind::W => held -= 1,
                        _ => {}
                    }
                    assert!(held <= pp, "pp{pp} m{m} rank {r}: {held} held");
                }
            }
        }
    }
}

#[test]
fn peak_inflight_1f1b_is_pp_minus_rank_gpipe_is_m() {
    for pp in 1..=4u32 {
        for m in [1, 2, 4, 8u32] {
            let (_, g) = run(ScheduleKind::GPipe, pp, 1, m);
            let (_, o) = run(ScheduleKind::OneFOneB, pp, 1, m);
            let (_, z) = run(ScheduleKind::ZbH1, pp, 1, m);
            for r in 0..pp as usize {
                assert_eq!(g.ranks[r].peak_inflight, m);
                assert_eq!(o.ranks[r].peak_inflight, (pp - r as u32).min(m));
                assert_eq!(z.ranks[r].peak_inflight, (pp - r as u32).min(m));
            }
        }
    }
}

#[test]
fn interleaved_follows_megatron_order() {
    // PP 2, VP 2, m 4: warmup on rank 0 = 2(p-1) + (v-1)p = 4 chunk forwards.
    let l = schedule(ScheduleKind::Interleaved, 2, 2, 4).unwrap();
    assert_eq!(
        rows(&l, true),
        "rank 0 | F0.0 F0.1 F2.0 F2.1 F0.2 BW2.0 F0.3 BW2.1 F2.2 BW0.0 F2.3 BW0.1 BW2.2 BW2.3 BW0.2 BW0.3\n\
         rank 1 | F1.0 F1.1 F3.0 BW3.0 F3.1 BW3.1 F1.2 BW1.0 F1.3 BW1.1 F3.2 BW3.2 F3.3 BW3.3 BW1.2 BW1.3\n"
    );
}

#[test]
fn validator_accepts_every_valid_combination() {
    let mut checked = 0;
    for kind in all_kinds() {
        for pp in 1..=4u32 {
            for vpp in 1..=3u32 {
                for m in [1, 2, 3, 4, 6, 8u32] {
                    match schedule(kind, pp, vpp, m) {
                        Ok(l) => {
                            validate(&l, pp, vpp, m)
                                .unwrap_or_else(|e| panic!("{kind:?} pp{pp} v{vpp} m{m}: {e}"));
                            checked += 1;
                        }
                        Err(ScheduleError::VppUnsupported { .. }) => {
                            assert!(vpp > 1 && !matches!(kind, ScheduleKind::Dpp(_)))
                        }
                        Err(ScheduleError::VppRequired { .. }) => {
                            assert!(kind == ScheduleKind::Interleaved && vpp == 1)
                        }
                        Err(ScheduleError::MicrobatchesNotMultiple { .. }) => {
                            assert!(kind == ScheduleKind::Interleaved && m % pp != 0)
                        }
                        Err(e) => panic!("{kind:?} pp{pp} v{vpp} m{m}: {e}"),
                    }
                }
            }
        }
    }
    assert!(checked > 300, "{checked}");
}

#[test]
fn communication_is_explicit_around_compute() {
    for kind in FIXED {
        let vpp = if kind == ScheduleKind::Interleaved {
            2
        } else {
            1
        };
        let (pp, m) = (3, 6);
        let nc = pp * vpp;
        let l = schedule(kind, pp, vpp, m).unwrap();
        for (r, list) in l.iter().enumerate() {
            for (i, a) in list.iter().enumerate() {
                let fwd = a.kind == ActionKind::F;
                let bwd = matches!(a.kind, ActionKind::B | ActionKind::BW);
                if (fwd && a.chunk > 0) || (bwd && a.chunk + 1 < nc) {
                    let (payload, chunk) = if fwd {
                        (Payload::Activation, a.chunk - 1)
                    } else {
                        (Payload::Gradient, a.chunk + 1)
                    };
                    let peer = chunk % pp;
                    assert_eq!(
                        list[i - 1],
                        Action {
                            kind: ActionKind::Recv { payload, peer },
                            chunk,
                            microbatch: a.microbatch
                        },
                        "{kind:?} rank {r} action {i}"
                    );
                }
                if (fwd && a.chunk + 1 < nc) || (bwd && a.chunk > 0) {
                    let (payload, peer) = if fwd {
                        (Payload::Activation, (a.chunk + 1) % pp)
                    } else {
                        (Payload::Gradient, (a.chunk - 1) % pp)
                    };
                    assert_eq!(list[i + 1].kind, ActionKind::Send { payload, peer });
                    assert_eq!(
                        (list[i + 1].chunk, list[i + 1].microbatch),
                        (a.chunk, a.microbatch)
                    );
                }
            }
        }
    }
}

fn position(list: &[Action], pred: impl Fn(&Action) -> bool) -> usize {
    list.iter().position(pred).unwrap()
}

fn is_send_act(mb: u32) -> impl Fn(&Action) -> bool {
    move |a| {
        matches!(
            a.kind,
            ActionKind::Send {
                payload: Payload::Activation,
                ..
            }
        ) && a.microbatch == mb
    }
}

#[test]
fn rejects_dropped_receive() {
    let mut l = schedule(ScheduleKind::OneFOneB, 2, 1, 4).unwrap();
    let i = position(&l[1], |a| {
        matches!(a.kind, ActionKind::Recv { .. }) && a.microbatch == 2
    });
    l[1].remove(i);
    assert_eq!(
        validate(&l, 2, 1, 4),
        Err(ValidateError::MissingTransfer {
            is_send: false,
            payload: Payload::Activation,
            chunk: 0,
            microbatch: 2,
            src: 0,
            dst: 1
        })
    );
}

#[test]
fn rejects_missing_b() {
    let mut l = schedule(ScheduleKind::OneFOneB, 2, 1, 4).unwrap();
    let i = position(&l[0], |a| a.kind == ActionKind::BW && a.microbatch == 3);
    l[0].remove(i);
    let err = validate(&l, 2, 1, 4).unwrap_err();
    assert_eq!(
        err,
        ValidateError::MissingCompute {
            kind: ActionKind::B,
            chunk: 0,
            microbatch: 3,
            rank: 0
        }
    );
    // Split schedules: a missing W is reported as W.
    let mut l = schedule(ScheduleKind::ZbH1, 2, 1, 4).unwrap();
    let i = position(&l[1], |a| a.kind == ActionKind::W && a.microbatch == 1);
    l[1].remove(i);
    assert!(matches!(
        validate(&l, 2, 1, 4),
        Err(ValidateError::MissingCompute {
            kind: ActionKind::W,
            chunk: 1,
            microbatch: 1,
            ..
        })
    ));
}

/// Swapping the positions of two sends puts one before the forward that produces it.
#[test]
fn rejects_swapped_sends() {
    let mut l = schedule(ScheduleKind::GPipe, 2, 1, 4).unwrap();
    let (a, b) = (
        position(&l[0], is_send_act(0)),
        position(&l[0], is_send_act(1)),
    );
    l[0].swap(a, b);
    // rank 0: F0 sA1 F1 sA0 ...: sA1 (index 1) precedes F1 (index 2).
    assert!(matches!(
        validate(&l, 2, 1, 4),
        Err(ValidateError::Order { rank: 0, index: 1, dep_index: 2, dep, .. })
            if dep == Action::compute(ActionKind::F, 0, 1)
    ));
}

/// Sends kept after their producers but reordered: the pair's order no longer matches the
/// receiver's.
#[test]
fn rejects_reordered_sends() {
    let mut l = schedule(ScheduleKind::GPipe, 2, 1, 4).unwrap();
    let a = position(&l[0], is_send_act(0));
    let s = l[0].remove(a);
    let b = position(&l[0], is_send_act(1));
    l[0].insert(b + 1, s);
    let err = validate(&l, 2, 1, 4).unwrap_err();
    assert!(
        matches!(err, ValidateError::PairOrder { src: 0, dst: 1, position: 0, send_index: 2, recv_index: 0, sent, .. } if sent.microbatch == 1),
        "{err:?}"
    );
    // The simulator alone reports the mismatch at the receive.
    assert!(matches!(
        simulate(&l, Costs::unit()),
        Err(SimError::Mismatch {
            src: 0,
            dst: 1,
            recv_index: 0,
            ..
        })
    ));
}

/// Rank 0 waits for a gradient before sending the activation rank 1 waits for.
#[test]
fn rejects_deadlock_naming_the_blocked_ranks() {
    let mut l = schedule(ScheduleKind::GPipe, 2, 1, 2).unwrap();
    // rank 0: F0 sA0 F1 sA1 rG0 BW0 rG1 BW1 -> F0 sA0 F1 rG0 sA1 BW0 rG1 BW1
    let s = position(&l[0], is_send_act(1));
    l[0].swap(s, s + 1);
    let err = validate(&l, 2, 1, 2).unwrap_err();
    let ValidateError::Sim(SimError::Deadlock { blocked }) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(blocked.len(), 2);
    assert_eq!((blocked[0].rank, blocked[0].index), (0, 3));
    assert_eq!((blocked[1].rank, blocked[1].index), (1, 2));
    assert!(
        err.to_string().contains("rank 0 blocked at action 3"),
        "{err}"
    );
}

#[test]
fn rejects_wrong_rank_duplicates_and_count() {
    let mut l = schedule(ScheduleKind::OneFOneB, 2, 1, 2).unwrap();
    l[0].push(Action::compute(ActionKind::F, 1, 0));
    assert!(matches!(
        validate(&l, 2, 1, 2),
        Err(ValidateError::BadAction { rank: 0, .. })
    ));
    let mut l = schedule(ScheduleKind::OneFOneB, 2, 1, 2).unwrap();
    let f = l[0][0];
    l[0].push(f);
    assert!(matches!(
        validate(&l, 2, 1, 2),
        Err(ValidateError::Duplicate {
            rank: 0,
            first_index: 0,
            ..
        })
    ));
    let l = schedule(ScheduleKind::OneFOneB, 2, 1, 2).unwrap();
    assert_eq!(
        validate(&l, 3, 1, 2),
        Err(ValidateError::RankCount { pp: 3, got: 2 })
    );
}

#[test]
fn dpp_bfs_and_dfs_orders_differ_as_defined() {
    let (pp, vpp, m) = (2, 2, 8);
    let (bfs, _) = run(ScheduleKind::Dpp(DppPolicy::Bfs), pp, vpp, m);
    let (dfs, _) = run(ScheduleKind::Dpp(DppPolicy::Dfs), pp, vpp, m);
    // BFS: every microbatch of chunk 0 before any forward of chunk 2 on rank 0.
    let f = forwards(&bfs[0]);
    assert!(f[..m as usize].iter().all(|&(c, _)| c == 0), "{f:?}");
    // DFS: microbatch 0 moves on to chunk 2 as soon as its input is there.
    assert_eq!(forwards(&dfs[0])[..3], [(0, 0), (0, 1), (2, 0)]);
    // Both prefer a ready backward; the orders differ and DFS holds fewer activations.
    assert_ne!(bfs, dfs);
    let (_, tb) = run(ScheduleKind::Dpp(DppPolicy::Bfs), pp, vpp, m);
    let (_, td) = run(ScheduleKind::Dpp(DppPolicy::Dfs), pp, vpp, m);
    assert!(td.ranks[0].peak_inflight < tb.ranks[0].peak_inflight);
}

/// `dpp-ordered`'s reference order is the static order it runs out of order: interleaved's
/// with virtual chunks, 1F1B's without; with chunks, m must be a multiple of pp as for
/// interleaved.
#[test]
fn dpp_ordered_takes_the_static_order() {
    let ordered: ScheduleKind = "dpp-ordered".parse().unwrap();
    assert_eq!(ordered.name(), "dpp-ordered");
    for (pp, vpp, m, static_kind) in [
        (2, 2, 4, ScheduleKind::Interleaved),
        (4, 2, 8, ScheduleKind::Interleaved),
        (2, 1, 4, ScheduleKind::OneFOneB),
        (4, 1, 6, ScheduleKind::OneFOneB),
    ] {
        assert_eq!(
            schedule(ordered, pp, vpp, m).unwrap(),
            schedule(static_kind, pp, vpp, m).unwrap(),
            "pp {pp} vpp {vpp} m {m}"
        );
    }
    assert_ne!(
        schedule(ordered, 4, 2, 8).unwrap(),
        schedule("dpp-bfs".parse().unwrap(), 4, 2, 8).unwrap()
    );
    assert!(matches!(
        schedule(ordered, 2, 2, 3),
        Err(ScheduleError::MicrobatchesNotMultiple { m: 3, pp: 2 })
    ));
}

#[test]
fn dpp_adaptive_respects_the_cap() {
    let (pp, vpp, m) = (2, 2, 8);
    let adaptive =
        |cap| schedule(ScheduleKind::Dpp(DppPolicy::Adaptive { cap }), pp, vpp, m).unwrap();
    // Breadth-first while fewer than cap = 3 are in flight, then depth-first.
    assert_eq!(
        forwards(&adaptive(Some(3))[0])[..4],
        [(0, 0), (0, 1), (0, 2), (2, 0)]
    );
    // Cap 0: always depth-first; cap beyond every chunk-microbatch: always breadth-first.
    assert_eq!(
        adaptive(Some(0)),
        schedule(ScheduleKind::Dpp(DppPolicy::Dfs), pp, vpp, m).unwrap()
    );
    assert_eq!(
        adaptive(Some(pp * vpp * m)),
        schedule(ScheduleKind::Dpp(DppPolicy::Bfs), pp, vpp, m).unwrap()
    );
    // Default cap = pp: never more in flight than breadth-first on any rank.
    for (pp, vpp, m) in [(2, 2, 8), (3, 2, 12), (4, 2, 8), (4, 3, 12)] {
        let a = simulate(&adaptive_default(pp, vpp, m), Costs::unit()).unwrap();
        let (_, b) = run(ScheduleKind::Dpp(DppPolicy::Bfs), pp, vpp, m);
        for (x, y) in a.ranks.iter().zip(&b.ranks) {
            assert!(x.peak_inflight <= y.peak_inflight, "pp{pp} v{vpp} m{m}");
        }
    }
}

fn adaptive_default(pp: u32, vpp: u32, m: u32) -> Vec<Vec<Action>> {
    schedule(
        ScheduleKind::Dpp(DppPolicy::Adaptive { cap: None }),
        pp,
        vpp,
        m,
    )
    .unwrap()
}

#[test]
fn schedule_errors() {
    use ScheduleKind::*;
    assert_eq!(
        schedule(GPipe, 0, 1, 1),
        Err(ScheduleError::Zero { what: "pp" })
    );
    assert_eq!(
        schedule(OneFOneB, 2, 1, 0),
        Err(ScheduleError::Zero { what: "m" })
    );
    assert_eq!(
        schedule(OneFOneB, 2, 2, 4),
        Err(ScheduleError::VppUnsupported {
            kind: "1f1b",
            vpp: 2
        })
    );
    assert_eq!(
        schedule(Interleaved, 2, 1, 4),
        Err(ScheduleError::VppRequired { vpp: 1 })
    );
    assert_eq!(
        schedule(Interleaved, 4, 2, 7),
        Err(ScheduleError::MicrobatchesNotMultiple { m: 7, pp: 4 })
    );
    for k in all_kinds() {
        let parsed: ScheduleKind = k.name().parse().unwrap();
        assert_eq!(parsed.name(), k.name());
    }
    assert!("zb-h2".parse::<ScheduleKind>().is_err());
}

#[test]
fn simulator_models_transfer_latency() {
    let l = schedule(ScheduleKind::OneFOneB, 2, 1, 1).unwrap();
    let costs = Costs {
        f: 1.0,
        b: 1.0,
        w: 1.0,
        send: 0.5,
    };
    let t = simulate(&l, costs).unwrap();
    // F on rank 0 [0,1], arrives 1.5; rank 1 F [1.5,2.5], BW [2.5,4.5]; gradient at 5;
    // rank 0 BW [5,7].
    assert_eq!(t.makespan, 7.0);
    assert_eq!(t.ranks[0].spans.last(), Some(&(5.0, 7.0)));
    assert_eq!(t.ranks[1].idle, 4.0);
}
