#!/usr/bin/env bash
# The side-by-side comparison of BENCHMARKS.md ("Against PyTorch"): this crate's examples and
# the same jobs in PyTorch, one after the other in the same window, on an otherwise quiet
# machine. Needs `pip install torch` (any 2.x; the CPU kernels are what is compared) and the
# release examples (`cargo build --release --examples`).
#
#   bash benches/pytorch/compare.sh            # GPT bench config ws 1 and 2, MNIST ws 2, then
#                                              # the Llama bench size ws 1 and 2 against
#                                              # transformers and FSDP2 (families.sh; needs
#                                              # transformers, skipped without it)
#   (build the examples with `--features mpi` to add MNIST under `mpirun -n 2`)
#   ROUNDS=3 bash benches/pytorch/compare.sh   # alternate the two sides three times
#
# GPT: median ms/step of steps 3..N and tokens/s over all ranks (ours: the example's log
# lines; PyTorch: benches/pytorch/gpt.py). MNIST: the training time of epoch 1 (ours: the
# example's epoch line; PyTorch: benches/pytorch/mnist_ddp.py, indexing the tensors directly and
# through a DataLoader). The GPT ratio is our tokens/s over PyTorch's (higher is better); the
# MNIST ratio our epoch time over PyTorch's (lower is better).
set -euo pipefail
cd "$(dirname "$0")/../.."
# SIMD=avx2: both sides held to AVX2 on an AVX-512 CPU, the code a CPU without AVX-512 runs
# (issue 31's targets): PyTorch through ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS and
# ONEDNN_MAX_CPU_ISA, ours through FSDP_SIMD and a build without the `gemm-avx512` feature:
#   CARGO_TARGET_DIR=target-avx2 cargo build --release --no-default-features \
#       --features mnist,gpt,llama,timeline,cli --examples --bin fsdp-run
#   SIMD=avx2 CARGO_TARGET_DIR=target-avx2 bash benches/pytorch/compare.sh
if [ "${SIMD:-}" = avx2 ]; then
    export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 FSDP_SIMD=avx2
elif [ -n "${SIMD:-}" ]; then
    echo "SIMD must be avx2 or unset, found $SIMD" >&2
    exit 2
fi
BIN="${CARGO_TARGET_DIR:-target}/release/examples"
ROUNDS=${ROUNDS:-1}
STEPS=${STEPS:-12}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

median() { sort -n | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
ours_gpt() { # ws
    "$BIN/gpt" --world-size "$1" --config examples/gpt/bench.toml --max-steps "$STEPS" \
        --checkpoint-dir "$TMP/gpt" --eval-batches 1 2>&1 | sed -n 's/^step .* \([0-9.]*\) ms\/step.*/\1/p' \
        | tail -n +3 | median
    rm -rf "$TMP/gpt"
}
torch_gpt() { # ws
    if [ "$1" = 1 ]; then
        python benches/pytorch/gpt.py --steps "$STEPS"
    else
        torchrun --nproc-per-node "$1" benches/pytorch/gpt.py --steps "$STEPS" 2>/dev/null
    fi | sed -n 's/^step .* \([0-9.]*\) ms\/step.*/\1/p' | tail -n +3 | median
}
ours_mnist() { # [mpirun]: one process per rank (an example built with `--features mpi`)
    if [ "${1:-}" = mpirun ]; then
        mpirun --allow-run-as-root --oversubscribe -n 2 "$BIN/mnist" --epochs 1 \
            --checkpoint-dir "$TMP/mnist" 2>&1
    else
        "$BIN/mnist" --world-size 2 --epochs 1 --checkpoint-dir "$TMP/mnist" 2>&1
    fi | sed -n 's/^epoch *1 .*(train \([0-9.]*\)s).*/\1/p' | head -1
    rm -rf "$TMP/mnist"
}
torch_mnist() { # extra args
    torchrun --nproc-per-node 2 benches/pytorch/mnist_ddp.py --epochs 1 "$@" 2>/dev/null \
        | sed -n 's/.*epoch 1 \([0-9.]*\) s.*/\1/p'
}
tok() { awk -v ms="$1" -v ws="$2" 'BEGIN {printf "%.0f", 1024 * ws / (ms / 1000)}'; }

echo "| round | job | PyTorch | candle-fsdp | ratio |"
echo "|---|---|---|---|---|"
for r in $(seq 1 "$ROUNDS"); do
    for ws in 1 2; do
        t=$(torch_gpt "$ws")
        o=$(ours_gpt "$ws")
        echo "| $r | GPT bench ws $ws, tokens/s (ms/step) | $(tok "$t" "$ws") ($t) | $(tok "$o" "$ws") ($o) | $(awk -v t="$t" -v o="$o" 'BEGIN {printf "%.2f×", t / o}') |"
    done
    t=$(torch_mnist)
    d=$(torch_mnist --dataloader)
    o=$(ours_mnist)
    echo "| $r | MNIST ws 2, s/epoch (DDP, indexed tensors, vs FSDP) | $t | $o | $(awk -v t="$t" -v o="$o" 'BEGIN {printf "%.2f×", o / t}') |"
    echo "| $r | MNIST ws 2, s/epoch (DDP, DataLoader, vs FSDP) | $d | $o | $(awk -v t="$d" -v o="$o" 'BEGIN {printf "%.2f×", o / t}') |"
    # One process per rank on both sides (torchrun / mpirun), when the example has MPI.
    if command -v mpirun >/dev/null && m=$(ours_mnist mpirun) && [ -n "$m" ]; then
        echo "| $r | MNIST ws 2, s/epoch (DDP indexed vs FSDP under mpirun -n 2) | $t | $m | $(awk -v t="$t" -v o="$m" 'BEGIN {printf "%.2f×", o / t}') |"
    fi
done
# The Llama bench size (issue 31): transformers' LlamaForCausalLM at world size 1, FSDP2 at 2.
if python -c 'import transformers' 2>/dev/null; then
    echo
    FAMILIES=llama ROUNDS="$ROUNDS" STEPS="$STEPS" bash benches/pytorch/families.sh
    echo
    WS=2 FAMILIES=llama ROUNDS="$ROUNDS" STEPS="$STEPS" bash benches/pytorch/families.sh
fi
