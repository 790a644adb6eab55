#!/usr/bin/env python3
"""dpp against interleaved 1F1B in alternating pairs (docs/scan.md, issue 17 section 5): on a
host whose speed drifts over minutes, a table of medians per schedule (bench/dpp_jitter.py)
moves by several percent between runs; a pair of runs a second apart sees the same host.

Each pair runs llama-tiny (8 layers, 8 micro-batches of one sequence) at pp PP vpp2 for STEPS
steps with interleaved and with dpp POLICY (in a seeded random order within the pair), on
local threads or MPI processes (`megac launch -n PP`), under CONDITION (`none` or `jitter`,
`jitter:0.2` with the pair's seed), and takes the ratio of their median step times (steps
2..). Prints the median of the PAIRS ratios with a 95% interval (the order statistics of the
median, binomial), and how many pairs had dpp faster.

Usage: python3 bench/dpp_pairs.py [PAIRS] [STEPS] [local|mpi] [PP] [POLICY] [none|jitter]
       (defaults 40 10 local 4 ordered none)
"""

import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile

PAIRS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 10
COMM = sys.argv[3] if len(sys.argv) > 3 else "local"
PP = int(sys.argv[4]) if len(sys.argv) > 4 else 4
POLICY = sys.argv[5] if len(sys.argv) > 5 else "ordered"
CONDITION = sys.argv[6] if len(sys.argv) > 6 else "none"
if COMM not in ("local", "mpi"):
    sys.exit(f"error: unknown communicator {COMM!r}; the communicators are 'local' and 'mpi'")
if CONDITION not in ("none", "jitter"):
    sys.exit(f"error: unknown condition {CONDITION!r}; the conditions are 'none' and 'jitter'")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M = os.path.join(ROOT, "target/release/megac")
ENV = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1")
SCHEDULES = {
    "interleaved": ["parallel.schedule=interleaved"],
    "dpp": ["parallel.schedule=dpp", f"parallel.dpp_policy={POLICY}"],
}


def sets(schedule):
    s = ["model.layers=8", "train.micro_batch=1", "train.global_batch=8", f"parallel.pp={PP}",
         "parallel.vpp=2"] + SCHEDULES[schedule]
    return [x for v in s for x in ("--set", v)]


def median_step(schedule, plan, report, seed):
    if COMM == "mpi":
        cmd = [M, "launch", "-n", str(PP), plan]
    else:
        cmd = [M, "train", "examples/llama-tiny.toml"] + sets(schedule)
    cmd += ["--steps", str(STEPS), "--report", report]
    if CONDITION == "jitter":
        cmd += ["--inject", f"jitter:0.2:{seed}"]
    subprocess.run(cmd, cwd=ROOT, env=ENV, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return statistics.median(s["seconds"] for s in json.load(open(report))["steps"][1:])


def interval(sorted_ratios):
    """95% interval of the median: order statistics k and n-1-k, with k the largest index
    such that P(Binomial(n, 1/2) <= k) <= 2.5%."""
    n = len(sorted_ratios)
    cdf, k = 0.0, -1
    for i in range(n):
        cdf += math.comb(n, i) / 2 ** n
        if cdf > 0.025:
            break
        k = i
    if k < 0:
        return sorted_ratios[0], sorted_ratios[-1]
    return sorted_ratios[k], sorted_ratios[n - 1 - k]


def main():
    tmp = tempfile.mkdtemp()
    report = os.path.join(tmp, "r.json")
    plans = {}
    if COMM == "mpi":
        for s in SCHEDULES:
            plans[s] = os.path.join(tmp, s)
            subprocess.run([M, "compile", "examples/llama-tiny.toml"] + sets(s) + ["-o", plans[s]],
                           cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rng = random.Random(17)
    ratios = []
    for seed in range(1, PAIRS + 1):
        order = list(SCHEDULES)
        rng.shuffle(order)
        t = {s: median_step(s, plans.get(s), report, seed) for s in order}
        ratios.append(t["dpp"] / t["interleaved"])
    ratios.sort()
    lo, hi = interval(ratios)
    faster = sum(r < 1 for r in ratios)
    print(f"{COMM} pp{PP} vpp2 {CONDITION}: dpp-{POLICY} / interleaved over {PAIRS} pairs of "
          f"{STEPS} steps: median {statistics.median(ratios):.3f} (95% {lo:.3f}-{hi:.3f}), "
          f"dpp faster in {faster} of {PAIRS}")


if __name__ == "__main__":
    main()
