"""Train a small Megatron-Core GPT twice -- standard residual vs mHC -- and compare.

The corpus is the Python standard library's own source (every ``*.py`` file under
``sysconfig.get_paths()["stdlib"]``, sorted, concatenated), tokenised as raw bytes
(vocabulary 256), so it exists on any machine and nothing is downloaded. The last 5% of
the bytes are held out for validation.

Both runs use the same seed, data order, optimiser and step count; the baseline is built
from Megatron-Core's own ``get_gpt_decoder_block_spec``, the mHC run from
``mhc_megatron.specs.get_gpt_decoder_block_with_mhc_spec`` with
``enable_hyper_connections=True, num_residual_streams=4``.

``--model hybrid``: the same layers as Megatron-Core's ``HybridModel`` (pattern ``"*-"`` per
GPT layer: an attention layer and an MLP layer, each one residual sublayer with its own
hyper-connection), built with ``mhc_megatron.specs.get_hybrid_stack_with_mhc_spec``; the
baseline is that model with ``enable_hyper_connections=False`` (Megatron's hybrid model).

Output: a progress bar per run, a loss table on stdout, and under ``--out``:
``loss_curves.png`` (train and validation loss of both runs) and ``results.json``. Log
records and warnings print above the progress bar; the third-party notices that the
test-suite hides (``mhc_testing.warning_filters``) are hidden here too.

    python examples/train_gpt_mhc.py                 # CPU: a few minutes
    python examples/train_gpt_mhc.py --preset gpu    # default when CUDA is present
    python examples/train_gpt_mhc.py --model hybrid  # the same as a HybridModel
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import logging
import math
import os
import sys
import sysconfig
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

# mhc_testing (CPU shims, warning filters) is test support kept in the repository, not in the
# installed package: import it from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

PRESETS = {
    # layers, hidden, heads, seq, batch, steps, lr, eval_every
    "cpu": dict(layers=4, hidden=128, heads=4, seq=128, batch=16, steps=300, lr=2e-3, eval_every=25),
    "gpu": dict(layers=8, hidden=512, heads=8, seq=256, batch=32, steps=800, lr=1e-3, eval_every=50),
    "smoke": dict(layers=2, hidden=32, heads=4, seq=32, batch=4, steps=6, lr=2e-3, eval_every=3),
    # ~85M parameters (12 x 768, GELU MLP 4x): examples/mhc_study.py on a GPU
    "study": dict(layers=12, hidden=768, heads=12, seq=512, batch=32, steps=600, lr=1e-3,
                  eval_every=50),
}


def parse_args(argv=None, extra_arguments=None, description=None):
    """The demo's flags; ``extra_arguments(parser)`` adds a caller's own (examples/mhc_study.py
    adds its group, so one parser sees every flag). Exact flag names only (no abbreviations,
    as Megatron's parser): ``--seed`` is never taken for a longer flag."""
    p = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model/run size; default: gpu when CUDA is available, else cpu")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--model", choices=("gpt", "hybrid"), default="gpt",
                   help="Megatron's GPTModel, or its HybridModel with the pattern '*-' per GPT "
                        "layer (attention, MLP: one residual sublayer, one hyper-connection "
                        "each)")
    p.add_argument("--streams", type=int, default=4, help="mHC residual streams n")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--corpus-mb", type=float, default=8.0, help="bytes of stdlib source to use")
    p.add_argument("--out", default="out/demo", help="directory for the plot and results")
    p.add_argument("--spec", choices=("local", "te"), default="local",
                   help="Megatron's local modules, or Transformer Engine's (needs TE and CUDA)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp8"), default="fp32",
                   help="fp32: fp32 weights and math (TF32 matmuls on CUDA); bf16: bf16 weights "
                        "and activations (Megatron's Float16Module) with fp32 master weights in "
                        "the optimiser; fp8: bf16 plus Transformer Engine's fp8 GEMMs (delayed "
                        "scaling, E4M3 forward / E5M2 backward; needs --spec te and an H100/H200). "
                        "The mHC mapping math is fp32 in all three")
    for key in PRESETS["cpu"]:
        p.add_argument(f"--{key.replace('_', '-')}", type=type(PRESETS["cpu"][key]), default=None)
    p.add_argument("--attention", choices=("megatron", "sdpa"), default="megatron",
                   help="core attention of both runs: the spec's own (megatron), or causal "
                        "torch SDPA (flash attention on CUDA; local spec only)")
    p.add_argument("--mhc-params", choices=("params", "fp32"), default="params",
                   help="storage of the mHC mapping parameters: the model's params_dtype "
                        "(mhc_params_dtype's default; bf16 with --precision bf16/fp8) or fp32")
    if extra_arguments is not None:
        extra_arguments(p)
    args = p.parse_args(argv)
    if args.precision == "fp8" and args.spec != "te":
        p.error("--precision fp8 needs --spec te (the fp8 GEMMs are Transformer Engine's)")
    if args.attention == "sdpa" and args.spec != "local":
        p.error("--attention sdpa replaces the local spec's core attention: use --spec local")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = PRESETS[args.preset or ("gpu" if args.device == "cuda" else "cpu")]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# -------------------------------------------------------------------------- console
class _AboveProgressBars(logging.Handler):
    """Prints log records with ``tqdm.write``: above the progress bars, never into one."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))

    def emit(self, record):
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:  # logging's contract: report, never raise
            self.handleError(record)


@contextlib.contextmanager
def console():
    """The demo's console for the duration of the block: the third-party warnings and log
    lines the test-suite hides are hidden (``mhc_testing.warning_filters``, installed before
    Megatron is imported), and log records and the remaining warnings print with
    ``tqdm.write``, on stdout with the progress bars. Logging and ``warnings.showwarning``
    are restored on exit."""
    from tqdm import tqdm

    from mhc_testing import warning_filters

    warning_filters.install()
    handler, root = _AboveProgressBars(), logging.getLogger()
    showwarning = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        tqdm.write(warnings.formatwarning(message, category, filename, lineno, line).rstrip(),
                   file=sys.stdout)

    root.addHandler(handler)  # also makes mhc_megatron's stand-by stderr handler step aside
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = showwarning
        root.removeHandler(handler)


# ----------------------------------------------------------------------------- data
def load_stdlib_corpus(max_bytes: int) -> np.ndarray:
    """The stdlib's ``*.py`` sources as one uint8 array (deterministic order)."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    chunks, total = [], 0
    for path in files:
        if "site-packages" in path:
            continue
        with open(path, "rb") as fh:
            data = fh.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 1_000_000:
        raise RuntimeError(f"only {total} bytes of Python source found under {root}")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


class Batches:
    """Random windows of ``seq + 1`` bytes; a fixed generator gives both runs the same data."""

    def __init__(self, data: np.ndarray, seq: int, batch: int, seed: int, device,
                 causal_attention: bool = False):
        self.data = torch.from_numpy(data.astype(np.int64))
        self.seq, self.batch, self.device = seq, batch, device
        self.gen = torch.Generator().manual_seed(seed)
        self.position_ids = torch.arange(seq, device=device).expand(batch, seq)
        self.mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1)[None, None]
        if causal_attention:  # SDPA's causal kernels need no mask
            self.mask = None

    def next(self):
        starts = torch.randint(0, len(self.data) - self.seq - 1, (self.batch,), generator=self.gen)
        windows = torch.stack([self.data[s:s + self.seq + 1] for s in starts.tolist()])
        if torch.device(self.device).type == "cuda":  # pinned: the copy does not wait for the
            windows = windows.pin_memory().to(self.device, non_blocking=True)  # GPU's queue
        return windows[:, :-1], windows[:, 1:]


def make_batches(data: np.ndarray, args, seed: int) -> Batches:
    """The run's batches of ``data`` (no mask with ``--attention sdpa``: it is causal)."""
    return Batches(data, args.seq, args.batch, seed, args.device,
                   causal_attention=args.attention == "sdpa")


# ---------------------------------------------------------------------------- model
def setup_megatron(device: str, seed: int) -> bool:
    """One-rank process group + Megatron parallel state; True if this call created them."""
    from megatron.core import parallel_state

    from mhc_testing.cpu import init_single_process_group, setup_cpu_megatron

    if device == "cpu" and torch.cuda.is_available():
        raise SystemExit("--device cpu on a CUDA machine is not supported by this demo")
    created = not torch.distributed.is_initialized()
    init_single_process_group()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    setup_cpu_megatron(seed)
    if device == "cuda":  # --precision fp32: TF32 matmuls
        torch.backends.cuda.matmul.allow_tf32 = True
    return created


def teardown_megatron() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def build_model(mhc: bool, args, mhc_overrides: dict | None = None):
    """The run's GPT; ``mhc_overrides``: more ``MHCTransformerConfig`` fields (e.g. the
    initial static mapping, for examples/mhc_study.py)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from mhc_megatron.config import MHCTransformerConfig
    from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec

    from mhc_testing.cpu import setup_cpu_megatron

    setup_cpu_megatron(args.seed)  # same RNG state for both runs
    low = args.precision in ("bf16", "fp8")
    config = MHCTransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.bfloat16 if low else torch.float32, bf16=low,
        fp8="hybrid" if args.precision == "fp8" else None, fp8_recipe="delayed",
        init_method_std=0.02, enable_hyper_connections=mhc, num_residual_streams=args.streams,
        **{"mhc_params_dtype": torch.float32 if args.mhc_params == "fp32" else None,
           **(mhc_overrides or {})},
    )
    te = args.spec == "te"
    if args.model == "hybrid":
        model = build_hybrid_model(config, args)
    else:
        if mhc:
            spec = get_gpt_decoder_block_with_mhc_spec(config, use_transformer_engine=te,
                                                       normalization="RMSNorm")
        else:
            spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te,
                                              normalization="RMSNorm")
        if args.attention == "sdpa":
            from mhc_testing.attention import SDPACoreAttention

            for layer_spec in spec.layer_specs:
                layer_spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        model = GPTModel(config, spec, vocab_size=256, max_sequence_length=args.seq,
                         position_embedding_type="rope")
    model = model.to(args.device)
    if low:  # bf16 weights and activations, fp32 logits: what Megatron's training loop does
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def hybrid_layer_pattern(layers: int) -> str:
    """The hybrid pattern of a GPT with ``layers`` layers: an attention and an MLP layer each."""
    return "*-" * layers


def build_hybrid_model(config, args):
    """The GPT's layers as Megatron's ``HybridModel`` (:func:`hybrid_layer_pattern`), with
    the mHC hybrid stack spec (mHC on or off per ``config``). Megatron's hybrid config counts
    pattern symbols as layers (``num_layers = 2 * layers``, ``is_hybrid_model``: the output
    projections' scaled init is then the GPT's)."""
    import dataclasses

    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from mhc_megatron.specs import get_hybrid_stack_with_mhc_spec

    pattern = hybrid_layer_pattern(args.layers)
    config = dataclasses.replace(config, num_layers=len(pattern), is_hybrid_model=True)
    spec = get_hybrid_stack_with_mhc_spec(config, use_transformer_engine=args.spec == "te")
    if args.attention == "sdpa":
        from mhc_testing.attention import SDPACoreAttention

        attention = spec.submodules.attention_layer
        self_attention = attention.submodules.self_attention
        spec.submodules.attention_layer = dataclasses.replace(attention, submodules=(
            dataclasses.replace(attention.submodules, self_attention=dataclasses.replace(
                self_attention, submodules=dataclasses.replace(
                    self_attention.submodules, core_attention=SDPACoreAttention)))))
    return HybridModel(config, spec, vocab_size=256, max_sequence_length=args.seq,
                       hybrid_layer_pattern=pattern, position_embedding_type="rope")


def fused_on(params) -> bool:
    """Whether AdamW runs as torch's fused kernels for ``params`` (all on CUDA): one launch
    set for all parameters, as Megatron's fused Adam, instead of the multi-tensor path, whose
    host time grows with the number of parameters (per parameter Python each step)."""
    return all(p.is_cuda for p in params)


class MasterWeightAdamW:
    """AdamW on fp32 master copies of bf16 weights (Megatron's mixed-precision optimiser,
    reduced to one rank): grads are copied up, clipped and applied in fp32, then the bf16
    weights are refreshed from the masters. A parameter already in fp32 (mHC's mapping
    parameters with ``--mhc-params fp32``) is its own master, as in Megatron's optimiser: its
    gradient is clipped and applied where it is, with no copy either way (the same values).
    ``groups``: AdamW parameter groups (dicts with ``params`` and per-group options such as
    ``weight_decay``)."""

    def __init__(self, groups: list[dict], clip: float, **adamw):
        self.params, self.low, master_groups = [], [], []
        for group in groups:
            params = [p for p in group["params"] if p.requires_grad]
            self.params += params
            masters = [p if p.dtype == torch.float32 else p.detach().float().clone()
                       for p in params]
            self.low += [(p, m) for p, m in zip(params, masters) if m is not p]
            master_groups.append({**group, "params": masters})
        self.master = [m for g in master_groups for m in g["params"]]
        for _, m in self.low:  # fp32 gradient buffers of the bf16 weights, refilled every step
            m.grad = torch.zeros_like(m)
        self.master_grads = [m.grad for _, m in self.low]
        self.clip = clip
        self.inner = torch.optim.AdamW(master_groups, fused=fused_on(self.master), **adamw)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        # one multi-tensor copy each way (the same values as a copy per parameter: exact up,
        # round-to-nearest down), not two launches per parameter
        low = self.low  # (empty where every parameter is fp32)
        with torch.no_grad():
            if low:
                torch._foreach_copy_(self.master_grads, [p.grad for p, _ in low])
        torch.nn.utils.clip_grad_norm_(self.master, self.clip)
        self.inner.step()
        with torch.no_grad():
            if low:
                torch._foreach_copy_([p for p, _ in low], [m for _, m in low])


# ---------------------------------------------------------------------------- train
@dataclass
class RunResult:
    name: str
    steps: list
    train_loss: list
    val_steps: list
    val_loss: list
    seconds: float  # wall time of the steps and evaluations, without ``on_eval``'s
    params: int
    on_eval_seconds: float = 0.0  # wall time of the ``on_eval`` calls (a study's diagnostics)


def read_losses(name: str, losses: list, first_step: int) -> list[float]:
    """The steps' losses (0-dim tensors on the device, the first of step ``first_step``) as
    floats, read back in one copy; a run whose loss is not finite stops here, naming the step."""
    values = torch.stack(losses).tolist()
    for i, value in enumerate(values):
        if not math.isfinite(value):
            raise RuntimeError(f"{name}: loss became {value} at step {first_step + i}")
    return values


def evaluate(model, val: Batches, batches: int = 8) -> float:
    """The mean loss over ``batches`` validation batches, read back from the device once."""
    model.eval()
    model.set_is_first_microbatch()  # fp8: weights re-quantised after the last optimiser step
    losses = []
    with torch.no_grad():
        for _ in range(batches):
            ids, labels = val.next()
            losses.append(model(ids, val.position_ids, val.mask, labels=labels).float().mean())
    model.train()
    return float(np.mean(torch.stack(losses).tolist()))


def param_groups(model, weight_decay: float, decay_1d: bool):
    """AdamW groups: with ``decay_1d=False`` Megatron's convention (no weight decay on 1-D
    parameters and biases: norms, mHC's ``alpha`` and ``bias``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if decay_1d:
        return [{"params": params, "weight_decay": weight_decay}]
    no_wd = [p for n, p in model.named_parameters()
             if p.requires_grad and (p.dim() == 1 or n.endswith(".bias"))]
    ids = {id(p) for p in no_wd}
    return [{"params": [p for p in params if id(p) not in ids], "weight_decay": weight_decay},
            {"params": no_wd, "weight_decay": 0.0}]


def train(name: str, mhc: bool, args, train_data, val_data, mhc_overrides=None, on_eval=None,
          decay_1d: bool = True) -> RunResult:
    """One run. ``on_eval(step, model, val_batches)`` runs at every evaluation, after the
    optimiser step (the step's gradients are still on the parameters); its time (device
    synchronised around it) is kept apart from ``seconds``, so that instrumentation of one run
    (the study's mHC diagnostics) does not count as that run's training time.

    The steps do not wait for the device: each step's loss stays on it until the next
    evaluation, which reads the losses back in one copy and stops the run at the first one
    that is not finite. So the host queues a step's forward while the device still runs the
    step before, as Megatron's own loop does between its logging intervals."""
    from tqdm import tqdm

    model = build_model(mhc, args, mhc_overrides)
    n_params = sum(p.numel() for p in model.parameters())
    adamw = dict(lr=args.lr, betas=(0.9, 0.95))
    groups = param_groups(model, 0.1, decay_1d)
    if args.precision == "fp32":
        opt = torch.optim.AdamW(groups, fused=fused_on(p for g in groups for p in g["params"]),
                                **adamw)
        sched_opt = opt
    else:
        opt = MasterWeightAdamW(groups, clip=1.0, **adamw)
        sched_opt = opt.inner
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        sched_opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    batches = make_batches(train_data, args, args.seed)
    result = RunResult(name, [], [], [], [], 0.0, n_params)
    pending = []  # the losses of the steps since the last evaluation, on the device
    start = time.time()
    bar = tqdm(range(1, args.steps + 1), desc=f"{name:>14}", file=sys.stdout, dynamic_ncols=True,
               mininterval=1.0)
    for step in bar:
        ids, labels = batches.next()
        # fp8: TE caches its fp8 weights between micro-batches; Megatron's schedule marks each
        # step's first one so they are re-quantised after the optimiser step (no-op otherwise).
        model.set_is_first_microbatch()
        loss = model(ids, batches.position_ids, batches.mask, labels=labels).float().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.precision == "fp32":  # MasterWeightAdamW clips its fp32 masters itself
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        pending.append(loss.detach())
        result.steps.append(step)
        if step % args.eval_every == 0 or step == args.steps:
            result.train_loss += read_losses(name, pending, first_step=step + 1 - len(pending))
            pending.clear()
            val = make_batches(val_data, args, args.seed + 1)
            result.val_steps.append(step)
            result.val_loss.append(evaluate(model, val))
            if on_eval is not None:
                if args.device == "cuda":
                    torch.cuda.synchronize()
                eval_start = time.time()
                on_eval(step, model, make_batches(val_data, args, args.seed + 1))
                if args.device == "cuda":
                    torch.cuda.synchronize()
                result.on_eval_seconds += time.time() - eval_start
            bar.set_postfix(loss=f"{result.train_loss[-1]:.3f}", val=f"{result.val_loss[-1]:.3f}")
    if args.device == "cuda":
        torch.cuda.synchronize()
    result.seconds = time.time() - start - result.on_eval_seconds
    return result


def smooth(values, window=10):
    out, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-window:]
        out.append(sum(acc) / len(acc))
    return out


def report(results: list[RunResult], args) -> str:
    base, mhc = results
    lines = [f"{'step':>6} | {'train base':>10} {'train mHC':>10} | {'val base':>9} {'val mHC':>9}"]
    sb, sm = smooth(base.train_loss), smooth(mhc.train_loss)
    for i, step in enumerate(base.val_steps):
        k = step - 1
        lines.append(f"{step:>6} | {sb[k]:>10.4f} {sm[k]:>10.4f} | "
                     f"{base.val_loss[i]:>9.4f} {mhc.val_loss[i]:>9.4f}")
    ln2 = math.log(2)
    lines.append("")
    for r in results:
        lines.append(f"{r.name:>14}: final val loss {r.val_loss[-1]:.4f} nats/byte "
                     f"({r.val_loss[-1] / ln2:.3f} bits/byte), {r.params / 1e6:.2f} M params, "
                     f"{r.seconds:.1f} s ({1000 * r.seconds / len(r.steps):.0f} ms/step)")
    delta = mhc.val_loss[-1] - base.val_loss[-1]
    lines.append(f"mHC - baseline final val loss: {delta:+.4f} nats/byte")
    return "\n".join(lines)


def plot(results: list[RunResult], path: str, title: str) -> None:
    """Left: the whole run. Right: the last half, zoomed, with the final values written on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (full, zoom) = plt.subplots(1, 2, figsize=(13, 5))
    colors = ("tab:blue", "tab:red")
    for ax in (full, zoom):
        for r, color in zip(results, colors):
            ax.plot(r.steps, smooth(r.train_loss), color=color, alpha=0.45, lw=1,
                    label=f"{r.name} train (10-step mean)")
            ax.plot(r.val_steps, r.val_loss, color=color, marker="o", ms=3, lw=2,
                    label=f"{r.name} validation")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats / byte)")
        ax.grid(alpha=0.3)
    full.set_title("whole run", fontsize=10)
    full.legend()

    half = results[0].steps[len(results[0].steps) // 2]
    shown = []
    for r in results:
        shown += [v for s, v in zip(r.steps, smooth(r.train_loss)) if s >= half]
        shown += [v for s, v in zip(r.val_steps, r.val_loss) if s >= half]
    pad = 0.08 * (max(shown) - min(shown) or 1.0)
    zoom.set_xlim(half, results[0].steps[-1])
    zoom.set_ylim(min(shown) - pad, max(shown) + pad)
    zoom.text(0.98, 0.97, "final validation loss", transform=zoom.transAxes, ha="right",
              va="top", fontsize=9)
    for k, (r, color) in enumerate(zip(results, colors)):
        zoom.axhline(r.val_loss[-1], color=color, ls="--", lw=0.8, alpha=0.7)
        zoom.text(0.98, 0.91 - 0.06 * k, f"{r.name}: {r.val_loss[-1]:.4f}",
                  transform=zoom.transAxes, ha="right", va="top", color=color, fontsize=9,
                  fontweight="bold")
    delta = results[1].val_loss[-1] - results[0].val_loss[-1]
    zoom.set_title(f"last half, zoomed (dashed: final validation; mHC - baseline = {delta:+.4f})",
                   fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def model_size(args) -> str:
    """The model's layers and width, for the console."""
    if args.model == "hybrid":
        return (f"{model_label(args)} ({2 * args.layers} layers: {args.layers} GPT layers) x "
                f"{args.hidden} hidden")
    return f"{args.layers} layers x {args.hidden} hidden"


def model_label(args) -> str:
    """The model, for the console and titles: ``--model``."""
    if args.model == "hybrid":
        return f"HybridModel '{hybrid_layer_pattern(args.layers)}'"
    return "GPT"


def mhc_params_label(args) -> str:
    """Where the mHC mapping parameters are stored, for titles: ``--mhc-params``."""
    if args.mhc_params == "fp32":
        return "mHC mappings in fp32"
    dtype = "bf16" if args.precision in ("bf16", "fp8") else "fp32"
    return f"mHC mappings in {dtype} (params dtype)"


def main(argv=None):
    args = parse_args(argv)
    with console():
        return _run(args)


def _run(args):
    if args.device == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    os.makedirs(args.out, exist_ok=True)
    owns_process_group = setup_megatron(args.device, args.seed)
    corpus = load_stdlib_corpus(int(args.corpus_mb * 1e6))
    split = int(0.95 * len(corpus))
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"corpus: {len(corpus) / 1e6:.1f} MB of Python stdlib source (byte tokens); "
          f"device: {device_name}; model: {model_size(args)}, "
          f"seq {args.seq}, batch {args.batch}, {args.steps} steps; {args.spec} spec, "
          f"{args.precision}")
    results = [
        train("baseline", False, args, corpus[:split], corpus[split:]),
        train(f"mHC n={args.streams}", True, args, corpus[:split], corpus[split:]),
    ]
    table = report(results, args)
    print("\n" + table)
    title = (f"Megatron-Core {model_label(args)} on Python stdlib bytes ({device_name}): "
             f"residual vs mHC n={args.streams}\n"
             f"{args.layers}L x {args.hidden}, seq {args.seq}, batch {args.batch}, "
             f"{args.spec} spec, {args.precision}, {mhc_params_label(args)}")
    plot(results, os.path.join(args.out, "loss_curves.png"), title)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump({"args": vars(args), "device": device_name,
                   "runs": [r.__dict__ for r in results]}, fh, indent=1)
    print(f"\nwrote {args.out}/loss_curves.png and {args.out}/results.json")
    if owns_process_group:
        teardown_megatron()
    return results


if __name__ == "__main__":
    main()
