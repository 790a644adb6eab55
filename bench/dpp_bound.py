#!/usr/bin/env python3
"""How much of a traced pipeline step could any order of its actions win back? (docs/scan.md,
issue 17 section 5: MegaDPP under jitter, "the trace shows it").

Runs llama-tiny (8 layers, 8 micro-batches of one sequence) at pp PP vpp2 on local threads
with `--trace`, interleaved 1F1B and dpp-ordered, without injection and under `jitter:0.2`,
SEEDS seeds of STEPS steps each, and reads the rank files back. For every step from the 2nd:

- the step: the longest `step` event over the ranks;
- the order bound, `megac simulate`'s `pipeline_bound_seconds` (sim/src/simulate/pipeline.rs,
  `order_bound`) from the recorded busy times, with what every order runs outside the
  pipeline's actions: an action's busy time is that of the compute segments and sends
  inside it (receive waits and a core held by another rank excluded; an injected slowdown
  included); a rank's work is the sum over its actions. No order can end the step before
  a rank's data loading (or, if longer, micro-batch 0's fastest forward through the chunks
  below the rank's first chunk), its work and its optimizer's compute; nor before the
  forward through those chunks, its work, and the fastest backward through them again.

Prints, per schedule and condition, the median step, the median bound over the step (the
fraction of the step that any order, with the same action times, must still take) and the
median of the step less the bound (the most that reordering could win back), ms. A dynamic
order that is to run at 0.9x interleaved needs interleaved's bound below 0.9.

On 2 cores with more than 2 ranks (pp4) the ranks also share cores: the bound counts each
rank's busy time alone, so it is lower (weaker) than what the cores allow. Without injection
the last column gives the cores' bound too: the ranks' busy time together over the cores
(`os.cpu_count()`); under jitter it does not hold (an injected slowdown waits off the core).

Usage: python3 bench/dpp_bound.py [STEPS] [SEEDS] [PP]   (defaults 20 5 2)
"""

import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
SEEDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
PP = int(sys.argv[3]) if len(sys.argv) > 3 else 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M = os.path.join(ROOT, "target/release/megac")

SCHEDULES = {
    "interleaved": ["parallel.schedule=interleaved"],
    "dpp-ordered": ["parallel.schedule=dpp", "parallel.dpp_policy=ordered"],
}
CONDITIONS = {
    "none": lambda seed: [],
    "jitter 0.2": lambda seed: [f"jitter:0.2:{seed}"],
}
ACTIONS = ("F", "B", "BW", "W")


def traced_run(schedule, inject, trace):
    sets = ["model.layers=8", "train.micro_batch=1", "train.global_batch=8",
            f"parallel.pp={PP}", "parallel.vpp=2"] + SCHEDULES[schedule]
    cmd = [M, "train", "examples/llama-tiny.toml", "--steps", str(STEPS), "--trace", trace]
    cmd += [x for s in sets for x in ("--set", s)]
    cmd += [x for i in inject for x in ("--inject", i)]
    subprocess.run(["rm", "-rf", trace], check=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def order_bound(ranks, f_min, b_min, split):
    """sim/src/simulate/pipeline.rs's `order_bound`, with each rank's work outside the
    actions: ranks = [(chunks, work, data, optimizer)], seconds."""
    best = 0.0
    for chunks, work, data, optimizer in ranks:
        first = min(chunks)
        fill = sum(t for c, t in f_min.items() if c < first)
        drain = 0.0 if split else sum(t for c, t in b_min.items() if c < first)
        best = max(best, max(data, fill) + work + optimizer, fill + work + drain)
    return best


def busy(e):
    """Busy ns of a compute or send event: its wall time less its wait for a core."""
    return e[2] - e[1] - e[8]


def steps_of(trace):
    """Per step (from the 2nd): (step seconds, bound seconds, the ranks' busy seconds)."""
    files = sorted(f for f in os.listdir(trace) if f.startswith("rank-"))
    step_len = collections.defaultdict(float)
    # step -> rank -> ([(kind, chunk, busy s)], data s, optimizer s)
    per = collections.defaultdict(dict)
    for f in files:
        doc = json.load(open(os.path.join(trace, f)))
        by_step = collections.defaultdict(list)
        for e in doc["events"]:
            by_step[e[3]].append(e)
        for step, events in by_step.items():
            acts = [e for e in events if e[0] in ACTIONS]
            work = [e for e in events if e[0] in ("compute", "send")]
            inside = set()
            rows = []
            for a in acts:
                mine = [i for i, e in enumerate(work) if e[1] >= a[1] and e[2] <= a[2]]
                inside.update(mine)
                rows.append((a[0], a[4], sum(busy(work[i]) for i in mine) / 1e9))
            data = sum(e[2] - e[1] for e in events if e[0] == "data") / 1e9
            optimizer = sum(busy(e) for i, e in enumerate(work)
                            if i not in inside and e[0] == "compute") / 1e9
            per[step][doc["rank"]] = (rows, data, optimizer)
            for e in events:
                if e[0] == "step":
                    step_len[step] = max(step_len[step], (e[2] - e[1]) / 1e9)
    out = []
    for step in sorted(per):
        if step < 2:
            continue
        f_min, b_min = {}, {}
        split = False
        ranks = []
        for rows, data, optimizer in per[step].values():
            for kind, chunk, t in rows:
                mins = f_min if kind == "F" else b_min if kind in ("B", "BW") else None
                split |= kind == "W"
                if mins is not None:
                    mins[chunk] = min(mins.get(chunk, t), t)
            ranks.append(({c for _, c, _ in rows}, sum(t for _, _, t in rows), data, optimizer))
        total = sum(work + data + optimizer for _, work, data, optimizer in ranks)
        out.append((step_len[step], order_bound(ranks, f_min, b_min, split), total))
    return out


def main():
    tmp = tempfile.mkdtemp()
    trace = os.path.join(tmp, "trace")
    print(f"llama-tiny 8 layers, 8 micro-batches, pp{PP} vpp2, local threads with --trace, "
          f"{STEPS} steps x {SEEDS} seeds; medians over steps 2..")
    cores = os.cpu_count()
    print(f"| condition | schedule | step (ms) | bound / step | step - bound (ms) | "
          f"busy / {cores} cores / step |")
    print("|---|---|---|---|---|---|")
    for cond, inject in CONDITIONS.items():
        rows = {s: [] for s in SCHEDULES}
        for seed in range(1, SEEDS + 1):
            for s in SCHEDULES:
                traced_run(s, inject(seed), trace)
                rows[s] += steps_of(trace)
        for s, pairs in rows.items():
            step = statistics.median(p[0] for p in pairs)
            frac = statistics.median(p[1] / p[0] for p in pairs)
            slack = statistics.median(p[0] - p[1] for p in pairs)
            core = (f"{statistics.median(p[2] / cores / p[0] for p in pairs):.3f}"
                    if cond == "none" else "-")
            print(f"| {cond} | {s} | {step * 1e3:.1f} | {frac:.3f} | {slack * 1e3:.2f} | "
                  f"{core} |", flush=True)


if __name__ == "__main__":
    main()
