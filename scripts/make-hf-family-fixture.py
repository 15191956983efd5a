#!/usr/bin/env python3
"""Writes the tiny random Hugging Face fixtures of the other model families of tests/models/.

    python3 scripts/make-hf-family-fixture.py     # needs torch, transformers, safetensors

The Llama fixtures are scripts/make-hf-fixture.py's; this one writes, under tests/models/fixtures/,
each a Hugging Face model directory (config.json + one f32 model.safetensors, as
`save_pretrained(safe_serialization=True)` writes them; vocab 64, hidden 32, 4 heads, 2 key/value
heads, intermediate 48, eager attention, every dropout 0, pad_token_id null):
  family-mistral/     MistralForCausalLM, 2 layers, head_dim 8, sliding_window 5 (< T = 12: the
                      window changes the logits), untied
  family-qwen2/       Qwen2ForCausalLM, 2 layers, q/k/v biases (no o_proj bias), rope theta 1e6,
                      use_sliding_window false, tied embeddings
  family-qwen2-bf16/  the same config, bf16 weights (the reference computes in f32 with the
                      bf16-rounded values, which is what loading gives)
  family-qwen3/       Qwen3ForCausalLM, 2 layers, head_dim 16 (!= hidden / heads), per-head q_norm and
                      k_norm, no attention bias, untied
  family-phi3/        Phi3ForCausalLM, 2 layers, fused qkv_proj and gate_up_proj, no sliding window,
                      partial_rotary_factor 1, default rope, untied
  family-gemma2-pad/  the same configuration with pad_token_id 0 (as published), the first
                      sequence left-padded with it (transformers' padding_idx: no gradient)
  family-gemma2/      Gemma2ForCausalLM, 4 layers (sliding, full, sliding, full), head_dim 8,
                      gelu_pytorch_tanh, query_pre_attn_scalar 12, attention softcap 5, final logit
                      softcap 3, sliding_window 4, tied embeddings
  family-gpt2/        GPT2LMHeadModel, 2 layers, n_positions 64, gelu_new, tied head
and for each an `expected.safetensors` with what transformers computed in f32: `logits` (B, T, V) of
the `ids` in expected.json's inputs, `loss` (the mean next-token cross-entropy against the targets),
and `step.<name>`: every parameter (named_parameters(): a tied weight once, under the name listed)
after one `torch.optim.AdamW` step on that loss in train mode (lr, betas, eps, weight_decay in
expected.json; for family-qwen2-bf16 the step starts from the bf16-rounded values and is taken in
f32). expected.json also has `family`, `architecture`, `param_names` (named_parameters() names and
shapes), `file_tensors` (the names, shapes and dtypes model.safetensors holds: a tied head is not
stored) and, where the config has them, the per-layer `layer_types`.

The random parameters are larger than the default init (randn * 0.2) so that every layer matters;
norm scales are around 1: 1 + randn * 0.2 for the RMSNorms and LayerNorms that multiply by their
weight, randn * 0.2 for Gemma 2's RMSNorm, which multiplies by (1 + weight); GPT-2's LayerNorm biases
randn * 0.2. The script asserts that the sliding windows (Mistral, Gemma 2) and Gemma 2's softcaps
change the logits by more than 1e-3.
"""
import copy
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM,
    Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models", "fixtures")
B, T, V = 2, 12, 64
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)

# What the RoPE families share (Llama-like sizes of make-hf-fixture.py, 2 key/value heads).
COMMON = dict(
    vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, hidden_act="silu", attention_dropout=0.0,
    pad_token_id=None,
)


def mistral_config():
    return MistralConfig(**COMMON, head_dim=8, rms_norm_eps=1e-6, sliding_window=5,
                         tie_word_embeddings=False, attn_implementation="eager")


def qwen2_config():
    # Qwen2Config has no head_dim: it is hidden_size / num_attention_heads = 8.
    return Qwen2Config(**COMMON, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       use_sliding_window=False, attn_implementation="eager")


def qwen3_config():
    return Qwen3Config(**COMMON, head_dim=16, rms_norm_eps=1e-6, attention_bias=False,
                       tie_word_embeddings=False, use_sliding_window=False,
                       attn_implementation="eager")


def phi3_config():
    # Phi3Config has no head_dim either (8); its default bos/eos/pad ids (1, 32000, 32000) are
    # outside the vocab but for bos.
    return Phi3Config(**COMMON, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=64,
                      rms_norm_eps=1e-5,
                      resid_pdrop=0.0, embd_pdrop=0.0, sliding_window=None, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 1.0},
                      attn_implementation="eager")


def gemma2_config(**extra):
    kw = dict(COMMON, num_hidden_layers=4)
    kw.update(extra)
    del kw["hidden_act"]
    return Gemma2Config(**kw, head_dim=8, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                        query_pre_attn_scalar=12, attn_logit_softcapping=5.0,
                        final_logit_softcapping=3.0, sliding_window=4, tie_word_embeddings=True,
                        attn_implementation="eager")


def gpt2_config():
    return GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                      activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      summary_first_dropout=0.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
                      attn_implementation="eager")


def randomise(model, family):
    with torch.no_grad():
        for n, p in model.named_parameters():
            r = torch.randn_like(p) * 0.2
            if family == "gpt2":
                is_scale = ".ln_" in n and n.endswith(".weight")
            else:
                is_scale = "norm" in n
            # Gemma 2's RMSNorm computes x * (1 + w): its weights around 0 are scales around 1.
            if is_scale and family != "gemma2":
                r += 1.0
            p.copy_(r)


def logits_of(cls, cfg, state, inputs):
    """The eval-mode logits of `inputs` from a model of `cfg` holding `state`."""
    m = cls(cfg).float()
    assert m.config._attn_implementation == "eager", m.config._attn_implementation
    m.load_state_dict(state, strict=True)
    m.eval()
    with torch.no_grad():
        return m(input_ids=inputs).logits.float()


def spec(shape_of):
    return [{"name": n, "shape": list(s)} for n, s in shape_of]


def make(name, family, cls, cfg, seed, dtype=torch.float32, variants=(), pad=None):
    torch.manual_seed(seed)
    model = cls(cfg).float()
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    randomise(model, family)
    if dtype != torch.float32:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype).float())
    model.eval()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    if pad is not None:
        # Left padding of the first sequence: the embedding's padding_idx row is looked up.
        ids[0, :3] = pad
    inputs, targets = ids[:, :T], ids[:, 1:]
    logits = model(input_ids=inputs).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))

    # The features that must matter: the same weights under a changed config give other logits.
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for what, change in variants:
        cfg2 = copy.deepcopy(cfg)
        for k, v in change.items():
            setattr(cfg2, k, v)
        other = logits_of(cls, cfg2, state, inputs)
        same = logits_of(cls, copy.deepcopy(cfg), state, inputs)
        assert torch.equal(same, logits.detach()), "the rebuilt model reproduces the logits"
        diff = float((other - logits.detach()).abs().max())
        print(f"{name}: {what} changes the logits by {diff:.4g}")
        assert diff > 1e-3, f"{name}: {what} does not matter ({diff})"

    out_dir = os.path.join(ROOT, name)
    os.makedirs(out_dir, exist_ok=True)
    # A copy is cast: casting the model itself would round its non-persistent buffers too (the
    # rotary inv_freq, Gemma 2's embed_scale), and the step below starts from the f32 model.
    copy.deepcopy(model).to(dtype).save_pretrained(out_dir, safe_serialization=True)
    with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
        file_tensors = [{"name": k, "shape": list(f.get_slice(k).get_shape()),
                         "dtype": f.get_slice(k).get_dtype()} for k in sorted(f.keys())]
    assert len(os.listdir(out_dir)) and not any(x.endswith(".index.json") for x in os.listdir(out_dir))

    expected = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1)}
    meta = {
        "family": family,
        "architecture": cls.__name__,
        "inputs": inputs.tolist(),
        "targets": targets.tolist(),
        "adamw": dict(ADAMW, betas=list(ADAMW["betas"])),
        "param_names": spec((n, p.shape) for n, p in model.named_parameters()),
        "file_tensors": file_tensors,
    }
    if getattr(model.config, "layer_types", None) is not None:
        meta["layer_types"] = list(model.config.layer_types)

    model.train()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    opt.zero_grad()
    logits2 = model(input_ids=inputs).logits.float()
    loss2 = torch.nn.functional.cross_entropy(logits2.reshape(-1, V), targets.reshape(-1))
    assert torch.allclose(logits2, logits, atol=1e-6), "train mode (dropouts 0) gives the eval logits"
    loss2.backward()
    opt.step()
    for n, p in model.named_parameters():
        expected["step." + n] = p.detach().float().contiguous()

    save_file(expected, os.path.join(out_dir, "expected.safetensors"))
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(name, "loss", float(loss.detach()), "logit std", float(logits.detach().std()))


make("family-mistral", "mistral", MistralForCausalLM, mistral_config(), 11,
     variants=[("sliding_window 5 -> 1000", {"sliding_window": 1000})])
make("family-qwen2", "qwen2", Qwen2ForCausalLM, qwen2_config(), 12)
make("family-qwen2-bf16", "qwen2", Qwen2ForCausalLM, qwen2_config(), 13, dtype=torch.bfloat16)
make("family-qwen3", "qwen3", Qwen3ForCausalLM, qwen3_config(), 14)
make("family-phi3", "phi3", Phi3ForCausalLM, phi3_config(), 15)
make("family-gemma2", "gemma2", Gemma2ForCausalLM, gemma2_config(), 16,
     variants=[("sliding_window 4 -> 1000", {"sliding_window": 1000}),
               ("softcaps 5, 3 -> None", {"attn_logit_softcapping": None, "final_logit_softcapping": None})])
make("family-gpt2", "gpt2", GPT2LMHeadModel, gpt2_config(), 17)
# Gemma 2 as published sets pad_token_id 0: transformers' embedding (padding_idx) gives that row
# no gradient from its lookups (the tied head's gradient still reaches it).
make("family-gemma2-pad", "gemma2", Gemma2ForCausalLM, gemma2_config(pad_token_id=0), 18, pad=0)
