#!/usr/bin/env python3
"""How MIN_BLOCK_SLOWDOWN and the interquartile mean were chosen (docs/scan.md, issue 17):
records RUNS seeded llama-tiny runs (STEPS steps, `jitter:0.05:SEED`) of each layout, healthy
and with a 1.1x slow rank (bench/scan_detect.py's cells), then scores each rank's blocks of
rotated steps (2 steps on a 2-core machine, as `detect_slow_ranks` forms them) with four
estimators at three levels. Prints, per estimator and level, the healthy runs naming a rank
and the 1.1x runs naming the slow one. (A sketch of the detector without its sequential
naming and inversion veto: a level is chosen here, the detector itself is measured by
bench/scan_detect.py.)

Usage: python3 bench/scan_levels.py [RUNS] [STEPS] [LAYOUTS]   (defaults 100 17 "dp4,cp2 dp2")
"""

import importlib.util
import json
import math
import os
import shutil
import statistics as st
import subprocess
import sys
import tempfile

RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 100
STEPS = sys.argv[2] if len(sys.argv) > 2 else "17"
LAYOUTS = (sys.argv[3] if len(sys.argv) > 3 else "dp4,cp2 dp2").split(",")
HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("sd", os.path.join(HERE, "scan_detect.py"))
sd = importlib.util.module_from_spec(spec)
argv, sys.argv = sys.argv, sys.argv[:1]
spec.loader.exec_module(sd)
sys.argv = argv


def blocks(d):
    """Per rank: the log-ratios of its blocks of two judged steps against its role peers."""
    ranks = [json.load(open(os.path.join(d, f))) for f in sorted(os.listdir(d))
             if f.startswith("rank-")]
    roles = {}
    for r in ranks:
        roles.setdefault(r["role"], []).append(r["rank"])
    steps = ranks[0]["steps"]
    seg = {r["rank"]: {} for r in ranks}
    for r in ranks:
        for e in r["events"]:
            if e[0] == "compute" and e[3] >= 2:
                seg[r["rank"]][(e[3], e[4])] = max(e[2] - e[1] - e[8], 1)
    out = {}
    for members in roles.values():
        for r in members:
            peers = [p for p in members if p != r]
            logs = []
            for s0 in range(2, steps, 2):
                a = b = 0.0
                for (s, i), d_ in seg[r].items():
                    if s not in (s0, s0 + 1) or any((s, i) not in seg[p] for p in peers):
                        continue
                    m = st.median(math.log(seg[p][(s, i)]) for p in peers)
                    a, b = a + d_, b + math.exp(m)
                logs.append(math.log(a / b))
            out[r] = logs
    return out


def iqm(v):
    v = sorted(v)
    k = len(v) // 4
    return sum(v[k:len(v) - k]) / len(v[k:len(v) - k])


ESTIMATORS = {"geometric mean": lambda v: sum(v) / len(v), "median": st.median,
              "interquartile mean": iqm}


def main():
    tmp = tempfile.mkdtemp()
    data = []  # (layout, cell, slow ranks, blocks)
    try:
        for layout in LAYOUTS:
            for cell in ("healthy", "slow-rank 1.1x"):
                for seed in range(1, RUNS + 1):
                    inject, want = sd.faults(cell, seed)
                    d = os.path.join(tmp, "t")
                    shutil.rmtree(d, ignore_errors=True)
                    specs = [f"jitter:0.05:{seed}"] + inject
                    cmd = [sd.M, "train", "examples/llama-tiny.toml"]
                    cmd += [x for s in sd.LAYOUTS[layout] for x in ("--set", s)]
                    cmd += ["--steps", STEPS, "--trace", d]
                    cmd += [x for s in specs for x in ("--inject", s)]
                    subprocess.run(cmd, cwd=sd.ROOT, check=True, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
                    data.append((layout, cell, {w[1][0] for w in want}, blocks(d)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{RUNS} runs per cell, llama-tiny, {STEPS} steps, jitter:0.05:SEED")
    print("| estimator | level | " + " | ".join(
        f"{l} healthy naming a rank | {l} 1.1x found" for l in LAYOUTS) + " |")
    print("|---|---|" + "---|---|" * len(LAYOUTS))
    for name, f in ESTIMATORS.items():
        for level in (1.04, 1.05, 1.06):
            cols = []
            for layout in LAYOUTS:
                fa = found = 0
                for l, cell, slow, b in data:
                    if l != layout:
                        continue
                    named = {r for r, v in b.items() if math.exp(f(v)) >= level}
                    if cell == "healthy":
                        fa += bool(named)
                    else:
                        found += slow <= named
                cols += [f"{fa}/{RUNS}", f"{found}/{RUNS}"]
            print(f"| {name} | {level} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
