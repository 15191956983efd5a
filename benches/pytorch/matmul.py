"""f32 matmul throughput of the GPT benchmark step's shapes in PyTorch (MKL/oneDNN) and numpy
(OpenBLAS), on every core: the same shapes as `cargo bench --bench matmul`, for BENCHMARKS.md.

  python benches/pytorch/matmul.py

GFLOP/s = 2·m·n·k / best time of 5 rounds of 5 products (after one warm-up product).
"""

import os
import time

import numpy as np
import torch

SHAPES = [(1024, 512, 1536), (1024, 512, 2048), (1024, 2048, 512), (512, 1024, 2048), (2048, 1024, 512), (1024, 1024, 1024)]


def gflops(f, m, n, k):
    f()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(5):
            f()
        best = min(best, (time.perf_counter() - t0) / 5)
    return 2 * m * n * k / best / 1e9


def main():
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), numpy {np.__version__}")
    for m, k, n in SHAPES:
        a = np.random.rand(m, k).astype(np.float32)
        b = np.random.rand(k, n).astype(np.float32)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        print(f"{m:5} x {k:5} x {n:5}  torch {gflops(lambda: ta @ tb, m, n, k):6.1f}  numpy {gflops(lambda: a @ b, m, n, k):6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
