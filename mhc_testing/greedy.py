"""Greedy decoding by repeated full forwards: the reference an inference engine's greedy
tokens are checked against (``tests/test_inference_engines.py``, ``examples/generate_mhc.py
--check-greedy``).

A full forward runs one sequence ``[1, s]`` through the model as in training (no inference
context, Megatron's process-wide ``InferenceMode`` off for its duration): logits ``[s, vocab]``.
Greedy decoding appends the argmax of the last position and repeats. An engine's tokens can
differ from these only where the full forward's two candidates are closer than bf16 rounding
decides (a near-tie): :func:`first_divergence` measures the gap at the first difference, and
:func:`greedy_mismatch` says whether it exceeds ``tie_tol`` of the logits' largest magnitude.
"""

from __future__ import annotations

import torch

# Of the logits' largest magnitude: two candidate tokens closer than this are a near-tie that
# bf16 rounding may decide either way (the engines' paged attention and the full forward's
# attention round differently).
TIE_TOL = 2e-2


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """The causal full forward of ``tokens`` on the model's device, fp32 logits ``[s, vocab]``.
    ``model(input_ids [1, s], position_ids [1, s], None)`` (Megatron's GPT or hybrid model, in
    its Float16Module or not)."""
    from megatron.core.inference.utils import InferenceMode

    device = next(model.parameters()).device
    was_active = InferenceMode.is_active()
    InferenceMode.unset_active()
    ids = torch.tensor([tokens], device=device)
    pos = torch.arange(len(tokens), device=device)[None]
    try:
        with torch.no_grad():
            return model(ids, pos, None)[0].float()
    finally:
        if was_active:
            InferenceMode.set_active()


def greedy_by_full_forwards(model, prompt: list[int], n: int) -> list[int]:
    """``n`` tokens: the argmax of the full forward's last position, appended, repeated."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(full_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def first_divergence(model, prompt: list[int], got: list[int], want: list[int],
                     tie_tol: float = TIE_TOL) -> dict | None:
    """None if ``got == want`` (of equal length); else at their first difference ``k``: the
    full forward's logits on ``prompt + want[:k]`` for the two tokens, their ``gap`` and the
    near-tie ``bound`` (``tie_tol`` of the logits' largest magnitude)."""
    if len(got) != len(want):
        raise ValueError(f"{len(got)} generated tokens against {len(want)} reference tokens")
    for k, (g, w) in enumerate(zip(got, want)):
        if g != w:
            last = full_logits(model, list(prompt) + list(want[:k]))[-1]
            return {"step": k, "got": g, "want": w, "gap": abs(float(last[w] - last[g])),
                    "bound": tie_tol * float(last.abs().max())}
    return None


def greedy_mismatch(model, prompt: list[int], got: list[int],
                    tie_tol: float = TIE_TOL) -> dict | None:
    """Check an engine's greedy tokens ``got`` for ``prompt`` against greedy decoding by full
    forwards of as many tokens: None where they are equal; else :func:`first_divergence`'s
    record with ``tie`` True where the first difference is a near-tie (then the sequences
    are not comparable past it) and False where it is a real divergence."""
    want = greedy_by_full_forwards(model, prompt, len(got))
    found = first_divergence(model, prompt, got, want, tie_tol)
    if found is not None:
        found["tie"] = found["gap"] <= found["bound"]
        found["reference"] = want
    return found
