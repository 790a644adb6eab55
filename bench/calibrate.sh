#!/usr/bin/env bash
# Calibration of the cost model (issue 13 §3). Prints:
# 1. every row of Megatron-LM's H100 weak-scaling table (shared/reference/megatron-lm.md §10.1)
#    predicted with the cluster's constants: the step time the published TFLOP/s imply, the
#    predicted one, their relative error and the layout the model picked; then the mean and
#    max |error| (targets: every row within 10%, mean within 5%; `sim/tests/calibrate.rs`
#    asserts them), and the held-out strong-scaling check (README: GPT-3 175B on 96 and 4,608
#    H100s);
# 2. the fit of the free constants (megac_sim::calibrate::fit) on all nine rows, beside the
#    cluster's, and the in-sample errors at the fitted constants;
# 3. the leave-one-out table: fit on eight rows, predict the ninth, with mean and max.
# Progress goes to stderr. About 15 s on 2 cores after the release build.
#
#   bash bench/calibrate.sh [CLUSTER.toml|PRESET] [--no-fit]     (default h100-sxm)
# Environment: CALIBRATE_KNOBS=gemm,attention,memory,tp_comm (the fitted set; also link,
# kernel), CALIBRATE_K (candidate layouts per row, 8), CALIBRATE_GRID (levels per knob, 5),
# CALIBRATE_STARTS (3), CALIBRATE_VERBOSE=1 (time breakdown per row).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --release --quiet -p megac-sim --example calibrate -- "${@:-h100-sxm}"
