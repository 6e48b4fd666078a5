"""The selection layer: the one place where a call's kernel, tile and backward strategy are chosen.

Between the public functions / custom ops (above) and the launchers (below). Each operator
family declares its kernels (``maxsim/<family>/specs.py``: dtypes, d, masks, layouts, GPU
families, Triton releases); the selectors here check a call against every declaration, read the
tile tables of :mod:`maxsim.tuning.tables`, and return a plan. :func:`explain` says, in words, which
kernel a call gets and why each other candidate was not taken.

- :mod:`maxsim.selection.dense`: the dense forward (Triton or warp-specialized) and backward.
- :mod:`maxsim.selection.varlen`: the packed forward (cross product or pairs) and backward.
- :mod:`maxsim.selection.common`: the shared ``backward="auto"`` rule and config clamps.
"""

from __future__ import annotations

import torch

from maxsim._capability import dtype_name
from maxsim.tuning import FAMILIES


class Explanation:
    """What :func:`explain` returns: ``str()`` it (or print it) for the words; ``forward`` and
    ``backward`` hold the decisions (:class:`maxsim.selection.common.Choice`) for programs."""

    def __init__(self, header: str, forward, backward, backend: str, precision: str | None = None):
        self.header, self.forward, self.backward, self.backend = header, forward, backward, backend
        self.precision = precision

    def __str__(self) -> str:
        parts = [self.header, f"  backend: {self.backend}"]
        if self.forward is not None:
            parts.append(self.forward.describe("  forward"))
        if self.precision is not None:
            parts.append(f"  products: {self.precision}")
        if self.backward is not None:
            parts.append(self.backward.describe("  backward (when Q or D requires grad)"))
        return "\n".join(parts)

    __repr__ = __str__


def explain(Q, D, q_mask=None, d_mask=None, *, normalize: bool = False, mask_mode: str = "exclude",
            return_argmax: bool = False, backward: str = "auto", cu_seqlens_q=None, cu_seqlens_d=None,
            pair_q=None, pair_d=None, max_seqlen_q=None, precision: str = "auto",
            gpu: str | None = None) -> Explanation:
    """Which kernel ``maxsim.maxsim(Q, D, q_mask, d_mask, ...)`` runs, with which tile, and why
    each other kernel was not chosen; the same for the backward strategy.

    Packed calls: give ``cu_seqlens_q``/``cu_seqlens_d`` (and ``pair_q``/``pair_d`` for
    ``score_pairs_packed``), or lists of ``[L, d]`` tensors, as to ``maxsim.maxsim_varlen``.
    ``gpu``: explain as a GPU family would run the call (``"sm90"``, ``"unmeasured"``,
    ``"interpreter"``) whatever device the tensors are on, e.g. Hopper's choice from a laptop.

    Example::

        print(maxsim.explain(Q, D, q_mask, d_mask))
    """
    from maxsim import _checks
    from maxsim._dispatch import backend_for, interpreting, pytorch_backend
    from maxsim.selection import dense, varlen
    from maxsim.selection.common import device_of, precision_choice

    if gpu is not None and gpu not in FAMILIES:
        raise ValueError(f"maxsim: gpu must be one of {', '.join(FAMILIES)} or None; got {gpu!r}")
    packed = cu_seqlens_q is not None or isinstance(Q, (list, tuple))
    if packed:
        from maxsim.varlen.packing import pack

        q, cu_q, max_q = pack(Q) if isinstance(Q, (list, tuple)) else (Q, cu_seqlens_q, max_seqlen_q)
        d, cu_d, _ = pack(D) if isinstance(D, (list, tuple)) else (D, cu_seqlens_d, None)
        cu_q, cu_d = _checks.check_packed(q, d, cu_q, cu_d, check_values=True)
        max_q = int((cu_q[1:] - cu_q[:-1]).max()) if max_q is None and cu_q.numel() > 1 else int(max_q or 0)
        pairs = pair_q is not None
        header = (f"maxsim.{'score_pairs_packed' if pairs else 'maxsim_varlen'}: q [{q.shape[0]}, {q.shape[1]}] "
                  f"{dtype_name(q.dtype)} ({cu_q.numel() - 1} queries, longest {max_q}), "
                  f"d [{d.shape[0]}, {d.shape[1]}] ({cu_d.numel() - 1} documents)")
        device = q.device
    else:
        p = _checks.check_inputs(Q, D, q_mask, d_mask, mask_mode=mask_mode)
        masks = [n for n, m in (("q_mask", p.q_mask), ("d_mask", p.d_mask)) if m is not None]
        header = (f"maxsim.maxsim: Q {_checks.shape_str(Q)} {dtype_name(Q.dtype)}, D {_checks.shape_str(D)}"
                  f" ({'candidate lists' if p.candidates else 'documents shared by every query'}), "
                  f"masks: {', '.join(masks) or 'none'}, normalize={normalize}")
        device = p.Q.device
    backend = backend_for(device)
    family = gpu
    if family is None and backend == "triton":  # the device the tensors are on, as a call would see it
        family = "interpreter" if interpreting() else device_of(q if packed else p.Q)[1]
    if family is None and backend != "triton":
        # the PyTorch side: maxsim.cpu's blocked GEMMs, or the plain reference with MAXSIM_BACKEND=reference
        backend = pytorch_backend()
        what = "maxsim.cpu's blocked GEMMs" if backend == "cpu" else "the plain PyTorch reference"
        words = (f"{backend} (tensors on {device} run {what}, no Triton kernel; "
                 "pass gpu='sm90' to see a GPU's plan)")
        return Explanation(header, None, None, words)
    backend_words = "Triton kernels" + (f", as {family} would run them" if gpu else "")
    if packed:
        dot, why = precision_choice(q.dtype, precision, family, varlen.query_rows_per_token(q, max_q, pairs),
                                    d.numel(), packed=True)
        fwd = varlen.forward_choice(q, cu_q.numel() - 1, max_q, pairs, argmax=False, family=family)
        n_pairs = pair_q.numel() if pairs else (cu_q.numel() - 1) * (cu_d.numel() - 1)
        bwd = varlen.strategy_choice(backward, q, d, max_q, n_pairs)
    else:
        masked = p.q_mask is not None or p.d_mask is not None
        dot, why = precision_choice(p.Q.dtype, precision, family, dense.query_rows_per_token(p.Q, p.D), p.D.numel(),
                                    training=torch.is_grad_enabled() and (p.Q.requires_grad or p.D.requires_grad))
        fq, fd = p.Q, p.D
        if dot == "fp16x3-copy":  # what runs: the 16-bit kernel on the fp16 split, width 3d
            fq, fd = (torch.empty((*t.shape[:-1], 3 * t.shape[-1]), dtype=torch.float16, device="meta") for t in (fq, fd))
        fwd = dense.forward_choice(fq, fd, masked, normalize, return_argmax, family=family, exact_words=True,
                                   precision=dot)
        bwd = dense.strategy_choice(backward, p.Q, p.D)
    dtype = q.dtype if packed else p.Q.dtype
    products = f"{dot} — {why}" if dtype == torch.float32 else why
    return Explanation(header, fwd, bwd, backend_words, products)


__all__ = ["Explanation", "explain"]
