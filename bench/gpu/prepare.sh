#!/usr/bin/env bash
# Prepare the device check (bench/gpu/check.sh) where cargo is: build the release `megac`
# (default features: cuda) and the release test binary of tests/cuda.rs, and copy both into
# bench/gpu/bin/ (ignored by git). The device machine builds nothing: carry bench/gpu/bin
# with the working tree, then run `bash bench/gpu/check.sh` there.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release
test_bin=$(cargo test --release --test cuda --no-run --message-format=json \
    | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda":
        print(m["executable"])' | tail -1)
if [ -z "$test_bin" ]; then
    echo "error: cargo did not name the tests/cuda.rs binary" >&2
    exit 1
fi
mkdir -p bench/gpu/bin
cp target/release/megac bench/gpu/bin/megac
cp "$test_bin" bench/gpu/bin/cuda-test
ls -l bench/gpu/bin
echo "ready: carry bench/gpu/bin, then run bash bench/gpu/check.sh on the GPU machine"
