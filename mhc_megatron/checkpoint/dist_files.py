"""Megatron distributed checkpoints as plain tensors, and back: what the name converter
(:mod:`mhc_megatron.checkpoint.names`, ``python -m mhc_megatron.convert``) reads and writes.

A Megatron distributed checkpoint (``dist_checkpointing``, the ``torch_dist`` format that
``megatron.training`` saves, e.g. ``ckpt/iter_0000100/``) holds every tensor whole under its
sharded key, whatever the parallel layout it was saved at; a GPT's decoder layers are stacked
(``decoder.layers.X`` with the layer as the first axis). Read with Megatron's own
``load_sharded_metadata`` / ``load`` on one process:

* :func:`read_dist_checkpoint` -> :class:`DistCheckpoint`: the model's tensors by key, its
  sharded objects (e.g. Transformer Engine's ``_extra_state``) as Megatron stored them, and
  the content metadata. The optimizer state (keys under ``optimizer.``) is left out: it is
  laid out by the optimizer's own buffers, not by parameter names (resume a converted
  checkpoint with ``--no-load-optim``).
* :func:`write_dist_checkpoint`: the tensors (each whole, one replica) and objects saved with
  Megatron's ``dist_checkpointing.save`` on one process, so that a model of any parallel
  layout loads them (Megatron reshards on load).
* :func:`unstack_layers` / :func:`stack_layers`: ``decoder.layers.X [L, ...]`` <->
  ``decoder.layers.{i}.X`` (what per-layer names, Hugging Face's and DeepSeek's, need).

Keys are the state dict's: Megatron's GPT MTP layer stores its inner layer under
``mtp.layers.d.transformer_layer.`` in the checkpoint (older checkpoints' name) and
``mtp.layers.d.mtp_model_layer.`` in ``state_dict()``; reading gives the latter, writing
stores the former, as Megatron's ``MultiTokenPredictionLayer.sharded_state_dict`` does.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field

import torch

_STACKED = re.compile(r"^(.*decoder\.layers\.)(?!\d+\.)(.+)$")
_MTP_INNER = re.compile(r"^(mtp\.layers\.\d+\.)(transformer_layer|mtp_model_layer)\.")
_PER_LAYER = re.compile(r"^(.*decoder\.layers\.)(\d+)\.(.+)$")
OPTIMIZER_PREFIX = "optimizer."


@dataclass
class DistCheckpoint:
    """The model part of a distributed checkpoint: ``tensors`` (sharded key -> whole
    tensor), ``objects`` (sharded object key -> Megatron's ``ShardedObject``, data included),
    ``content_metadata`` (what the checkpoint was saved with, e.g.
    ``non_homogeneous_layers``), ``dropped`` (the optimizer keys left out)."""

    tensors: dict = field(default_factory=dict)
    objects: dict = field(default_factory=dict)
    content_metadata: dict | None = None
    dropped: list = field(default_factory=list)


def is_dist_checkpoint(path: str) -> bool:
    """A directory Megatron's ``dist_checkpointing`` wrote (it holds ``metadata.json``)."""
    return os.path.isdir(path) and os.path.exists(os.path.join(path, "metadata.json"))


def _single_process_group() -> bool:
    """Megatron's (de)serialisation asks ``torch.distributed`` for ranks: a one-process gloo
    group where none exists (returns whether it made one)."""
    if torch.distributed.is_initialized():
        return False
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    return True


def read_dist_checkpoint(path: str) -> DistCheckpoint:
    """The tensors, objects and content metadata of the distributed checkpoint at ``path``
    (module docstring); the optimizer state is left out."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.serialization import (
        load_content_metadata,
        load_sharded_metadata,
    )

    if not is_dist_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a Megatron distributed checkpoint (no metadata.json). Fix: pass the "
            "iteration directory (e.g. ckpt/iter_0000100), or a .safetensors / .pt file.")
    made = _single_process_group()
    try:
        metadata = load_sharded_metadata(path)
        ckpt = DistCheckpoint(content_metadata=load_content_metadata(path))
        wanted = {}
        for key, item in metadata.items():
            if key.startswith(OPTIMIZER_PREFIX):
                ckpt.dropped.append(key)
            elif isinstance(item, (ShardedTensor, ShardedObject)) \
                    and not key.startswith("common_state/"):
                wanted[key] = item
        loaded = dist_checkpointing.load(wanted, path, validate_access_integrity=False)
        for key, item in wanted.items():
            if isinstance(item, ShardedTensor):
                ckpt.tensors[_mtp_inner(key, "mtp_model_layer")] = loaded[key]
            else:
                item.data = loaded[key]
                ckpt.objects[key] = item
        return ckpt
    finally:
        if made:
            torch.distributed.destroy_process_group()


def write_dist_checkpoint(path: str, ckpt: DistCheckpoint) -> None:
    """Save ``ckpt`` as a Megatron distributed checkpoint at ``path`` (a new or empty
    directory): each tensor whole under its key, the objects as they were read."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    os.makedirs(path, exist_ok=True)
    if os.listdir(path):
        raise FileExistsError(f"{path} is not empty. Fix: write the converted checkpoint to a "
                              "new directory.")
    sharded = {}
    for key, tensor in ckpt.tensors.items():
        key = _mtp_inner(key, "transformer_layer")
        sharded[key] = ShardedTensor.from_rank_offsets(key, tensor.contiguous(), replica_id=0)
    for key, item in ckpt.objects.items():
        sharded[f"object:{key}"] = item
    made = _single_process_group()
    try:
        with _cpu_host_save():
            dist_checkpointing.save(sharded, path, content_metadata=ckpt.content_metadata)
    finally:
        if made:
            torch.distributed.destroy_process_group()


@contextlib.contextmanager
def _cpu_host_save():
    """On a host without CUDA (conversion needs none), for the duration of the save:
    ``torch.cuda.synchronize`` a no-op and ``torch.cuda.current_device`` "cpu". Megatron's
    checkpoint writer waits for the device before it copies the tensors and puts its
    end-of-save failure flag on the current device; on CPU there is nothing to wait for and
    the flag goes to CPU memory. Restored afterwards; untouched where CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    originals = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = originals


def _mtp_inner(key: str, name: str) -> str:
    """``key`` with an MTP depth's inner layer named ``name`` (module docstring)."""
    return _MTP_INNER.sub(lambda m: f"{m[1]}{name}.", key)


def unstack_layers(tensors: dict) -> dict:
    """``decoder.layers.X [L, ...]`` -> ``decoder.layers.{i}.X [...]`` for i < L; other keys
    as they are (the same tensors, views for the split ones)."""
    out = {}
    for key, value in tensors.items():
        m = _STACKED.match(key)
        if m is None:
            out[key] = value
            continue
        for i in range(value.shape[0]):
            out[f"{m[1]}{i}.{m[2]}"] = value[i]
    return out


def stack_layers(tensors: dict) -> dict:
    """The inverse of :func:`unstack_layers`: ``decoder.layers.{i}.X`` for i = 0 .. L-1 ->
    ``decoder.layers.X [L, ...]`` (a clear error where a layer is missing or the shapes
    differ, as for layers of different kinds: keep those per layer)."""
    groups, out = {}, {}
    for key, value in tensors.items():
        m = _PER_LAYER.match(key)
        if m is None:
            out[key] = value
        else:
            groups.setdefault(m[1] + m[3], {})[int(m[2])] = value
    for key, layers in groups.items():
        if sorted(layers) != list(range(len(layers))):
            raise ValueError(f"{key}: layers {sorted(layers)} are not 0..L-1, so they cannot be "
                             "stacked. Fix: write the checkpoint with per-layer keys.")
        shapes = {tuple(t.shape) for t in layers.values()}
        if len(shapes) != 1:
            raise ValueError(f"{key}: the layers' shapes differ ({sorted(shapes)}), so they "
                             "cannot be stacked. Fix: write the checkpoint with per-layer keys.")
        out[key] = torch.stack([layers[i] for i in range(len(layers))])
    return out
