#!/usr/bin/env bash
# gpu-check.sh: the GPU checks of candle-fsdp, on a CUDA machine with no network and no Rust
# toolchain, from a copy of the repository (data/ included) with the bundle that
# scripts/gpu-bundle.sh built elsewhere (gpu-bundle/: bin/ or bin.tar.xz, MANIFEST.txt).
#
# 1. Finds the CUDA and NCCL libraries already installed: Python environments' nvidia/*/lib
#    (PyTorch's CUDA wheels), torch/lib, /usr/local/cuda, ldconfig (the driver's libcuda.so.1);
#    prints what it found, nvidia-smi, the glibc, and what each binary still lacks (ldd); makes
#    the libnccl.so symlink cudarc's NCCL loader looks for.
# 2. Runs, in order, each under a time limit; a failing stage does not stop the later ones:
#      gpu-tests   the GPU test binary, ignored tests included (kernels against CPU references,
#                  FSDP at world size 1 against plain Candle CUDA, the thread backend with 2 and
#                  4 ranks on one GPU)
#      bandwidth   all-gather / reduce-scatter bandwidth on the GPU (BW_DEVICE=cuda)
#      mnist       one MNIST epoch on the GPU: epoch time, test accuracy (>= 95 % to pass)
#      gpt-f32     GPT bench config steps: step time, tokens/s, MFU against the f32 peak
#      gpt-bf16    the same in bf16 (MFU against the bf16 tensor-core peak), with a Chrome trace
#      nsys        the GPT example under `nsys profile` (NVTX ranges FSDP::...), if nsys exists
# 3. Ends with one summary table (also in $OUTDIR/summary.md); exit 1 if a stage failed.
#
# Environment (all optional):
#   GPU_BUNDLE_DIR        the bundle (default: gpu-bundle/ of the repository)
#   GPU_CHECK_OUT         where logs, the summary, the trace and the nsys report go (default $OUT
#                         when set, else a new folder under /tmp)
#   GPU_CHECK_BUDGET_S    total seconds for the stages (default 480): a stage gets at most its own
#                         limit and what is left; none starts with under 15 s left
#   GPU_CHECK_LIB_DIRS    extra library folders, colon-separated, searched first
#   GPU_CHECK_SITE_PACKAGES  colon-separated site-packages folders to search instead of asking
#                         the Python interpreters found on PATH
#   GPU_CHECK_NO_SYSTEM=1 search neither ldconfig nor /usr/local/cuda (tests of this script)
#   GPU_CHECK_FORCE=1     run the stages even when no GPU is found
#   GPU_CHECK_PEAK_F32_TFLOPS / GPU_CHECK_PEAK_BF16_TFLOPS: the peaks for MFU (default 67 and
#                         989: H200 SXM, FP32 without tensor cores / dense BF16 tensor cores)
# Run by `sh script`: restart under bash (the script uses bash features).
if [ -z "${BASH_VERSION:-}" ]; then exec bash "$0" "$@"; fi
set -euo pipefail
case "${1:-}" in
    -h | --help)
        # The header comment is the help.
        sed -n '2,/^set -euo pipefail/p' "$0" | grep '^#' | grep -v 'Run by .sh script.' | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    "") ;;
    *)
        echo "$(basename "$0"): unknown argument '$1' (it takes none; settings are environment variables, see --help)" >&2
        exit 2
        ;;
esac

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
BUNDLE=${GPU_BUNDLE_DIR:-$REPO/gpu-bundle}
OUTDIR=${GPU_CHECK_OUT:-${OUT:-}}
[ -n "$OUTDIR" ] || OUTDIR=$(mktemp -d /tmp/gpu-check.XXXXXX)
mkdir -p "$OUTDIR/logs"
WORK=$(mktemp -d /tmp/gpu-check-work.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
BUDGET=${GPU_CHECK_BUDGET_S:-480}
PEAK_F32=${GPU_CHECK_PEAK_F32_TFLOPS:-67}
PEAK_BF16=${GPU_CHECK_PEAK_BF16_TFLOPS:-989}
START=$(date +%s)

section() { printf '\n===== %s =====\n' "$*"; }

# ---------------------------------------------------------------------------------------------
# Stage bookkeeping: name, status (PASS / FAIL ... / SKIP), seconds, headline numbers.
NAMES=()
STATUS=()
SECS=()
HEADS=()
record() {
    NAMES+=("$1")
    STATUS+=("$2")
    SECS+=("$3")
    HEADS+=("$4")
}
SKIP_REASON=""

# run_stage NAME LIMIT_S PARSER CMD...: runs CMD (output to the terminal and logs/NAME.log), then
# PARSER LOG prints the headline; a parser that returns nonzero fails a stage whose command
# succeeded (a check on the numbers).
run_stage() {
    local name=$1 limit=$2 parser=$3
    shift 3
    local log=$OUTDIR/logs/$name.log left rc t0 secs head status
    section "stage $name: $*"
    if [ -n "$SKIP_REASON" ]; then
        echo "skipped: $SKIP_REASON"
        record "$name" SKIP 0 "$SKIP_REASON"
        return 0
    fi
    left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt 15 ]; then
        echo "skipped: out of time (budget ${BUDGET} s)"
        record "$name" SKIP 0 "out of time (GPU_CHECK_BUDGET_S=$BUDGET)"
        return 0
    fi
    [ "$limit" -le "$left" ] || limit=$left
    local a
    for a in "$@"; do
        if [[ $a == "$BIN"/* && ! -x $a ]]; then
            echo "$(basename "$a") is not in the bundle"
            record "$name" "FAIL (not in the bundle)" 0 "no $(basename "$a") in the bundle (scripts/gpu-bundle.sh: tests/gpu, benches/bandwidth, examples mnist and gpt)"
            return 0
        fi
    done
    t0=$(date +%s.%N)
    set +e
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    local check=0
    head=$("$parser" "$log") || check=$?
    head=${head//$'\n'/; }
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status="FAIL (timeout ${limit} s)"
    elif [ "$rc" -ne 0 ]; then
        status="FAIL (exit $rc)"
        # The last error line says why, before what the parser found.
        local why
        why=$(grep -iE 'error|panick|not found|failed' "$log" | tail -n 1 | cut -c1-160)
        head=${why}${why:+${head:+; }}${head}
    elif [ "$check" -ne 0 ]; then
        status="FAIL (check)"
    else
        status=PASS
    fi
    record "$name" "$status" "$secs" "$head"
}

# ---------------------------------------------------------------------------------------------
# Parsers: LOG -> one headline line on stdout; return 1 when the numbers fail a check.

parse_tests() {
    local res
    res=$(grep -E '^test result:' "$1" | tail -n 1 | sed 's/^test result: //; s/; finished in.*//')
    local failed
    failed=$(awk '/^failures:$/ { f = 1; next } f && /^    [^ ]/ { printf "%s%s", sep, $1; sep = ", " } /^test result:/ { f = 0 }' "$1")
    echo "${res:-no test result line}${failed:+; failed: $failed}"
    grep -qE '^test result: ok\.' "$1"
}

# The bench's markdown table: | op | ws | size | backend | time (us) | algbw | busbw | memcpy |.
# Headline: busbw of all-gather and reduce-scatter at the largest size, per world size and backend.
parse_bandwidth() {
    awk -F'|' '
        function trim(s) { gsub(/^ +| +$/, "", s); return s }
        NF >= 9 && ($2 ~ /all_gather|reduce_scatter/) {
            op = trim($2); ws = trim($3); size = trim($4); be = trim($5); bus = trim($8)
            n++; OP[n] = op; WS[n] = ws; SZ[n] = size; BE[n] = be; BUS[n] = bus
            if (be ~ /cuda|nccl|gpu/) gpu = 1
            last = size
        }
        END {
            if (!n) { print "no bandwidth table"; exit 1 }
            out = "busbw at " last ":"
            for (i = 1; i <= n; i++)
                if (SZ[i] == last)
                    out = out sprintf("%s %s ws%s %s %s GB/s", (k++ ? ";" : ""), (OP[i] == "all_gather" ? "AG" : "RS"), WS[i], BE[i], BUS[i])
            if (!gpu) { print out " (no CUDA/NCCL backend row: is BW_DEVICE=cuda implemented?)"; exit 1 }
            print out
        }' "$1"
}

# The examples name their device in their first line; a run that never says "cuda" may have
# fallen back to the CPU and must not pass as a GPU measurement.
on_cuda() {
    grep -qi cuda "$1" || { echo "(the run never says it used CUDA)"; return 1; }
}

parse_mnist() {
    local line acc
    line=$(grep -E '^epoch +1 ' "$1" | tail -n 1)
    acc=$(sed -n 's/^final test accuracy \([0-9.]*\)%.*/\1/p' "$1" | tail -n 1)
    if [ -z "$line" ] || [ -z "$acc" ]; then
        echo "no epoch line or final accuracy"
        return 1
    fi
    echo "$line" | sed -E 's/^epoch +1 +//; s/  +/, /g'
    on_cuda "$1" || return 1
    awk -v a="$acc" 'BEGIN { exit !(a >= 95.0) }' || { echo "(accuracy $acc % < 95 %)"; return 1; }
}

# GPT: "GPT: L layers, d D, H heads, context T, ..., N M parameters; ..." and the last loss line
# "... X ms/step  Y tok/s". Model FLOPs per token: 6 N + 12 L d T (PaLM, appendix B: the weights'
# matmuls forward and backward, plus attention's scores and values over the context T).
gpt_parser() { # LOG PEAK_TFLOPS LABEL
    local desc last
    desc=$(grep -m1 '^GPT: ' "$1" || true)
    last=$(grep -E 'ms/step .* tok/s' "$1" | tail -n 1 || true)
    if [ -z "$desc" ]; then
        echo "no 'GPT: ...' line"
        return 1
    elif [ -z "$last" ]; then
        echo "no step line with ms/step and tok/s"
        return 1
    fi
    awk -v desc="$desc" -v last="$last" -v peak="$2" -v label="$3" 'BEGIN {
        L = desc; sub(/^GPT: /, "", L); sub(/ layers.*/, "", L)
        d = desc; sub(/.* d /, "", d); sub(/,.*/, "", d)
        T = desc; sub(/.*context /, "", T); sub(/,.*/, "", T)
        N = desc; sub(/ M parameters.*/, "", N); sub(/.* /, "", N); N *= 1e6
        ms = last; sub(/ ms\/step.*/, "", ms); sub(/.* /, "", ms)
        tok = last; sub(/ tok\/s.*/, "", tok); sub(/.* /, "", tok)
        flops = 6 * N + 12 * L * d * T
        mfu = 100 * tok * flops / (peak * 1e12)
        printf "%.1f M params (%d x d%d, ctx %d): %s ms/step, %s tok/s, %.0f MFLOP/token, MFU %.2f%% of %s TFLOP/s (%s)\n", N / 1e6, L, d, T, ms, tok, flops / 1e6, mfu, peak, label
    }'
    on_cuda "$1"
}
parse_gpt_f32() { gpt_parser "$1" "$PEAK_F32" "H200 FP32"; }
parse_gpt_bf16() {
    local rc=0
    gpt_parser "$1" "$PEAK_BF16" "H200 dense BF16" || rc=$?
    # The Chrome trace's overlap line, when the run wrote one.
    grep -m1 '^trace: ' "$1" | sed -E 's/.*per step: /trace per step: /' || true
    return $rc
}

NSYS_REP=""
parse_nsys() {
    local rep=$NSYS_REP.nsys-rep ranges
    if [ ! -f "$rep" ]; then
        echo "no report $rep"
        return 1
    fi
    ranges=$( { "$NSYS" stats --report nvtx_sum --format csv "$rep" 2>/dev/null \
        || "$NSYS" stats --report nvtxsum --format csv "$rep" 2>/dev/null; } \
        | grep -o 'FSDP::[A-Za-z_]*' | sort | uniq -c | awk '{ printf "%s%s", sep, $2; sep = ", " }')
    echo "$(basename "$rep") ($(du -h "$rep" | cut -f1)); NVTX: ${ranges:-no FSDP:: ranges}"
    [ -n "$ranges" ]
}

# ---------------------------------------------------------------------------------------------
section "bundle"
BIN=${GPU_CHECK_BIN_DIR:-$BUNDLE/bin}
if [ ! -d "$BIN" ] && [ -f "$BUNDLE/bin.tar.xz" ]; then
    echo "unpacking $BUNDLE/bin.tar.xz"
    # tar's xz, else Python's lzma (a machine may lack xz-utils).
    tar -C "$WORK" -xJf "$BUNDLE/bin.tar.xz" 2>/dev/null \
        || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
            "$BUNDLE/bin.tar.xz" "$WORK" \
        || echo "cannot unpack $BUNDLE/bin.tar.xz"
    BIN=$WORK/bin
fi
if [ -f "$BUNDLE/MANIFEST.txt" ]; then
    cat "$BUNDLE/MANIFEST.txt"
fi
if [ -d "$BIN" ]; then
    ls -l "$BIN"
    record bundle PASS 0 "$(find "$BIN" -maxdepth 1 -type f -printf '%f ' | sed 's/ $//')"
else
    echo "no bundle at $BUNDLE: run scripts/gpu-bundle.sh on the build machine and bring gpu-bundle/"
    record bundle FAIL 0 "no bundle at $BUNDLE (scripts/gpu-bundle.sh)"
    SKIP_REASON="no bundle"
fi

# ---------------------------------------------------------------------------------------------
section "CUDA and NCCL libraries"
# site-packages folders of the Python environments on PATH (or GPU_CHECK_SITE_PACKAGES).
site_dirs() {
    if [ -n "${GPU_CHECK_SITE_PACKAGES:-}" ]; then
        tr ':' '\n' <<<"$GPU_CHECK_SITE_PACKAGES"
        return 0
    fi
    {
        for py in python3 python; do
            command -v "$py" >/dev/null 2>&1 || continue
            timeout 30 "$py" -c 'import site, sys
print("\n".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))' 2>/dev/null || true
        done
        for d in "${VIRTUAL_ENV:-}" "${CONDA_PREFIX:-}" /opt/conda /usr/local /usr; do
            if [ -n "$d" ]; then compgen -G "$d/lib/python3*/*-packages" || true; fi
        done
    } | awk 'NF && !seen[$0]++'
}
LIB_DIRS=()
add_dir() {
    local d=$1 x
    [ -d "$d" ] || return 0
    case $d in */stubs | */stubs/) return 0 ;; esac # link stubs, never at run time
    for x in "${LIB_DIRS[@]}"; do [ "$x" = "$d" ] && return 0; done
    LIB_DIRS+=("$d")
}
if [ -n "${GPU_CHECK_LIB_DIRS:-}" ]; then
    IFS=: read -r -a extra <<<"$GPU_CHECK_LIB_DIRS"
    for d in "${extra[@]}"; do add_dir "$d"; done
fi
SITES=()
while read -r sp; do
    [ -d "$sp/nvidia" ] || [ -d "$sp/torch" ] || continue
    SITES+=("$sp")
    for d in "$sp"/nvidia/*/lib "$sp"/nvidia/*/lib64 "$sp"/torch/lib; do add_dir "$d"; done
done < <(site_dirs)
if [ "${GPU_CHECK_NO_SYSTEM:-0}" != 1 ]; then
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64; do
        add_dir "$d"
    done
fi
echo "python environments with CUDA wheels: ${SITES[*]:-none}"
for sp in "${SITES[@]}"; do
    find "$sp" -maxdepth 1 \( -name 'nvidia_*.dist-info' -o -name 'torch-*.dist-info' \) \
        | sed 's,.*/,  ,; s,\.dist-info$,,' | sort
done
echo "library folders searched: ${LIB_DIRS[*]:-none}"

# find_lib NAME: the first folder holding NAME, then ldconfig's cache (the driver's libcuda).
SYSTEM_HITS=""
find_lib() {
    local name=$1 d hit
    if [ "$name" = libcuda.so.1 ] && [ "${GPU_CHECK_NO_SYSTEM:-0}" != 1 ]; then
        hit=$(ldconfig -p 2>/dev/null | awk -v n="$name" '$1 == n { print $NF; exit }')
        if [ -n "$hit" ]; then
            SYSTEM_HITS+=" $name"
            echo "$hit"
            return 0
        fi
    fi
    for d in "${LIB_DIRS[@]}"; do
        [ -e "$d/$name" ] && { echo "$d/$name"; return 0; }
    done
    if [ "${GPU_CHECK_NO_SYSTEM:-0}" != 1 ]; then
        hit=$(ldconfig -p 2>/dev/null | awk -v n="$name" '$1 == n { print $NF; exit }')
        [ -n "$hit" ] && { echo "$hit"; return 0; }
    fi
    return 1
}
# What the binaries link (cudarc dynamic-linking + candle's kernels) and what NVRTC loads.
LIBS=(libcuda.so.1 libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10
    libnvrtc.so.13 libnvrtc-builtins.so.13.0 libnccl.so.2)
MISSING=()
LD_DIRS=()
printf '%-28s %s\n' library found
for lib in "${LIBS[@]}"; do
    if path=$(find_lib "$lib"); then
        printf '%-28s %s\n' "$lib" "$path"
        dir=$(dirname "$path")
        [[ " ${LD_DIRS[*]} " == *" $dir "* ]] || LD_DIRS+=("$dir")
    else
        printf '%-28s %s\n' "$lib" MISSING
        MISSING+=("$lib")
    fi
done
# cudarc's NCCL loader (dynamic loading) asks for libnccl.so, which NCCL wheels do not ship.
NCCL_LINK=$WORK/nccl-link
mkdir -p "$NCCL_LINK"
if path=$(find_lib libnccl.so.2); then
    ln -sf "$path" "$NCCL_LINK/libnccl.so"
    echo "libnccl.so -> $path (in $NCCL_LINK)"
fi
LDP=$NCCL_LINK
for d in "${LD_DIRS[@]}"; do LDP+=":$d"; done
export LD_LIBRARY_PATH=$LDP${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

section "GPU"
GPU=""
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi || true
    GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>/dev/null | head -n 1 || true)
    echo "GPU: ${GPU:-none listed}"
else
    echo "nvidia-smi: not on PATH"
fi
echo "glibc: $(ldd --version 2>&1 | head -n 1)"
NSYS=""
for c in nsys /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/nsight-systems-*/bin/nsys; do
    if command -v "$c" >/dev/null 2>&1; then
        NSYS=$(command -v "$c")
        break
    fi
done
echo "nsys: ${NSYS:-not found}"

# What each binary still lacks, and whether it loads (every symbol bound: a missing NCCL or
# cuBLAS symbol shows here, before any stage).
LOAD_PROBLEMS=()
if [ -d "$BIN" ]; then
    unresolved=0
    for f in "$BIN"/*; do
        nf=$(ldd "$f" 2>&1 | grep -E 'not found' | awk '{ print $1 }' | sort -u | paste -sd' ' - || true)
        if [ -n "$nf" ]; then
            echo "ldd $(basename "$f"): missing $nf"
        else
            echo "ldd $(basename "$f"): all libraries resolved"
        fi
        [ -z "$nf" ] || unresolved=1
        # Only what the search above did not already report missing.
        for l in $nf; do
            [[ " ${MISSING[*]} " == *" $l "* ]] || LOAD_PROBLEMS+=("$(basename "$f") lacks $l")
        done
    done
    probe=$BIN/gpu
    [ -e "$probe" ] || probe=$(find "$BIN" -maxdepth 1 -type f | sort | head -n 1)
    if [ "$unresolved" -eq 0 ] && [ -n "$probe" ]; then
        undef=$(ldd -r "$probe" 2>&1 | grep -E 'undefined symbol' | head -n 5 || true)
        [ -z "$undef" ] || { echo "$undef"; LOAD_PROBLEMS+=("$(echo "$undef" | head -n 1 | tr '\t' ' ')"); }
    fi
fi
if [ ${#MISSING[@]} -eq 0 ] && [ ${#LOAD_PROBLEMS[@]} -eq 0 ]; then
    record libraries PASS 0 "${#LIBS[@]} found; binaries load"
else
    problems=${MISSING[*]:+missing: ${MISSING[*]}}
    for p in "${LOAD_PROBLEMS[@]}"; do problems+="${problems:+; }$p"; done
    record libraries FAIL 0 "$problems"
fi
if [ -z "$GPU" ]; then
    record gpu FAIL 0 "no GPU (nvidia-smi $(command -v nvidia-smi >/dev/null 2>&1 && echo 'lists none' || echo 'not on PATH'))"
    if [ "${GPU_CHECK_FORCE:-0}" != 1 ] && [ -z "$SKIP_REASON" ]; then
        SKIP_REASON="no GPU"
    fi
else
    record gpu PASS 0 "$GPU"
fi

# ---------------------------------------------------------------------------------------------
MNIST_CKPT=$WORK/ckpt-mnist
GPT_ARGS=(--device cuda --world-size 1 --config examples/gpt/bench.toml --max-steps 40
    --log-interval 20 --eval-interval 0 --sample-len 0)

run_stage gpu-tests 240 parse_tests "$BIN/gpu" --include-ignored --test-threads=1
run_stage bandwidth 90 parse_bandwidth env BW_DEVICE=cuda BW_MAX_MIB="${GPU_CHECK_BW_MAX_MIB:-256}" "$BIN/bandwidth"
run_stage mnist 120 parse_mnist "$BIN/mnist" --device cuda --world-size 1 --epochs 1 --checkpoint-dir "$MNIST_CKPT"
run_stage gpt-f32 90 parse_gpt_f32 "$BIN/gpt" "${GPT_ARGS[@]}" --checkpoint-dir "$WORK/ckpt-gpt-f32"
run_stage gpt-bf16 90 parse_gpt_bf16 "$BIN/gpt" "${GPT_ARGS[@]}" --precision bf16 \
    --checkpoint-dir "$WORK/ckpt-gpt-bf16" --trace "$OUTDIR/gpt-bf16-trace.json"
if [ -n "$NSYS" ]; then
    NSYS_REP=$OUTDIR/gpt-nsys
    run_stage nsys 150 parse_nsys "$NSYS" profile --trace=cuda,nvtx --sample=none --cpuctxsw=none \
        --force-overwrite=true -o "$NSYS_REP" "$BIN/gpt" "${GPT_ARGS[@]}" --max-steps 12 \
        --checkpoint-dir "$WORK/ckpt-gpt-nsys"
else
    record nsys SKIP 0 "nsys not on PATH"
fi

# ---------------------------------------------------------------------------------------------
section "summary"
FAILED=0
for st in "${STATUS[@]}"; do
    case $st in FAIL*) FAILED=$((FAILED + 1)) ;; esac
done
{
    echo "gpu-check on $(hostname) $(date -u +%Y-%m-%dT%H:%M:%SZ); GPU: ${GPU:-none}; total $(($(date +%s) - START)) s; logs in $OUTDIR/logs"
    echo
    echo "| stage | status | s | headline |"
    echo "|---|---|---|---|"
    for i in "${!NAMES[@]}"; do
        echo "| ${NAMES[$i]} | ${STATUS[$i]} | ${SECS[$i]} | ${HEADS[$i]//|/\/} |"
    done
} | tee "$OUTDIR/summary.md"
if [ "$FAILED" -gt 0 ]; then
    echo "$FAILED stage(s) failed"
    exit 1
fi
echo "all stages passed or were skipped"
