//! Prints the calibration table: the Megatron-LM H100 weak-scaling table (megatron-lm.md
//! §10.1) against the cost model's predictions, per-row relative error and the mean; then
//! fits the cost model's free constants to the table (`megac_sim::calibrate::fit`), prints
//! them beside the cluster's, the in-sample errors at the fitted constants and the
//! leave-one-out table (fit on eight rows, predict the ninth).
//!
//! `cargo run --release -p megac-sim --example calibrate [-- CLUSTER.toml|PRESET] [--no-fit]`;
//! with `CALIBRATE_VERBOSE=1` it also prints each row's time breakdown and memory;
//! `CALIBRATE_K` sets the candidate layouts per row (default 8), `CALIBRATE_GRID` the grid
//! levels per knob (default 5).

use megac_sim::calibrate::{self, fit};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let no_fit = args.iter().any(|a| a == "--no-fit");
    let arg = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .cloned()
        .unwrap_or_else(|| "h100-sxm".into());
    let cluster = match megac_sim::Cluster::load(&arg) {
        Ok(c) => c,
        Err(e) => {
            eprint!("{}", e.render());
            std::process::exit(1);
        }
    };
    let rows = calibrate::calibrate(&cluster);
    println!("== the cluster's constants ({arg})");
    print!("{}", calibrate::report(&rows));
    if std::env::var_os("CALIBRATE_VERBOSE").is_some() {
        for c in &rows {
            let t = &c.estimate.time;
            println!(
                "{:<5} fwd {:.3} bwd {:.3} wgrad {:.3} (layer comm {:.3}) bubble {:.3} dp {:.3} opt {:.3}  mem {:.1} GiB",
                c.row.name, t.forward, t.backward, t.weight_grad, t.layer_comm, t.bubble, t.dp_comm, t.optimizer,
                c.estimate.peak_memory_bytes / (1u64 << 30) as f64
            );
        }
    }
    println!();
    print!(
        "{}",
        calibrate::external_report(&calibrate::external(&cluster))
    );
    if no_fit {
        return;
    }

    let k = env_usize("CALIBRATE_K", 8);
    let opts = fit::FitOptions {
        grid: env_usize("CALIBRATE_GRID", fit::FitOptions::default().grid),
        starts: env_usize("CALIBRATE_STARTS", fit::FitOptions::default().starts),
        ..fit::FitOptions::default()
    };
    let knobs = match std::env::var("CALIBRATE_KNOBS") {
        Ok(v) => fit::knobs_named(&v.split(',').collect::<Vec<_>>()),
        Err(_) => fit::knobs(),
    };
    let start = cluster.cost.clone();
    let samples = fit::samples(&cluster, calibrate::MEGATRON_H100, k);
    let t0 = std::time::Instant::now();
    eprintln!(
        "fitting {} constants to {} rows ({} candidate layouts per row, grid {}^{}) ...",
        knobs.len(),
        samples.len(),
        k,
        opts.grid,
        knobs.len()
    );
    let all: Vec<&fit::Sample> = samples.iter().collect();
    let f = fit::fit(&all, &start, &knobs, &opts);
    eprintln!(
        "  done: {} evaluations in {:.1} s",
        f.evaluations,
        t0.elapsed().as_secs_f64()
    );
    println!();
    println!(
        "== fit on all {} rows (minimising mean + 1/2 max |error|; bounds from megac_sim::calibrate::fit::knobs)",
        samples.len()
    );
    println!(
        "{:<44} {:>8} {:>8}  bounds",
        "constant", "cluster", "fitted"
    );
    for kn in &knobs {
        println!(
            "{:<44} {:>8.4} {:>8.4}  [{}, {}]",
            kn.name,
            (kn.get)(&start),
            (kn.get)(&f.params),
            kn.lo,
            kn.hi
        );
    }
    let obj = |p: &megac_sim::CostParams| {
        fit::objective(&samples.iter().map(|s| s.error(p)).collect::<Vec<_>>())
    };
    println!(
        "objective mean + 1/2 max |error| (candidate layouts): cluster {:.4}, fitted {:.4}",
        obj(&start),
        obj(&f.params)
    );
    if let Err(e) = fit::check_plausible(&f.params) {
        println!("NOT PLAUSIBLE: {e}");
    }
    let mut fitted = cluster.clone();
    fitted.cost = f.params.clone();
    let in_sample = calibrate::calibrate(&fitted);
    println!("in-sample, the fitted constants (full layout search):");
    print!("{}", calibrate::report(&in_sample));
    print!(
        "{}",
        calibrate::external_report(&calibrate::external(&fitted))
    );

    println!();
    println!(
        "== leave-one-out: fit on the other rows, predict the held-out row (full layout search)"
    );
    let t1 = std::time::Instant::now();
    let loo = fit::leave_one_out(&cluster, &samples, &start, &knobs, &opts, |h| {
        eprintln!(
            "  held out {:<5} {:>+6.1}%  ({:.1} s)",
            h.name,
            100.0 * h.error,
            t1.elapsed().as_secs_f64()
        )
    });
    print!("{:<6} {:>7}", "held", "error");
    for kn in &knobs {
        print!(
            " {:>8}",
            kn.name
                .split(' ')
                .next()
                .unwrap_or(kn.name)
                .trim_end_matches("_efficiency")
        );
    }
    println!();
    for h in &loo {
        print!("{:<6} {:>+6.1}%", h.name, 100.0 * h.error);
        for kn in &knobs {
            print!(" {:>8.4}", (kn.get)(&h.params));
        }
        println!();
    }
    let mean = loo.iter().map(|h| h.error.abs()).sum::<f64>() / loo.len().max(1) as f64;
    let max = loo.iter().map(|h| h.error.abs()).fold(0.0, f64::max);
    println!(
        "leave-one-out mean |error| {:.1}%, max |error| {:.1}% over {} rows (goal: mean <= 3%, max <= 8%)",
        100.0 * mean,
        100.0 * max,
        loo.len()
    );
}
