"""The ``forward_step_func`` the multi-rank tests and benchmarks hand to Megatron's schedules.

Test support (not installed with the package).
"""

from __future__ import annotations


def mean_loss_forward_step(data_iterator, model, return_schedule_plan=False):
    """One micro-batch ``(ids, pos, mask, labels)`` from ``data_iterator``: the per-token
    losses ``[b, s]`` (or, when Megatron's EP-overlap schedule asks for it, the model's schedule
    plan) and a loss function returning their mean as ``(loss, {"loss": loss})``."""
    ids, pos, mask, labels = next(data_iterator)
    if return_schedule_plan:
        out = model.build_schedule_plan(ids, pos, mask, labels=labels)
    else:
        out = model(ids, pos, mask, labels=labels)

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func
