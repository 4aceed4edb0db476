#!/usr/bin/env bash
# The tests and benchmarks that need an NVIDIA GPU, from the repository root:
#   bash scripts/gpu_check.sh STAGE...        e.g. bash scripts/gpu_check.sh kernel-tests tests bench
# It installs minirt (editable), writes the GPU, its driver and the torch and triton versions to
# $OUT/gpu.txt, then runs the stages in the order given:
# tests:        runtime, CLI, README, embedding, MoE model, first-run, untrusted-input and V4 runtime tests
#               with CUDA tensors (tiny and v4-tiny presets)
# kernel-tests: the kernel test files with CUDA tensors (each attention test through both kernels; MoE
#               kernels; the direct-launch path; the norm and rope kernels; decode_topk; V4's compressor)
# v4-decode:    the MODEL1 (DeepSeek-V4) cache and decode test files with CUDA tensors (each decode test
#               through the Gluon and the portable kernel), then bench_decode.py's V4 table
# host-cost:    scripts/bench_host_cost.py (host µs per call of each public kernel function, eager beside
#               CUDA-graph replay; the decode rows again with where their host time goes, by function)
# moe-bench:    scripts/bench_moe.py (routing, grouped GEMMs beside torch._scaled_mm, the expert block at
#               decode and prefill sizes, V3.2 and V4-Flash shapes) with its launch-shape variants
# moe-decode:   the MoE kernel tests with CUDA tensors, then bench_moe.py at 1, 16 and 64 tokens (the decode
#               paths and each model's b 1 layer with its shared expert; about 2 minutes)
# bench:        scripts/bench_prefill.py, bench_decode.py (with roofline PNGs), bench_indexer.py,
#               bench_indexer_paged.py (and its --topk-sweep), bench_mhc.py; ceilings measured in the same run
# gemm-bench:   scripts/bench_gemm.py (fp8 GEMM beside torch._scaled_mm and bf16)
# v32:          synthetic checkpoint at real DeepSeek-V3.2 dims (3 dense layers, several GB in
#               /tmp/minirt-v32), then `minirt verify` (default fp8 weights; bf16 weights; a prompt
#               longer than one prefill chunk)
# v32-generate: `minirt generate` on that checkpoint at batch 1 and 64
# v32-step:     bench_runtime.py on that checkpoint at b 1 (1,024 and 163,840 tokens) and b 16 (1,024), both
#               indexer modes, with each step's 20 largest kernels, eager and inside a graph replay
# v4-1m:        the v4-flash preset's b 1 step at 1,024 and after a 1,048,576-token prompt (long-step's first part)
# long-step:    the two long-context step ratios: the v4-flash preset at 1,024 and 1,048,576, then v32-step,
#               then the decode scores' launch shapes (what grows with the context): bench_indexer_paged.py
#               --decode-sweep (V3.2's paged keys) and bench_indexer.py --decode-sweep (V4's CSA keys)
# runtime-bench: scripts/bench_runtime.py on that checkpoint (contexts to 163840, batch 1 and 16,
#               both weight and indexer modes, peak memory, the split of one long prefill;
#               RUNTIME_BENCH_ARGS: more flags)
# v32-moe:      the v32 preset with 5 layers (3 dense + 2 MoE at real size, ~25 GB in /tmp/minirt-v32-moe), then
#               `minirt verify` on it (prompt 2120: past index_topk, within an 80 GB card; prefill chunks of 1024)
# v4-flash:     the v4-flash preset (V4-Flash's first 4 layers, ~16 GB in /tmp/minirt-v4-flash), `minirt verify`
#               (2200 tokens: past the window, one prefill chunk and the CSA top-k of 512 entries), then
#               scripts/bench_runtime.py on it (contexts to 1,048,576 at b 1, and b 64; V4_BENCH_ARGS: more flags)
# v4-step:      what V4-Flash's decode step and prefill chunk need checked, in one call: the fp8 GEMM stream
#               and grouped tests, the V4 indexer's row blocks, decode_topk's tests and bench_indexer_paged.py
#               --decode-only, bench_runtime.py at 1,024 and 131,072 tokens, then 1,024 and 1,048,576 (each
#               step's 20 largest kernels, eager and in the graph), `minirt verify`, and 131,072 again in
#               prefill chunks of 2048
# profile:      where the time goes: bench_runtime.py --split --top 30 on the v4-flash preset (1,024 and 131,072
#               tokens at b 1), then on the v32 preset (1,024 and 163,840, both indexer modes)
# tp:           (2 GPUs) the v32-moe checkpoint (3 dense + 2 MoE layers), `minirt
#               verify` on 1 GPU and at --tp 2 under torchrun (NCCL), v4-tiny's verify at --tp 2, then
#               bench_runtime.py --tp 2 beside 1 GPU
# Tables and plots go to $OUT (default /tmp/minirt-out), each step's output to $OUT/<step>.log, its exit
# status and time to $OUT/summary.txt; the script exits 1 if any step failed. A step still running
# DEADLINE seconds after the start (default 570) is stopped and later ones are skipped, so a job with a
# time limit still ends with its logs. PACK=1 packs everything under $OUT into $OUT/run.tar.gz at the end
# (summary.txt stays beside it), for a runner that returns only a few files.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/minirt-out}
mkdir -p "$OUT"
status=0
pack() {
  tar -czf /tmp/minirt-run.tar.gz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete \
    && mv /tmp/minirt-run.tar.gz "$OUT/run.tar.gz"
}
[ "${PACK:-0}" = 1 ] && trap pack EXIT
python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"

DEADLINE=${DEADLINE:-570}
run() {  # run NAME CMD...: tee output to $OUT/NAME.log, remember failures
  local name=$1; shift
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 10 ]; then echo "=== $name: skipped, past the deadline" | tee -a "$OUT/summary.txt"; status=1; return; fi
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "$left" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc, $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
}

v32_step() {  # the v32 preset's b 1 step at 1,024 and 163,840 tokens and b 16 at 1,024, both indexer modes
  run v32-step-bench python3 scripts/bench_runtime.py $V32 --modes fp8/exact,fp8/fp8 --context 1024,163840 \
    --batch 1,16 --top 20 --steps 10
}

v4_flash_1m() {  # the v4-flash preset's b 1 step at 1,024 and after a 1,048,576-token prompt
  run v4-flash-1m python3 scripts/bench_runtime.py $V4F --context 1024,1048576 --batch 1 --max-tokens 1048576 \
    --steps 10 --top 20
}

for stage in "$@"; do
  case $stage in
    tests) run tests python3 -m pytest -q tests/test_engine.py tests/test_layers.py tests/test_cli.py \
             tests/test_readme.py tests/test_ops.py tests/test_embedding.py tests/test_first_run.py \
             tests/test_moe_model.py tests/test_untrusted_input.py tests/test_v4_runtime.py tests/test_mhc.py \
             -k "not hub and not download" ;;  # the download tests need huggingface_hub>=2 (httpx2), which the GPU lacks
    kernel-tests) run kernel-tests python3 -m pytest -q tests/test_sparse_mla_prefill.py tests/test_sparse_mla_decode.py \
                    tests/test_kv_cache_fp8.py tests/test_lightning_indexer.py tests/test_indexer_cache.py \
                    tests/test_fp8_gemm.py tests/test_moe_kernels.py tests/test_sparse_mla_prefill_two_sources.py \
                    tests/test_decode_launch.py tests/test_rms_norm.py tests/test_rope_kernel.py tests/test_decode_topk.py \
                    tests/test_norm_rope.py tests/test_compressor_decode.py tests/test_v4_step_indices.py ;;
    v4-decode)
      run v4-decode-tests python3 -m pytest -q tests/test_model1_cache.py tests/test_sparse_mla_decode_model1.py \
                            tests/test_sparse_mla_decode_model1_sm90.py
      run bench-decode-v4 python3 scripts/bench_decode.py --cases v4 --out "$OUT/decode_v4.md" ;;
    host-cost)
      run host-cost python3 scripts/bench_host_cost.py --out "$OUT/host_cost.md"
      run host-cost-profile python3 scripts/bench_host_cost.py --only decode --calls 300 --profile ;;
    moe-decode)
      run moe-tests python3 -m pytest -q tests/test_moe_kernels.py
      run moe-decode-bench python3 scripts/bench_moe.py --out "$OUT/moe_decode.md" --tokens 1 16 64 ;;
    moe-bench) run bench-moe python3 scripts/bench_moe.py --out "$OUT/moe.md" --tokens 1 16 4096 \
                 --configs 16,4,3,swap 16,4,3,swap,split8 16,4,4,swap,e4m3 128,8,3 64,8,2,swap,e4m3 ;;
    bench)
      run bench-prefill python3 scripts/bench_prefill.py --out "$OUT/prefill.md" --plot "$OUT/prefill.png"
      run bench-decode python3 scripts/bench_decode.py --out "$OUT/decode.md" --plot "$OUT/decode.png"
      run bench-indexer python3 scripts/bench_indexer.py --out "$OUT/indexer.md"
      run bench-indexer-paged python3 scripts/bench_indexer_paged.py --out "$OUT/indexer_paged.md"
      run bench-decode-topk python3 scripts/bench_indexer_paged.py --topk-sweep --out "$OUT/decode_topk.md"
      run bench-mhc python3 scripts/bench_mhc.py ;;
    gemm-bench) run bench-gemm python3 scripts/bench_gemm.py --out "$OUT/gemm.md" ;;
    v32|v32-generate|v32-step|runtime-bench|profile|long-step)
      V32=/tmp/minirt-v32
      [ -f $V32/config.json ] || run v32-init minirt init $V32 --preset v32 --device cuda ;;&
    v32-step) v32_step ;;
    runtime-bench) run runtime-bench python3 scripts/bench_runtime.py $V32 --split --out "$OUT/runtime.md" ${RUNTIME_BENCH_ARGS:-} ;;
    v32)
      run v32-verify minirt verify $V32 --json
      run v32-verify-bf16 python3 -c "import json, minirt; from minirt.models.deepseek_v32.verify import run_verify
e = minirt.load('$V32', weights='bf16', prefill_chunk=1024); o = minirt.load('$V32', backend='reference')
print(run_verify(e, o, 2 * e.cfg.index_topk + 8, 8).to_json())" ;;
    v32-generate)
      prompt=$(python3 -c 'print(",".join(str((i * 7919) % 129280) for i in range(512)))')
      run v32-generate-b1 minirt generate $V32 --tokens "$prompt" -n 64 --batch 1
      run v32-generate-b64 minirt generate $V32 --tokens "$prompt" -n 64 --batch 64 ;;
    v32-moe)
      V32M=/tmp/minirt-v32-moe
      [ -f $V32M/config.json ] || run v32-moe-init minirt init $V32M --preset v32 --layers 5 --device cuda
      # (2120 tokens fit an 80 GB card beside the eager reference; 2 x index_topk + 8 needs the H200)
      run v32-moe-verify minirt verify $V32M --json --prefill-chunk 1024 --prompt-len 2120 ;;
    v4-flash|v4-step|profile|long-step|v4-1m)
      V4F=/tmp/minirt-v4-flash
      [ -f $V4F/config.json ] || run v4-flash-init minirt init $V4F --preset v4-flash --device cuda ;;&
    v4-flash)
      run v4-flash-verify minirt verify $V4F --json --prompt-len 2200 --prefill-chunk 1024
      run v4-flash-bench python3 scripts/bench_runtime.py $V4F --context 1024,131072,1048576 --batch 1,64 --max-tokens 1048576 \
        --out "$OUT/runtime_v4.md" ${V4_BENCH_ARGS:-} ;;
    v4-1m) v4_flash_1m ;;
    long-step)
      v4_flash_1m
      v32_step
      run decode-sweep python3 scripts/bench_indexer_paged.py --decode-sweep
      run csa-decode-sweep python3 scripts/bench_indexer.py --decode-sweep ;;
    v4-step)
      run v4-step-tests python3 -m pytest -q tests/test_fp8_gemm.py tests/test_v4_runtime.py tests/test_decode_topk.py \
        -k "grouped or stream or dequantised or row_blocks or compressor_state or topk"
      run topk-bench python3 scripts/bench_indexer_paged.py --decode-only
      run v4-step-bench python3 scripts/bench_runtime.py $V4F --context 1024,131072 --batch 1 --top 20 --steps 10
      v4_flash_1m
      run v4-flash-verify minirt verify $V4F --json --prompt-len 2200 --prefill-chunk 1024
      run v4-flash-chunk2k python3 scripts/bench_runtime.py $V4F --context 131072 --batch 1 --steps 10 \
        --prefill-chunk 2048 ;;
    profile)
      run profile-v4-flash python3 scripts/bench_runtime.py $V4F --context 1024,131072 --batch 1 --split --top 30 \
        --steps 10 --out "$OUT/profile_v4.md"
      run profile-v32 python3 scripts/bench_runtime.py $V32 --modes fp8/exact,fp8/fp8 --context 1024,163840 --batch 1 \
        --split --top 30 --steps 10 --out "$OUT/profile_v32.md" ;;
    tp)
      V32M=/tmp/minirt-v32-moe
      [ -f $V32M/config.json ] || run v32-moe-init minirt init $V32M --preset v32 --layers 5 --device cuda
      run tp-verify-1gpu minirt verify $V32M --json --prefill-chunk 1024
      run tp-verify-2gpu python3 -m torch.distributed.run --nproc-per-node 2 -m minirt verify $V32M --tp 2 --json --prefill-chunk 1024
      V4T=/tmp/minirt-v4-tiny
      [ -f $V4T/config.json ] || run v4-tiny-init minirt init $V4T --preset v4-tiny
      run tp-verify-v4 python3 -m torch.distributed.run --nproc-per-node 2 -m minirt verify $V4T --tp 2 --json
      run tp-bench python3 -m torch.distributed.run --nproc-per-node 2 scripts/bench_runtime.py $V32M --tp 2 \
        --modes fp8/exact --context 1024,8192 --batch 1,16 --out "$OUT/runtime_tp2.md" ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
exit $status
