#!/usr/bin/env python3
"""Writes the LoRA fixtures of tests/models/lora.rs with PEFT, on the tiny Llama of
tests/models/fixtures/llama-gqa (4 heads, 2 key/value heads, hidden 32, 2 layers):

    python3 scripts/make-peft-fixture.py     # needs torch, transformers, peft, safetensors

tests/models/fixtures/lora-llama/ holds
  adapter_config.json, adapter_model.safetensors   PEFT's save_pretrained of a LoraConfig(r=4,
      lora_alpha=8, target_modules q_proj, v_proj, o_proj, gate_proj, down_proj, dropout 0),
      with lora_A and lora_B replaced by seeded random values (B nonzero, so the adapter changes
      the logits: asserted)
  expected.json        the inputs and targets of llama-gqa, the AdamW settings, the LoRA config
  expected.safetensors `logits` (B, T, V) and `loss` of the adapted model (eager attention, f32),
      `merged.<name>`: every weight of merge_and_unload() (what a merged export must equal), and
      `step.<PEFT name>`: every adapter tensor after one torch.optim.AdamW step on that loss over
      the adapters only (the base frozen, as PEFT trains it)
"""
import json
import os
import shutil

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models", "fixtures")
BASE = os.path.join(ROOT, "llama-gqa")
OUT = os.path.join(ROOT, "lora-llama")
ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
            lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")


def base_model():
    m = AutoModelForCausalLM.from_pretrained(BASE, torch_dtype=torch.float32, attn_implementation="eager")
    m.config.use_cache = False
    return m


def main():
    torch.manual_seed(0)
    with open(os.path.join(BASE, "expected.json")) as f:
        inputs = json.load(f)
    ids = torch.tensor(inputs["inputs"])
    targets = torch.tensor(inputs["targets"])

    plain = base_model().eval()
    with torch.no_grad():
        base_logits = plain(ids).logits

    model = get_peft_model(base_model(), LoraConfig(**LORA))
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    shutil.rmtree(OUT, ignore_errors=True)
    model.save_pretrained(OUT)
    # A path relative to the fixture (not this machine's), and no model card.
    os.remove(os.path.join(OUT, "README.md"))
    cfg_path = os.path.join(OUT, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["base_model_name_or_path"] = "../llama-gqa"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)

    model.eval()
    V = model.config.vocab_size
    with torch.no_grad():
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    assert (logits - base_logits).abs().max() > 1e-2, "the adapter must change the logits"

    # One AdamW step on the adapters (train mode; dropout is 0).
    model.train()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert all("lora_" in n for n, _ in trainable)
    opt = torch.optim.AdamW([p for _, p in trainable], **ADAMW)
    logits2 = model(ids).logits
    loss2 = torch.nn.functional.cross_entropy(logits2.reshape(-1, V), targets.reshape(-1))
    loss2.backward()
    opt.step()

    out = {"logits": logits.contiguous(), "loss": loss.reshape(1)}
    for n, p in trainable:
        # PEFT's file name: without the adapter name ("default").
        out["step." + n.replace(".default", "")] = p.detach().clone().contiguous()

    # The merged model of the saved (pre-step) adapter.
    merged = PeftModel.from_pretrained(base_model(), OUT).merge_and_unload()  # noqa: the dir's adapter
    for n, p in merged.state_dict().items():
        out["merged." + n] = p.detach().clone().contiguous()
    with torch.no_grad():
        merged_logits = merged.eval()(ids).logits
    assert (merged_logits - logits).abs().max() < 1e-4

    save_file(out, os.path.join(OUT, "expected.safetensors"))
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(dict(inputs, adamw=dict(ADAMW, betas=list(ADAMW["betas"])), lora=LORA), f, indent=1)
    print(f"wrote {OUT}: loss {loss.item():.6f}, {len(trainable)} adapter tensors")


if __name__ == "__main__":
    main()
