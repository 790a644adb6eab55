#!/usr/bin/env bash
# One training step of a tp2 x dp2 plan of bench/llama-bench.toml (4-layer llama, hidden 256,
# vocab 4096, seq 256; micro batch 4, global batch 8 = 2048 tokens a step) with `--comm mpi`
# on 4 processes (`megac launch -n 4`) vs `--comm local` (4 threads in one process). Step 1
# warms up; tokens/s is taken over steps 2..N. Prints both and the ratio.
#
#   bash bench/mpi_step.sh [STEPS]      (default 5)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-5}
cargo build --release --quiet --features mpi --bin megac
megac=$PWD/target/release/megac
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$megac" compile bench/llama-bench.toml --set parallel.tp=2 --set parallel.dp=2 \
  --set train.micro_batch=4 --set train.global_batch=8 -o "$dir/plan" >/dev/null
tps() { # tokens/s over steps 2..N of a report
  python3 - "$1" <<'PY'
import json, sys
steps = json.load(open(sys.argv[1]))["steps"][1:]
print(f"{8 * 256 * len(steps) / sum(s['seconds'] for s in steps):.1f}")
PY
}
"$megac" launch -n 4 "$dir/plan" --steps "$steps" --report "$dir/mpi.json" 2>/dev/null | sed 's/^/  mpi:   /'
"$megac" run "$dir/plan" --comm local --steps "$steps" --report "$dir/local.json" | sed 's/^/  local: /'
mpi=$(tps "$dir/mpi.json")
local_=$(tps "$dir/local.json")
echo "cores: $(nproc)  plan: llama-bench tp2 x dp2 (4 ranks), 2048 tokens/step, steps 2..$steps"
echo "--comm mpi   (megac launch -n 4) tokens/s: $mpi"
echo "--comm local (4 threads)         tokens/s: $local_"
python3 -c "print(f'ratio mpi/local: {$mpi / $local_:.2f}')"
