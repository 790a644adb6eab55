#!/usr/bin/env python3
"""Mixed-precision references for megac's golden fixtures (bf16, and fp16 with a static
loss scale), with PyTorch + Hugging Face transformers, from the fp32 fixtures' own initial
weights and tokens (run make_golden.py first; CI runs neither script).

    python3 tests/golden/make_golden_mixed.py          # writes <model>/expected_{bf16,fp16}.json
                                                        # and final_{bf16,fp16}.safetensors
    python3 tests/golden/make_golden_mixed.py --check  # regenerate in a temp dir, compare bytes
    python3 tests/golden/make_golden_mixed.py --models qwen2,qwen3  # only these fixtures

llama and gpt have bf16 and fp16 references; qwen3, mistral and qwen2_moe bf16 ones
(MIXED_MODELS; qwen2 and llama31 none, see there). MoE fixtures load their
init_fused.safetensors (transformers 5's state dict) and save_pretrained writes the final
weights in the Hub layout, as for the fp32 fixtures.

The reference trains as Megatron's mixed precision (the semantics megac implements):
  * working weights are the fp32 initial weights rounded to bf16 (fp16); the fp32 master
    weights start as exactly those rounded values;
  * forward and backward run in transformers in the 16-bit dtype (its own fp32 islands:
    RMSNorm/LayerNorm in fp32, attention softmax in fp32); the rotary frequencies stay
    fp32 (Megatron's; model.to(dtype) would round transformers' inv_freq buffer); the cross entropy in fp32 on
    the logits widened to fp32;
  * each micro-batch's parameter gradients (computed by autograd in the 16-bit dtype) are
    widened and accumulated in an fp32 main_grad; the global norm, clipping and
    torch.optim.AdamW (foreach=False, fused=False) run on the fp32 master weights, which
    are then rounded into the working weights;
  * fp16 multiplies the loss by a static scale (train.loss_scale) before backward and
    divides main_grad by it before the norm; no step overflows (the script asserts it);
  * AdamW's eps is raised from the fp32 fixtures' 1e-8 to MIXED_EPS = 1e-2 (megac:
    train.eps): with eps far below the gradients, AdamW's first steps are lr * sign(g) per
    element, so a gradient that is zero up to rounding moves its weight by a whole lr one
    way or the other, and two correct mixed-precision runs part by far more than the unit
    roundoff after one step. With eps above the gradients' scale the update is
    proportional to the gradient and the runs stay within the tolerances.
Outputs: per-step loss (fp32) and grad norm, and the final working weights widened to
fp32 (HF names and layout, as megac's --save-params writes them).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_golden as mg  # noqa: E402  (TRAIN, MODELS, build_model, save helpers)

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}
# fp16's static loss scale (megac: train.loss_scale); large enough to keep the smallest
# gradients of these models out of fp16's subnormals, small enough not to overflow.
FP16_LOSS_SCALE = 1024.0
# Fixture -> the precisions it has references for. qwen2 and llama31 (weights drawn with
# init std 0.2 so that their features move the fp32 loss) have none: there bf16's own
# rounding moves step 1's grad norm by 1.2u (qwen2: this reference in bf16 vs fp32,
# 4.8e-3), so no reference can be compared within docs/precision.md's tolerances.
MIXED_MODELS = {
    "llama": ["bf16", "fp16"],
    "gpt": ["bf16", "fp16"],
    "qwen3": ["bf16"],
    "mistral": ["bf16"],
    "qwen2_moe": ["bf16"],
}
MIXED_EPS = 1e-2


def load_model(name, dtype):
    m = mg.MODELS[name]
    torch.manual_seed(mg.TRAIN["seed"])
    model = mg.build_model(m)
    # MoE models hold their experts fused in transformers 5 (init_fused.safetensors).
    fused = os.path.join(HERE, name, "init_fused.safetensors")
    is_moe = m.get("moe") is not None
    sd = load_file(fused if is_moe else os.path.join(HERE, name, "init.safetensors"))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # GPT-2's save_pretrained omits the tied lm_head.
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    # Megatron computes the rotary frequencies in fp32 and keeps them so (as megac does);
    # model.to(dtype) would round transformers' inv_freq buffer to 16 bits, which moves
    # the angles of far positions by up to position * 2^-9 rad.
    freqs = {
        mod: (mod.inv_freq.clone(), getattr(mod, "original_inv_freq", None))
        for mod in model.modules()
        if isinstance(getattr(mod, "inv_freq", None), torch.Tensor)
    }
    model.to(dtype)
    for mod, (inv, orig) in freqs.items():
        mod.inv_freq = inv
        if orig is not None:
            mod.original_inv_freq = orig.clone()
        assert mod.inv_freq.dtype == torch.float32
    return model, m


def train(model, m, dtype, precision):
    t = mg.TRAIN
    S, V = m["seq_len"], m["vocab"]
    G, mb = t["global_batch"], t["micro_batch"]
    n_micro = G // mb
    toks = np.fromfile(os.path.join(HERE, mg_name(m), "tokens.bin"), dtype="<u4")
    windows = torch.from_numpy(toks.astype(np.int64))
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(
        master,
        lr=t["lr"],
        betas=t["betas"],
        eps=MIXED_EPS,
        weight_decay=t["weight_decay"],
        foreach=False,
        fused=False,
    )
    scale = FP16_LOSS_SCALE if precision == "fp16" else 1.0
    model.train()
    losses, norms = [], []
    for k in range(t["steps"]):
        main_grad = [torch.zeros_like(w) for w in master]
        step_loss = torch.zeros((), dtype=torch.float32)
        for j in range(n_micro):
            rows = []
            for b in range(mb):
                i = k * G + j * mb + b
                rows.append(windows[i * (S + 1) : (i + 1) * (S + 1)])
            batch = torch.stack(rows)
            inputs, labels = batch[:, :S], batch[:, 1:]
            logits = model(input_ids=inputs).logits
            assert logits.dtype == dtype
            loss = F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1))
            (loss * (scale / n_micro)).backward()
            for g, p in zip(main_grad, params):
                g += p.grad.float()
                p.grad = None
            step_loss += loss.detach() / n_micro
        for g in main_grad:
            g /= scale
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in main_grad)).float()
        assert torch.isfinite(norm), f"step {k}: overflow"
        coef = m["grad_clip"] / (norm + 1e-6)
        for w, g in zip(master, main_grad):
            w.grad = g * coef if coef < 1 else g
        opt.step()
        with torch.no_grad():
            for p, w in zip(params, master):
                p.copy_(w.to(dtype))
        losses.append(float(step_loss.item()))
        norms.append(float(norm.item()))
    return losses, norms


def mg_name(m):
    return next(n for n, v in mg.MODELS.items() if v is m)


def generate(name, precision, outdir):
    dtype = PRECISIONS[precision]
    model, m = load_model(name, dtype)
    losses, norms = train(model, m, dtype, precision)
    os.makedirs(outdir, exist_ok=True)
    model.float()
    mg.save_weights(model, os.path.join(outdir, f"final_{precision}.safetensors"))
    expected = {
        "losses": losses,
        "grad_norms": norms,
        "loss_scale": FP16_LOSS_SCALE if precision == "fp16" else None,
        "eps": MIXED_EPS,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    with open(os.path.join(outdir, f"expected_{precision}.json"), "w") as f:
        json.dump(expected, f, indent=2)
        f.write("\n")
    return expected


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="regenerate in a temp dir, compare bytes")
    ap.add_argument("--models", help="comma-separated fixtures (default: every MIXED_MODELS one)")
    args = ap.parse_args()
    names = args.models.split(",") if args.models else list(MIXED_MODELS)
    for name in names:
        assert name in MIXED_MODELS, f"{name}: not one of {list(MIXED_MODELS)}"
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    root = tempfile.mkdtemp() if args.check else HERE
    bad = []
    for name in names:
        for precision in MIXED_MODELS[name]:
            e = generate(name, precision, os.path.join(root, name))
            print(name, precision, "losses", e["losses"], "norms", e["grad_norms"])
            if args.check:
                for f in (f"expected_{precision}.json", f"final_{precision}.safetensors"):
                    a = open(os.path.join(root, name, f), "rb").read()
                    b = open(os.path.join(HERE, name, f), "rb").read()
                    if a != b:
                        bad.append(f"{name}/{f}")
    if args.check:
        shutil.rmtree(root)
        if bad:
            sys.exit("differ: " + ", ".join(bad))
        print("ok: byte-identical")


if __name__ == "__main__":
    main()
