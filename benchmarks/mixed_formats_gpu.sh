#!/usr/bin/env bash
# The K/V-split and group-scale formats on the GPU machine, in one run of at most ~6 minutes (each step has a timeout;
# the rest of the tests of tests/test_kernel_mixed.py run on CPU in CI):
#   1. their kernel tests (tests/test_kernel_mixed.py: the write's bytes under the GPU's shortcuts, decode against
#      the fp64 oracle, the Gluon kernel on K8V4 (also with V in groups of 32) / K FP8 / V INT4 / group-64 / group-32
#      caches) and the single formats' Gluon decode tests (the kernel they share);
#   2. benchmarks/kernels.py at Llama-3-8B 16 x 32768 for those formats beside BF16, FP8 and INT4 per-token asym,
#      cuDNN BF16 SDPA timed in the same run -> OUT/kernels_mixed_formats.{md,jsonl};
#   3. benchmarks/peers.py at the same shape (FlashInfer and XQA on BF16 / FP8, kvq on the same and on K8V4 (also V
#      in groups of 32), INT4 per-token and groups of 64 / 32) -> OUT/peers/peers.{md,jsonl}, where the carried
#      wheels (.whl/, benchmarks/README.md) install.
# Usage (repository root): bash benchmarks/mixed_formats_gpu.sh OUT
set -uo pipefail
out=${1:?usage: bash benchmarks/mixed_formats_gpu.sh OUT}
mkdir -p "$out"
status=0

# the new paths first (the Gluon kernel on the mixed formats, the e8m0 formats that failed to compile, Llama-3-8B
# shapes), then the single formats' Gluon decode at one shape (the kernel they share): 2.3 minutes at most
tests="python3 -m pytest -v --noconftest -p no:cacheprovider"
timeout 110 $tests tests/test_kernel_mixed.py -k "gluon_mixed_formats or tma_ring or se8m0 or llama8b or write_bytes" 2>&1 \
    | tee "$out/gpu_tests_mixed.log" | tail -30
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 30 $tests tests/test_kernel_gluon.py -k "test_decode_gluon_kernel and gqa4-page16 and split-k" 2>&1 \
    | tee -a "$out/gpu_tests_mixed.log" | tail -5
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# FORMAT@triton: the same format under decode_mixed.py (its kernel before the Gluon path), in the same run
formats=bf16,fp8_e4m3,int4-tok-asym,k8v4,k8v4@triton,kfp8v4,int4-g64-asym,int4-g64-asym@triton,int4-g32-asym,k8v4-g32,\
k8v4-g32@triton
timeout 120 python3 -m benchmarks.kernels --models llama3-8b --shapes 16x32768 --formats "$formats" --out "$out/kernels" \
    || status=1
if [ -f "$out/kernels/kernels.md" ]; then
    cp "$out/kernels/kernels.md" "$out/kernels_mixed_formats.md"
    cp "$out/kernels/kernels.jsonl" "$out/kernels_mixed_formats.jsonl"
fi

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    CUDA_HOME=/usr/local/cuda PYTHONPATH=.:/tmp/site timeout 90 python3 -m benchmarks.peers --shapes llama3-8b:16x32768 \
        --formats bf16,fp8_e4m3,int4-tok-asym,k8v4,int4-g64-asym,int4-g32-asym,k8v4-g32 --out "$out/peers" || status=1
else
    echo "no .whl/: the peers' rows are left out (benchmarks/README.md says how the wheels travel)"
fi
exit $status
