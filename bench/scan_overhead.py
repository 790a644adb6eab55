#!/usr/bin/env python3
"""What `--trace` costs a training step (docs/scan.md, issue 17 section 1): A/B on
bench/llama-bench.toml tp2 dp2 (4 ranks), on local threads (`megac train`) and MPI
processes (`megac launch -n 4`, needs target/release/megac built with --features mpi).
REPS pairs of runs per communicator, each pair one run without and one with `--trace`,
their order alternating from pair to pair; per run the median step time of steps 2..STEPS.
Prints per communicator the pooled median of each side and the median of the pairs' ratios
(with / without), with the spread of those ratios.

Usage: python3 bench/scan_overhead.py [STEPS] [REPS] [local,mpi]   (defaults 8 10 local,mpi)
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 10
COMMS = (sys.argv[3] if len(sys.argv) > 3 else "local,mpi").split(",")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M = os.path.join(ROOT, "target/release/megac")
ENV = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1")
SETS = ["parallel.tp=2", "parallel.dp=2", "train.global_batch=16"]


def median_step(comm, plan, tmp, trace):
    report = os.path.join(tmp, "r.json")
    common = ["--steps", str(STEPS), "--report", report]
    if trace:
        shutil.rmtree(os.path.join(tmp, "tr"), ignore_errors=True)
        common += ["--trace", os.path.join(tmp, "tr")]
    if comm == "mpi":
        cmd = [M, "launch", "-n", "4", plan] + common
    else:
        cmd = [M, "train", "bench/llama-bench.toml"] + [x for s in SETS for x in ("--set", s)]
        cmd += common
    subprocess.run(cmd, cwd=ROOT, env=ENV, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return statistics.median(s["seconds"] for s in json.load(open(report))["steps"][1:])


def main():
    tmp = tempfile.mkdtemp()
    try:
        plan = os.path.join(tmp, "plan")
        subprocess.run([M, "compile", "bench/llama-bench.toml"]
                       + [x for s in SETS for x in ("--set", s)] + ["-o", plan],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        print(f"bench/llama-bench.toml tp2 dp2, {STEPS} steps, {REPS} pairs of runs; "
              "median step time of steps 2..")
        print("| comm | without --trace (ms) | with --trace (ms) | ratio, median of pairs "
              "| pairs' ratios, min-max |")
        print("|---|---|---|---|---|")
        for comm in COMMS:
            off, on, ratios = [], [], []
            for i in range(REPS):
                order = (False, True) if i % 2 == 0 else (True, False)
                t = {tr: median_step(comm, plan, tmp, tr) for tr in order}
                off.append(t[False])
                on.append(t[True])
                ratios.append(t[True] / t[False])
            print(f"| {comm} | {1e3 * statistics.median(off):.1f} | "
                  f"{1e3 * statistics.median(on):.1f} | {statistics.median(ratios):.4f} | "
                  f"{min(ratios):.4f}-{max(ratios):.4f} |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
