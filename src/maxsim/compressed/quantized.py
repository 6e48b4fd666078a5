"""int8 and fp8 (e4m3) corpora: per-token symmetric quantisation and MaxSim on the quantised tokens.

A token x [d] is stored as d one-byte values and one fp32 scale:

    int8:      scale = amax(|x|) / 127,  values = round(x / scale)  in [-127, 127]
    fp8_e4m3:  scale = amax(|x|) / 448,  values = float8_e4m3fn(x / scale)   (448: e4m3's largest)

and read back as ``values * scale`` (an all-zero token has scale 0 and reads back as zeros).

Scoring never builds the dequantised corpus. Packed documents (``maxsim_quantized_varlen``) on
the Triton backend, for inference, go to the packed stream kernel as they are (``maxsim.varlen.
stream``): each tile of one-byte values is widened to Q's dtype on chip and each product column
multiplied by its token's scale, ``s (q . v)`` in fp32, one rounding fewer than dequantising
first. Otherwise (padded documents, the CPU backend, a Q that needs a gradient) documents are
dequantised a bounded chunk at a time into Q's dtype, on Q's device, and each chunk is scored with
the public ``maxsim.maxsim`` / ``maxsim.maxsim_varlen``. When Q needs a gradient, each chunk runs
under activation checkpointing, so the backward dequantises its chunk again instead of keeping
every chunk alive. Chunks also bound what is copied at a time from values held in host memory.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from maxsim import _checks
from maxsim._dispatch import backend_for
from maxsim.dense.ops import maxsim as maxsim_dense
from maxsim.selection import varlen as select_varlen
from maxsim.selection.common import device_of
from maxsim.varlen.ops import maxsim_varlen, quantized_scores

from ._inputs import (check_chunk_documents, check_cu_seqlens, check_d_mask, check_q_mask, check_query,
                      describe)

FORMATS = ("int8", "fp8_e4m3")
FORMAT_OF_DTYPE = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3"}
# Largest magnitude each format's values may take (int8 keeps -128 unused: symmetric).
_FORMAT_MAX = {"int8": 127.0, "fp8_e4m3": 448.0}
_VALUE_DTYPES = (torch.int8, torch.float8_e4m3fn)
_DEQUANTIZE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Scratch of one chunk: its documents' fp32 products plus the dequantised copy in Q's dtype. Large
# enough that a GPU chunk amortises its launches, small beside any GPU's memory.
DEFAULT_CHUNK_BYTES = 256 << 20
# Scratch of one chunk of tokens inside quantize_tokens (fp32 copies of the input).
_QUANTIZE_CHUNK_BYTES = 64 << 20




# ---------------------------------------------------------------------- quantise / dequantise
def quantize_tokens(x, format="int8"):
    """x [..., d] floating -> (values [..., d] int8 or float8_e4m3fn, scales [...] fp32).

    Symmetric, one scale per token (the last dimension is the token's features): int8 values are
    round-half-to-even of x / scale with scale = amax / 127; fp8_e4m3 values are x / scale rounded to
    e4m3 with scale = amax / 448. ``dequantize_tokens(values, scales)`` inverts it to within
    scale / 2 per element (int8) or e4m3's relative rounding (fp8). Non-finite input is an error.
    """
    if format not in FORMATS:
        raise ValueError(f"maxsim: format must be one of {FORMATS}, got {format!r}")
    if not torch.is_tensor(x) or not x.is_floating_point() or x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"maxsim: x must be a floating-point tensor of shape [..., d] with d >= 1, got {describe(x)}")
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("maxsim: x holds NaN or infinite values: they have no quantised form")
    dim = x.shape[-1]
    lead_shape = tuple(x.shape[:-1])
    rows = x.reshape(-1, dim)  # [T, d]
    total = rows.shape[0]
    value_dtype = torch.int8 if format == "int8" else torch.float8_e4m3fn
    limit = _FORMAT_MAX[format]
    values = torch.empty(total, dim, dtype=value_dtype, device=x.device)
    scales = torch.empty(total, dtype=torch.float32, device=x.device)
    step = max(1, _QUANTIZE_CHUNK_BYTES // (8 * dim))
    for start in range(0, total, step):
        chunk = rows[start:start + step].detach().float()  # [n, d]; the stored corpus carries no graph
        # a tensor divisor: CUDA divides by a Python scalar as a product with its reciprocal, whose
        # rounding can differ from the CPU's quotient and move a value across a rounding boundary
        chunk_scales = chunk.abs().amax(dim=-1) / torch.full((), limit, dtype=torch.float32, device=chunk.device)
        # an all-zero token keeps scale 0; dividing by 1 there leaves its zeros as they are
        safe = torch.where(chunk_scales > 0, chunk_scales, torch.ones_like(chunk_scales))
        scaled = (chunk / safe[:, None]).clamp_(-limit, limit)  # rounding may overshoot by an ulp
        if format == "int8":
            values[start:start + step] = scaled.round_().to(torch.int8)
        else:
            values[start:start + step] = scaled.to(torch.float8_e4m3fn)
        scales[start:start + step] = chunk_scales
    return values.reshape(*lead_shape, dim), scales.reshape(lead_shape)


def _check_quantized(values, scales, values_name="values", scales_name="scales"):
    if not torch.is_tensor(values) or values.dtype not in _VALUE_DTYPES:
        raise TypeError(f"maxsim: {values_name} must be an int8 or float8_e4m3fn tensor, got "
                        f"{values.dtype if torch.is_tensor(values) else type(values).__name__}")
    if not torch.is_tensor(scales) or not scales.is_floating_point():
        raise TypeError(f"maxsim: {scales_name} must be a floating-point tensor, got "
                        f"{scales.dtype if torch.is_tensor(scales) else type(scales).__name__}")
    if values.dim() == 0 or tuple(scales.shape) != tuple(values.shape[:-1]):
        raise ValueError(f"maxsim: {scales_name} must have shape {tuple(values.shape[:-1])} ({values_name}.shape[:-1], "
                         f"one scale per token), got {tuple(scales.shape)}")
    if values.device != scales.device:
        raise ValueError(f"maxsim: {values_name} and {scales_name} must be on one device, got {values.device} and "
                         f"{scales.device}")


def check_scale_values(scales, name="scales"):
    # One read of the scales (on their own device) per scoring call: a negative scale would flip a
    # token's similarities into finite wrong scores.
    if scales.numel() and not bool(((scales >= 0) & torch.isfinite(scales)).all()):
        raise ValueError(f"maxsim: {name} must be finite and >= 0 (amax / 127 or / 448, as quantize_tokens "
                         "writes them); found a negative or non-finite scale")


def dequantize_tokens(values, scales, dtype=torch.float32):
    """values [..., d] int8 / float8_e4m3fn, scales [...] floating -> values * scales[..., None], [..., d].

    The product is taken in fp32 (fp64 for ``dtype=torch.float64``) and rounded once to ``dtype``.
    """
    _check_quantized(values, scales)
    if dtype not in _DEQUANTIZE_DTYPES:
        raise ValueError(f"maxsim: dtype must be one of {_DEQUANTIZE_DTYPES}, got {dtype}")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (values.to(work) * scales.detach().to(work).unsqueeze(-1)).to(dtype)


# ---------------------------------------------------------------------- checks shared by the scorers






def _needs_grad(Q) -> bool:
    return torch.is_grad_enabled() and Q.requires_grad


def _gradient_input(Q):
    """What the chunks receive: Q itself, or an fp32 copy when a half-precision Q needs a gradient,
    so that the chunks' gradients add up in fp32 (each chunk casts it back to Q's dtype, exactly)."""
    return Q.float() if _needs_grad(Q) and Q.dtype != torch.float32 else Q


def _run_chunk(fn, Q, *chunk_inputs):
    """fn(Q, *chunk_inputs) -> scores; checkpointed when Q needs a gradient, so that the chunk's
    dequantised documents are recomputed in the backward rather than held until it."""
    if _needs_grad(Q):
        return checkpoint(fn, Q, *chunk_inputs, use_reentrant=False, preserve_rng_state=False)
    return fn(Q, *chunk_inputs)


# ---------------------------------------------------------------------- padded documents
def maxsim_quantized(Q, values, scales, *, q_mask=None, d_mask=None, d_lengths=None, mask_mode="exclude",
                     normalize=False, chunk_documents=None):
    """MaxSim of Q against padded quantised documents.

    Q [Nq, Lq, d] (or [Lq, d]) float16 / bfloat16 / float32; values [Nd, Ld, d] int8 or
    float8_e4m3fn; scales [Nd, Ld] floating; the real tokens as ``maxsim.maxsim`` takes them:
    q_mask Q.shape[:-1], d_mask [Nd, Ld] (True = real) or d_lengths [Nd].
    Returns [Nq, Nd] fp32 ([Nd] for a 2-D Q), equal (to fp32 rounding of the chunked scoring) to
    ``maxsim.maxsim(Q, dequantize_tokens(values, scales, Q.dtype), q_mask, d_mask,
    mask_mode=mask_mode, normalize=normalize)``. Documents are dequantised ``chunk_documents`` at a
    time (default: as many as fit DEFAULT_CHUNK_BYTES of scratch) on Q's device; values and scales
    may live elsewhere (host memory) and are copied there a chunk at a time. Differentiable in Q.
    """
    _check_quantized(values, scales)
    check_scale_values(scales)
    if values.dim() != 3:
        raise ValueError(f"maxsim: values must have shape [Nd, Ld, d], got {tuple(values.shape)}")
    num_docs, doc_len, dim = values.shape
    check_query(Q, dim, "values")
    q_mask = check_q_mask(q_mask, Q)
    d_mask = check_d_mask(d_mask, d_lengths, values.shape[:-1], values.device)
    _checks.check_choice("mask_mode", mask_mode, _checks.MASK_MODES)
    _checks.check_bool("normalize", normalize)
    check_chunk_documents(chunk_documents)
    device, dtype = Q.device, Q.dtype
    if q_mask is not None:
        q_mask = q_mask.to(device)
    if chunk_documents is None:
        per_doc = max(1, doc_len * dim * (4 + (dtype.itemsize if dtype != torch.float32 else 0)))
        chunk_documents = max(1, DEFAULT_CHUNK_BYTES // per_doc)

    def score_chunk(Q, chunk_values, chunk_scales, chunk_mask):
        D = dequantize_tokens(chunk_values.to(device), chunk_scales.to(device), dtype)  # [n, Ld, d]
        return maxsim_dense(Q.to(dtype), D, q_mask, chunk_mask, mask_mode=mask_mode, normalize=normalize)

    if num_docs == 0:  # maxsim.maxsim's own empty result: [Nq, 0] or [0]
        return score_chunk(Q, values, scales, None if d_mask is None else d_mask.to(device))
    Q_in = _gradient_input(Q)
    scores = []
    for start in range(0, num_docs, chunk_documents):
        stop = min(num_docs, start + chunk_documents)
        chunk_mask = None if d_mask is None else d_mask[start:stop].to(device)
        scores.append(_run_chunk(score_chunk, Q_in, values[start:stop], scales[start:stop], chunk_mask))
    return scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)


# ---------------------------------------------------------------------- packed documents


def _packed_queries(Q, q_mask, dim):
    """Q in any accepted form -> (packed [Tq, d], cu_seqlens_q int64 [Nq + 1], max length, 1 query given
    as [Lq, d]?): the query checks of this family, then the search family's packing (masked query
    tokens dropped: under the exclude rule they add nothing)."""
    from maxsim.varlen.queries import packed_queries

    if isinstance(Q, (list, tuple)):
        if not Q:
            raise ValueError("maxsim: Q must hold at least one query, got an empty list")
        for k, q in enumerate(Q):
            check_query(q, dim, "values", name=f"Q[{k}]")
            if q.dim() != 2:
                raise ValueError(f"maxsim: Q[{k}] must have shape [L, {dim}], got {tuple(q.shape)}")
        single_query = False
    else:
        check_query(Q, dim, "values")
        q_mask = check_q_mask(q_mask, Q)
        single_query = Q.dim() == 2
    packed, cu_q, _, max_q = packed_queries(Q, q_mask)
    return packed, cu_q, max_q, single_query


def prepare_queries(q_packed, cu_q, max_q: int, value_dtype: torch.dtype, quantize_query: bool | None = None):
    """Packed queries ``q [Tq, d]`` (``cu_q [Nq + 1]`` on their device) about to score many chunks
    of one-byte tokens of ``value_dtype`` -> the form :func:`score_checked_tokens` takes (the query
    bytes, when ``quantize_query`` or the selection's rule multiplies bytes, quantised once), or None
    where the stream kernel does not run (a gradient, no Triton backend, empty queries)."""
    if backend_for(q_packed.device) != "triton" or _needs_grad(q_packed) or max_q == 0:
        return None
    query_bytes = None
    if select_varlen.quantize_query(quantize_query, device_of(q_packed)[1])[0]:
        query_bytes = quantize_tokens(q_packed, FORMAT_OF_DTYPE[value_dtype])
    return q_packed, cu_q, max_q, query_bytes


def score_checked_tokens(prepared, values, scales, cu_d, max_d: int | None = None):
    """Scores ``[Nq, Nd]`` fp32 by the stream kernel of :func:`prepare_queries`'s queries against
    one-byte tokens whose scales and offsets were already checked (a ``maxsim.Corpus``'s):
    ``values [T, d]``, ``scales [T]`` and ``cu_d [Nd + 1]`` on the queries' device; ``max_d`` a bound
    on the documents' lengths (None: none). Nothing is read on the host."""
    q_packed, cu_q, max_q, query_bytes = prepared
    return quantized_scores(q_packed, values.contiguous(), scales.to(torch.float32).contiguous(), cu_q, cu_d,
                            max_q, max_d, query_bytes)


def maxsim_quantized_varlen(Q, values, scales, cu_seqlens_d, *, q_mask=None, chunk_documents=None,
                            quantize_query=None):
    """MaxSim of Q against packed quantised documents (the exclude rule).

    Q: padded [Nq, Lq, d] (with an optional q_mask [Nq, Lq]), one query [Lq, d] (q_mask [Lq]), or
    a list of [L_i, d] tensors; float16 / bfloat16 / float32. values [T, d] int8 or float8_e4m3fn,
    scales [T] floating, cu_seqlens_d [Nd + 1] (document j is tokens cu[j]:cu[j + 1]).
    Returns [Nq, Nd] fp32 ([Nd] for a 2-D Q): MaxSim against the dequantised tokens, scored
    ``chunk_documents`` documents at a time (default: as many as fit DEFAULT_CHUNK_BYTES of
    scratch, at least one; the whole corpus in one launch when the stream kernel reads bytes
    already on Q's device): on the Triton backend without a gradient, by the stream kernel on the
    bytes (exact products ``s (q . v)``, fp32); otherwise ``maxsim.maxsim_varlen`` on the tokens
    dequantised in Q's dtype. Empty documents score 0. Differentiable in Q.
    ``quantize_query`` (the stream kernel only): quantise each query token to the corpus's format
    too, so that the tensor cores multiply bytes (int8 x int8, e4m3 x e4m3); True / False, or None
    for the selection's rule (``maxsim.selection.varlen.quantize_query``). Ranking cost on MiniLM
    tokens: none at top-10 (BENCHMARKS.md); scores move by the query's own rounding.
    """
    _check_quantized(values, scales)
    check_scale_values(scales)
    if quantize_query is not None and not isinstance(quantize_query, bool):
        raise TypeError(f"maxsim: quantize_query must be True, False or None, got {quantize_query!r}")
    if values.dim() != 2:
        raise ValueError(f"maxsim: values must have shape [T, d], got {tuple(values.shape)}")
    total, dim = values.shape
    q_packed, cu_q, max_q, single_query = _packed_queries(Q, q_mask, dim)
    check_chunk_documents(chunk_documents)
    device, dtype = q_packed.device, q_packed.dtype

    # The Triton backend (CUDA, or the interpreter when asked) scores the bytes in the stream kernel,
    # the query bytes (where it multiplies bytes) quantised once for every chunk.
    prepared = prepare_queries(q_packed, cu_q, max_q, values.dtype, quantize_query)
    fused = prepared is not None
    query_bytes = prepared[3] if fused else None
    if fused and chunk_documents is None and values.device == device and scales.device == device:
        # The bytes already beside Q: nothing is dequantised, so no scratch to bound. One launch over
        # the whole corpus, the offsets checked where they live (no copy to the host and back).
        cu_d = check_cu_seqlens(cu_seqlens_d, total, on_host=False).to(device)
        out = score_checked_tokens(prepared, values, scales, cu_d)
        return out[0] if single_query else out
    cu = check_cu_seqlens(cu_seqlens_d, total)
    num_queries, num_docs = cu_q.numel() - 1, cu.numel() - 1
    lengths = cu[1:] - cu[:-1]  # [Nd] on the host

    def score_chunk(q_packed, chunk_values, chunk_scales, cu_chunk, chunk_max):
        if fused:  # the one-byte tokens go to the kernel as they are
            return quantized_scores(q_packed, chunk_values.to(device).contiguous(),
                                    chunk_scales.to(device, torch.float32).contiguous(), cu_q, cu_chunk, max_q,
                                    chunk_max, query_bytes)
        D = dequantize_tokens(chunk_values.to(device), chunk_scales.to(device), dtype)  # [n tokens, d]
        # both max lengths given: no host synchronisation inside (the offsets were checked above)
        return maxsim_varlen(q_packed.to(dtype), D, cu_q, cu_chunk, max_seqlen_q=max_q,
                                     max_seqlen_d=chunk_max)

    # scratch a token: its dequantised copy and fp32 products (none when the kernel reads the bytes)
    bytes_per_token = dim * (1 if fused else 4 + (dtype.itemsize if dtype != torch.float32 else 0))
    tokens_per_chunk = max(1, DEFAULT_CHUNK_BYTES // bytes_per_token)
    q_in = _gradient_input(q_packed)
    scores = []
    start = 0
    while start < num_docs:
        if chunk_documents is not None:
            stop = min(num_docs, start + chunk_documents)
        else:  # the documents from `start` whose tokens fit the budget, at least one
            limit = int(cu[start]) + max(tokens_per_chunk, int(lengths[start]))
            stop = min(num_docs, max(start + 1, int(torch.searchsorted(cu, limit, right=True)) - 1))
        lo, hi = int(cu[start]), int(cu[stop])
        cu_chunk = (cu[start:stop + 1] - lo).to(device)
        chunk_max = int(lengths[start:stop].max())
        scores.append(_run_chunk(score_chunk, q_in, values[lo:hi], scales[lo:hi], cu_chunk, chunk_max))
        start = stop
    if not scores:
        out = q_packed.new_zeros(num_queries, 0, dtype=torch.float32)
    else:
        out = scores[0] if len(scores) == 1 else torch.cat(scores, dim=1)
    return out[0] if single_query else out
