"""Pretrain a GPT, or a hybrid model, with Megatron's own training loop; mHC is switched on
by flags.

    python examples/prepare_stdlib_corpus.py out/data/stdlib
    torchrun --nproc-per-node=N examples/pretrain_gpt_mhc.py <Megatron's flags> \\
        --data-path out/data/stdlib --split 98,1,1 --tokenizer-type NullTokenizer \\
        --vocab-size 257 --enable-hyper-connections [--num-residual-streams 4 ...]

Everything is Megatron's: ``parse_and_validate_args``, ``pretrain`` (DDP, the distributed
optimiser, LR schedule, grad clipping, logging, checkpoint save/resume), the GPT dataset.
mhc-megatron adds its flags (``add_mhc_arguments``), the mHC transformer config and the
decoder-block spec (``mhc_gpt_model_config_from_args``), and makes Megatron's optimisers
checkpoint fp32 mapping parameters in a bf16/fp16 run (``--mhc-params-dtype fp32``,
``fp32_params_in_megatron_training``; a no-op for a model of one dtype). Without ``--enable-hyper-connections``
the same script trains the baseline (the mHC spec with mHC off is Megatron's own layer).

With Megatron's ``--hybrid-layer-pattern`` the model is Megatron's ``HybridModel``
(``mhc_hybrid_model_config_from_args``: Megatron's ``hybrid_config_from_args`` and
``HybridModelBuilder`` with the mHC stack spec); every mHC flag applies as for GPT, and each
layer of the pattern (one residual sublayer) gets its own hyper-connection. Megatron derives
``--num-layers`` from the pattern; ``|`` splits it into pipeline stages (as many segments as
``--pipeline-model-parallel-size``), ``/`` appends multi-token-prediction depths. The GPT
flags above with, e.g.::

    --hybrid-layer-pattern "*-*-" --enable-hyper-connections  # the 2-layer GPT's layers
    --hybrid-layer-pattern "*-|*-" --pipeline-model-parallel-size 2      # 2 pipeline stages
    --hybrid-layer-pattern "*E*E" --num-experts 4 --moe-router-topk 2    # MoE layers
    --hybrid-layer-pattern "*-*-/*-"                                      # one MTP depth

(``*`` attention, ``-`` MLP, ``E`` MoE, ``+`` MLA; Mamba ``M`` and GDN ``G`` layers need
their CUDA packages.) The name of the script stays: the data, loss and loop are the GPT's.

Data: any Megatron indexed dataset with its tokenizer, e.g. the Python standard library as
bytes (``examples/prepare_stdlib_corpus.py``, Megatron's ``NullTokenizer``), or ``--mock-data``.

Without CUDA the script installs ``mhc_testing.cpu_training`` (CPU test support for
CI and smoke runs, with gloo and Megatron's local modules: pass ``--transformer-impl local
--no-persist-layer-norm --no-gradient-accumulation-fusion --distributed-backend gloo
--no-rope-fusion --no-masked-softmax-fusion``, the last because with ``--bf16`` or ``--fp16``
Megatron's softmax would run its fused CUDA kernel) and hides the third-party notices about
missing CUDA, TE and Apex that the test-suite hides (``mhc_testing.warning_filters``); it is
not a way to train. A smoke run on one CPU process (under a minute)::

    python examples/prepare_stdlib_corpus.py out/data/stdlib_small --max-mb 1
    torchrun --nproc-per-node=1 examples/pretrain_gpt_mhc.py --num-layers 2 \\
        --hidden-size 64 --num-attention-heads 4 --seq-length 128 \\
        --max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 4 \\
        --train-iters 10 --lr 1e-3 --log-interval 1 --eval-interval 5 --eval-iters 1 \\
        --data-path out/data/stdlib_small --split 90,5,5 --tokenizer-type NullTokenizer \\
        --vocab-size 257 --transformer-impl local --no-persist-layer-norm \\
        --no-gradient-accumulation-fusion --distributed-backend gloo --no-rope-fusion \\
        --no-masked-softmax-fusion --enable-hyper-connections --num-residual-streams 4

(``--split 90,5,5``: every split of the 1 MB corpus's 41 documents must hold one at least;
Megatron's index builder loops forever on an empty split, e.g. the test split of 98,1,1.)
``--help`` lists Megatron's flags, the "mHC" group and this script's own.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import sys

import torch

# mhc_testing (CPU shims, warning filters) is test support kept in the repository, not in the
# installed package: import it from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def skip_megatron_helper_build() -> None:
    """megatron-core wheels ship the compiled dataset helpers but not their Makefile, and
    ``initialize_megatron`` always runs ``make`` there, exiting the process when it fails.
    Skip that build where the compiled helpers import and no Makefile exists."""
    import megatron.core.datasets.utils as dataset_utils

    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return
    if not os.path.exists(os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile")):
        dataset_utils.compile_helpers = lambda: None


def example_arguments(parser):
    from mhc_megatron.training import add_mhc_arguments

    add_mhc_arguments(parser)
    g = parser.add_argument_group("pretrain_gpt_mhc.py")
    g.add_argument("--log-micro-batch-loss", action="store_true",
                   help="print every micro-batch's loss from one rank of the last pipeline "
                        "stage (exact per-step losses for tests; Megatron's own log averages "
                        "since its last reset)")
    g.add_argument("--log-grad-norm", action="store_true",
                   help="print every iteration's gradient norm (Megatron's, over all model "
                        "parallel ranks, before clipping) in full precision from the rank that "
                        "prints the losses (exact values for tests; Megatron's log rounds it to "
                        "3 decimals)")
    return parser


@contextlib.contextmanager
def grad_norm_printed():
    """For the duration of the block, Megatron's ``training_log`` (which its training loop
    calls by its module-level name once an iteration) also prints the iteration's gradient
    norm in full precision: ``[grad norm] <iteration> <value>``. Scoped and restored."""
    import megatron.training.training as training

    log = training.training_log
    signature = inspect.signature(log)
    if not {"iteration", "grad_norm"} <= set(signature.parameters):
        raise RuntimeError(
            "--log-grad-norm: megatron.training.training.training_log no longer takes "
            "'iteration' and 'grad_norm' (written for Megatron-Core 0.19). Fix: drop "
            "--log-grad-norm, or read the grad norm Megatron logs.")

    @functools.wraps(log)
    def training_log(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        grad_norm = bound.get("grad_norm")
        if grad_norm is not None and _prints_losses():
            print(f"[grad norm] {bound['iteration']} {float(grad_norm):.10e}", flush=True)
        return log(*args, **kwargs)

    training.training_log = training_log
    try:
        yield
    finally:
        training.training_log = log


def forward_step(data_iterator, model, return_schedule_plan=False):
    """One micro-batch: ``(per-token losses, loss_func)`` as Megatron's schedules expect;
    with ``return_schedule_plan`` (the MoE EP-overlap schedule) the model's schedule plan in
    place of the losses."""
    from megatron.training import get_args

    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    tokens, labels, loss_mask, position_ids = (
        batch[k].to(device) for k in ("tokens", "labels", "loss_mask", "position_ids"))
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
    if return_schedule_plan:  # --overlap-moe-expert-parallel-comm: the combined 1F1B schedule
        output = model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels,
                                           loss_mask=loss_mask)
    else:
        output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    log_micro_batch = get_args().log_micro_batch_loss
    phase = "train" if model.training else "eval"

    def loss_func(output_tensor):
        losses = output_tensor.view(-1).float()
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * mask)
        num_tokens = mask.sum().clone().detach().to(torch.int)
        # not while a full-iteration CUDA graph captures the step: printing syncs with the
        # host (the replays run no Python, so only eager steps print)
        if log_micro_batch and _prints_losses() and not _capturing():
            print(f"[micro-batch loss] {phase} {float(loss / num_tokens):.10f}", flush=True)
        report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
        return loss, num_tokens, report

    return output, loss_func


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _prints_losses() -> bool:
    """One rank of those that compute the loss: the last pipeline stage's first TP, CP and
    DP rank."""
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_last_stage(ignore_virtual=True) and
            ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0 and
            ps.get_data_parallel_rank() == 0)


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's GPT datasets (every rank builds its own loader)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split, split=args.split, path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mmap_bin_files=args.mmap_bin_files,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, lambda: True,
                                         config).build()


datasets_provider.is_distributed = True


def main():
    if not torch.cuda.is_available():
        from mhc_testing import cpu_training, warning_filters

        warning_filters.install()  # before Megatron is imported
        cpu_training.install()
    skip_megatron_helper_build()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from mhc_megatron.training import (
        fp32_params_in_megatron_training,
        mhc_gpt_model_config_from_args,
        mhc_hybrid_model_config_from_args,
    )

    args = parse_and_validate_args(extra_args_provider=example_arguments)
    # the config's refusals fire here, on every rank, before any process group exists
    if args.hybrid_layer_pattern is not None:
        model_cfg = mhc_hybrid_model_config_from_args(args)
    else:
        model_cfg = mhc_gpt_model_config_from_args(args)
    with contextlib.ExitStack() as scope:
        scope.enter_context(fp32_params_in_megatron_training())  # --mhc-params-dtype fp32, bf16
        if args.log_grad_norm:
            scope.enter_context(grad_norm_printed())
        pretrain(pretrain_cfg_container_from_args(args, model_cfg), datasets_provider,
                 ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
