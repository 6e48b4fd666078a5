"""Public entry points for packed (ragged) inputs: ``maxsim_varlen`` and ``score_pairs_packed``."""

from __future__ import annotations

from typing import Optional

import torch

from maxsim import _checks, reference
from maxsim._autograd import argmax_or_empty, make_differentiable
from maxsim._dispatch import backend_for, pytorch_backend, through_dispatcher
from maxsim._split import split_fp16x3, unscale
from maxsim.cpu.varlen import padded, varlen_cpu
from maxsim.selection import varlen as select
from maxsim.selection.common import PRECISIONS, device_of, precision_choice
from maxsim.selection.common import STRATEGIES as BACKWARD_STRATEGIES
from maxsim.varlen.backward import varlen_backward
from maxsim.varlen.forward import varlen_forward
from maxsim.varlen.packing import check_sequences, cpu_lengths, pack
from maxsim.varlen.specs import STREAM_FORWARD
from maxsim.varlen.stream import stream_forward


def _run_forward(q, d, cu_q, cu_d, max_q, max_d, pair_q, pair_d, save_argmax=False, precision="ieee"):
    """The selection's kernel and tile, launched (the eager and the op paths share it)."""
    if precision == "fp16x3-copy" and q.dtype == torch.float32:
        # the 16-bit kernels on the fp16 split (maxsim._split): same tokens, width 3d
        q3, q_exp = split_fp16x3(q, document=False)  # [Tq, 3d]
        d3, d_exp = split_fp16x3(d, document=True)  # [Td, 3d]
        scores, argmax = _run_forward(q3, d3, cu_q, cu_d, max_q, max_d, pair_q, pair_d, save_argmax)
        return unscale(scores, q_exp, d_exp), argmax
    choice = select.forward_choice(q, cu_q.numel() - 1, max_q, pair_q is not None, save_argmax)
    if choice.kernel is STREAM_FORWARD and max_q > 0:
        return stream_forward(q, d, cu_q, cu_d, max_q, config=choice.config, max_d=max_d, precision=precision), None
    return varlen_forward(q, d, cu_q, cu_d, max_q, pair_q, pair_d, save_argmax=save_argmax, config=choice.config,
                          max_d=max_d, precision=precision)


def quantized_scores(q, values, scales, cu_q, cu_d, max_q, max_d, query_bytes=None):
    """Inference scores ``[Nq, Nd]`` of packed q against packed one-byte tokens (int8 or
    float8_e4m3fn ``values [T, d]``, fp32 ``scales [T]``) in the stream kernel (the selection's
    tile for q): the tokens widened on chip to q's dtype, or, given ``query_bytes = (values [Tq, d],
    scales [Tq])``, q quantised the same way, the bytes multiplied on the tensor cores. Every
    tensor on q's device, offsets already checked."""
    choice = select.forward_choice(q, cu_q.numel() - 1, max_q, False, False)
    if choice.kernel is not STREAM_FORWARD:
        raise RuntimeError(f"maxsim: {STREAM_FORWARD.name} cannot run this call")
    q_in, q_scales = (q, None) if query_bytes is None else query_bytes
    return stream_forward(q_in, values, cu_q, cu_d, max_q, config=choice.config, scales=scales,
                          query_scales=q_scales, max_d=max_d)


def _forward_launch(q, d, cu_q, cu_d, pair_q, pair_d, max_q, max_d, save_argmax, strategy, precision):
    """The forward op's body (``strategy`` is for the backward only)."""
    scores, argmax = _run_forward(q, d, cu_q, cu_d, max_q, max_d, pair_q, pair_d, save_argmax, precision)
    return scores, argmax_or_empty(argmax, q.device)


def _backward_launch(grad, q, d, cu_q, cu_d, pair_q, pair_d, argmax, strategy):
    """The backward op's body."""
    P, max_q = argmax.shape if argmax.dim() == 2 else (0, 0)
    config = select.backward_config(strategy, max_q, q.shape[1], P)
    return varlen_backward(grad, q, d, cu_q, cu_d, pair_q, pair_d, argmax, strategy, config)


@torch.library.custom_op("maxsim::varlen_forward", mutates_args=())
def varlen_forward_op(
    q: torch.Tensor,
    d: torch.Tensor,
    cu_q: torch.Tensor,
    cu_d: torch.Tensor,
    pair_q: Optional[torch.Tensor],
    pair_d: Optional[torch.Tensor],
    max_q: int,
    max_d: int,
    save_argmax: bool,
    strategy: str,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed scores ([Nq, Nd], or [P] for pairs) and argmax [P, max_q] int32 (empty unless saved).
    ``strategy`` is the backward's (read by autograd); ``precision`` the resolved fp32 product."""
    return _forward_launch(q, d, cu_q, cu_d, pair_q, pair_d, max_q, max_d, save_argmax, strategy, precision)


@varlen_forward_op.register_fake
def _(q, d, cu_q, cu_d, pair_q, pair_d, max_q, max_d, save_argmax, strategy, precision):
    Nq, Nd = cu_q.shape[0] - 1, cu_d.shape[0] - 1
    P = Nq * Nd if pair_q is None else pair_q.shape[0]
    scores = q.new_empty((Nq, Nd) if pair_q is None else (P,), dtype=torch.float32)
    return scores, q.new_empty((P, max_q) if save_argmax else (0,), dtype=torch.int32)


@torch.library.custom_op("maxsim::varlen_backward", mutates_args=())
def varlen_backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    d: torch.Tensor,
    cu_q: torch.Tensor,
    cu_d: torch.Tensor,
    pair_q: Optional[torch.Tensor],
    pair_d: Optional[torch.Tensor],
    argmax: torch.Tensor,
    strategy: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_q like q, grad_d like d)."""
    return _backward_launch(grad, q, d, cu_q, cu_d, pair_q, pair_d, argmax, strategy)


@varlen_backward_op.register_fake
def _(grad, q, d, cu_q, cu_d, pair_q, pair_d, argmax, strategy):
    return torch.empty_like(q), torch.empty_like(d)


def _varlen_setup_context(ctx, inputs, output):
    q, d, cu_q, cu_d, pair_q, pair_d, max_q, max_d, save_argmax, strategy, _precision = inputs
    ctx.set_materialize_grads(False)  # no zero tensor the size of the argmax for its "gradient"
    ctx.has_argmax = save_argmax
    ctx.backward_args = (strategy,)
    ctx.save_for_backward(q, d, cu_q, cu_d, pair_q, pair_d, output[1])


# Autograd for the op, and the eager training path: the same implementation and rule.
_VarlenMaxSim = make_differentiable(
    "_VarlenMaxSim", varlen_forward_op, varlen_backward_op, _varlen_setup_context, _forward_launch, _backward_launch,
    n_inputs=11,
)


def _run(q, d, cu_q, cu_d, max_q, max_d, pair_q, pair_d, backward, precision):
    """The kernels: through the differentiable custom op under torch.compile, the eager autograd
    Function when a gradient is needed, straight to the launcher otherwise."""
    _checks.check_choice("backward", backward, BACKWARD_STRATEGIES)
    rows = select.query_rows_per_token(q, max_q, pair_q is not None)
    dot_precision = precision_choice(q.dtype, precision, device_of(q)[1], rows, d.numel(), packed=True)[0]
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or d.requires_grad)
    compiling = through_dispatcher()
    if compiling or needs_grad:
        op = varlen_forward_op if compiling else _VarlenMaxSim.apply
        return op(q, d, cu_q, cu_d, pair_q, pair_d, max_q, max_d, needs_grad,
                  select.strategy(backward, q, d, max_q), dot_precision)[0]
    return _run_forward(q, d, cu_q, cu_d, max_q, max_d, pair_q, pair_d, precision=dot_precision)[0]


def _prepare(q, d, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d, validate):
    """Ragged lists -> packed; validation; the max lengths.

    Trusted path (both max lengths given, ``validate`` False): nothing is read on the host; an
    output whose sequence is invalid (outside the data, decreasing offsets, longer than its max
    length) is NaN. Otherwise every value is checked on the host with an error naming it, and a
    max length left out is read from the offsets."""
    if isinstance(q, (list, tuple)):
        if cu_seqlens_q is not None:
            raise ValueError("maxsim: pass either a list of query tensors or packed q with cu_seqlens_q, not both")
        q, cu_seqlens_q, max_seqlen_q = pack(q)
    if isinstance(d, (list, tuple)):
        if cu_seqlens_d is not None:
            raise ValueError("maxsim: pass either a list of document tensors or packed d with cu_seqlens_d, not both")
        d, cu_seqlens_d, max_seqlen_d = pack(d)
    _checks.check_bool("validate", validate)
    max_q = _checks.check_max_length("max_seqlen_q", max_seqlen_q)
    max_d = _checks.check_max_length("max_seqlen_d", max_seqlen_d)
    trusted = max_q is not None and max_d is not None and not validate
    cu_q, cu_d = _checks.check_packed(q, d, cu_seqlens_q, cu_seqlens_d, check_values=not trusted)
    if not trusted:
        for name, cu, given in (("max_seqlen_q", cu_q, max_q), ("max_seqlen_d", cu_d, max_d)):
            if given is not None:
                _checks.check_lengths_fit(name, cu, given)
        max_q = _max_length(cu_q) if max_q is None else max_q
        max_d = _max_length(cu_d) if max_d is None else max_d
    return q.contiguous(), d.contiguous(), cu_q, cu_d, int(max_q), int(max_d), trusted


def _max_length(cu: torch.Tensor) -> int:
    """The longest sequence of ``cu`` (a host read)."""
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def check_packed(q, d, cu_seqlens_q=None, cu_seqlens_d=None, max_seqlen_q=None, max_seqlen_d=None,
                 pair_q=None, pair_d=None) -> None:
    """Check packed inputs fully (one host synchronisation) and raise a ``ValueError``/``TypeError``
    naming the first problem: offsets that do not start at 0, decrease or miss the packed length,
    a sequence longer than the max length given, a pair index out of range. Returns None when the
    inputs are valid: then the trusted path (both max lengths, no host read) scores them all.
    Arguments as :func:`maxsim_varlen` / :func:`score_pairs_packed`."""
    q, d, cu_q, cu_d, *_ = _prepare(q, d, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d, True)
    if (pair_q is None) != (pair_d is None):
        raise ValueError("maxsim: give both pair_q and pair_d, or neither")
    if pair_q is not None:
        _checks.check_pairs(pair_q, pair_d, cu_q.numel() - 1, cu_d.numel() - 1, q.device, check_values=True)


def maxsim_varlen(q, d, cu_seqlens_q=None, cu_seqlens_d=None, max_seqlen_q=None, max_seqlen_d=None, *,
                  backward="auto", validate=False, precision="auto"):
    """MaxSim of every packed query against every packed document, without padding.

    Args:
        q: packed queries ``[Tq, dim]`` (or a list of ``[Lq_i, dim]`` tensors).
        d: packed documents ``[Td, dim]`` (or a list of ``[Ld_j, dim]`` tensors).
        cu_seqlens_q: int32/int64 ``[Nq + 1]``: query i is rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``.
        cu_seqlens_d: int32/int64 ``[Nd + 1]``, likewise.
        max_seqlen_q, max_seqlen_d: the longest query / document. Give both to avoid any host
            synchronisation; the cu_seqlens values are then trusted (not read on the host): a
            score whose query or document is invalid (offsets that decrease or run past the
            packed data, a sequence longer than its max length) is NaN, never a wrong number.
        backward: grad_d/grad_q reduction when q or d requires grad: ``"unified"`` (fp32 atomics)
            or ``"lowmem"`` (destination-owned, deterministic); ``"auto"`` is the dense rule:
            unified unless its fp32 buffers of q's and d's size would pass 2 GiB.
        validate: check every value on the host even with both max lengths (one synchronisation),
            raising an error that names the problem instead of scoring it NaN.
        precision: fp32 inputs' products, as :func:`maxsim.maxsim`'s (``"auto"``, ``"ieee"``,
            ``"fp16x3"``, ``"tf32x3"``, ``"tf32"``); fp16x3 splits on chip rather than copy packed
            documents whose copy (6 bytes a value, made whole) would pass 4 GiB.

    Returns:
        ``[Nq, Nd]`` fp32; an empty sequence contributes 0 (and gets zero gradient). Same as
        ``maxsim.maxsim`` on the padded tensors with masks (``maxsim.pad``), with work
        proportional to the real tokens. Differentiable in q and d (through a list's tensors too).
    """
    _checks.check_choice("precision", precision, PRECISIONS)
    if isinstance(d, (list, tuple)) and cu_seqlens_d is None and len(d):
        scores, d = _cpu_document_list(q, d, cu_seqlens_q, max_seqlen_q, validate)
        if scores is not None:
            return scores
        d, cu_seqlens_d, max_seqlen_d = pack(d, checked=True)  # (checked once)
    q, d, cu_q, cu_d, max_q, max_d, _ = _prepare(q, d, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d,
                                                 validate)
    if backend_for(q.device) == "reference":
        return _pytorch_backend(pytorch_backend(), q, d, cu_q, cu_d, max_q, max_d, None, None)
    return _run(q, d, cu_q, cu_d, max_q, max_d, None, None, backward, precision)


def _cpu_document_list(q, documents, cu_seqlens_q, max_seqlen_q, validate):
    """Documents given as a list, scored by the CPU backend without a gradient, from the items where
    they lie (:func:`maxsim.cpu.varlen.cross_per_document`): the list is never packed whole (a copy
    of every token). Each task's items are checked by the CPU worker about to score them; a bad
    item raises (:func:`~maxsim.varlen.packing.check_sequences`'s error) before its task is
    scored. Returns (scores, or None where the packed path scores instead; the checked list)."""
    from maxsim.cpu.engine import STOP
    from maxsim.cpu.varlen import cross_per_document

    documents = list(documents)
    first = documents[0]
    if (not isinstance(first, torch.Tensor) or first.dim() != 2 or not first.is_cpu
            or backend_for(first.device) != "reference" or pytorch_backend() != "cpu"):
        return None, check_sequences(documents)
    grad = torch.is_grad_enabled()
    queries_need_grad = any(x.requires_grad for x in q) if isinstance(q, (list, tuple)) else getattr(
        q, "requires_grad", False)
    if grad and queries_need_grad:
        return None, check_sequences(documents)
    # the queries checked (and packed) against an empty document of the list's d, dtype and device
    q, _, cu_q, _, max_q, _, _ = _prepare(q, first[:0], cu_seqlens_q, torch.zeros(2, dtype=torch.int64),
                                          max_seqlen_q, 0, validate)
    q_ok = _checks.sequences_valid(cu_q, q.shape[0], max_q)  # [Nq]
    q_start, q_len = _emptied(cu_q, q_ok)
    dim, dtype = first.shape[1], first.dtype

    def item_lengths(items: list) -> list:
        lengths = cpu_lengths(items, dim, dtype, no_grad=grad)
        if lengths is None:
            check_sequences(documents)  # a bad item raises, named; else one wants a gradient
            return STOP  # (the packed path scores it with autograd)
        return lengths

    with torch.no_grad():
        scores = cross_per_document(q, q_start, q_len, documents, len(documents), item_lengths)  # [Nq, Nd]
    if scores is None:
        return None, documents
    return torch.where(q_ok[:, None], scores, torch.full((), float("nan"))), documents


def score_pairs_packed(q, d, cu_seqlens_q, cu_seqlens_d, pair_q, pair_d, max_seqlen_q=None, max_seqlen_d=None, *,
                       backward="auto", validate=False, precision="auto"):
    """MaxSim of chosen (query, document) pairs of packed batches: the reranking shape.

    Args:
        q, d, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d: as :func:`maxsim_varlen`.
        pair_q, pair_d: integer ``[P]``: pair p scores query ``pair_q[p]`` against document
            ``pair_d[p]``. With both max lengths given nothing is read on the host: an index out
            of range (negative ones included: -1 does not wrap) then scores NaN instead of
            raising, as does a pair whose query or document is invalid.
        backward, validate, precision: as :func:`maxsim_varlen`.

    Returns:
        ``[P]`` fp32, differentiable in q and d.
    """
    q, d, cu_q, cu_d, max_q, max_d, trusted = _prepare(q, d, cu_seqlens_q, cu_seqlens_d, max_seqlen_q,
                                                       max_seqlen_d, validate)
    Nq, Nd = cu_q.numel() - 1, cu_d.numel() - 1
    _checks.check_pairs(pair_q, pair_d, Nq, Nd, q.device, check_values=not trusted)
    pq, pd = pair_q.to(torch.int64), pair_d.to(torch.int64)
    _checks.check_choice("precision", precision, PRECISIONS)
    if backend_for(q.device) == "reference":
        return _pytorch_backend(pytorch_backend(), q, d, cu_q, cu_d, max_q, max_d, pq, pd)
    return _run(q, d, cu_q, cu_d, max_q, max_d, pq, pd, backward, precision)


def _pytorch_backend(backend, q, d, cu_q, cu_d, max_q, max_d, pair_q, pair_d):
    """The CPU backend (``"cpu"``) or the plain reference (``"reference"``) on packed inputs, with the
    trusted path's rule: invalid sequences are emptied before scoring, their outputs set to NaN."""
    q_ok = _checks.sequences_valid(cu_q, q.shape[0], max_q)  # [Nq]
    d_ok = _checks.sequences_valid(cu_d, d.shape[0], max_d)  # [Nd]
    q_start, q_len = _emptied(cu_q, q_ok)
    d_start, d_len = _emptied(cu_d, d_ok)
    if pair_q is None:
        ok = q_ok[:, None] & d_ok[None, :]  # [Nq, Nd]
    else:
        ok = _checks.pairs_valid(pair_q, pair_d, q_ok, d_ok)  # [P]
        if not (q_ok.numel() and d_ok.numel()):
            return torch.full(pair_q.shape, float("nan"), dtype=torch.float32, device=q.device)
        pair_q = torch.where(ok, pair_q, 0)
        pair_d = torch.where(ok, pair_d, 0)
    if backend == "cpu":
        scores = varlen_cpu(q, d, q_start, q_len, d_start, d_len, pair_q, pair_d)
    else:
        Qp, qm = padded(q, q_start, q_len)
        Dp, dm = padded(d, d_start, d_len)
        scores = reference.maxsim_reference(Qp, Dp, qm, dm)  # [Nq, Nd]
        if pair_q is not None:
            scores = scores[pair_q, pair_d]
    return torch.where(ok, scores, torch.full((), float("nan"), device=scores.device))


def _emptied(cu: torch.Tensor, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, length) int64 ``[N]`` of cu's sequences, an invalid one emptied (0, 0)."""
    start = torch.where(ok, cu[:-1], 0)
    return start, torch.where(ok, cu[1:] - cu[:-1], 0)
