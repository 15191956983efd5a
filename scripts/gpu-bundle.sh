#!/usr/bin/env bash
# gpu-bundle.sh: builds the GPU-path binaries here (no GPU needed) and puts them, stripped, in
# gpu-bundle/ for scripts/gpu-check.sh to run on a CUDA machine that has no Rust toolchain and
# no network.
#
# Built with `--features cuda,nccl,nvtx` by the CUDA 13.0 toolchain of scripts/cuda-toolchain.sh:
#   gpu        the GPU test binary (tests/gpu/; its tests are #[ignore]d, run with --ignored)
#   bandwidth  the collectives bandwidth bench (benches/bandwidth.rs; BW_DEVICE=cuda)
#   mnist      the MNIST example (--device cuda)
#   gpt        the GPT example (--device cuda)
#   fsdp-run   the torchrun-style launcher, when the crate has it
# A target missing from the crate is left out with a warning (the manifest says so).
#
# The bundle: gpu-bundle/bin/<name> and gpu-bundle/MANIFEST.txt (commit, toolchain, each
# binary's size, sha256, needed libraries and newest glibc symbol). It must travel with the
# repository (which carries data/) within 64 MiB: over GPU_BUNDLE_MAX_MIB (default 40) of
# binaries, bin/ is packed into bin.tar.xz instead (each binary carries Candle's ~45 MB of CUDA
# kernels, which xz finds again across binaries), which gpu-check.sh unpacks.
#
# Use:  scripts/gpu-bundle.sh        (CARGO_TARGET_DIR is honoured)
#       then on the GPU machine, from a copy of the repository with gpu-bundle/:
#       scripts/gpu-check.sh
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

log() { printf '[gpu-bundle] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
BUNDLE=${GPU_BUNDLE_DIR:-$REPO/gpu-bundle}
MAX_MIB=${GPU_BUNDLE_MAX_MIB:-40}
FEATURES=cuda,nccl,nvtx

CUDA_ENV=$(scripts/cuda-toolchain.sh) || die "scripts/cuda-toolchain.sh failed"
eval "$CUDA_ENV"

# name in the bundle <- cargo target (kind:name); optional ones are skipped when absent.
declare -A WANT=(
    [gpu]="test:gpu"
    [bandwidth]="bench:bandwidth"
    [mnist]="example:mnist"
    [gpt]="example:gpt"
    [fsdp-run]="bin:fsdp-run"
)
args=()
missing=()
for name in gpu bandwidth mnist gpt fsdp-run; do
    kind=${WANT[$name]%%:*}
    target=${WANT[$name]#*:}
    case $kind in
        test) src=tests/$target.rs; [ -e "$src" ] || src=tests/$target/main.rs ;;
        bench) src=benches/$target.rs; [ -e "$src" ] || src=benches/$target/main.rs ;;
        example) src=examples/$target.rs; [ -e "$src" ] || src=examples/$target/main.rs ;;
        bin) src=src/bin/$target.rs; [ -e "$src" ] || src=src/bin/$target/main.rs ;;
    esac
    if [ -e "$src" ]; then
        args+=("--$kind" "$target")
    else
        log "warning: no $kind target '$target' in the crate: no '$name' in the bundle"
        missing+=("$name (no $kind target '$target')")
        unset "WANT[$name]"
    fi
done
[ ${#args[@]} -gt 0 ] || die "nothing to build"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
log "cargo build --release --features $FEATURES ${args[*]}"
t0=$(date +%s)
cargo build --release --features "$FEATURES" "${args[@]}" \
    --message-format=json-render-diagnostics >"$TMP/build.json" \
    || die "cargo build failed"
log "built in $(($(date +%s) - t0)) s"

# kind:name -> executable, from cargo's artifact messages.
python3 - "$TMP/build.json" >"$TMP/exes.txt" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    print("%s:%s %s" % (m["target"]["kind"][0], m["target"]["name"], m["executable"]))
PY

if [ -d "$BUNDLE" ] && [ -n "$(ls -A "$BUNDLE")" ] && [ ! -e "$BUNDLE/MANIFEST.txt" ]; then
    die "$BUNDLE exists and is not a bundle: not overwriting it"
fi
rm -rf "${BUNDLE:?}"
mkdir -p "$BUNDLE/bin"
for name in "${!WANT[@]}"; do
    exe=$(awk -v k="${WANT[$name]}" '$1 == k { print $2 }' "$TMP/exes.txt" | tail -n 1)
    [[ -n "$exe" && -x "$exe" ]] || die "cargo reported no executable for ${WANT[$name]}"
    cp "$exe" "$BUNDLE/bin/$name"
    strip --strip-all "$BUNDLE/bin/$name"
done

# The manifest.
{
    echo "# candle-fsdp GPU bundle (scripts/gpu-bundle.sh); run scripts/gpu-check.sh on the GPU machine"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (working tree modified)')"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(ldd --version 2>&1 | head -n 1)"
    echo "features: $FEATURES"
    echo "rustc: $(rustc --version)"
    echo "nvcc: $(nvcc --version | sed -n 's/.*release \([0-9.]*\), \(V[0-9.]*\).*/\1 (\2)/p')"
    echo "cudarc: $(awk '/^name = "cudarc"$/ { getline; gsub(/[^0-9.]/, ""); print; exit }' Cargo.lock)"
    echo "compute capability the kernels were built for: ${CUDA_COMPUTE_CAP:-?} (Candle's kernels; ours are NVRTC-compiled at run time)"
    for m in "${missing[@]}"; do echo "missing: $m"; done
    echo
    echo "| binary | bytes | sha256 | needed libraries | newest glibc | NCCL functions it imports |"
    echo "|---|---|---|---|---|---|"
    for f in "$BUNDLE"/bin/*; do
        needed=$(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | paste -sd' ' -)
        glibc=$(objdump -T "$f" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -n 1)
        nccl=$(nm -D --undefined-only "$f" | awk '$2 ~ /^nccl/ { print $2 }' | paste -sd' ' -)
        echo "| $(basename "$f") | $(stat -c %s "$f") | $(sha256sum "$f" | cut -c1-16)… | $needed | $glibc | ${nccl:--} |"
    done
    echo
    echo "Binaries are linked with BIND_NOW: every imported function must exist in the GPU"
    echo "machine's libraries (an older libnccl.so.2 lacking one fails at start; gpu-check's ldd -r shows it)."
} >"$BUNDLE/MANIFEST.txt"

total=$(du -cb "$BUNDLE"/bin/* | tail -n 1 | cut -f1)
log "binaries: $((total >> 20)) MiB stripped (limit ${MAX_MIB} MiB)"
if [ "$total" -gt $((MAX_MIB << 20)) ]; then
    # Each binary carries Candle's CUDA kernels (~33 MB of fatbin, ~10 MB of PTX): identical
    # bytes that xz's 64 MiB window finds again from one binary to the next.
    log "packing into bin.tar.xz (xz -9, a few minutes on 2 cores)"
    t0=$(date +%s)
    tar -C "$BUNDLE" -cf - bin | xz -9 -T1 >"$BUNDLE/bin.tar.xz"
    rm -rf "${BUNDLE:?}/bin"
    packed=$(stat -c %s "$BUNDLE/bin.tar.xz")
    log "packed in $(($(date +%s) - t0)) s: $((packed >> 20)) MiB"
    echo "packed: bin.tar.xz, $packed bytes (gpu-check.sh unpacks it)" >>"$BUNDLE/MANIFEST.txt"
    [ "$packed" -le $((MAX_MIB << 20)) ] || die "the bundle is $((packed >> 20)) MiB even packed, over ${MAX_MIB} MiB"
fi
cat "$BUNDLE/MANIFEST.txt" >&2
log "bundle ready: $BUNDLE ($(du -sh "$BUNDLE" | cut -f1))"
