//! Token cross-entropy over the vocabulary (the causal-LM loss).

use rayon::prelude::*;

use crate::simd::{exp, max, simd_dispatch, sum_f64};

/// The label value whose rows are skipped, as `torch.nn.CrossEntropyLoss(ignore_index=-100)`
/// (Hugging Face's default) does.
pub const IGNORE_INDEX: i32 = -100;

/// Rows per parallel task; fixed so the f64 sum is the same whatever the thread count.
const ROWS_PER_TASK: usize = 8;

/// The row's label as an index, `None` for [`IGNORE_INDEX`]; panics outside `0..vocab`.
#[inline]
fn label_index(label: i32, vocab: usize) -> Option<usize> {
    if label == IGNORE_INDEX {
        return None;
    }
    assert!(
        label >= 0 && (label as usize) < vocab,
        "cross_entropy: label {label} outside 0..{vocab}"
    );
    Some(label as usize)
}

simd_dispatch! {
    /// `(max, Σ e^(x - max))` of one row.
    fn max_and_sum_exp(x: &[f32]) -> (f32, f64) {
        let m = max(x);
        (m, sum_exp_shifted(x, m))
    }
}

/// `Σ e^(x - m)`: the exponentials of each block of 256 values go through a stack
/// buffer (a plain map loop, which LLVM vectorizes reliably) and are summed in f64.
#[inline(always)]
fn sum_exp_shifted(x: &[f32], m: f32) -> f64 {
    let mut buf = [0.0f32; 256];
    let mut total = 0.0f64;
    for blk in x.chunks(256) {
        let e = &mut buf[..blk.len()];
        for (e, &v) in e.iter_mut().zip(blk) {
            *e = exp(v - m);
        }
        total += sum_f64(e);
    }
    total
}

simd_dispatch! {
    /// `dl += scale * (softmax(x) - onehot(t))`, with `e` as scratch for the exponentials.
    fn softmax_accumulate(x: &[f32], t: usize, scale: f32, e: &mut [f32], dl: &mut [f32]) {
        let m = max(x);
        let e = &mut e[..x.len()];
        for (e, &v) in e.iter_mut().zip(x) {
            *e = exp(v - m);
        }
        let inv = (1.0 / sum_f64(e)) as f32;
        let before = dl[t];
        for (d, &ev) in dl.iter_mut().zip(e.iter()) {
            *d += scale * (ev * inv);
        }
        dl[t] = before + scale * (e[t] * inv - 1.0);
    }
}

/// `Σ_rows -log softmax(logits[r])[labels[r]]` over `logits` `[rows, vocab]`, each row's
/// log-sum-exp computed stably (max-shifted) and the total accumulated in f64. Rows
/// labelled [`IGNORE_INDEX`] (-100) contribute nothing; any other label outside
/// `0..vocab` panics. Divide by the number of counted rows for Hugging Face's mean loss.
pub fn cross_entropy_fwd(logits: &[f32], labels: &[i32], rows: usize, vocab: usize) -> f64 {
    assert_eq!(
        logits.len(),
        rows * vocab,
        "cross_entropy_fwd: logits must be [rows, vocab]"
    );
    assert_eq!(
        labels.len(),
        rows,
        "cross_entropy_fwd: labels must be [rows]"
    );
    if rows == 0 || vocab == 0 {
        return 0.0;
    }
    let task = |(x, l): (&[f32], &[i32])| -> f64 {
        let mut total = 0.0f64;
        for (row, &label) in x.chunks_exact(vocab).zip(l) {
            if let Some(t) = label_index(label, vocab) {
                let (m, s) = max_and_sum_exp(row);
                total += (m as f64 + s.ln()) - row[t] as f64;
            }
        }
        total
    };
    let chunk = ROWS_PER_TASK * vocab;
    if rows * vocab < crate::util::PAR_MIN_ELEMS {
        return task((logits, labels));
    }
    let parts: Vec<f64> = logits
        .par_chunks(chunk)
        .zip(labels.par_chunks(ROWS_PER_TASK))
        .map(task)
        .collect();
    parts.iter().sum()
}

/// Backward of [`cross_entropy_fwd`] scaled by `scale` (e.g. `1 / counted_rows` for a
/// mean): `dlogits[r] += scale * (softmax(logits[r]) - onehot(labels[r]))`; rows labelled
/// [`IGNORE_INDEX`] get nothing.
pub fn cross_entropy_bwd(
    logits: &[f32],
    labels: &[i32],
    rows: usize,
    vocab: usize,
    scale: f32,
    dlogits: &mut [f32],
) {
    assert_eq!(
        logits.len(),
        rows * vocab,
        "cross_entropy_bwd: logits must be [rows, vocab]"
    );
    assert_eq!(
        labels.len(),
        rows,
        "cross_entropy_bwd: labels must be [rows]"
    );
    assert_eq!(
        dlogits.len(),
        rows * vocab,
        "cross_entropy_bwd: dlogits must be [rows, vocab]"
    );
    if rows == 0 || vocab == 0 {
        return;
    }
    let task = |e: &mut Vec<f32>, ((dl, x), l): ((&mut [f32], &[f32]), &[i32])| {
        for ((drow, row), &label) in dl.chunks_exact_mut(vocab).zip(x.chunks_exact(vocab)).zip(l) {
            if let Some(t) = label_index(label, vocab) {
                softmax_accumulate(row, t, scale, e, drow);
            }
        }
    };
    if rows * vocab < crate::util::PAR_MIN_ELEMS {
        let mut e = vec![0.0f32; vocab];
        task(&mut e, ((dlogits, logits), labels));
        return;
    }
    dlogits
        .par_chunks_mut(ROWS_PER_TASK * vocab)
        .zip(logits.par_chunks(ROWS_PER_TASK * vocab))
        .zip(labels.par_chunks(ROWS_PER_TASK))
        .for_each_init(|| vec![0.0f32; vocab], task);
}
