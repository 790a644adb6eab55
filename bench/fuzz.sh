#!/usr/bin/env bash
# Fuzz every reader of user input (model.toml + --set, cluster.toml, hostfiles, plan.json,
# .bin/.txt token files, safetensors) with N inputs per target (default 1,000,000).
#
#   bench/fuzz.sh [N]             # every target
#   TARGETS=plan bench/fuzz.sh 1e5 # one target (names: `megac-fuzz list`)
#
# Builds megac-fuzz in the `fuzz` profile (optimised, overflow checks and debug assertions
# on), compiles small plans as the plan target's seeds, and runs niced (the machine is shared).
# Prints one row per target: inputs, rejected, accepted, crashes, wall time. Findings (input
# and message) go to $OUT/<target>/; the script exits non-zero if there was any. A finding
# becomes a regression case: copy the input to tests/fuzz-corpus/<target>/.
set -euo pipefail
cd "$(dirname "$0")/.."
ITERS=${1:-1000000}
ITERS=$(python3 -c "print(int(float('$ITERS')))" 2>/dev/null || echo "$ITERS")
SEED=${SEED:-1}
OUT=${OUT:-target/fuzz-findings}
TARGETS=${TARGETS:-all}
NICE=${NICE:-10}
FEATURES=(--no-default-features)

cargo build "${FEATURES[@]}" --profile fuzz -p megac-fuzz
cargo build "${FEATURES[@]}" --bin megac
FUZZ=target/fuzz/megac-fuzz
MEGAC=target/debug/megac

# Plan seeds: the fuzzer's tiny model on one rank, with tp=2, and with pp=2 (two layers).
SEEDS=$OUT/plan-seeds
rm -rf "$SEEDS"
mkdir -p "$SEEDS"
"$FUZZ" list >/dev/null
cat > "$SEEDS/tiny.toml" <<'TOML'
[model]
arch = "llama"
layers = 1
hidden = 8
heads = 2
ffn_hidden = 16
vocab = 16
seq_len = 4

[train]
micro_batch = 1
global_batch = 1
TOML
compile() { # NAME SET...
    local name=$1
    shift
    "$MEGAC" compile "$SEEDS/tiny.toml" -o "$SEEDS/$name" "$@" >/dev/null
    mv "$SEEDS/$name/plan.json" "$SEEDS/$name.json"
    rmdir "$SEEDS/$name"
}
compile one
compile tp2 --set parallel.tp=2
compile pp2 --set model.layers=2 --set parallel.pp=2 --set train.global_batch=2
rm "$SEEDS/tiny.toml"
ls -l "$SEEDS" | tail -n +2

read -r -a LIST <<<"$([ "$TARGETS" = all ] && "$FUZZ" list | tr '\n' ' ' || echo "$TARGETS")"
status=0
echo "fuzz: $ITERS inputs per target, seed $SEED, findings in $OUT"
for t in "${LIST[@]}"; do
    extra=()
    [ "$t" = plan ] && extra=(--seeds "$SEEDS")
    nice -n "$NICE" "$FUZZ" run --target "$t" --iters "$ITERS" --seed "$SEED" \
        "${extra[@]}" --out "$OUT" | { [ "$t" = "${LIST[0]}" ] && cat || tail -n +2; } || status=1
done
exit $status
