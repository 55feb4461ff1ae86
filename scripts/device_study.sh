#!/usr/bin/env bash
# One GPU, one call per phase (carry [".whl"], and for PHASE=study the ignored out/study_gpu
# of earlier calls so the study resumes). Logs go to $OUT.
#   PHASE=checks  the single-GPU cases of tests/test_fp32_mapping_params.py and
#                 tests/test_pretrain_example.py, and a step-time probe of the study preset
#   PHASE=defaults  after a change of the initialisation defaults: the GPU golden losses
#                 re-recorded into $OUT (then checked again), the layer/model/diagnostics tests
#                 and the single-GPU cases of the example and fp32 tests (with TE if on
#                 PYTHONPATH: the distributed optimiser's resume needs its fused Adam)
#   PHASE=study   examples/mhc_study.py (--preset study, bf16, fp32 mapping parameters, SDPA
#                 attention, SEEDS seeds), stopping between runs before BUDGET seconds
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_env.sh"
record_env
STUDY="--preset study --precision bf16 --mhc-params fp32 --attention sdpa"
PHASE="${PHASE:-checks}"
if [ "$PHASE" = checks ]; then
  python3 -m pytest tests/test_fp32_mapping_params.py tests/test_pretrain_example.py -v \
    -p no:cacheprovider -k "cuda or gpu" --durations=10 2>&1 | tail -40 | tee "$OUT/checks.log"
  python3 examples/mhc_study.py $STUDY --steps ${PROBE_STEPS:-40} --eval-every 20 --seeds 1 \
    --out /tmp/probe --variants baseline "mhc-ours=static:residual" 2>&1 | tr '\r' '\n' \
    | grep -vE "it/s|DEPRECATED" | tee "$OUT/probe.log"
  python3 -c "import json; [print(r['variant'], round(1000 * r['seconds'] / len(r['steps']), 1), 'ms/step incl. evals') for r in json.load(open('/tmp/probe/study.json'))]" | tee -a "$OUT/probe.log"
elif [ "$PHASE" = defaults ]; then
  python3 -c "import transformer_engine as t; print('Transformer Engine', t.__version__)" 2>&1 | tail -1 | tee -a "$OUT/env.txt"
  for pass in record check; do
    env $([ $pass = record ] && echo MHC_UPDATE_GOLDEN=1) MHC_GOLDEN_DIR="$OUT" python3 -m pytest \
      tests/test_pretrain_example.py -q -p no:cacheprovider -k golden_losses_gpu 2>&1 | tail -2
  done | tee "$OUT/golden_gpu.log"
  python3 -m pytest tests/test_diagnostics.py tests/test_layer.py tests/test_model.py \
    tests/test_reference_math.py tests/test_config.py tests/test_transformer_engine.py \
    tests/test_fp32_mapping_params.py tests/test_pretrain_example.py -q -p no:cacheprovider \
    -k "not golden and (cuda or gpu or not pretrain_example)" -rs --durations=8 2>&1 \
    | tail -40 | tee "$OUT/checks.log"
else
  mkdir -p "$OUT/study"; [ -f out/study_gpu/study.json ] && cp out/study_gpu/study.json "$OUT/study/"
  python3 examples/mhc_study.py $STUDY --seeds "${SEEDS:-3}" --out "$OUT/study" \
    --time-budget-s "${BUDGET:-540}" ${STUDY_ARGS:-} 2>&1 | tr '\r' '\n' \
    | grep -vE "it/s|DEPRECATED" | tail -40 | tee "$OUT/study.log"
fi
