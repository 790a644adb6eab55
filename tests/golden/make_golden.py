#!/usr/bin/env python3
"""Produce megac's golden fixtures with PyTorch + Hugging Face transformers.

CI never runs this script: it only reads the files committed next to it. Run it by hand
(see README.md in this folder for the exact install commands and versions) to regenerate:

    python3 tests/golden/make_golden.py            # writes tests/golden/{llama,gpt}/
    python3 tests/golden/make_golden.py --check    # regenerate in a temp dir, compare bytes

For each model it writes, into tests/golden/<name>/:

    model.toml          the same model and training job in megac's format
    init.safetensors    initial weights (HF layout, from save_pretrained)
    init_config.json    the HF config.json saved with them
    tokens.bin          little-endian uint32 token ids
    expected.json       per-step loss and global grad norm (before clipping), versions
    final.safetensors   weights after `steps` optimizer steps (HF layout)

Training semantics (what megac implements and is checked against):
  * sample i is the window tokens[i*(S+1) : (i+1)*(S+1)]; inputs = its first S tokens,
    labels = its last S tokens (already shifted: the loss is computed here, not by HF);
  * step k uses samples k*G .. (k+1)*G-1 (G = global_batch), split into micro-batches of
    micro_batch samples; the loss of a micro-batch is the mean cross entropy over its
    tokens, scaled by 1/num_microbatches and accumulated, so the step's loss is the mean
    over all G*S tokens;
  * grad norm = torch.nn.utils.clip_grad_norm_(params, grad_clip) (total L2 norm before
    clipping), then one torch.optim.AdamW step (constant lr, decoupled weight decay on
    every parameter, foreach=False, fused=False);
  * float32 throughout, deterministic algorithms, one thread.
"""

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))

# Shared training job. grad_clip is per model, chosen from the unclipped norms (llama:
# 1.907, 1.875, 2.225; gpt: 2.255, 1.677, 1.233) so that clipping triggers with a clear
# margin (the script asserts it): llama clips every step (1.0: the strongest effect on
# the later losses, norms and final weights; no threshold separates its step 0 from step 1
# with a margin and 2.05, clipping step 2 only, moves just the final weights by 4e-4);
# gpt clips step 0 only (2.0), so the unclipped path is covered too.
TRAIN = dict(
    micro_batch=2,
    global_batch=4,
    steps=3,
    lr=1e-2,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
    seed=7,
)

# Minimum relative distance between a step's grad norm and grad_clip, so that megac's
# float rounding can't flip the clip decision.
CLIP_MARGIN = 0.05

MODELS = {
    "llama": dict(
        arch="llama",
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        ffn_hidden=96,
        vocab=128,
        seq_len=16,
        norm_eps=1e-5,
        rope_theta=10000.0,
        tie_embeddings=False,
        grad_clip=1.0,
    ),
    "gpt": dict(
        arch="gpt",
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=4,
        ffn_hidden=256,
        vocab=128,
        seq_len=16,
        norm_eps=1e-5,
        rope_theta=10000.0,
        tie_embeddings=True,
        grad_clip=2.0,
    ),
}


def build_model(m):
    if m["arch"] == "llama":
        cfg = LlamaConfig(
            vocab_size=m["vocab"],
            hidden_size=m["hidden"],
            intermediate_size=m["ffn_hidden"],
            num_hidden_layers=m["layers"],
            num_attention_heads=m["heads"],
            num_key_value_heads=m["kv_heads"],
            max_position_embeddings=m["seq_len"],
            rms_norm_eps=m["norm_eps"],
            rope_theta=m["rope_theta"],
            tie_word_embeddings=m["tie_embeddings"],
            attention_bias=False,
            attention_dropout=0.0,
            mlp_bias=False,
            hidden_act="silu",
            dtype="float32",
        )
        cfg._attn_implementation = "eager"
        model = LlamaForCausalLM(cfg)
    elif m["arch"] == "gpt":
        cfg = GPT2Config(
            vocab_size=m["vocab"],
            n_positions=m["seq_len"],
            n_embd=m["hidden"],
            n_layer=m["layers"],
            n_head=m["heads"],
            n_inner=m["ffn_hidden"],
            activation_function="gelu_new",
            layer_norm_epsilon=m["norm_eps"],
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            summary_first_dropout=0.0,
            tie_word_embeddings=m["tie_embeddings"],
            scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False,
            reorder_and_upcast_attn=False,
            use_cache=False,
            bos_token_id=None,
            eos_token_id=None,
            dtype="float32",
        )
        cfg._attn_implementation = "eager"
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(m["arch"])
    model = model.to(torch.float32)
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    if m["tie_embeddings"]:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    else:
        assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    return model


def save_weights(model, dst_safetensors, dst_config=None):
    """save_pretrained into a temp dir, copy model.safetensors (and config.json)."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        files = sorted(os.listdir(tmp))
        assert "model.safetensors" in files, files
        shutil.copyfile(os.path.join(tmp, "model.safetensors"), dst_safetensors)
        if dst_config is not None:
            shutil.copyfile(os.path.join(tmp, "config.json"), dst_config)


def fnum(x):
    """A float as a short TOML number: 1e-05 -> 1e-5, 0.01 -> 0.01, 10000.0 -> 10000.0."""
    r = repr(float(x))
    if "e" in r:
        mant, exp = r.split("e")
        sign = "-" if exp.startswith("-") else ""
        r = f"{mant}e{sign}{exp.lstrip('+-').lstrip('0') or '0'}"
    return r


def model_toml(name, m):
    t = TRAIN
    lines = [
        f"# Golden fixture '{name}': written by tests/golden/make_golden.py, do not edit.",
        f"# Matches init.safetensors / tokens.bin / expected.json / final.safetensors here.",
        "",
        "[model]",
        f'arch = "{m["arch"]}"',
        f"layers = {m['layers']}",
        f"hidden = {m['hidden']}",
        f"heads = {m['heads']}",
        f"kv_heads = {m['kv_heads']}",
        f"ffn_hidden = {m['ffn_hidden']}",
        f"vocab = {m['vocab']}",
        f"seq_len = {m['seq_len']}",
        f"norm_eps = {fnum(m['norm_eps'])}",
        f"rope_theta = {fnum(m['rope_theta'])}",
        f"tie_embeddings = {'true' if m['tie_embeddings'] else 'false'}",
        "",
        "[train]",
        f"micro_batch = {t['micro_batch']}",
        f"global_batch = {t['global_batch']}",
        f"steps = {t['steps']}",
        f"lr = {fnum(t['lr'])}",
        f"betas = [{fnum(t['betas'][0])}, {fnum(t['betas'][1])}]",
        f"eps = {fnum(t['eps'])}",
        f"weight_decay = {fnum(t['weight_decay'])}",
        f"grad_clip = {fnum(m['grad_clip'])}",
        'precision = "fp32"',
        f"seed = {t['seed']}",
        "",
    ]
    return "\n".join(lines)


def make_tokens(m, seed):
    t = TRAIN
    n = t["steps"] * t["global_batch"] * (m["seq_len"] + 1) + 5
    rng = np.random.RandomState(seed)
    toks = rng.randint(0, m["vocab"], size=n).astype("<u4")
    return toks


def train(model, toks, m):
    """Run `steps` steps with megac's semantics; return (losses, grad_norms)."""
    t = TRAIN
    S, V = m["seq_len"], m["vocab"]
    G, mb = t["global_batch"], t["micro_batch"]
    assert G % mb == 0
    n_micro = G // mb
    windows = torch.from_numpy(toks.astype(np.int64))
    params = list(model.parameters())  # tied weights appear once
    opt = torch.optim.AdamW(
        params,
        lr=t["lr"],
        betas=t["betas"],
        eps=t["eps"],
        weight_decay=t["weight_decay"],
        foreach=False,
        fused=False,
    )
    model.train()
    losses, norms = [], []
    for k in range(t["steps"]):
        opt.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), dtype=torch.float32)
        for j in range(n_micro):
            rows = []
            for b in range(mb):
                i = k * G + j * mb + b
                rows.append(windows[i * (S + 1) : (i + 1) * (S + 1)])
            batch = torch.stack(rows)  # [mb, S+1]
            inputs, labels = batch[:, :S], batch[:, 1:]
            logits = model(input_ids=inputs).logits
            assert logits.dtype == torch.float32 and logits.shape == (mb, S, V)
            loss = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))
            (loss / n_micro).backward()
            step_loss += loss.detach() / n_micro
        norm = torch.nn.utils.clip_grad_norm_(params, m["grad_clip"])
        opt.step()
        losses.append(float(step_loss.item()))
        norms.append(float(norm.item()))
    return losses, norms


def generate(name, m, outdir):
    os.makedirs(outdir, exist_ok=True)
    seed = TRAIN["seed"]
    torch.manual_seed(seed)
    model = build_model(m)
    save_weights(
        model,
        os.path.join(outdir, "init.safetensors"),
        os.path.join(outdir, "init_config.json"),
    )
    toks = make_tokens(m, seed)
    with open(os.path.join(outdir, "tokens.bin"), "wb") as f:
        f.write(toks.tobytes())
    with open(os.path.join(outdir, "model.toml"), "w") as f:
        f.write(model_toml(name, m))

    losses, norms = train(model, toks, m)
    clip = m["grad_clip"]
    clipped = [n > clip for n in norms]
    for n in norms:
        assert abs(n - clip) / clip > CLIP_MARGIN, (
            f"{name}: grad norm {n} within {CLIP_MARGIN:.0%} of grad_clip {clip}: pick another"
        )
    assert any(clipped), f"{name}: no step clipped (norms {norms}, clip {clip})"
    assert all(math.isfinite(x) for x in losses + norms)

    save_weights(model, os.path.join(outdir, "final.safetensors"))
    expected = {
        "losses": losses,
        "grad_norms": norms,
        "clipped": clipped,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    with open(os.path.join(outdir, "expected.json"), "w") as f:
        json.dump(expected, f, indent=2)
        f.write("\n")
    return expected


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=HERE, help="output root (default: this folder)")
    ap.add_argument(
        "--check",
        action="store_true",
        help="regenerate into a temp dir and compare with the committed files byte for byte",
    )
    args = ap.parse_args()

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()

    root = tempfile.mkdtemp() if args.check else args.out
    try:
        for name, m in MODELS.items():
            outdir = os.path.join(root, name)
            exp = generate(name, m, outdir)
            print(f"== {name} ({m['arch']}), grad_clip {m['grad_clip']}")
            for k, (l, n, c) in enumerate(zip(exp["losses"], exp["grad_norms"], exp["clipped"])):
                print(f"  step {k}: loss {l:.9g}  grad_norm {n:.9g}  {'clipped' if c else ''}")
            for fn in sorted(os.listdir(outdir)):
                p = os.path.join(outdir, fn)
                print(f"  {fn:20s} {os.path.getsize(p):8d} B  sha256 {sha256(p)[:16]}")
                assert not fn.endswith(".safetensors") or os.path.getsize(p) < 1 << 20
        print(f"torch {torch.__version__}, transformers {transformers.__version__}")
        if args.check:
            bad = []
            for name in MODELS:
                for fn in sorted(os.listdir(os.path.join(root, name))):
                    a = os.path.join(root, name, fn)
                    b = os.path.join(HERE, name, fn)
                    if not os.path.exists(b) or sha256(a) != sha256(b):
                        bad.append(f"{name}/{fn}")
            if bad:
                print("differs from the committed fixtures: " + ", ".join(bad))
                return 1
            print("identical to the committed fixtures")
    finally:
        if args.check:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
