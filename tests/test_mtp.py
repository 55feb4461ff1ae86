"""Multi-token prediction (DeepSeek-V3 style, ``mtp_num_layers``) with mHC.

Each MTP depth's inner layer is an mHC layer that expands its ``[s, b, C]`` input (eh_proj's
output) into n streams; the MTP layer's final norm contracts them
(``get_gpt_mtp_block_with_mhc_spec``). Checked here on CPU: the shapes inside, the MTP loss
Megatron records against the same loss composed by hand from the MTP output, gradients of
every parameter, training, and mHC recompute with MTP.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    SEQ,
    VOCAB,
    assert_every_parameter_gets_gradient,
    batch,
    lm_loss,
    moe_overrides,
    tiny_config,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec, get_gpt_mtp_block_with_mhc_spec
from mhc_testing.cpu import setup_cpu_megatron


def _mtp_gpt(depth=1, device="cpu", **overrides):
    """The local-spec mHC GPT with ``depth`` MTP depths, on ``device`` (Megatron computes the
    rotary embedding on the GPU where CUDA is available, so the model and the data must be
    there too)."""
    cfg = tiny_config(mtp_num_layers=depth, **overrides)
    block = get_gpt_decoder_block_with_mhc_spec(cfg, use_transformer_engine=False)
    mtp = get_gpt_mtp_block_with_mhc_spec(cfg, block, use_transformer_engine=False)
    return GPTModel(cfg, block, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", mtp_block_spec=mtp).to(device)


def _roll_left(t):
    """Megatron's roll_tensor(t, shifts=-1, dims=-1): one step left, the last entry 0."""
    out = torch.roll(t, -1, dims=-1)
    out[..., -1] = 0
    return out


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_loss_equals_composition_by_hand(megatron_single_rank, device, depth):
    setup_cpu_megatron(seed=5)
    model = _mtp_gpt(depth, device)
    n, c = model.config.num_residual_streams, model.config.hidden_size
    seen = {}
    for k, layer in enumerate(model.mtp.layers):
        layer.mtp_model_layer.register_forward_hook(
            lambda m, a, out, k=k: seen.__setitem__(("inner", k), out[0].shape))
        layer.register_forward_hook(lambda m, a, out, k=k: seen.__setitem__(("mtp", k), out))
    MTPLossLoggingHelper.tracker.clear()
    ids, pos, mask, labels = batch(seed=9, device=device)
    model(ids, pos, mask, labels=labels)

    recorded = MTPLossLoggingHelper.tracker["loss_values"]
    mtp_labels, loss_mask = labels.clone(), torch.ones_like(labels)
    for k in range(depth):
        assert seen[("inner", k)][-1] == n * c  # the inner mHC layer runs on n streams
        out = seen[("mtp", k)]
        h = out[0] if isinstance(out, tuple) else out
        h = h.chunk(1 + depth, dim=0)[-1] if h.shape[0] != SEQ else h  # this depth's [s, b, C]
        assert h.shape[-1] == c  # ... which the MTP final norm contracted
        logits, _ = model.output_layer(h)
        mtp_labels, loss_mask = _roll_left(mtp_labels), _roll_left(loss_mask)
        per_token = F.cross_entropy(logits.float().reshape(-1, VOCAB),
                                    mtp_labels.t().reshape(-1), reduction="none")
        by_hand = (per_token * loss_mask.t().reshape(-1)).sum() / loss_mask.sum()
        torch.testing.assert_close(recorded[k], by_hand, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("mhc_recompute", [False, True])
def test_mtp_model_trains_and_every_parameter_learns(megatron_single_rank, device, kind,
                                                     mhc_recompute):
    setup_cpu_megatron(seed=5)
    extra = moe_overrides() if kind == "moe" else {}
    model = _mtp_gpt(1, device, mhc_recompute=mhc_recompute, **extra)
    mtp_hc = [name for name, _ in model.named_parameters() if name.startswith("mtp.")
              and "hyper_connection" in name]
    assert len(mtp_hc) == 6  # two mappings of the MTP layer's inner mHC layer, (phi, alpha, bias)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batch(seed=9, device=device)
    losses = []
    for step in range(12):
        opt.zero_grad(set_to_none=True)
        MTPLossLoggingHelper.tracker.clear()
        loss = lm_loss(model, data)
        loss.backward()
        if step == 0:
            assert_every_parameter_gets_gradient(model)
        losses.append((loss.item(), MTPLossLoggingHelper.tracker["loss_values"][0].item()))
        opt.step()
    assert losses[-1][0] < 0.8 * losses[0][0], losses  # the main loss falls
    assert losses[-1][1] < 0.8 * losses[0][1], losses  # and so does the MTP loss


def test_mtp_grads_equal_with_and_without_mhc_recompute(megatron_single_rank, device):
    grads = []
    for rc in (False, True):
        setup_cpu_megatron(seed=5)
        model = _mtp_gpt(1, device, mhc_recompute=rc, num_layers=3, mhc_recompute_layer_num=2)
        lm_loss(model, batch(seed=9, device=device)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


@pytest.mark.parametrize("config_class", ["mhc", "megatron"])
def test_megatron_builder_gives_mtp_mhc_layers(megatron_single_rank, device, config_class):
    """Megatron's own model builder (the one ``pretrain`` uses), from the config container:
    with ``MHCGPTModelConfig`` every MTP depth's inner layer is an mHC layer on n streams of
    its own and the depth's final norm contracts them, exactly the block of
    ``get_gpt_mtp_block_with_mhc_spec``; Megatron's ``GPTModelConfig`` builds its plain layer
    there (why ``mhc_gpt_model_config_from_args`` returns the former). The model trains."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelConfig

    from mhc_megatron.layers import HyperConnectionTransformerLayer, StreamContractingNorm
    from mhc_megatron.training import MHCGPTModelConfig, mhc_block_spec

    setup_cpu_megatron(seed=5)
    cls = MHCGPTModelConfig if config_class == "mhc" else GPTModelConfig
    model_cfg = cls(transformer=tiny_config(mtp_num_layers=2, transformer_impl="local"),
                    transformer_layer_spec=mhc_block_spec,
                    vocab_size=VOCAB, seq_length=SEQ, position_embedding_type="rope")
    model = model_cfg.get_builder_cls()(model_cfg).build_model(
        ProcessGroupCollection.use_mpu_process_groups()).to(device)
    assert len(model.mtp.layers) == 2
    for layer in model.mtp.layers:
        inner = layer.mtp_model_layer
        is_mhc = isinstance(inner, HyperConnectionTransformerLayer) and inner.mhc_enabled
        assert is_mhc == (config_class == "mhc")
        assert isinstance(layer.final_layernorm, StreamContractingNorm) == is_mhc
    if config_class != "mhc":
        return
    reference = _mtp_gpt(2)  # the same structure built by hand: same parameter names/shapes
    assert {n: p.shape for n, p in model.named_parameters()} == \
        {n: p.shape for n, p in reference.named_parameters()}
    MTPLossLoggingHelper.tracker.clear()  # sized by the depth of the first model that logs
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = batch(seed=9, device=device)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = lm_loss(model, data)
        loss.backward()
        assert all(p.grad is not None for p in model.mtp.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
