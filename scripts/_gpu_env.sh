# Sourced by the device scripts: $OUT, the carried megatron-core wheel installed into
# /tmp/site, and the environment Megatron's launch wants (TE first on PYTHONPATH if the caller
# put it there).
set -uo pipefail
OUT="${OUT:-out/device}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site:$PWD" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export CUDA_DEVICE_MAX_CONNECTIONS=1

# What ran where: GPU, driver, torch, triton, megatron-core (and TE where importable) into
# $OUT/env.txt and stdout.
record_env() {
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, triton, megatron.core as m; print('torch', torch.__version__, 'triton', triton.__version__, 'megatron-core', m.__version__)"
    python3 -c "import transformer_engine as t; print('Transformer Engine', t.__version__)" 2>/dev/null
  } 2>&1 | tee "$OUT/env.txt"
}
