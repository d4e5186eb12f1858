#!/usr/bin/env bash
# The FP8 default's candidates and the top-1 agreement of the 8-bit-K formats on the GPU machine, 8,192 tokens of
# the built-in held-out split and 8,192 of calibration/data/out_of_domain (docs/kv-formats.md):
#   1. the FP8 variants in the dense simulation (benchmarks/kv_screen.py) -> OUT/kv_screen_fp8.json;
#   2. the FP8 default beside its candidates through the engine (kv_formats_accuracy --set fp8: perplexity on both
#      texts, greedy and top-1 agreement, passkey) -> OUT/kv_formats_fp8.{json,md};
#   3. K8V4-g32 + rotation, INT8 + rotation and the FP8 default through the engine (--set agreement: the top-1
#      agree column over 8,184 positions) -> OUT/kv_formats_agreement.{json,md};
#   4. which positions flip (benchmarks/top1_flips.py, dense simulation) -> OUT/top1_flips.json.
# Usage (repository root): bash benchmarks/fp8_default_gpu.sh OUT
# (a CPU check of the script: DEVICE=cpu TOKENS=64 PASSKEY="64 1" bash benchmarks/fp8_default_gpu.sh OUT)
set -uo pipefail
out=${1:?usage: bash benchmarks/fp8_default_gpu.sh OUT}
mkdir -p "$out/model"
status=0
device=${DEVICE:-cuda}
tokens=${TOKENS:-8192}
read -r pk_lengths pk_trials <<< "${PASSKEY:-320,1024,3072 20}"
python3 -c "from pathlib import Path; from builder.convert import convert_source; \
convert_source('smollm2-135m', None, Path('$out/model'), 'float32')" || exit 1
ood=calibration/data/out_of_domain
fp8=$(python3 -c "from benchmarks.kv_screen import CANDIDATES; print(','.join(k for k in CANDIDATES if 'fp8' in k \
or k.startswith('int8-per_token')))")
timeout 180 python3 -m benchmarks.kv_screen --model-dir "$out/model" --device "$device" --ppl-tokens "$tokens" --ood \
    --only "$fp8" --out "$out/kv_screen_fp8.json" | grep -v '^ ' || status=1
for set in fp8 agreement; do
    timeout 150 python3 -m benchmarks.kv_formats_accuracy --set "$set" --device "$device" --model-dir "$out/model" \
        --ppl-tokens "$tokens" --ood "$ood" --passkey-lengths "$pk_lengths" --passkey-trials "$pk_trials" \
        --out "$out" || status=1
done
timeout 90 python3 -m benchmarks.top1_flips --model-dir "$out/model" --device "$device" --ppl-tokens "$tokens" \
    --out "$out/top1_flips.json" | grep -v '^ ' || status=1
rm -rf "$out/model"
exit $status
