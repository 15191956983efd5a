#!/usr/bin/env bash
# Training-step and memory-scaling benchmarks of BENCHMARKS.md: the two examples run as whole
# jobs, one process per rank under mpirun (so each rank's peak RSS is its process's VmHWM), and
# their own output is turned into markdown tables.
#
#   cargo build --release --features mpi --examples
#   bash benches/scaling.sh step      # MNIST MLP and GPT (bench config) at world sizes 1, 2, 4
#   bash benches/scaling.sh memory    # 152 M-parameter GPT at world sizes 1, 2, 4, 8
#   BATCH=4 SEQ=256 WS="1 2" bash benches/scaling.sh memory   # PyTorch reference's batch shape
#   EXTRA=--activation-checkpointing BATCH=4 SEQ=256 WS="1 2" bash benches/scaling.sh memory
#
# Step times are the mean of the steps after the first two (warm-up); peak memory is the
# largest per-rank peak RSS of the job. Needs mpirun (OpenMPI) and `--features mpi` binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${CARGO_TARGET_DIR:-target}/release/examples"
MPIRUN=(mpirun --allow-run-as-root --oversubscribe)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# Largest "peak RSS N B" of a job's output, in MiB.
peak_mib() { sed -n 's/.*peak RSS \([0-9]*\) B.*/\1/p' | sort -n | tail -1 | awk '{printf "%.0f", $1 / 1048576}'; }
# Mean ms/step of the GPT log lines after the first two.
gpt_ms() { sed -n 's/^step .* \([0-9.]*\) ms\/step.*/\1/p' | tail -n +3 | awk '{s += $1; n++} END {printf "%.0f", s / n}'; }

gpt() { # ws extra-args...
    local ws=$1
    shift
    "${MPIRUN[@]}" -n "$ws" "$BIN/gpt" --checkpoint-dir "$TMP/ckpt-$ws" --sample-len 0 \
        --eval-batches 1 "$@" 2>&1
    rm -rf "$TMP/ckpt-$ws"
}

case "${1:-step}" in
step)
    echo "| job | ws | step (ms) | throughput (all ranks) | peak RSS per rank (MiB) |"
    echo "|---|---|---|---|---|"
    for ws in 1 2 4; do
        out=$("${MPIRUN[@]}" -n "$ws" "$BIN/mnist" --epochs 1 --checkpoint-dir "$TMP/mnist-$ws" 2>&1)
        rm -rf "$TMP/mnist-$ws"
        secs=$(echo "$out" | sed -n 's/.*(train \([0-9.]*\)s).*/\1/p' | head -1)
        steps=$(( (60000 + 32 * ws - 1) / (32 * ws) ))
        ms=$(awk -v s="$secs" -v n="$steps" 'BEGIN {printf "%.2f", 1000 * s / n}')
        sps=$(awk -v s="$secs" 'BEGIN {printf "%.0f", 60000 / s}')
        echo "| MNIST MLP, batch 32/rank | $ws | $ms | $sps samples/s | $(echo "$out" | peak_mib) |"
    done
    for ws in 1 2 4; do
        out=$(gpt "$ws" --config examples/gpt/bench.toml --max-steps 8 --log-interval 1)
        ms=$(echo "$out" | gpt_ms)
        tps=$(awk -v m="$ms" -v w="$ws" 'BEGIN {printf "%.0f", w * 4 * 256 / (m / 1000)}')
        echo "| GPT 6L d512 (19.3 M), 4×256/rank | $ws | $ms | $tps tokens/s | $(echo "$out" | peak_mib) |"
    done
    ;;
memory)
    echo "| ws | plan per rank (MiB) | of which sharded state | measured peak RSS per rank (MiB) | step (ms) |"
    echo "|---|---|---|---|---|"
    for ws in ${WS:-1 2 4 8}; do
        out=$(gpt "$ws" --n-layer 12 --d-model 1024 --n-head 16 --seq-len "${SEQ:-128}" --batch-size "${BATCH:-1}" \
            --untied --max-steps 3 --log-interval 1 --max-memory-per-rank 100000000000 \
            --warmup-steps 1 ${EXTRA:-})
        plan=$(echo "$out" | sed -n 's/^memory plan: \([0-9]*\) B.*/\1/p' | awk '{printf "%.0f", $1 / 1048576}')
        sharded=$(echo "$out" | sed -n 's/.*parameter shards \([0-9]*\) + gradient shards \([0-9]*\) + optimizer state \([0-9]*\).*/\1 \2 \3/p' | head -1 | awk '{printf "%.0f", ($1 + $2 + $3) / 1048576}')
        ms=$(echo "$out" | sed -n 's/^step .* \([0-9.]*\) ms\/step.*/\1/p' | tail -1)
        echo "| $ws | $plan | $sharded | $(echo "$out" | peak_mib) | $ms |"
    done
    ;;
*)
    echo "usage: $0 step|memory" >&2
    exit 2
    ;;
esac
