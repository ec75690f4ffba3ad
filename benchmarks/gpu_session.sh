#!/usr/bin/env bash
# One call on a GPU machine: every GPU measurement the records need, most needed first, each
# part under its own time limit, everything it wrote packed into $OUT/gpu_session.tar.gz after each
# part (a call cut off keeps what the finished parts measured) and its log in $OUT/session.log.
#
#   OUT=/tmp/out bash benchmarks/gpu_session.sh            # from the repository root, one CUDA GPU
#
#   PARTS="facts allocator" OUT=/tmp/out bash benchmarks/gpu_session.sh   # some parts, in that order
#
# Parts: the device's facts; what the process holds outside the caching allocator, phase by phase and
# with every kernel loaded eagerly (gpu_memory_phases.py); one profiled step of encoder chunking against
# block recomputation (gpu_chunk_profile.py); the caching allocator under memory pressure
# (gpu_allocator.py); the harness's runs with provenance (gpu_figures.py); the LLM-only step against a
# plain bf16 stack, eager and compiled (gpu_llm_stack.py; compilation alone takes minutes); kernels on
# SM shares and side by side, what spatial multiplexing's quota model assumes (gpu_quota_sweep.py).
# OMNIBENCH_GIT_MANIFEST (omnibench/provenance.py
# write_manifest, made at the checkout: `python -c "from omnibench.provenance import write_manifest;
# write_manifest('.prov/manifest.txt')"`) lets every record name its commit and whether any file differs.
set -u
OUT=${OUT:-/tmp/gpu-session-out}
W=/tmp/gpu-session
rm -rf "$W"; mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=200
# a machine given a copy of the tree may carry a .git of an older commit under uncommitted changes:
# the manifest, where every file matches it, names the commit the tree really is
if [ -f .prov/manifest.txt ]; then
  export OMNIBENCH_GIT_MANIFEST=$PWD/.prov/manifest.txt
fi
LOG=$OUT/session.log
: >"$LOG"

part() {  # part NAME LIMIT_S COMMAND...: run, log its tail, pack what is there so far
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout -k 10 "$limit" "$@" >"$W/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$W/$name.log" | tee -a "$LOG"
  echo "== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
  tar -czf "$OUT/gpu_session.tar.gz" -C "$W" . 2>/dev/null
}

# PARTS (space separated, in order) picks what one call runs. Every part stays callable: the NCCL
# communicators' memory as a committed script, the chunked step again after its host synchronisations
# were removed, the compiled LLM stack; the all-gather-KV attention kernels, the LLM-only whole step under
# --mixed-precision master against the plain stack's whole step, the same pair on mixed_video.
# The default: the quota sweep first (spatial multiplexing's quota model has never been measured), then the
# H200's held-out check of the machine model (its kernels are read from this part `kernels`:
# simulator/data/hardware/h200.toml): the CUDA attention tests, the H100's own commands again (the same
# Plans), the kernel sweep, then the default run at the depth 141 GB holds.
PARTS=${PARTS:-"facts quota cuda_tests runs_like_h100 kernels run_default"}
for p in $PARTS; do
  case $p in
  facts) part facts 30 bash -c 'nvidia-smi; python3 -c "
import json, torch
from omnibench.provenance import provenance
print(json.dumps(provenance(torch.cuda.get_device_name(), cuda=True)))
free, total = torch.cuda.mem_get_info()
print(\"mem_get_info after init: free\", free, \"total\", total, \"in use\", total - free)
torch.ones(1, device=\"cuda\") @ torch.ones(1, device=\"cuda\")
free, total = torch.cuda.mem_get_info()
print(\"after a first matmul: in use\", total - free, \"reserved\", torch.cuda.memory_reserved())
"' ;;
  phases_mm) part phases_mm 75 python3 benchmarks/gpu_memory_phases.py --case mm --steps 6 --out "$W/phases" ;;
  phases_mm_eager) part phases_mm_eager 90 env CUDA_MODULE_LOADING=EAGER \
    python3 benchmarks/gpu_memory_phases.py --case mm --steps 6 --tag eager --out "$W/phases" ;;
  phases_omni_default) part phases_omni_default 90 python3 benchmarks/gpu_memory_phases.py --case omni-default \
    --steps 5 --out "$W/phases" ;;
  nccl_memory) part nccl_memory 120 python3 benchmarks/gpu_nccl_memory.py --out "$W/nccl_memory" ;;
  phases_llm) part phases_llm 60 python3 benchmarks/gpu_memory_phases.py --case llm --steps 4 --out "$W/phases" ;;
  chunk_profile) part chunk_profile 120 python3 benchmarks/gpu_chunk_profile.py --out "$W/chunk_profile" ;;
  runs_systems) part runs_systems 180 python3 benchmarks/gpu_figures.py --out "$W/gpu" --steps 5 --no-chunk-runs \
    --no-fit --cells colocated:mixed_video,temporal:mixed_video,homogeneous:mixed_video ;;
  allocator) part allocator 170 python3 benchmarks/gpu_allocator.py --out "$W/allocator" ;;
  runs) part runs 150 python3 benchmarks/gpu_figures.py --out "$W/gpu" --steps 5 --no-chunk-runs --no-fit \
    --cells homogeneous:text_only,omni:mixed_video ;;
  llm_stack) part llm_stack 120 python3 benchmarks/gpu_llm_stack.py --layers 4 --seq 8192 --tokens 16384 --steps 8 \
    --autocast-plain --out "$W/llm_stack" ;;
  runs_more) part runs_more 240 python3 benchmarks/gpu_figures.py --out "$W/gpu" --steps 5 --no-fit \
    --chunk-workloads mixed_video --cells homogeneous:text_only,omni:mixed_video,omni:omni_av,omni:image_sft ;;
  allocator_expandable) part allocator_expandable 90 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    python3 benchmarks/gpu_allocator.py --cases mm --out "$W/allocator-expandable" ;;
  allgather_attention) part allgather_attention 90 python3 benchmarks/gpu_allgather_attention.py \
    --out "$W/allgather_attention" ;;
  llm_stack_master) part llm_stack_master 270 python3 benchmarks/gpu_llm_stack.py --layers 4 --seq 8192 \
    --tokens 16384 --steps 8 --autocast-plain --optimizer --out "$W/llm_stack_master" ;;
  # one system, the CUDA default model, both ways of holding the weights, the recompute the check picked before
  mixed_master) part mixed_master 220 bash -c 'for mp in autocast master; do python3 -m omnibench run \
    --system colocated --workload mixed_video --steps 5 --recompute full --mixed-precision $mp \
    --out '"$W"'/gpu/runs/colocated-mixed_video-$mp --json || exit; done' ;;
  # torch.compile of the plain stack and the harness took more than 3 minutes on an H100 (2026-11-27)
  llm_stack_compile) part llm_stack_compile 330 python3 benchmarks/gpu_llm_stack.py --layers 4 --seq 8192 \
    --tokens 16384 --steps 8 --compile-only --out "$W/llm_stack_compile" ;;
  cuda_tests) part cuda_tests 120 python3 -m pytest -q -p no:cacheprovider -n 0 tests/test_models_attention.py \
    tests/test_llm_allgather_kv.py ;;
  # the commands of the H100 records runs-2026-11-27/homogeneous-text_only and omni-mixed_video, the depth and
  # recompute the memory check picked on 80 GB named, so the H200 runs the same Plans
  runs_like_h100) part runs_like_h100 240 bash -c 'python3 -m omnibench run --system homogeneous \
    --workload text_only --model llm-7b@4L --steps 5 --out '"$W"'/gpu/runs/homogeneous-text_only --json \
    && python3 -m omnibench run --system omni --workload mixed_video --model omni-7b@8L --recompute full \
    --steps 5 --out '"$W"'/gpu/runs/omni-mixed_video-8L --json' ;;
  kernels) mkdir -p "$W/kernels"; part kernels 200 python3 benchmarks/gpu_kernels.py --budget-s 150 --out "$W/kernels/kernels.json" ;;
  quota) mkdir -p "$W/quota"; part quota 180 python3 benchmarks/gpu_quota_sweep.py --out "$W/quota/quota.json" ;;
  run_default) part run_default 200 python3 -m omnibench run --system omni --workload mixed_video --steps 4 \
    --out "$W/gpu/runs/omni-mixed_video" --json ;;
  *) echo "== unknown part $p" | tee -a "$LOG" ;;
  esac
done
echo "== done in $SECONDS s" | tee -a "$LOG"
