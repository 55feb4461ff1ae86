"""Small builders shared by the tests (tiny GPT configs and batches) and the launcher of the
tests' child processes (torchrun, the examples)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from mhc_megatron.config import MHCTransformerConfig
from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec

VOCAB = 64
SEQ = 16

ROOT = Path(__file__).resolve().parent.parent

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
needs_te = pytest.mark.skipif(not (HAVE_TE and torch.cuda.is_available()),
                              reason="needs Transformer Engine and a CUDA device")
# Spec families a test runs with: Megatron's local modules everywhere, TE's where installed.
SPEC_FAMILIES = ["local", pytest.param("te", marks=needs_te)]
# Megatron-Core 0.19.2's distributed optimiser resumes only with TE's or Apex's fused Adam:
# with torch's Adam, DistributedOptimizer.state_dict asserts a single Adam step value, and an
# optimiser being loaded has not stepped yet (no mHC involved; the baseline fails the same).
HAVE_FUSED_ADAM = HAVE_TE or importlib.util.find_spec("apex") is not None
needs_fused_adam = pytest.mark.skipif(
    not HAVE_FUSED_ADAM, reason="Megatron 0.19.2's distributed optimiser resumes only with "
    "TE's or Apex's fused Adam (torch Adam: assert len(steps) == 1 in state_dict)")


# The smallest mHC config the config tests vary (no model is built from it).
CONFIG_BASE = dict(num_layers=4, hidden_size=32, num_attention_heads=4,
                   enable_hyper_connections=True)


def assert_refused(overrides: dict, field: str) -> None:
    """``MHCTransformerConfig(**CONFIG_BASE, **overrides)`` raises the config's clear error:
    a ValueError naming ``field`` and giving a fix."""
    with pytest.raises(ValueError, match=rf"mHC config: .*{field}.*Fix: "):
        MHCTransformerConfig(**{**CONFIG_BASE, **overrides})


def tiny_config(**overrides) -> MHCTransformerConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        enable_hyper_connections=True,
        num_residual_streams=4,
        mhc_kernel_backend="reference",
    )
    base.update(overrides)
    return MHCTransformerConfig(**base)


def moe_overrides() -> dict:
    return dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather", add_bias_linear=False)


def build_gpt(config, device=None, spec=None, te=False) -> GPTModel:
    spec = spec or get_gpt_decoder_block_with_mhc_spec(config, use_transformer_engine=te)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope")
    return model.to(device) if device is not None else model


def batch(batch_size=2, seq=SEQ, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, seq + 1), generator=g)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(seq).expand(batch_size, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
    return [t.to(device) for t in (ids, pos, mask, labels)]


def lm_loss(model, data) -> torch.Tensor:
    ids, pos, mask, labels = data
    return model(ids, pos, mask, labels=labels).float().mean()


def replace(config, **kw):
    return dataclasses.replace(config, **kw)


def sequence_parallel_capable_spec(config, spec=None):
    """The mHC block spec (or ``spec``, a local-modules mHC block spec, e.g. one pipeline
    stage's) with norms that accept sequence_parallel on CPU (no apex/TE)."""
    from mhc_megatron.layers import StreamContractingNorm
    from mhc_testing.cpu import SequenceParallelTorchNorm

    if spec is None:
        spec = get_gpt_decoder_block_with_mhc_spec(config, use_transformer_engine=False)
    for layer_spec in spec.layer_specs:
        layer_spec.submodules.input_layernorm = SequenceParallelTorchNorm
        layer_spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    spec.layer_norm = StreamContractingNorm.wrapping(SequenceParallelTorchNorm)
    return spec


# ------------------------------------------------------------------------ child processes
# The tiny GPT that the tests train with Megatron's own loop (examples/pretrain_gpt_mhc.py),
# and Megatron's local modules without the fused kernels that need apex or TE.
TINY_GPT_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                  "--seq-length", "64", "--max-position-embeddings", "64",
                  "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                  "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0"]
LOCAL_MODULE_FLAGS = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion",
                      "--no-persist-layer-norm", "--no-rope-fusion", "--no-masked-softmax-fusion",
                      "--no-bias-dropout-fusion"]
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def child_env(cpu_only: bool = False, **extra) -> dict:
    """The environment of a child process: unbuffered, one OpenMP thread, warnings off, and
    none of this process's launch variables unless given in ``extra`` (a test's own process
    group holds its MASTER_PORT). ``cpu_only``: no CUDA device, also on a GPU host."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONWARNINGS": "ignore", **extra}
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    for key in LAUNCH_VARIABLES:
        if key not in extra:
            env.pop(key, None)
    return env


def start(cmd, env: dict) -> subprocess.Popen:
    """``cmd`` in its own session (so a timeout can stop all its processes), from the repo
    root, stdout and stderr together."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: int) -> str:
    """Wait for ``proc``; on timeout kill its whole process group (torchrun's ranks too)."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        pytest.fail(f"timed out after {timeout} s:\n{out[-4000:]}")


def run_child(cmd, env: dict, timeout: int) -> subprocess.CompletedProcess:
    """:func:`start` then :func:`finish`: the exit code and the output."""
    proc = start(cmd, env)
    out = finish(proc, timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")

