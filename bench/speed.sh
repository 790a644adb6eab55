#!/usr/bin/env bash
# Compiler and search speed (issue: cost model, simulator and layout search):
#   - `megac compile` of GPT-3 175B for 1,024 GPUs and of a 1T GPT for 16,384 GPUs
#     (target: under 1 s each);
#   - `megac plan` of GPT-3 175B on 1,024 GPUs (target: over 1,000 layouts/s).
# Both use the papers' layouts: 175B as examples/gpt3-175b.toml (TP8 PP16 VPP2 DP8,
# interleaved, sp, distributed optimizer), 1T as bench/gpt-1t.toml (TP8 PP64 DP32).
#
#   bash bench/speed.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
megac=./target/release/megac
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0

seconds() { # run "$@" quietly, print its wall time in seconds
  local t0 t1
  t0=$(date +%s.%N)
  "$@" >/dev/null
  t1=$(date +%s.%N)
  python3 -c "print(f'{$t1 - $t0:.3f}')"
}

check() { # name value op target
  if python3 -c "import sys; sys.exit(0 if $2 $3 $4 else 1)"; then
    echo "  ok    $1: $2 (target $3 $4)"
  else
    echo "  FAIL  $1: $2 (target $3 $4)"
    status=1
  fi
}

t175=$(seconds $megac compile examples/gpt3-175b.toml -o "$out/gpt3-175b")
t1t=$(seconds $megac compile bench/gpt-1t.toml -o "$out/gpt-1t")
plan_line=$($megac plan examples/gpt3-175b.toml --gpus 1024 --top 3 | tail -n 1)
echo "compile GPT-3 175B, 1,024 GPUs (tp8 pp16 vpp2 dp8): $t175 s"
echo "compile GPT 1T, 16,384 GPUs (tp8 pp64 dp32):       $t1t s"
echo "plan GPT-3 175B, 1,024 GPUs:                 $plan_line"
n=$(echo "$plan_line" | awk '{print $2}')
t=$(echo "$plan_line" | awk '{print $5}')
rate=$(python3 -c "print(f'{$n / max($t, 1e-9):.0f}')")
echo "  = $rate layouts/s"
check "compile 175B (s)" "$t175" "<" 1
check "compile 1T (s)" "$t1t" "<" 1
check "plan layouts/s" "$rate" ">" 1000
exit $status
