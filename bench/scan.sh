#!/usr/bin/env bash
# MegaScan measurements (docs/scan.md), on local threads:
#   1. tracing overhead: bench/llama-bench.toml at tp2 dp2, STEPS steps, with and without
#      --trace, REPS alternating runs each; median step time (steps 2..) of each.
#   2. alignment: tp2 dp2 llama-tiny with clock:1:50:200 and clock:3:-50:-200; the residual
#      |aligned - true| over every recorded event (p50, p99, max, µs).
#   3. detection: RUNS seeded runs per cell (healthy, slow-rank 1.5x and 3x on a random rank,
#      slow link 3x) with jitter:0.05:SEED; recall and false alarms of megac scan and of
#      MegatronApp's three-stage heuristic (megac_runtime::scan::analyze::megatronapp_baseline).
# Usage: bash bench/scan.sh [STEPS] [REPS] [RUNS]   (defaults 6 3 5)
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-6}
REPS=${2:-3}
RUNS=${3:-5}
cargo build --release -q
M=target/release/megac
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT

median_step() { # report.json -> median seconds of steps 2..
  python3 -c 'import json,sys; s=sorted(x["seconds"] for x in json.load(open(sys.argv[1]))["steps"][1:]); print(s[len(s)//2])' "$1"
}

echo "== 1. tracing overhead (bench/llama-bench.toml, tp2 dp2, $STEPS steps, $REPS runs each)"
off=(); on=()
for i in $(seq "$REPS"); do
  $M train bench/llama-bench.toml --set parallel.tp=2 --set parallel.dp=2 --set train.global_batch=16 \
    --steps "$STEPS" --report "$T/off.json" >/dev/null
  off+=("$(median_step "$T/off.json")")
  $M train bench/llama-bench.toml --set parallel.tp=2 --set parallel.dp=2 --set train.global_batch=16 \
    --steps "$STEPS" --report "$T/on.json" --trace "$T/tr" >/dev/null
  on+=("$(median_step "$T/on.json")")
done
python3 - "${off[*]}" "${on[*]}" <<'PY'
import sys
off = sorted(map(float, sys.argv[1].split())); on = sorted(map(float, sys.argv[2].split()))
a, b = off[len(off)//2], on[len(on)//2]
print(f"step time without --trace {a*1e3:.1f} ms, with {b*1e3:.1f} ms: overhead {100*(b-a)/a:+.2f}% (runs: off {off}, on {on})")
PY

out=$(cargo test --release -q -p megac-runtime --lib scan::tests::recording -- --nocapture 2>/dev/null)
ns=$(sed -n 's/recording cost: \([0-9.]*\) ns per event/\1/p' <<<"$out")
clk=$(sed -n 's/thread clock reading: \([0-9.]*\) ns.*/\1/p' <<<"$out")
python3 - "$T/tr" "$T/on.json" "$ns" "$clk" <<'PY'
import json, sys
d, rep, ns = sys.argv[1], json.load(open(sys.argv[2])), float(sys.argv[3])
clk = float(sys.argv[4])
v = json.load(open(f"{d}/rank-0.json"))
per_step = len(v["events"]) / v["steps"]
step = sorted(s["seconds"] for s in rep["steps"][1:])[len(rep["steps"][1:]) // 2]
# Each event: its own record plus at most one compute-segment or transfer boundary (two
# clock reads and two readings of the thread's clocks).
bound = per_step * 2 * (ns + clk) * 1e-9
print(f"recording: {ns:.0f} ns per event, {clk:.0f} ns per thread-clock reading, "
      f"{per_step:.0f} events per step per rank: "
      f"at most {bound*1e6:.1f} us of a {step*1e3:.0f} ms step ({100*bound/step:.4f}%)")
PY

echo "== 2. clock alignment (llama-tiny tp2 dp2, 8 steps, clock:1:50:200 clock:3:-50:-200)"
$M train examples/llama-tiny.toml --set parallel.tp=2 --set parallel.dp=2 --steps 8 \
  --trace "$T/clk" --inject clock:1:50:200 --inject clock:3:-50:-200 >/dev/null
$M scan "$T/clk" --format json > "$T/clk.json"
python3 - "$T/clk" "$T/clk.json" <<'PY'
import json, sys
d, rep = sys.argv[1], json.load(open(sys.argv[2]))
truth = {1: (50e6, 200e-6), 3: (-50e6, -200e-6)}
res = []
for r in range(rep["ranks"]):
    ot, dt = truth.get(r, (0.0, 0.0))
    oe, de = rep["clock"]["offsets_us"][r] * 1e3, rep["clock"]["drift_ppm"][r] * 1e-6
    for e in json.load(open(f"{d}/rank-{r}.json"))["events"]:
        for x in (e[1], e[2]):
            res.append(abs((x - oe) / (1 + de) - (x - ot) / (1 + dt)) / 1e3)
res.sort()
q = lambda p: res[min(len(res) - 1, int(p * len(res)))]
print(f"estimated offsets {rep['clock']['offsets_us']} us, drifts {rep['clock']['drift_ppm']} ppm")
print(f"residual over {len(res)} event times: p50 {q(0.5):.1f} us, p99 {q(0.99):.1f} us, max {res[-1]:.1f} us")
PY

echo "== 3. detection ($RUNS seeded runs per cell, llama-tiny dp4, 6 steps, jitter:0.05:SEED)"
cell() { # name, expected finding (kind:ranks or none), inject...
  local name=$1 want=$2; shift 2
  local hit=0 false=0 bhit=0 bfalse=0
  for s in $(seq "$RUNS"); do
    local inj=("--inject" "jitter:0.05:$s")
    for i in "$@"; do inj+=("--inject" "${i//RANDR/$((s % 4))}"); done
    local w=${want//RANDR/$((s % 4))}
    rm -rf "$T/det"
    $M train examples/llama-tiny.toml $SETS --steps 6 --trace "$T/det" "${inj[@]}" >/dev/null
    out=$($M scan "$T/det" --format json | python3 -c 'import json,sys; v=json.load(sys.stdin); print(" ".join(f["kind"]+":"+",".join(map(str,f["ranks"])) for f in v["findings"]) or "none", " ".join("slow-rank:"+str(r) for r in v["baseline_megatronapp"]) or "none", sep="|")')
    got=${out%%|*}; base=${out#*|}
    if [ "$got" = "$w" ]; then hit=$((hit+1)); elif [ "$w" = none ] || [ "$got" != none ]; then false=$((false+1)); fi
    # MegatronApp's heuristic names ranks only: a slow link counts as found by it never.
    if [ "$base" = "$w" ]; then bhit=$((bhit+1)); elif [ "$w" = none ] || [ "$base" != none ]; then bfalse=$((bfalse+1)); fi
  done
  printf '%-28s megac: correct %d/%d, wrong or extra %d | MegatronApp: correct %d/%d, wrong or extra %d\n' \
    "$name" "$hit" "$RUNS" "$false" "$bhit" "$RUNS" "$bfalse"
}
SETS="--set parallel.dp=4 --set train.global_batch=16"
cell "healthy (dp4)" none
cell "slow-rank 1.5x (dp4)" "slow-rank:RANDR" "slow-rank:RANDR:1.5"
cell "slow-rank 3x (dp4)" "slow-rank:RANDR" "slow-rank:RANDR:3"
SETS="--set parallel.pp=2 --set parallel.dp=2"
cell "healthy (pp2 dp2)" none
cell "slow link 0-2 3x (pp2 dp2)" "slow-link:0,2" "slow-link:0-2:3"
