"""fp32 mapping parameters in a bf16/fp16 model, through Megatron-Core 0.19.2's optimisers.

With ``mhc_params_dtype=torch.float32`` the mHC mapping parameters (``phi``, ``alpha``,
``bias``) stay fp32 when ``Float16Module`` casts the model to bf16/fp16
(``HyperConnectionModule._apply``). Megatron-Core 0.19.2 trains such a model correctly:

* DDP groups parameters into one buffer per ``(param dtype, grad dtype)``
  (``distributed/param_and_grad_buffer.py: group_params_for_buffers``), so the fp32
  parameters get their own fp32 param/grad buffer, whose gradients are reduced (or
  reduce-scattered) like every other buffer's;
* the float16 optimiser keeps fp32 parameters as their own main parameters
  (``fp32_from_fp32_groups``, gradient = ``main_grad``); the distributed optimiser shards
  them as views of the fp32 param buffer (``model_fp32_groups`` / ``shard_fp32_groups``),
  which its parameter all-gather keeps in sync.

Only their checkpoints are wrong, in three places (file:line in ``megatron/core/optimizer/``;
all latent in Megatron, whose own models keep one dtype per param group):

1. float16 optimiser, save: ``Float16OptimizerWithFloat16Params.sharded_state_dict``
   (``optimizer.py:1150``) numbers the model tensors over ``float16_groups`` only, while the
   inner torch optimiser's state ids count *every* parameter of every group, fp32 ones too;
   ``fp32_from_fp16_params`` is zipped with all ids of a group (``optimizer.py:1161``).
   From the first fp32 parameter on, ids miss (``KeyError`` at ``optimizer.py:1165``) or
   hit another tensor (shape assertion in ``make_sharded_optimizer_tensor``, or wrong data).
2. distributed optimiser, save and load: ``_build_optimizer_group_ranges``
   (``distrib_optimizer.py:330-337``) records each parameter's ``(group_index,
   group_order)`` in grad-buffer order, but ``_build_model_and_main_param_groups``
   (``distrib_optimizer.py:486-490``) installs each group as ``[*fp32 shards,
   *fp32-from-float16 shards]`` and ``model_param_group_index_map`` is never rebuilt, so
   ``_get/_set_main_param_and_optimizer_states`` (``:1097``, ``:1199``) and
   ``load_state_dict`` (``:990``) take another parameter's shard: ``dp_reshardable`` (the
   ``torch_dist`` default) asserts at save (``:1958``); ``fully_reshardable`` /
   ``fully_sharded_model_space`` would carry another parameter's state, silently where the
   shapes agree. (Megatron-LM fixed this after 0.19 the same way: PR #5835.)
3. distributed optimiser, load: an fp32 parameter's shard is ``model_param.view(-1)[...]``
   (``distrib_optimizer.py:467``), a view autograd tracks, where a float16 parameter's is
   taken from ``model_param.detach()`` (``:412``); ``load_parameter_state_from_dp_reshardable``
   (``:2061``, not under ``no_grad``) copies into it (``:1225``): "a view of a leaf Variable
   that requires grad is being used in an in-place operation". (This one hits any fp32
   parameter under the distributed optimiser, an all-fp32 model too.)

The fix changes no Megatron code; it adjusts the optimiser *instance* once, right after
``get_megatron_optimizer`` built it, before any step or checkpoint load
(:func:`make_fp32_params_checkpointable`), with Megatron's own code for the same job:

* float16 optimiser: each fp32 parameter takes the path of a bf16 one, with an fp32 main
  copy made as the constructor makes a bf16 parameter's (``optimizer.py:1010-1021``: same
  attributes, ``param.main_param``). Every parameter of every group is then in
  ``float16_groups`` in the inner optimiser's order, so Megatron's ``sharded_state_dict`` /
  ``state_dict`` / ``load_state_dict`` / ``reload_model_params`` are right as they are. The
  updates are bitwise the same (main grad = the fp32 ``main_grad`` itself; the fp32 -> fp32
  copy back is exact); the cost is one fp32 copy of the fp32 parameters. In the checkpoint
  such a parameter looks like a bf16 one: the model tensor (here fp32),
  ``optimizer.state.fp32_param.*`` and the Adam moments.
* distributed optimiser: the fp32 shards become ``model_param.detach().view(-1)[...]`` (as
  for float16 parameters; the same storage, so the update still lands in the parameter and
  the param buffer) and ``model_param_group_index_map`` is rebuilt in the installed order,
  checked against the inner optimiser's parameter objects. Both are no-ops for a model
  without fp32 parameters, so other models and their checkpoints are unaffected.

Megatron's training loop builds its optimiser inside ``pretrain`` and offers no hook, so
:func:`fp32_params_in_megatron_training` rebinds the one name it calls
(``megatron.training.training.get_megatron_optimizer``) for the duration of a ``with`` block
(scoped and restored, like ``mhc_megatron.training.config._mla_config_class``).

Verified with Megatron-Core 0.19.2; on another version both functions warn, and every step
checks the internals it relies on and refuses (``RuntimeError``) where they changed.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

VERIFIED_MEGATRON_CORE = "0.19."


def _megatron_core_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def _check_version() -> None:
    version = _megatron_core_version()
    if not version.startswith(VERIFIED_MEGATRON_CORE):
        warnings.warn(
            f"mhc_megatron.training.fp32_params was verified with Megatron-Core "
            f"{VERIFIED_MEGATRON_CORE}x, found {version}: its structural checks still run, but "
            "check whether this Megatron version handles fp32 parameters in a bf16/fp16 model "
            "itself (Megatron-LM PRs #5835, #5929).", UserWarning, stacklevel=3)


def _fail(what: str) -> None:
    raise RuntimeError(
        f"mhc_megatron.training.fp32_params: {what} (Megatron-Core {_megatron_core_version()}). "
        "Fix: leave mhc_params_dtype=None (the mapping parameters in params_dtype), or adapt "
        "this module to this Megatron version.")


def _sub_optimizers(optimizer) -> list:
    from megatron.core.optimizer import ChainedOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        return [o for sub in optimizer.chained_optimizers for o in _sub_optimizers(sub)]
    return [optimizer]


def _route_fp32_params_through_main_copies(opt) -> int:
    """``Float16OptimizerWithFloat16Params``: give each fp32 parameter an fp32 main copy, as
    the constructor does for bf16/fp16 ones. Returns the number of parameters moved."""
    from megatron.core import tensor_parallel
    from megatron.core.optimizer.optimizer import copy_optimizer_param_metadata

    if opt.is_stub_optimizer or not any(opt.fp32_from_fp32_groups):
        return 0
    if len(opt.optimizer.state) != 0:
        _fail("the float16 optimiser already has state; call make_fp32_params_checkpointable "
              "right after get_megatron_optimizer, before any step or checkpoint load")
    groups = opt.optimizer.param_groups
    if not len(groups) == len(opt.float16_groups) == len(opt.fp32_from_float16_groups) == \
            len(opt.fp32_from_fp32_groups):
        _fail("Float16OptimizerWithFloat16Params' group lists do not match its param groups")
    moved = 0
    for g, group in enumerate(groups):
        fp32_params = {id(p) for p in opt.fp32_from_fp32_groups[g]}
        model_of_main = {id(main): model for model, main
                         in zip(opt.float16_groups[g], opt.fp32_from_float16_groups[g])}
        model_params, main_params = [], []
        for i, param in enumerate(group["params"]):
            if id(param) in fp32_params:
                # As Float16OptimizerWithFloat16Params.__init__ does for a float16 parameter.
                main = param.detach().clone().float()
                tensor_parallel.copy_tensor_model_parallel_attributes(main, param)
                tensor_parallel.copy_gtp_attributes(main, param)
                copy_optimizer_param_metadata(main, param)
                group["params"][i] = main
                param.main_param = main
                model_params.append(param)
                main_params.append(main)
                moved += 1
            elif id(param) in model_of_main:
                model_params.append(model_of_main[id(param)])
                main_params.append(param)
            else:
                _fail("a parameter of the float16 optimiser is in none of its group lists")
        opt.float16_groups[g] = model_params
        opt.fp32_from_float16_groups[g] = main_params
        opt.fp32_from_fp32_groups[g] = []
    return moved


def _fix_distributed_optimizer(opt) -> None:
    """``DistributedOptimizer``: detach the fp32 shards and rebuild
    ``model_param_group_index_map`` in the order the inner optimiser holds the shards."""
    from megatron.core import tensor_parallel
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.optimizer.optimizer import copy_optimizer_param_metadata

    if opt.is_stub_optimizer or opt.ddp_config.use_megatron_fsdp:
        return
    if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        shard_low = opt.shard_float16_groups
    else:
        shard_low = opt.shard_fp32_from_float16_groups
    groups = opt.optimizer.param_groups
    if not len(groups) == len(opt.model_fp32_groups) == len(opt.model_float16_groups):
        _fail("the distributed optimiser's group lists do not match its param groups")
    new_map = {}
    for g, (model_fp32, model_low) in enumerate(zip(opt.model_fp32_groups,
                                                     opt.model_float16_groups)):
        installed = groups[g]["params"]
        expected = [*opt.shard_fp32_groups[g], *shard_low[g]]
        if len(installed) != len(expected) or any(a is not b for a, b in zip(installed, expected)):
            _fail("the distributed optimiser's param group no longer holds "
                  "[*shard_fp32, *shard_fp32_from_float16] in this order")
        for i, (model_param, shard) in enumerate(zip(model_fp32, opt.shard_fp32_groups[g])):
            if shard.requires_grad:  # a view of the parameter that autograd still tracks
                if isinstance(opt.optimizer, HybridDeviceOptimizer) or opt.optimizer.state:
                    _fail("the distributed optimiser already has state, or offloads to the CPU "
                          "(HybridDeviceOptimizer); call make_fp32_params_checkpointable right "
                          "after get_megatron_optimizer, without optimizer_cpu_offload")
                r = opt._get_model_param_range_map(model_param)["param"]
                # As DistributedOptimizer._build_model_and_main_param_groups does for a float16
                # parameter's shard: a detached view, so in-place loads are allowed.
                detached = model_param.detach().view(-1)[r.start:r.end]
                tensor_parallel.copy_tensor_model_parallel_attributes(detached, model_param)
                tensor_parallel.copy_gtp_attributes(detached, model_param)
                copy_optimizer_param_metadata(detached, model_param)
                opt.shard_fp32_groups[g][i] = detached
                installed[i] = detached
        for order, model_param in enumerate([*model_fp32, *model_low]):
            new_map[model_param] = (g, order)
    if set(new_map) != set(opt.model_param_group_index_map):
        _fail("the distributed optimiser's model_param_group_index_map covers other parameters")
    opt.model_param_group_index_map = new_map


def make_fp32_params_checkpointable(optimizer):
    """Make Megatron's optimiser ``optimizer`` (as returned by ``get_megatron_optimizer``,
    possibly a ``ChainedOptimizer``) save and load fp32 parameters of a bf16/fp16 model
    correctly. Call it once, right after building the optimiser. Idempotent; a no-op for
    models with one parameter dtype and for ``FP32Optimizer``. Returns ``optimizer``."""
    from megatron.core.optimizer import DistributedOptimizer, Float16OptimizerWithFloat16Params

    _check_version()
    for opt in _sub_optimizers(optimizer):
        # Two sibling classes (both MixedPrecisionOptimizer), two different fixes.
        if isinstance(opt, DistributedOptimizer):
            _fix_distributed_optimizer(opt)
        elif isinstance(opt, Float16OptimizerWithFloat16Params):
            _route_fp32_params_through_main_copies(opt)
    return optimizer


@contextlib.contextmanager
def fp32_params_in_megatron_training():
    """Within the block, Megatron's training loop (``megatron.training.pretrain``) applies
    :func:`make_fp32_params_checkpointable` to the optimiser it builds. Scoped: the name
    ``megatron.training.training.get_megatron_optimizer`` is restored on exit.

        with fp32_params_in_megatron_training():
            pretrain(cfg_container, datasets_provider, model_type, forward_step)
    """
    import megatron.training.training as training

    _check_version()
    original = getattr(training, "get_megatron_optimizer", None)
    if original is None or not callable(original):
        _fail("megatron.training.training no longer calls get_megatron_optimizer by name")

    @functools.wraps(original)
    def get_megatron_optimizer(*args, **kwargs):
        return make_fp32_params_checkpointable(original(*args, **kwargs))

    training.get_megatron_optimizer = get_megatron_optimizer
    try:
        yield
    finally:
        training.get_megatron_optimizer = original

