"""Run a Python script as if Transformer Engine were not installed.

    python tests/gpu_child/without_te.py SCRIPT [ARGS...]

``import transformer_engine`` (and every submodule) raises ImportError and
``importlib.util.find_spec("transformer_engine")`` returns None, so Megatron takes its
no-TE paths. Used by tests/test_cuda_graphs.py: with TE installed, Megatron's local CUDA
graphs take TE's code paths (TE's weak-reference buffer reuse among them) and their replay
is not bitwise equal to eager for any model (the baseline without mHC included), so the
bitwise checks run here.
"""

import runpy
import sys

sys.modules["transformer_engine"] = None  # type: ignore[assignment]
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
