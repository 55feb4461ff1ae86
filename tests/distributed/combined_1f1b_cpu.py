"""Megatron's combined 1F1B schedule (the MoE EP-overlap schedule) on one CPU rank: mHC models
trained through it equal the same models through the plain schedule, bit for bit.

Run: MHC_DIST_DEVICE=cpu torchrun --nproc-per-node=1 tests/distributed/combined_1f1b_cpu.py

Megatron's no-pipelining schedule with ``overlap_moe_expert_parallel_comm`` builds each
micro-batch's model schedule plan and runs micro-batch i+1's forward interleaved with
micro-batch i's backward, layer by layer and node by node (``combined_1f1b.py``). Megatron
allows the overlap only with EP > 1, the alltoall (or flex) dispatcher and CUDA; here the
flag is set after the config's validation, on one rank with the allgather dispatcher, and
CUDA's streams and events are stand-ins (``mhc_testing.cpu_training``'s CUDA -> CPU shims, a
no-op event and ``record_stream``; no node frees its input, as Megatron would for the
alltoall dispatcher's copies). What this checks is the schedule's order and its hand-over of
tensors and gradients between nodes with mHC layers: 4 micro-batches, every loss and every
gradient against the plain schedule's. The overlap with EP=2 on GPUs:
``ep_overlap_equivalence.py``.
"""

from __future__ import annotations

import harness  # noqa: F401  (first: hides TE on CPU ranks)
import torch

from helpers import batch, moe_overrides

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


def _model(cfg):
    from megatron.core.models.gpt import GPTModel

    from helpers import SEQ, VOCAB
    from mhc_megatron.specs import (
        get_gpt_decoder_block_with_mhc_spec,
        get_gpt_mtp_block_with_mhc_spec,
    )

    spec = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=False)
    mtp = get_gpt_mtp_block_with_mhc_spec(cfg, spec, False) if cfg.mtp_num_layers else None
    return GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", mtp_block_spec=mtp)


def _run(kind: str, mhc: bool, overlap: bool):
    """4 micro-batches through Megatron's no-pipelining schedule: (losses, gradients)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from helpers import SEQ
    from mhc_testing.schedules import mean_loss_forward_step

    harness.init_parallel()  # the same seed: the same initial weights in both runs
    cfg = _config(kind, mhc)
    model = _model(cfg)
    cfg.overlap_moe_expert_parallel_comm = overlap  # after validation (see the docstring)
    data = iter([batch(batch_size=2, seed=10 + i) for i in range(MICRO)])
    out = get_forward_backward_func()(
        forward_step_func=mean_loss_forward_step, data_iterator=data, model=model,
        num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=2, forward_only=False)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [d["loss"] for d in out], grads


def check(kind: str, mhc: bool) -> None:
    losses, grads = _run(kind, mhc, overlap=False)
    losses2, grads2 = _run(kind, mhc, overlap=True)
    assert len(losses2) == MICRO and all(torch.equal(a, b) for a, b in zip(losses, losses2)), \
        (losses, losses2)
    assert sorted(grads) == sorted(grads2)
    for n in grads:
        if n == "embedding.word_embeddings.weight":  # shared with the output layer: its
            # contributions add up in another order under the schedule
            torch.testing.assert_close(grads2[n], grads[n], rtol=1e-6, atol=1e-9)
        else:
            assert torch.equal(grads2[n], grads[n]), n
    n_mhc = sum("hyper_connection" in n for n in grads)
    assert n_mhc == (0 if not mhc else 18 if kind == "mtp" else 12), n_mhc
    print(f"PASS combined_1f1b kind={kind} mhc={mhc} micro_batches={MICRO} losses and "
          f"gradients equal the plain schedule's, mhc_params={n_mhc}", flush=True)


def main():
    harness.init(world_size=1, cuda_to_cpu=True)
    _stand_ins()
    from mhc_megatron.layers import fine_grained

    fine_grained.install()  # as an mHC layer built with the overlap flag does
    for kind in ("moe", "mix", "mtp"):
        for mhc in (True, False):
            check(kind, mhc)


if __name__ == "__main__":
    main()
