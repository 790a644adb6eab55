#!/usr/bin/env python3
"""MegaDPP under jitter (docs/scan.md, issue 17 section 5): dpp (bfs, dfs, adaptive) against
interleaved 1F1B at pp4 vpp2 and pp2 vpp2 on local threads, llama-tiny with 8 layers and 8
micro-batches of one sequence a step, three conditions: no injection, `jitter:0.2:SEED`
(every compute segment slowed by 1 + 0.2|z|), and a 3x slow link between the ranks of stages
0 and 1 (`slow-link:0-1:3`). STEPS steps x SEEDS seeds per (layout, condition, schedule); the
schedules of one seed run one after another (interleaved in time, so the machine's load falls
on all alike). Prints the median step time (steps 2.., all seeds pooled) and its ratio to
interleaved's. With TRACE=1 it also keeps, for pp4 vpp2 under jitter and seed 1, a trace of
interleaved and of dpp-adaptive under /tmp/dpp-jitter-trace-{schedule} for `megac scan`.

COMM `mpi` runs the same cells over MPI processes instead (`megac compile` the plan, then
`megac launch -n PP`; needs target/release/megac built with --features mpi).

Usage: python3 bench/dpp_jitter.py [STEPS] [SEEDS] [local|mpi]   (defaults 20 5 local)
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
SEEDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M = os.path.join(ROOT, "target/release/megac")
COMM = sys.argv[3] if len(sys.argv) > 3 else "local"
if COMM not in ("local", "mpi"):
    sys.exit(f"error: unknown communicator {COMM!r}; the communicators are 'local' and 'mpi'")
TRACE = os.environ.get("TRACE") == "1"
ENV = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1")

SCHEDULES = {
    "interleaved": ["parallel.schedule=interleaved"],
    "dpp-bfs": ["parallel.schedule=dpp", "parallel.dpp_policy=bfs"],
    "dpp-dfs": ["parallel.schedule=dpp", "parallel.dpp_policy=dfs"],
    "dpp-adaptive": ["parallel.schedule=dpp", "parallel.dpp_policy=adaptive"],
    "dpp-ordered": ["parallel.schedule=dpp", "parallel.dpp_policy=ordered"],
}
CONDITIONS = {
    "none": lambda seed: [],
    "jitter 0.2": lambda seed: [f"jitter:0.2:{seed}"],
    "slow link 0-1 3x": lambda seed: ["slow-link:0-1:3"],
}


def step_times(pp, schedule, inject, report, trace=None):
    sets = ["model.layers=8", "train.micro_batch=1", "train.global_batch=8", f"parallel.pp={pp}",
            "parallel.vpp=2"]
    sets += SCHEDULES[schedule]
    sets = [x for s in sets for x in ("--set", s)]
    if COMM == "mpi":
        plan = os.path.join(os.path.dirname(report), "plan")
        subprocess.run(["rm", "-rf", plan], check=True)
        subprocess.run([M, "compile", "examples/llama-tiny.toml"] + sets + ["-o", plan],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        cmd = [M, "launch", "-n", str(pp), plan]
    else:
        cmd = [M, "train", "examples/llama-tiny.toml"] + sets
    cmd += ["--steps", str(STEPS), "--report", report]
    cmd += [x for i in inject for x in ("--inject", i)]
    if trace:
        cmd += ["--trace", trace]
    subprocess.run(cmd, cwd=ROOT, env=ENV, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return [s["seconds"] for s in json.load(open(report))["steps"][1:]]


def main():
    tmp = tempfile.mkdtemp()
    report = os.path.join(tmp, "r.json")
    where = "local threads" if COMM == "local" else "MPI processes (megac launch)"
    print(f"llama-tiny 8 layers, 8 micro-batches, {where}, {STEPS} steps x {SEEDS} seeds; "
          "median step time (ms) of steps 2.., and against interleaved")
    print("| layout | condition | " + " | ".join(SCHEDULES) + " |")
    print("|---|---|" + "---|" * len(SCHEDULES))
    for pp in (4, 2):
        for cond, inject in CONDITIONS.items():
            times = {s: [] for s in SCHEDULES}
            for seed in range(1, SEEDS + 1):
                for s in SCHEDULES:
                    trace = None
                    if TRACE and pp == 4 and cond == "jitter 0.2" and seed == 1 and s in (
                            "interleaved", "dpp-adaptive"):
                        trace = f"/tmp/dpp-jitter-trace-{s}"
                        subprocess.run(["rm", "-rf", trace], check=True)
                    times[s] += step_times(pp, s, inject(seed), report, trace)
            med = {s: statistics.median(v) for s, v in times.items()}
            base = med["interleaved"]
            cells = [f"{med[s] * 1e3:.1f} ({med[s] / base:.2f}x)" for s in SCHEDULES]
            print(f"| pp{pp} vpp2 | {cond} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
