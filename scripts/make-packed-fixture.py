#!/usr/bin/env python3
"""Writes tests/models/fixtures/packed/: what transformers computes for sequences that pack several
examples (position ids restarting at 0 at each example, no attention mask), for the existing tiny
fixtures of tests/models/fixtures/.

    python3 scripts/make-packed-fixture.py     # needs torch, transformers, safetensors

transformers (>= 4.53, masking_utils.find_packed_sequence_indices) treats a sequence whose position
ids restart as several examples when no attention mask is given: each token attends only to the
earlier tokens of its own example (and within the sliding window, where the layer has one), and its
rotary angles (GPT-2: its learned position) are taken at its position id (only without a cache:
the forwards here pass use_cache=False, as training does). This is what
DataCollatorWithFlattening and TRL's padding-free packing feed the model.

For each fixture F (llama-gqa, family-mistral with its window of 5, family-gemma2 with its window,
soft-caps and sandwich norms, family-qwen3, family-phi3, family-gpt2), packed/F.safetensors holds
  ids        (2, 12) int64   random token ids (seeded)
  positions  (2, 12) int64   row 0: examples of 5 and 7 tokens; row 1: 3, 6 and 3
  logits     (2, 12, V) f32  the model's logits of ids at positions (eval mode, eager attention)
The script asserts that each example's logits equal those of the example run alone (so the packing
was honoured) within 1e-5, and that they differ from the unpacked forward's by more than 1e-3 (so the
fixture tells packing from no packing).
"""
import os

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models", "fixtures")
FIXTURES = ["llama-gqa", "family-mistral", "family-gemma2", "family-qwen3", "family-phi3", "family-gpt2"]
ROWS = [[5, 7], [3, 6, 3]]
T = 12


def main():
    torch.manual_seed(0)
    positions = torch.tensor([[p for n in row for p in range(n)] for row in ROWS])
    assert positions.shape == (len(ROWS), T)
    out_dir = os.path.join(ROOT, "packed")
    os.makedirs(out_dir, exist_ok=True)
    for name in FIXTURES:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.join(ROOT, name), attn_implementation="eager", dtype=torch.float32
        ).eval()
        v = model.config.vocab_size
        ids = torch.randint(0, v, positions.shape)
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
            plain = model(input_ids=ids, use_cache=False).logits
            for b, row in enumerate(ROWS):
                start = 0
                for n in row:
                    alone = model(input_ids=ids[b : b + 1, start : start + n]).logits[0]
                    got = logits[b, start : start + n]
                    d = (alone - got).abs().max().item()
                    assert d < 1e-5, f"{name}: example at ({b}, {start}) differs from alone by {d}"
                    start += n
        later = (plain[:, 5:] - logits[:, 5:]).abs().max().item()
        assert later > 1e-3, f"{name}: packing changes the logits by only {later}"
        save_file(
            {"ids": ids.contiguous(), "positions": positions.contiguous(), "logits": logits.contiguous()},
            os.path.join(out_dir, f"{name}.safetensors"),
        )
        print(f"{name}: packed logits written; unpacked differ by {later:.3g}")


if __name__ == "__main__":
    main()
