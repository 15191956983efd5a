#!/usr/bin/env bash
# One training step per decoder family, transformers beside the llama example, one after the
# other on the same machine (an otherwise quiet one). Needs `pip install torch transformers`
# (5.25: the classes of candle_fsdp::models::decoder) and the release example
# (`cargo build --release --example llama`).
#
#   bash benches/pytorch/families.sh                          # every family, 8 steps each side
#   FAMILIES="llama qwen3" STEPS=12 ROUNDS=3 bash benches/pytorch/families.sh
#   SIZE=tiny STEPS=3 bash benches/pytorch/families.sh         # seconds: checks the script only
#   LOG_DIR=logs bash benches/pytorch/families.sh              # keep each run's full output
#   LORA_RANK=16 FAMILIES=llama bash benches/pytorch/families.sh   # LoRA r 16 on every
#                     # projection, base frozen, both sides (PEFT 0.21 on transformers' side)
#   WS=2 FAMILIES=llama bash benches/pytorch/families.sh       # world size 2: FSDP2 under
#                     # torchrun (gloo, `fully_shard` per layer) against ours as threads and
#                     # under `fsdp-run --nproc-per-node 2` (shared memory); batch per rank
#   BASE_BIN=/other/target/release/examples bash benches/pytorch/families.sh
#                     # also an older build's llama example, alternated with ours in each round
#                     # (before/after a change on the same machine): two more columns
#
# Per family: a random model written once by benches/pytorch/families.py --save (config.json +
# model.safetensors, f32; the bench size: 6 layers, hidden 512, 8 heads, 2 key/value heads of 64,
# intermediate 1408, vocabulary 256 so that bytes are the tokens, context 256), then per round
# transformers' steps on it (families.py --from DIR: sdpa attention, eager where transformers
# refuses sdpa: Gemma 2) and ours (the llama example --from-hf DIR, world size 1, loss lines every
# step, no evaluation or sample inside the steps). Batch 4 × 256 tokens, AdamW lr 3e-4, all
# cores on both sides. Each cell: the median ms/step of steps 3..N and its tokens/s; the ratio
# is our tokens/s over transformers' (higher is better). A side that fails says so in its cell
# (its output's tail goes to stderr) and the table goes on.
set -euo pipefail
cd "$(dirname "$0")/../.."
# SIMD=avx2: both sides held to AVX2 on an AVX-512 CPU, the code a CPU without AVX-512 runs
# (issue 31's targets): PyTorch through ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS and
# ONEDNN_MAX_CPU_ISA, ours through FSDP_SIMD and a build without the `gemm-avx512` feature:
#   CARGO_TARGET_DIR=target-avx2 cargo build --release --no-default-features \
#       --features mnist,gpt,llama,timeline,cli --examples --bin fsdp-run
#   SIMD=avx2 CARGO_TARGET_DIR=target-avx2 bash benches/pytorch/families.sh
if [ "${SIMD:-}" = avx2 ]; then
    export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 FSDP_SIMD=avx2
elif [ -n "${SIMD:-}" ]; then
    echo "SIMD must be avx2 or unset, found $SIMD" >&2
    exit 2
fi
BIN="${CARGO_TARGET_DIR:-target}/release/examples"
FAMILIES=${FAMILIES:-llama mistral qwen2 qwen3 phi3 gemma2 gpt2}
ROUNDS=${ROUNDS:-1}
STEPS=${STEPS:-8}
WS=${WS:-1}
export SIZE=${SIZE:-bench}
case "$SIZE" in
    bench) SEQ=256 BATCH=4 ;;
    tiny) SEQ=32 BATCH=2 ;;
    *) echo "SIZE must be bench or tiny, found $SIZE" >&2; exit 2 ;;
esac
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
[ -n "${LOG_DIR:-}" ] && mkdir -p "$LOG_DIR"
[ -x "$BIN/llama" ] || echo "note: no $BIN/llama (cargo build --release --example llama): our cells will say failed" >&2

median() { sort -n | awk '{a[NR] = $1} END {if (NR) print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
steps_median() { sed -n 's/^\(\[rank 0\] \)\{0,1\}step .* \([0-9.]*\) ms\/step.*/\2/p' "$1" | tail -n +3 | median; }
name() {
    case "$1" in
        llama) echo Llama ;; mistral) echo Mistral ;; qwen2) echo Qwen2 ;; qwen3) echo Qwen3 ;;
        phi3) echo Phi-3 ;; gemma2) echo "Gemma 2" ;; gpt2) echo GPT-2 ;; *) echo "$1" ;;
    esac
}
# run LOG CMD...: CMD's output into LOG (and LOG_DIR); on failure its tail to stderr.
run() {
    local log=$1 rc=0
    shift
    "$@" >"$log" 2>&1 || rc=$?
    [ -n "${LOG_DIR:-}" ] && cp "$log" "$LOG_DIR/"
    if [ "$rc" != 0 ]; then
        { echo "--- $* (exit $rc):"; tail -n 5 "$log"; } >&2
    fi
    return "$rc"
}
LORA_TARGETS=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
theirs_lora=() ours_lora=()
if [ "${LORA_RANK:-0}" != 0 ]; then
    theirs_lora=(--lora-rank "$LORA_RANK" --lora-alpha 16 --lora-targets "$LORA_TARGETS")
    ours_lora=(--lora-rank "$LORA_RANK" --lora-alpha 16 --lora-targets "$LORA_TARGETS")
fi
theirs() { # family dir log
    local launch=(python)
    [ "$WS" != 1 ] && launch=(torchrun --nproc-per-node "$WS")
    run "$3" "${launch[@]}" benches/pytorch/families.py --family "$1" --from "$2" --steps "$STEPS" "${theirs_lora[@]}"
}
ours() { # dir log [bin dir] [fsdp-run]: threads, or one process per rank under fsdp-run (shm)
    rm -rf "$TMP/ckpt"
    local launch=() ws=(--world-size "$WS")
    if [ "${4:-}" = fsdp-run ]; then
        launch=("$(dirname "$BIN")/fsdp-run" --nproc-per-node "$WS" --)
        ws=()
    fi
    run "$2" "${launch[@]}" "${3:-$BIN}/llama" --from-hf "$1" "${ws[@]}" --seq-len "$SEQ" --batch-size "$BATCH" \
        --max-steps "$STEPS" --log-interval 1 --eval-interval 0 --eval-batches 1 --sample-len 0 \
        --checkpoint-dir "$TMP/ckpt" "${ours_lora[@]}"
}
cell() { # ms: "ms (tok/s)", or "failed"
    if [ -n "$1" ]; then
        awk -v ms="$1" -v n=$((BATCH * SEQ * WS)) 'BEGIN {printf "%s (%.0f)", ms, n / (ms / 1000)}'
    else
        echo failed
    fi
}

if [ "$WS" != 1 ]; then
    echo "| family | transformers FSDP2 ws $WS ms/step (tok/s) | candle-fsdp threads ms/step (tok/s) | ratio | candle-fsdp under fsdp-run (shm) ms/step (tok/s) | ratio |"
    echo "|---|---|---|---|---|---|"
elif [ -n "${BASE_BIN:-}" ]; then
    echo "| family | transformers ms/step (tok/s) | candle-fsdp ms/step (tok/s) | ratio (our tok/s / theirs) | baseline build ms/step (tok/s) | ours / baseline (tok/s) |"
    echo "|---|---|---|---|---|---|"
else
    echo "| family | transformers ms/step (tok/s) | candle-fsdp ms/step (tok/s) | ratio (our tok/s / theirs) |"
    echo "|---|---|---|---|"
fi
for f in $FAMILIES; do
    dir="$TMP/$f"
    if ! run "$TMP/$f.save.log" python benches/pytorch/families.py --family "$f" --save "$dir"; then
        echo "| $(name "$f") | model not written | | |"
        continue
    fi
    for r in $(seq 1 "$ROUNDS"); do
        t="" o="" attn="?"
        theirs "$f" "$dir" "$TMP/$f.transformers.$r.log" && t=$(steps_median "$TMP/$f.transformers.$r.log")
        attn=$(sed -n 's/^transformers .* attn \([a-z_]*\),.*/\1/p' "$TMP/$f.transformers.$r.log")
        ours "$dir" "$TMP/$f.ours.$r.log" && o=$(steps_median "$TMP/$f.ours.$r.log")
        extra=""
        if [ "$WS" != 1 ]; then
            p=""
            ours "$dir" "$TMP/$f.fsdp-run.$r.log" "$BIN" fsdp-run && p=$(steps_median "$TMP/$f.fsdp-run.$r.log")
            pratio="—"
            [ -n "$t" ] && [ -n "$p" ] && pratio=$(awk -v t="$t" -v o="$p" 'BEGIN {printf "%.2f×", t / o}')
            extra=" $(cell "$p") | $pratio |"
        elif [ -n "${BASE_BIN:-}" ]; then
            bs=""
            ours "$dir" "$TMP/$f.base.$r.log" "$BASE_BIN" && bs=$(steps_median "$TMP/$f.base.$r.log")
            bratio="—"
            [ -n "$bs" ] && [ -n "$o" ] && bratio=$(awk -v b="$bs" -v o="$o" 'BEGIN {printf "%.2f×", b / o}')
            extra=" $(cell "$bs") | $bratio |"
        fi
        label="$(name "$f") (${attn:-?})"
        [ "$ROUNDS" -gt 1 ] && label="$label, round $r"
        if [ -n "$t" ] && [ -n "$o" ]; then
            ratio=$(awk -v t="$t" -v o="$o" 'BEGIN {printf "%.2f×", t / o}')
        else
            ratio="—"
        fi
        echo "| $label | $(cell "$t") | $(cell "$o") | $ratio |$extra"
    done
done
echo
echo "SIZE $SIZE, world size $WS, batch $BATCH × $SEQ tokens per rank, $STEPS steps (median of steps 3..$STEPS), $(nproc) cores;" \
    "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -1);" \
    "flags: $(lscpu | sed -n 's/^Flags: *//p' | tr ' ' '\n' | grep -E 'avx|fma|amx' | tr '\n' ' ' | sed 's/ $//');" \
    "$(python -c 'import torch, transformers; print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), transformers {transformers.__version__}")' 2>/dev/null)${SIMD:+; SIMD=$SIMD (ours: FSDP_SIMD=$SIMD)}"
