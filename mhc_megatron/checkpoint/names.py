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

with ``X`` in ``fn`` / ``base`` / ``scale`` for our ``phi`` / ``bias`` / ``alpha``. Hugging
Face's DeepSeek-V4 has no MTP modules: MTP parameters have no ``hf`` name. Other parameters
(attention, MoE, norms, embeddings) are not mHC's and pass through unchanged; convert them with
your model family's converter. ``megatron_core`` is the ``GPTModel`` layout; a ``HybridModel``'s
layers are numbered per sublayer: map its keys to the GPT layout first
(:mod:`mhc_megatron.checkpoint.gpt_to_hybrid`).

``python -m mhc_megatron.convert`` runs :func:`convert_state_dict` on a ``.safetensors`` or
``torch.save`` file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SCHEMES = ("megatron_core", "hf", "deepseek")
_OURS_TO_X = {"phi": "fn", "bias": "base", "alpha": "scale"}
_X_TO_OURS = {v: k for k, v in _OURS_TO_X.items()}
_SUBLAYERS = {"self_attention": "attn", "mlp": "ffn"}
_SUBLAYERS_BACK = {v: k for k, v in _SUBLAYERS.items()}


@dataclass(frozen=True)
class MHCParameter:
    """One mHC parameter, independent of names: ``kind`` "hc" (a sublayer's hyper-connection:
    ``sublayer`` "attn" or "ffn") or "head" (an output head); ``layer`` the decoder layer
    (None for the decoder's head); ``mtp`` the MTP depth (None in the decoder); ``param``
    "fn", "base" or "scale"."""

    kind: str
    param: str
    layer: int | None = None
    sublayer: str | None = None
    mtp: int | None = None


_PATTERNS = {
    "megatron_core": (
        (re.compile(r"^decoder\.layers\.(\d+)\.(self_attention|mlp)_hyper_connection\."
                    r"(phi|bias|alpha)$"),
         lambda m: MHCParameter("hc", _OURS_TO_X[m[3]], int(m[1]), _SUBLAYERS[m[2]])),
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
    """``p``'s name in ``scheme``; a clear error where the scheme has none (HF: MTP)."""
    _check_scheme(scheme)
    if scheme == "megatron_core":
        ours = _X_TO_OURS[p.param]
        if p.kind == "head":
            owner = "decoder" if p.mtp is None else f"mtp.layers.{p.mtp}"
            return f"{owner}.final_layernorm.head.{ours}"
        sub = _SUBLAYERS_BACK[p.sublayer]
        if p.mtp is None:
            return f"decoder.layers.{p.layer}.{sub}_hyper_connection.{ours}"
        return f"mtp.layers.{p.mtp}.mtp_model_layer.{sub}_hyper_connection.{ours}"
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


def convert_state_dict(state_dict: dict, source: str, target: str,
                       drop_unnamed: bool = False) -> dict:
    """``state_dict`` with its mHC parameters renamed from ``source`` to ``target`` names
    (module docstring); the tensors are the same objects, other keys pass through.
    ``drop_unnamed``: leave out mHC parameters ``target`` has no name for (HF: MTP) instead of
    raising. An mHC-looking key of ``source`` that no pattern matches raises, naming it."""
    _check_scheme(source)
    _check_scheme(target)
    out = {}
    for key, value in state_dict.items():
        p = parse_name(key, source)
        if p is None:
            if _looks_like_mhc(key, source):
                raise ValueError(
                    f"{key!r} looks like an mHC parameter but matches no {source!r} name. Fix: "
                    f"check the source scheme (one of {SCHEMES}).")
            out[key] = value
            continue
        if drop_unnamed and target == "hf" and p.mtp is not None:
            continue
        new_key = format_name(p, target)
        if new_key in out:
            raise ValueError(f"two parameters map to {new_key!r}. Fix: check the source scheme.")
        out[new_key] = value
    return out


def _looks_like_mhc(key: str, scheme: str) -> bool:
    markers = {"megatron_core": ("hyper_connection.", ".head."),
               "hf": ("_hc.", "hc_head."), "deepseek": ("hc_",)}[scheme]
    return any(m in key for m in markers)
