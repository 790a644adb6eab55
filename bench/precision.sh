#!/usr/bin/env bash
# Loss curves of fp32, bf16 and fp16 (dynamic loss scaler) on the same data: llama-tiny on
# examples/data/corpus.txt for N steps (default 300), from the same seed. Prints the mean
# loss of the last 20 steps per precision, the gap to fp32 (absolute and relative), the
# largest per-step gap after the first 50 steps, fp16's skipped steps and tokens/s.
#
#   bench/precision.sh [N] [MODEL.toml]
#
# Release build; about a minute on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-300}"
MODEL="${2:-examples/llama-tiny.toml}"
cargo build --release --quiet
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
for p in fp32 bf16 fp16; do
  ./target/release/megac train "$MODEL" --data examples/data/corpus.txt --steps "$N" \
    --set "train.precision=\"$p\"" --report "$dir/$p.json" >/dev/null
done
python3 - "$dir" "$N" <<'PY'
import json, sys
d, n = sys.argv[1], int(sys.argv[2])
r = {p: json.load(open(f"{d}/{p}.json")) for p in ("fp32", "bf16", "fp16")}
loss = {p: [s["loss"] for s in r[p]["steps"]] for p in r}
tail = lambda xs: sum(xs[-20:]) / len(xs[-20:])
base = tail(loss["fp32"])
print(f"{n} steps, mean loss of the last 20 steps:")
for p in ("fp32", "bf16", "fp16"):
    t = tail(loss[p])
    gap = max(abs(a - b) for a, b in zip(loss[p][50:], loss["fp32"][50:])) if n > 50 else float("nan")
    skipped = sum(1 for s in r[p]["steps"] if s.get("skipped"))
    extra = f", {skipped} steps skipped (loss scaler)" if p == "fp16" else ""
    print(f"  {p}: {t:.4f} (gap to fp32 {t - base:+.4f}, {100 * (t - base) / base:+.2f}%; "
          f"largest step gap after step 50: {gap:.4f}){extra}; {r[p]['tokens_per_s']:.0f} tokens/s")
PY
