#!/usr/bin/env bash
# cuda-toolchain.sh: a CUDA 13.0 build toolchain for `--features cuda,nccl,nvtx` on a machine
# with no GPU and no CUDA installed (this project's development and CI machines).
#
# What it does
#   1. Downloads pinned CUDA 13.0 wheels from PyPI with pip (nvcc, nvvm/cicc, crt, cudart, cccl,
#      nvrtc; hashes checked) and unpacks them into one toolkit root (bin/, include/, lib/, nvvm/).
#      13.0 because cudarc 0.19 accepts CUDA 11.4-13.4 only, and the CUDA 12 "nvcc" wheels lack
#      the nvcc driver and cicc (measured: shared/notes/gpu-build.md).
#   2. Generates link stubs, shared libraries with the real SONAMEs, for the libraries no wheel
#      here ships and that cudarc's `dynamic-linking` links against: libcuda.so.1,
#      libcublas.so.13, libcublasLt.so.13, libcurand.so.10 and libnccl.so.2. Their functions are
#      the ones cudarc's own `src/*/sys/mod.rs` declares; every status-returning stub returns an
#      error (cu*: 100 = CUDA_ERROR_NO_DEVICE; cuBLAS: NOT_INITIALIZED; cuRAND:
#      INITIALIZATION_FAILED; NCCL: ncclUnhandledCudaError), so a binary run here fails cleanly
#      ("no device") instead of pretending to succeed. NVRTC and the CUDA runtime are the real
#      libraries from the wheels: tests can compile kernels to PTX here without a GPU.
#   3. Prints on stdout only the `export ...` lines to use (logs go to stderr).
#
# Why: Candle 0.11's `cuda` feature compiles its kernels with nvcc at build time and links the
# CUDA libraries dynamically; the GPU machine has the real ones (driver, PyTorch's wheels).
# The stubs are only for linking and for running CPU-side code of CUDA-feature binaries here:
# never put this LD_LIBRARY_PATH on a machine with a GPU.
#
# Cache: everything lives outside the repository under
#   ${CANDLE_FSDP_CUDA_CACHE:-$HOME/.cache/candle-fsdp/cuda-13.0}
#   (wheels/ ~190 MB downloaded, root/ ~490 MB unpacked, env.sh the printed exports).
# A second run finds the stamp and only prints the exports (offline, instant). Delete the folder
# to start over. Needs: python3 with pip, a C compiler (cc), cargo (to locate cudarc's sources).
#
# Use:
#   eval "$(scripts/cuda-toolchain.sh)"
#   cargo build --release --features cuda,nccl,nvtx
#   cargo test --release --features cuda,nccl,nvtx      # GPU tests are #[ignore]d
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

log() { printf '[cuda-toolchain] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${CANDLE_FSDP_CUDA_CACHE:-$HOME/.cache/candle-fsdp/cuda-13.0}
PYTHON=${PYTHON:-python3}

# Pinned wheels: name==version and the sha256 of the manylinux x86_64 wheel (checked by pip
# on download and again before unpacking a cached one).
WHEELS=(
    "nvidia-cuda-nvcc==13.0.88 56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03"
    "nvidia-nvvm==13.0.88 c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0"
    "nvidia-cuda-crt==13.0.88 2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4"
    "nvidia-cuda-runtime==13.0.96 7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548"
    "nvidia-cuda-cccl==13.0.85 e0da7ad981f3a8aff08241b5bfc1af868742a63e2762f53a5171c492ef242649"
    "nvidia-cuda-nvrtc==13.0.88 ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575"
)
# Bump when the stub generator or the layout changes: the stamp then no longer matches.
LAYOUT_VERSION=1

ROOT=$CACHE/root
STUBS=$ROOT/lib/stubs
ENV_FILE=$CACHE/env.sh

print_env() {
    local threads
    threads=$(nproc 2>/dev/null || echo 2)
    cat <<EOF
export CUDA_ROOT="$ROOT"
export CUDA_PATH="$ROOT"
export CUDA_HOME="$ROOT"
export CUDA_TOOLKIT_ROOT_DIR="$ROOT"
export PATH="$ROOT/bin:\${PATH}"
export CUDA_COMPUTE_CAP=90
export CUDAFORGE_THREADS=$threads
export LIBRARY_PATH="$STUBS:$ROOT/lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$STUBS:$ROOT/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
EOF
}

# The cudarc version Candle links (from Cargo.lock) and its sources in cargo's registry.
cudarc_src() {
    local ver dir
    ver=$(awk '/^name = "cudarc"$/ { getline; gsub(/[^0-9.]/, "", $0); print; exit }' "$REPO/Cargo.lock" 2>/dev/null || true)
    [ -n "$ver" ] || ver=0.19.10
    local reg=${CARGO_HOME:-$HOME/.cargo}/registry/src
    dir=$(find "$reg" -maxdepth 2 -type d -name "cudarc-$ver" 2>/dev/null | head -n 1 || true)
    if [ -z "$dir" ]; then
        log "cudarc-$ver sources not in $reg: cargo fetch"
        (cd "$REPO" && cargo fetch >&2) || die "cargo fetch failed"
        dir=$(find "$reg" -maxdepth 2 -type d -name "cudarc-$ver" | head -n 1 || true)
    fi
    [ -n "$dir" ] || die "cannot find cudarc-$ver sources under $reg"
    printf '%s\n' "$dir"
}

CUDARC=$(cudarc_src)
STAMP_WANT=$(printf '%s\n' "layout=$LAYOUT_VERSION" "cudarc=$(basename "$CUDARC")" "${WHEELS[@]}")
if [ -f "$CACHE/.stamp" ] && [ "$(cat "$CACHE/.stamp")" = "$STAMP_WANT" ] && [ -x "$ROOT/bin/nvcc" ]; then
    log "cached toolchain at $ROOT"
    print_env
    exit 0
fi

command -v "$PYTHON" >/dev/null || die "$PYTHON not found (needed for pip)"
command -v cc >/dev/null || die "no C compiler (cc) for the link stubs"
mkdir -p "$CACHE/wheels"

# 1. Wheels: download only the missing ones (pip download is not offline-idempotent by itself).
wheel_file() { # name version -> the cached wheel's path, or nothing
    compgen -G "$CACHE/wheels/${1//-/_}-${2}-*.whl" | head -n 1 || true
}
REQ=$CACHE/wheels/requirements.txt
: >"$REQ"
for w in "${WHEELS[@]}"; do
    read -r spec sha <<<"$w"
    [ -n "$(wheel_file "${spec%%==*}" "${spec##*==}")" ] || echo "$spec --hash=sha256:$sha" >>"$REQ"
done
if [ -s "$REQ" ]; then
    log "downloading $(wc -l <"$REQ") wheel(s) from PyPI: $(cut -d' ' -f1 "$REQ" | tr '\n' ' ')"
    t0=$(date +%s)
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
        -d "$CACHE/wheels" -r "$REQ" >&2 || die "pip download failed"
    log "downloaded in $(($(date +%s) - t0)) s"
fi

# 2. Unpack into a fresh folder, then move it into place (an interrupted run leaves no half root).
TMP=$(mktemp -d "$CACHE/unpack.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
log "checking and unpacking the wheels into $ROOT"
wheel_files=()
for w in "${WHEELS[@]}"; do
    read -r spec sha <<<"$w"
    f=$(wheel_file "${spec%%==*}" "${spec##*==}")
    [ -n "$f" ] || die "wheel for $spec missing after download"
    echo "$sha  $f" | sha256sum --quiet -c - >&2 || die "$f: sha256 mismatch (delete it to download again)"
    wheel_files+=("$f")
done
# zipfile with the mode bits the wheels record (plain `extractall` drops the executable bits).
"$PYTHON" - "$TMP/x" "${wheel_files[@]}" <<'PY'
import os, sys, zipfile
dest = sys.argv[1]
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = z.extract(info, dest)
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                os.chmod(path, mode)
PY
[ -d "$TMP/x/nvidia/cu13" ] || die "the wheels have no nvidia/cu13 folder (layout changed?)"
mv "$TMP/x/nvidia/cu13" "$TMP/root"
R=$TMP/root
# Some wheels record no mode bits: make the compiler's programs executable regardless.
find "$R/bin" "$R/nvvm/bin" -maxdepth 1 -type f -exec chmod a+x {} + 2>/dev/null || true
[ -x "$R/bin/nvcc" ] || die "no bin/nvcc in the unpacked wheels"
# Unversioned names for the linker (-lcudart, -lnvrtc): the wheels ship only the SONAMEs.
for lib in cudart nvrtc; do
    so=$(find "$R/lib" -maxdepth 1 -name "lib$lib.so.[0-9]*" -printf '%f\n' | sort | head -n 1)
    [ -n "$so" ] || die "no lib$lib.so.* in the wheels"
    [ -e "$R/lib/lib$lib.so" ] || ln -s "$so" "$R/lib/lib$lib.so"
done

# 3. Link stubs from cudarc's declarations (the `extern "C" { fn NAME(...) -> RET; }` lines).
mkdir -p "$R/lib/stubs"
"$PYTHON" - "$CUDARC" "$R/lib/stubs" >"$TMP/stubs.txt" <<'PY'
import os, re, sys
cudarc, out = sys.argv[1], sys.argv[2]
# module -> (SONAME, error code for the status type it returns)
LIBS = {
    "driver":   ("libcuda.so.1",      100),  # CUDA_ERROR_NO_DEVICE
    "cublas":   ("libcublas.so.13",   1),    # CUBLAS_STATUS_NOT_INITIALIZED
    "cublaslt": ("libcublasLt.so.13", 1),    # CUBLAS_STATUS_NOT_INITIALIZED
    "curand":   ("libcurand.so.10",   203),  # CURAND_STATUS_INITIALIZATION_FAILED
    "nccl":     ("libnccl.so.2",      1),    # ncclUnhandledCudaError
}
decl = re.compile(r"^\s+fn ([A-Za-z_][A-Za-z0-9_]*)\((.*)\)(?: -> (.+))?;$")
for mod, (soname, code) in LIBS.items():
    seen, lines = set(), [
        "/* Link stub generated by scripts/cuda-toolchain.sh from cudarc's src/%s/sys/mod.rs. */" % mod,
        "/* Every status-returning function fails with %d: there is no GPU here. */" % code,
        'static const char msg[] = "%s link stub: no CUDA device or library on this machine";' % soname,
    ]
    with open(os.path.join(cudarc, "src", mod, "sys", "mod.rs")) as f:
        for line in f:
            m = decl.match(line)
            if not m or m.group(1) in seen:
                continue
            name, ret = m.group(1), (m.group(3) or "").strip()
            seen.add(name)
            if not ret:
                lines.append("void %s(void) {}" % name)
            elif ret == "*const ::core::ffi::c_char":
                lines.append("const char *%s(void) { return msg; }" % name)
            elif ret.startswith("*"):
                lines.append("void *%s(void) { return 0; }" % name)
            elif ret in ("usize", "u64", "i64", "isize"):
                lines.append("long %s(void) { return 0; }" % name)  # versions, sizes
            else:
                lines.append("int %s(void) { return %d; }" % (name, code))
    if len(seen) < 10:
        sys.exit("only %d functions found in cudarc's %s module" % (len(seen), mod))
    with open(os.path.join(out, mod + ".c"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("%s %s %d" % (mod, soname, len(seen)))
PY
while read -r mod soname count; do
    cc -shared -fPIC -O0 -fno-builtin -w -Wl,-soname,"$soname" -o "$R/lib/stubs/$soname" "$R/lib/stubs/$mod.c" \
        || die "cannot build the $soname stub"
    ln -sf "$soname" "$R/lib/stubs/${soname%%.so.*}.so"
    log "stub $soname: $count functions"
done <"$TMP/stubs.txt"

# 4. Check: nvcc runs and says 13.0 (cudarc parses this line).
"$R/bin/nvcc" --version | grep -q 'release 13\.0' || die "nvcc --version does not say release 13.0"

rm -rf "$ROOT"
mv "$R" "$ROOT"
printf '%s\n' "$STAMP_WANT" >"$CACHE/.stamp"
print_env >"$ENV_FILE"
log "toolchain ready at $ROOT ($(du -sh "$ROOT" | cut -f1)); exports also in $ENV_FILE"
print_env
