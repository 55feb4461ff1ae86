#!/usr/bin/env bash
# The main job: train a small Megatron-Core GPT with a standard residual and with mHC (n=4)
# on the Python standard library's source bytes; print a loss table and write
# out/demo/loss_curves.png. CPU by default (a few minutes); the GPU preset when CUDA is
# present. Extra arguments go to examples/train_gpt_mhc.py (e.g. --steps 100).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_venv.sh"
cd "$ROOT"
exec python examples/train_gpt_mhc.py "$@"
