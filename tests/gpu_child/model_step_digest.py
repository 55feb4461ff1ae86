"""Digests of one mHC model step on a GPU: what the golden test of the fast host path compares.

    python tests/gpu_child/model_step_digest.py [OUT.json]

A 4-layer mHC GPT (n=4, bf16, hidden 512, Megatron's local modules with its own deterministic
attention, Triton kernels), one forward and backward of a fixed batch, once without and once
with ``mhc_recompute``. Per run: the loss's bits and a SHA-256 of every parameter gradient's
bytes. The step is run three times per process and must repeat bit for bit, so the digests are a
fact of the code and the GPU architecture, not of the run (where the ops' host replay is on, the
first step runs their Python path and records it, the second replays their forward from C++ with
the ops' C++ autograd nodes, whose backward runs the Python path once per variant and records
it, and the third replays both: :mod:`mhc_megatron.kernels.host_replay`,
:mod:`mhc_megatron.kernels.native_autograd`). Prints the JSON (and writes it to
OUT.json): ``{"device", "capability", "versions": {"torch", "triton"}, "runs": {name: {"loss",
"grads": {param: sha256}}}}``. Imports the package from the working directory, so it also
digests another revision of the code checked out elsewhere (run from there).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())

LAYERS, HIDDEN, HEADS, SEQ, BATCH, VOCAB = 4, 512, 8, 128, 2, 1024


def _model(recompute: bool):
    from megatron.core.models.gpt import GPTModel

    from mhc_megatron.config import MHCTransformerConfig
    from mhc_megatron.specs import get_gpt_decoder_block_with_mhc_spec
    from mhc_testing.cpu import setup_cpu_megatron

    setup_cpu_megatron(1234)
    config = MHCTransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        ffn_hidden_size=2 * HIDDEN, normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16, bf16=True,
        use_cpu_initialization=True, enable_hyper_connections=True, num_residual_streams=4,
        mhc_kernel_backend="triton", mhc_recompute=recompute)
    spec = get_gpt_decoder_block_with_mhc_spec(config, use_transformer_engine=False,
                                               normalization="RMSNorm")
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope").cuda()


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
                          ).hexdigest()


def _step(model) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    pos = torch.arange(SEQ, device="cuda").expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device="cuda"), 1)[None, None]
    for p in model.parameters():
        p.grad = None
    loss = model(ids, pos, mask, labels=ids).float().mean()
    loss.backward()
    torch.cuda.synchronize()
    return {"loss": loss.item().hex(),
            "grads": {n: _sha(p.grad) for n, p in model.named_parameters()}}


def digests() -> dict:
    from megatron.core import parallel_state

    from mhc_testing.cpu import init_single_process_group

    if not torch.distributed.is_initialized():
        init_single_process_group()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    runs = {}
    for name, recompute in (("mhc", False), ("mhc_recompute", True)):
        model = _model(recompute)
        first, second, third = _step(model), _step(model), _step(model)
        if not first == second == third:
            raise RuntimeError(f"{name}: the step does not repeat bit for bit on this GPU")
        runs[name] = first
    import triton

    return {"device": torch.cuda.get_device_name(),
            "capability": list(torch.cuda.get_device_capability()),
            "versions": {"torch": torch.__version__, "triton": triton.__version__},
            "runs": runs}


def main():
    out = digests()
    text = json.dumps(out, indent=1, sort_keys=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
