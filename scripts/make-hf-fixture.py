#!/usr/bin/env python3
"""Writes the tiny random Hugging Face Llama fixtures of tests/models/ (issue 23).

    python3 scripts/make-hf-fixture.py            # needs torch, transformers, safetensors

Under tests/models/fixtures/ it writes, each a Hugging Face model directory (config.json + weights as
`save_pretrained` writes them):
  llama-mha/          2 layers, 4 heads, 4 key/value heads, untied, f32, one model.safetensors
  llama-mha-index/    the same weights, sharded: model.safetensors.index.json + 4 files (no
                      expected values: the test compares it with llama-mha)
  llama-gqa/          4 heads, 2 key/value heads, bf16 weights (the reference computes in f32
                      with the bf16-rounded values, which is what loading gives)
  llama-tied/         tied embeddings, attention_bias and mlp_bias, f32
  llama3-rope/        4 heads, 2 key/value heads, Llama 3's rotary scaling (rope_type "llama3")
llama-mha also gets a character-level `tokenizer.json` (64 symbols, made with the `tokenizers`
package) and `eval.txt` (the start of the shipped Shakespeare, filtered to those symbols), whose
`--eval-file` loss at `--seq-len 16` (consecutive windows, a last partial one dropped) is
expected.json's `eval`;
and for each variant an `expected.safetensors` with what transformers computed in f32:
`logits` (B, T, V) of the `ids` in expected.json's inputs, `loss` (the mean next-token
cross-entropy against the targets), and for llama-mha `step.<name>`: every parameter after one
`torch.optim.AdamW` step on that loss (lr, betas, eps, weight_decay in expected.json).
"""
import json
import os

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models", "fixtures")
B, T, V = 2, 12, 64
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def config(**kw):
    base = dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, hidden_act="silu",
    )
    base.update(kw)
    return LlamaConfig(**base)


ALPHABET = list("abcdefghijklmnopqrstuvwxyz") + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ") + list(" .,;:!?'\n-()")
EVAL_SEQ_LEN = 16


def add_tokenizer_and_eval(name, cfg, seed):
    import gzip
    from tokenizers import Tokenizer, decoders, models

    assert len(ALPHABET) == V
    out_dir = os.path.join(ROOT, name)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(ALPHABET)}, merges=[]))
    tok.decoder = decoders.Fuse()  # characters joined as they are (not with spaces)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    corpus = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "shakespeare", "shakespeare.txt.gz")
    text = gzip.open(corpus, "rt").read()[:2000]
    text = "".join(c for c in text if c in ALPHABET)[:700]
    with open(os.path.join(out_dir, "eval.txt"), "w") as f:
        f.write(text)
    ids = tok.encode(text).ids
    assert ids == [ALPHABET.index(c) for c in text], "character-level tokens"
    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    n = (len(ids) - 1) // EVAL_SEQ_LEN
    t = torch.tensor(ids)
    x = torch.stack([t[w * EVAL_SEQ_LEN:(w + 1) * EVAL_SEQ_LEN] for w in range(n)])
    y = torch.stack([t[w * EVAL_SEQ_LEN + 1:(w + 1) * EVAL_SEQ_LEN + 1] for w in range(n)])
    with torch.no_grad():
        logits = model(input_ids=x).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
    path = os.path.join(out_dir, "expected.json")
    meta = json.load(open(path))
    meta["eval"] = {"seq_len": EVAL_SEQ_LEN, "tokens": len(ids), "windows": n, "loss": float(loss)}
    json.dump(meta, open(path, "w"), indent=1)
    print(name, "eval loss", float(loss), "over", n, "windows")


def make(name, cfg, seed, dtype=torch.float32, shard=None, step=False, expect=True):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            # Larger than the default init (0.02) so that every layer matters in the logits;
            # norm scales around 1.
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in n else 0.0))
            if dtype != torch.float32:
                p.copy_(p.to(dtype).float())
    model.eval()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    inputs, targets = ids[:, :T], ids[:, 1:]
    logits = model(input_ids=inputs).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    out_dir = os.path.join(ROOT, name)
    os.makedirs(out_dir, exist_ok=True)
    save = model.to(dtype)
    kw = {"max_shard_size": shard} if shard else {}
    save.save_pretrained(out_dir, safe_serialization=True, **kw)
    save.float()
    expected = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1)}
    meta = {"inputs": inputs.tolist(), "targets": targets.tolist()}
    if step:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        opt.zero_grad()
        logits = model(input_ids=inputs).logits.float()
        loss2 = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
        loss2.backward()
        opt.step()
        for n, p in model.named_parameters():
            expected["step." + n] = p.detach().float().contiguous()
        meta["adamw"] = dict(ADAMW, betas=list(ADAMW["betas"]))
    if not expect:
        print(name, "weights only")
        return
    save_file(expected, os.path.join(out_dir, "expected.safetensors"))
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(name, "loss", float(loss), "logit std", float(logits.std()))


make("llama-mha", config(), 1, step=True)
add_tokenizer_and_eval("llama-mha", config(), 1)
make("llama-mha-index", config(), 1, shard="30KB", expect=False)
make("llama-gqa", config(num_key_value_heads=2), 2, dtype=torch.bfloat16)
make("llama-tied", config(tie_word_embeddings=True, attention_bias=True, mlp_bias=True), 3)
# Llama 3's rotary scaling: with head_dim 8 and rope_theta 1e4 the wavelengths are 6.3, 63, 628
# and 6283 positions; against original_max_position_embeddings 64 (low 1, high 4: bounds 16 and
# 64) the first is kept, the second smoothed, the last two divided by the factor.
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)
make("llama3-rope", config(num_key_value_heads=2, max_position_embeddings=128, rope_parameters=LLAMA3_ROPE), 4)
