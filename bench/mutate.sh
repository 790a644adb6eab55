#!/usr/bin/env bash
# Mutation bench of the plan gate: N seeded field-level mutations (default 10,000) of
# compiled plans (tp+sp, pp zb-h1 and dpp, fbd, ep, cp, distributed optimizer), each either
# rejected by the gate or trained 2 steps on local threads to a positive, finite loss.
# Prints: tried / rejected / ran-ok / failures (and each failure with its seed).
#
#   bench/mutate.sh [N] [SEED]
#
# The mutator and harness: tests/common/mutate.rs (the test `plan_mutations` runs 300).
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-10000}"
SEED="${2:-1000000}"
MEGAC_MUTATIONS="$N" MEGAC_SEED="$SEED" cargo test --no-default-features --test plan_mutations \
  -- --ignored mutation_bench --nocapture --test-threads 1 2>&1 \
  | grep -E '^(tried|failure:|FAILURE)' || true
