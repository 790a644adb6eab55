#!/usr/bin/env bash
# Step throughput of megac vs PyTorch eager on the same model and step (issue 3's benchmark):
# a 4-layer llama, hidden 256, 8 heads, ffn 688, vocab 4096, seq 256, micro batch 8, fp32,
# 2 threads. Prints both tokens/s, the ratio, and megac's per-op profile (matmul share and
# achieved GFLOP/s). PyTorch is optional: without it only megac's figures are printed.
#
# Fusion (issue 19): where LLVM/MLIR 22 is installed (/usr/lib/llvm-22, or MLIR=0 to skip)
# megac is built with the `mlir` feature and runs twice per round, `--fusion off` then
# `--fusion on` (on first in even rounds), interleaved with PyTorch over ROUNDS rounds (the
# machine may be loaded: compare the ratios of one round). Fused kernels come from the disk
# cache after the first run (MEGAC_KERNEL_CACHE, docs/mlir.md). Each megac run also reports the share of its step time
# outside the GEMMs (1 - linear* kernel seconds / step seconds over steps 2..N).
#
#   bash bench/step_throughput.sh [STEPS] [ROUNDS]
#   PYTHON=/path/to/venv/bin/python3 bash bench/step_throughput.sh   # a venv with torch
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-20}
rounds=${2:-1}
py=${PYTHON:-python3}
features=()
modes=(default)
if [ "${MLIR:-1}" != 0 ] && [ -x /usr/lib/llvm-22/bin/llvm-config ]; then
  features=(--features mlir)
  modes=(off on)
fi
cargo build --release --quiet "${features[@]}"
bin="${CARGO_TARGET_DIR:-target}/release/megac"
plan=$(mktemp -d)
trap 'rm -rf "$plan"' EXIT
"$bin" compile bench/llama-bench.toml -o "$plan" >/dev/null
have_torch=0
if "$py" -c "import torch, transformers" 2>/dev/null; then have_torch=1; fi

# megac_run MODE: one run; prints its profile, then `tps share` on the last line.
megac_run() {
  local mode=$1 report="$plan/report-$1.json" out="$plan/out-$1.txt" flag=()
  [ "$mode" != default ] && flag=(--fusion "$mode")
  # Step 1 warms up (first-touch page faults, thread pool, the JIT); tokens/s is over 2..N.
  "$bin" run "$plan" --steps "$steps" --report "$report" --profile "${flag[@]}" \
    | tail -n +2 >"$out"
  python3 - "$report" "$out" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
steps = r["steps"][1:]
secs = sum(s["seconds"] for s in steps)
gemm = 0.0
for line in open(sys.argv[2]):
    f = line.split()
    if f and f[0].startswith("linear"):
        gemm += float(f[1])
print(f"{8 * 256 * len(steps) / secs:.1f} {100 * (1 - gemm / secs):.1f}")
PY
}

for round in $(seq 1 "$rounds"); do
  echo "round $round:"
  # Fusion off then on in odd rounds, on then off in even ones: no order bias over rounds.
  order=("${modes[@]}")
  if [ "${#modes[@]}" = 2 ] && [ $((round % 2)) = 0 ]; then order=(on off); fi
  for mode in "${order[@]}"; do
    read -r tps share < <(megac_run "$mode" | tail -n 1)
    [ "$round" = "$rounds" ] && { echo "  megac profile (fusion $mode):"; sed 's/^/    /' "$plan/out-$mode.txt"; }
    echo "  megac (fusion $mode) tokens/s: $tps, step time outside GEMMs: $share%"
    eval "tps_$mode=$tps"
  done
  if [ "$have_torch" = 1 ]; then
    torch_tps=$("$py" bench/pytorch_step.py "$steps" 2>/dev/null | sed -n 's/^pytorch tokens\/s: //p')
    echo "  pytorch tokens/s: $torch_tps"
    for mode in "${modes[@]}"; do
      t=$(eval "echo \$tps_$mode")
      python3 -c "print(f'  ratio megac (fusion $mode)/pytorch: {$t / $torch_tps:.2f}')"
    done
  fi
  if [ "${#modes[@]}" = 2 ]; then
    python3 -c "print(f'  ratio fusion on/off: {$tps_on / $tps_off:.3f}')"
  fi
done
if [ "$have_torch" = 0 ]; then
  echo "pytorch: not installed (pip install torch transformers; or PYTHON=venv/bin/python3) - ratio not measured"
fi
