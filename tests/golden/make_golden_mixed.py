#!/usr/bin/env python3
"""Mixed-precision references for megac's golden fixtures (bf16, and fp16 with a static
loss scale), with PyTorch + Hugging Face transformers, from the fp32 fixtures' own initial
weights and tokens (run make_golden.py first; CI runs neither script).

    python3 tests/golden/make_golden_mixed.py          # writes <model>/expected_{bf16,fp16}.json
                                                        # and final_{bf16,fp16}.safetensors
    python3 tests/golden/make_golden_mixed.py --check  # regenerate in a temp dir, compare bytes

The reference trains as Megatron's mixed precision (the semantics megac implements):
  * working weights are the fp32 initial weights rounded to bf16 (fp16); the fp32 master
    weights start as exactly those rounded values;
  * forward and backward run in transformers in the 16-bit dtype (its own fp32 islands:
    RMSNorm/LayerNorm in fp32, attention softmax in fp32); the cross entropy in fp32 on
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
MIXED_MODELS = ["llama", "gpt"]
MIXED_EPS = 1e-2


def load_model(name, dtype):
    m = mg.MODELS[name]
    torch.manual_seed(mg.TRAIN["seed"])
    model = mg.build_model(m)
    sd = load_file(os.path.join(HERE, name, "init.safetensors"))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # GPT-2's save_pretrained omits the tied lm_head.
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    model.to(dtype)
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
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    root = tempfile.mkdtemp() if args.check else HERE
    bad = []
    for name in MIXED_MODELS:
        for precision in PRECISIONS:
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
