#!/usr/bin/env bash
# The layering rules of design/README.md ("Modules"), checked over the source's `use` lines and
# paths: a lower layer never names a higher one. Run by .ci/run; prints each violation with its
# file and line and exits 1 if there is one.
#
#   bash scripts/check-layers.sh
set -euo pipefail
cd "$(dirname "$0")/.."

fail=0
# never FROM_GLOB PATTERN WHY: no file matching FROM_GLOB (under src/) may contain PATTERN.
never() {
    local from=$1 pattern=$2 why=$3 hits
    # shellcheck disable=SC2086
    hits=$(grep -rnHE --include='*.rs' "$pattern" $from 2>/dev/null | grep -vE '^\S+:[0-9]+:\s*//' || true)
    if [ -n "$hits" ]; then
        echo "layering: $why"
        echo "$hits" | sed 's/^/    /'
        fail=1
    fi
}

never "src/comm" 'crate::(launch|fsdp|optim|checkpoint|data|models|nn)\b' \
    "comm/ is below launch/, fsdp/ and everything beside the step"
# NCCL's bootstrap (nccl/meet.rs) exchanges the root id over MPI under mpirun: the one use of a
# backend by another, the way torch's NCCL group meets over a store.
for backend in threads shm tcp mpi nccl; do
    others=$(echo threads shm tcp mpi nccl | tr ' ' '\n' | grep -vx "$backend" | paste -sd '|')
    files="src/comm/$backend"
    if [ "$backend" = nccl ]; then
        files=$(ls src/comm/nccl/*.rs | grep -v meet.rs | tr '\n' ' ')
        never "src/comm/nccl/meet.rs" "(comm|super)::(threads|shm|tcp)\\b" \
            "NCCL's bootstrap uses MPI (mpirun) or the store, no other backend"
    fi
    never "$files" "(comm|super)::($others)\\b" \
        "a comm backend names no other backend: what they share is comm/engine/ (issue 34)"
done
never "src/kernels" 'crate::(ops|fsdp|flat_param|comm|launch|optim|checkpoint|nn|device|cuda)\b' \
    "kernels/ is a leaf: it imports nothing of the crate but error"
never "src/nn" 'crate::(fsdp|models|optim|checkpoint|launch|comm)\b' \
    "nn/ is the layer library and its kernels: fused nodes that use the runtime's seam (fsdp::fused) live with their models (decision 72) or, general-purpose ones, in fsdp/fused/ (decision 88)"
never "src/quant.rs" 'crate::(ops|fsdp|flat_param|comm|launch|optim|checkpoint|nn|models)\b' \
    "quant.rs is a leaf: storage formats over slices"
never "src/flat_param.rs" 'crate::(ops|fsdp|comm)\b' \
    "flat_param.rs is data: no ops, no runtime"
never "src/checkpoint" 'crate::data::(DistributedSampler|BatchLoader|loader|mnist|text)\b|DistributedSampler' \
    "checkpoint/ stores the sampler's state (a value, data::SamplerState) without knowing the sampler"
never "src/checkpoint" 'crate::(models|hf)\b' \
    "checkpoint/ is the format: the Hugging Face code (hf/) and the models sit above it (issue 34)"
never "src/models src/models.rs" 'crate::(hf|checkpoint)\b' \
    "the models hand their names, shapes and configs to hf/ as values; they read and write no files"
never "src" 'crate::cuda\b' \
    "the GPU plumbing has one path, crate::device::cuda (the former alias crate::cuda is gone)"
never "src/fsdp/call.rs" '(super|crate::fsdp)::model\b' \
    "the call nodes reach the runtime through the CallBackward trait, not the model"
never "src/nn src/ops src/ops.rs src/optim src/optim.rs src/clip.rs src/grad_scaler.rs src/checkpoint src/comm src/launch src/data src/models src/models.rs" \
    '^\s*impl(<[^>]*>)?\s+FsdpModel\b' \
    "only fsdp/ implements FsdpModel"
never "src/fsdp/scheduler.rs src/fsdp/step.rs" '\bFsdpModel\b' \
    "the scheduler answers questions and the step is data: neither names the model (no circle model -> scheduler/step -> model)"
never "src/models/decoder/layers.rs" '\bfused::' \
    "the decoder's layers are composed Candle code: the block's fused node builds on them, not the reverse"
never "src/optim src/optim.rs src/clip.rs src/grad_scaler.rs" '\.(span|at)\(' \
    "beside-the-step modules use FsdpModel::in_phase, not the model's private span/at"

if [ "$fail" -ne 0 ]; then
    exit 1
fi
echo "layering: all rules hold"
