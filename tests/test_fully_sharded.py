"""mHC parameters under Megatron-FSDP's tensor-parallel classification.

Megatron-FSDP annotates every parameter as column- or row-split over tensor parallelism, or
replicated, from its module (``FullyShardedDataParallel._detect_parallelism_type``: Megatron's
own module types by name, then the module's ``tensor_model_parallel`` attribute). The mHC
mapping parameters (``phi``, ``alpha``, ``bias`` of every hyper-connection and of DeepSeek-V4's
output heads) are replicated on every TP rank: they must be classified so, not left unknown.
The multi-rank equivalence of FSDP2 and Megatron-FSDP with DDP: tests/distributed/
fsdp_equivalence.py (tests/test_distributed.py).
"""

from __future__ import annotations

from helpers import build_gpt, tiny_config


def test_megatron_fsdp_classifies_the_mapping_parameters_as_replicated(seeded):
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    from mhc_megatron.layers.hyper_connection import MappingParameters

    model = build_gpt(tiny_config(mhc_variant="deepseek_v4", mtp_num_layers=None))
    kinds = {}
    for module in model.modules():
        if isinstance(module, MappingParameters):
            for name, _ in module.named_parameters(recurse=False):
                # an instance method reading only the class's registry
                kinds[f"{type(module).__name__}.{name}"] = \
                    FullyShardedDataParallel._detect_parallelism_type(
                        FullyShardedDataParallel, name, module)
    assert set(kinds) == {f"{m}.{p}" for m in ("HyperConnectionModule", "StreamOutputHead")
                          for p in ("phi", "alpha", "bias")}, kinds
    assert set(kinds.values()) == {"replicated"}, kinds
