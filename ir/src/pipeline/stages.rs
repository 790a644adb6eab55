//! The stage split: how many layers each pipeline chunk (virtual stage) holds.
//!
//! `parallel.stage_layers = [..]` lists them; `parallel.stage_layers = "balanced"` asks for
//! the contiguous split that minimises the most expensive chunk under a per-layer cost
//! estimate (Megatron's model FLOPs of the layer, forward and backward, plus the output layer
//! and loss on the last chunk, from [`crate::flops::layer_flops`] and
//! [`crate::flops::head_flops`]; the embedding is a gather and costs nothing); without the key
//! every chunk gets `layers / (pp·vpp)` (Megatron's default). Chunk `c` runs on pipeline rank
//! `c % pp` ([`crate::mesh::chunk_owner`]).

use crate::flops::{head_flops, layer_flops};
use crate::spec::ModelSpec;

/// Layers per chunk, in chunk order (`pp·vpp` entries adding up to `model.layers`), or why
/// the model does not split.
pub fn chunk_layers(spec: &ModelSpec) -> Result<Vec<u64>, String> {
    let p = &spec.parallel;
    let nc = p.pp * p.vpp;
    let layers = spec.model.layers;
    if !p.stage_layers.is_empty() {
        let sum: u64 = p.stage_layers.iter().sum();
        if p.stage_layers.len() as u64 != nc || sum != layers {
            return Err(format!(
                "parallel.stage_layers {:?} does not split {layers} layers into pp·vpp = {nc} chunks",
                p.stage_layers
            ));
        }
        return Ok(p.stage_layers.clone());
    }
    if layers < nc {
        return Err(format!(
            "{layers} layers do not fill pp·vpp = {nc} pipeline chunks"
        ));
    }
    if p.balance_stages {
        let costs: Vec<f64> = (0..layers)
            .map(|l| layer_flops(spec, l).training())
            .collect();
        return Ok(balanced(&costs, nc as usize, 3.0 * head_flops(spec)));
    }
    if !layers.is_multiple_of(nc) {
        return Err(format!(
            "{layers} layers do not split into pp·vpp = {nc} equal chunks; list them in parallel.stage_layers or set it to \"balanced\""
        ));
    }
    Ok(vec![layers / nc; nc as usize])
}

/// The contiguous split of `costs` into `chunks` non-empty runs that minimises the largest
/// run's cost, with `last_extra` added to the last run. Ties go to the split whose earlier
/// chunks are longest (deterministic).
pub fn balanced(costs: &[f64], chunks: usize, last_extra: f64) -> Vec<u64> {
    let n = costs.len();
    let mut prefix = vec![0.0; n + 1];
    for (i, c) in costs.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c;
    }
    let run = |a: usize, b: usize, last: bool| {
        prefix[b] - prefix[a] + if last { last_extra } else { 0.0 }
    };
    // best[c][i]: the smallest largest-run cost of the first i layers in c runs.
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; n + 1]; chunks + 1];
    let mut cut = vec![vec![0usize; n + 1]; chunks + 1];
    best[0][0] = 0.0;
    for c in 1..=chunks {
        let last = c == chunks;
        for i in c..=n {
            for j in (c - 1)..i {
                let v = best[c - 1][j].max(run(j, i, last));
                // Strictly better, or equal with a later cut (longer earlier chunks).
                if v < best[c][i] || (v == best[c][i] && j > cut[c][i]) {
                    best[c][i] = v;
                    cut[c][i] = j;
                }
            }
        }
    }
    let mut sizes = vec![0u64; chunks];
    let mut i = n;
    for c in (1..=chunks).rev() {
        let j = cut[c][i];
        sizes[c - 1] = (i - j) as u64;
        i = j;
    }
    sizes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_layers_split_evenly_and_a_heavy_head_moves_layers_forward() {
        assert_eq!(balanced(&[1.0; 8], 4, 0.0), vec![2, 2, 2, 2]);
        // A head worth two layers: the last chunk gets fewer.
        let s = balanced(&[1.0; 32], 4, 2.0);
        assert_eq!(s.iter().sum::<u64>(), 32);
        assert!(s[3] < s[0], "{s:?}");
        let cost = |k: usize| -> f64 {
            let start: u64 = s[..k].iter().sum();
            s[k] as f64 + if k == 3 { 2.0 } else { 0.0 } + 0.0 * start as f64
        };
        let worst = (0..4).map(cost).fold(0.0, f64::max);
        assert!(worst <= 9.0, "{s:?}");
    }

    #[test]
    fn every_chunk_gets_a_layer() {
        assert_eq!(balanced(&[1.0, 100.0, 1.0], 3, 0.0), vec![1, 1, 1]);
        assert_eq!(balanced(&[5.0, 1.0, 1.0, 1.0], 2, 0.0), vec![1, 3]);
    }
}
