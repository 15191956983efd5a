"""One training step per decoder family in transformers, for the side-by-side comparison with the
llama example (`benches/pytorch/families.sh`, which runs both).

The families are those of `candle_fsdp::models::decoder` (transformers 5.25 classes), at the
Llama bench size of the issue: 6 layers, hidden 512, 8 heads, 2 key/value heads of 64,
intermediate 1408, vocabulary 256 (bytes are the tokens: the example needs no tokenizer.json),
context 256, batch 4, f32, untied heads except where the family ties by default.

  llama    LlamaForCausalLM
  mistral  MistralForCausalLM   sliding_window 128 (every layer; shorter than the context)
  qwen2    Qwen2ForCausalLM     q/k/v biases (always, in Qwen2), untied
  qwen3    Qwen3ForCausalLM     q/k RMS norms, head_dim 64
  phi3     Phi3ForCausalLM      fused qkv_proj and gate_up_proj (pad_token_id and eos_token_id
                                None: the default 32000 is outside the vocabulary)
  gemma2   Gemma2ForCausalLM    tied, default soft-caps (attention 50, final 30),
                                sliding_window 128 on alternate layers, query_pre_attn_scalar 64;
                                eager attention (transformers refuses sdpa: no soft-cap)
  gpt2     GPT2LMHeadModel      n_embd 512, n_head 8, n_layer 6, n_positions 256, n_inner null
                                (2048), tied; dropouts 0 (the example applies none);
                                bos/eos_token_id None (the default 50256 is outside the vocabulary)

`--size tiny` (or env SIZE=tiny): 2 layers, hidden 64, 4 heads (2 key/value) of 16, intermediate
128, context 32, batch 2, window 16 (half the context, as 128 of 256), query_pre_attn_scalar 16.

  python benches/pytorch/families.py --family qwen3 --save DIR    # config.json + model.safetensors
  python benches/pytorch/families.py --family qwen3 --steps 8     # time 8 steps of a random model
  python benches/pytorch/families.py --family qwen3 --steps 8 --from DIR   # ... of DIR's weights
  torchrun --nproc-per-node 2 benches/pytorch/families.py --family llama --from DIR
      # FSDP2 over gloo: `fully_shard` per decoder layer, then the root; the batch per rank, each
      # rank its own windows, the cores split among the ranks; tokens/s over all ranks

A step as the example's: the inputs are 256 tokens of a window of 257 bytes of the corpus and the
targets the same window shifted by one; forward (`use_cache=False`), the mean cross-entropy of
the logits against the targets, backward, AdamW step (lr 3e-4, betas 0.9/0.95, weight decay 0.1
on the matrices and embeddings, none on norms and biases: the example's groups), zero_grad. The
window is drawn outside the timed part. Attention: `--attn` (default sdpa; a family whose
transformers class refuses it runs eager, and the summary line says so). Threads: all the cores
this process may use (`nproc`; `--threads`). Prints one line per step (`step i/N ... X ms/step`, as gpt.py) and a summary.
"""

import argparse
import gzip
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

SIZES = {
    "bench": dict(layers=6, hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1408, ctx=256, batch=4),
    # The issue-33 QLoRA bench's: a 147 M-parameter Llama, and TinyLlama-1.1B's shape (with the
    # byte vocabulary: 0.97 B parameters).
    "148m": dict(layers=13, hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=2816, ctx=256, batch=4),
    "tinyllama": dict(layers=22, hidden=2048, heads=32, kv_heads=4, head_dim=64, intermediate=5632, ctx=256, batch=1),
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, ctx=32, batch=2),
}
VOCAB = 256
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gpt2"]
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
CORPUS = Path(__file__).resolve().parents[2] / "data" / "shakespeare" / "shakespeare.txt.gz"


def config(family, s):
    """The transformers config of `family` at size `s` (a SIZES entry)."""
    window = s["ctx"] // 2
    llama_like = dict(
        vocab_size=VOCAB,
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        max_position_embeddings=s["ctx"],
    )
    if family == "llama":
        return LlamaConfig(**llama_like, tie_word_embeddings=False)
    if family == "mistral":
        return MistralConfig(**llama_like, tie_word_embeddings=False, sliding_window=window)
    if family == "qwen2":
        return Qwen2Config(**llama_like, tie_word_embeddings=False)
    if family == "qwen3":
        return Qwen3Config(**llama_like, tie_word_embeddings=False)
    if family == "phi3":
        return Phi3Config(**llama_like, tie_word_embeddings=False, pad_token_id=None, eos_token_id=None)
    if family == "gemma2":
        return Gemma2Config(**llama_like, sliding_window=window, query_pre_attn_scalar=s["head_dim"])
    if family == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB,
            n_embd=s["hidden"],
            n_head=s["heads"],
            n_layer=s["layers"],
            n_positions=s["ctx"],
            n_inner=None,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=None,
            eos_token_id=None,
        )
    raise ValueError(f"unknown family {family!r}: one of {FAMILIES}")


def load(family, s, attn, src):
    """The model (from `src`, else random of seed 0) with `attn`, or eager when transformers
    refuses `attn` for it; returns (model, attention used)."""
    for impl in dict.fromkeys([attn, "eager"]):
        try:
            torch.manual_seed(0)
            if src:
                model = AutoModelForCausalLM.from_pretrained(src, attn_implementation=impl, dtype=torch.float32)
            else:
                model = AutoModelForCausalLM.from_config(config(family, s), attn_implementation=impl, dtype=torch.float32)
            return model, impl
        except (ValueError, ImportError) as e:
            if impl == "eager":
                raise
            print(f"{family}: attn_implementation={impl!r} refused ({str(e).split('. ')[0]}); using eager", flush=True)
    raise AssertionError("unreachable")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--family", required=True, choices=FAMILIES)
    p.add_argument("--size", choices=sorted(SIZES), default=os.environ.get("SIZE", "bench"))
    p.add_argument("--save", metavar="DIR", help="write a random model of the family to DIR and exit")
    p.add_argument("--from", dest="src", metavar="DIR", help="time DIR's model (from --save) instead of a fresh one")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the summary's median")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--threads", type=int, default=CORES, help="default: the cores this process may use (nproc)")
    p.add_argument("--batch-size", type=int, help="default: the size's (bench 4, tiny 2)")
    p.add_argument("--seq-len", type=int, help="default: the size's context (bench 256, tiny 32)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="PEFT LoRA of this rank on --lora-targets (the base frozen); 0: full fine-tuning")
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--data", default=str(CORPUS), help="corpus whose bytes are the tokens (plain or .gz); '' for random bytes")
    a = p.parse_args()
    s = SIZES[a.size]

    if a.save:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config(a.family, s), dtype=torch.float32)
        # transformers 5 always writes safetensors (the keyword is accepted and ignored).
        model.save_pretrained(a.save, safe_serialization=True)
        n = sum(p.numel() for p in model.parameters())
        print(f"{type(model).__name__} ({a.size}): {n / 1e6:.2f} M parameters, "
              f"tied {model.config.tie_word_embeddings}, saved to {a.save}")
        return

    ws = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if ws > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    torch.set_num_threads(max(1, a.threads // ws))
    batch = a.batch_size or s["batch"]
    seq = a.seq_len or s["ctx"]
    model, attn = load(a.family, s, a.attn, a.src)
    if a.lora_rank:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=a.lora_rank, lora_alpha=a.lora_alpha, lora_dropout=0.0,
                                                 target_modules=a.lora_targets.split(","), task_type="CAUSAL_LM"))
    if ws > 1:
        from torch.distributed.fsdp import fully_shard

        layers = [m for name, m in model.named_modules()
                  if isinstance(m, torch.nn.ModuleList) and name.split(".")[-1] in ("layers", "h")]
        assert len(layers) == 1, f"one list of decoder layers expected, found {len(layers)}"
        for layer in layers[0]:
            fully_shard(layer)
        fully_shard(model)
    model.train()
    n = sum(p.numel() for p in model.parameters()) * ws
    say = print if rank == 0 else (lambda *args, **kw: None)
    say(f"{type(model).__name__} ({a.size}{', from ' + a.src if a.src else ''}): {n / 1e6:.2f} M parameters, "
          f"tied {model.config.tie_word_embeddings}, attn {attn}, batch {batch} x {seq}", flush=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
    )
    g = torch.Generator().manual_seed(1 + rank)
    if a.data:
        raw = Path(a.data).read_bytes()
        if a.data.endswith(".gz"):
            raw = gzip.decompress(raw)
        corpus = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        assert len(corpus) > seq + 1, f"{a.data}: {len(corpus)} bytes, too few for a window of {seq + 1}"

    def windows():
        if not a.data:
            return torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        starts = torch.randint(0, len(corpus) - seq - 1, (batch,), generator=g)
        return torch.stack([corpus[i : i + seq + 1] for i in starts.tolist()])

    times = []
    for step in range(a.steps):
        ids = windows()
        t0 = time.perf_counter()
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        times.append(dt)
        say(f"step {step + 1:3}/{a.steps}  loss {loss.item():.4f}  {dt * 1e3:.1f} ms/step  {ws * batch * seq / dt:.0f} tok/s", flush=True)
    med = statistics.median(times[a.warmup:] or times)
    say(f"transformers {transformers.__version__} (torch {torch.__version__}) {a.family} attn {attn}, "
        f"{torch.get_num_threads()} thread(s){f', FSDP2 ws {ws}' if ws > 1 else ''}: median step {med * 1e3:.1f} ms, "
        f"{ws * batch * seq / med:.0f} tokens/s")
    if ws > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
