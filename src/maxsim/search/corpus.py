"""``Corpus``: multi-vector documents packed as ``[T, d]`` plus offsets plus document ids.

    corpus = Corpus.from_list(docs, ids=["doc-a", "doc-b", ...])   # ragged list of [L_j, d]
    corpus = Corpus.from_padded(D, d_mask)                          # [Nd, Ld, d] + [Nd, Ld]
    corpus.save("corpus/")                                          # format.py
    corpus = Corpus.load("corpus/", mmap=True)                      # on disk, memory-mapped
    result = corpus.search(Q, k=100)                                # SearchResult(scores, indices, ids)
    corpus = Corpus.from_list(docs, encoding="int8")                # one byte a dim + an fp32 scale a token

A corpus is a list of segments (one per save/append), each a packed ``[t, d]`` tensor with its
document offsets (and, for an int8 / fp8 corpus, its ``[t]`` fp32 scales); its tensors live on
the GPU, in (optionally pinned) host memory, or are memory maps of the corpus file. Searching a
GPU-resident corpus scores it in place; a host or mapped corpus streams to the GPU under a memory
budget (stream.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

import maxsim
from maxsim.compressed.quantized import dequantize_tokens, quantize_tokens
from maxsim.search import format as corpus_format

_TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}
ENCODINGS = corpus_format.ENCODINGS
# one-byte encodings -> (quantize_tokens' format, the values' dtype)
_QUANTIZED = {"int8": ("int8", torch.int8), "fp8": ("fp8_e4m3", torch.float8_e4m3fn)}
_VALUE_ENCODINGS = {dtype: name for name, (_, dtype) in _QUANTIZED.items()}


class SearchResult(NamedTuple):
    """``scores [Nq, k] fp32``, ``indices [Nq, k] int64`` (positions in the corpus), ``ids``: the
    documents' ids, an int64 tensor ``[Nq, k]`` for int ids or a list of Nq lists of str."""

    scores: torch.Tensor
    indices: torch.Tensor
    ids: object


@dataclass
class CorpusSegment:
    """Documents ``first_document ...`` of a corpus: ``embeddings [t, d]`` and host ``offsets
    [n + 1]`` int64 (from 0). ``mapped``: the embeddings are a memory map of a corpus file.
    ``scales [t]`` fp32 (on the embeddings' device) for an int8 / fp8 corpus, whose embeddings are
    the one-byte values; None for a float corpus."""

    embeddings: torch.Tensor
    offsets: np.ndarray
    first_document: int
    mapped: bool = False
    scales: torch.Tensor | None = None

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The per-token tensors: ``(embeddings,)`` or ``(values, scales)``."""
        return (self.embeddings,) if self.scales is None else (self.embeddings, self.scales)

    @property
    def num_documents(self) -> int:
        return self.offsets.size - 1


def _as_tensor(name, x) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, torch.Tensor):
        return x
    raise TypeError(f"maxsim: {name} must be a torch.Tensor or numpy array; got {type(x).__name__}")


def _check_embeddings(name: str, x: torch.Tensor) -> None:
    if x.dtype not in _DTYPE_NAMES:
        raise TypeError(f"maxsim: {name} must be float16, bfloat16 or float32 (for one-byte tokens pass floats "
                        f"with encoding='int8' or 'fp8'); got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"maxsim: {name} must be packed [total_tokens, d]; got {list(x.shape)}")


def _check_encoding(encoding) -> None:
    if encoding is not None and encoding not in ENCODINGS:
        raise ValueError(f"maxsim: encoding must be one of {', '.join(ENCODINGS)} (or None: the input's dtype); "
                         f"got {encoding!r}")


def _encode(embeddings: torch.Tensor, encoding):
    """Float ``[T, d]`` -> ``(embeddings [T, d], scales [T] fp32 or None)`` in ``encoding``
    (None: as they are)."""
    if encoding is None:
        return embeddings, None
    if encoding in _QUANTIZED:
        return quantize_tokens(embeddings, _QUANTIZED[encoding][0])
    return embeddings.to(_TORCH_DTYPES[encoding]), None


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
    unique = len(np.unique(out)) if isinstance(out, np.ndarray) else len(set(out))
    if unique != n:
        raise ValueError("maxsim: document ids must be unique")
    return out


def _join_ids(a, b):
    if isinstance(a, np.ndarray) != isinstance(b, np.ndarray):
        raise TypeError("maxsim: cannot mix int and str document ids in one corpus")
    if isinstance(a, np.ndarray):
        joined = np.concatenate([a, b])
        if len(np.unique(joined)) != len(joined):
            raise ValueError("maxsim: appended document ids must not repeat the corpus's ids")
        return joined
    if set(a) & set(b):
        raise ValueError("maxsim: appended document ids must not repeat the corpus's ids")
    return list(a) + list(b)


class Corpus:
    """Multi-vector documents, packed: ``[T, d]`` embeddings, offsets ``[N + 1]``, N ids.

    Build with :meth:`from_packed` (also ``Corpus(embeddings, offsets, ids)``), :meth:`from_list`,
    :meth:`from_padded` (torch or numpy inputs), or :meth:`load`. ``ids``: str or int, unique;
    default 0 .. N - 1. Move with :meth:`to` / :meth:`pin_memory`.

    ``encoding`` (every constructor): how the tokens are held. None (default): as given, float16,
    bfloat16 or float32. "float16" / "bfloat16" / "float32": cast to it. "int8" / "fp8": quantised
    per token (``maxsim.compressed.quantized.quantize_tokens``, fp8 = e4m3): values ``[T, d]``
    int8 / float8_e4m3fn plus scales ``[T]`` fp32, d + 4 bytes a token; search scores MaxSim
    against the dequantised tokens ``values * scale``. To re-encode a corpus, build a new one:
    ``Corpus.from_packed(c.embeddings, c.offsets, c.ids, encoding="int8")`` (float ``c``).
    """

    def __init__(self, embeddings, offsets, ids=None, *, encoding: str | None = None):
        embeddings = _as_tensor("embeddings", embeddings)
        _check_encoding(encoding)
        if encoding is None or not embeddings.is_floating_point():  # (an encoding casts any float, fp64 too)
            _check_embeddings("embeddings", embeddings)
        elif embeddings.dim() != 2:
            raise ValueError(f"maxsim: embeddings must be packed [total_tokens, d]; got {list(embeddings.shape)}")
        offsets = _as_tensor("offsets", offsets).cpu().numpy().astype(np.int64).reshape(-1)
        if offsets.size < 1 or offsets[0] != 0 or offsets[-1] != embeddings.shape[0] or (np.diff(offsets) < 0).any():
            raise ValueError(f"maxsim: offsets must start at 0, never decrease and end at {embeddings.shape[0]}")
        embeddings, scales = _encode(embeddings, encoding)
        self._segments = [CorpusSegment(embeddings.contiguous(), offsets, 0, scales=scales)]
        self.ids = _normalize_ids(ids, offsets.size - 1)
        self.path: Path | None = None
        self.base_index = 0  # global index of document 0 (a shard of a larger corpus)
        self.shard_info: tuple[int, int, int] | None = None  # (rank, world_size, total documents)

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_packed(cls, embeddings, offsets, ids=None, *, encoding: str | None = None) -> "Corpus":
        """``embeddings [T, d]``, ``offsets`` (cu_seqlens) ``[N + 1]``; ``encoding`` as the class."""
        return cls(embeddings, offsets, ids, encoding=encoding)

    @classmethod
    def from_list(cls, documents, ids=None, *, encoding: str | None = None) -> "Corpus":
        """A ragged list of ``[L_j, d]`` tensors or arrays (an empty list is an error: no d);
        ``encoding`` as the class."""
        documents = [_as_tensor("documents", x) for x in documents]
        packed, cu, _ = maxsim.pack(documents)
        return cls(packed, cu, ids, encoding=encoding)

    @classmethod
    def from_padded(cls, D, d_mask=None, ids=None, *, encoding: str | None = None) -> "Corpus":
        """``D [Nd, Ld, d]`` with ``d_mask [Nd, Ld]`` (True = real token; None = all real);
        ``encoding`` as the class."""
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
        packed, cu, _ = maxsim.padded_to_packed(D, mask)
        return cls(packed, cu, ids, encoding=encoding)

    @classmethod
    def _from_segments(cls, segments, ids, path=None) -> "Corpus":
        corpus = cls.__new__(cls)
        corpus._segments = segments
        corpus.ids = ids
        corpus.path = path
        corpus.base_index = 0
        corpus.shard_info = None
        return corpus

    # -- properties ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(s.num_documents for s in self._segments)

    @property
    def num_documents(self) -> int:
        return len(self)

    @property
    def num_tokens(self) -> int:
        return sum(int(s.embeddings.shape[0]) for s in self._segments)

    @property
    def dim(self) -> int:
        return int(self._segments[0].embeddings.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        """The stored embeddings' dtype: float16 / bfloat16 / float32, or int8 / float8_e4m3fn (the
        one-byte values of an int8 / fp8 corpus)."""
        return self._segments[0].embeddings.dtype

    @property
    def encoding(self) -> str:
        """"float16", "bfloat16", "float32", "int8" or "fp8"."""
        if self._segments[0].scales is None:
            return _DTYPE_NAMES[self.dtype]
        return _VALUE_ENCODINGS[self.dtype]

    @property
    def is_quantized(self) -> bool:
        """Whether the tokens are one-byte values with per-token scales (int8 / fp8)."""
        return self._segments[0].scales is not None

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

    @property
    def embeddings(self) -> torch.Tensor:
        """``[T, d]`` as stored (a concatenation, i.e. a copy, when there are several segments): the
        one-byte values of an int8 / fp8 corpus (``document`` dequantises)."""
        if len(self._segments) == 1:
            return self._segments[0].embeddings
        return torch.cat([s.embeddings for s in self._segments], 0)

    @property
    def scales(self) -> torch.Tensor | None:
        """``[T]`` fp32 per-token scales of an int8 / fp8 corpus (a copy when there are several
        segments); None for a float corpus."""
        if not self.is_quantized:
            return None
        if len(self._segments) == 1:
            return self._segments[0].scales
        return torch.cat([s.scales for s in self._segments], 0)

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
        return (f"Corpus({len(self)} documents, {self.num_tokens} tokens, d={self.dim}, "
                f"{self.encoding}, {self.where()}{', ' + str(self.path) if self.path else ''})")

    def document(self, index: int) -> torch.Tensor:
        """Embeddings ``[L, d]`` of document ``index``: a view, or for an int8 / fp8 corpus its
        dequantised tokens ``values * scale`` in float32 (a new tensor)."""
        if not 0 <= index < len(self):
            raise IndexError(f"maxsim: document {index} out of range for {len(self)} documents")
        for s in self._segments:
            if index < s.first_document + s.num_documents:
                j = index - s.first_document
                t0, t1 = int(s.offsets[j]), int(s.offsets[j + 1])
                if s.scales is None:
                    return s.embeddings[t0:t1]
                return dequantize_tokens(s.embeddings[t0:t1], s.scales[t0:t1])
        raise AssertionError  # pragma: no cover

    # -- moving -------------------------------------------------------------------------------

    def _map(self, fn, mapped: bool | None = None) -> "Corpus":
        segments = [CorpusSegment(fn(s.embeddings), s.offsets, s.first_document,
                                  s.mapped if mapped is None else mapped, None if s.scales is None else fn(s.scales))
                    for s in self._segments]
        out = Corpus._from_segments(segments, self.ids, self.path)
        out.base_index, out.shard_info = self.base_index, self.shard_info
        return out

    def to(self, device) -> "Corpus":
        """A copy on ``device`` (or this corpus when it is there already and not mapped)."""
        device = torch.device(device)
        if device == self.device and not self.is_mapped:
            return self
        return self._map(lambda e: e.to(device, copy=e.device == device), mapped=False)

    def pin_memory(self) -> "Corpus":
        """A copy in pinned host memory: what streams to the GPU at the full copy rate."""
        return self._map(lambda e: e.cpu().pin_memory(), mapped=False)

    # -- appending, sharding ------------------------------------------------------------------

    def append(self, documents, ids=None) -> "Corpus":
        """Add documents (a Corpus, a ragged list, or ``(embeddings, offsets)``) in memory, as a new
        segment on this corpus's device; default ids continue 0, 1, ... Returns self.

        Float documents (a list or a pair) appended to an int8 / fp8 corpus are quantised to its
        encoding; a float corpus takes documents of its dtype, and an appended Corpus must have this
        corpus's encoding."""
        encoding = self.encoding if self.is_quantized else None
        if isinstance(documents, Corpus):
            other = documents
            if ids is not None:
                other = Corpus._from_segments(other._segments, _normalize_ids(ids, len(other)))
        elif isinstance(documents, tuple) and len(documents) == 2:
            other = Corpus(documents[0], documents[1], None if ids is None else ids, encoding=encoding)
        else:
            other = Corpus.from_list(documents, ids, encoding=encoding)
        if ids is None and not isinstance(documents, Corpus) and isinstance(self.ids, np.ndarray):
            start = int(self.ids.max()) + 1 if len(self.ids) else 0
            other.ids = np.arange(start, start + len(other), dtype=np.int64)
        if other.dim != self.dim:
            raise ValueError(f"maxsim: cannot append d={other.dim} documents to {self.name()} of d={self.dim}")
        if other.is_quantized != self.is_quantized or (self.is_quantized and other.encoding != self.encoding):
            raise TypeError(f"maxsim: cannot append {other.encoding} documents to {self.name()} of {self.encoding}: "
                            f"build them with encoding={self.encoding!r}")
        if other.dtype != self.dtype:
            raise TypeError(f"maxsim: cannot append {other.dtype} documents to {self.name()} of {self.dtype}")
        self.ids = _join_ids(self.ids, other.ids)
        first = len(self)
        for s in other._segments:
            scales = None if s.scales is None else s.scales.to(self.device)
            self._segments.append(CorpusSegment(s.embeddings.to(self.device), s.offsets, first, False, scales))
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
        return self._slice(lo, hi, (rank, world_size, len(self)))

    def _slice(self, lo: int, hi: int, shard_info) -> "Corpus":
        segments, first = [], 0
        for s in self._segments:
            a, b = max(lo, s.first_document), min(hi, s.first_document + s.num_documents)
            if a >= b:
                continue
            ja, jb = a - s.first_document, b - s.first_document
            t0, t1 = int(s.offsets[ja]), int(s.offsets[jb])
            scales = None if s.scales is None else s.scales[t0:t1]
            segments.append(CorpusSegment(s.embeddings[t0:t1], s.offsets[ja:jb + 1] - t0, first, s.mapped, scales))
            first += jb - ja
        if not segments:  # an empty shard keeps d, encoding and device
            s = self._segments[0]
            segments = [CorpusSegment(s.embeddings[:0], np.zeros(1, dtype=np.int64), 0, s.mapped,
                                      None if s.scales is None else s.scales[:0])]
        ids = self.ids[lo:hi]
        out = Corpus._from_segments(segments, ids, self.path)
        out.base_index = self.base_index + lo
        out.shard_info = shard_info
        return out

    # -- files --------------------------------------------------------------------------------

    def _stored(self):
        """(embeddings as numpy in the stored dtype, lengths, ids, scales as numpy or None) over all
        segments."""
        emb = self.embeddings.detach().cpu().contiguous()
        if emb.dtype in (torch.bfloat16, torch.float8_e4m3fn):  # numpy has neither: store the bits
            array = emb.view(torch.uint16 if emb.dtype == torch.bfloat16 else torch.uint8).numpy()
        else:
            array = emb.numpy()
        scales = None if not self.is_quantized else self.scales.detach().cpu().float().contiguous().numpy()
        return array, np.diff(self.offsets), self.ids, scales

    def save(self, path, *, append: bool = False, overwrite: bool = False) -> Path:
        """Write this corpus to the directory ``path`` (format.py). ``append``: add its documents
        to the corpus already there (a new segment; its ids must be new; the same encoding).
        ``overwrite``: replace an existing corpus. Every write is atomic: an interruption leaves
        the previous corpus."""
        array, lengths, ids, scales = self._stored()
        dtype_name = corpus_format.QUANTIZED_ENCODINGS.get(self.encoding, self.encoding)
        corpus_format.write_corpus(path, array, lengths, ids, dtype_name, append=append, overwrite=overwrite,
                                   encoding=self.encoding, scales=scales)
        return Path(path)

    @classmethod
    def load(cls, path, mmap: bool = True, *, verify: bool = True, device=None,
             pin_memory: bool = False) -> "Corpus":
        """Open a corpus directory. ``mmap``: map the embeddings (no read until searched);
        otherwise read them into host memory (pinned with ``pin_memory``) or onto ``device``.
        ``verify``: check every file's CRC-32 (one read of the corpus); sizes and headers are always
        checked. Errors name the file."""
        path = Path(path)
        manifest, stored = corpus_format.open_corpus(path, mmap=mmap, verify=verify)
        encoding = corpus_format.manifest_encoding(manifest)
        dtype = _QUANTIZED[encoding][1] if encoding in _QUANTIZED else _TORCH_DTYPES[encoding]
        segments, first, ids = [], 0, None
        for s in stored:
            parts = [torch.from_numpy(s.embeddings)]
            if dtype in (torch.bfloat16, torch.float8_e4m3fn):  # stored as their bits
                parts[0] = parts[0].view(dtype)
            if s.scales is not None:
                parts.append(torch.from_numpy(s.scales))
            offsets = np.zeros(s.lengths.size + 1, dtype=np.int64)
            np.cumsum(s.lengths, out=offsets[1:])
            if not mmap and pin_memory:
                parts = [t.pin_memory() for t in parts]
            if device is not None and torch.device(device).type != "cpu":
                parts = [t.to(device) for t in parts]
            emb, scales = parts[0], (parts[1] if len(parts) > 1 else None)
            mapped = mmap and (device is None or torch.device(device).type == "cpu")
            segments.append(CorpusSegment(emb, offsets, first, mapped, scales))
            first += s.lengths.size
            ids = s.ids if ids is None else _join_ids(ids, s.ids)
        if not segments:
            raise corpus_format.CorpusFormatError(f"maxsim: corpus {path} has no segments")
        return cls._from_segments(segments, ids, path)

    # -- search -------------------------------------------------------------------------------

    def ids_of(self, indices: torch.Tensor):
        """Ids of corpus positions ``indices [Nq, k]`` (global when this is a shard)."""
        local = indices.cpu().numpy() - self.base_index
        if isinstance(self.ids, np.ndarray):
            return torch.from_numpy(self.ids[local])
        return [[self.ids[j] for j in row] for row in local.tolist()]

    def search(self, Q, k: int, q_mask=None, batch_size: int | None = None, gpu_memory: int | None = None,
               progress: bool | None = None, *, device=None) -> SearchResult:
        """The best ``k`` documents per query, exactly (``torch.topk`` of ``maxsim_varlen`` scores,
        ties to the lower index, best first; ``k > N`` returns N).

        Args:
            Q: queries ``[Nq, Lq, d]`` (with ``q_mask``), ``[Lq, d]``, or a list of ``[L_i, d]``;
                the corpus's d and dtype (an int8 / fp8 corpus: float16, bfloat16 or float32, its
                tokens scored as ``maxsim_quantized_varlen`` scores them).
            batch_size: queries scored together against each resident chunk (default: as many as
                the memory budget allows; all of them when it can).
            gpu_memory: bytes the search may use on the device: chunk buffers, scores, top-k state
                (default: a quarter of the free GPU memory; 1 GiB on the CPU).
            progress: a tqdm bar over the documents: None = when stderr is a terminal and tqdm is
                installed; False = never.
            device: where to score (default: the corpus's GPU, else the queries', else CUDA when
                available, else the CPU).

        Returns:
            ``SearchResult(scores [Nq, k'] fp32, indices [Nq, k'] int64, ids)``; 2-D ``Q`` drops the
            query axis. Ctrl-C stops the stream cleanly and raises KeyboardInterrupt.
        """
        from maxsim.search.stream import search_corpus

        scores, indices = search_corpus(self, Q, k, q_mask=q_mask, batch_size=batch_size, gpu_memory=gpu_memory,
                                        progress=progress, device=device)
        if scores.dim() == 1:
            return SearchResult(scores, indices, self.ids_of(indices[None])[0])
        return SearchResult(scores, indices, self.ids_of(indices))
