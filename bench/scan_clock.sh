#!/usr/bin/env bash
# MegaScan clock alignment (docs/scan.md, issue 17 §2): RUNS seeded runs per cell of llama-tiny
# (8 steps), every rank given a random recorded clock (`--inject clock:R:MS:PPM`, offsets uniform
# in ±50 ms, drifts uniform in ±200 ppm), on local threads and on MPI processes (`megac launch`,
# needs a release build with --features mpi); layouts tp2 dp2, dp4, pp2 dp2. The residual of an
# event time is |megac scan's aligned time - the true time on rank 0's recorded clock|; the truth
# comes from each rank file's `true_clock` (the process's wall-clock epoch, the injected offset
# and drift). Prints p50, p99 and max over every recorded event time of every run of a cell.
# Usage: bash bench/scan_clock.sh [RUNS] [MPI]   (defaults 5 1; MPI=0 skips the MPI cells)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
MPI=${2:-1}
if [ "$MPI" = 1 ]; then cargo build --release --features mpi -q; else cargo build --release -q; fi
M=target/release/megac
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
export OMPI_MCA_mpi_yield_when_idle=1

residuals() { # trace dir, scan json -> appends residuals (ns) to $T/res
  python3 - "$1" "$2" >>"$T/res" <<'PY'
import json, sys
d, rep = sys.argv[1], json.load(open(sys.argv[2]))
files = [json.load(open(f"{d}/rank-{r}.json")) for r in range(rep["ranks"])]
z = files[0]["true_clock"]
for r, f in enumerate(files):
    t = f["true_clock"]
    de = t["epoch_unix_ns"] - z["epoch_unix_ns"]  # exact (integers)
    oe, ee = rep["clock"]["offsets_us"][r] * 1e3, rep["clock"]["drift_ppm"][r] * 1e-6
    for e in f["events"]:
        if e[0] == "sync":
            continue
        for x in (e[1], e[2]):
            real = (x - t["offset_ns"]) / (1 + t["drift"]) + de  # ns since rank 0's epoch
            truth = real * (1 + z["drift"]) + z["offset_ns"]      # on rank 0's recorded clock
            est = (x - oe) / (1 + ee)
            print(f"{abs(est - truth):.1f}")
PY
}

cell() { # name, local|mpi, sets...
  local name=$1 how=$2; shift 2
  : >"$T/res"
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  if [ "$how" = mpi ]; then $M compile examples/llama-tiny.toml "${sets[@]}" -o "$T/plan" >/dev/null; fi
  for s in $(seq "$RUNS"); do
    local inj
    inj=$(python3 -c 'import random,sys; r=random.Random(int(sys.argv[1])); print(" ".join(f"--inject clock:{k}:{r.uniform(-50,50):.3f}:{r.uniform(-200,200):.2f}" for k in range(4)))' "$s")
    rm -rf "$T/tr"
    if [ "$how" = mpi ]; then
      # shellcheck disable=SC2086
      $M launch -n 4 "$T/plan" --steps 8 --trace "$T/tr" $inj >/dev/null 2>"$T/err" || { cat "$T/err"; exit 1; }
    else
      # shellcheck disable=SC2086
      $M train examples/llama-tiny.toml "${sets[@]}" --steps 8 --trace "$T/tr" $inj >/dev/null
    fi
    $M scan "$T/tr" --format json >"$T/scan.json"
    residuals "$T/tr" "$T/scan.json"
  done
  python3 - "$T/res" "$name" "$RUNS" <<'PY'
import sys
res = sorted(float(x) / 1e3 for x in open(sys.argv[1]))
q = lambda p: res[min(len(res) - 1, int(p * len(res)))]
print(f"| {sys.argv[2]} | {sys.argv[3]} | {len(res)} | {q(0.5):.2f} | {q(0.99):.2f} | {res[-1]:.2f} |")
PY
}

echo "| cell | runs | event times | p50 us | p99 us | max us |"
echo "|---|---|---|---|---|---|"
for how in local mpi; do
  [ "$how" = mpi ] && [ "$MPI" != 1 ] && continue
  cell "$how tp2 dp2" "$how" parallel.tp=2 parallel.dp=2
  cell "$how dp4" "$how" parallel.dp=4 train.global_batch=16
  cell "$how pp2 dp2" "$how" parallel.pp=2 parallel.dp=2
done
