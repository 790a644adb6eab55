//! Mutation test of the plan gate: seeded field-level mutations of compiled plans (tp+sp,
//! pp with zb-h1 and dpp, fbd, ep, cp, the distributed optimizer) are either rejected by the
//! gate with one clear error or train 2 steps to a positive, finite loss; never a panic, a
//! runtime error after the gate, a hang, or a zero or non-finite loss. The mutator and the
//! harness are in `tests/common/mutate.rs`; `bench/mutate.sh` runs 10,000 mutations.

#[path = "common/mutate.rs"]
mod mutate;

use std::time::Duration;

fn report(t: &mutate::Tally) -> String {
    format!(
        "tried {} / rejected {} / ran-ok {} / failures {}",
        t.tried,
        t.rejected,
        t.ran_ok,
        t.failures.len()
    )
}

#[test]
fn mutated_plans_are_rejected_or_train() {
    let t = mutate::run_mutations(1, 300, Duration::from_secs(60));
    eprintln!("{}", report(&t));
    assert!(t.failures.is_empty(), "{}: {:#?}", report(&t), t.failures);
    assert_eq!(t.tried, 300);
    // The mutator reaches both sides of the gate.
    assert!(t.rejected > 0 && t.ran_ok > 0, "{}", report(&t));
}

/// `bench/mutate.sh`: `MEGAC_MUTATIONS` mutations (default 10,000) from `MEGAC_SEED`.
#[test]
#[ignore = "bench: run by bench/mutate.sh"]
fn mutation_bench() {
    let n = std::env::var("MEGAC_MUTATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let seed = std::env::var("MEGAC_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let t = mutate::run_mutations(seed, n, Duration::from_secs(60));
    println!("{}", report(&t));
    for (s, layout, what, f) in &t.failures {
        println!("failure: seed {s} {layout}: {what}: {f}");
    }
    assert!(t.failures.is_empty(), "{}", report(&t));
}
