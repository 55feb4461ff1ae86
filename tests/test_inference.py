"""KV-cached decoding through Megatron's static inference context with mHC layers.

Megatron's inference runs the model on a prompt (prefill, which fills each attention layer's
KV cache) and then one token at a time (decode steps of ``[1, b]`` tokens) with a
``StaticInferenceContext``. mHC's streams ``[s, b, n*C]`` are per token, so a token's n
streams must stay with that token through both: the logits of prefill + step-by-step decode
must equal the full forward's at every position. Dense, MoE and the DeepSeek-V4 preset (its
output head), batch 2; CPU (reference ops) and, on a CUDA machine, the Triton kernels.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import SEQ, VOCAB, build_gpt, moe_overrides, tiny_config

KINDS = {"dense": {}, "moe": moe_overrides(), "deepseek_v4": {"mhc_variant": "deepseek_v4"}}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_static_kv_cache_decode_equals_full_forward(seeded, device, kind):
    from megatron.core.inference.contexts import StaticInferenceContext

    cfg = tiny_config(num_layers=3, **KINDS[kind])
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu:  # the fused kernels, against the full forward (also on them)
        cfg = dataclasses.replace(cfg, mhc_kernel_backend="triton")
    model = build_gpt(cfg, device).eval()
    with torch.no_grad():  # mappings away from their symmetric initial values
        for name, p in model.named_parameters():
            if "hyper_connection.bias" in name or ".head.bias" in name:
                p.add_(torch.randn_like(p))
    b, s, prompt = 2, 12, 7
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (b, s), generator=g).to(device)
    pos = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    assert s <= SEQ
    with torch.no_grad():
        full = model(ids, pos, None)  # [b, s, vocab]: the causal full forward
        ctx = StaticInferenceContext(b, s)
        steps = [model(ids[:, :prompt], pos[:, :prompt], None, inference_context=ctx)]
        ctx.sequence_len_offset += prompt
        for t in range(prompt, s):
            steps.append(model(ids[:, t:t + 1], pos[:, t:t + 1], None, inference_context=ctx))
            ctx.sequence_len_offset += 1
    cached = torch.cat(steps, dim=1)
    assert cached.shape == full.shape
    tol = 1e-3 if on_gpu else 1e-5  # TF32 / 3xTF32 dots on GPUs
    torch.testing.assert_close(cached, full, rtol=tol, atol=tol * full.abs().max().item())
    # the decode steps' logits differ token to token (the streams are per token)
    assert not torch.allclose(cached[:, -1], cached[:, -2])


@pytest.mark.parametrize("model_class", ["gpt", "hybrid"])
def test_inference_with_pipeline_parallelism_is_refused(seeded, device, model_class):
    """Megatron's inference wrappers size a stage's receive buffer from ``hidden_size``, so an
    mHC model's streams cannot cross a stage boundary in inference: a layer's forward with an
    inference context under pipeline parallelism stops with a clear error (the config's
    pipeline size set after the build: one process has no second stage). GPTModel and
    HybridModel (``*-``), on the test device (Megatron computes RoPE on CUDA where present)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    if model_class == "gpt":
        model = build_gpt(tiny_config(), device).eval()
    else:
        from hybrid_models import build_hybrid_model, hybrid_config

        model = build_hybrid_model(hybrid_config(tiny_config()), device, "*-*-").eval()
    model.config.pipeline_model_parallel_size = 2
    ids = torch.randint(0, VOCAB, (2, 4), device=device)
    pos = torch.arange(4, device=device).unsqueeze(0).expand(2, 4)
    with torch.no_grad(), pytest.raises(ValueError, match="pipeline_model_parallel_size=1"):
        model(ids, pos, None, inference_context=StaticInferenceContext(2, 4))
    model.config.pipeline_model_parallel_size = 1
    with torch.no_grad():  # and without pipeline parallelism it runs
        model(ids, pos, None, inference_context=StaticInferenceContext(2, 4))


class _ScriptedLM(torch.nn.Module):
    """Logits ``[1, s, vocab]`` whose last position favours ``(last token + 1) % vocab`` by
    ``margin``, except after ``tie_after``, where tokens 0 and 1 are a near-tie."""

    def __init__(self, vocab=8, margin=4.0, tie_after=5):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.vocab, self.margin, self.tie_after = vocab, margin, tie_after

    def forward(self, ids, pos, mask):
        logits = torch.zeros(1, ids.shape[1], self.vocab)
        for i, t in enumerate(ids[0].tolist()):
            if t == self.tie_after:
                logits[0, i, 0], logits[0, i, 1] = 4.0, 3.99
            else:
                logits[0, i, (t + 1) % self.vocab] = self.margin
        return logits


def test_greedy_reference_and_its_verdicts():
    """The greedy reference that engines are checked against (mhc_testing.greedy, used by the
    engine tests and examples/generate_mhc.py --check-greedy): argmax by full forwards; a
    difference is a near-tie where the two logits are closer than the tie bound, else a
    divergence."""
    from mhc_testing.greedy import greedy_by_full_forwards, greedy_mismatch

    model = _ScriptedLM()
    assert greedy_by_full_forwards(model, [1], 6) == [2, 3, 4, 5, 0, 1]
    assert greedy_mismatch(model, [1], [2, 3, 4, 5, 0, 1]) is None
    tie = greedy_mismatch(model, [1], [2, 3, 4, 5, 1, 2])  # 1 vs 0 after token 5: 4.0 vs 3.99
    assert tie["step"] == 4 and tie["tie"] and tie["gap"] < tie["bound"]
    diverged = greedy_mismatch(model, [1], [2, 7, 0, 1])
    assert diverged["step"] == 1 and not diverged["tie"]
    assert (diverged["got"], diverged["want"], diverged["reference"]) == (7, 3, [2, 3, 4, 5])


def test_forward_in_inference_mode_equals_no_grad_on_the_triton_ops(seeded, device):
    """Megatron's engines run the model under ``torch.inference_mode``, and its layers run
    bias-dropout-add under ``torch.enable_grad`` inside it: the combine then gets a linear
    bias that requires grad and inference tensors. The forward runs there on the Triton ops
    (the interpreter on CPU) to the bits of the same forward under ``no_grad``."""
    cfg = dataclasses.replace(tiny_config(num_layers=2), mhc_kernel_backend="triton")
    assert cfg.add_bias_linear  # the sublayers hand the combine their bias
    model = build_gpt(cfg, device).eval()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g).to(device)
    pos = torch.arange(8, device=device).unsqueeze(0).expand(2, 8)
    with torch.no_grad():
        want = model(ids, pos, None)
    with torch.inference_mode():
        got = model(ids, pos, None)
    assert torch.equal(got, want)
