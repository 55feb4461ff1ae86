"""Rename the mHC parameters of a checkpoint file between naming schemes.

    python -m mhc_megatron.convert --from megatron_core --to deepseek model.safetensors out.safetensors
    python -m mhc_megatron.convert --from hf --to megatron_core state_dict.pt out.pt

Schemes and names: :mod:`mhc_megatron.checkpoint.names` (``megatron_core``: mhc-megatron's
``GPTModel`` state dict; ``hf``: Hugging Face transformers' DeepSeek-V4; ``deepseek``:
DeepSeek's release; ``megatron_lm``: Megatron-LM's in-tree mHC). Files: ``.safetensors``
(needs the ``safetensors`` package) or a ``torch.save``d state dict. Only the mHC parameters
are renamed; the tensors are written as they are; the others pass through. A model that loads DeepSeek-V4 names computes DeepSeek-V4's
math only with ``mhc_variant="deepseek_v4"``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from mhc_megatron.checkpoint.names import SCHEMES, convert_state_dict, parse_name


def load(path: str) -> dict:
    if path.endswith(".safetensors"):
        return _safetensors().load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a state dict (a dict of tensors), got "
                         f"{type(state).__name__}. Fix: pass a torch.save(model.state_dict()) "
                         "file or a .safetensors file.")
    return state


def save(state: dict, path: str) -> None:
    if path.endswith(".safetensors"):
        _safetensors().save_file({k: v.contiguous() for k, v in state.items()}, path)
    else:
        torch.save(state, path)


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as error:
        raise ImportError("reading or writing .safetensors needs the safetensors package. Fix: "
                          "pip install safetensors, or use torch.save files (.pt).") from error
    return safetensors.torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_megatron.convert",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", choices=SCHEMES, required=True)
    parser.add_argument("--to", dest="target", choices=SCHEMES, required=True)
    parser.add_argument("--drop-unnamed", action="store_true",
                        help="leave out mHC parameters the target has no name for (hf: MTP; "
                             "megatron_lm: MTP and the output head)")
    parser.add_argument("input")
    parser.add_argument("output")
    args = parser.parse_args(argv)
    state = load(args.input)
    converted = convert_state_dict(state, args.source, args.target, args.drop_unnamed)
    save(converted, args.output)
    renamed = sum(parse_name(k, args.source) is not None for k in state)
    print(f"{args.input} ({args.source}) -> {args.output} ({args.target}): {renamed} mHC "
          f"parameters renamed, {len(state) - renamed} others unchanged, "
          f"{len(state) - len(converted)} dropped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
