#!/usr/bin/env bash
# Mutation bench of the plan gate: N seeded field-level mutations (default 10,000) of
# compiled plans (tp+sp, pp zb-h1 and dpp, fbd, ep, cp, distributed optimizer), each either
# rejected by the gate or trained 2 steps on local threads to a positive, finite loss.
# Prints: tried / rejected / ran-ok / failures, then each failure with its seed; exits
# non-zero on any failure. The full output is kept in target/mutate.log.
#
#   bench/mutate.sh [N] [SEED]
#
# The mutator and harness: tests/common/mutate.rs (the test `plan_mutations` runs 300).
# Figures at the commit that added this line (2 cores, test profile):
#   bench/mutate.sh           tried 10000 / rejected 7845 / ran-ok 2155 / failures 0 (with the bf16 and fp16 layouts)
#   bench/mutate.sh 10000 2   tried 10000 / rejected 7830 / ran-ok 2170 / failures 0 (before the bf16 and fp16 layouts were added)
set -uo pipefail
cd "$(dirname "$0")/.."
N="${1:-10000}"
SEED="${2:-1000000}"
log=target/mutate.log
MEGAC_MUTATIONS="$N" MEGAC_SEED="$SEED" cargo test --no-default-features --test plan_mutations \
  -- --ignored mutation_bench --nocapture --test-threads 1 >"$log" 2>&1
status=$?
grep -oE 'tried [0-9]+ / rejected [0-9]+ / ran-ok [0-9]+ / failures [0-9]+' "$log" | head -1 || true
grep -E '^failure:' "$log" || true
[ $status -eq 0 ] || tail -20 "$log"
exit $status
