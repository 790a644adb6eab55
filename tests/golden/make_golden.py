#!/usr/bin/env python3
"""Produce megac's golden fixtures with PyTorch + Hugging Face transformers.

CI never runs this script: it only reads the files committed next to it. Run it by hand
(see README.md in this folder for the exact install commands and versions) to regenerate:

    python3 tests/golden/make_golden.py            # writes tests/golden/<model>/ for every MODELS entry
    python3 tests/golden/make_golden.py --check    # regenerate in a temp dir, compare bytes

For each model it writes, into tests/golden/<name>/:

    model.toml          the same model and training job in megac's format
    init.safetensors    initial weights (HF layout, from save_pretrained)
    init_config.json    the HF config.json saved with them
    tokens.bin          little-endian uint32 token ids
    expected.json       per-step loss and global grad norm (before clipping), versions
    final.safetensors   weights after `steps` optimizer steps (HF layout)

and for the MoE models (mixtral, qwen2_moe) also

    init_fused.safetensors  the same initial weights as transformers 5's state_dict holds
                            them (experts fused into 3-D tensors; see hub_from_fused)

mixtral's init/final.safetensors use the Hub checkpoint names and layout of Mixtral
(block_sparse_moe.gate, per-expert w1/w2/w3), which is what megac names its parameters.

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
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

HERE = os.path.dirname(os.path.abspath(__file__))

# Shared training job. grad_clip is per model, chosen from the unclipped norms (llama:
# 1.907, 1.875, 2.225; gpt: 2.255, 1.677, 1.233) so that clipping triggers with a clear
# margin (the script asserts it): llama clips every step (1.0: the strongest effect on
# the later losses, norms and final weights; no threshold separates its step 0 from step 1
# with a margin and 2.05, clipping step 2 only, moves just the final weights by 4e-4);
# gpt clips step 0 only (2.0), so the unclipped path is covered too. mixtral (unclipped
# norms 1.766, 1.604, 2.763: no threshold separates steps 0 and 1 with a margin) uses 2.0:
# steps 0 and 1 don't clip, step 2 does (leaving the losses and norms as unclipped, but
# moving the final weights by up to 1.6e-3, 2.7e-2 relative to a tensor; clipping every
# step with 1.0 would change the step 2 loss by only 1.1e-4 relative).
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
    # Mixtral: the llama fixture's shapes with every layer's MLP replaced by 4 SwiGLU
    # experts of ffn_hidden 96, top-2 routing. aux_loss_coeff = 0: megac's load-balancing
    # loss is per layer (Megatron's), transformers' is one formula over the whole model,
    # so the golden leaves it out and the loss is exactly the LM cross entropy.
    # capacity_factor = 0: dropless (transformers never drops tokens).
    "mixtral": dict(
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
        moe=dict(experts=4, top_k=2, layer_freq=1, aux_loss_coeff=0.0, capacity_factor=0.0),
        grad_clip=2.0,
    ),
    # Qwen2ForCausalLM: llama's shapes plus q/k/v biases (Qwen2 always has them), and
    # linear rope scaling (factor 2). transformers zero-initialises biases, which would
    # leave them invisible in the first loss: they are redrawn from N(0, bias_std) (the
    # script asserts that zeroing them moves the first loss by more than MIN_EFFECT), and
    # the weights are drawn with std init_std (transformers' initializer_range) so that the
    # logits, hence the loss, respond to the attention (and to positions and their scaling).
    "qwen2": dict(
        arch="qwen2",
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        ffn_hidden=96,
        vocab=128,
        seq_len=16,
        norm_eps=1e-6,
        rope_theta=10000.0,
        tie_embeddings=False,
        rope_scaling=dict(type="linear", factor=2.0),
        bias_std=0.5,
        init_std=0.2,
        grad_clip=2.0,
    ),
    # LlamaForCausalLM with Llama 3.1's rope scaling (_compute_llama3_parameters). At the
    # default init std 0.02 the rewrite moves the loss by ~2e-5, so the weights are drawn
    # larger (init_std: transformers' initializer_range), the sequence is longer than
    # original_max_position_embeddings and theta is large, so the low-frequency half of the
    # dims is rescaled over positions that matter; the script asserts the effect on the
    # first loss exceeds MIN_EFFECT.
    "llama31": dict(
        arch="llama",
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        ffn_hidden=96,
        vocab=128,
        seq_len=32,
        norm_eps=1e-5,
        rope_theta=500000.0,
        tie_embeddings=False,
        rope_scaling=dict(
            type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
        init_std=0.2,
        grad_clip=2.0,
    ),
    # Qwen3ForCausalLM: an RMSNorm over each head's q and k before RoPE, and a head size (32)
    # that is not hidden / heads (16). The q/k norm weights are drawn around 1
    # (1 + N(0, qk_norm_std)) instead of transformers' ones, so each element's gradient
    # matters; the script asserts that removing the norms moves the first loss.
    "qwen3": dict(
        arch="qwen3",
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=32,
        ffn_hidden=96,
        vocab=128,
        seq_len=16,
        norm_eps=1e-6,
        rope_theta=10000.0,
        tie_embeddings=False,
        qk_norm_std=0.2,
        init_std=0.1,
        grad_clip=2.0,
    ),
    # MistralForCausalLM with a sliding window of 5 over 32-token samples (query q sees keys
    # q-4 ..= q): the window cuts most of each row of the causal mask; the script asserts
    # that full causal attention (sliding_window None) gives another first loss.
    "mistral": dict(
        arch="mistral",
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        ffn_hidden=96,
        vocab=128,
        seq_len=32,
        norm_eps=1e-5,
        rope_theta=10000.0,
        tie_embeddings=False,
        sliding_window=5,
        init_std=0.1,
        grad_clip=1.5,
    ),
    # Qwen2MoeForCausalLM: Qwen2's attention (q/k/v biases redrawn from N(0, bias_std)), a
    # dense first layer (mlp_only_layers = [0], first_dense_layers here) with the dense
    # intermediate size 96, then MoE layers of 4 routed experts of 48 (top 2, weights not
    # renormalised: norm_topk_prob false) and a shared expert of 80 scaled by
    # sigmoid(shared_expert_gate(x)). The weights are drawn with std init_std so the gate's
    # logits spread; the script asserts that renormalising the top-k weights, and replacing
    # the gate by 1, each move the first loss.
    "qwen2_moe": dict(
        arch="qwen2_moe",
        layers=3,
        hidden=64,
        heads=4,
        kv_heads=2,
        ffn_hidden=96,
        vocab=128,
        seq_len=16,
        norm_eps=1e-6,
        rope_theta=10000.0,
        tie_embeddings=False,
        moe=dict(
            experts=4,
            top_k=2,
            layer_freq=1,
            aux_loss_coeff=0.0,
            capacity_factor=0.0,
            ffn_hidden=48,
            shared_ffn_hidden=80,
            norm_topk_prob=False,
            first_dense_layers=1,
        ),
        bias_std=0.5,
        init_std=0.1,
        grad_clip=2.0,
    ),
}

# A feature's golden must show it: switching the feature off (zero biases, no rope scaling)
# must change the first loss by more than this (relative), far above float32 noise.
MIN_EFFECT = 1e-3

# Minimum gap between the top_k-th and the (top_k+1)-th router logit of any token in any
# MoE layer over all the training forwards (mixtral): far above float32 rounding, so
# megac's routing can't pick a different expert than transformers' does.
MIN_ROUTER_GAP = 1e-4


def build_model(m):
    if m["arch"] == "qwen2_moe":
        moe = m["moe"]
        assert moe["layer_freq"] == 1
        assert moe["aux_loss_coeff"] == 0.0 and moe["capacity_factor"] == 0.0
        cfg = Qwen2MoeConfig(
            vocab_size=m["vocab"],
            hidden_size=m["hidden"],
            intermediate_size=m["ffn_hidden"],
            num_hidden_layers=m["layers"],
            num_attention_heads=m["heads"],
            num_key_value_heads=m["kv_heads"],
            max_position_embeddings=m["seq_len"],
            rms_norm_eps=m["norm_eps"],
            rope_parameters=rope_parameters(m),
            tie_word_embeddings=m["tie_embeddings"],
            qkv_bias=True,
            use_sliding_window=False,
            num_experts=moe["experts"],
            num_experts_per_tok=moe["top_k"],
            moe_intermediate_size=moe["ffn_hidden"],
            shared_expert_intermediate_size=moe["shared_ffn_hidden"],
            norm_topk_prob=moe["norm_topk_prob"],
            mlp_only_layers=list(range(moe["first_dense_layers"])),
            decoder_sparse_step=1,
            router_aux_loss_coef=0.0,
            output_router_logits=False,
            attention_dropout=0.0,
            hidden_act="silu",
            initializer_range=m.get("init_std", 0.02),
            dtype="float32",
        )
        cfg._attn_implementation = "eager"
        # The plain per-expert loop of the experts' forward (not grouped_mm).
        cfg._experts_implementation = "eager"
        model = Qwen2MoeForCausalLM(cfg)
        assert model.config._experts_implementation == "eager"
        with torch.no_grad():
            for name, p in model.named_parameters():
                if m.get("bias_std") is not None and name.endswith(".bias"):
                    p.normal_(0.0, m["bias_std"])
    elif m.get("moe") is not None:
        moe = m["moe"]
        assert m["arch"] == "llama" and moe["layer_freq"] == 1
        assert moe["aux_loss_coeff"] == 0.0 and moe["capacity_factor"] == 0.0
        cfg = MixtralConfig(
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
            num_local_experts=moe["experts"],
            num_experts_per_tok=moe["top_k"],
            router_aux_loss_coef=0.0,
            output_router_logits=False,
            router_jitter_noise=0.0,
            sliding_window=None,
            attention_dropout=0.0,
            hidden_act="silu",
            dtype="float32",
        )
        cfg._attn_implementation = "eager"
        # The plain per-expert loop of MixtralExperts.forward (not grouped_mm).
        cfg._experts_implementation = "eager"
        model = MixtralForCausalLM(cfg)
        assert model.config._experts_implementation == "eager"
    elif m["arch"] in ("qwen2", "qwen3", "mistral") or m.get("rope_scaling") is not None:
        kw = dict(
            vocab_size=m["vocab"],
            hidden_size=m["hidden"],
            intermediate_size=m["ffn_hidden"],
            num_hidden_layers=m["layers"],
            num_attention_heads=m["heads"],
            num_key_value_heads=m["kv_heads"],
            max_position_embeddings=m["seq_len"],
            rms_norm_eps=m["norm_eps"],
            rope_parameters=rope_parameters(m),
            tie_word_embeddings=m["tie_embeddings"],
            attention_dropout=0.0,
            hidden_act="silu",
            initializer_range=m.get("init_std", 0.02),
            dtype="float32",
        )
        if m["arch"] == "qwen2":
            cfg = Qwen2Config(use_sliding_window=False, **kw)
            cls = Qwen2ForCausalLM
        elif m["arch"] == "mistral":
            cfg = MistralConfig(sliding_window=m.get("sliding_window"), **kw)
            cls = MistralForCausalLM
        elif m["arch"] == "qwen3":
            cfg = Qwen3Config(
                use_sliding_window=False, attention_bias=False, head_dim=m["head_dim"], **kw
            )
            cls = Qwen3ForCausalLM
        else:
            assert m["arch"] == "llama"
            cfg = LlamaConfig(attention_bias=False, mlp_bias=False, **kw)
            cls = LlamaForCausalLM
        cfg._attn_implementation = "eager"
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if m.get("bias_std") is not None and name.endswith(".bias"):
                    p.normal_(0.0, m["bias_std"])
                if m.get("qk_norm_std") is not None and name.endswith(
                    ("q_norm.weight", "k_norm.weight")
                ):
                    p.normal_(1.0, m["qk_norm_std"])
    elif m["arch"] == "llama":
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


def rope_parameters(m):
    """transformers 5's rope_parameters for model m (theta and its rope_scaling)."""
    r = dict(rope_type="default", rope_theta=m["rope_theta"])
    sc = m.get("rope_scaling")
    if sc is not None:
        r.update({k: v for k, v in sc.items() if k != "type"})
        r["rope_type"] = sc["type"]
    return r


def first_loss(model, toks, m):
    """The loss of the first global batch's samples in one forward (no update)."""
    S, V, G = m["seq_len"], m["vocab"], TRAIN["global_batch"]
    windows = torch.from_numpy(toks.astype(np.int64))
    batch = torch.stack([windows[i * (S + 1) : (i + 1) * (S + 1)] for i in range(G)])
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch[:, :S]).logits
    model.train()
    return float(F.cross_entropy(logits.reshape(-1, V), batch[:, 1:].reshape(-1)).item())


def feature_effects(model, toks, m):
    """How much each feature of m moves the first loss: {feature: relative change} when it
    is switched off in a copy of the model (biases zeroed; rope scaling removed)."""
    import copy

    base = first_loss(model, toks, m)
    effects = {}
    if m.get("bias_std") is not None:
        off = copy.deepcopy(model)
        with torch.no_grad():
            for name, p in off.named_parameters():
                if name.endswith(".bias"):
                    p.zero_()
        effects["qkv_bias"] = abs(first_loss(off, toks, m) - base) / base
    if m.get("qk_norm_std") is not None:
        off = copy.deepcopy(model)
        for layer in off.model.layers:
            layer.self_attn.q_norm = torch.nn.Identity()
            layer.self_attn.k_norm = torch.nn.Identity()
        effects["qk_norm"] = abs(first_loss(off, toks, m) - base) / base
    if m.get("sliding_window") is not None:
        plain = dict(m)
        plain.pop("sliding_window")
        torch.manual_seed(12345)
        off = build_model(plain)
        off.load_state_dict(model.state_dict(), strict=True)
        effects["sliding_window"] = abs(first_loss(off, toks, m) - base) / base
    if m["arch"] == "qwen2_moe":

        class One(torch.nn.Module):
            # sigmoid(30) == 1 in float32: the shared expert ungated.
            def forward(self, x):
                return torch.full(x.shape[:-1] + (1,), 30.0)

        off = copy.deepcopy(model)
        for layer in off.model.layers:
            if hasattr(layer.mlp, "shared_expert_gate"):
                layer.mlp.shared_expert_gate = One()
        effects["shared_expert_gate"] = abs(first_loss(off, toks, m) - base) / base
        off = copy.deepcopy(model)
        for layer in off.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.norm_topk_prob = not m["moe"]["norm_topk_prob"]
        effects["norm_topk_prob"] = abs(first_loss(off, toks, m) - base) / base
    if m.get("rope_scaling") is not None:
        plain = dict(m)
        plain.pop("rope_scaling")
        torch.manual_seed(12345)
        off = build_model(plain)
        off.load_state_dict(model.state_dict(), strict=True)
        effects["rope_scaling"] = abs(first_loss(off, toks, m) - base) / base
    for k, v in effects.items():
        assert v > MIN_EFFECT, f"{m['arch']}: switching off {k} moves the first loss by only {v:.2e}"
    return effects


def save_weights(model, dst_safetensors, dst_config=None):
    """save_pretrained into a temp dir, copy model.safetensors (and config.json)."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        files = sorted(os.listdir(tmp))
        assert "model.safetensors" in files, files
        shutil.copyfile(os.path.join(tmp, "model.safetensors"), dst_safetensors)
        if dst_config is not None:
            shutil.copyfile(os.path.join(tmp, "config.json"), dst_config)


def hub_from_fused(sd, m):
    """transformers 5 Mixtral state dict -> Hub checkpoint names and layout.

    transformers 5 (MixtralSparseMoeBlock) holds, per layer i,
      model.layers.{i}.mlp.gate.weight               [E, hidden]         (router)
      model.layers.{i}.mlp.experts.gate_up_proj      [E, 2*ffn, hidden]
      model.layers.{i}.mlp.experts.down_proj         [E, hidden, ffn]
    and computes expert e as
      gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)
      y = linear(silu(gate) * up, down_proj[e])
    so gate_up_proj[e] rows [0, ffn) are the gate projection (Hub w1) and rows
    [ffn, 2*ffn) the up projection (Hub w3), both already [out, in] as nn.Linear stores
    them; down_proj[e] is w2 as is. Nothing is transposed:
      model.layers.{i}.block_sparse_moe.gate.weight          = mlp.gate.weight
      model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight = gate_up_proj[e, :ffn, :]
      model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight = gate_up_proj[e, ffn:, :]
      model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight = down_proj[e]
    (the inverse of transformers' own conversion_mapping["mixtral"], which loads Hub files
    by renaming .block_sparse_moe. -> .mlp. and concatenating [w1; w3] along dim 1).
    Every other tensor keeps its name.
    """
    E, F_ = m["moe"]["experts"], m["ffn_hidden"]
    out = {}
    for k, v in sd.items():
        v = v.detach().contiguous()
        if ".mlp.experts.gate_up_proj" in k:
            pre = k[: -len(".mlp.experts.gate_up_proj")] + ".block_sparse_moe.experts"
            assert v.shape == (E, 2 * F_, m["hidden"]), (k, v.shape)
            for e in range(E):
                out[f"{pre}.{e}.w1.weight"] = v[e, :F_, :].clone()
                out[f"{pre}.{e}.w3.weight"] = v[e, F_:, :].clone()
        elif ".mlp.experts.down_proj" in k:
            pre = k[: -len(".mlp.experts.down_proj")] + ".block_sparse_moe.experts"
            assert v.shape == (E, m["hidden"], F_), (k, v.shape)
            for e in range(E):
                out[f"{pre}.{e}.w2.weight"] = v[e].clone()
        elif ".mlp.gate.weight" in k:
            assert v.shape == (E, m["hidden"]), (k, v.shape)
            out[k.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = v.clone()
        else:
            assert ".mlp." not in k, k
            out[k] = v.clone()
    return out


def fused_from_hub(hub, m):
    """The inverse of hub_from_fused: Hub names -> transformers 5 state dict."""
    E = m["moe"]["experts"]
    out = {}
    for k, v in hub.items():
        if ".block_sparse_moe.experts." in k:
            continue
        out[k.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = v
    for i in range(m["layers"]):
        pre = f"model.layers.{i}.block_sparse_moe.experts"
        w = lambda e, n: hub[f"{pre}.{e}.{n}.weight"]
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([w(e, "w1"), w(e, "w3")], dim=0) for e in range(E)]
        )
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([w(e, "w2") for e in range(E)])
    return out


def save_hub_weights(model, m, dst_safetensors, dst_config=None):
    """MoE models: write the state dict converted to Hub names (hub_from_fused).

    Cross-checks the conversion: the names and values equal what save_pretrained writes
    (transformers 5.24 converts back to the Hub layout when saving), and converting back
    and loading into the model reproduces the state dict exactly.
    """
    sd = model.state_dict()
    hub = hub_from_fused(sd, m)
    back = fused_from_hub(hub, m)
    assert sorted(back) == sorted(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        with safe_open(os.path.join(tmp, "model.safetensors"), "pt") as f:
            assert sorted(f.keys()) == sorted(hub), (sorted(f.keys()), sorted(hub))
            for k in hub:
                assert torch.equal(f.get_tensor(k), hub[k]), k
        if dst_config is not None:
            shutil.copyfile(os.path.join(tmp, "config.json"), dst_config)
    save_file(hub, dst_safetensors, metadata={"format": "pt"})


def check_conversion(model, m, hub_path, fused_path, toks):
    """Load the Hub-named file (via fused_from_hub, and via transformers' own loader) and
    the fused file into fresh models: each must give the original model's loss bit for
    bit."""
    S = m["seq_len"]
    windows = torch.from_numpy(toks.astype(np.int64))
    batch = torch.stack([windows[i * (S + 1) : (i + 1) * (S + 1)] for i in range(4)])

    def loss_of(mod):
        mod.eval()
        with torch.no_grad():
            logits = mod(input_ids=batch[:, :S]).logits
        return F.cross_entropy(logits.reshape(-1, m["vocab"]), batch[:, 1:].reshape(-1))

    want = loss_of(model)
    model.train()
    with safe_open(hub_path, "pt") as f:
        hub = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(fused_path, "pt") as f:
        fused = {k: f.get_tensor(k) for k in f.keys()}
    losses = {}
    for label, sd in (("hub->fused", fused_from_hub(hub, m)), ("fused", fused)):
        torch.manual_seed(12345)  # fresh, different weights until loaded
        fresh = build_model(m)
        fresh.load_state_dict(sd, strict=True)
        losses[label] = loss_of(fresh)
    with tempfile.TemporaryDirectory() as tmp:
        model.config.save_pretrained(tmp)
        shutil.copyfile(hub_path, os.path.join(tmp, "model.safetensors"))
        fresh = MixtralForCausalLM.from_pretrained(
            tmp, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
        )
        losses["from_pretrained(hub)"] = loss_of(fresh)
    for label, l in losses.items():
        assert torch.equal(l, want), f"conversion check {label}: loss {l.item()} != {want.item()}"
    return float(want.item())


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
    ]
    for key in ("head_dim", "sliding_window"):
        if m.get(key) is not None:
            lines.append(f"{key} = {m[key]}")
    lines.append("")
    sc = m.get("rope_scaling")
    if sc is not None:
        lines.append("[model.rope_scaling]")
        lines.append(f'type = "{sc["type"]}"')
        for k, v in sc.items():
            if k != "type":
                lines.append(f"{k} = {fnum(v)}")
        lines.append("")
    if m.get("moe") is not None:
        moe = m["moe"]
        lines += [
            "[model.moe]",
            f"experts = {moe['experts']}",
            f"top_k = {moe['top_k']}",
            f"layer_freq = {moe['layer_freq']}",
            f"aux_loss_coeff = {fnum(moe['aux_loss_coeff'])}",
            f"capacity_factor = {fnum(moe['capacity_factor'])}",
        ]
        for key in ("ffn_hidden", "shared_ffn_hidden", "first_dense_layers"):
            if key in moe:
                lines.append(f"{key} = {moe[key]}")
        if "norm_topk_prob" in moe:
            lines.append(f"norm_topk_prob = {'true' if moe['norm_topk_prob'] else 'false'}")
        lines.append("")
    lines += [
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


def router_gaps(model):
    """Hooks recording, for every MoE router call, each token's gap between its top_k-th
    and (top_k+1)-th router logit. Returns the list they append to."""
    gaps = []
    if model.config.model_type not in ("mixtral", "qwen2_moe"):
        return gaps
    k = model.config.num_experts_per_tok

    def hook(_mod, _inp, out):
        logits = out[0].detach()
        top = torch.topk(logits, k + 1, dim=-1).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min().item()))

    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.gate.register_forward_hook(hook)
    return gaps


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
    is_moe = m.get("moe") is not None
    # Mixtral's fused experts are written in the Hub layout by hand (save_hub_weights);
    # Qwen2-MoE's save_pretrained writes mlp.experts.{j}.* itself.
    hub_by_hand = is_moe and m["arch"] != "qwen2_moe"
    toks = make_tokens(m, seed)
    if hub_by_hand:
        save_hub_weights(
            model,
            m,
            os.path.join(outdir, "init.safetensors"),
            os.path.join(outdir, "init_config.json"),
        )
        save_file(
            {k: v.detach().contiguous() for k, v in model.state_dict().items()},
            os.path.join(outdir, "init_fused.safetensors"),
            metadata={"format": "pt"},
        )
        check_conversion(
            model,
            m,
            os.path.join(outdir, "init.safetensors"),
            os.path.join(outdir, "init_fused.safetensors"),
            toks,
        )
    else:
        save_weights(
            model,
            os.path.join(outdir, "init.safetensors"),
            os.path.join(outdir, "init_config.json"),
        )
    if is_moe and not hub_by_hand:
        # Qwen2-MoE: the state dict as transformers 5 holds it (experts fused), which
        # --init also reads.
        save_file(
            {k: v.detach().contiguous() for k, v in model.state_dict().items()},
            os.path.join(outdir, "init_fused.safetensors"),
            metadata={"format": "pt"},
        )
    with open(os.path.join(outdir, "tokens.bin"), "wb") as f:
        f.write(toks.tobytes())
    with open(os.path.join(outdir, "model.toml"), "w") as f:
        f.write(model_toml(name, m))

    effects = feature_effects(model, toks, m)
    gaps = router_gaps(model)
    losses, norms = train(model, toks, m)
    if is_moe:
        moe_layers = m["layers"] - m["moe"].get("first_dense_layers", 0)
        assert len(gaps) == TRAIN["steps"] * (TRAIN["global_batch"] // TRAIN["micro_batch"]) * moe_layers
        assert min(gaps) > MIN_ROUTER_GAP, f"{name}: router near-tie {min(gaps)}"
    clip = m["grad_clip"]
    clipped = [n > clip for n in norms]
    for n in norms:
        assert abs(n - clip) / clip > CLIP_MARGIN, (
            f"{name}: grad norm {n} within {CLIP_MARGIN:.0%} of grad_clip {clip}: pick another"
        )
    assert any(clipped), f"{name}: no step clipped (norms {norms}, clip {clip})"
    assert all(math.isfinite(x) for x in losses + norms)

    if hub_by_hand:
        save_hub_weights(model, m, os.path.join(outdir, "final.safetensors"))
    else:
        save_weights(model, os.path.join(outdir, "final.safetensors"))
    expected = {
        "losses": losses,
        "grad_norms": norms,
        "clipped": clipped,
    }
    if is_moe:
        expected["min_router_logit_gap"] = min(gaps)
    if effects:
        expected["feature_effects"] = effects
    expected["torch_version"] = torch.__version__
    expected["transformers_version"] = transformers.__version__
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
        "--only",
        action="append",
        help="generate only this model (repeatable; default: every model)",
    )
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
        names = args.only or list(MODELS)
        for name in names:
            m = MODELS[name]
            outdir = os.path.join(root, name)
            exp = generate(name, m, outdir)
            print(f"== {name} ({m['arch']}), grad_clip {m['grad_clip']}")
            for k, (l, n, c) in enumerate(zip(exp["losses"], exp["grad_norms"], exp["clipped"])):
                print(f"  step {k}: loss {l:.9g}  grad_norm {n:.9g}  {'clipped' if c else ''}")
            for k, v in exp.get("feature_effects", {}).items():
                print(f"  switching off {k} moves the first loss by {v:.3g} (relative)")
            if "min_router_logit_gap" in exp:
                print(f"  min router logit gap (top_k vs next): {exp['min_router_logit_gap']:.3g}")
            for fn in sorted(os.listdir(outdir)):
                p = os.path.join(outdir, fn)
                print(f"  {fn:24s} {os.path.getsize(p):8d} B  sha256 {sha256(p)[:16]}")
                assert not fn.endswith(".safetensors") or os.path.getsize(p) < 1 << 20
        print(f"torch {torch.__version__}, transformers {transformers.__version__}")
        if args.check:
            bad = []
            for name in names:
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
