"""Megatron's combined 1F1B schedules (the MoE EP-overlap schedule) on two CPU ranks: mHC models
trained through them equal the same models through the plain schedules, bit for bit.

Run: MHC_DIST_DEVICE=cpu torchrun --nproc-per-node=2 tests/distributed/combined_1f1b_cpu.py

With ``overlap_moe_expert_parallel_comm`` Megatron's schedules build each micro-batch's model
schedule plan and run micro-batch i+1's forward interleaved with micro-batch i's backward,
layer by layer and node by node (``combined_1f1b.py``): the no-pipelining schedule (each
rank on its own, the same data) and the interleaved pipeline schedule (PP=2 with 2 virtual
stages, the streams crossing the stage boundaries). Megatron allows the overlap only with
EP > 1, the alltoall (or flex) dispatcher and CUDA; here the flag is set after the config's
validation, with EP=1 (allgather without pipelining, alltoall with it), and CUDA's streams
and events are stand-ins (``mhc_testing.cpu_training``'s CUDA -> CPU shims, a
no-op event and ``record_stream``; no node frees its input, as Megatron would for the
alltoall dispatcher's copies). What this checks is the schedule's order and its hand-over of
tensors and gradients between nodes with mHC layers: 4 micro-batches, every loss and every
gradient against the plain schedule's, and that the schedule built a plan for each
micro-batch. The overlap with EP=2 on GPUs:
``ep_overlap_equivalence.py``.
"""

from __future__ import annotations

import harness  # noqa: F401  (first: hides TE on CPU ranks)
import torch

from helpers import batch, build_gpt, moe_overrides

MICRO = 4


class _Event:
    """Stands in for ``torch.cuda.Event`` (one CPU stream: every wait is satisfied)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _stand_ins() -> None:
    from megatron.core.models.common import utils

    torch.cuda.Event = _Event
    torch.Tensor.record_stream = lambda self, stream: None
    utils.TransformerLayerNode._resolve_free_input = staticmethod(lambda *args: False)


def _config(kind: str, mhc: bool):
    extra = dict(moe_overrides())
    if kind == "mix":  # a dense layer, then a MoE layer (the schedule's last layer is MoE)
        extra["moe_layer_freq"] = [0, 1]
    if kind == "mtp":
        extra["mtp_num_layers"] = 1
    return harness.config(enable_hyper_connections=mhc, **extra)


def _plans_counted(counter: list):
    """:func:`mean_loss_forward_step`, counting the schedule plans it builds."""
    from mhc_testing.schedules import mean_loss_forward_step

    def forward_step(data_iterator, model, return_schedule_plan=False):
        counter.append(return_schedule_plan)
        return mean_loss_forward_step(data_iterator, model, return_schedule_plan)

    return forward_step


def _run(kind: str, mhc: bool, overlap: bool):
    """4 micro-batches through Megatron's no-pipelining schedule: (losses, gradients, plans
    built)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from helpers import SEQ

    harness.init_parallel()  # the same seed: the same initial weights in both runs
    cfg = _config(kind, mhc)
    model = build_gpt(cfg)
    cfg.overlap_moe_expert_parallel_comm = overlap  # after validation (see the docstring)
    data = iter([batch(batch_size=2, seed=10 + i) for i in range(MICRO)])
    plans = []
    out = get_forward_backward_func()(
        forward_step_func=_plans_counted(plans), data_iterator=data, model=model,
        num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=2, forward_only=False)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [d["loss"] for d in out], grads, sum(plans)


def _run_pipelined(kind: str, mhc: bool, overlap: bool):
    """The same through Megatron's interleaved schedule at PP=2 x 2 virtual stages (the
    chunks of ``pp_equivalence.py``): (this rank's losses, gradients by chunk, plans)."""
    import dataclasses

    import pp_equivalence as pp

    harness.init_parallel(pp=2, vp=2)
    cfg = dataclasses.replace(pp._config(kind, 2, 2, False), enable_hyper_connections=mhc)
    chunks = [model for model, _ in pp._chunks(cfg, 2)]
    for model in chunks:
        model.config.overlap_moe_expert_parallel_comm = overlap  # after validation
    plans = []
    losses = pp._run(chunks, cfg, 2, forward_step=_plans_counted(plans))
    grads = {(i, n): p.grad.clone() for i, model in enumerate(chunks)
             for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads, sum(plans)


def _assert_equal(plain, overlapped, label: str, plans_expected: int) -> None:
    """The overlapped run built ``plans_expected`` schedule plans (the plain run none) and
    gave the plain run's losses and gradients."""
    (losses, grads, plans), (losses2, grads2, plans2) = plain, overlapped
    assert plans == 0 and plans2 == plans_expected, (label, plans, plans2)
    assert len(losses2) == len(losses) and all(
        torch.equal(a, b) for a, b in zip(losses, losses2)), (label, losses, losses2)
    assert sorted(grads) == sorted(grads2), label
    for n in grads:
        if "embedding.word_embeddings.weight" in str(n):  # shared with the output layer: its
            # contributions add up in another order under the schedule
            torch.testing.assert_close(grads2[n], grads[n], rtol=1e-6, atol=1e-9)
        else:
            assert torch.equal(grads2[n], grads[n]), (label, n)


def check(kind: str, mhc: bool) -> None:
    rank = torch.distributed.get_rank()
    plain = _run(kind, mhc, overlap=False)
    _assert_equal(plain, _run(kind, mhc, overlap=True), f"{kind} mhc={mhc}", MICRO)
    n_mhc = sum("hyper_connection" in n for n in plain[1])
    assert n_mhc == (0 if not mhc else 18 if kind == "mtp" else 12), n_mhc
    print(f"PASS rank={rank} combined_1f1b kind={kind} mhc={mhc} micro_batches={MICRO} "
          f"losses and gradients equal the plain schedule's, mhc_params={n_mhc}", flush=True)


def check_pipelined(kind: str, mhc: bool) -> None:
    rank = torch.distributed.get_rank()
    _assert_equal(_run_pipelined(kind, mhc, overlap=False),
                  _run_pipelined(kind, mhc, overlap=True), f"pp=2 vp=2 {kind} mhc={mhc}",
                  2 * MICRO)  # a plan per micro-batch and virtual stage
    print(f"PASS rank={rank} combined_1f1b pp=2 vp=2 kind={kind} mhc={mhc} "
          f"micro_batches={MICRO} losses and gradients equal the interleaved schedule's",
          flush=True)


def main():
    harness.init(cuda_to_cpu=True)
    _stand_ins()
    from mhc_megatron.layers import fine_grained

    fine_grained.install()  # as an mHC layer built with the overlap flag does
    for kind in ("moe", "mix", "mtp"):
        for mhc in (True, False):
            check(kind, mhc)
    for mhc in (True, False):
        check_pipelined("moe", mhc)


if __name__ == "__main__":
    main()
