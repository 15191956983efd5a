#!/usr/bin/env python3
"""The PyTorch side of benches/qlora.sh: LoRA r 16 on all seven projections of a Hugging Face
Llama (benches/pytorch/families.py --save), PEFT 0.21 on transformers, FSDP2 (`fully_shard` per
decoder layer, then the root) over gloo, AdamW on the adapters, batch 4 x 256 per rank:

    torchrun --nproc-per-node 2 benches/pytorch/fsdp2_lora.py --from /tmp/m148 --steps 5
    python3 benches/pytorch/fsdp2_lora.py --from /tmp/m148 --steps 5      # one process, no FSDP

Prints per step the loss and ms, then the median ms/step of steps 3..N, tokens/s over all
ranks, and each rank's peak RSS (the process's VmHWM).
"""
import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--from", dest="src", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lora-rank", type=int, default=16)
    a = p.parse_args()
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if ws > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // ws))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a.src, dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=a.lora_rank, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    if ws > 1:
        from torch.distributed.fsdp import fully_shard
        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    model.train()
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=3e-4)
    g = torch.Generator().manual_seed(1 + rank)
    vocab = model.config.vocab_size
    times = []
    for step in range(a.steps):
        ids = torch.randint(0, vocab, (a.batch_size, a.seq_len + 1), generator=g)
        t0 = time.perf_counter()
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        times.append(dt)
        if rank == 0:
            print(f"step {step + 1}/{a.steps} loss {loss.item():.4f} {dt * 1e3:.1f} ms/step", flush=True)
    med = statistics.median(times[2:] or times)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"rank {rank}: peak RSS {rss:.0f} MiB", flush=True)
    if rank == 0:
        print(f"torch {torch.__version__} ws {ws}: median step {med * 1e3:.1f} ms, "
              f"{ws * a.batch_size * a.seq_len / med:.0f} tokens/s", flush=True)
    if ws > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
