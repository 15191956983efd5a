#!/usr/bin/env python3
"""Checks a Hugging Face model directory against a fixture's expected logits.

    python3 scripts/check-hf-reload.py DIR FIXTURE_DIR     # needs torch, transformers, safetensors

Loads DIR with `AutoModelForCausalLM.from_pretrained(DIR, attn_implementation="eager",
dtype=torch.float32)`, runs the `inputs` of FIXTURE_DIR/expected.json through it (eval mode) and
prints the largest absolute difference of its logits from FIXTURE_DIR/expected.safetensors'
`logits`. Exits 1 when that difference exceeds 1e-4 (or the shapes differ), 0 otherwise. DIR may be
FIXTURE_DIR itself (difference 0) or a directory a runtime wrote, e.g. a checkpoint of a fixture
exported back to the Hugging Face layout.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

TOLERANCE = 1e-4


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    model_dir, fixture_dir = argv[1], argv[2]
    meta = json.load(open(os.path.join(fixture_dir, "expected.json")))
    want = load_file(os.path.join(fixture_dir, "expected.safetensors"))["logits"].float()
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    model.eval()
    inputs = torch.tensor(meta["inputs"], dtype=torch.long)
    with torch.no_grad():
        got = model(input_ids=inputs).logits.float()
    if got.shape != want.shape:
        print(f"{model_dir}: logits shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        return 1
    diff = float((got - want).abs().max())
    ok = diff <= TOLERANCE
    print(f"{model_dir}: {type(model).__name__} max |logits - expected| = {diff:.3g}"
          f" ({'ok' if ok else 'above ' + str(TOLERANCE)})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
