# Sourced by the device scripts: $OUT, the carried megatron-core wheel installed into
# /tmp/site, and the environment Megatron's launch wants (TE first on PYTHONPATH if the caller
# put it there).
set -uo pipefail
OUT="${OUT:-out/device}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site:$PWD" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export CUDA_DEVICE_MAX_CONNECTIONS=1
