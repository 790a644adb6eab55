#!/usr/bin/env python3
"""MegaScan detection benchmark (docs/scan.md, issue 17 section 3).

RUNS seeded runs per cell (STEPS steps, 4 ranks, `jitter:0.05:SEED` on every run so that
healthy runs vary too), on local threads and on MPI processes (`megac launch`, needs
target/release/megac built with --features mpi); layouts dp4, tp2 dp2, pp2 dp2 and cp2 dp2 of
llama-tiny and ep2 dp4 of moe-tiny; faults: none, a slow rank at 1.2x and at 1.1x (rank
SEED mod 4), two slow ranks at 1.5x in different groups, and on pp2 dp2 (the only layout
here with point-to-point sends) a slow link at half bandwidth (2x) between the stages of one
pipeline and a slow rank 1.5x beside a slow link 2x. Each trace is scored for megac scan's findings and for MegatronApp's
three-stage heuristic (`baseline_megatronapp`, ranks only) on the same run:

  recall       runs in which every injected fault was found (a link as a slow-link)
  exact        runs whose findings are exactly the injected faults
  false alarm  runs with any finding that was not injected (on healthy cells: any finding)
  first step   the median, over the runs that found them, of the injected faults' first_step
               (the faults are there from step 1; step 1 is warm-up and never judged)

Ranks of one thread take turns on the cores while recording (docs/scan.md), and the
detector judges them over blocks of as many steps as there are cores: 17 steps are 8 blocks
of 2 on a 2-core machine.

Usage: python3 bench/scan_detect.py [RUNS] [STEPS] [local,mpi] [LAYOUT,...]
       (defaults 200 17 local,mpi, every layout; e.g. "ep2 dp4" for one)

SCAN_DETECT_KEEP=DIR keeps every run's trace as DIR/COMM/LAYOUT/FAULT/SEED (about 60 KB a
run); SCAN_DETECT_FROM=DIR scores the traces kept there instead of running (a changed
detector re-scored on the same runs; a missing trace is an error).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 200
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 17
COMMS = (sys.argv[3] if len(sys.argv) > 3 else "local,mpi").split(",")
ONLY = sys.argv[4].split(",") if len(sys.argv) > 4 else None
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M = os.path.join(ROOT, "target/release/megac")
ENV = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1")
KEEP = os.environ.get("SCAN_DETECT_KEEP")
FROM = os.environ.get("SCAN_DETECT_FROM")

LLAMA, MOE = "examples/llama-tiny.toml", "examples/moe-tiny.toml"
# layout -> (model, --set overrides); ep2 dp4 is moe-tiny's 4 data-parallel ranks with its
# experts split over pairs of them (an all-to-all each way per MoE layer).
LAYOUTS = {
    "dp4": (LLAMA, ["parallel.dp=4", "train.global_batch=16"]),
    "tp2 dp2": (LLAMA, ["parallel.tp=2", "parallel.dp=2"]),
    "pp2 dp2": (LLAMA, ["parallel.pp=2", "parallel.dp=2"]),
    "cp2 dp2": (LLAMA, ["parallel.cp=2", "parallel.dp=2"]),
    "ep2 dp4": (MOE, ["parallel.ep=2", "parallel.dp=4", "train.global_batch=16"]),
}


def faults(cell, seed):
    """(inject specs, expected findings) of `cell` for run `seed`."""
    r = seed % 4
    # Two slow ranks sharing no group on any layout here: 0 and 3, or 1 and 2.
    a, b = (0, 3) if seed % 2 == 0 else (1, 2)
    return {
        "healthy": ([], set()),
        "slow-rank 1.2x": ([f"slow-rank:{r}:1.2"], {("slow-rank", (r,))}),
        "slow-rank 1.1x": ([f"slow-rank:{r}:1.1"], {("slow-rank", (r,))}),
        "two slow ranks 1.5x": (
            [f"slow-rank:{a}:1.5", f"slow-rank:{b}:1.5"],
            {("slow-rank", (a,)), ("slow-rank", (b,))},
        ),
        # pp2 dp2: ranks 0 and 2 are the two stages of one pipeline, 1 and 3 of the other.
        "slow link 2x": (
            [f"slow-link:{seed % 2}-{seed % 2 + 2}:2"],
            {("slow-link", (seed % 2, seed % 2 + 2))},
        ),
        "slow rank 1.5x + link 2x": (
            [f"slow-rank:{1 - seed % 2}:1.5", f"slow-link:{seed % 2}-{seed % 2 + 2}:2"],
            {("slow-rank", (1 - seed % 2,)), ("slow-link", (seed % 2, seed % 2 + 2))},
        ),
    }[cell]


def selected_layouts(only):
    """The layouts to run: `only` (the command line's list) or all; an unknown one is an
    error naming the layouts."""
    unknown = [x for x in only or [] if x not in LAYOUTS]
    if unknown:
        sys.exit(f"error: unknown layout {', '.join(map(repr, unknown))}; "
                 f"the layouts are {', '.join(map(repr, LAYOUTS))}")
    return [x for x in LAYOUTS if not only or x in only]


def compile_plan(layout, plan):
    """`megac compile` `layout`'s plan into the folder `plan` (for `megac launch`)."""
    model, sets = LAYOUTS[layout]
    shutil.rmtree(plan, ignore_errors=True)
    subprocess.run([M, "compile", model] + [x for s in sets for x in ("--set", s)]
                   + ["-o", plan], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def cells_of(layout, slow_ranks):
    """The cells of `layout`: healthy, the `slow_ranks` cells, two slow ranks, and on pp2 dp2
    (the only layout with point-to-point sends) the slow-link cells."""
    cells = ["healthy"] + slow_ranks + ["two slow ranks 1.5x"]
    if layout == "pp2 dp2":
        cells += ["slow link 2x", "slow rank 1.5x + link 2x"]
    return cells


def stored(comm, layout, cell, seed):
    """Where run `seed` of a cell is kept (SCAN_DETECT_KEEP) or read from (SCAN_DETECT_FROM)."""
    return os.path.join(KEEP or FROM, comm, layout.replace(" ", "-"), cell.replace(" ", "-"),
                        str(seed))


def run(comm, layout, plan, seed, inject, trace, cell):
    if FROM:
        trace = stored(comm, layout, cell, seed)
        if not os.path.isdir(trace):
            sys.exit(f"error: no stored trace {trace}")
        return scan(trace)
    shutil.rmtree(trace, ignore_errors=True)
    specs = [f"jitter:0.05:{seed}"] + inject
    inj = [x for s in specs for x in ("--inject", s)]
    common = ["--steps", str(STEPS), "--trace", trace] + inj
    if comm == "mpi":
        cmd = [M, "launch", "-n", "4", plan] + common
    else:
        model, sets = LAYOUTS[layout]
        sets = [x for s in sets for x in ("--set", s)]
        cmd = [M, "train", model] + sets + common
    subprocess.run(cmd, cwd=ROOT, env=ENV, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    if KEEP:
        kept = stored(comm, layout, cell, seed)
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(trace, kept)
    return scan(trace)


def scan(trace):
    """megac scan's findings, MegatronApp's and the findings' first steps on one trace."""
    out = subprocess.run([M, "scan", trace, "--format", "json"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    v = json.loads(out)
    found = {(f["kind"], tuple(f["ranks"])) for f in v["findings"]}
    first = {(f["kind"], tuple(f["ranks"])): f["first_step"] for f in v["findings"]}
    base = {("slow-rank", (r,)) for r in v["baseline_megatronapp"]}
    return found, base, first


def main():
    layouts = selected_layouts(ONLY)
    tmp = tempfile.mkdtemp()
    trace = os.path.join(tmp, "trace")
    print(f"{RUNS} runs per cell, {STEPS} steps, 4 ranks, jitter:0.05:SEED on every run")
    print("| comm | layout | fault | runs | megac recall | megac exact | megac false alarm "
          "| megac first step | MegatronApp recall | MegatronApp exact "
          "| MegatronApp false alarm | s/run |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for comm in COMMS:
            for layout in layouts:
                plan = os.path.join(tmp, "plan")
                if comm == "mpi" and not FROM:
                    compile_plan(layout, plan)
                for cell in cells_of(layout, ["slow-rank 1.2x", "slow-rank 1.1x"]):
                    score = {"m": [0, 0, 0], "b": [0, 0, 0]}
                    firsts = []
                    t0 = time.time()
                    for seed in range(1, RUNS + 1):
                        inject, want = faults(cell, seed)
                        found, base, first = run(comm, layout, plan, seed, inject, trace, cell)
                        if want and want <= found:
                            firsts.append(max(first[w] for w in want))
                        for k, got in (("m", found), ("b", base)):
                            score[k][0] += want <= got
                            score[k][1] += want == got
                            score[k][2] += bool(got - want)
                    dt = (time.time() - t0) / RUNS

                    def pct(k, i, none_if_healthy=False):
                        if none_if_healthy and cell == "healthy":
                            return "-"
                        return f"{100 * score[k][i] / RUNS:.1f}%"

                    firsts.sort()
                    step = str(firsts[len(firsts) // 2]) if firsts else "-"
                    print(f"| {comm} | {layout} | {cell} | {RUNS} | {pct('m', 0, True)} | "
                          f"{pct('m', 1)} | {pct('m', 2)} | {step} | {pct('b', 0, True)} | "
                          f"{pct('b', 1)} | {pct('b', 2)} | {dt:.2f} |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
