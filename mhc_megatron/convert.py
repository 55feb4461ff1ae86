"""Rename the mHC parameters of a checkpoint between naming schemes.

    python -m mhc_megatron.convert --from megatron_core --to deepseek model.safetensors out.safetensors
    python -m mhc_megatron.convert --from hf --to megatron_core state_dict.pt out.pt
    python -m mhc_megatron.convert --from megatron_core --to megatron_lm ckpt/iter_0000100 lm_ckpt
    python -m mhc_megatron.convert --from megatron_core --to hf ckpt/iter_0000100 mhc.safetensors

Schemes and names: :mod:`mhc_megatron.checkpoint.names` (``megatron_core``: mhc-megatron's
``GPTModel`` state dict; ``hf``: Hugging Face transformers' DeepSeek-V4; ``deepseek``:
DeepSeek's release; ``megatron_lm``: Megatron-LM's mHC and Megatron-Bridge's DeepSeek-V4).
Inputs and outputs: ``.safetensors`` (needs the ``safetensors`` package), a ``torch.save``d
state dict (``.pt``), or a Megatron distributed checkpoint directory
(:mod:`mhc_megatron.checkpoint.dist_files`: its model tensors, stacked layers split for
per-layer names; the optimizer state is left out). A directory output is written as a
distributed checkpoint (``megatron_core`` / ``megatron_lm`` names; decoder layers stacked, as
Megatron's GPT saves them). Only the mHC parameters are renamed (and our final norms' inner
norm); the tensors are written as they are; the others pass through. A model that loads
DeepSeek-V4 names computes DeepSeek-V4's math only with ``mhc_variant="deepseek_v4"``.
"""

from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

import torch

from mhc_megatron.checkpoint.dist_files import (
    DistCheckpoint,
    is_dist_checkpoint,
    read_dist_checkpoint,
    stack_layers,
    unstack_layers,
    write_dist_checkpoint,
)
from mhc_megatron.checkpoint.names import SCHEMES, convert_state_dict, has_name, parse_name

FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
PER_LAYER_SCHEMES = ("hf", "deepseek")  # names with a layer index only


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


class Conversion(NamedTuple):
    """What :func:`convert_path` did: mHC tensors renamed, other tensors, mHC tensors dropped,
    and whether it wrote a distributed checkpoint from a file (tensors only, no sharded
    objects: it loads non-strictly)."""

    renamed: int
    others: int
    dropped: int
    dist_from_file: bool


def convert_path(source_path: str, target_path: str, source: str, target: str,
                 drop_unnamed: bool = False) -> Conversion:
    """Convert the checkpoint at ``source_path`` (a file or a distributed checkpoint) from
    ``source`` to ``target`` names into ``target_path`` (a file, by its suffix, or a
    distributed checkpoint directory)."""
    to_dist = not target_path.endswith(FILE_SUFFIXES)
    if to_dist and target in PER_LAYER_SCHEMES:
        raise ValueError(f"{target!r} names are for files: give {target_path!r} a .safetensors "
                         "or .pt suffix (a distributed checkpoint holds megatron_core or "
                         "megatron_lm names).")
    from_file = not is_dist_checkpoint(source_path)
    if from_file:
        state = load(source_path)
    else:
        ckpt = read_dist_checkpoint(source_path)
        # per-layer names (a file's) need the stacked layers split; a dist output keeps them
        state = ckpt.tensors if to_dist else unstack_layers(ckpt.tensors)
    converted = convert_state_dict(state, source, target, drop_unnamed)
    if to_dist:
        if from_file:  # layers stacked as Megatron's GPT saves them
            ckpt = DistCheckpoint(tensors=stack_layers(converted))
        else:
            ckpt.tensors = converted
        write_dist_checkpoint(target_path, ckpt)
    else:
        save(converted, target_path)
    params = [p for p in map(lambda k: parse_name(k, source), state) if p is not None]
    dropped = sum(not has_name(p, target) for p in params) if drop_unnamed else 0
    return Conversion(len(params), len(state) - len(params), dropped,
                      dist_from_file=to_dist and from_file)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_megatron.convert",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", choices=SCHEMES, required=True)
    parser.add_argument("--to", dest="target", choices=SCHEMES, required=True)
    parser.add_argument("--drop-unnamed", action="store_true",
                        help="leave out mHC parameters the target has no name for (hf: MTP)")
    parser.add_argument("input", help="a .safetensors / .pt file or a Megatron distributed "
                        "checkpoint directory")
    parser.add_argument("output", help="a .safetensors / .pt file, or a directory for a Megatron "
                        "distributed checkpoint")
    args = parser.parse_args(argv)
    try:
        done = convert_path(args.input, args.output, args.source, args.target,
                            args.drop_unnamed)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        parser.exit(2, f"python -m mhc_megatron.convert: error: {error}\n")
    print(f"{args.input} ({args.source}) -> {args.output} ({args.target}): {done.renamed} mHC "
          f"parameters renamed, {done.others} others unchanged, {done.dropped} dropped")
    if done.dist_from_file:
        print("The distributed checkpoint was written from a file: it has the tensors but no "
              "sharded objects (e.g. Transformer Engine's _extra_state). Load it non-strictly: "
              "--dist-ckpt-strictness log_unexpected (megatron.training), or "
              "dist_checkpointing.load(..., strict='log_unexpected').")
    return 0


if __name__ == "__main__":
    sys.exit(main())
