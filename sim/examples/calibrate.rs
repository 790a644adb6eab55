//! Prints the calibration table: the Megatron-LM H100 weak-scaling table (megatron-lm.md
//! §10.1) against the cost model's predictions, per-row relative error and the mean.
//!
//! `cargo run --release -p megac-sim --example calibrate [-- CLUSTER.toml|PRESET]`; with
//! `CALIBRATE_VERBOSE=1` it also prints each row's time breakdown and memory.

fn main() {
    let arg = std::env::args().nth(1).unwrap_or_else(|| "h100-sxm".into());
    let cluster = match megac_sim::Cluster::load(&arg) {
        Ok(c) => c,
        Err(e) => {
            eprint!("{}", e.render());
            std::process::exit(1);
        }
    };
    let rows = megac_sim::calibrate::calibrate(&cluster);
    print!("{}", megac_sim::calibrate::report(&rows));
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
}
