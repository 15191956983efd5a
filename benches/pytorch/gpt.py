"""The GPT benchmark configuration in PyTorch, for the side-by-side comparison of BENCHMARKS.md.

The same model as `candle_fsdp::models::gpt` at `examples/gpt/bench.toml` (6 pre-norm blocks,
d 512, 8 heads, context 256, vocabulary 256, untied head, GELU tanh, biases on every linear but
the head), AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1 on weight matrices and embeddings),
batch 4 x 256 random bytes per rank, f32, eager mode, causal attention through
`F.scaled_dot_product_attention` (PyTorch's fused CPU kernel).

  python benches/pytorch/gpt.py --steps 12                       # world size 1, 2 threads
  torchrun --nproc-per-node 2 benches/pytorch/gpt.py --steps 12  # FSDP FULL_SHARD, gloo, 1 thread/rank

Under torchrun each rank gets cores / world size threads (torchrun's OMP_NUM_THREADS rule) and
the model is wrapped in FSDP (FULL_SHARD, one unit per block, `use_orig_params`). Prints one
line per step and a summary: median step time over the steps after `--warmup`, tokens/s over
all ranks.
"""

import argparse
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, vocab=256, n_layer=6, d=512, h=8, seq_len=256):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n_layer))
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1])
        x = self.wte(ids) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.head(self.lnf(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    a = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(0)
    model = Gpt(seq_len=a.seq_len)
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        dist.init_process_group("gloo")
        model = FSDP(
            model,
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
    )
    g = torch.Generator().manual_seed(1 + rank)
    times = []
    for step in range(a.steps):
        ids = torch.randint(0, 256, (a.batch_size, a.seq_len + 1), generator=g)
        t0 = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        times.append(dt)
        if rank == 0:
            tok = a.batch_size * a.seq_len * world / dt
            print(f"step {step + 1:3}/{a.steps}  loss {loss.item():.4f}  {dt * 1e3:.1f} ms/step  {tok:.0f} tok/s", flush=True)
    if rank == 0:
        med = statistics.median(times[a.warmup:])
        tok = a.batch_size * a.seq_len * world / med
        print(f"pytorch {torch.__version__} gpt bench world size {world} ({torch.get_num_threads()} thread(s)/rank): "
              f"median step {med * 1e3:.1f} ms, {tok:.0f} tokens/s")
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
