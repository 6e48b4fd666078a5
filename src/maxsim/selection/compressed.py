"""Selection for MaxSim on residual-compressed documents (``maxsim.compressed.maxsim_residual`` and
``maxsim_residual_varlen``): the packed stream kernel's on-chip decode or the chunked PyTorch path,
and the kernel's tile.

On the Triton backend (CUDA tensors, or ``MAXSIM_BACKEND=triton`` in the interpreter) the stream
kernel (:mod:`maxsim.compressed.forward`) runs the calls its declaration covers (packed documents,
inference); the chunked path (decode 64 MB at a time, then ``maxsim.maxsim`` / ``maxsim_varlen``)
runs the rest and is the tests' oracle. Tiles: :data:`maxsim.tuning.tables.COMPRESSED_STREAM_SM90`,
BN capped so that the decoded tile fits.
"""

from __future__ import annotations

import functools

import torch

from maxsim.compressed import specs
from maxsim.selection.common import Choice, call_of, clamp, device_of
from maxsim.tuning import tables as T
from maxsim.tuning.rules import first_match, next_pow2, tile_of


def features(Nq: int, Lq: int, d: int, dtype: torch.dtype) -> dict:
    """The bucketed features the stream table matches on (powers of two of Nq and Lq)."""
    seg = next_pow2(max(Lq, 1))
    return dict(dtype="fp32" if dtype == torch.float32 else "16bit", d=d, rows=seg * next_pow2(max(Nq, 1)))


def _clamp(tile: dict, family: str, d: int) -> dict:
    """The sm90 tile as run on ``family``, BN capped so that the decoded tile fits registers."""
    BD = max(16, next_pow2(d))
    tile = {**tile, "BN": max(16, min(tile["BN"], T.COMPRESSED_TILE_ELEMENTS // BD))}
    return clamp(tile, family, varlen=True)


def forward_choice(Nq: int, Lq: int, d: int, dtype: torch.dtype, layout: str, masked: bool, normalize: bool,
                   argmax: bool, family: str) -> Choice:
    """The forward path and tile for a call (cached by bucket). ``dtype``: the decode dtype;
    ``layout``: ``"padded"`` or ``"packed"``; ``family``: the device's tile family."""
    return _choice(next_pow2(max(Nq, 1)), next_pow2(max(Lq, 1)), d, dtype, layout, masked, normalize, argmax,
                   family)


@functools.lru_cache(maxsize=512)
def _choice(nq, lq, d, dtype, layout, masked, normalize, argmax, family) -> Choice:
    call = call_of(dtype, d, layout, masked, normalize, argmax, family)
    fused, chunked = specs.FUSED_FORWARD, specs.CHUNKED_DECODE
    why_not = fused.unsupported(call)
    if why_not is None and d > specs.MAX_FUSED_D:
        why_not = f"holds the query's bit planes on chip for d <= {specs.MAX_FUSED_D}, not d = {d} (they would spill)"
    if why_not is not None:
        return Choice(chunked, dict(chunk_bytes=64 << 20), "the stream kernel cannot run the call", "-",
                      ((fused.name, why_not),))
    f = features(nq, lq, d, dtype)
    rule = first_match(T.COMPRESSED_STREAM_SM90, f)
    config = _clamp(tile_of(rule, f), family, d)
    return Choice(fused, config, rule.name, rule.record,
                  ((chunked.name, ("the Triton backend decodes on chip: decoding in chunks writes each "
                                   "chunk's decoded tokens to memory and reads them back")),))


def lookup_choice(Nq: int, Lq: int, d: int, nbits: int, dtype: torch.dtype, masked: bool, normalize: bool,
                  needs_grad: bool, family: str) -> tuple[Choice | None, tuple[tuple[str, str], ...]]:
    """(the look-up scorer and its tile for a search of a residual corpus's look-up layout, or
    None; why each look-up kernel was not taken). It scores with a query quantised to int8 a row
    and the corpus's stored norms (normalised decode only), so it serves inference."""
    return _lookup(next_pow2(max(Nq, 1)), Lq, d, nbits, dtype, masked, normalize, needs_grad, family)


@functools.lru_cache(maxsize=512)
def _lookup(nq, lq, d, nbits, dtype, masked, normalize, needs_grad, family):
    call = call_of(dtype, d, "packed", masked, True, needs_grad, family)
    common = None
    if nbits not in specs.LOOKUP_NBITS:
        common = f"expands {' or '.join(map(str, specs.LOOKUP_NBITS))}-bit codes, not {nbits}-bit"
    elif not normalize:
        common = "scores the normalised decode (its stored norms), not normalize=False"
    return _first_lookup(((specs.LOOKUP_GLUON, T.LOOKUP_GLUON_SM90, 32),
                          (specs.LOOKUP_TRITON, T.LOOKUP_TRITON_SM90, None)), call, common, lq, nq, family)


def _first_lookup(candidates, call, common, lq: int, nq: int, family: str):
    """(the first of ``candidates`` ``(spec, table, rows)`` that runs ``call`` and queries of ``lq``
    rows (``rows``: the most a query it holds, None: any), or None; why each earlier one was not
    taken). ``common``: why none of them can run, or None."""
    rejected = []
    for spec, table, rows in candidates:
        why = common or spec.unsupported(call)
        if why is None and rows is not None and lq > rows:
            why = f"holds {rows} query rows a query (N = {rows} a query in the wgmma), not {lq}"
        if why is not None:
            rejected.append((spec.name, why))
            continue
        return _lookup_tile(spec, table, nq, family, tuple(rejected)), tuple(rejected)
    return None, tuple(rejected)


def _lookup_tile(spec, table, nq: int, family: str, rejected: tuple) -> Choice:
    """A look-up scorer's Choice: the table's rule for ``nq`` queries of 32 rows (the interpreter:
    one program an SM, no pipelining)."""
    f = dict(rows=32 * nq)
    rule = first_match(table, f)
    config = tile_of(rule, f)
    if family == "interpreter":
        config.update(waves=1, num_warps=4, num_stages=1)
    return Choice(spec, config, rule.name, rule.record, rejected)


def pq_lookup_choice(Nq: int, Lq: int, d: int, sub_dim: int, dtype: torch.dtype, masked: bool, needs_grad: bool,
                     family: str) -> tuple[Choice | None, tuple[tuple[str, str], ...]]:
    """(the PQ look-up scorer and its tile for a search of a PQ corpus's look-up layout, or None;
    why it was not taken). It scores with the query quantised to int8 a row and int8 codebooks, so
    it serves inference."""
    return _pq_lookup(next_pow2(max(Nq, 1)), Lq, d, sub_dim, dtype, masked, needs_grad, family)


@functools.lru_cache(maxsize=512)
def _pq_lookup(nq, lq, d, sub_dim, dtype, masked, needs_grad, family):
    call = call_of(dtype, d, "packed", masked, False, needs_grad, family)
    common = None if sub_dim == 4 else f"gathers 4 dimensions a code (one 32-bit word), not {sub_dim}"
    return _first_lookup(((specs.PQ_LOOKUP_GLUON, T.PQ_LOOKUP_GLUON_SM90, 32),
                          (specs.PQ_LOOKUP, T.PQ_LOOKUP_SM90, None)), call, common, lq, nq, family)


def onebyte_lookup_choice(Nq: int, Lq: int, d: int, dtype: torch.dtype, masked: bool, needs_grad: bool,
                          family: str) -> tuple[Choice | None, tuple[tuple[str, str], ...]]:
    """(the one-byte Gluon scorer and its tile for a search of an int8 / fp8 corpus's layout, or
    None; why it was not taken). It scores with the query quantised a row as the tokens are, so it
    serves inference."""
    return _onebyte_lookup(next_pow2(max(Nq, 1)), Lq, d, dtype, masked, needs_grad, family)


@functools.lru_cache(maxsize=512)
def _onebyte_lookup(nq, lq, d, dtype, masked, needs_grad, family):
    call = call_of(dtype, d, "packed", masked, False, needs_grad, family)
    return _first_lookup(((specs.ONEBYTE_GLUON, T.ONEBYTE_GLUON_SM90, 32),), call, None, lq, nq, family)


def explain_residual(Q, codec, *, num_docs: int, layout: str = "packed", q_mask=None, normalize: bool = True,
                     decode_dtype=None, requires_grad: bool = False, gpu: str | None = None,
                     quantize_query: bool = False):
    """What ``maxsim.compressed.maxsim_residual[_varlen](Q, ..., codec, ...)`` runs for ``num_docs`` documents
    and why (``gpu``: as a GPU family would, e.g. ``"sm90"`` from any machine); with
    ``quantize_query=True``, what the look-up scorer runs (as ``maxsim.Corpus.search`` of a resident
    residual corpus does). Returns a :class:`maxsim.selection.Explanation`; print it."""
    from maxsim._capability import dtype_name
    from maxsim._dispatch import backend_for, interpreting
    from maxsim.compressed._inputs import check_query
    from maxsim.compressed._inputs import check_codec as _check_codec
    from maxsim.compressed._inputs import decode_dtype as _decode_dtype
    from maxsim.selection import Explanation
    from maxsim.tuning import FAMILIES

    if gpu is not None and gpu not in FAMILIES:
        raise ValueError(f"maxsim: gpu must be one of {', '.join(FAMILIES)} or None; got {gpu!r}")
    if layout not in ("padded", "packed"):
        raise ValueError(f"maxsim: layout must be 'padded' or 'packed'; got {layout!r}")
    _check_codec(codec)
    check_query(Q, codec.dim, "the codec")
    dtype = _decode_dtype(Q, decode_dtype)
    Nq, Lq = (1, Q.shape[0]) if Q.dim() == 2 else Q.shape[:2]
    header = (f"maxsim.compressed.maxsim_residual{'_varlen' if layout == 'packed' else ''}: Q {list(Q.shape)} "
              f"{dtype_name(Q.dtype)}, {num_docs} documents ({codec.nbits}-bit residuals, d {codec.dim}, "
              f"{codec.num_centroids} centroids), decode {dtype_name(dtype)}, normalize={normalize}, "
              f"q_mask {'yes' if q_mask is not None else 'no'}")
    family = gpu
    if family is None and backend_for(Q.device) == "triton":
        family = "interpreter" if interpreting() else device_of(Q)[1]
    if family is None:
        return Explanation(header, Choice(specs.CHUNKED_DECODE, dict(chunk_bytes=64 << 20),
                                          f"tensors on {Q.device}: the PyTorch backend", "-"),
                           None, f"PyTorch (tensors on {Q.device}; pass gpu='sm90' to see a GPU's plan)")
    if quantize_query:
        if layout != "packed":
            raise ValueError("maxsim: the look-up scorer (quantize_query=True) scores packed documents")
        look, rejected = lookup_choice(Nq, Lq, codec.dim, codec.nbits, Q.dtype, q_mask is not None, normalize,
                                       requires_grad, family)
        if look is None:
            look = Choice(specs.CHUNKED_DECODE, None, "the look-up scorer cannot run the call", "-", rejected)
        return Explanation(header + ", quantize_query=True", look, None,
                           "Triton kernels" + (f", as {family} would run them" if gpu else ""))
    fwd = forward_choice(Nq, Lq, codec.dim, dtype, layout, q_mask is not None, normalize, requires_grad, family)
    return Explanation(header, fwd, None, "Triton kernels" + (f", as {family} would run them" if gpu else ""))
