"""examples/pretrain_gpt_mhc.py with ``--hybrid-layer-pattern``: Megatron's own training loop
trains Megatron's ``HybridModel`` with mHC (``mhc_hybrid_model_config_from_args``).

The runs are launched as in test_pretrain_example.py (``helpers.pretrain``: CPU ranks over
gloo here, the ``cuda`` variants over NCCL on 2 GPUs), with the tiny GPT's flags and a
pattern, from which Megatron takes the layer count: ``"*-*-"`` is the 2-layer GPT's layers
as hybrid layers (attention, MLP, attention, MLP), each with its own hyper-connection. Every
run prints its micro-batch losses and each iteration's gradient norm in full precision
(``--log-micro-batch-loss --log-grad-norm``); the parallel layouts are compared with the
single-rank run, losses and gradient norms, over every optimizer step.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch
from helpers import (LOCAL_MODULE_FLAGS, MHC_FLAGS, PRETRAIN_DEVICES, PRETRAIN_ITERS,
                     SavedAtIteration3, assert_close, batch, needs_2_gpus, needs_gpu,
                     needs_te_norms, pretrain, shared_run, write_pretrain_corpus)

ITERS = PRETRAIN_ITERS
LOG = ["--log-grad-norm"]
MHC = MHC_FLAGS + LOG
BASE = LOG
PATTERN = ["--hybrid-layer-pattern", "*-*-"]
N, HIDDEN = 4, 64  # MHC_FLAGS' streams, TINY_GPT_FLAGS' hidden size
# (Megatron's CPU-rank MoE: at EP=1 its all-to-all dispatcher sends nothing, so gloo, which
# has no all-to-all, runs it)
MOE = ["--hybrid-layer-pattern", "*E*E", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "0",
       "--moe-token-dispatcher-type", "alltoall"]
MTP = ["--hybrid-layer-pattern", "*-*-/*-", "--mtp-num-layers", "1"]


def _tp(sp: bool = False) -> list[str]:
    return ["--tensor-model-parallel-size", "2", *(["--sequence-parallel"] if sp else [])]


# Layouts of one global batch: flags, number of processes. ``|`` splits the pattern into the
# two pipeline stages (Megatron wants as many segments as stages).
LAYOUTS = {"1": (PATTERN, 1),
           "pp2": (["--hybrid-layer-pattern", "*-|*-", "--pipeline-model-parallel-size", "2"], 2),
           "tp2": (PATTERN + _tp(), 2),
           "tp2sp": (PATTERN + _tp(sp=True), 2)}


def mapping_params(n: int = N, c: int = HIDDEN) -> int:
    """Parameters of one hyper-connection: phi [n*C, 2n + n^2], alpha (3), bias (2n + n^2)."""
    m = 2 * n + n * n
    return m * n * c + 3 + m


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_pretrain_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def saved_at_iteration_3(corpus, tmp_path_factory):
    return SavedAtIteration3(corpus, tmp_path_factory)


def _iterations(values: dict) -> list[float]:
    return [values[i] for i in range(1, ITERS + 1)]


# ------------------------------------------------------------------------- config from args
TINY = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "4",
        "--eval-interval", "10", "--tokenizer-type", "NullTokenizer", "--vocab-size", "257",
        "--mock-data", "--use-cpu-initialization", "--position-embedding-type", "rope",
        *LOCAL_MODULE_FLAGS]


def _args(*flags, monkeypatch):
    """Megatron's parse + validate with the mHC flags, in this process."""
    from megatron.training.arguments import parse_args, validate_args

    from mhc_megatron.training import add_mhc_arguments

    monkeypatch.setattr(sys, "argv", ["pretrain", *TINY, *flags])
    monkeypatch.setenv("RANK", "0")
    args = parse_args(extra_args_provider=add_mhc_arguments)
    validate_args(args)
    return args


def test_hybrid_model_config_from_args(monkeypatch, megatron_single_rank, device):
    """Megatron's HybridModelConfig and HybridModelBuilder with the mHC config and stack spec:
    Megatron takes num_layers from the pattern, and the model it builds has a hyper-connection
    in every layer, around that layer's one sublayer."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.hybrid import HybridModelBuilder, HybridModelConfig

    from mhc_megatron.config import MHCTransformerConfig
    from mhc_megatron.layers.hybrid import (HybridHyperConnectionLayer, HyperConnectionMLPLayer,
                                            MHCHybridStack)
    from mhc_megatron.training import mhc_hybrid_model_config_from_args

    args = _args(*MHC_FLAGS, *PATTERN, "--num-residual-streams", "2", monkeypatch=monkeypatch)
    model_cfg = mhc_hybrid_model_config_from_args(args)
    assert type(model_cfg) is HybridModelConfig
    assert model_cfg.get_builder_cls() is HybridModelBuilder
    tc = model_cfg.transformer
    assert isinstance(tc, MHCTransformerConfig) and tc.enable_hyper_connections
    assert (tc.num_residual_streams, tc.num_layers, tc.is_hybrid_model) == (2, 4, True)
    assert model_cfg.hybrid_layer_pattern == "*-*-"
    assert model_cfg.hybrid_stack_spec.module is MHCHybridStack
    # (on the test device: Megatron computes RoPE on CUDA where present)
    model = HybridModelBuilder(model_cfg).build_model(
        pg_collection=ProcessGroupCollection.use_mpu_process_groups()).to(device)
    layers = list(model.decoder.layers)
    assert [type(layer) for layer in layers] == [HybridHyperConnectionLayer,
                                                 HyperConnectionMLPLayer] * 2
    assert all(layer.mhc_enabled for layer in layers)
    assert [hasattr(layer, "self_attention_hyper_connection") for layer in layers] == \
        [True, False, True, False]
    assert [hasattr(layer, "mlp_hyper_connection") for layer in layers] == \
        [False, True, False, True]
    ids, pos, mask, _ = batch(seq=32, device=device)
    assert model(ids, pos, mask).shape[:2] == (2, 32)


def test_hybrid_model_config_refusals_and_spec(monkeypatch, megatron_single_rank):
    """No pattern: a clear error (no hybrid model to build). ``--spec`` names the stack spec
    as in Megatron's own helper. ``--sequence-parallel`` with Megatron's local norms, which
    refuse it: the same clear error as for GPT, before any model is built."""
    import megatron.training.arguments as megatron_arguments

    from mhc_megatron.specs.hybrid import get_hybrid_stack_local_spec
    from mhc_megatron.training import mhc_hybrid_model_config_from_args

    with pytest.raises(ValueError, match=r"--hybrid-layer-pattern is not set.*Fix: "):
        mhc_hybrid_model_config_from_args(_args(*MHC_FLAGS, "--num-layers", "2",
                                                monkeypatch=monkeypatch))
    model_cfg = mhc_hybrid_model_config_from_args(_args(
        *MHC_FLAGS, *PATTERN, "--spec", "mhc_megatron.specs.hybrid",
        "get_hybrid_stack_local_spec", monkeypatch=monkeypatch))
    assert model_cfg.hybrid_stack_spec is get_hybrid_stack_local_spec

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron asks for it with TP > 1
    if not torch.cuda.is_available():  # TP > 1 asks for the GPU architecture
        monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 9)
    args = _args(*MHC_FLAGS, *PATTERN, *_tp(sp=True), monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match=r"--sequence-parallel.*WrappedTorchNorm.*Fix: install "
                       r"Transformer Engine.*or drop --sequence-parallel"):
        mhc_hybrid_model_config_from_args(args)


# ----------------------------------------------------------------- Megatron's training loop
@pytest.mark.parametrize("device", PRETRAIN_DEVICES)
def test_hybrid_baseline_and_mhc_train(corpus, device):
    """Pattern ``"*-*-"`` without and with mHC: both learn, and the mHC model has exactly one
    hyper-connection (phi, alpha, bias) per layer of the pattern more than the baseline,
    which is Megatron's HybridModel (the mHC spec with mHC off)."""
    base = shared_run(corpus, *BASE, *PATTERN, device=device)
    mhc = shared_run(corpus, *MHC, *PATTERN, device=device)
    for run in (base, mhc):
        assert "HybridModel: pp_rank=0/1" in run.out and "layers='*-*-' (4 layers)" in run.out
        assert len(run.train) == 2 * ITERS and len(run.logged) == ITERS and run.valid
        assert sorted(run.grad_norms) == list(range(1, ITERS + 1))
        assert run.logged[ITERS] < run.logged[1] - 0.2, run.logged  # it learns
    assert mhc.params - base.params == 4 * mapping_params(), (mhc.params, base.params)
    assert mhc.logged != base.logged


def test_hybrid_baseline_is_megatrons_gpt(corpus):
    """With mHC off, the hybrid model of the local-module stack spec, pattern ``"*-*-"``, is
    Megatron's 2-layer GPT (same flags, no pattern): Megatron initialises the same weights in
    the same order and the layers compute the same, so every micro-batch loss and every
    gradient norm of the six steps are equal, bit for bit (CPU ranks)."""
    hybrid = shared_run(corpus, *BASE, *PATTERN)
    gpt = shared_run(corpus, *BASE)
    assert "HybridModel: pp_rank" not in gpt.out and gpt.params == hybrid.params
    assert hybrid.train == gpt.train and len(gpt.train) == 2 * ITERS
    assert hybrid.grad_norms == gpt.grad_norms and len(gpt.grad_norms) == ITERS


def test_hybrid_tensor_parallel_matches_single_rank(corpus):
    """TP=2 == 1 rank from the same initial weights (CPU ranks: ``--use-cpu-initialization``
    initialises the full weights and splits them): Megatron's iteration losses and gradient
    norms over all six optimizer steps, within rtol 1e-5 (only the order of TP's reductions
    differs). A ``|``-split PP=2 run starts from other weights (Megatron seeds each pipeline
    stage apart, seed + 100 x stage), so PP=2 is compared with 1 rank from one checkpoint,
    in the resume test below; so is TP on GPUs, where the flag does not give the same
    weights."""
    single = shared_run(corpus, *MHC, *PATTERN)
    tp2 = shared_run(corpus, *MHC, *LAYOUTS["tp2"][0], nproc=2)
    assert_close(_iterations(tp2.logged), _iterations(single.logged), rtol=1e-5)
    assert_close(_iterations(tp2.grad_norms), _iterations(single.grad_norms), rtol=1e-5)


@pytest.mark.parametrize("device,save,load", [
    ("cpu", "1", "pp2"),
    ("cpu", "1", "tp2"),
    ("cpu", "pp2", "1"),
    pytest.param("cuda", "1", "pp2", marks=needs_2_gpus),
    pytest.param("cuda", "1", "tp2", marks=needs_2_gpus),
    pytest.param("cuda", "1", "tp2sp", marks=[needs_2_gpus, needs_te_norms]),
])
def test_hybrid_resumes_at_another_parallel_layout(corpus, saved_at_iteration_3, tmp_path,
                                                   device, save, load):
    """Interrupted at iteration 3 at one layout (Megatron saves and exits), resumed at
    another (Megatron's torch_dist checkpoint reshards model and optimizer state; with
    ``|``-split PP=2 the n streams cross the stage boundary, with TP=2 + SP they are split
    along the sequence): the resumed iterations 4-6 give the uninterrupted run's micro-batch
    losses and gradient norms within rtol 1e-5 (the order of TP's reductions and
    of the stages' gradient-norm sums may differ). On 2 GPUs this is the check that PP=2 and
    TP=2 + SP equal one GPU over several optimizer steps. Compared per micro-batch: after a
    resume, Megatron 0.19.2's logged loss at the second iteration averages the first two.
    (Saved at PP=2, the uninterrupted run is PP=2's: its stages start from other weights.)"""
    ckpt = tmp_path / "ckpt"
    (save_flags, save_procs), (load_flags, load_procs) = LAYOUTS[save], LAYOUTS[load]
    first = saved_at_iteration_3(ckpt, *MHC, *save_flags, nproc=save_procs,
                                 device=device).ok()
    assert "successfully saved checkpoint" in first.out
    second = pretrain(corpus, *MHC, *load_flags, "--load", str(ckpt), nproc=load_procs,
                      device=device).ok()
    assert "successfully loaded checkpoint" in second.out and sorted(second.logged) == [4, 5, 6]
    whole = shared_run(corpus, *MHC, *save_flags, nproc=save_procs, device=device)
    assert_close(first.train, whole.train[:2 * 3], rtol=1e-5)
    assert_close(second.train, whole.train[2 * 3:], rtol=1e-5)
    assert sorted(second.grad_norms) == [4, 5, 6]
    assert_close([second.grad_norms[i] for i in (4, 5, 6)],
                 [whole.grad_norms[i] for i in (4, 5, 6)], rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_hybrid_bf16_with_fp32_mappings_resumes_bitwise(corpus, saved_at_iteration_3, tmp_path,
                                                        device):
    """``--bf16 --mhc-params-dtype fp32`` (Float16Module, Megatron's float16 optimizer, fp32
    mapping parameters): the example runs ``pretrain`` inside
    ``fp32_params_in_megatron_training`` for a hybrid model as for a GPT, so the checkpoint
    saved at iteration 3 holds the fp32 mappings and their optimizer state, and the resumed
    iterations repeat the uninterrupted run's losses and gradient norms bit for bit (on a
    GPU with Megatron's local modules, also where TE is installed, as
    test_fp32_mapping_params.py: TE's fused attention may reorder its backward sums)."""
    flags = (*MHC, *PATTERN, "--bf16", "--mhc-params-dtype", "fp32",
             *(LOCAL_MODULE_FLAGS if device == "cuda" else ()))  # (CPU ranks: already local)
    ckpt = tmp_path / "ckpt"
    first = saved_at_iteration_3(ckpt, *flags, device=device).ok()
    assert "successfully saved checkpoint" in first.out
    second = pretrain(corpus, *flags, "--load", str(ckpt), device=device).ok()
    assert "successfully loaded checkpoint" in second.out
    whole = shared_run(corpus, *flags, device=device)
    assert len(whole.train) == 2 * ITERS and first.train + second.train == whole.train
    assert second.grad_norms == {i: whole.grad_norms[i] for i in (4, 5, 6)}


@pytest.mark.parametrize("device", PRETRAIN_DEVICES)
def test_hybrid_moe_trains(corpus, device):
    """Pattern ``"*E*E"``: MoE layers (4 experts, top 2), each with its hyper-connection,
    learn through Megatron's loop."""
    run = pretrain(corpus, *MHC, *MOE, device=device).ok()
    assert "layers='*E*E' (4 layers)" in run.out and "load_balancing_loss" in run.out
    assert len(run.train) == 2 * ITERS and len(run.logged) == ITERS
    assert run.logged[ITERS] < run.logged[1] - 0.2, run.logged


@pytest.mark.parametrize("device", PRETRAIN_DEVICES)
def test_hybrid_multi_token_prediction_trains(corpus, device):
    """Pattern ``"*-*-/*-"`` (one MTP depth of an attention and an MLP layer): the MTP loss
    is logged and falls, and the depth's two inner layers are mHC layers: the mHC model's
    MTP block has exactly the baseline MTP block's parameters plus two hyper-connections
    (the mHC stack spec's ``mtp_block_spec``, which Megatron's HybridModel builds)."""
    run = pretrain(corpus, *MHC, *MTP, device=device).ok()
    assert len(run.mtp) == ITERS and run.mtp[-1] < run.mtp[0] - 0.2, run.mtp
    assert run.logged[ITERS] < run.logged[1] - 0.2, run.logged
    base_mtp = pretrain(corpus, *BASE, *MTP, device=device).ok()
    base = shared_run(corpus, *BASE, *PATTERN, device=device)
    mhc = shared_run(corpus, *MHC, *PATTERN, device=device)
    assert run.params - mhc.params == (base_mtp.params - base.params) + 2 * mapping_params(), \
        (run.params, mhc.params, base_mtp.params, base.params)


def test_hybrid_bad_mhc_flag_fails_with_the_config_error(corpus):
    """A bad mHC flag with a hybrid pattern: the launch stops with the config's refusal
    (raised right after Megatron parses the flags, before any process group exists)."""
    run = pretrain(corpus, *MHC, *PATTERN, "--num-residual-streams", "0", nproc=1)
    assert run.returncode != 0, run.out[-3000:]
    assert re.search(r"ValueError: mHC config: [^\n]*num_residual_streams[^\n]*Fix: ", run.out), \
        run.out[-3000:]
