#!/usr/bin/env python3
"""MegaDPP under jitter in the simulator (docs/scan.md, issue 17 section 5): how much can a
dynamic order win back from i.i.d. jitter at all? Compiles llama-tiny (8 layers) at pp4 vpp2
with M micro-batches a step for interleaved 1F1B and each dpp policy, and runs
`megac simulate --costs unit --jitter S:SEED` (every F takes 1 and BW 2 times 1 + S|z|; no
cores shared, no polling, no communication) over SEEDS seeds. Prints, per S, the median
step of each schedule over interleaved's, and jitter's excess: interleaved's median step over
its jitter-free step times the mean factor E[1 + S|z|] = 1 + S·sqrt(2/pi). The excess is the
waiting that the variance (not the mean) of the jitter adds to the static order. And the order
bound: `simulate`'s `pipeline_bound_seconds` of interleaved's run over its step, the median
over seeds: no order of the same actions, at the durations they took, could end the step
sooner than that fraction of interleaved's (each stage's own actions, plus micro-batch 0's
fastest forward through the chunks below the stage and the backward through them again).

Usage: python3 bench/dpp_sim.py [SEEDS] [M...]   (defaults 20, and M = 8 16 32)
"""

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

SEEDS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
MS = [int(x) for x in sys.argv[2:]] or [8, 16, 32]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M = os.path.join(ROOT, "target/release/megac")
SCHEDULES = {
    "interleaved": ["parallel.schedule=interleaved"],
    "dpp-bfs": ["parallel.schedule=dpp", "parallel.dpp_policy=bfs"],
    "dpp-dfs": ["parallel.schedule=dpp", "parallel.dpp_policy=dfs"],
    "dpp-adaptive": ["parallel.schedule=dpp", "parallel.dpp_policy=adaptive"],
    "dpp-ordered": ["parallel.schedule=dpp", "parallel.dpp_policy=ordered"],
}


def run(plan, jitter):
    cmd = [M, "simulate", plan, "--costs", "unit", "--format", "json"]
    if jitter:
        cmd += ["--jitter", jitter]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def step(plan, jitter):
    return run(plan, jitter)["step_seconds"]


def main():
    tmp = tempfile.mkdtemp()
    print(f"megac simulate --costs unit, llama-tiny 8 layers, pp4 vpp2, {SEEDS} seeds: median "
          "step over interleaved's; excess = interleaved / (jitter-free x E[1 + S|z|]); "
          "bound = the order bound of interleaved's run over its step")
    print("| m | S | " + " | ".join(SCHEDULES) + " | jitter's excess | order bound |")
    print("|---|---|" + "---|" * (len(SCHEDULES) + 2))
    for m in MS:
        plans = {}
        for name, sets in SCHEDULES.items():
            plans[name] = os.path.join(tmp, f"{name}-{m}")
            sets = sets + ["model.layers=8", "train.micro_batch=1", f"train.global_batch={m}",
                           "parallel.pp=4", "parallel.vpp=2"]
            cmd = [M, "compile", "examples/llama-tiny.toml", "-o", plans[name]]
            cmd += [x for s in sets for x in ("--set", s)]
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        free = step(plans["interleaved"], None)
        for s in (0.0, 0.1, 0.2, 0.4):
            med = {}
            for name, plan in plans.items():
                seeds = range(1, SEEDS + 1) if s > 0 else [0]
                med[name] = statistics.median(
                    step(plan, f"{s}:{seed}" if s > 0 else None) for seed in seeds)
            base = med["interleaved"]
            excess = base / (free * (1 + s * math.sqrt(2 / math.pi)))
            seeds = range(1, SEEDS + 1) if s > 0 else [0]
            runs = (run(plans["interleaved"], f"{s}:{seed}" if s > 0 else None) for seed in seeds)
            bound = statistics.median(r["pipeline_bound_seconds"] / r["pipeline_seconds"]
                                      for r in runs)
            cells = [f"{med[n] / base:.3f}" for n in SCHEDULES]
            print(f"| {m} | {s} | " + " | ".join(cells) + f" | {excess:.3f} | {bound:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
