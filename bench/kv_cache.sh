#!/usr/bin/env bash
# Tokens per second of `megac generate` with the KV cache (the default) and without it
# (--no-kv-cache: the whole window recomputed per token), same machine, same run:
# examples/llama-tiny.toml (32 new tokens) and a bigger Llama (llama-tiny with hidden 256,
# 4 layers, 8 heads, seq_len 512; 300 new tokens). Weights: one training step from the
# seed, saved with --save-params. Usage: bench/kv_cache.sh [MEGAC] (default target/debug/megac).
set -euo pipefail
megac=${1:-target/debug/megac}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
big=(--set model.hidden=256 --set model.layers=4 --set model.heads=8 --set model.kv_heads=8
     --set model.ffn_hidden=688 --set model.seq_len=512)
one=(--set train.micro_batch=1 --set train.global_batch=1)
"$megac" train examples/llama-tiny.toml --steps 1 "${one[@]}" --save-params "$dir/tiny.safetensors" >/dev/null
"$megac" train examples/llama-tiny.toml --steps 1 "${one[@]}" "${big[@]}" --save-params "$dir/big.safetensors" >/dev/null
run() { # name, init, new tokens, extra args...
  local name=$1 init=$2 n=$3; shift 3
  for mode in kv no-kv; do
    local flag=(); [ "$mode" = no-kv ] && flag=(--no-kv-cache)
    local out
    out=$("$megac" generate examples/llama-tiny.toml --init "$init" --tokens 5,17,99,3,42,7,1,12 \
      --max-new-tokens "$n" --format json "$@" "${flag[@]}")
    echo "$name $mode: $(echo "$out" | sed -e 's/.*"tokens_per_s":\([0-9.]*\).*/\1/') tokens/s"
    echo "$out" | sed -e 's/.*"tokens":\(\[[^]]*\]\).*/\1/' > "$dir/$name-$mode.ids"
  done
  cmp -s "$dir/$name-kv.ids" "$dir/$name-no-kv.ids" && echo "$name: same tokens" || echo "$name: TOKENS DIFFER"
}
run llama-tiny "$dir/tiny.safetensors" 32
run llama-big "$dir/big.safetensors" 300 "${big[@]}"
