#!/usr/bin/env bash
# Calibration of the cost model (issue: cost model, simulator and layout search): predicts
# every row of Megatron-LM's H100 weak-scaling table (shared/reference/megatron-lm.md §10.1)
# and prints, per row, the step time the published TFLOP/s imply, the predicted one, their
# relative error and the layout the model picked; then the mean and max |error|
# (targets: every row within 10%, mean within 5%). `sim/tests/calibrate.rs` asserts them.
#
#   bash bench/calibrate.sh [CLUSTER.toml|PRESET]     (default h100-sxm)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --release --quiet -p megac-sim --example calibrate -- "${1:-h100-sxm}"
