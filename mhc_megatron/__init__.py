"""mhc-megatron: Manifold-Constrained Hyper-Connections (arXiv 2512.24880) for Megatron-Core.

Typical use::

    from mhc_megatron.config import MHCTransformerConfig
    from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec
"""

from mhc_megatron._logging import install_default_handler

install_default_handler()

__version__ = "0.1.0"
