"""mHC operations: the PyTorch reference and the run-time backend choice.

A leaf package: its modules import only torch, triton, the standard library and each other
(``tests/test_kernels_package.py``).
"""

from mhc_megatron.kernels.dispatch import (KERNEL_BACKENDS, REFERENCE_OPS, MHCOps, loaded_ops,
                                           select_ops, site_ops)

__all__ = ["KERNEL_BACKENDS", "MHCOps", "REFERENCE_OPS", "loaded_ops", "select_ops", "site_ops"]
