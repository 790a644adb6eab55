#!/usr/bin/env bash
# The analytic model (`megac plan`) against the plan path (`megac compile` + `megac simulate`)
# for the best K layouts of a model on N GPUs: per layout, the relative difference of the
# step time and of the peak memory per rank (plan / simulate - 1), then the largest of each.
# Issue 13's goal: time within 5%, memory within 2%.
#
#   bash bench/plan_vs_simulate.sh MODEL.toml GPUS [K]      e.g. examples/llama3-8b.toml 8 10
set -euo pipefail
cd "$(dirname "$0")/.."
model="$1"; gpus="$2"; top="${3:-10}"
cargo build --release --quiet
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
./target/release/megac plan "$model" --gpus "$gpus" --top "$top" --format json > "$dir/plan.json"
python3 - "$model" "$dir" <<'PY'
import json, subprocess, sys
model, d = sys.argv[1], sys.argv[2]
v = json.load(open(f"{d}/plan.json"))
worst_t = worst_m = 0.0
for i, l in enumerate(v["layouts"]):
    out = f"{d}/p{i}"
    args = ["./target/release/megac", "compile", model]
    for s in l["set"]:
        args += ["--set", s]
    subprocess.run(args + ["-o", out], check=True, capture_output=True)
    r = subprocess.run(["./target/release/megac", "simulate", out, "--format", "json"],
                       check=True, capture_output=True, text=True)
    s = json.loads(r.stdout)
    t = s["step_seconds"]
    mem = max(x["memory_bytes"] for x in s["roles"])
    dt, dm = l["step_seconds"] / t - 1, l["peak_memory_bytes"] / mem - 1
    worst_t, worst_m = max(worst_t, abs(dt)), max(worst_m, abs(dm))
    layout = " ".join(x.replace("parallel.", "").replace("train.", "") for x in l["set"])
    print(f"time {dt:+6.1%}  memory {dm:+6.1%}  plan {l['step_seconds']:.3f} s "
          f"{l['peak_memory_bytes'] / 2**30:.1f} GiB  simulate {t:.3f} s {mem / 2**30:.1f} GiB  {layout}")
print(f"largest difference over {len(v['layouts'])} layouts: time {worst_t:.1%}, memory {worst_m:.1%}")
PY
