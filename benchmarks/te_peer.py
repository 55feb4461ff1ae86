"""Load TransformerEngine 2.20.2's Triton mHC kernels without TE's compiled core (benchmark only).

The pure-python ``transformer-engine==2.20.2`` wheel holds ``transformer_engine/common/triton/
mhc.py`` and ``transformer_engine/pytorch/triton/mhc.py``. Put those two files under a folder
(default ``.te/``, ignored by git; we never vendor TE's code) with their package paths, e.g.::

    pip download --no-deps transformer-engine==2.20.2 -d /tmp/te
    unzip /tmp/te/transformer_engine-2.20.2-py3-none-any.whl \
        'transformer_engine/common/triton/mhc.py' 'transformer_engine/pytorch/triton/mhc.py' -d .te

``load_te_mhc(root)`` builds stub parent packages in memory, replaces
``transformer_engine.pytorch.cpp_extensions.gemm.general_gemm`` (used for TE's ``dphi``) by a
torch matmul, and returns TE's ``transformer_engine.pytorch.triton.mhc`` module.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types


def _general_gemm(A, B, out_dtype=None, layout="TN", **_):
    """The one form TE's mHC calls: layout "NT" -> ``B^T @ A`` (fp32 accumulate)."""
    if layout != "NT":
        raise NotImplementedError(f"stub general_gemm supports layout='NT' only, got {layout!r}")
    out = B.float().t() @ A.float()
    return (out.to(out_dtype) if out_dtype is not None else out,)


def load_te_mhc(root: str = ".te"):
    files = {name: os.path.join(root, "transformer_engine", *name.split(".")[1:]) + ".py"
             for name in ("transformer_engine.common.triton.mhc",
                          "transformer_engine.pytorch.triton.mhc")}
    for path in files.values():
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} missing; see benchmarks/te_peer.py for how to get it")
    for pkg in ("transformer_engine", "transformer_engine.common", "transformer_engine.common.triton",
                "transformer_engine.pytorch", "transformer_engine.pytorch.triton",
                "transformer_engine.pytorch.cpp_extensions"):
        sys.modules.setdefault(pkg, types.ModuleType(pkg)).__path__ = []
    gemm = types.ModuleType("transformer_engine.pytorch.cpp_extensions.gemm")
    gemm.general_gemm = _general_gemm
    sys.modules[gemm.__name__] = gemm
    module = None
    for name, path in files.items():
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module
