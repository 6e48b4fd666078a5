"""``Corpus``: multi-vector documents packed as ``[T, d]`` plus offsets plus document ids.

    corpus = Corpus.from_list(docs, ids=["doc-a", "doc-b", ...])   # ragged list of [L_j, d]
    corpus = Corpus.from_padded(D, d_mask)                          # [Nd, Ld, d] + [Nd, Ld]
    corpus.save("corpus/")                                          # format.py
    corpus = Corpus.load("corpus/", mmap=True)                      # on disk, memory-mapped
    result = corpus.search(Q, k=100)                                # SearchResult(scores, indices, ids)
    result = corpus.search(Q, k=100, subset=tenant_ids)             # only these documents compete
    corpus.delete(["doc-a"]); corpus.save("corpus/", overwrite=True)  # a tombstone, written alone
    corpus.compact("corpus/")                                       # rewrite without the deleted
    corpus = Corpus.from_list(docs, encoding="int8")                # one byte a dim + an fp32 scale a token
    corpus = Corpus.from_list(docs, encoding="residual2")           # PLAID: a centroid id + 2 bits a dim
    corpus = Corpus.from_list(docs, encoding="pq32")                # product quantisation: 32 bytes a token
    corpus = Corpus.from_index("colbert_or_fast_plaid_index/")      # the codes of an existing PLAID index

A corpus is a list of segments (one per save/append), each a packed ``[t, d]`` tensor with its
document offsets (and, for an int8 / fp8 corpus, its ``[t]`` fp32 scales; for a residual corpus
its ``[t]`` int32 codes and ``[t, d * nbits / 8]`` uint8 residuals; for a PQ corpus its ``[t, m]``
uint8 codes, with one codec for the whole corpus); its tensors live on the GPU, in (optionally
pinned) host memory, or are memory maps of the corpus file. Searching a GPU-resident corpus
scores it in place; a host or mapped corpus streams to the GPU under a memory budget (stream.py).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from maxsim._results import SearchResult
from maxsim.search import changes
from maxsim.search import format as corpus_format
from maxsim.search import encodings
from maxsim.search.encodings import Encoding, train_codec  # noqa: F401  (train_codec: the CLI's)
from maxsim.search.pinned import pinned_copy
from maxsim.varlen.packing import pack, padded_to_packed

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ENCODINGS = encodings.DOCUMENTED


@dataclass
class CorpusSegment:
    """Documents ``first_document ...`` of a corpus: ``embeddings [t, d]`` and host ``offsets
    [n + 1]`` int64 (from 0). ``mapped``: the embeddings are a memory map of a corpus file.
    ``scales [t]`` fp32 (on the embeddings' device) for an int8 / fp8 corpus, whose embeddings are
    the one-byte values; None for a float corpus. For a residual corpus ``embeddings`` holds the
    codes ``[t]`` int32 and ``residuals [t, d * nbits / 8]`` uint8 the packed residuals; for a PQ
    corpus ``embeddings`` holds the codes ``[t, m]`` uint8 (the codec is the corpus's).
    ``source``: the manifest entry of the file segment these are, in the folder the corpus was
    loaded from (None for a segment built or changed in memory): saving back there keeps it."""

    embeddings: torch.Tensor
    offsets: np.ndarray
    first_document: int
    mapped: bool = False
    scales: torch.Tensor | None = None
    residuals: torch.Tensor | None = None
    source: dict | None = field(default=None, repr=False, compare=False)
    # A segment never changes once built: what every search would recompute from the offsets
    # (their copy on the scoring device, the longest document) is computed once.
    _offsets_on: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _longest: int | None = field(default=None, init=False, repr=False, compare=False)
    _scales_checked: bool = field(default=False, init=False, repr=False, compare=False)
    _lookup: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _lookup_refused: bool = field(default=False, init=False, repr=False, compare=False)
    _lookup_oom: bool = field(default=False, init=False, repr=False, compare=False)

    def check_scales(self) -> None:
        """The one-byte scales checked (finite, >= 0) the first time a search reads them, not at
        every call (a negative or non-finite scale would score finite wrong numbers)."""
        if self.scales is not None and not self._scales_checked:
            from maxsim.compressed.quantized import check_scale_values

            check_scale_values(self.scales)
            self._scales_checked = True

    def offsets_on(self, device: torch.device) -> torch.Tensor:
        """The offsets as an int64 tensor ``[n + 1]`` on ``device`` (copied there once)."""
        key = _device_key(device)
        if key not in self._offsets_on:
            self._offsets_on[key] = torch.from_numpy(self.offsets).to(device)
        return self._offsets_on[key]

    def lookup_layout(self, enc: Encoding, codec, device: torch.device):
        """A residual or PQ segment's look-up layout on ``device`` (where its codes are;
        ``enc.build_lookup``), built the first time a search asks for it and kept with the segment
        (its tokens never change); None when building it would not fit the device's free memory
        (then the segment is scored by the decoding kernel, said once: a ``LookupLayoutWarning``)."""
        key = _device_key(device)
        if self._lookup.get(key) is None:
            self._lookup.clear()  # one device at a time: the layout takes about the codes' bytes again
            need = enc.lookup_bytes(codec, int(self.embeddings.shape[0]), self.num_documents)
            free = _free_device_bytes(torch.device(device))
            layout = None
            if free is None or need * (2 if self._lookup_oom else 1) <= free:  # (an OOM asks for twice the bound)
                try:
                    layout = enc.build_lookup(codec, self.parts(), self.offsets_on(device))
                except torch.OutOfMemoryError:
                    self._lookup_oom = True
                    free = _free_device_bytes(torch.device(device))
            if layout is None:
                if not self._lookup_refused:
                    warnings.warn(f"maxsim: the look-up layout of a segment of {int(self.embeddings.shape[0])} "
                                  f"{enc} tokens needs up to {need / 2**30:.1f} GiB, "
                                  f"{'?' if free is None else f'{free / 2**30:.1f}'} GiB of {device} are free: it is "
                                  "scored by the decoding kernel (slower); free device memory, or split the corpus "
                                  "into shards", LookupLayoutWarning, stacklevel=2)
                    self._lookup_refused = True
                return None
            self._lookup[key] = layout
        return self._lookup[key]

    def lookup_on(self, device: torch.device):
        """The look-up layout already on ``device`` (``Corpus.to(device, lookup_only=True)`` put it
        there, or a search built it), else None: nothing is built here."""
        return self._lookup.get(_device_key(device))

    def keep_lookup(self, device: torch.device, layout) -> None:
        """Hold ``layout`` as this segment's look-up layout on ``device`` (one device at a time)."""
        self._lookup = {_device_key(device): layout}

    @property
    def longest(self) -> int:
        """Tokens of the longest document (0 when there is none)."""
        if self._longest is None:
            self._longest = int(np.diff(self.offsets).max()) if self.offsets.size > 1 else 0
        return self._longest

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The per-token tensors: ``(embeddings,)``, ``(values, scales)``, ``(codes, residuals)``
        (residual) or ``(codes,)`` (PQ)."""
        return (self.embeddings,) + tuple(t for t in (self.scales, self.residuals) if t is not None)

    def with_parts(self, parts, **changes) -> "CorpusSegment":
        """This segment with ``parts`` (as :meth:`parts` orders them) in place of its tensors."""
        parts = list(parts)
        embeddings = parts.pop(0)
        scales = parts.pop(0) if self.scales is not None else None
        residuals = parts.pop(0) if self.residuals is not None else None
        fields = dict(offsets=self.offsets, first_document=self.first_document, mapped=self.mapped)
        fields.update(changes)
        return CorpusSegment(embeddings, scales=scales, residuals=residuals, **fields)

    @property
    def num_documents(self) -> int:
        return self.offsets.size - 1


class LookupLayoutWarning(UserWarning):
    """A resident residual or PQ segment's look-up layout did not fit the device: the decoding
    kernel scores it."""


def _free_device_bytes(device: torch.device) -> int | None:
    """Free bytes of a CUDA device; None elsewhere (no limit to check)."""
    if device.type != "cuda":
        return None
    from maxsim.tuning import free_device_bytes

    return free_device_bytes(device)


def _as_tensor(name, x) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, torch.Tensor):
        return x
    raise TypeError(f"maxsim: {name} must be a torch.Tensor or numpy array; got {type(x).__name__}")


def _check_embeddings(name: str, x: torch.Tensor) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"maxsim: {name} must be float16, bfloat16 or float32 (for one-byte, residual or PQ tokens "
                        f"pass floats with encoding='int8', 'fp8', 'residual2', 'pq32', ...); got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"maxsim: {name} must be packed [total_tokens, d]; got {list(x.shape)}")


def _resolve_encoding(encoding, codec) -> Encoding | None:
    """The Encoding of a constructor: a given codec names its encoding (which ``encoding``, if
    given, must be); None: the input's float dtype."""
    if codec is not None:
        own = encodings.of_codec(codec)
        if encoding is not None:
            encodings.encoding(encoding).check_codec(codec)
        return own
    return None if encoding is None else encodings.encoding(encoding)


def _codec_to(codec, device: torch.device):
    if codec is None or codec.device == device:
        return codec
    return codec.to(device)


def _normalize_ids(ids, n: int, first: int = 0):
    """ids -> int64 numpy array or list of str, length n, unique. None -> first .. first + n - 1."""
    if ids is None:
        return np.arange(first, first + n, dtype=np.int64)
    if isinstance(ids, torch.Tensor):
        ids = ids.cpu().numpy()
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
        out = ids.astype(np.int64).reshape(-1)
    else:
        ids = list(ids)
        if all(isinstance(x, str) for x in ids):
            out = ids
        elif all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in ids):
            out = np.asarray(ids, dtype=np.int64).reshape(-1)
        else:
            raise TypeError("maxsim: document ids must be all str or all int")
    if len(out) != n:
        raise ValueError(f"maxsim: ids must have one entry per document ({n}); got {len(out)}")
    if isinstance(out, np.ndarray):  # increasing ids (a slice's range, the common case) need no sort
        unique = n if bool(np.all(out[1:] > out[:-1])) else len(np.unique(out))
    else:
        unique = len(set(out))
    if unique != n:
        raise ValueError("maxsim: document ids must be unique")
    return out


def _live_clash(a, b, deleted_a=None, deleted_b=None):
    """A live id of ``b`` that is a live id of ``a`` (None when there is none)."""
    if isinstance(a, np.ndarray) != isinstance(b, np.ndarray):
        raise TypeError("maxsim: cannot mix int and str document ids in one corpus")
    live_a, live_b = changes.live_ids(a, deleted_a), changes.live_ids(b, deleted_b)
    if isinstance(a, np.ndarray):
        if live_a.size == 0 or live_b.size == 0 or live_b.min() > live_a.max():  # ids that follow on: no sort
            return None
        both = np.intersect1d(live_a, live_b)
        return int(both[0]) if both.size else None
    seen = set(live_a)
    return next((x for x in live_b if x in seen), None)


def _join_ids(a, b, deleted_a=None, deleted_b=None, name: str = "the corpus"):
    """``a`` then ``b``. A live id of ``b`` must not be a live id of ``a``; a deleted document's id
    may come back (an update is a delete, then an append)."""
    clash = _live_clash(a, b, deleted_a, deleted_b)
    if clash is not None:
        raise ValueError(f"maxsim: document id {clash!r} is already in {name} (appended ids must be new): to "
                         f"replace that document, delete it first (corpus.delete([{clash!r}])), then append")
    return np.concatenate([a, b]) if isinstance(a, np.ndarray) else list(a) + list(b)


def _device_key(device) -> str:
    """``device`` as a segment's per-device caches name it: "cuda" and "cuda:0" (the current GPU)
    are one key, so a layout built for one is found by a search on the other."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _rows(t: torch.Tensor, keep: np.ndarray) -> torch.Tensor:
    """Rows ``keep`` (bool ``[t]``) of a per-token tensor, as a new tensor on its device."""
    mask = torch.from_numpy(keep).to(t.device)
    if t.dtype == torch.float8_e4m3fn:  # (indexing takes fp8 as its bytes)
        return t.view(torch.uint8)[mask].view(t.dtype)
    return t[mask]


def _stored_array(emb: torch.Tensor) -> np.ndarray:
    """Embeddings or codes as numpy in the stored dtype (bf16 and fp8 as their bits)."""
    emb = emb.detach().cpu().contiguous()
    if emb.dtype in (torch.bfloat16, torch.float8_e4m3fn):  # numpy has neither: store the bits
        return emb.view(torch.uint16 if emb.dtype == torch.bfloat16 else torch.uint8).numpy()
    return emb.numpy()


class Corpus:
    """Multi-vector documents, packed: ``[T, d]`` embeddings, offsets ``[N + 1]``, N ids.

    Build with :meth:`from_packed` (also ``Corpus(embeddings, offsets, ids)``), :meth:`from_list`,
    :meth:`from_padded` (torch or numpy inputs), :meth:`from_index` (a PLAID index) or :meth:`load`.
    ``ids``: str or int, unique; default 0 .. N - 1. Move with :meth:`to` / :meth:`pin_memory`.

    ``encoding`` (every constructor): how the tokens are held.

    - None (default): as given, float16, bfloat16 or float32. "float16" / "bfloat16" / "float32":
      cast to it (2d or 4d bytes a token).
    - "int8" / "fp8": quantised per token (``maxsim.compressed.quantized.quantize_tokens``, fp8 =
      e4m3): values ``[T, d]`` int8 / float8_e4m3fn plus scales ``[T]`` fp32, d + 4 bytes a token;
      search scores MaxSim against the dequantised tokens ``values * scale``.
    - "residual2" / "residual4" (also "residual1", "residual8"): PLAID residual compression
      (``maxsim.compressed.ResidualCodec``): a centroid code ``[T]`` int32 plus ``[T, d * nbits /
      8]`` uint8 residuals, d * nbits / 8 + 4 bytes a token (d a multiple of 8); search scores
      ``maxsim_residual_varlen``, i.e. MaxSim against the decoded, L2-normalised tokens.
    - "pq<m>" (e.g. "pq16", "pq32", "pq64"; m must divide d): product quantisation
      (``maxsim.compressed.ProductQuantizer``): codes ``[T, m]`` uint8, m bytes a token; search
      scores ``maxsim_pq_varlen``, MaxSim against the decoded tokens.

    A residual / PQ corpus has one codec (``corpus.codec``): ``codec=`` (every constructor) takes a
    ResidualCodec or ProductQuantizer to encode with (its encoding is then implied); without it
    one is trained on the tokens being encoded (:func:`train_codec`: the library's defaults, on a
    sample). Appends encode with the corpus's codec, never a new one. Searching such a corpus
    takes float16, bfloat16 or float32 queries. To re-encode a corpus, build a new one from the
    float tokens: ``Corpus.from_packed(c.embeddings, c.offsets, c.ids, encoding="int8")`` (float
    ``c``); the tokens of a compressed corpus are only ever decoded (``document(j)``).

    A corpus changes by :meth:`append`, :meth:`delete` (tombstones: the tokens stay until
    :meth:`compact`) and an update, which is a delete and then an append of the same id. Positions
    (``len``, ``indices``, ``document(j)``) count deleted documents until :meth:`compact`;
    :attr:`num_live` counts the others. ``search(..., subset=ids)`` ranks only those documents.
    """

    def __init__(self, embeddings, offsets, ids=None, *, encoding: str | None = None, codec=None):
        embeddings = _as_tensor("embeddings", embeddings)
        encoding = _resolve_encoding(encoding, codec)  # a given codec names its (residual / PQ) encoding
        if encoding is None or not embeddings.is_floating_point():  # (an encoding casts any float, fp64 too)
            _check_embeddings("embeddings", embeddings)
        elif embeddings.dim() != 2:
            raise ValueError(f"maxsim: embeddings must be packed [total_tokens, d]; got {list(embeddings.shape)}")
        offsets = _as_tensor("offsets", offsets).cpu().numpy().astype(np.int64).reshape(-1)
        if offsets.size < 1 or offsets[0] != 0 or offsets[-1] != embeddings.shape[0] or (np.diff(offsets) < 0).any():
            raise ValueError(f"maxsim: offsets must start at 0, never decrease and end at {embeddings.shape[0]}")
        if encoding is None:
            first, scales, residuals = embeddings, None, None
        else:
            first, scales, residuals, codec = encoding.encode(embeddings, codec)
        self._segments = [CorpusSegment(first.contiguous(), offsets, 0, scales=scales,
                                        residuals=None if residuals is None else residuals.contiguous())]
        self.codec = codec
        self.ids = _normalize_ids(ids, offsets.size - 1)
        self.path: Path | None = None
        self.base_index = 0  # global index of document 0 (a shard of a larger corpus)
        # (rank, world_size, live documents of the whole corpus: the width of a merged top-k)
        self.shard_info: tuple[int, int, int] | None = None
        self._init_changes()

    def _init_changes(self) -> None:
        # bool [N], True = deleted (None: none is); replaced, never changed in place, so that
        # copies (to, pin_memory) share it safely
        self._deleted: np.ndarray | None = None
        # (resolved folder, its manifest's segment entries) when loaded from a folder: saving back
        # there writes only the changes, and is refused if another write changed the folder since
        self._origin: tuple[str, list] | None = None
        self._id_index: changes.IdIndex | None = None  # built by the first delete / subset

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_packed(cls, embeddings, offsets, ids=None, *, encoding: str | None = None, codec=None) -> "Corpus":
        """``embeddings [T, d]``, ``offsets`` (cu_seqlens) ``[N + 1]``; ``encoding`` and ``codec``
        as the class."""
        return cls(embeddings, offsets, ids, encoding=encoding, codec=codec)

    @classmethod
    def from_list(cls, documents, ids=None, *, encoding: str | None = None, codec=None) -> "Corpus":
        """A ragged list of ``[L_j, d]`` tensors or arrays (an empty list is an error: no d);
        ``encoding`` and ``codec`` as the class."""
        documents = [_as_tensor("documents", x) for x in documents]
        packed, cu, _ = pack(documents)
        return cls(packed, cu, ids, encoding=encoding, codec=codec)

    @classmethod
    def from_padded(cls, D, d_mask=None, ids=None, *, encoding: str | None = None, codec=None) -> "Corpus":
        """``D [Nd, Ld, d]`` with ``d_mask [Nd, Ld]`` (True = real token; None = all real);
        ``encoding`` and ``codec`` as the class."""
        D = _as_tensor("D", D)
        if D.dim() != 3:
            raise ValueError(f"maxsim: D must be [Nd, Ld, d]; got {list(D.shape)}")
        if d_mask is None:
            mask = torch.ones(D.shape[:2], dtype=torch.bool, device=D.device)
        else:
            mask = _as_tensor("d_mask", d_mask).to(D.device)
            if tuple(mask.shape) != tuple(D.shape[:2]):
                raise ValueError(f"maxsim: d_mask must have shape {list(D.shape[:2])}; got {list(mask.shape)}")
            if mask.dtype != torch.bool:
                if bool(((mask != 0) & (mask != 1)).any()):
                    raise ValueError("maxsim: d_mask must be bool or hold only 0 and 1")
                mask = mask != 0
        packed, cu, _ = padded_to_packed(D, mask)
        return cls(packed, cu, ids, encoding=encoding, codec=codec)

    @classmethod
    def from_index(cls, path, ids=None) -> "Corpus":
        """A residual corpus holding the codes of a colbert-ai or fast-plaid (PyLate PLAID) index
        folder, as ``maxsim.index.load`` reads it: its codec (encoding "residual<nbits>"), codes,
        residuals and document lengths, no copy of the float tokens (which the index does not
        keep). ``ids``: default 0 .. N - 1, the index's passage ids. The corpus is searched
        exhaustively (not PLAID's candidate generation) and can be saved as a corpus file."""
        from maxsim.index import load as load_index

        index = load_index(path)
        codes = index.codes if index.codes.dtype == torch.int32 else index.codes.to(torch.int32)
        offsets = index.cu_seqlens.cpu().numpy().astype(np.int64)
        segment = CorpusSegment(codes.contiguous(), offsets, 0, residuals=index.residuals.contiguous())
        return cls._from_segments([segment], _normalize_ids(ids, offsets.size - 1), codec=index.codec)

    @classmethod
    def _from_segments(cls, segments, ids, path=None, codec=None) -> "Corpus":
        corpus = cls.__new__(cls)
        corpus._segments = segments
        corpus.codec = codec
        corpus.ids = ids
        corpus.path = path
        corpus.base_index = 0
        corpus.shard_info = None
        corpus._init_changes()
        return corpus

    # -- properties ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(s.num_documents for s in self._segments)

    @property
    def num_documents(self) -> int:
        return len(self)

    @property
    def num_deleted(self) -> int:
        """Documents deleted (:meth:`delete`) and not yet compacted away."""
        return 0 if self._deleted is None else int(self._deleted.sum())

    @property
    def num_live(self) -> int:
        """Documents a search can return: ``len(corpus) - num_deleted``."""
        return len(self) - self.num_deleted

    @property
    def live(self) -> np.ndarray:
        """bool ``[N]``: True for each position holding a live (not deleted) document (a copy)."""
        return np.ones(len(self), dtype=bool) if self._deleted is None else ~self._deleted

    @property
    def num_tokens(self) -> int:
        return sum(int(s.embeddings.shape[0]) for s in self._segments)

    @property
    def dim(self) -> int:
        if self.codec is not None:
            return int(self.codec.dim)
        return int(self._segments[0].embeddings.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        """The stored embeddings' dtype: float16 / bfloat16 / float32, int8 / float8_e4m3fn (the
        one-byte values of an int8 / fp8 corpus), or the codes' int32 / uint8 (residual / PQ)."""
        return self._segments[0].embeddings.dtype

    @property
    def encoding(self) -> Encoding:
        """How the tokens are held (:mod:`maxsim.search.encodings`): an Encoding, which is its name
        ("float16", "bfloat16", "float32", "int8", "fp8", "residual<nbits>" or "pq<m>") and owns
        the encoding's layout, codec, decoding and scorer."""
        if self.codec is not None:
            return encodings.of_codec(self.codec)
        if self._segments[0].scales is None:
            return encodings.of_dtype(self.dtype)
        return encodings.OneByte("int8" if self.dtype == torch.int8 else "fp8")

    @property
    def bytes_per_token(self) -> int:
        """Bytes a token takes in memory, on disk and in a streamed chunk: 4d / 2d (float), d + 4
        (int8 / fp8), d * nbits / 8 + 4 (residual), m (PQ)."""
        return self.encoding.bytes_per_token(self.dim)

    @property
    def device(self) -> torch.device:
        return self._segments[0].embeddings.device

    @property
    def segments(self) -> list[CorpusSegment]:
        return list(self._segments)

    @property
    def offsets(self) -> np.ndarray:
        """int64 ``[N + 1]`` over all segments."""
        parts, base = [np.zeros(1, dtype=np.int64)], 0
        for s in self._segments:
            parts.append(s.offsets[1:] + base)
            base += int(s.offsets[-1])
        return np.concatenate(parts)

    def _joined(self, field: str) -> torch.Tensor:
        if len(self._segments) == 1:
            return getattr(self._segments[0], field)
        return torch.cat([getattr(s, field) for s in self._segments], 0)

    @property
    def embeddings(self) -> torch.Tensor:
        """``[T, d]`` as stored (a concatenation, i.e. a copy, when there are several segments): the
        one-byte values of an int8 / fp8 corpus (``document`` dequantises). A residual / PQ corpus
        holds codes, not embeddings: see :attr:`codes`, :attr:`residuals` and :meth:`document`."""
        if self.encoding.has_codec:
            raise TypeError(f"maxsim: {self.name()} holds {self.encoding} codes, not embeddings: corpus.codes "
                            "(and corpus.residuals) hold them, corpus.document(j) decodes a document; to re-encode, "
                            "build a new corpus from the float tokens")
        return self._joined("embeddings")

    @property
    def codes(self) -> torch.Tensor | None:
        """The codes of a residual (``[T]`` int32) or PQ (``[T, m]`` uint8) corpus (a copy when
        there are several segments); None for other encodings."""
        return self._joined("embeddings") if self.encoding.has_codec else None

    @property
    def residuals(self) -> torch.Tensor | None:
        """``[T, d * nbits / 8]`` uint8 packed residuals of a residual corpus (a copy when there are
        several segments); None for other encodings."""
        return self._joined("residuals") if self._segments[0].residuals is not None else None

    @property
    def scales(self) -> torch.Tensor | None:
        """``[T]`` fp32 per-token scales of an int8 / fp8 corpus (a copy when there are several
        segments); None for a float corpus."""
        return self._joined("scales") if self.encoding.has_scales else None

    @property
    def is_mapped(self) -> bool:
        return any(s.mapped for s in self._segments)

    def where(self) -> str:
        """'cuda:0', 'pinned', 'cpu' or 'mmap' (for messages and the CLI's summary)."""
        if self.is_mapped:
            return "mmap"
        if self.device.type != "cpu":
            return str(self.device)
        return "pinned" if all(t.is_pinned() for s in self._segments for t in s.parts()) else "cpu"

    def name(self) -> str:
        return f"the corpus {self.path}" if self.path is not None else "the corpus"

    def __repr__(self) -> str:
        deleted = f" ({self.num_deleted} deleted)" if self.num_deleted else ""
        return (f"Corpus({len(self)} documents{deleted}, {self.num_tokens} tokens, d={self.dim}, "
                f"{self.encoding}, {self.where()}{', ' + str(self.path) if self.path else ''})")

    def document(self, index: int) -> torch.Tensor:
        """Embeddings ``[L, d]`` of document ``index``: a view, or for an int8 / fp8 corpus its
        dequantised tokens ``values * scale`` in float32, for a residual corpus its decoded tokens
        (``codec.decode(..., dtype=torch.float32)``, L2-normalised), for a PQ corpus its decoded
        tokens in float32 (new tensors)."""
        if not 0 <= index < len(self):
            raise IndexError(f"maxsim: document {index} out of range for {len(self)} documents")
        for s in self._segments:
            if index < s.first_document + s.num_documents:
                j = index - s.first_document
                t0, t1 = int(s.offsets[j]), int(s.offsets[j + 1])
                return self.encoding.decode(s.embeddings[t0:t1], None if s.scales is None else s.scales[t0:t1],
                                            None if s.residuals is None else s.residuals[t0:t1], self.codec)
        raise AssertionError  # pragma: no cover

    # -- moving -------------------------------------------------------------------------------

    def _map(self, fn, mapped: bool | None = None, codec_device=None) -> "Corpus":
        segments = [s.with_parts([fn(t) for t in s.parts()], mapped=s.mapped if mapped is None else mapped)
                    for s in self._segments]
        for new, old in zip(segments, self._segments):  # the same documents: still the folder's segments
            new.source = old.source
        codec = self.codec if codec_device is None else _codec_to(self.codec, torch.device(codec_device))
        out = Corpus._from_segments(segments, self.ids, self.path, codec)
        out.base_index, out.shard_info = self.base_index, self.shard_info
        out._deleted, out._origin, out._id_index = self._deleted, self._origin, self._id_index
        return out

    def to(self, device, *, lookup_only: bool = False) -> "Corpus":
        """A copy on ``device`` (or this corpus when it is there already and not mapped); a residual
        / PQ corpus's codec moves with it.

        ``lookup_only=True`` (a residual, PQ, int8 or fp8 corpus, a GPU ``device``): the GPU holds
        only the look-up scorer's layout, built one segment at a time (that segment's codes on the
        GPU while it is built); the codes stay in host memory (pinned, or memory-mapped from the
        corpus file; a GPU corpus's are copied to pinned memory). Returns that host corpus (this
        one when its codes are in host memory already). For a corpus whose codes and layout do not
        both fit the GPU: searches the look-up scorer serves read the layout alone; others (d other
        than 128, queries over 32 tokens), ``rerank``, refine and ``save`` read the codes from the
        host. An int8 / fp8 corpus (d 128) held so is scored by the one-byte Gluon scorer on
        Hopper (its tokens' bytes loaded straight into the 8-bit tensor cores' operand, the
        layout about their bytes again); resident on the GPU, by the one-byte stream kernel."""
        device = torch.device(device)
        if lookup_only:
            return self._lookup_only(device)
        if device == self.device and not self.is_mapped:
            return self
        return self._map(lambda e: e.to(device, copy=e.device == device), mapped=False, codec_device=device)

    def _lookup_only(self, device: torch.device) -> "Corpus":
        enc = self.encoding
        if not enc.has_lookup or device.type != "cuda":
            raise ValueError(f"maxsim: lookup_only=True holds a residual, PQ, int8 or fp8 corpus's look-up layout on a "
                             f"GPU; {self.name()} is {enc} and {device} is "
                             f"{'a GPU' if device.type == 'cuda' else 'not a GPU'}")
        host = self if self.device.type == "cpu" else self.pin_memory()
        codec = _codec_to(self.codec, device)
        for i, segment in enumerate(host._segments):
            try:
                parts = tuple(t.to(device) for t in segment.parts())  # one segment's codes at a time
                layout = enc.build_lookup(codec, parts, segment.offsets_on(device))
            except torch.OutOfMemoryError:
                tokens = int(segment.embeddings.shape[0])
                raise MemoryError(f"maxsim: the look-up layout of segment {i} ({tokens} tokens) does not fit "
                                  f"{device} beside its codes: free GPU memory, or append the documents in smaller "
                                  "segments") from None
            del parts
            segment.keep_lookup(device, layout)
        return host

    def pin_memory(self) -> "Corpus":
        """A copy in pinned host memory: what streams to the GPU at the full copy rate."""
        return self._map(pinned_copy, mapped=False, codec_device="cpu")

    # -- appending, sharding ------------------------------------------------------------------

    def append(self, documents, ids=None) -> "Corpus":
        """Add documents (a Corpus, a ragged list, or ``(embeddings, offsets)``) in memory, as a new
        segment on this corpus's device; default ids continue 0, 1, ... Returns self.

        Float documents (a list or a pair) appended to an int8 / fp8 corpus are quantised to its
        encoding, to a residual / PQ corpus encoded with its codec (never a new one); a float
        corpus takes documents of its dtype, and an appended Corpus must have this corpus's
        encoding (and codec).

        An id already live in this corpus is an error: an update is ``corpus.delete([id])``, then
        the append (a deleted document's id may come back). An appended Corpus brings its own
        deletions."""
        encoding = None if self.encoding.exact else self.encoding  # a float corpus takes its own dtype
        if isinstance(documents, Corpus):
            other = documents
            if ids is not None:
                other = Corpus._from_segments(other._segments, _normalize_ids(ids, len(other)), codec=other.codec)
                other._deleted = documents._deleted
        else:
            pair = isinstance(documents, tuple) and len(documents) == 2
            if not pair:
                documents = [_as_tensor("documents", x) for x in documents]
            if self.encoding.has_codec:  # the codec takes tokens of its d only: say so before encoding
                dims = {int(_as_tensor("embeddings", documents[0]).shape[-1])} if pair else \
                    {int(x.shape[-1]) for x in documents}
                if dims and dims != {self.dim}:
                    raise ValueError(f"maxsim: cannot append d={min(dims - {self.dim})} documents to {self.name()} "
                                     f"of d={self.dim}")
            codec = self.codec
            if pair:
                other = Corpus(documents[0], documents[1], None if ids is None else ids, encoding=encoding, codec=codec)
            else:
                other = Corpus.from_list(documents, ids, encoding=encoding, codec=codec)
        if ids is None and not isinstance(documents, Corpus) and isinstance(self.ids, np.ndarray):
            start = int(self.ids.max()) + 1 if len(self.ids) else 0
            other.ids = np.arange(start, start + len(other), dtype=np.int64)
        if other.dim != self.dim:
            raise ValueError(f"maxsim: cannot append d={other.dim} documents to {self.name()} of d={self.dim}")
        if other.encoding != self.encoding and not (self.encoding.exact and other.encoding.exact):
            hint = ("encode them with its codec: codec=corpus.codec" if self.encoding.has_codec
                    else f"build them with encoding={self.encoding!r}")
            raise TypeError(f"maxsim: cannot append {other.encoding} documents to {self.name()} of {self.encoding}: "
                            f"{hint}")
        if self.encoding.has_codec and not self.encoding.same_codec(self.codec, other.codec):
            raise ValueError(f"maxsim: cannot append documents encoded with another codec to {self.name()}: encode "
                             "them with its codec: codec=corpus.codec")
        if other.dtype != self.dtype:
            raise TypeError(f"maxsim: cannot append {other.dtype} documents to {self.name()} of {self.dtype}")
        self.ids = _join_ids(self.ids, other.ids, self._deleted, other._deleted, self.name())
        if self._deleted is not None or other._deleted is not None:
            self._deleted = np.concatenate([~self.live, ~other.live])
        self._id_index = None
        first = len(self)
        for s in other._segments:
            self._segments.append(s.with_parts([t.to(self.device) for t in s.parts()], first_document=first,
                                               mapped=False))
            first += s.num_documents
        return self

    def shard(self, rank: int, world_size: int) -> "Corpus":
        """Documents of shard ``rank`` of ``world_size``: a contiguous range, balanced by tokens (views,
        no copy; a mapped corpus stays mapped). Its ``base_index`` is the global index of its first
        document."""
        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"maxsim: need 0 <= rank < world_size; got rank={rank}, world_size={world_size}")
        offsets = self.offsets
        total = int(offsets[-1])
        bounds = [0] + [int(np.searchsorted(offsets, total * r / world_size, side="left")) for r in range(1, world_size)]
        bounds.append(len(self))
        bounds = np.maximum.accumulate(np.minimum(bounds, len(self)))
        lo, hi = int(bounds[rank]), int(bounds[rank + 1])
        return self._slice(lo, hi, (rank, world_size, self.num_live))

    def _slice(self, lo: int, hi: int, shard_info) -> "Corpus":
        segments, first = [], 0
        for s in self._segments:
            a, b = max(lo, s.first_document), min(hi, s.first_document + s.num_documents)
            if a >= b:
                continue
            ja, jb = a - s.first_document, b - s.first_document
            t0, t1 = int(s.offsets[ja]), int(s.offsets[jb])
            segments.append(s.with_parts([t[t0:t1] for t in s.parts()], offsets=s.offsets[ja:jb + 1] - t0,
                                         first_document=first))
            first += jb - ja
        if not segments:  # an empty shard keeps d, encoding and device
            s = self._segments[0]
            segments = [s.with_parts([t[:0] for t in s.parts()], offsets=np.zeros(1, dtype=np.int64),
                                     first_document=0)]
        ids = self.ids[lo:hi]
        out = Corpus._from_segments(segments, ids, self.path, self.codec)
        out.base_index = self.base_index + lo
        out.shard_info = shard_info
        if self._deleted is not None and self._deleted[lo:hi].any():
            out._deleted = self._deleted[lo:hi].copy()
        return out

    # -- files --------------------------------------------------------------------------------

    def _stored(self):
        """(embeddings or codes as numpy in the stored dtype, lengths, ids, scales as numpy or
        None, residuals as numpy or None) over all segments."""
        parts = [self._stored_segment(s) for s in self._segments]
        if len(parts) == 1:
            return parts[0][:2] + (self.ids,) + parts[0][3:]

        def joined(i):
            return None if parts[0][i] is None else np.concatenate([p[i] for p in parts])

        return joined(0), joined(1), self.ids, joined(3), joined(4)

    def _stored_segment(self, s: CorpusSegment):
        """:meth:`_stored` of one segment (changes.py writes segment by segment)."""
        scales = None if s.scales is None else s.scales.detach().cpu().float().contiguous().numpy()
        residuals = None if s.residuals is None else s.residuals.detach().cpu().contiguous().numpy()
        ids = self.ids[s.first_document:s.first_document + s.num_documents]
        return _stored_array(s.embeddings), np.diff(s.offsets), ids, scales, residuals

    def _is_origin(self, path) -> bool:
        """Whether ``path`` is the folder this corpus was loaded from (or last saved its changes to)."""
        return self._origin is not None and str(Path(path).resolve()) == self._origin[0]

    def _bind(self, path: Path, manifest: dict) -> None:
        """This corpus is ``manifest``'s corpus at ``path``: its segments are the listed ones."""
        self._origin = (str(Path(path).resolve()), manifest["segments"])
        for s, entry in zip(self._segments, manifest["segments"]):
            s.source = entry

    def save(self, path, *, append: bool = False, overwrite: bool = False) -> Path:
        """Write this corpus to the directory ``path`` (format.py). ``append``: add its documents
        to the corpus already there (a new segment; its live ids must not be live there; the same
        encoding, and for a residual / PQ corpus the same codec: build the documents with
        ``codec=Corpus.load(path).codec``). ``overwrite``: replace an existing corpus. Every
        write is atomic: an interruption leaves the previous corpus.

        Deleted documents are saved as tombstones (one small file a segment). Saving a corpus
        with ``overwrite=True`` to the folder it was loaded from writes only its changes: new
        segments (appended, or rewritten by :meth:`compact`) and the tombstones; the segments it
        loaded stay as they are. That is refused if another write changed the folder since the
        load (its changes would be lost): load it again.

            corpus = Corpus.load("corpus/")
            corpus.delete(["doc-7"]); corpus.append([new_doc], ids=["doc-7"])   # an update
            corpus.save("corpus/", overwrite=True)   # one tombstone file, one new segment
        """
        path = Path(path)
        exists = (path / corpus_format.MANIFEST).is_file()
        if exists and self._is_origin(path):
            if append:
                raise ValueError(f"maxsim: this corpus was loaded from {path}: save(path, overwrite=True) writes its "
                                 "changes there (append=True would add its documents a second time)")
            if overwrite:
                self._bind(path, changes.write_changes(path, self))
                return path
        if append and exists and (self.num_deleted or changes.has_tombstones(path)):
            # tombstones on either side: the file's corpus, appended to in memory (ids checked
            # against its live ones), writes its new segment and tombstones in one commit
            existing = Corpus._open(path, mmap=True, verify=False, warn=False)
            existing.append(self)
            changes.write_changes(path, existing)
            return path
        if self.num_deleted:
            changes.write_new(path, self, overwrite=overwrite)
            return path
        array, lengths, ids, scales, residuals = self._stored()
        dtype_name = self.encoding.stored_dtype
        tables = self.encoding.tables(self.codec) if self.encoding.has_codec else None
        try:
            corpus_format.write_corpus(path, array, lengths, ids, dtype_name, append=append, overwrite=overwrite,
                                       encoding=self.encoding, scales=scales, residuals=residuals, codec=tables)
        except ValueError as err:
            clash = self._clash_with(path) if append and exists else None
            if clash is not None:  # an update: say how
                raise ValueError(f"{err}: to replace that document, delete it first (Corpus.load(path).delete("
                                 f"[{clash!r}]), then save(path, overwrite=True)), then append") from None
            raise
        return path

    def _clash_with(self, path: Path):
        """A live id of this corpus that is live in the corpus at ``path`` (None when there is none,
        or that corpus cannot be read: the caller's error stands). Read on an error path only."""
        try:
            existing = Corpus._open(path, mmap=True, verify=False, warn=False)
        except (ValueError, OSError):
            return None
        if isinstance(existing.ids, np.ndarray) != isinstance(self.ids, np.ndarray):
            return None
        return _live_clash(existing.ids, self.ids, existing._deleted, self._deleted)

    @classmethod
    def load(cls, path, mmap: bool = True, *, verify: bool = True, device=None,
             pin_memory: bool = False) -> "Corpus":
        """Open a corpus directory. ``mmap``: map the embeddings (no read until searched);
        otherwise read them into host memory (pinned with ``pin_memory``) or onto ``device``.
        ``verify``: check every file's CRC-32 (one read of the corpus); sizes and headers are always
        checked. Errors name the file. A residual / PQ corpus's codec is read into memory (on
        ``device`` when given). Deleted documents (tombstones) come back deleted.

        Files left by an interrupted write (temporaries, segments never committed: the manifest
        does not list them) are never read; one warning (``changes.CorpusLeftoversWarning``) names
        them and their size. Loading does not delete them (a writer may be at work beside this
        reader): :meth:`cleanup` or the next save does."""
        return cls._open(path, mmap, verify=verify, device=device, pin_memory=pin_memory, warn=True)

    @classmethod
    def _open(cls, path, mmap: bool = True, *, verify: bool = True, device=None, pin_memory: bool = False,
              warn: bool = True) -> "Corpus":
        path = Path(path)
        manifest, stored = corpus_format.open_corpus(path, mmap=mmap, verify=verify)
        tombstones = changes.read_tombstones(path, manifest, verify)
        encoding = corpus_format.manifest_encoding(manifest)
        codec = None
        if encoding.has_codec:
            codec = encoding.codec_from_tables(corpus_format.read_codec(path, manifest, verify=verify))
        dtype = encoding.torch_dtype
        on_device = device is not None and torch.device(device).type != "cpu"
        segments, first = [], 0
        for s in stored:
            parts = [torch.from_numpy(s.embeddings)]
            if dtype in (torch.bfloat16, torch.float8_e4m3fn):  # stored as their bits
                parts[0] = parts[0].view(dtype)
            scales = None if s.scales is None else torch.from_numpy(s.scales)
            residuals = None if s.residuals is None else torch.from_numpy(s.residuals)
            parts += [t for t in (scales, residuals) if t is not None]
            offsets = np.zeros(s.lengths.size + 1, dtype=np.int64)
            np.cumsum(s.lengths, out=offsets[1:])
            if not mmap and pin_memory:
                parts = [pinned_copy(t) for t in parts]
            if on_device:
                parts = [t.to(device) for t in parts]
            mapped = mmap and not on_device
            template = CorpusSegment(parts[0], offsets, first, mapped, scales, residuals)
            segments.append(template.with_parts(parts))
            first += s.lengths.size
        if not segments:
            raise corpus_format.CorpusFormatError(f"maxsim: corpus {path} has no segments")
        if isinstance(stored[0].ids, np.ndarray):
            ids = np.concatenate([s.ids for s in stored])
        else:
            ids = [x for s in stored for x in s.ids]
        deleted = None
        if any(t is not None for t in tombstones):
            deleted = np.zeros(first, dtype=bool)
            for segment, dead in zip(segments, tombstones):
                if dead is not None:
                    deleted[segment.first_document + dead] = True
        changes.check_live_ids_unique(ids, deleted, f"corpus {path}")
        if on_device:
            codec = _codec_to(codec, torch.device(device))
        corpus = cls._from_segments(segments, ids, path, codec)
        corpus._deleted = deleted
        corpus._bind(path, manifest)
        if warn:
            changes.warn_leftovers(path, manifest, stacklevel=4)
        return corpus

    REFINE_FOLDER = "refine"

    def stored_refine(self) -> "Corpus | None":
        """The refine corpus stored with this one (a corpus in the folder's ``refine/`` subfolder,
        as ``python -m maxsim index --refine float16`` writes it), memory-mapped; None when the
        corpus was not loaded from a folder or the folder holds none."""
        if self.path is None:
            return None
        folder = Path(self.path) / self.REFINE_FOLDER
        if not (folder / corpus_format.MANIFEST).is_file():
            return None
        if getattr(self, "_stored_refine", None) is None:  # opened once (its files are only mapped)
            self._stored_refine = Corpus.load(folder, mmap=True, verify=False)
        return self._stored_refine

    @staticmethod
    def cleanup(path) -> list[str]:
        """Remove the files an interrupted write left in the corpus folder ``path`` (those its
        manifest does not list) -> their names. Run it when no other process writes the corpus;
        any save to the folder does the same."""
        return changes.cleanup(path)

    # -- changing -----------------------------------------------------------------------------

    def _index(self) -> changes.IdIndex:
        if self._id_index is None:
            self._id_index = changes.IdIndex(self.ids)
        return self._id_index

    def delete(self, ids, *, missing: str = "error") -> int:
        """Mark the documents of ``ids`` deleted (tombstones; their tokens stay until
        :meth:`compact`) -> how many were live before this call.

        ``ids``: one id, a list, a numpy array or a tensor, of the corpus's id type. Deleted
        documents never appear in :meth:`search` results, and ``k`` results still come back while
        ``k`` live documents remain. Deleting a deleted document again changes nothing (it counts
        0). An id the corpus never held is a ValueError naming it, and nothing is deleted;
        ``missing="ignore"`` skips such ids instead. :meth:`save` writes the tombstones (to the
        folder the corpus was loaded from: ``save(path, overwrite=True)``, only them).

            corpus.delete(["doc-3", "doc-9"])                # -> 2
            corpus.search(Q, k=10)                           # never doc-3 or doc-9
        """
        if missing not in ("error", "ignore"):
            raise ValueError(f"maxsim: missing must be 'error' or 'ignore'; got {missing!r}")
        wanted = changes.wanted_ids(ids, isinstance(self.ids, np.ndarray), "the ids to delete")
        which, positions = self._index().lookup(wanted)
        if missing == "error":
            found = np.zeros(len(wanted), dtype=bool)
            found[which] = True
            if not found.all():
                unknown = np.flatnonzero(~found)
                names = ", ".join(repr(wanted[int(i)] if not isinstance(wanted, np.ndarray) else int(wanted[i]))
                                  for i in unknown[:3])
                more = f" and {unknown.size - 3} more" if unknown.size > 3 else ""
                raise ValueError(f"maxsim: cannot delete {unknown.size} id(s) that {self.name()} does not hold: "
                                 f"{names}{more} (nothing deleted; missing='ignore' skips them)")
        deleted = np.zeros(len(self), dtype=bool) if self._deleted is None else self._deleted.copy()
        newly = np.unique(positions[~deleted[positions]])
        if newly.size:
            deleted[newly] = True
            self._deleted = deleted
        return int(newly.size)

    def compact(self, path=None) -> "Corpus":
        """Drop the deleted documents for good -> self: each segment that holds one is rebuilt from
        its live documents (on its device; a memory-mapped one is read into host memory), the
        others stay as they are. Positions (``indices``) change; ids, and every search's scores
        and ids, do not.

        ``path``: also write the compacted corpus there: the folder it was loaded from (the
        rebuilt segments are written, the manifest replaced last, the old files removed after: a
        kill at any point leaves the corpus before or after the compaction), or a new folder.

            corpus = Corpus.load("corpus/")
            corpus.compact("corpus/")
        """
        if self._deleted is not None:
            segments, first = [], 0
            for s in self._segments:
                dead = self._deleted[s.first_document:s.first_document + s.num_documents]
                if not dead.any():
                    segments.append(dataclasses.replace(s, first_document=first))  # (keeps its source)
                elif not dead.all():
                    live, lengths = ~dead, np.diff(s.offsets)
                    offsets = np.zeros(int(live.sum()) + 1, dtype=np.int64)
                    np.cumsum(lengths[live], out=offsets[1:])
                    parts = [_rows(t, np.repeat(live, lengths)) for t in s.parts()]
                    segments.append(s.with_parts(parts, offsets=offsets, first_document=first, mapped=False))
                else:
                    continue
                first += segments[-1].num_documents
            if not segments:  # everything deleted: an empty corpus keeps d, encoding and device
                s = self._segments[0]
                segments = [s.with_parts([t[:0] for t in s.parts()], offsets=np.zeros(1, dtype=np.int64),
                                         first_document=0, mapped=False)]
            self.ids = changes.live_ids(self.ids, self._deleted)
            self._segments, self._deleted, self._id_index = segments, None, None
        if path is not None:
            self.save(path, overwrite=self._is_origin(path))
        return self

    def _candidate_mask(self, subset=None) -> np.ndarray | None:
        """bool ``[N]``: the documents a search ranks (live, and in ``subset`` when given); None
        when that is every document."""
        if subset is None:
            return None if self._deleted is None else ~self._deleted
        wanted = changes.wanted_ids(subset, isinstance(self.ids, np.ndarray), "subset")
        _, positions = self._index().lookup(wanted)
        mask = np.zeros(len(self), dtype=bool)
        mask[positions] = True
        if self._deleted is not None:
            mask &= ~self._deleted
        return mask

    # -- search -------------------------------------------------------------------------------

    def ids_of(self, indices: torch.Tensor):
        """Ids of corpus positions ``indices [Nq, k]`` (global when this is a shard); position -1
        (no answer) has id -1 (int ids) or None (str ids)."""
        positions = indices.cpu().numpy()
        return changes.ids_at(self.ids, np.where(positions >= 0, positions - self.base_index, -1))

    def search(self, Q, k: int, *, q_mask=None, subset=None, refine=None, refine_factor: int = 4,
               batch_size: int | None = None, gpu_memory: int | None = None, progress: bool | None = None,
               device=None) -> SearchResult:
        """The best ``k`` documents per query, exactly (``torch.topk`` of ``maxsim_varlen`` scores,
        ties to the lower index, best first; ``k > N`` returns N). Deleted documents are never
        ranked: ``k > N`` returns the live ones.

        Args:
            Q: queries ``[Nq, Lq, d]`` (with ``q_mask``), ``[Lq, d]``, or a list of ``[L_i, d]``;
                the corpus's d; float16, bfloat16 or float32. A float corpus converts other float
                queries to its dtype (a ``QueryDtypeWarning``); an int8 / fp8 / residual / PQ corpus
                takes them as they are, its tokens scored as ``maxsim_quantized_varlen``,
                ``maxsim_residual_varlen`` or ``maxsim_pq_varlen`` score them.
            batch_size: queries scored together against each resident chunk (default: as many as
                the memory budget allows; all of them when it can).
            gpu_memory: bytes the search may use on the device: chunk buffers, scores, top-k state
                (default: a quarter of the free GPU memory; 1 GiB on the CPU). The residual and PQ
                scorers' own bounded scratch (decoded tiles, look-up tables; tens of MB) comes on
                top.
            progress: a tqdm bar over the documents: None = when stderr is a terminal and tqdm is
                installed; False = never.
            device: where to score (default: the corpus's GPU, else the queries', else CUDA when
                available, else the CPU).
            subset: ids (a list, array or tensor of the corpus's id type; one set for every
                query): only these documents are ranked, e.g. a tenant's. The answer is the exact
                top-k of the same scores restricted to them (``k > len(subset)`` returns those).
                Ids the corpus does not hold, or deleted ones, match nothing (a filter: the same
                set can be given to every shard).
            refine: a Corpus of the same documents in the same order (float16 / bfloat16 / float32,
                or int8 / fp8), typically loaded with ``mmap=True`` or pinned, or True: the one
                stored in this corpus's folder (:meth:`stored_refine`). This corpus's search
                keeps ``k * refine_factor`` candidates a query, and those are scored again from
                ``refine``'s tokens (only theirs are read); the result is the exact top-k of the
                candidates under ``refine``'s scores (FAISS's IndexRefine;
                :mod:`maxsim.search.refine`).
            refine_factor: candidates kept a result (default 4).

        Returns:
            ``SearchResult(scores [Nq, k'] fp32, indices [Nq, k'] int64, ids)``; 2-D ``Q`` drops the
            query axis. Ctrl-C stops the stream cleanly and raises KeyboardInterrupt.
        """
        from maxsim.search.refine import refined_search

        scores, indices = refined_search(self, Q, k, q_mask=q_mask, refine=refine, refine_factor=refine_factor,
                                         batch_size=batch_size, gpu_memory=gpu_memory, progress=progress,
                                         device=device, subset=subset)
        return self._result(scores, indices)

    def rerank(self, Q, candidates, k: int, *, q_mask=None, device=None) -> SearchResult:
        """The exact top-``k`` of each query among its own candidates, scored from this corpus's
        tokens (only theirs are read): the second stage of a search whose first stage ran
        elsewhere (a PLAID index, a compressed corpus, BM25), as ``search(refine=...)`` uses it.

        Args:
            Q: queries as :meth:`search` takes them (``[Nq, Lq, d]`` with ``q_mask``, ``[Lq, d]``
                or a list of ``[L_i, d]``).
            candidates: int ``[Nq, m]`` positions in this corpus (``SearchResult.indices`` of a
                search over the same documents in the same order; ``[m]`` for a 2-D ``Q``); -1
                pads a short list; deleted documents and repeats count as none.
            k: results a query (``k > m`` returns m).
            device: where to score (default as :meth:`search`).

        Returns:
            ``SearchResult(scores [Nq, k'] fp32, indices [Nq, k'] int64, ids)``, best first, ties
            to the lower index; a query with fewer than k candidates gets -1 and -inf in its last
            slots.
        """
        from maxsim.search.refine import rerank

        scores, indices = rerank(self, Q, candidates, k, q_mask=q_mask, device=device)
        return self._result(scores, indices)

    def _result(self, scores: torch.Tensor, indices: torch.Tensor) -> SearchResult:
        if scores.dim() == 1:
            return SearchResult(scores, indices, self.ids_of(indices[None])[0])
        return SearchResult(scores, indices, self.ids_of(indices))
