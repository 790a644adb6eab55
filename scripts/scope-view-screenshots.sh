#!/usr/bin/env bash
# The screenshots of docs/scope.md's viewer section (docs/img/scope-view-*.png): trains
# examples/llama-tiny.toml for 1000 steps on examples/data/corpus.txt (about a minute on a
# laptop core), probes one prompt clean and with layer 0's attention output zeroed, renders
# both with `megac scope view`, and photographs the pages with headless Chromium (Debian's
# `chromium`; the page's #fragment sets the layer, the enlarged head, the query and the
# position, and only=SECTION hides the others). Usage: bash scripts/scope-view-screenshots.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --quiet
megac=target/debug/megac
work=${1:-$(mktemp -d)}
mkdir -p "$work" docs/img
prompt="megac compiles the model into a plan"
$megac train examples/llama-tiny.toml --data examples/data/corpus.txt --steps 1000 \
  --save-params "$work/params.safetensors" | tail -3
$megac scope examples/llama-tiny.toml --init "$work/params.safetensors" --prompt "$prompt" \
  --probe '*' -o "$work/probes.safetensors"
$megac scope view "$work/probes.safetensors" -o "$work/view.html"
$megac scope examples/llama-tiny.toml --init "$work/params.safetensors" --prompt "$prompt" \
  --probe '*' --perturb 'layers.0.attn.out:scale(0)' --report "$work/r.json" \
  -o "$work/perturbed.safetensors"
$megac scope view "$work/perturbed.safetensors" --report "$work/r.json" -o "$work/perturbed.html"
shot() { # OUT.png WIDTH,HEIGHT URL
  chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --hide-scrollbars --user-data-dir="$(mktemp -d)" --window-size="$2" \
    --screenshot="$1" "$3" 2>/dev/null
}
shot docs/img/scope-view-attention.png 1100,1000 "file://$work/view.html#layer=1&head=0&query=20&pos=20"
shot docs/img/scope-view-lens.png 1100,560 "file://$work/view.html#pos=20&only=lens"
shot docs/img/scope-view-report.png 1100,760 "file://$work/perturbed.html#pos=20&only=report"
ls -l docs/img/scope-view-*.png
