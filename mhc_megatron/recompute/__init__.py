"""Cross-layer activation recompute of the mHC ops (``mhc_recompute=True``)."""

from mhc_megatron.recompute.manager import (MHCRecomputeManager, manager_for, record_as,
                                            register_replay_fusion, run_recorded)

__all__ = ["MHCRecomputeManager", "manager_for", "record_as", "register_replay_fusion",
           "run_recorded"]
