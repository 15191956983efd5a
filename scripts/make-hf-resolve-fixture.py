#!/usr/bin/env python3
"""Writes the fixtures of how a Hugging Face directory is resolved (issue 30): which weights file
wins and when a head is tied, each as transformers' `from_pretrained` decides it.

    python3 scripts/make-hf-resolve-fixture.py      # needs torch, transformers, safetensors

Under tests/models/fixtures/ (one decoder layer, f32, as scripts/make-hf-fixture.py's shapes):
  resolve-tied-differs/     config says tie_word_embeddings: true, model.safetensors holds an
                            lm_head.weight that differs from model.embed_tokens.weight (a head
                            trained untied, saved with the flag left on): transformers keeps both
  resolve-tied-head-only/   tie_word_embeddings: true and only lm_head.weight: transformers ties
                            the embedding to the head (the embedding takes the head's values)
  resolve-single-and-index/ model.safetensors (weights A) beside another model's
                            model.safetensors.index.json and shards (weights B): transformers
                            loads the single file
  resolve-index-missing/    model.safetensors (A) beside an index whose shards are missing:
                            transformers loads the single file
Each gets `expected.json` (the inputs, the targets and what transformers decided: `tied`, whether
the loaded head is the embedding's storage; `loaded`, which weights it computed with) and
`expected.safetensors` (`logits` (B, T, V) and `loss`, computed by the model transformers loaded).
"""
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models", "fixtures")
B, T, V = 2, 12, 64


def config(**kw):
    base = dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, hidden_act="silu",
    )
    base.update(kw)
    return LlamaConfig(**base)


def random_state(seed, cfg):
    """Every parameter of an untied model of `cfg`, N(0, 0.2) (norms around 1), by HF name."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config(**{**cfg.to_dict(), "tie_word_embeddings": False}))
    out = {}
    for n, p in model.named_parameters():
        out[n] = (torch.randn_like(p) * 0.2 + (1.0 if "norm" in n else 0.0)).contiguous()
    return out


def fresh(name):
    out = os.path.join(ROOT, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    return out


def write_config(out, cfg):
    d = cfg.to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)


def expect(out, seed, loaded):
    """Loads `out` with transformers, records its decisions and its logits and loss."""
    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    inputs, targets = ids[:, :T], ids[:, 1:]
    with torch.no_grad():
        logits = model(input_ids=inputs).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    save_file({"logits": logits.contiguous(), "loss": loss.reshape(1)},
              os.path.join(out, "expected.safetensors"))
    meta = {"inputs": inputs.tolist(), "targets": targets.tolist(), "tied": tied, "loaded": loaded}
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(os.path.basename(out), "tied" if tied else "untied", "loaded", loaded, "loss", float(loss))
    return model


# 1. The flag says tied, the file holds a head of its own.
cfg = config(tie_word_embeddings=True)
out = fresh("resolve-tied-differs")
write_config(out, cfg)
state = random_state(11, cfg)
assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
m = expect(out, 11, "model.safetensors")
assert torch.equal(m.lm_head.weight, state["lm_head.weight"]), "transformers kept the file's head"

# 2. The flag says tied, the file holds only the head.
out = fresh("resolve-tied-head-only")
write_config(out, cfg)
state = random_state(12, cfg)
del state["model.embed_tokens.weight"]
save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
m = expect(out, 12, "model.safetensors")
assert torch.equal(m.model.embed_tokens.weight, state["lm_head.weight"]), "embedding = head"

# 3. A single file (A) beside another model's index and shards (B).
cfg = config()
out = fresh("resolve-single-and-index")
write_config(out, cfg)
a, b = random_state(13, cfg), random_state(14, cfg)
save_file(a, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
names = sorted(b)
half = len(names) // 2
parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
weight_map = {}
for file, ns in parts.items():
    save_file({n: b[n] for n in ns}, os.path.join(out, file), metadata={"format": "pt"})
    weight_map.update({n: file for n in ns})
total = sum(t.numel() * 4 for t in b.values())
with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
m = expect(out, 13, "model.safetensors")
assert torch.equal(m.model.norm.weight, a["model.norm.weight"]), "transformers loaded A"

# 4. The single file beside an index whose shards are missing.
out4 = fresh("resolve-index-missing")
write_config(out4, cfg)
shutil.copy(os.path.join(out, "model.safetensors"), out4)
shutil.copy(os.path.join(out, "model.safetensors.index.json"), out4)
m = expect(out4, 13, "model.safetensors")
assert torch.equal(m.model.norm.weight, a["model.norm.weight"]), "transformers loaded A"
# The same inputs as case 3 (same seed): the same logits.
assert torch.equal(load_file(os.path.join(out, "expected.safetensors"))["logits"],
                   load_file(os.path.join(out4, "expected.safetensors"))["logits"])
