#!/usr/bin/env bash
# Issue 33's QLoRA table: a Llama fine-tuned fully and with LoRA r 16 on all seven projections
# over an f32, bf16, int8 and NF4 frozen base (--base-dtype), at several world sizes (ranks as
# threads of one process). Per run: the runtime's own per-rank accounting (parameter +
# gradient shards, optimizer state, peak unsharded parameters; `FsdpModel::memory_stats`), the
# last step's all-gather and reduce-scatter bytes per rank (`FsdpModel::comm_stats`), the
# process's peak RSS (all its ranks), and the median ms/step of steps 3..N with tokens/s.
#
#   python3 benches/pytorch/families.py --family llama --size 148m --save /tmp/m148
#   cargo build --release --example llama
#   MODEL=/tmp/m148 bash benches/qlora.sh                       # ws 1 2 4, every mode
#   MODEL=/tmp/tl WS="2" MODES="f32 nf4" BATCH=1 STEPS=3 bash benches/qlora.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${CARGO_TARGET_DIR:-target}/release/examples"
: "${MODEL:?MODEL=DIR, a Hugging Face directory (benches/pytorch/families.py --save)}"
WS=${WS:-1 2 4}
MODES=${MODES:-full f32 bf16 int8 nf4}
STEPS=${STEPS:-5}
BATCH=${BATCH:-4}
SEQ=${SEQ:-256}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
LORA=(--lora-rank 16 --lora-alpha 16 --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)

mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
echo "| ws | run | params+grads per rank (MiB) | optimizer per rank (MiB) | peak unsharded (MiB) | all-gather per rank per step (MiB) | reduce-scatter (MiB) | process peak RSS, all ranks (MiB) | ms/step | tokens/s |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for ws in $WS; do
    for mode in $MODES; do
        case $mode in
            full) extra=() ;;
            *) extra=("${LORA[@]}" --base-dtype "$mode") ;;
        esac
        out=$("$BIN/llama" --from-hf "$MODEL" --world-size "$ws" --batch-size "$BATCH" --seq-len "$SEQ" \
            --max-steps "$STEPS" --log-interval 1 --eval-interval 0 --eval-batches 1 --sample-len 0 \
            --warmup-steps 1 --checkpoint-dir "$TMP/ck" "${extra[@]}" 2>&1) || {
            echo "| $ws | $mode | failed: $(echo "$out" | tail -1) |"
            continue
        }
        rm -rf "$TMP/ck"
        mem=$(echo "$out" | sed -n 's/.*sharded state \([0-9]*\) B (+ optimizer \([0-9]*\) B), peak unsharded parameters \([0-9]*\) B.*/\1 \2 \3/p')
        read -r sharded optim peak <<<"$mem"
        traffic=$(echo "$out" | sed -n "s/.*all-gather \([0-9]*\) B in .* reduce-scatter \([0-9]*\) B.*/\1 \2/p")
        read -r ag rs <<<"$traffic"
        rss=$(echo "$out" | sed -n 's/.*peak RSS \([0-9]*\) B.*/\1/p' | sort -n | tail -1)
        ms=$(echo "$out" | sed -n 's/^step .* \([0-9.]*\) ms\/step.*/\1/p' | tail -n +3 | sort -n | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}')
        tps=$(awk -v m="$ms" -v w="$ws" -v b="$BATCH" -v t="$SEQ" 'BEGIN {printf "%.0f", w * b * t / (m / 1000)}')
        echo "| $ws | $mode | $(mib "$sharded") | $(mib "$optim") | $(mib "$peak") | $(mib "$ag") | $(mib "$rs") | $(mib "$rss") | $ms | $tps |"
    done
done
