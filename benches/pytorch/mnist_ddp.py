"""The MNIST seed recipe in PyTorch DDP, for the side-by-side comparison of BENCHMARKS.md.

The MLP of `candle_fsdp::models::mnist_mlp` (784 -> 128 -> ReLU -> 64 -> ReLU -> 10), AdamW
(lr 1e-3, no weight decay), batch 32 per rank, the training set shuffled per epoch and split
between the ranks (DistributedSampler's rule), from the IDX files in data/mnist/ held in memory
(indexing the tensors directly: the fastest input path PyTorch has), gloo, one thread per
rank. With `--dataloader` the batches come the way the usual recipe writes it instead: a
`DataLoader` over a `TensorDataset` with a `DistributedSampler` (no worker processes).

  torchrun --nproc-per-node 2 benches/pytorch/mnist_ddp.py --epochs 2
  torchrun --nproc-per-node 2 benches/pytorch/mnist_ddp.py --epochs 2 --dataloader

Prints each epoch's time (training only, the epoch's evaluation excluded) and test accuracy.
"""

import argparse
import gzip
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def idx(path):
    with gzip.open(path) as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--data-dir", default="data/mnist")
    p.add_argument("--dataloader", action="store_true")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo")
    d = a.data_dir
    x = torch.from_numpy(idx(f"{d}/train-images-idx3-ubyte.gz").astype(np.float32) / 255.0).reshape(-1, 784)
    y = torch.from_numpy(idx(f"{d}/train-labels-idx1-ubyte.gz").astype(np.int64))
    tx = torch.from_numpy(idx(f"{d}/t10k-images-idx3-ubyte.gz").astype(np.float32) / 255.0).reshape(-1, 784)
    ty = torch.from_numpy(idx(f"{d}/t10k-labels-idx1-ubyte.gz").astype(np.int64))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    if world > 1:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    n = x.shape[0]
    per_rank = n // world
    if a.dataloader:
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

        ds = TensorDataset(x, y)
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(ds, batch_size=a.batch_size, sampler=sampler)

    def batches(epoch):
        if a.dataloader:
            sampler.set_epoch(epoch)
            yield from loader
            return
        g = torch.Generator().manual_seed(epoch)
        order = torch.randperm(n, generator=g)[rank:per_rank * world:world]
        for i in range(0, per_rank, a.batch_size):
            b = order[i : i + a.batch_size]
            yield x[b], y[b]

    for epoch in range(a.epochs):
        t0 = time.perf_counter()
        for bx, by in batches(epoch):
            loss = F.cross_entropy(model(bx), by)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        dt = time.perf_counter() - t0
        with torch.no_grad():
            acc = (model(tx).argmax(1) == ty).float().mean().item() * 100
        if rank == 0:
            how = "DataLoader" if a.dataloader else "indexed tensors"
            print(f"pytorch {torch.__version__} DDP world size {world} ({how}): epoch {epoch + 1} {dt:.2f} s, test accuracy {acc:.2f}%", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
