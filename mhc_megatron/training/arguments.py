"""The mHC command-line flags, for Megatron's ``extra_args_provider``.

Every flag's ``dest`` is the name of an :class:`~mhc_megatron.config.MHCTransformerConfig`
field, so Megatron's ``core_transformer_config_from_args`` copies it into the config (it
copies every args attribute named like a config field); defaults are the config's own.
Megatron-LM's in-tree mHC spellings are accepted too, so its users can switch without edits:
``--enable-mhc-connections``, ``--mhc-num-residual-streams`` and ``mhc`` in
``--recompute-modules`` (see :func:`apply_mhc_argument_aliases`).

:func:`add_mhc_arguments` also repairs help strings of Megatron's own flags that argparse
cannot format (:func:`repair_help_strings`), so ``--help`` of a script using it works.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import torch

from mhc_megatron.config import VARIANTS, MHCTransformerConfig
from mhc_megatron.kernels import KERNEL_BACKENDS

MHC_RECOMPUTE_MODULE = "mhc"  # Megatron-LM's in-tree name in --recompute-modules
_PARAMS_DTYPES = {"fp32": torch.float32, "params": None}

# Megatron-Core's own flags whose help holds a bare '%' (argparse %-formats every help string
# for ``--help``, which then raises ValueError), per megatron-core release.
KNOWN_UNFORMATTABLE_HELP = {
    "0.19.2": ("--moe-paged-stash-buffer-size-factor-cuda",),  # "(e.g. 1.10 = 10%)."
}
# '%%' and '%(name)' stay; any other '%' is bare.
_PERCENT_TOKEN = re.compile(r"%%|%\(\w+\)|%")


def _default(field: str):
    return {f.name: f.default for f in dataclasses.fields(MHCTransformerConfig)}[field]


def _variant(value: str) -> str:
    """``deepseek-v4`` (the issue trackers' spelling) is ``deepseek_v4``."""
    return value.replace("-", "_")


def _params_dtype(value: str):
    try:
        return _PARAMS_DTYPES[value]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"--mhc-params-dtype: {value!r} is not one of {sorted(_PARAMS_DTYPES)}") from None


def _megatron_release() -> str:
    """``megatron.core.__version__`` without a local part (``0.19.2+abc`` -> ``0.19.2``)."""
    import megatron.core

    return str(getattr(megatron.core, "__version__", "")).split("+")[0]


def _help_formats(parser: argparse.ArgumentParser, action: argparse.Action) -> bool:
    """Whether argparse can expand ``action.help`` (what ``--help`` does for every flag)."""
    if not action.help or action.help is argparse.SUPPRESS:
        return True
    try:
        parser._get_formatter()._expand_help(action)
    except (ValueError, TypeError, KeyError):
        return False
    return True


def _escape_bare_percent(text: str) -> str:
    """``text`` with every bare '%' doubled; '%%' and '%(name)...' placeholders kept."""
    return _PERCENT_TOKEN.sub(lambda m: "%%" if m.group(0) == "%" else m.group(0), text)


def repair_help_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Escape the bare '%' of help strings that argparse cannot format, so that ``--help``
    works; returns the first option string of every action repaired.

    The flags known for the installed megatron-core release
    (:data:`KNOWN_UNFORMATTABLE_HELP`) are repaired by name; then, as a safety net for other
    releases and parsers, any action whose help still fails to format. Only such actions
    change, and in them only the bare '%' (``%%`` and ``%(default)s``-style placeholders stay).
    """
    def repair(action: argparse.Action) -> None:
        action.help = _escape_bare_percent(action.help)
        if not _help_formats(parser, action):  # a placeholder argparse does not know
            action.help = action.help.replace("%(", "%%(")
        repaired.append(action.option_strings[0] if action.option_strings else action.dest)

    repaired: list[str] = []
    by_option = {option: a for a in parser._actions for option in a.option_strings}
    for option in KNOWN_UNFORMATTABLE_HELP.get(_megatron_release(), ()):
        action = by_option.get(option)
        if action is not None and not _help_formats(parser, action):
            repair(action)
    for action in parser._actions:
        if not _help_formats(parser, action):
            repair(action)
    return repaired


def add_mhc_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the mHC flags to Megatron's parser, as the argument group "mHC"; returns it
    (``extra_args_provider`` contract). Also :func:`repair_help_strings`, so ``--help`` works."""
    g = parser.add_argument_group(
        "mHC", "Manifold-constrained hyper-connections (mhc-megatron): n residual streams "
               "mixed by learned, doubly stochastic H_res.")
    g.add_argument("--enable-hyper-connections", "--enable-mhc-connections",
                   dest="enable_hyper_connections", action="store_true",
                   help="Turn mHC on: n residual streams mixed by doubly stochastic H_res.")
    g.add_argument("--num-residual-streams", "--mhc-num-residual-streams",
                   dest="num_residual_streams", type=int,
                   default=_default("num_residual_streams"),
                   help="n, the number of residual streams (the paper uses 4).")
    g.add_argument("--mhc-sinkhorn-iterations", type=int,
                   default=_default("mhc_sinkhorn_iterations"),
                   help="Sinkhorn-Knopp iterations that make H_res doubly stochastic.")
    g.add_argument("--mhc-init-gating-factor", type=float,
                   default=_default("mhc_init_gating_factor"),
                   help="Initial alpha_pre / alpha_post / alpha_res.")
    g.add_argument("--mhc-init-static-mapping", choices=("residual", "zero"),
                   default=_default("mhc_init_static_mapping"),
                   help="Static mapping at step 0: residual (H_pre=1/n, H_post=1, H_res "
                        "diagonal --mhc-init-res-diagonal) or zero (all-zero bias: H_pre=1/2, "
                        "H_post=1, H_res=1/n, as Megatron-LM's in-tree mHC).")
    g.add_argument("--mhc-init-res-diagonal", type=float,
                   default=_default("mhc_init_res_diagonal"),
                   help="H_res diagonal at step 0 for the residual static mapping, in [1/n, 1).")
    g.add_argument("--mhc-rms-eps", type=float, default=_default("mhc_rms_eps"),
                   help="Epsilon of the fp32 RMS of the flattened streams.")
    g.add_argument("--mhc-variant", type=_variant, choices=sorted(VARIANTS),
                   default=_default("mhc_variant"),
                   help="The conventions as one preset: paper (default) or deepseek_v4 "
                        "(also deepseek-v4): DeepSeek-V4's mapping form, H_res transposed, the "
                        "learned output head and fp32 mapping parameters.")
    g.add_argument("--mhc-mapping-form", choices=("paper", "deepseek_v4"),
                   default=_default("mhc_mapping_form"),
                   help="How the logits become the mappings: paper (sigmoid; log-domain "
                        "Sinkhorn) or deepseek_v4 (sigmoid + eps; row softmax + eps, then "
                        "Sinkhorn dividing by sum + eps); default: the preset's. The fused "
                        "kernels compute paper only.")
    g.add_argument("--mhc-mapping-eps", type=float, default=_default("mhc_mapping_eps"),
                   help="eps of the deepseek_v4 mapping form (DeepSeek-V4's hc_eps).")
    g.add_argument("--mhc-res-transposed", action="store_const", const=True,
                   default=_default("mhc_res_transposed"),
                   help="Mix the streams with H_res transposed (DeepSeek-V4's comb^T h); "
                        "default: the preset's.")
    g.add_argument("--mhc-output-head", action="store_const", const=True,
                   default=_default("mhc_output_head"),
                   help="Contract the streams before the final norm with DeepSeek-V4's "
                        "learned head (a per-token sigmoid-weighted sum) instead of the sum; "
                        "default: the preset's.")
    g.add_argument("--mhc-kernel-backend", choices=KERNEL_BACKENDS,
                   default=_default("mhc_kernel_backend"),
                   help="auto: fused Triton kernels on CUDA, else the PyTorch reference.")
    g.add_argument("--mhc-recompute", action="store_true",
                   help="Cross-layer recompute of the mHC activations (also: 'mhc' in "
                        "--recompute-modules).")
    g.add_argument("--mhc-recompute-layer-num", type=int,
                   default=_default("mhc_recompute_layer_num"),
                   help="Layers per mHC recompute block (default: eq. 20 of the paper).")
    g.add_argument("--mhc-params-dtype", type=_params_dtype, default=_default("mhc_params_dtype"),
                   metavar="{params,fp32}",
                   help="Storage of the mapping parameters: params (default: --params-dtype) "
                        "or fp32 (kept fp32 in a bf16/fp16 run; Megatron's optimisers need "
                        "mhc_megatron.training.fp32_params to checkpoint them, which "
                        "examples/pretrain_gpt_mhc.py applies).")
    repair_help_strings(parser)
    return parser


def apply_mhc_argument_aliases(args: argparse.Namespace) -> argparse.Namespace:
    """Fold Megatron-LM's ``mhc`` entry of ``--recompute-modules`` into ``mhc_recompute``.

    Megatron's own config would refuse ``mhc`` among the recompute modules, and its training
    loop reads ``args``, so the entry is removed from ``args`` itself. Idempotent.
    """
    modules = getattr(args, "recompute_modules", None)
    if modules and MHC_RECOMPUTE_MODULE in modules:
        args.recompute_modules = [m for m in modules if m != MHC_RECOMPUTE_MODULE] or None
        args.mhc_recompute = True
    return args
