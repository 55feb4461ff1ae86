"""The names of the mHC parameters in other checkpoints, and conversion between them.

The same parameters live under other names elsewhere; the tensors are the same (rows of
``fn`` in the order pre, post, residual mix; ``scale`` = our ``alpha``, ``base`` = our
``bias``), so conversion renames, it does not change values. The H_res orientation is not a
property of the tensors but of the math: DeepSeek-V4 checkpoints mix the streams with H_res
transposed, so a model that loads them must use ``mhc_variant="deepseek_v4"`` (and one saved
to those names must have been trained with it).

Schemes (``L`` a decoder layer, ``d`` an MTP depth):

=============  ===========================================  ==============================  =====================
what           ``megatron_core`` (mhc-megatron, GPTModel)   ``hf`` (transformers)           ``deepseek`` (release)
=============  ===========================================  ==============================  =====================
attention HC   decoder.layers.L.self_attention_hyper_        model.layers.L.attn_hc.X        layers.L.hc_attn_X
               connection.{phi,bias,alpha}
MLP HC         decoder.layers.L.mlp_hyper_connection.*      model.layers.L.ffn_hc.X         layers.L.hc_ffn_X
output head    decoder.final_layernorm.head.*               model.hc_head.hc_X              hc_head_X
MTP HC         mtp.layers.d.mtp_model_layer.*_hyper_         (none)                          mtp.d.hc_{attn,ffn}_X
               connection.*
MTP head       mtp.layers.d.final_layernorm.head.*          (none)                          mtp.d.hc_head_X
=============  ===========================================  ==============================  =====================

with ``X`` in ``fn`` / ``base`` / ``scale`` for our ``phi`` / ``bias`` / ``alpha``.

``megatron_lm`` (Megatron-LM's mHC, ``megatron/core/transformer/hyper_connection.py``, and its
DeepSeek-V4 model as Megatron-Bridge maps it):
``decoder.layers.L.{self_attention,mlp}_hyper_connection.{mapping_proj.weight, bias}`` for
``fn``, ``base``, and ``alpha_pre`` / ``alpha_post`` / ``alpha_res`` (``[1]`` each) for the
three entries of ``scale``; MTP depths under ``mtp.layers.d.mtp_model_layer.`` the same; the
output heads ``decoder.hc_head_X`` and ``mtp.layers.d.hc_head_X`` (read also as Bridge's
``decoder.hc_head_params.hc_head_X``). Its in-tree mHC has the paper's conventions
(``mhc_variant="paper"``) and no head (it averages the streams; its RMS puts eps outside the
square root, so a converted checkpoint computes our function up to that eps); its DeepSeek-V4
model has DeepSeek-V4's (``mhc_variant="deepseek_v4"``). Hugging Face's DeepSeek-V4 has no MTP
modules: MTP parameters have no ``hf`` name.

Megatron distributed checkpoints keep a GPT's layers stacked: one tensor per parameter name
with the layer as its first axis, ``decoder.layers.{self_attention,mlp}_hyper_connection.X``
(no layer index). ``megatron_core`` and ``megatron_lm`` names have that form too
(:attr:`MHCParameter.stacked`); ``hf`` and ``deepseek`` names are per layer
(:func:`mhc_megatron.checkpoint.dist_files.unstack_layers` splits the stacks first).

Other parameters (attention, MoE, norms, embeddings) are not mHC's and pass through unchanged
(convert them with your model family's converter), but for one rename: our final norms wrap
Megatron's norm (``decoder.final_layernorm.norm.weight``, also per MTP depth), which every
other scheme names as Megatron does (``decoder.final_layernorm.weight``). ``megatron_core`` is
the ``GPTModel`` layout; a ``HybridModel``'s layers are numbered per sublayer: map its keys to
the GPT layout first (:mod:`mhc_megatron.checkpoint.gpt_to_hybrid`).

``python -m mhc_megatron.convert`` runs :func:`convert_state_dict` on a ``.safetensors`` or
``torch.save`` file or a Megatron distributed checkpoint.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

SCHEMES = ("megatron_core", "hf", "deepseek", "megatron_lm")
_ALPHA_PARTS = ("pre", "post", "res")  # Megatron-LM's alpha_pre / alpha_post / alpha_res
_OURS_TO_X = {"phi": "fn", "bias": "base", "alpha": "scale"}
_X_TO_OURS = {v: k for k, v in _OURS_TO_X.items()}
_SUBLAYERS = {"self_attention": "attn", "mlp": "ffn"}
_SUBLAYERS_BACK = {v: k for k, v in _SUBLAYERS.items()}
# Megatron-LM's names -> ``param`` ("scale_pre" etc.: one entry of ``scale``)
_MEGATRON_LM_PARAMS = {"mapping_proj.weight": "fn", "bias": "base",
                       **{f"alpha_{part}": f"scale_{part}" for part in _ALPHA_PARTS}}


@dataclass(frozen=True)
class MHCParameter:
    """One mHC parameter, independent of names: ``kind`` "hc" (a sublayer's hyper-connection:
    ``sublayer`` "attn" or "ffn") or "head" (an output head); ``layer`` the decoder layer
    (None for the decoder's head and for ``stacked``: every decoder layer's, stacked on a
    first axis, as Megatron's distributed checkpoints hold them); ``mtp`` the MTP depth (None
    in the decoder); ``param`` "fn", "base" or "scale"."""

    kind: str
    param: str
    layer: int | None = None
    sublayer: str | None = None
    mtp: int | None = None
    stacked: bool = False


def _layer(index: str | None) -> dict:
    """``layer`` / ``stacked`` of an optional ``(\d+)\.`` group of ``decoder.layers.``."""
    return {"stacked": True} if index is None else {"layer": int(index)}


_PATTERNS = {
    "megatron_core": (
        (re.compile(r"^decoder\.layers\.(?:(\d+)\.)?(self_attention|mlp)_hyper_connection\."
                    r"(phi|bias|alpha)$"),
         lambda m: MHCParameter("hc", _OURS_TO_X[m[3]], sublayer=_SUBLAYERS[m[2]],
                                **_layer(m[1]))),
        (re.compile(r"^decoder\.final_layernorm\.head\.(phi|bias|alpha)$"),
         lambda m: MHCParameter("head", _OURS_TO_X[m[1]])),
        (re.compile(r"^mtp\.layers\.(\d+)\.mtp_model_layer\.(self_attention|mlp)_hyper_"
                    r"connection\.(phi|bias|alpha)$"),
         lambda m: MHCParameter("hc", _OURS_TO_X[m[3]], None, _SUBLAYERS[m[2]], int(m[1]))),
        (re.compile(r"^mtp\.layers\.(\d+)\.final_layernorm\.head\.(phi|bias|alpha)$"),
         lambda m: MHCParameter("head", _OURS_TO_X[m[2]], mtp=int(m[1]))),
    ),
    "hf": (
        (re.compile(r"^model\.layers\.(\d+)\.(attn|ffn)_hc\.(fn|base|scale)$"),
         lambda m: MHCParameter("hc", m[3], int(m[1]), m[2])),
        (re.compile(r"^model\.hc_head\.hc_(fn|base|scale)$"),
         lambda m: MHCParameter("head", m[1])),
    ),
    "megatron_lm": (
        (re.compile(r"^decoder\.layers\.(?:(\d+)\.)?(self_attention|mlp)_hyper_connection\."
                    r"(mapping_proj\.weight|bias|alpha_pre|alpha_post|alpha_res)$"),
         lambda m: MHCParameter("hc", _MEGATRON_LM_PARAMS[m[3]], sublayer=_SUBLAYERS[m[2]],
                                **_layer(m[1]))),
        (re.compile(r"^decoder\.(?:hc_head_params\.)?hc_head_(fn|base|scale)$"),
         lambda m: MHCParameter("head", m[1])),
        (re.compile(r"^mtp\.layers\.(\d+)\.mtp_model_layer\.(self_attention|mlp)_hyper_"
                    r"connection\.(mapping_proj\.weight|bias|alpha_pre|alpha_post|alpha_res)$"),
         lambda m: MHCParameter("hc", _MEGATRON_LM_PARAMS[m[3]], None, _SUBLAYERS[m[2]],
                                int(m[1]))),
        (re.compile(r"^mtp\.layers\.(\d+)\.hc_head_(fn|base|scale)$"),
         lambda m: MHCParameter("head", m[2], mtp=int(m[1]))),
    ),
    "deepseek": (
        (re.compile(r"^layers\.(\d+)\.hc_(attn|ffn)_(fn|base|scale)$"),
         lambda m: MHCParameter("hc", m[3], int(m[1]), m[2])),
        (re.compile(r"^hc_head_(fn|base|scale)$"), lambda m: MHCParameter("head", m[1])),
        (re.compile(r"^mtp\.(\d+)\.hc_(attn|ffn)_(fn|base|scale)$"),
         lambda m: MHCParameter("hc", m[3], None, m[2], int(m[1]))),
        (re.compile(r"^mtp\.(\d+)\.hc_head_(fn|base|scale)$"),
         lambda m: MHCParameter("head", m[2], mtp=int(m[1]))),
    ),
}


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown checkpoint naming scheme {scheme!r}. Fix: use one of "
                         f"{SCHEMES}.")


def parse_name(key: str, scheme: str) -> MHCParameter | None:
    """The mHC parameter ``key`` names in ``scheme``, or None for any other parameter."""
    _check_scheme(scheme)
    for pattern, build in _PATTERNS[scheme]:
        match = pattern.match(key)
        if match:
            return build(match)
    return None


def format_name(p: MHCParameter, scheme: str) -> str:
    """``p``'s name in ``scheme``; a clear error where the scheme has none (HF: MTP; HF and
    DeepSeek: stacked layers)."""
    _check_scheme(scheme)
    if scheme in ("megatron_core", "megatron_lm"):
        return _megatron_name(p, scheme)
    if p.stacked:
        raise ValueError(
            f"{p} holds every layer's tensor stacked (a Megatron distributed checkpoint's "
            f"layout), and {scheme!r} names one layer's. Fix: split the stacks first "
            "(mhc_megatron.checkpoint.dist_files.unstack_layers; python -m "
            "mhc_megatron.convert does it for a distributed checkpoint).")
    if scheme == "hf":
        if p.mtp is not None:
            raise ValueError(
                f"{p} is a multi-token-prediction parameter, and Hugging Face's DeepSeek-V4 has "
                "no MTP modules, so it has no 'hf' name. Fix: drop the MTP parameters "
                "(drop_unnamed=True) or convert to 'deepseek' names, which have them.")
        if p.kind == "head":
            return f"model.hc_head.hc_{p.param}"
        return f"model.layers.{p.layer}.{p.sublayer}_hc.{p.param}"
    owner = "" if p.mtp is None else f"mtp.{p.mtp}."
    if p.kind == "head":
        return f"{owner}hc_head_{p.param}"
    layer = owner if p.mtp is not None else f"layers.{p.layer}."
    return f"{layer}hc_{p.sublayer}_{p.param}"


def _megatron_name(p: MHCParameter, scheme: str) -> str:
    """``p``'s ``megatron_core`` or ``megatron_lm`` name (``format_name``)."""
    if scheme == "megatron_core":
        ours = _X_TO_OURS[p.param]
        if p.kind == "head":
            owner = "decoder" if p.mtp is None else f"mtp.layers.{p.mtp}"
            return f"{owner}.final_layernorm.head.{ours}"
        leaf = ours
    else:
        if p.kind == "head":
            owner = "decoder" if p.mtp is None else f"mtp.layers.{p.mtp}"
            return f"{owner}.hc_head_{p.param}"
        leaf = {"fn": "mapping_proj.weight", "base": "bias"}.get(p.param)
        if leaf is None:
            if not p.param.startswith("scale_"):
                raise ValueError(f"{p}: Megatron-LM keeps scale as alpha_pre/_post/_res; "
                                 "split it first (convert_state_dict does)")
            leaf = f"alpha_{p.param[len('scale_'):]}"
    sub = _SUBLAYERS_BACK[p.sublayer]
    if p.mtp is not None:
        return f"mtp.layers.{p.mtp}.mtp_model_layer.{sub}_hyper_connection.{leaf}"
    layer = "" if p.stacked else f"{p.layer}."
    return f"decoder.layers.{layer}{sub}_hyper_connection.{leaf}"


# our final norms wrap Megatron's (StreamContractingNorm.norm): their keys as other schemes
# (Megatron's own layout) name them
_WRAPPED_FINAL_NORM = re.compile(r"^((?:decoder|mtp\.layers\.\d+)\.final_layernorm\.)norm\.(.+)$")
_FINAL_NORM = re.compile(r"^((?:decoder|mtp\.layers\.\d+)\.final_layernorm\.)(.+)$")


def _final_norm_key(key: str, source: str, target: str) -> str:
    """A non-mHC ``key`` in ``target``'s layout: our final norms' inner norm
    (``...final_layernorm.norm.*``) is ``...final_layernorm.*`` in every other scheme."""
    if source == "megatron_core" and target != "megatron_core":
        m = _WRAPPED_FINAL_NORM.match(key)
        return key if m is None else m[1] + m[2]
    if target == "megatron_core" and source != "megatron_core":
        m = _FINAL_NORM.match(key)
        if m is not None and not m[2].startswith(("norm.", "head.")):
            return f"{m[1]}norm.{m[2]}"
    return key


def convert_state_dict(state_dict: dict, source: str, target: str,
                       drop_unnamed: bool = False) -> dict:
    """``state_dict`` with its mHC parameters renamed from ``source`` to ``target`` names
    (module docstring); the tensors are the same objects (but Megatron-LM's three ``alpha_*``,
    merged into ``scale`` and split from it in the order pre, post, res, along the last axis,
    so stacked layers too), other keys pass through (our final norms' inner norm renamed,
    module docstring). ``drop_unnamed``: leave out mHC parameters ``target`` has no name for
    (HF: MTP) instead of raising. An mHC-looking key of ``source`` that no pattern matches
    raises, naming it."""
    _check_scheme(source)
    _check_scheme(target)
    out, scale_parts = {}, {}
    for key, value in state_dict.items():
        p = parse_name(key, source)
        if p is None:
            if _looks_like_mhc(key, source):
                raise ValueError(
                    f"{key!r} looks like an mHC parameter but matches no {source!r} name. Fix: "
                    f"check the source scheme (one of {SCHEMES}).")
            new_key = _final_norm_key(key, source, target)
            if new_key in out:
                raise ValueError(f"two parameters map to {new_key!r}. Fix: check the source "
                                 "scheme.")
            out[new_key] = value
            continue
        if p.param.startswith("scale_"):  # one of Megatron-LM's three alphas: merged below
            scale_parts.setdefault(dataclasses.replace(p, param="scale"), {})[p.param] = value
            continue
        _put(out, p, value, target, drop_unnamed)
    for p, parts in scale_parts.items():
        missing = [f"alpha_{q}" for q in _ALPHA_PARTS if f"scale_{q}" not in parts]
        if missing:
            raise ValueError(
                f"layer {p.layer} {p.sublayer}: {missing} missing. Fix: pass the whole state "
                "dict (Megatron-LM's hyper-connections hold alpha_pre, alpha_post, alpha_res).")
        scale = torch.cat([parts[f"scale_{q}"] for q in _ALPHA_PARTS], dim=-1)
        _put(out, p, scale, target, drop_unnamed)
    return out


def has_name(p: MHCParameter, scheme: str) -> bool:
    """Whether ``scheme`` names ``p`` (Hugging Face's has no MTP)."""
    return p.mtp is None if scheme == "hf" else True


def _put(out: dict, p: MHCParameter, value, target: str, drop_unnamed: bool) -> None:
    """Store ``p`` under its ``target`` name (Megatron-LM: ``scale`` as its three alphas)."""
    if drop_unnamed and not has_name(p, target):
        return
    if target == "megatron_lm" and p.kind == "hc" and p.param == "scale":
        items = [(dataclasses.replace(p, param=f"scale_{q}"), value[..., i:i + 1].clone())
                 for i, q in enumerate(_ALPHA_PARTS)]
    else:
        items = [(p, value)]
    for q, tensor in items:
        new_key = format_name(q, target)
        if new_key in out:
            raise ValueError(f"two parameters map to {new_key!r}. Fix: check the source scheme.")
        out[new_key] = tensor


def _looks_like_mhc(key: str, scheme: str) -> bool:
    markers = {"megatron_core": ("hyper_connection.", ".head."),
               "megatron_lm": ("hyper_connection.", "hc_head"), "hf": ("_hc.", "hc_head."),
               "deepseek": ("hc_",)}[scheme]
    return any(m in key for m in markers)
