"""Megatron-Core 0.19.2's inference engines with mHC layers: the dynamic context and engine,
the static engine (the dynamic engine underneath), CUDA-graphed decode.

``DynamicInferenceContext`` runs every active request's new tokens as one flat sequence:
input ids and positions ``[1, T]`` (requests back to back in the context's request order, one
token per decoding request, a prompt per prefilling one; ``T`` padded), so the decoder sees
``[T, 1, C]`` and mHC's streams are ``[T, 1, n*C]``; keys and values go to a paged (block) KV
cache; prefill and decode requests share a forward pass. A token's n streams must stay with
that token through all of it. Checked, for a dense and an MoE GPT with mHC (n=4, the Triton
kernels) and the same models with mHC off (Megatron's own layers: a failure there is
Megatron's), batch > 1, prompts of different lengths:

* the context driven step by step (two prompts prefilled together, decode steps, a third
  prompt's prefill joining in a step with the others' decodes, requests finishing at
  different steps): every request's logits at every position equal the full forward of its
  tokens;
* greedy generation through ``DynamicInferenceEngine`` and ``StaticInferenceEngine`` equals
  greedy decoding by repeated full forwards;
* CUDA-graphed decode (``cuda_graph_impl="local"``, inference scope ``layer`` and ``block``,
  decode-only graphs): the eager engine's tokens, every decode step replayed from a graph.
  Each case runs in a child process (this file, ``--graph-case``): Megatron's CUDA-graph
  state is process-global, and a failed capture can leave the CUDA context unusable.

Precision: the dynamic context's attention is FlashAttention's paged kernel, which runs in
bf16 / fp16 only, so the models are bf16 and the reference (the full forward, Megatron's local
attention with an fp32 softmax) differs from the engine by bf16 rounding: logits agree within
``TOL`` of their largest magnitude, where a token reading another token's streams would be off
by the logits' own scale. Greedy tokens may differ only where the full forward's two
candidates are closer than ``TIE_TOL`` of that magnitude (a near-tie that rounding decides);
generation is compared up to the first such tie. MoE: every token goes to all 4 experts
(top-k = number of experts, so routing makes no discrete choice that rounding could flip),
drop-and-pad with capacity factor 1 (capacity = tokens: nothing is dropped) for the static
shapes CUDA graphs need, in every test alike.

Needs a CUDA device, FlashAttention (flash-attn >= 2.7.3, FA3 or FA4) and einops, as
Megatron's dynamic attention path does; skipped otherwise, with the reason.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # helpers, when run as a child
from mhc_megatron.training.inference import inference_engines_unavailable  # noqa: E402
from mhc_testing.greedy import (  # noqa: E402
    TIE_TOL,
    first_divergence,
    full_logits,
    greedy_by_full_forwards,
)

from helpers import (  # noqa: E402
    MHC_FLAGS,
    ROOT,
    SEQ,
    VOCAB,
    build_gpt,
    child_env,
    child_result,
    moe_overrides,
    pretrain,
    pretrain_cmd,
    run_ranks,
    tiny_config,
    write_pretrain_corpus,
)

MOE = {**moe_overrides(), "moe_router_topk": 4, "moe_token_dispatcher_type": "alltoall",
       "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
KINDS = {"dense": {}, "moe": MOE}
MHC = [pytest.param(True, id="mhc"), pytest.param(False, id="baseline")]
# Of the logits' largest magnitude. The bf16 rounding between the context's path and the full
# forward, measured on CPU with a PyTorch stand-in for the paged flash kernel: at most 7e-3 (a
# request compared with another request's full forward: 1.3).
TOL = 3e-2  # logits, every position
NEW_TOKENS = 6
PROMPT_LENGTHS = (5, 9, 3)  # batch 3; the longest prompt + NEW_TOKENS <= SEQ
# The context test: request id -> (prompt length, total length); request 2 joins after two
# steps, so its prefill shares a forward pass with the decodes of requests 0 and 1.
CONTEXT_REQUESTS = {0: (5, 14), 1: (9, 12), 2: (3, 10)}
JOIN_AFTER = {2: 2}
HEAD_DIM = 64
BLOCK_TOKENS = 256  # FlashAttention's paged KV cache (FA2) takes blocks of multiples of 256


UNAVAILABLE = inference_engines_unavailable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(UNAVAILABLE is not None,
                                                  reason=f"needs {UNAVAILABLE}")]


class _IdTokenizer:
    """What the engines use of a tokenizer when prompts are token ids: ``eod`` (the default
    termination id; the tests pass ``termination_id=-1``: no early stop) and ``detokenize``
    (the engine detokenizes finished requests)."""

    eod = -1
    bos = None
    vocab_size = VOCAB

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


@pytest.fixture(autouse=True)
def _inference_mode_off():
    """The engines set Megatron's process-wide ``InferenceMode`` flag and never clear it;
    cleared after each test, so later tests' models run as in training."""
    yield
    from megatron.core.inference.utils import InferenceMode

    InferenceMode.unset_active()


def _model(kind: str, mhc: bool, device, **config):
    """A bf16 GPT (3 layers, width 32, 4 heads of 64 channels, vocab ``VOCAB``) in eval mode;
    with mHC the mapping biases moved off their symmetric initial values (as in
    tests/test_inference.py). Heads of 64: FlashAttention's paged kernel (FA4 on Hopper) takes
    head dimensions of multiples of 16 only."""
    cfg = tiny_config(num_layers=3, kv_channels=HEAD_DIM, params_dtype=torch.bfloat16, bf16=True,
                      mhc_kernel_backend="triton", enable_hyper_connections=mhc,
                      **KINDS[kind], **config)
    # bf16 throughout, as Megatron's Float16Module casts a model (mapping parameters as the
    # config says)
    model = build_gpt(cfg, device).bfloat16().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "hyper_connection.bias" in name:
                p.add_(torch.randn_like(p))
    return model


def _inference_config(**overrides):
    from megatron.core.inference.config import InferenceConfig

    return InferenceConfig(**{"max_sequence_length": SEQ, "buffer_size_gb": 0.05,
                              "block_size_tokens": BLOCK_TOKENS, "max_requests": 4,
                              **overrides})


def _dynamic_engine(model, **overrides):
    """Megatron's sequence (as its ``apis/_llm_base.py``): context, GPT wrapper, controller,
    engine; CUDA graphs are captured in the engine's constructor when the model has them."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    context = DynamicInferenceContext(model.config, _inference_config(**overrides))
    controller = TextGenerationController(inference_wrapped_model=GPTInferenceWrapper(
        model, context), tokenizer=_IdTokenizer())
    return DynamicInferenceEngine(controller=controller, context=context)


def _greedy():
    from megatron.core.inference.sampling_params import SamplingParams

    return SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS, termination_id=-1)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _assert_greedy_equal(model, prompts, got, want, who: str) -> None:
    for prompt, g, w in zip(prompts, got, want, strict=True):
        d = first_divergence(model, prompt, g, w, TIE_TOL)
        if d is not None:
            print(f"\n[{who}] near-tie at step {d['step']}: gap {d['gap']:.3g} "
                  f"(bound {d['bound']:.3g})")
            assert d["gap"] <= d["bound"], (
                f"{who}: prompt of {len(prompt)} tokens, step {d['step']}: token {d['got']} "
                f"instead of {d['want']}, whose full-forward logits differ by {d['gap']:.4g} "
                f"(more than bf16 rounding, {d['bound']:.4g}); got {g}, want {w}")


def _context_logits(model, context, sequences: dict[int, list[int]]) -> dict[int, torch.Tensor]:
    """Drive ``context`` as the engine's controller does, feeding each request its own next
    token (``update_requests``); per request the logits of every position, ``[L, vocab]``.

    Per step: ``initialize_attention_state``; ``current_input_and_position_ids`` gives
    ``[1, T_padded]``; the model's logits are ``[1, T_padded, vocab]`` (every token's:
    ``materialize_only_last_token_logits=False``), rows in the order of the active requests
    (``request_ids[paused:total]``), ``request_query_lengths`` rows each."""
    from megatron.core.inference.inference_request import DynamicInferenceRequest
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.utils import InferenceMode

    def add(rid):
        prompt_len, total = CONTEXT_REQUESTS[rid]
        context.add_request(DynamicInferenceRequest(
            request_id=rid, prompt_tokens=torch.tensor(sequences[rid][:prompt_len],
                                                       device="cuda"),
            sampling_params=SamplingParams(num_tokens_to_generate=total - prompt_len,
                                           termination_id=-1)))

    rows: dict[int, dict[int, torch.Tensor]] = {rid: {} for rid in sequences}
    pending = dict(JOIN_AFTER)
    for rid in sequences:
        if rid not in pending:
            add(rid)
    step = 0
    with torch.inference_mode(), InferenceMode.active():
        while True:
            for rid in [r for r, after in pending.items() if after == step]:
                add(rid)
                del pending[rid]
            if context.total_request_count == 0:
                break
            assert context.paused_request_count == 0  # short requests: one KV block each
            context.initialize_attention_state()
            ids, pos = context.current_input_and_position_ids()
            out = model(ids, pos, None, inference_context=context, runtime_gather_output=True)
            active = slice(context.paused_request_count, context.total_request_count)
            order = context.request_ids[active].tolist()
            lengths = context.request_query_lengths[active].tolist()
            assert sum(lengths) == context.active_token_count
            ids_l, pos_l = ids[0].tolist(), pos[0].tolist()
            mask, next_tokens, row = [], [], 0
            for rid, q in zip(order, lengths):
                for r in range(row, row + q):
                    assert ids_l[r] == sequences[rid][pos_l[r]], "token layout"
                    rows[rid][pos_l[r]] = out[0, r].float()
                row += q
                nxt = pos_l[row - 1] + 1
                done = nxt == len(sequences[rid])
                mask.append(0 if done else 1)
                next_tokens.append(0 if done else sequences[rid][nxt])
            context.update_requests(torch.tensor(mask, dtype=torch.uint8),
                                    torch.tensor(next_tokens, dtype=torch.int64))
            step += 1
    assert not pending
    return {rid: torch.stack([r[t] for t in range(len(sequences[rid]))])
            for rid, r in rows.items()}


@pytest.mark.parametrize("mhc", MHC)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dynamic_context_decode_equals_full_forward(seeded, device, kind, mhc):
    """Prefill + step-by-step decode through ``DynamicInferenceContext`` (paged KV cache,
    requests of different lengths joining and finishing at different steps): every request's
    logits at every position equal its full forward's."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    model = _model(kind, mhc, device)
    g = torch.Generator().manual_seed(3)
    sequences = {rid: torch.randint(0, VOCAB, (total,), generator=g).tolist()
                 for rid, (_, total) in CONTEXT_REQUESTS.items()}
    assert max(len(s) for s in sequences.values()) <= SEQ
    context = DynamicInferenceContext(
        model.config, _inference_config(materialize_only_last_token_logits=False))
    cached = _context_logits(model, context, sequences)
    for rid, seq in sequences.items():
        full = full_logits(model, seq)  # [L, vocab]
        err = (cached[rid] - full).abs().max().item()
        print(f"\n[dynamic context] {kind} mhc={mhc} request {rid}: max |diff| {err:.3g}, "
              f"max |logit| {full.abs().max().item():.3g}")
        torch.testing.assert_close(cached[rid], full, rtol=TOL,
                                   atol=TOL * full.abs().max().item())
        # decode logits differ token to token (the streams are per token)
        assert not torch.allclose(cached[rid][-1], cached[rid][-2])


@pytest.mark.parametrize("mhc", MHC)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_generation_equals_full_forward_greedy(seeded, device, kind, mhc):
    """Greedy tokens of ``DynamicInferenceEngine.generate`` and ``StaticInferenceEngine.generate``
    (batch 3, prompts of 5, 9 and 3 tokens) equal greedy decoding by repeated full forwards,
    up to a near-tie."""
    from megatron.core.inference.contexts.static_context import StaticInferenceContext
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    model = _model(kind, mhc, device)
    prompts = _prompts()
    want = [greedy_by_full_forwards(model, p, NEW_TOKENS) for p in prompts]

    records = _dynamic_engine(model).generate(prompts, _greedy())  # in request-id order
    dynamic = [list(r.merge().generated_tokens) for r in records]
    _assert_greedy_equal(model, prompts, dynamic, want, "DynamicInferenceEngine")

    context = StaticInferenceContext(len(prompts), SEQ)
    controller = TextGenerationController(GPTInferenceWrapper(model, context), _IdTokenizer())
    static = StaticInferenceEngine(controller, max_batch_size=len(prompts), buffer_size_gb=0.05)
    assert not static.legacy, "Megatron could not build the static engine's dynamic context"
    results = static.generate(prompts=prompts, sampling_params=_greedy())
    _assert_greedy_equal(model, prompts, [list(r.generated_tokens) for r in results], want,
                         "StaticInferenceEngine")


# The GPT that examples/pretrain_gpt_mhc.py trains for the generation test: bf16, heads of 64
# channels (FlashAttention's paged kernel takes multiples of 16), mHC n=4.
GENERATION_GPT = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "2",
                  "--seq-length", "64", "--max-position-embeddings", "64",
                  "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                  "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0",
                  "--bf16"]
GENERATION_TRAINING = [*MHC_FLAGS, "--train-iters", "60", "--eval-interval", "60",
                       "--log-interval", "20"]


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    """A checkpoint that Megatron's training loop wrote: examples/pretrain_gpt_mhc.py, the
    generation GPT, 60 steps on the stdlib corpus (one GPU). ``(corpus, checkpoint dir)``."""
    root = tmp_path_factory.mktemp("generation")
    corpus = write_pretrain_corpus(root)
    ckpt = str(root / "ckpt")
    pretrain(corpus, *GENERATION_TRAINING, "--save", ckpt, "--save-interval", "60",
             device="cuda", model=GENERATION_GPT).ok()
    return corpus, ckpt


@pytest.mark.parametrize("engine", ["dynamic", "static"])
def test_generate_example_decodes_a_trained_checkpoint_greedily(trained_checkpoint, engine):
    """examples/generate_mhc.py on the trained checkpoint, through Megatron's engine (dynamic,
    or static) and the byte tokenizer: it prints each prompt's text, and its greedy tokens
    equal greedy decoding by repeated full forwards of the loaded model (``--check-greedy``,
    up to a near-tie)."""
    corpus, ckpt = trained_checkpoint
    cmd = pretrain_cmd(corpus, [*GENERATION_TRAINING, "--load", ckpt], "cuda",
                       model=GENERATION_GPT)
    cmd[0] = str(ROOT / "examples" / "generate_mhc.py")
    proc = run_ranks(1, *cmd, "--prompts", "import os", "def main(", "--max-new-tokens", "24",
                     "--greedy", "--check-greedy", "--engine", engine,
                     "--inference-dynamic-batching-buffer-size-gb", "1", env=child_env(),
                     timeout=400)
    out = proc.stdout + (proc.stderr or "")
    print(out[-3000:])
    assert proc.returncode == 0, out[-6000:]
    assert out.count("----- prompt ") == 2 and "import os" in out and "def main(" in out
    checks = [line for line in out.splitlines() if line.startswith("greedy check, prompt")]
    assert len(checks) == 2 and not any("DIVERGES" in line for line in checks), checks


@pytest.mark.parametrize("scope", ["layer", "block"])
@pytest.mark.parametrize("mhc", MHC)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_cuda_graphed_decode_equals_eager(kind, mhc, scope):
    """``DynamicInferenceEngine`` with Megatron's local CUDA graphs (decode-only graphs,
    ``inference_cuda_graph_scope`` ``layer`` / ``block``) gives the eager engine's greedy
    tokens (up to a near-tie), with every decode step replayed from a graph."""
    cmd = [sys.executable, __file__, "--graph-case", kind, str(int(mhc)), scope]
    r = child_result(cmd, child_env(), timeout=600)
    print(f"\n[cuda graphs] {kind} mhc={mhc} {scope}: {r['graphed_modules']}/"
          f"{r['graph_owners']} graph owners with graphs, "
          f"{r['graphed_decode_steps']}/{r['decode_steps']} decode steps graphed; "
          f"eager {r['eager']} graphed {r['graphed']}")
    assert r["graphed_modules"] == r["graph_owners"] > 0, "a graph owner holds no graph"
    assert r["decode_steps"] == NEW_TOKENS - 1
    assert r["graphed_decode_steps"] == r["decode_steps"], "a decode step ran eagerly"
    assert r["graphed_other_steps"] == r["eager_graphed_steps"] == 0  # decode-only graphs
    for d in r["divergences"]:
        assert d is None or d["gap"] <= d["bound"], (
            f"graphed decode chose {d['got']} where the eager engine chose {d['want']} "
            f"(step {d['step']}); their full-forward logits differ by {d['gap']:.4g} > "
            f"{d['bound']:.4g}: {r}")


def _run_engine(engine, prompts) -> tuple[list[list[int]], list[tuple[bool, bool]]]:
    """Greedy generation step by step: the tokens per prompt, and per step (decode-only,
    ran from a CUDA graph: ``cuda_graph_request_count`` set)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, _greedy())
    records, steps = [], []
    while engine.has_unfinished_requests():
        result = engine.step_modern()
        steps.append((bool(engine.decode_only.consumed),
                      result["cuda_graph_request_count"] is not None))
        records.extend(result["finished_request_records"])
    records.sort(key=lambda record: record.request_id)
    return [list(rec.merge().generated_tokens) for rec in records], steps


def _graph_case(kind: str, mhc: bool, scope: str) -> dict:
    """One CUDA-graph case in this process: the eager engine, then the graphed one on a model
    with the same weights; their tokens, step counts and divergences."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.inference.utils import InferenceMode
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

    from mhc_testing.cpu import init_single_process_group

    init_single_process_group()
    parallel_state.initialize_model_parallel(1, 1)
    # Megatron's graph managers take only a graph-safe RNG tracker (the inference one)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True,
                                                    force_reset_rng=True)
    torch.manual_seed(1234)
    eager_model = _model(kind, mhc, "cuda")
    graphed_model = _model(kind, mhc, "cuda", cuda_graph_impl="local",
                           inference_cuda_graph_scope=scope)
    loaded = graphed_model.load_state_dict(eager_model.state_dict(), strict=False)
    assert not loaded.unexpected_keys and all("_extra_state" in k for k in loaded.missing_keys)
    prompts = _prompts()
    eager, eager_steps = _run_engine(_dynamic_engine(eager_model), prompts)
    delete_cuda_graphs()
    engine = _dynamic_engine(graphed_model, num_cuda_graphs=-1,
                             use_cuda_graphs_for_non_decode_steps=False)
    graphed, steps = _run_engine(engine, prompts)
    holders = [graphed_model.decoder] if scope == "block" else list(graphed_model.decoder.layers)
    graphed_modules = sum(1 for m in holders if getattr(m, "cudagraph_manager", None) is not None
                          and m.cudagraph_manager.cudagraph_runners)
    InferenceMode.unset_active()
    divergences = [first_divergence(eager_model, p, g, e, TIE_TOL)
                   for p, g, e in zip(prompts, graphed, eager)]
    delete_cuda_graphs()
    parallel_state.destroy_model_parallel()
    return {"eager": eager, "graphed": graphed, "decode_steps": sum(d for d, _ in steps),
            "graphed_decode_steps": sum(d and g for d, g in steps),
            "graphed_other_steps": sum(g and not d for d, g in steps),
            "eager_graphed_steps": sum(g for _, g in eager_steps),
            "graphed_modules": graphed_modules, "graph_owners": len(holders),
            "divergences": divergences}


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "--graph-case":
        raise SystemExit("usage: test_inference_engines.py --graph-case {dense,moe} {0,1} "
                         "{layer,block}")
    result = _graph_case(sys.argv[2], bool(int(sys.argv[3])), sys.argv[4])
    print("RESULT " + json.dumps(result), flush=True)
