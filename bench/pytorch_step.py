#!/usr/bin/env python3
"""PyTorch eager baseline for megac's CPU training step.

One training step = forward, cross-entropy loss, backward, AdamW update, for a
LlamaForCausalLM of 4 layers, hidden 256, 8 heads (8 kv heads), intermediate 688,
vocab 4096, seq 256, micro batch 8, float32, eager attention, 2 threads.

    python3 bench/pytorch_step.py [N] [--threads T] [--no-profile]

Warms up 3 steps, times N steps (default 10) and prints `pytorch tokens/s: X`, the ms per
step and, from one extra profiled step, the share of CPU time spent in matmuls.
Install: see tests/golden/README.md (torch + transformers from PyPI).
"""

import argparse
import time

import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, SEQ, MICRO_BATCH = 4, 256, 8, 8, 688, 4096, 256, 8
WARMUP = 3

MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::dot"}


def build():
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=SEQ,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        use_cache=False,
        dtype="float32",
    )
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).to(torch.float32)
    assert model.config._attn_implementation == "eager"
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("steps", nargs="?", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled step")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (WARMUP + args.steps + 1, MICRO_BATCH, SEQ + 1), generator=g)

    def step(i):
        batch = data[i]
        logits = model(input_ids=batch[:, :SEQ]).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    for i in range(WARMUP):
        step(i)
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        step(WARMUP + i)
        times.append(time.perf_counter() - t0)
    total = sum(times)
    tokens = MICRO_BATCH * SEQ * args.steps
    ms = 1000.0 * total / args.steps
    # Model FLOPs per step: 6 * params * tokens (dense) + attention 12 * L * S^2 * h / ... kept
    # simple: 6 N T plus causal-attention scores/values 6 * L * B * S^2 * hidden (fwd+bwd).
    flops = 6 * n_params * MICRO_BATCH * SEQ + 6 * LAYERS * MICRO_BATCH * SEQ * SEQ * HIDDEN

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"threads {torch.get_num_threads()}, params {n_params}, "
        f"batch {MICRO_BATCH}x{SEQ}, {args.steps} timed steps after {WARMUP} warm-up"
    )
    med = sorted(times)[len(times) // 2]
    print(
        f"ms/step: {ms:.1f} (median {1000 * med:.1f}, min {1000 * min(times):.1f}, "
        f"max {1000 * max(times):.1f})"
    )
    print(f"GFLOP/s (approx. model FLOPs): {flops * args.steps / total / 1e9:.1f}")
    print(f"tokens/s at the median step: {MICRO_BATCH * SEQ / med:.1f}")
    print(f"pytorch tokens/s: {tokens / total:.1f}")

    if not args.no_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(WARMUP + args.steps)
        events = prof.key_averages()
        total_self = sum(e.self_cpu_time_total for e in events)
        mm_self = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
        top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
        print(f"matmul share of CPU self time (profiled step): {100 * mm_self / total_self:.1f}%")
        print("top ops by self CPU time: " + ", ".join(
            f"{e.key} {100 * e.self_cpu_time_total / total_self:.1f}%" for e in top
        ))


if __name__ == "__main__":
    main()
