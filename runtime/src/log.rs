//! Logs of a run for people who are not watching it: a line on stdout every
//! `--log-interval` steps when stdout is not a terminal (Slurm, nohup, a pipe), and
//! `--log FILE.jsonl`, one JSON object per step and per evaluation, flushed per line so that
//! the file can be followed while the run goes (`tail -f`).
//!
//! A log line (steps 11-20 of 100 here):
//!
//! ```text
//! step 20/100 | loss 4.1234 | grad norm 0.812 | lr 1.000e-03 | 51234 tok/s | elapsed 0:00:04 | ETA 0:00:16
//! ```
//!
//! The loss is the mean over the steps since the previous line, tokens/s is theirs (their
//! tokens over their step times), the grad norm and lr are the last step's, elapsed and ETA
//! count training only (not evaluations or checkpoint writes). fp16 adds
//! `| loss scale S | skipped K` (K: steps of the interval skipped on overflow). An evaluation
//! prints `eval step 20/100 | loss 4.2345 | ppl 69.04 | 4 batches | 0.12 s`.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::RuntimeError;
use crate::eval::EvalRecord;
use crate::train::StepRecord;

/// The log interval when `--log-interval` is not given.
pub const DEFAULT_LOG_INTERVAL: u64 = 10;

/// The steps of `steps` in the last log interval of `interval` steps: those after the last
/// multiple of `interval` before the last step (all of them in a run shorter than one
/// interval), as (first step, last step, their mean loss). None for no steps.
pub fn last_interval(steps: &[StepRecord], interval: u64) -> Option<(u64, u64, f64)> {
    let last = steps.last()?.step;
    let from = (last - 1) / interval.max(1) * interval.max(1) + 1;
    let window: Vec<&StepRecord> = steps.iter().filter(|s| s.step >= from).collect();
    let mean = window.iter().map(|s| s.loss).sum::<f64>() / window.len() as f64;
    Some((window[0].step, last, mean))
}

/// `h:mm:ss`.
pub fn fmt_duration(s: f64) -> String {
    let s = if s.is_finite() { s.round() as u64 } else { 0 };
    format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

/// The log of rank 0 (other ranks keep none).
pub(crate) struct RunLog {
    interval: u64,
    /// Print log lines on stdout.
    lines: bool,
    /// `--log`: the file and its path (for messages).
    file: Option<(std::fs::File, PathBuf)>,
    /// The run's last step.
    steps: u64,
    /// Tokens per step.
    tokens_per_step: u64,
    /// The interval so far: (loss sum, steps, seconds, skipped).
    window: (f64, u64, f64, u64),
}

impl RunLog {
    /// A log for a run ending at step `steps` (`lines`: print log lines; `file`: create or
    /// truncate it, and write every record to it).
    pub(crate) fn new(
        interval: u64,
        lines: bool,
        file: Option<&Path>,
        steps: u64,
        tokens_per_step: u64,
    ) -> Result<RunLog, RuntimeError> {
        let file = match file {
            Some(p) => {
                if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir).map_err(|e| io_err(p, &e))?;
                }
                let f = std::fs::File::create(p).map_err(|e| io_err(p, &e))?;
                Some((f, p.to_path_buf()))
            }
            None => None,
        };
        Ok(RunLog {
            interval: interval.max(1),
            lines,
            file,
            steps,
            tokens_per_step,
            window: (0.0, 0, 0.0, 0),
        })
    }

    /// Log step `r`; `elapsed`: seconds of training so far, `done`: steps this run trained.
    pub(crate) fn step(
        &mut self,
        r: &StepRecord,
        elapsed: f64,
        done: u64,
    ) -> Result<(), RuntimeError> {
        let w = &mut self.window;
        w.0 += r.loss;
        w.1 += 1;
        w.2 += r.seconds;
        w.3 += u64::from(r.skipped);
        if self.file.is_some() {
            let mut j = serde_json::json!({
                "kind": "step",
                "step": r.step,
                "loss": r.loss,
                "grad_norm": r.grad_norm,
                "lr": r.lr,
                "seconds": r.seconds,
                "tokens_per_s": self.tokens_per_step as f64 / r.seconds.max(1e-9),
                "elapsed": elapsed,
            });
            if let Some(scale) = r.loss_scale {
                j["loss_scale"] = serde_json::json!(scale);
                j["skipped"] = serde_json::json!(r.skipped);
            }
            self.write_json(&j)?;
        }
        if r.step.is_multiple_of(self.interval) {
            let (sum, n, seconds, skipped) = std::mem::take(&mut self.window);
            if self.lines && n > 0 {
                let eta = elapsed / done.max(1) as f64 * self.steps.saturating_sub(r.step) as f64;
                let mut line = format!(
                    "step {}/{} | loss {:.4} | grad norm {:.3} | lr {:.3e} | {:.0} tok/s | elapsed {} | ETA {}",
                    r.step,
                    self.steps,
                    sum / n as f64,
                    r.grad_norm,
                    r.lr,
                    (n * self.tokens_per_step) as f64 / seconds.max(1e-9),
                    fmt_duration(elapsed),
                    fmt_duration(eta)
                );
                if let Some(scale) = r.loss_scale {
                    line.push_str(&format!(
                        " | loss scale {} | skipped {skipped}",
                        crate::scaler::fmt_scale(scale)
                    ));
                }
                print_line(&line);
            }
        }
        Ok(())
    }

    /// Log evaluation `e`.
    pub(crate) fn eval(&mut self, e: &EvalRecord) -> Result<(), RuntimeError> {
        if self.file.is_some() {
            let j = serde_json::json!({
                "kind": "eval",
                "step": e.step,
                "loss": e.loss,
                "perplexity": e.perplexity(),
                "batches": e.batches,
                "seconds": e.seconds,
            });
            self.write_json(&j)?;
        }
        if self.lines {
            print_line(&eval_line(e, self.steps));
        }
        Ok(())
    }

    fn write_json(&mut self, j: &serde_json::Value) -> Result<(), RuntimeError> {
        let Some((f, path)) = &mut self.file else {
            return Ok(());
        };
        let mut line = j.to_string();
        line.push('\n');
        // One write per record, unbuffered: a reader never sees half a line of a finished
        // record.
        f.write_all(line.as_bytes())
            .and_then(|()| f.flush())
            .map_err(|e| io_err(path, &e))
    }
}

/// The line of an evaluation (log lines and the progress output).
pub(crate) fn eval_line(e: &EvalRecord, steps: u64) -> String {
    format!(
        "eval step {}/{} | loss {:.4} | ppl {:.2} | {} batch{} | {:.2} s",
        e.step,
        steps,
        e.loss,
        e.perplexity(),
        e.batches,
        if e.batches == 1 { "" } else { "es" },
        e.seconds
    )
}

/// Print a line on stdout and flush it (stdout is block-buffered when it is not a terminal).
/// A closed stdout is ignored: the run goes on (its report and checkpoints still matter).
fn print_line(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

fn io_err(path: &Path, e: &std::io::Error) -> RuntimeError {
    RuntimeError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}
