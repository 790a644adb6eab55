#!/usr/bin/env python3
"""Produce the generation and probe fixtures of `megac generate` and `megac scope` with
PyTorch + Hugging Face transformers.

CI never runs this script: it only reads the files committed next to it. It reuses the
weights of the training fixtures (tests/golden/<name>/init.safetensors, init_config.json,
made by make_golden.py) and writes, into tests/golden/<name>/:

    generate.json     greedy `generate(do_sample=False)` ids for a few prompts, with the
                      smallest gap between the two largest logits of any step (so float
                      rounding cannot flip an argmax), and the versions
    scope.safetensors one forward of SCOPE_TOKENS (batch 1): the probes of `megac scope`
                      under megac's names (see docs/scope.md):
                        embed              hidden_states[0]
                        layers.{i}.out     the residual stream after layer i, before any
                                           final norm (the decoder layer's output, hooked)
                        layers.{i}.attn.probs  output_attentions[i]  [batch, heads, q, k]
                        layers.{i}.attn.out    the attention block's output (o_proj / c_proj)
                        layers.{i}.mlp.out     the MLP's (or MoE block's) output
                        layers.{i}.moe.router  mixtral: softmax of the router's logits
                                           over every expert [batch, seq, experts]
                        logits             the output layer's logits
                        layers.{i}.lens.tokens / .probs  the logit lens: the final norm
                                           and output layer applied to layers.{i}.out,
                                           the top 5 tokens (as float ids) and their
                                           probabilities [batch, seq, 5]

    python3 tests/golden/make_scope_golden.py          # writes the files
    python3 tests/golden/make_scope_golden.py --check  # regenerate in memory, compare

Same versions as make_golden.py (README.md): torch 2.15.0, transformers 5.24.0,
safetensors 0.8.0; float32, eager attention (and eager experts), one thread.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))

# Prompts (token ids < vocab 128) and how many tokens to generate: prompt + new <= seq_len 16.
PROMPTS = [([5, 17, 99, 3, 42], 8), ([1], 15), ([100, 2, 64, 64, 7, 0, 33, 90, 12, 8], 6)]
SCOPE_TOKENS = [3, 14, 15, 92, 65, 35, 89, 79]
LENS_K = 5

CLASSES = {"llama": LlamaForCausalLM, "gpt": GPT2LMHeadModel, "mixtral": MixtralForCausalLM}


def load(name):
    src = os.path.join(HERE, name)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(os.path.join(src, "init_config.json"), os.path.join(tmp, "config.json"))
        shutil.copyfile(
            os.path.join(src, "init.safetensors"), os.path.join(tmp, "model.safetensors")
        )
        kw = dict(attn_implementation="eager", dtype=torch.float32)
        if name == "mixtral":
            kw["experts_implementation"] = "eager"
        model = CLASSES[name].from_pretrained(tmp, **kw)
    model.eval()
    # No stop token: always generate max_new_tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def blocks(model, name):
    """(decoder layers, attention module, mlp module) per layer."""
    if name == "gpt":
        return [(l, l.attn, l.mlp) for l in model.transformer.h]
    return [(l, l.self_attn, l.mlp) for l in model.model.layers]


def greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            # Explicit: generate would otherwise mask prompt tokens equal to pad_token_id.
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    gap = min(float((l[0].topk(2).values[0] - l[0].topk(2).values[1])) for l in out.logits)
    # The same ids by recomputing the whole prefix each step (no cache).
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert seq[len(prompt) :] == tokens, (seq, tokens)
    return tokens, gap


def probes(model, name):
    got = {}
    hooks = []
    for i, (layer, attn, mlp) in enumerate(blocks(model, name)):

        def save(key):
            def hook(_m, _inp, out):
                t = out[0] if isinstance(out, tuple) else out
                got[key] = t.detach().clone()

            return hook

        hooks.append(layer.register_forward_hook(save(f"layers.{i}.out")))
        hooks.append(attn.register_forward_hook(save(f"layers.{i}.attn.out")))
        hooks.append(mlp.register_forward_hook(save(f"layers.{i}.mlp.out")))
        if name == "mixtral":
            # The router's probabilities over every expert: softmax of its logits.
            def router(key):
                def hook(_m, _inp, out):
                    got[key] = torch.softmax(out[0].float(), dim=-1).reshape(1, len(SCOPE_TOKENS), -1)

                return hook

            hooks.append(mlp.gate.register_forward_hook(router(f"layers.{i}.moe.router")))
    with torch.no_grad():
        out = model(
            torch.tensor([SCOPE_TOKENS]), output_hidden_states=True, output_attentions=True
        )
    for h in hooks:
        h.remove()
    got["embed"] = out.hidden_states[0]
    n = len(out.attentions)
    for i, a in enumerate(out.attentions):
        got[f"layers.{i}.attn.probs"] = a
    # hidden_states[i+1] is layer i's output except the last (final norm applied there).
    for i in range(n - 1):
        assert torch.equal(got[f"layers.{i}.out"], out.hidden_states[i + 1]), i
    got["logits"] = out.logits
    # The logit lens: the final norm and the output layer on each layer's output, top 5.
    norm = model.transformer.ln_f if name == "gpt" else model.model.norm
    with torch.no_grad():
        for i in range(n):
            p = torch.softmax(model.lm_head(norm(got[f"layers.{i}.out"])).double(), dim=-1)
            top = p.topk(LENS_K, dim=-1)
            got[f"layers.{i}.lens.tokens"] = top.indices.to(torch.float32)
            got[f"layers.{i}.lens.probs"] = top.values.to(torch.float32)
    return {k: v.contiguous().to(torch.float32) for k, v in sorted(got.items())}


def make(name):
    model = load(name)
    cases = []
    for prompt, n in PROMPTS:
        tokens, gap = greedy(model, prompt, n)
        assert gap > 1e-4, (name, prompt, gap)
        cases.append(
            {"prompt": prompt, "max_new_tokens": n, "tokens": tokens, "min_top2_gap": gap}
        )
    gen = {
        "cases": cases,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    return gen, probes(model, name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed files")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    bad = []
    for name in CLASSES:
        gen, pr = make(name)
        gpath = os.path.join(HERE, name, "generate.json")
        spath = os.path.join(HERE, name, "scope.safetensors")
        text = json.dumps(gen, indent=1) + "\n"
        print(f"== {name}")
        for c in gen["cases"]:
            print(f"  {c['prompt']} -> {c['tokens']} (min top-2 gap {c['min_top2_gap']:.3g})")
        if args.check:
            if open(gpath).read() != text:
                bad.append(gpath)
            old = load_file(spath)
            if old.keys() != pr.keys() or any(not torch.equal(old[k], pr[k]) for k in pr):
                bad.append(spath)
        else:
            with open(gpath, "w") as f:
                f.write(text)
            save_file(pr, spath, metadata={"format": "pt", "tokens": json.dumps(SCOPE_TOKENS)})
    if bad:
        print("differs: " + ", ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
