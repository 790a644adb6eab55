#!/usr/bin/env bash
# Step throughput of megac vs PyTorch eager on the same model and step (issue 3's benchmark):
# a 4-layer llama, hidden 256, 8 heads, ffn 688, vocab 4096, seq 256, micro batch 8, fp32,
# 2 threads. Prints both tokens/s, the ratio, and megac's per-op profile (matmul share and
# achieved GFLOP/s). PyTorch is optional: without it only megac's figures are printed.
#
#   bash bench/step_throughput.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-20}
cargo build --release --quiet
plan=$(mktemp -d)
trap 'rm -rf "$plan"' EXIT
./target/release/megac compile bench/llama-bench.toml -o "$plan" >/dev/null
report="$plan/report.json"
# Step 1 warms up (first-touch page faults, thread pool); tokens/s is taken over steps 2..N.
./target/release/megac run "$plan" --steps "$steps" --report "$report" --profile | tail -n +2 | sed 's/^/  /'
megac_tps=$(python3 - "$report" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
steps = r["steps"][1:]
tokens = 8 * 256 * len(steps)
print(f"{tokens / sum(s['seconds'] for s in steps):.1f}")
PY
)
echo "megac tokens/s: $megac_tps"
if python3 -c "import torch, transformers" 2>/dev/null; then
  torch_tps=$(python3 bench/pytorch_step.py "$steps" 2>/dev/null | sed -n 's/^pytorch tokens\/s: //p')
  echo "pytorch tokens/s: $torch_tps"
  python3 -c "print(f'ratio megac/pytorch: {$megac_tps / $torch_tps:.2f}')"
else
  echo "pytorch: not installed (pip install torch transformers) - ratio not measured"
fi
