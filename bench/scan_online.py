#!/usr/bin/env python3
"""`--scan` while training (docs/scan.md, issue 17 section 3): how often and how soon the
online detector warns, over RUNS seeded runs per cell of STEPS steps, on local threads and
MPI processes, with the layouts and faults of bench/scan_detect.py plus a 1.5x slow rank
(`--scan` warns of a slow rank from a score of 1.3, WARN_SLOWDOWN; links at megac scan's
level). Every run has `jitter:0.05:SEED`; faults are there from step 1. Per cell:

  warned       runs in which every injected fault was warned of (a link as a slow-link)
  in 10 steps  runs in which every injected fault was warned of by step 11 (the fault starts
               with step 1)
  false alarm  runs with a warning of anything not injected (on healthy cells: any warning)
  step         the median step of the last injected fault's first warning, over the runs
               that warned of them all

Usage: python3 bench/scan_online.py [RUNS] [STEPS] [local,mpi] [LAYOUT,...]
       (defaults 200 20 local,mpi, every layout)
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scan_detect  # noqa: E402  (the layouts and faults, one home)

RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 200
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
COMMS = (sys.argv[3] if len(sys.argv) > 3 else "local,mpi").split(",")
ONLY = sys.argv[4].split(",") if len(sys.argv) > 4 else None
ROOT, M, ENV, LAYOUTS = scan_detect.ROOT, scan_detect.M, scan_detect.ENV, scan_detect.LAYOUTS

# "warning: --scan: step 9: slow-rank rank 2 (dp2): score 1.52 (...)" and
# "warning: --scan: step 3: slow-link rank 0 (...) <-> rank 2 (...): score 2.9 (...)"
WARN = re.compile(r"warning: --scan: step (\d+): (slow-rank|slow-link) rank (\d+)"
                  r"(?: \([^)]*\))?(?: <-> rank (\d+))?")


def faults(cell, seed):
    if cell == "slow-rank 1.5x":
        r = seed % 4
        return [f"slow-rank:{r}:1.5"], {("slow-rank", (r,))}
    return scan_detect.faults(cell, seed)


def run(comm, layout, plan, seed, inject):
    """{(kind, ranks): step of its first warning} of one run."""
    specs = [f"jitter:0.05:{seed}"] + inject
    common = ["--steps", str(STEPS), "--scan"] + [x for s in specs for x in ("--inject", s)]
    if comm == "mpi":
        cmd = [M, "launch", "-n", "4", plan] + common
    else:
        model, sets = LAYOUTS[layout]
        cmd = [M, "train", model] + [x for s in sets for x in ("--set", s)] + common
    err = subprocess.run(cmd, cwd=ROOT, env=ENV, check=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True).stderr
    warned = {}
    for m in WARN.finditer(err):
        ranks = tuple(sorted(int(x) for x in (m.group(3), m.group(4)) if x is not None))
        warned.setdefault((m.group(2), ranks), int(m.group(1)))
    return warned


def main():
    layouts = scan_detect.selected_layouts(ONLY)
    tmp = tempfile.mkdtemp()
    print(f"{RUNS} runs per cell, {STEPS} steps, 4 ranks, --scan, jitter:0.05:SEED on every run")
    print("| comm | layout | fault | runs | warned | in 10 steps | false alarm | step | s/run |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for comm in COMMS:
            for layout in layouts:
                plan = os.path.join(tmp, "plan")
                if comm == "mpi":
                    scan_detect.compile_plan(layout, plan)
                for cell in scan_detect.cells_of(layout, ["slow-rank 1.5x", "slow-rank 1.2x"]):
                    warned = soon = false = 0
                    steps = []
                    t0 = time.time()
                    for seed in range(1, RUNS + 1):
                        inject, want = faults(cell, seed)
                        got = run(comm, layout, plan, seed, inject)
                        false += bool(set(got) - want)
                        if want and want <= set(got):
                            warned += 1
                            last = max(got[w] for w in want)
                            soon += last <= 11
                            steps.append(last)
                    dt = (time.time() - t0) / RUNS
                    steps.sort()

                    def pct(k):
                        return "-" if cell == "healthy" else f"{100 * k / RUNS:.1f}%"

                    step = str(steps[len(steps) // 2]) if steps else "-"
                    print(f"| {comm} | {layout} | {cell} | {RUNS} | {pct(warned)} | {pct(soon)} "
                          f"| {100 * false / RUNS:.1f}% | {step} | {dt:.2f} |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
