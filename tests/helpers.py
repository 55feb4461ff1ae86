"""Small builders shared by the tests (tiny GPT configs and batches) and the launcher of the
tests' child processes (torchrun, the examples)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from mhc_megatron.config import MHCTransformerConfig
from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec, get_gpt_mtp_block_with_mhc_spec

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


def single_grouped_expert_overrides() -> dict:
    """Config overrides for Megatron-Core 0.19.2's single grouped expert weight
    (``moe_single_grouped_weight``: the local experts' weights as one TE parameter, a
    ``GroupedTensor`` of shape ``[local experts, out, in]``). TE specs only. What it takes:

    - TE's op fuser, which Megatron enables for squared-ReLU experts with its fused weighted
      activation, or for SwiGLU only with TE's CuTe DSL kernels
      (``NVTE_CUTEDSL_FUSED_GROUPED_MLP``); the squared-ReLU form runs on any CUDA GPU;
    - bf16 (or fp16) compute: TE 2.20 runs single grouped parameters only on its grouped-tensor
      GEMM path, which has no fp32 form;
    - TE's opt-in variable ``NVTE_GROUPED_LINEAR_SINGLE_PARAM=1``, without which TE 2.20 builds
      per-expert weights after a warning. This sets it in the calling process (before the model
      is built);
    - the model built on its GPU (``use_cpu_initialization=False``): TE 2.20's ``GroupedTensor``
      does not follow a module move. ``model.to("cuda")`` (or Megatron's ``.cuda()``) replaces
      the parameter's data with a stacked copy, while ``rowwise_data``, the buffer TE's
      grouped GEMM reads, stays in host memory (its ``__torch_dispatch__`` has no case for
      ``_to_copy``)."""
    from megatron.core.activations import squared_relu

    os.environ["NVTE_GROUPED_LINEAR_SINGLE_PARAM"] = "1"
    return dict(moe_grouped_gemm=True, moe_single_grouped_weight=True,
                use_transformer_engine_op_fuser=True, activation_func=squared_relu,
                gated_linear_unit=False, use_fused_weighted_squared_relu=True,
                bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=False)


def te_single_grouped_weight_unsupported() -> str | None:
    """Why TE cannot run the single grouped expert weight on this GPU, or None. TE 2.20 runs it
    only on its grouped-tensor GEMM path (bf16/fp16, compute capability 9.0-11.0, cuBLASLt
    >= 13.4 on Hopper and >= 13.3 on Blackwell; ``is_op_fuser_grouped_tensor_path_supported``),
    and raises in the first forward elsewhere."""
    try:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.ops.basic.grouped_linear import (
            is_op_fuser_grouped_tensor_path_supported,
        )
    except ImportError as error:
        return f"this Transformer Engine has no single grouped weight path ({error})"
    if is_op_fuser_grouped_tensor_path_supported(None, torch.bfloat16):
        return None
    v = tex.get_cublasLt_version()
    return (f"TE's single grouped expert weight needs its grouped-tensor GEMM path: compute "
            f"capability 9.0-11.0 with cuBLASLt >= 13.4 on Hopper (13.3 on Blackwell); this GPU "
            f"is {torch.cuda.get_device_name()} (capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability()))}) with cuBLASLt "
            f"{v // 10000}.{v // 100 % 100}.{v % 100}")


def single_grouped_step(mhc: bool, routing: str = "dropless",
                        timeout: int = 300) -> tuple[dict | None, str]:
    """One forward + backward of the tiny MoE GPT with TE's single grouped expert weight on
    one GPU, in a child process (``tests/gpu_child/single_grouped_step.py``; a fault in TE's
    grouped-tensor GEMM can leave the CUDA context unusable), with the ``routing``
    ("dropless" or "drop_and_pad"): ``(result, "")`` where it ran, ``(None, error)`` with the
    child's last error line (or the tail of its output) where not."""
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_child",
                         "single_grouped_step.py")
    run = run_child([sys.executable, child, str(int(mhc)), routing], child_env(), timeout)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    if run.returncode == 0 and lines:
        return json.loads(lines[-1][len("RESULT "):]), ""
    return None, (last_error_line(run.stdout) or run.stdout[-1500:])


def last_error_line(out: str) -> str:
    """The last ``...Error: message`` line a process or rank printed (rank prefixes off;
    torchrun's own ``ChildFailedError`` report left out), or ``""``."""
    errors = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in out.splitlines()
              if re.search(r"\b\w+Error: \S", line) and "ChildFailedError" not in line]
    return errors[-1] if errors else ""


def build_gpt(config, device=None, spec=None, te=False) -> GPTModel:
    """The tests' mHC GPT of ``config`` (vocabulary ``VOCAB``, ``SEQ`` positions, RoPE): the
    decoder block ``spec`` (default: ours, TE's modules with ``te``) and, where
    ``config.mtp_num_layers``, its multi-token-prediction block."""
    spec = spec or get_gpt_decoder_block_with_mhc_spec(config, use_transformer_engine=te)
    mtp = get_gpt_mtp_block_with_mhc_spec(config, spec, te) if config.mtp_num_layers else None
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope", mtp_block_spec=mtp)
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


def assert_every_parameter_gets_gradient(model) -> None:
    """After a backward: every parameter of ``model`` has a finite, non-zero gradient."""
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} gets no gradient"


def assert_loads_to(fresh, path, data, expected, strict="assume_ok_unexpected") -> None:
    """``fresh`` (a model built with other weights: its logits on ``data`` are not
    ``expected``) loads the distributed checkpoint at ``path`` (Megatron's
    ``dist_checkpointing``, ``strict``) and then gives ``expected`` bit for bit."""
    from megatron.core import dist_checkpointing

    with torch.no_grad():
        assert not torch.allclose(fresh(*data[:3]), expected), "the fresh model already matched"
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(path),
                                                  strict=strict))
    with torch.no_grad():
        torch.testing.assert_close(fresh(*data[:3]), expected, rtol=0, atol=0)


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
# On CPU ranks only (GPU runs keep Megatron's defaults): Megatron's fused SwiGLU is a
# torch.compile'd function (Inductor generates, builds and loads C++ in every new process),
# and each data split forks its own loader workers. Both cost seconds a launch and neither is
# what a test checks: the loader gives the same batches in the same order in the main
# process, and eager SwiGLU computes what the compiled one does, rounding a loss at most one
# float32 ulp apart (tests/golden/pretrain_cpu_losses.json, rtol 1e-5, holds either way).
# Runs that a test compares with each other all take the same flags.
CPU_LAUNCH_FLAGS = ["--no-bias-swiglu-fusion", "--num-workers", "0"]
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def child_env(cpu_only: bool = False, **extra) -> dict:
    """The environment of a child process: unbuffered, one OpenMP thread, warnings off, and
    none of this process's launch variables unless given in ``extra`` (a child's one-rank
    process group then runs on a store of its own, not on this process's launcher's port).
    ``cpu_only``: no CUDA device, also on a GPU host."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONWARNINGS": "ignore", **extra}
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    for key in LAUNCH_VARIABLES:
        if key not in extra:
            env.pop(key, None)
    return env


# A kernel whose loop bounds are run-time values (a kernel argument, a program id), as the mHC
# kernels' split and Sinkhorn loops are
_INTERPRETER_PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def loop_to_run_time_bounds(out, steps):
    pid = tl.program_id(0)
    acc = tl.zeros((1,), tl.float32)
    for _ in range(pid * steps, pid * steps + steps):
        acc += 1.0
    tl.store(out + pid + tl.arange(0, 1), acc)

out = torch.zeros(2)
loop_to_run_time_bounds[(2,)](out, 3)
assert out.tolist() == [3.0, 3.0], out
"""


@functools.cache
def interpreter_child_skip_reason() -> str | None:
    """Why a child process cannot run the mHC kernels on Triton's interpreter here (None: it
    can). Probed once, in a child, on a CUDA host only: there the tests run the compiled
    kernels, and the interpreter only in the children of the tests that ask for it, whose
    Triton may be one whose interpreter cannot (Triton 3.6's turns a run-time loop bound, a
    kernel argument or a value made from a program id, into an int from a one-element array,
    which NumPy 2.5 refuses; Triton 3.8 squeezes it first. The kernels' bounds are run-time
    values on purpose: a constant would compile a kernel per shape). On a CPU host the whole
    suite runs on the interpreter, so a broken one fails there, never skips."""
    if not torch.cuda.is_available():
        return None
    import numpy
    import triton

    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_PROBE], cwd=ROOT,
                          env=child_env(cpu_only=True, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return None
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return (f"Triton {triton.__version__}'s interpreter with NumPy {numpy.__version__} cannot "
            f"run a loop to a run-time bound ({lines[-1] if lines else 'no output'}); the "
            "CPU hosts' suite runs these scripts on the interpreter")


def interpreter_child_env(**extra) -> dict:
    """:func:`child_env` for a child that runs the kernels on Triton's interpreter (CUDA
    hidden, ``TRITON_INTERPRET=1``, and ``extra``); the calling test is skipped where such a
    child cannot run them (:func:`interpreter_child_skip_reason`)."""
    reason = interpreter_child_skip_reason()
    if reason:
        pytest.skip(reason)
    return child_env(cpu_only=True, TRITON_INTERPRET="1", **extra)


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


def child_result(cmd, env: dict, timeout: int) -> dict:
    """:func:`run_child`, which must exit 0 and print a line ``RESULT <json>``: the last such
    line's JSON (the child's output in the assertion message otherwise)."""
    run = run_child(cmd, env, timeout)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


class Background:
    """A child process started now (:func:`start`) whose output a thread reads as it comes,
    so that several can run at once (an unread pipe would stop a child once it fills).
    :meth:`wait` gives what :func:`run_child` gives; :meth:`kill` stops one never waited for."""

    def __init__(self, cmd, env: dict):
        self.cmd, self.proc, self.output = cmd, start(cmd, env), ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        self.output = self.proc.stdout.read()

    def wait(self, timeout: int) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"timed out after {timeout} s:\n{self.output[-4000:]}")
        self._reader.join()
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, self.output, "")

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reader.join()


# Hosts without CUDA and without Transformer Engine (CI) start the ranks of a launch with
# tests/distributed/fork_ranks.py: torch and Megatron imported once for the whole session, the
# ranks forked from there (seconds less a launch on CPU ranks); other hosts with torchrun.
# MHC_TEST_LAUNCHER=torchrun takes torchrun everywhere.
FORK_RANKS = (not torch.cuda.is_available() and not HAVE_TE
              and os.environ.get("MHC_TEST_LAUNCHER") != "torchrun")
FORK_RANKS_SCRIPT = ROOT / "tests" / "distributed" / "fork_ranks.py"
# What the launched scripts import (Megatron-Core's models, schedules, optimisers and
# checkpoints; Megatron's training loop), for the fork server to import once
FORK_PRELOAD = ("torch", "megatron.core", "megatron.core.models.gpt",
                "megatron.core.pipeline_parallel", "megatron.core.distributed",
                "megatron.core.optimizer", "megatron.core.dist_checkpointing",
                "megatron.training.training", "megatron.training.arguments",
                "megatron.training.initialize", "megatron.core.datasets.gpt_dataset",
                "megatron.core.datasets.blended_megatron_dataset_builder")


def ranks_cmd(nproc: int, script, *args: str) -> list[str]:
    """The command of one launch of ``script args`` on ``nproc`` ranks with torchrun's
    variables: torchrun, or (:data:`FORK_RANKS`) fork_ranks.py on its own."""
    if FORK_RANKS:
        return [sys.executable, str(FORK_RANKS_SCRIPT), "--preload", ",".join(FORK_PRELOAD),
                str(nproc), str(script), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(script), *args]


def start_ranks(nproc: int, script, *args: str, env: dict):
    """``script args`` on ``nproc`` ranks, started now: on a :data:`FORK_RANKS` host by the
    session's fork server (its own launch where the server refuses ``env``), else torchrun.
    The result has ``wait(timeout) -> CompletedProcess`` and ``kill()``, as :class:`Background`."""
    if FORK_RANKS:
        launch = _fork_server().submit(nproc, [str(script), *args], env)
        if launch is not None:
            return launch
    return Background(ranks_cmd(nproc, script, *args), env)


def run_ranks(nproc: int, script, *args: str, env: dict,
              timeout: int) -> subprocess.CompletedProcess:
    """:func:`start_ranks`, to its end: the exit code and the output."""
    return start_ranks(nproc, script, *args, env=env).wait(timeout)


def start_python(*argv: str, env: dict):
    """``python *argv`` (``SCRIPT ARGS`` or ``-m MODULE ARGS``), one process with ``env`` as
    given (no torchrun variables), from the repository root, started now: on a
    :data:`FORK_RANKS` host forked from the session's fork server, where torch and Megatron
    are imported already (a new interpreter where the server refuses ``env``), elsewhere a new
    interpreter. What a script does and prints is the same either way, except the notices
    that importing torch and Megatron prints (a test of those starts a new interpreter). The
    result has ``wait(timeout) -> CompletedProcess`` (stdout and stderr together) and
    ``kill()``, as :class:`Background`."""
    argv = [str(a) for a in argv]
    if FORK_RANKS:
        launch = _fork_server().submit(1, argv, env, plain=True)
        if launch is not None:
            return launch
    return Background([sys.executable, *argv], env)


def run_python(*argv: str, env: dict, timeout: int) -> subprocess.CompletedProcess:
    """:func:`start_python`, to its end: the exit code and the output."""
    return start_python(*argv, env=env).wait(timeout)


class _ServedLaunch:
    """A launch that the fork server started (a process group of its own, output to a file)."""

    def __init__(self, server: "_ForkServer", ident: str, pid: int, out: str, cmd):
        self.server, self.ident, self.pid, self.out, self.cmd = server, ident, pid, out, cmd

    def _output(self) -> str:
        with open(self.out, errors="replace") as f:
            return f.read()

    def wait(self, timeout: int) -> subprocess.CompletedProcess:
        code = self.server.wait_done(self.ident, timeout)
        if code is None:
            self.kill()
            pytest.fail(f"timed out after {timeout} s:\n{self._output()[-4000:]}")
        out = self._output()
        os.remove(self.out)
        return subprocess.CompletedProcess(self.cmd, code, out, "")

    def kill(self):
        if self.server.wait_done(self.ident, 0) is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass
            self.server.wait_done(self.ident, 30)


class _ForkServer:
    """tests/distributed/fork_ranks.py --serve, started at the first launch of a session (it
    imports :data:`FORK_PRELOAD` once) and ended when the session's process exits. Started
    with ``child_env(cpu_only=True)``: it serves the launches whose environment adds
    to that one (see fork_ranks.py)."""

    def __init__(self):
        import atexit
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="mhc-fork-server-")
        self.log = open(os.path.join(self.dir, "server.log"), "w")
        cmd = [sys.executable, str(FORK_RANKS_SCRIPT), "--preload", ",".join(FORK_PRELOAD),
               "--serve"]
        env = {k: v for k, v in child_env(cpu_only=True).items()
               if not k.startswith("PYTEST_")}  # pytest's (PYTEST_CURRENT_TEST) change a test
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, cwd=ROOT, start_new_session=True)
        self.replies: dict[str, dict[str, str]] = {}
        self.alive, self.count = True, 0
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.close)

    def _read(self):
        for raw in self.proc.stdout:
            kind, ident, rest = (raw.decode().rstrip("\n").split(" ", 2) + [""])[:3]
            with self.changed:
                self.replies.setdefault(ident, {})[kind] = rest
                self.changed.notify_all()
        with self.changed:
            self.alive = False
            self.changed.notify_all()

    def _reply(self, ident: str, kinds: tuple[str, ...], timeout: float):
        with self.changed:
            self.changed.wait_for(lambda: not self.alive or any(
                k in self.replies.get(ident, {}) for k in kinds), timeout)
            got = self.replies.get(ident, {})
            return next(((k, got[k]) for k in kinds if k in got), None)

    def submit(self, nproc: int, argv: list[str], env: dict, plain: bool = False):
        """Start a launch (``plain``: one process, see fork_ranks.py); None where the server
        refuses it or is gone."""
        with self.changed:
            if not self.alive:
                return None
            self.count += 1
            ident = str(self.count)
        out = os.path.join(self.dir, f"launch{ident}.out")
        request = {"id": ident, "nproc": nproc, "argv": argv, "env": env, "out": out,
                   "plain": plain}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            return None
        reply = self._reply(ident, ("STARTED", "REFUSED"), 300)
        if reply is None or reply[0] != "STARTED":
            why = reply[1] if reply else "no answer; its log ends:\n" + self._log_tail()
            print(f"fork server: {why}\n(the launch runs on its own)", file=sys.stderr)
            return None
        cmd = [sys.executable, *argv] if plain else [str(FORK_RANKS_SCRIPT), str(nproc), *argv]
        return _ServedLaunch(self, ident, int(reply[1]), out, cmd)

    def _log_tail(self) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-3000:]

    def wait_done(self, ident: str, timeout: float):
        """The launch's exit code, or None if it has not ended within ``timeout`` s."""
        reply = self._reply(ident, ("DONE",), timeout)
        if reply is None and not self.alive:
            return -1
        return None if reply is None else int(reply[1])

    def close(self):
        import shutil

        if self.proc.poll() is None:
            self.proc.stdin.close()  # the server stops what still runs and exits
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_SERVER: _ForkServer | None = None


def _fork_server() -> _ForkServer:
    global _SERVER
    if _SERVER is None:
        _SERVER = _ForkServer()
    return _SERVER


# ------------------------------------------- Megatron's training loop: pretrain_gpt_mhc.py
# The runs of examples/pretrain_gpt_mhc.py that test_pretrain_example.py (GPT) and
# test_pretrain_hybrid.py (HybridModel) launch and compare: the tiny GPT's flags, a short
# fixed-seed schedule on the stdlib corpus, Megatron's local modules over gloo on CPU ranks.
PRETRAIN_EXAMPLE = ROOT / "examples" / "pretrain_gpt_mhc.py"
PRETRAIN_ITERS = 6
# The same initial weights at every TP size on CPU ranks: full weights initialised, then
# split (Megatron's GPT builder leaves such a model on the CPU, so not on GPUs), and a padded
# vocabulary (512) that does not depend on TP.
SAME_INIT = {"cpu": ["--use-cpu-initialization"], "cuda": []}
PRETRAIN_TRAIN_FLAGS = [
    "--make-vocab-size-divisible-by", "256", "--micro-batch-size", "2", "--global-batch-size",
    "4", "--train-iters", str(PRETRAIN_ITERS), "--lr", "1e-3", "--min-lr", "1e-4",
    "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--seed", "1234", "--log-interval",
    "1", "--eval-iters", "1", "--eval-interval", "3", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "257", "--split", "90,5,5", "--log-micro-batch-loss"]
PRETRAIN_BACKEND = {
    "cpu": LOCAL_MODULE_FLAGS + ["--distributed-backend", "gloo"] + CPU_LAUNCH_FLAGS,  # gloo
    # GPUs over NCCL: TE's modules where installed (no apex: its fused wgrad is off)
    "cuda": ["--no-gradient-accumulation-fusion"] if HAVE_TE else LOCAL_MODULE_FLAGS}
MHC_FLAGS = ["--enable-hyper-connections", "--num-residual-streams", "4"]

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
needs_4_gpus = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
needs_te_norms = pytest.mark.skipif(not HAVE_TE, reason="sequence parallel needs TE's norms")
# CPU ranks here; the same checks over NCCL with 2 GPUs
PRETRAIN_DEVICES = ["cpu", pytest.param("cuda", marks=needs_2_gpus)]


def write_pretrain_corpus(directory: Path) -> str:
    """The 1 MB stdlib corpus (examples/prepare_stdlib_corpus.py) under ``directory``; its
    Megatron data prefix."""
    sys.path.insert(0, str(ROOT / "examples"))
    import prepare_stdlib_corpus

    prefix = str(Path(directory) / "stdlib")
    prepare_stdlib_corpus.write_corpus(prefix, max_bytes=1_000_000)
    return prefix


class PretrainRun:
    """A finished run of the example: its output and what Megatron and the example printed
    (``train``: every training micro-batch's loss; ``logged``: Megatron's iteration loss;
    ``grad_norms``: iteration -> gradient norm, with ``--log-grad-norm``; ``mtp``: Megatron's
    logged MTP loss of depth 1 per iteration; ``params``: model parallel rank 0's count)."""

    def __init__(self, proc: subprocess.CompletedProcess):
        import re

        self.returncode, self.out = proc.returncode, proc.stdout + proc.stderr
        self.train = [float(v) for v in re.findall(
            r"\[micro-batch loss\] train ([-0-9.eE+]+)", self.out)]
        self.logged = {int(i): float(v) for i, v in re.findall(
            r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([-+0-9.Ee]+) \|", self.out)}
        self.valid = [float(v) for v in re.findall(
            r"validation loss at iteration \d+ \| lm loss value: ([-+0-9.Ee]+)", self.out)]
        self.grad_norms = {int(i): float(v) for i, v in re.findall(
            r"\[grad norm\] (\d+) ([-+0-9.Ee]+)", self.out)}
        self.mtp = [float(v) for v in re.findall(r"mtp_1 loss: ([-+0-9.Ee]+)", self.out)]
        params = re.findall(r"number of parameters on \(tensor, .*?\) model parallel rank "
                            r"\(0, .*?\): (\d+)", self.out)
        self.params = int(params[0]) if params else None

    def ok(self):
        assert self.returncode == 0, self.out[-6000:]
        return self


def pretrain_cmd(corpus: str, flags, device: str, model=None) -> list[str]:
    """The example's command line: the tiny GPT (``model``, default ``TINY_GPT_FLAGS``), the
    schedule, the device's backend, then ``flags`` (which may override any of them)."""
    return [str(PRETRAIN_EXAMPLE), *(TINY_GPT_FLAGS if model is None else model),
            *PRETRAIN_TRAIN_FLAGS, "--data-path", corpus, *PRETRAIN_BACKEND[device],
            *SAME_INIT[device], *flags]


def pretrain(corpus: str, *flags, nproc=1, device="cpu", timeout=600,
             wrapper=None, env=None, model=None) -> PretrainRun:
    """A run of the example (:func:`run_ranks`); ``wrapper``: a script that runs the
    example script given as its first argument (e.g. tests/gpu_child/without_te.py);
    ``env``: environment variables to set or override; ``model``: the model's flags
    (default ``TINY_GPT_FLAGS``)."""
    example = [*([str(wrapper)] if wrapper else []),
               *pretrain_cmd(corpus, flags, device, model)]
    return PretrainRun(run_ranks(nproc, *example,
                                 env=child_env(cpu_only=device == "cpu", **(env or {})),
                                 timeout=timeout))


_PRETRAIN_RUNS: dict = {}


def shared_run(corpus: str, *flags, nproc=1, device="cpu", wrapper=None) -> PretrainRun:
    """A finished, successful run, computed once per session for the same flags."""
    key = (corpus, flags, nproc, device, wrapper)
    if key not in _PRETRAIN_RUNS:
        _PRETRAIN_RUNS[key] = pretrain(corpus, *flags, nproc=nproc, device=device,
                                       wrapper=wrapper).ok()
    return _PRETRAIN_RUNS[key]


def assert_close(a, b, rtol):
    """Two non-empty sequences of the same length, element by element within ``rtol`` of
    ``b``."""
    assert len(a) == len(b) and a, (a, b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rtol * abs(y), f"step {i + 1}: {x} vs {y}\n{a}\n{b}"


class SavedAtIteration3:
    """``saved(dest, *flags, nproc=1, device="cpu") -> PretrainRun``: the run of ``flags``
    interrupted at iteration 3 (``--save-interval 3 --exit-interval 3``: Megatron saves and
    exits), made once for all the tests that resume from it; each test gets its own copy of
    the checkpoint at ``dest`` (a resumed run may save into it). ``tmp_path_factory``:
    pytest's, for the saved checkpoints."""

    def __init__(self, corpus: str, tmp_path_factory):
        self.corpus, self.tmp_path_factory, self.saved = corpus, tmp_path_factory, {}

    def __call__(self, dest: Path, *flags, nproc=1, device="cpu") -> PretrainRun:
        import shutil

        key = (flags, nproc, device)
        if key not in self.saved:
            ckpt = self.tmp_path_factory.mktemp("saved") / "ckpt"
            run = pretrain(self.corpus, *flags, "--save", str(ckpt), "--save-interval", "3",
                           "--exit-interval", "3", nproc=nproc, device=device)
            self.saved[key] = (ckpt, run)
        ckpt, run = self.saved[key]
        if run.returncode == 0:
            shutil.copytree(ckpt, dest)
        return run


SUBLAYER_VARIANTS = ["fold", "no_fold", "dh_pre", "broadcast", "bias", "main_grads"]


def skip_without_host_replay() -> None:
    """Skip the calling test where the ops' host replay (and so their C++ autograd nodes)
    cannot run: no CUDA, or the extension off or not built here."""
    from mhc_megatron.kernels import host_replay

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (compiled Triton kernels)")
    reason = host_replay.unavailable()
    if reason is not None:
        pytest.skip(f"the host replay is off here: {reason}")


def sublayer_inputs(T: int, C: int, n: int) -> tuple:
    """``(x [T, n*C] bf16, phi, alpha, bias)`` on CUDA for the Triton ops, all requiring grad."""
    m = 2 * n + n * n
    x = torch.randn(T, n * C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    phi = (0.02 * torch.randn(m, n * C, device="cuda")).requires_grad_()
    alpha = torch.full((3,), 0.3, device="cuda", requires_grad=True)
    bias = torch.zeros(m, device="cuda", requires_grad=True)
    return x, phi, alpha, bias


def sublayer_ops_case(variant: str, seed: int = 0, T: int = 37, C: int = 96, n: int = 4,
                      strided_grad: bool = False):
    """One sublayer's Triton ops (pre, then combine of ``1.25 y``) forward and backward on CUDA
    in ``variant`` (one of :data:`SUBLAYER_VARIANTS`; ``fold``: combine on pre's x, whose dx pass takes combine's; ``no_fold``:
    combine on another x; ``dh_pre``: a gradient for ``h_pre`` too; ``broadcast``: global layer
    1's broadcast streams; ``bias``: a sublayer bias; ``main_grads``: Megatron's
    ``main_grad`` protocol, gradient-accumulation fusion), with a random upstream gradient
    (``strided_grad``: a strided one). Returns ``(tensors, (pre's node name, combine's))``:
    the outputs and every gradient, cloned."""
    from mhc_megatron.kernels import triton_mhc
    from mhc_megatron.layers.streams import broadcast_streams

    g = torch.Generator(device="cuda").manual_seed(seed)
    m = 2 * n + n * n
    dev = "cuda"
    phi = (0.02 * torch.randn(m, n * C, device=dev, generator=g)).requires_grad_()
    alpha = torch.full((3,), 0.3, device=dev, requires_grad=True)
    bias = (0.1 * torch.randn(m, device=dev, generator=g)).requires_grad_()
    h = torch.randn(T, 1, C, device=dev, dtype=torch.bfloat16, generator=g)
    if variant == "broadcast":
        emb = h.requires_grad_()
        x = broadcast_streams(emb, n).view(T, n, C)
        leaf, n_arg = emb, None
    else:
        x = torch.randn(T, n * C, device=dev, dtype=torch.bfloat16,
                        generator=g).requires_grad_()
        leaf, n_arg = x, n
    if variant == "main_grads":
        for p in (phi, alpha, bias):
            p.main_grad = torch.zeros_like(p)
            p.grad_added_to_main_grad = False
    y, h_pre, h_post, h_res = triton_mhc.pre(x, phi, alpha, bias, 20, 1e-6, n=n_arg,
                                             main_grads=variant == "main_grads")
    f = y * 1.25
    f_bias = (0.1 * torch.randn(C, device=dev, dtype=torch.bfloat16,
                                generator=g)).requires_grad_() if variant == "bias" else None
    x_in = x.detach().requires_grad_() if variant == "no_fold" else x
    out = triton_mhc.combine(x_in, f, f_bias, h_res, h_post, n=n_arg)
    names = (y.grad_fn.name(), out.grad_fn.name())
    up = torch.randn(out.shape, device=dev, dtype=out.dtype, generator=g)
    if strided_grad:  # an upstream gradient the recipes were not recorded for
        up = torch.randn(*out.shape[:-1], 2 * out.shape[-1], device=dev, dtype=out.dtype,
                         generator=g)[..., ::2]
    grads = [up]
    outputs = [out]
    if variant == "dh_pre":
        outputs.append(h_pre)
        grads.append(torch.arange(n, device=dev, dtype=torch.float32).repeat(T, 1))
    torch.autograd.backward(outputs, grads)
    got = [t.grad for t in (leaf, phi, alpha, bias)]
    if variant == "main_grads":
        assert all(p.grad_added_to_main_grad for p in (phi, alpha, bias))
        got = [leaf.grad] + [p.main_grad for p in (phi, alpha, bias)]
    extra = [x_in.grad] if variant == "no_fold" else [f_bias.grad] if variant == "bias" else []
    return [t.detach().clone() for t in (y, h_pre, h_post, h_res, out, *got, *extra)], names
