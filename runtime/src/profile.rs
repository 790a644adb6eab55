//! Per-op kernel timings (`--profile`) and the Chrome-trace timeline (`--trace`).

/// Time and matmul FLOPs per op name, gathered with `--profile`; with `--trace`, also every
/// kernel call as a timeline event.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    /// op name -> (seconds, matmul FLOPs, calls).
    pub by_op: std::collections::BTreeMap<&'static str, (f64, f64, u64)>,
    /// Timeline events, when tracing.
    pub events: Option<Vec<TraceEvent>>,
    /// Time zero of the timeline.
    pub origin: std::time::Instant,
}

impl Default for Profile {
    fn default() -> Self {
        Profile {
            by_op: Default::default(),
            events: None,
            origin: std::time::Instant::now(),
        }
    }
}

/// One kernel call on the timeline.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEvent {
    /// Op name.
    pub name: &'static str,
    /// Provenance path of the instruction.
    pub path: String,
    /// Start, in seconds since the profile's origin.
    pub start_s: f64,
    /// Duration in seconds.
    pub seconds: f64,
}

impl Profile {
    /// The timeline as a Chrome trace (opens in Perfetto / chrome://tracing): one track of
    /// kernels and one of steps (`steps` holds each step's (start, seconds) on the same clock).
    pub fn chrome_trace(&self, rank: usize, steps: &[(u64, f64, f64)]) -> String {
        let us = |s: f64| (s * 1e6 * 1000.0).round() / 1000.0;
        let mut events: Vec<serde_json::Value> = Vec::new();
        for (step, start, secs) in steps {
            events.push(serde_json::json!({
                "name": format!("step {step}"), "cat": "step", "ph": "X",
                "ts": us(*start), "dur": us(*secs), "pid": rank, "tid": 0
            }));
        }
        for e in self.events.iter().flatten() {
            events.push(serde_json::json!({
                "name": e.name, "cat": "kernel", "ph": "X", "ts": us(e.start_s), "dur": us(e.seconds),
                "pid": rank, "tid": 1, "args": { "path": e.path }
            }));
        }
        let v = serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" });
        let mut s = serde_json::to_string(&v).expect("trace serializes");
        s.push('\n');
        s
    }

    /// A table, most expensive first, with the matmul share and achieved GFLOP/s.
    pub fn render(&self) -> String {
        let total: f64 = self.by_op.values().map(|v| v.0).sum();
        let mut rows: Vec<_> = self.by_op.iter().collect();
        rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
        let mut out = format!(
            "{:<22} {:>9} {:>7} {:>8} {:>10}\n",
            "op", "seconds", "share", "calls", "GFLOP/s"
        );
        for (name, (secs, flops, calls)) in rows {
            let gf = if *flops > 0.0 {
                format!("{:.1}", flops / secs / 1e9)
            } else {
                "-".into()
            };
            out.push_str(&format!(
                "{name:<22} {secs:>9.3} {:>6.1}% {calls:>8} {gf:>10}\n",
                100.0 * secs / total.max(1e-12)
            ));
        }
        let (mm_s, mm_f) = self
            .by_op
            .values()
            .filter(|v| v.1 > 0.0)
            .fold((0.0, 0.0), |a, v| (a.0 + v.0, a.1 + v.1));
        out.push_str(&format!(
            "matmuls: {:.1}% of kernel time, {:.1} GFLOP/s achieved\n",
            100.0 * mm_s / total.max(1e-12),
            mm_f / mm_s.max(1e-12) / 1e9
        ));
        out
    }
}
