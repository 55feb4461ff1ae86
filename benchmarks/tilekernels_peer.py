"""Load DeepSeek's TileKernels (TileLang mHC of DeepSeek-V4) from a checkout, adapted to our
ops' layouts and signatures (benchmark only; we never vendor TileKernels' code).

Get it (a plain copy of the repository, default folder ``.tilekernels/``, ignored by git) and
its runtime (tilelang 0.1.11 with apache-tvm-ffi 0.1.11: 0.1.12 aborts at import; an
``nvcc`` to compile the kernels at first use)::

    git clone https://github.com/deepseek-ai/TileKernels .tilekernels   # or copy an export
    pip install tilelang==0.1.11 apache-tvm-ffi==0.1.11   # offline: benchmarks/README.md

``load_tilekernels(root)`` puts ``root`` on ``sys.path``, imports ``tile_kernels`` and returns
a :class:`TileKernelsMHC` whose ``pre`` / ``combine`` / ``output_head`` take and return our
layouts (``mhc_megatron.kernels.reference``):

* ``x [T, n, C]`` (stream-major): TileKernels' ``residual [..., n, C]``, the same bytes;
  passed as the view ``[1, T, n, C]`` (its ops want two leading dims).
* ``phi [m, n*C]`` (``m = 2n + n^2``): ``fn``, the same rows in the same order (pre ``0:n``,
  post ``n:2n``, comb ``2n:`` row-major, ``[i, j]`` at ``2n + i*n + j``); ``alpha [3]``:
  ``scale`` (pre, post, comb); ``bias [m]``: ``base``. As ``mhc_megatron.checkpoint.names``
  says (our phi/alpha/bias are DeepSeek's fn/scale/base), nothing to convert.
* ``h_res``: TileKernels' ``comb_mix [1, T, n, n]`` is the Sinkhorn output ``M`` and
  ``mhc_post`` mixes with its transpose (``x'[i] = sum_j M[j, i] x[j]``); our transposed
  form returns ``h_res = M^T`` and mixes with ``h_res`` itself, so ``h_res = comb_mix^T``
  (a view both ways; contiguous again when it goes back into ``mhc_post``).
* ``h_post``: ``post_mix [1, T, n, 1]`` viewed as ``[T, n]``; ``h_pre``: None
  (``mhc_pre`` does not return its ``pre_mix``); ``y``: ``layer_input [1, T, C]`` viewed.
* head: ``phi [n, n*C]``, ``alpha [1]``, ``bias [n]`` are ``mhc_head``'s ``fn`` (padded to
  ``[m, n*C]`` inside), ``scale``, ``base``.

So no weight needs converting and only views are taken (no copies in the timed region). The
math is our ``MappingForm("deepseek_v4", eps, transposed=True)`` with ``mhc_pre(...,
norm_eps=eps`` (RMS eps, inside the square root, as ours), ``pre_eps=form.eps,
sinkhorn_eps=form.eps, sinkhorn_repeat=iters, post_mult_value=2.0)`` (its defaults are
``post_mult_value=1.0`` and 10 iterations; our ``H_post`` is ``2 sigmoid``); the head is
``mhc_head(..., norm_eps=rms_eps, pre_eps=eps)``. TileKernels has no paper form.

TileKernels' limits: x bf16, fn / scale / base fp32, n = 4 (the projection kernel's tile is
24 = 2n + n^2 wide; the post backward asserts 4), ``n*C`` a multiple of 256, tokens a
multiple of 128 for the backward (128-token tiles; we do not rely on a tail); no bias
on the sublayer output (``combine``'s ``f_bias`` must be None). Under ``torch.no_grad`` its
``mhc_pre`` runs the fused inference kernel (``mhc_pre_big_fuse``); with gradients it runs
the four autograd ops (``pre_norm_fn``, ``pre_split_mixes``, ``sinkhorn_normalize``,
``pre_apply_mix``), each with a backward kernel. The projection is a TF32 GEMM (fn rounded
by ``round_to_tf32``). Its README asks for an SM90/SM100 GPU and CUDA 13.1+. Its
``mhc_head`` hands a non-compact slice of the mixes to a kernel declaring a compact buffer,
which tilelang's argument check should refuse (read in tilelang's source, not yet seen run);
if it does, ``output_head`` runs mhc_head's ops with that slice made contiguous
(``_head_ops``; ``head_composed`` then says so).

Its backward hands x's gradient between ops through the storage: ``mhc_post``'s backward
stores ``d_residual`` as ``x.untyped_storage().grad_from_mhc_post`` and pre's two backward
kernels (``pre_apply_mix``, ``pre_norm_fn``) add their parts into it in place and return
None for x (the norm kernel then deletes the attribute); ``mhc_pre`` and ``mhc_head`` fail
in backward without it. Where no ``mhc_post`` of the same x ran first (a pre or a head on
its own, as the benchmark times them), :class:`TileKernelsMHC` hands them a zeroed buffer
from a hook on the output's gradient (one memset of x) and returns it as x's gradient, so
plain autograd works. That the combine's backward runs before the pre's is what a model
gives (the sublayer sits between them); callers timing a pre and a combine of the same x
must keep that order (``bench_dsv4.py``'s stand-in sublayer does). :meth:`release` drops a
leftover ``grad_from_mhc_post`` (a combine's backward without a pre after it).
"""

from __future__ import annotations

import os
import sys

import torch

_ATTR = "grad_from_mhc_post"


class _Holder:
    buf = None


class _Entry(torch.autograd.Function):
    """``x [T, n, C]`` -> the ``[1, T, n, C]`` view TileKernels reads; in backward, x's
    gradient is the zeroed buffer a hook handed to TileKernels' kernels (if it made one)."""

    @staticmethod
    def forward(ctx, x, holder):
        ctx.holder = holder
        ctx.set_materialize_grads(False)
        return x.view(1, *x.shape)

    @staticmethod
    def backward(ctx, g):
        buf, ctx.holder.buf = ctx.holder.buf, None
        if buf is not None:
            g = buf if g is None else g.view_as(buf) + buf
        return (None if g is None else g.view(g.shape[1:])), None


class _Transpose(torch.autograd.Function):
    """``t.mT`` as a view; the gradient comes back transposed, made contiguous when
    ``contiguous_grad`` (TileKernels' Sinkhorn backward reads it as contiguous)."""

    @staticmethod
    def forward(ctx, t, contiguous_grad):
        ctx.contiguous_grad = contiguous_grad
        return t.mT

    @staticmethod
    def backward(ctx, g):
        g = g.mT
        return (g.contiguous() if ctx.contiguous_grad else g), None


def _hand_dx_buffer(x4: torch.Tensor, out: torch.Tensor, holder: _Holder) -> None:
    """Before ``out``'s backward: if no ``mhc_post`` backward has left x's gradient on the
    storage, leave a zeroed one there for TileKernels' kernels to accumulate into."""
    def hook(grad):
        storage = x4.untyped_storage()
        if not hasattr(storage, _ATTR):
            holder.buf = torch.zeros_like(x4)
            setattr(storage, _ATTR, holder.buf)
    out.register_hook(hook)


def _grad_mode(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class TileKernelsMHC:
    """TileKernels' mHC ops with our signatures (module docstring). ``commit``: the checkout's
    commit when known (a ``COMMIT`` file beside it), else None."""

    def __init__(self, functional, commit=None, tilelang_version=None):
        self._f = functional
        self.head_composed = False  # set when mhc_head itself is refused (see _head_ops)
        self.commit = commit
        self.tilelang_version = tilelang_version

    @staticmethod
    def unsupported(T: int, n: int, C: int, dtype, backward: bool = False) -> str | None:
        """Why TileKernels cannot run this shape (None if it can)."""
        if n != 4:
            return f"n={n} (TileKernels: n = 4 only)"
        if dtype != torch.bfloat16:
            return f"{dtype} activations (TileKernels: bf16 only)"
        if (n * C) % 256:
            return f"n*C={n * C} not a multiple of 256"
        if backward and T % 128:
            return f"T={T} not a multiple of 128 (backward)"
        return None

    def pre(self, x, phi, alpha, bias, sinkhorn_iterations, eps, n=None, form=None):
        """``(y [T, C], None, h_post [T, n], h_res [T, n, n])`` in the DeepSeek-V4 transposed
        form (``form`` must be that, any ``form.eps``): ``mhc_pre`` does not return its
        ``pre_mix`` (it only feeds the aggregate ``y``), so ``h_pre`` is None."""
        if form is not None and (form.name != "deepseek_v4" or not form.transposed):
            raise ValueError("TileKernels implements DeepSeek-V4's transposed form only, "
                             f"not {form}")
        form_eps = 1e-6 if form is None else form.eps
        if n is not None:
            x = x.reshape(-1, n, x.shape[-1] // n)
        T, n_streams, C = x.shape
        grad = _grad_mode(x, phi, alpha, bias)
        holder = _Holder()
        x4 = _Entry.apply(x, holder) if grad else x.view(1, T, n_streams, C)
        y, (post_mix, comb_mix) = self._f.mhc_pre(
            x4, phi, alpha, bias, norm_eps=eps, mhc_mult=n_streams, post_mult_value=2.0,
            pre_eps=form_eps, sinkhorn_eps=form_eps, sinkhorn_repeat=int(sinkhorn_iterations))
        if grad:
            _hand_dx_buffer(x4, y, holder)
        h_res = _Transpose.apply(comb_mix.view(T, n_streams, n_streams), True)
        return y.view(T, C), None, post_mix.view(T, n_streams), h_res

    def combine(self, x, f, f_bias, h_res, h_post, n=None):
        """``x' = h_res x + h_post (f + f_bias)`` via ``mhc_post`` (``f_bias`` must be None)."""
        if f_bias is not None:
            raise ValueError("TileKernels' mhc_post has no bias on the sublayer output")
        if n is not None:
            x = x.reshape(-1, n, x.shape[-1] // n)
        T, n_streams, C = x.shape
        comb = _Transpose.apply(h_res, False).contiguous()  # TileKernels' M (no copy for its
        # pre's h_res); x as a view, so its backward leaves dx on the storage the pre reads
        out = self._f.mhc_post(f.reshape(1, T, C), x.view(1, T, n_streams, C),
                               h_post.reshape(1, T, n_streams, 1),
                               comb.view(1, T, n_streams, n_streams))
        return out.view(T, n_streams, C)

    def output_head(self, x, phi, alpha, bias, rms_eps, eps):
        """``mhc_head``: ``[T, n, C]`` -> ``[T, C]`` (phi ``[n, n*C]``, alpha ``[1]``,
        bias ``[n]``)."""
        T, n_streams, C = x.shape
        grad = _grad_mode(x, phi, alpha, bias)
        holder = _Holder()
        x4 = _Entry.apply(x, holder) if grad else x.view(1, T, n_streams, C)
        if not self.head_composed:
            try:
                y = self._f.mhc_head(x4, phi, alpha, bias, norm_eps=rms_eps,
                                     mhc_mult=n_streams, pre_eps=eps)
            except RuntimeError as exc:  # its non-compact mixes slice, refused by tilelang
                if "packed ABI" not in str(exc) and "compact" not in str(exc):
                    raise
                self.head_composed = True
        if self.head_composed:
            y = self._head_ops(x4, phi, alpha, bias, rms_eps, eps)
        if grad:
            _hand_dx_buffer(x4, y, holder)
        return y.view(T, C)

    def _head_ops(self, x4, phi, alpha, bias, rms_eps, eps):
        """``mhc_head``'s own ops in its order, with the mixes' slice made contiguous (a
        ``[T, n]`` fp32 copy): ``mhc_head`` hands ``mixes[..., :n]`` (row stride 2n + n^2)
        to a kernel that declares a compact ``[T, n]`` buffer, which tilelang's argument
        check refuses."""
        ops, n = self._f.ops, x4.shape[-2]
        fn = torch.nn.functional.pad(phi, (0, 0, 0, n * (n + 2) - phi.shape[0]))
        mixes = ops.mhc_pre_norm_fn(x4, fn, None, rms_eps)[..., :n].contiguous()
        mix = ops.mhc_head_compute_mix(mixes, alpha.reshape(1), bias, eps)
        return ops.mhc_pre_apply_mix(x4, mix.unsqueeze(-1))

    @staticmethod
    def release(*tensors) -> None:
        """Drop a ``grad_from_mhc_post`` left on these tensors' storage."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and hasattr(t.untyped_storage(), _ATTR):
                delattr(t.untyped_storage(), _ATTR)


def load_tilekernels(root: str = ".tilekernels") -> TileKernelsMHC:
    root = os.path.abspath(root)
    if not os.path.isdir(os.path.join(root, "tile_kernels", "modeling", "mhc")):
        raise FileNotFoundError(f"{root}/tile_kernels/modeling/mhc missing; see "
                                "benchmarks/tilekernels_peer.py for how to get TileKernels")
    if root not in sys.path:
        sys.path.insert(0, root)
    import tilelang
    from tile_kernels.modeling.mhc import functional
    from tile_kernels.modeling.mhc.ops import mhc_post

    from tile_kernels.modeling.mhc import ops

    class _F:  # the entry points we call
        mhc_pre = staticmethod(functional.mhc_pre)
        mhc_head = staticmethod(functional.mhc_head)
    _F.mhc_post = staticmethod(mhc_post)
    _F.ops = ops
    commit = None
    path = os.path.join(root, "COMMIT")
    if os.path.exists(path):
        with open(path) as fh:
            commit = fh.read().strip() or None
    return TileKernelsMHC(_F, commit, getattr(tilelang, "__version__", None))
