#!/usr/bin/env python3
"""Writes tests/models/fixtures/quant/quant.safetensors, the reference bytes of the packed
frozen-base formats (src/quant.rs), with bitsandbytes' own CPU implementation:

    python3 scripts/make-quant-fixture.py     # needs torch, bitsandbytes (>= 0.45), safetensors

Tensors:
  input          f32 (N,)  N = 64 * 12: ten seeded N(0, s) blocks at scales from 1e-4 to 30,
                 one block with int8 half-way ties (absmax 127, values k + 0.5) and one block
                 whose scaled values sit exactly on the NF4 midpoints (absmax 1)
  nf4.codes      u8 (N/2,) bitsandbytes.functional.quantize_4bit(input, blocksize=64,
                 quant_type="nf4") packed codes (element 2i in the high nibble)
  nf4.absmax     f32 (N/64,) its per-block absmax
  nf4.dequant    f32 (N,)  dequantize_4bit of the two
  int8.codes     i8 (N,)   torch.ops.bitsandbytes.int8_vectorwise_quant on input viewed as
                 (N/64, 64): LLM.int8's row-wise absmax quantisation with each block of 64 a row
  int8.absmax    f32 (N/64,) its row statistics
  int8.dequant   f32 (N,)  bitsandbytes.functional.int8_vectorwise_dequant of the two
"""
import os

import bitsandbytes.functional as F
import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models", "fixtures", "quant")
BLOCK = 64


def main():
    g = torch.Generator().manual_seed(33)
    blocks = [torch.randn(BLOCK, generator=g) * s for s in (1e-4, 1e-3, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 3.0, 30.0)]
    ties = torch.arange(BLOCK, dtype=torch.float32) - 32.0 + 0.5
    ties[0] = 127.0
    blocks.append(ties)
    code = F.get_4bit_type("nf4", device="cpu").float()
    mids = (code[:-1] + code[1:]) / 2
    on_mids = torch.cat([mids, -mids, mids, -mids, mids[:4]])
    on_mids[-1] = 1.0
    blocks.append(on_mids)
    x = torch.cat(blocks).contiguous()
    assert x.numel() % BLOCK == 0

    q4, st = F.quantize_4bit(x, blocksize=BLOCK, quant_type="nf4")
    d4 = F.dequantize_4bit(q4, st)
    q8, stats, _ = torch.ops.bitsandbytes.int8_vectorwise_quant.default(x.view(-1, BLOCK).clone())
    d8 = F.int8_vectorwise_dequant(q8, stats).reshape(-1)
    os.makedirs(OUT, exist_ok=True)
    save_file({
        "input": x,
        "nf4.codes": q4.reshape(-1).contiguous(),
        "nf4.absmax": st.absmax.float().contiguous(),
        "nf4.dequant": d4.reshape(-1).float().contiguous(),
        "int8.codes": q8.reshape(-1).contiguous(),
        "int8.absmax": stats.float().contiguous(),
        "int8.dequant": d8.float().contiguous(),
    }, os.path.join(OUT, "quant.safetensors"))
    print("wrote", OUT, "N =", x.numel(), "max nf4 err", (x - d4.reshape(-1)).abs().max().item(),
          "max int8 err", (x - d8).abs().max().item())


if __name__ == "__main__":
    main()
