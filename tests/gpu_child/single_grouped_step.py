"""One training step of a tiny MoE GPT whose experts are Megatron-Core 0.19.2's single grouped
weight (``moe_single_grouped_weight``, TE specs, bf16), on one GPU, EP=1.

    python tests/gpu_child/single_grouped_step.py {0,1} [dropless|drop_and_pad]
        # 1: mHC n=4, 0: Megatron's layers; the routing (default dropless; drop_and_pad:
        # capacity factor 1, every expert's input padded to capacity, so equal token counts)

Prints ``RESULT {json}`` (the loss, the grouped weight's gradient norm) after a forward and a
backward with the device synchronised. Run in a child process: a fault in TE's grouped-tensor
GEMM can leave the CUDA context unusable.
"""

import faulthandler
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/helpers.py
faulthandler.enable()

import torch  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402

from helpers import (  # noqa: E402
    batch,
    build_gpt,
    lm_loss,
    moe_overrides,
    single_grouped_expert_overrides,
    tiny_config,
)
from mhc_testing.cpu import init_single_process_group  # noqa: E402


ROUTING = {"dropless": {},
           "drop_and_pad": dict(moe_expert_capacity_factor=1.0,
                                moe_pad_expert_input_to_capacity=True)}


def main(mhc: bool, routing: str = "dropless") -> dict:
    init_single_process_group()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    config = tiny_config(**{**moe_overrides(), **single_grouped_expert_overrides(),
                            **ROUTING[routing]},
                         enable_hyper_connections=mhc, mhc_kernel_backend="triton")
    model = build_gpt(config, "cuda", te=True)
    grouped = [(n, p) for n, p in model.named_parameters()
               if ".experts.linear_fc" in n and n.endswith(".weight")]
    loss = lm_loss(model, batch(device="cuda"))
    loss.backward()
    torch.cuda.synchronize()
    return {"mhc": mhc, "routing": routing, "loss": loss.item(), "grouped_weights": [n for n, _ in grouped],
            "grouped_grad_norms": [p.grad.float().norm().item() if p.grad is not None
                                   else None for _, p in grouped]}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(bool(int(sys.argv[1])), *sys.argv[2:3])), flush=True)
