"""How a corpus holds its tokens: one object per encoding, owning everything that differs between
them (FAISS's index types), so that nothing else branches on an encoding's name.

    enc = encoding("residual2")          # or Residual(2); "float16", "int8", "fp8", "pq32", ...
    enc == "residual2"                   # an Encoding is its name (a str): manifests, messages
    enc.has_codec, enc.bytes_per_token(128)

=========  ==================================  ======================  =====================
encoding   a token holds                       scorer                  file (format.py)
=========  ==================================  ======================  =====================
Float      ``[d]`` float16 / bfloat16 / fp32   ``maxsim_varlen``       ``emb`` (version 1)
OneByte    ``[d]`` int8 / fp8 e4m3 + fp32      one-byte stream kernel  ``emb`` + ``scl`` (2)
           scale (``quantize_tokens``)
Residual   an int32 centroid id + ``d *        look-up scorer          ``codes`` + ``res`` +
           nbits / 8`` packed residual bytes   (resident) or decoded   a codec (3)
           (PLAID, ``ResidualCodec``)          planes (streamed)
PQ         ``[m]`` uint8 codes                 look-up scorer          ``codes`` + a codec (3)
           (``ProductQuantizer``)              (resident, pq_lut) or
                                               ``maxsim_pq_varlen``
=========  ==================================  ======================  =====================

Each owns: its name and stored dtype, the format version that first held it, its per-token parts,
its codec (training, the tables a file stores, their checks), encoding float tokens, decoding a
document, the form a query batch takes and the scorer of a chunk. A float or one-byte corpus can
be the exact second stage of a search (``refine=``); a residual or PQ one cannot.
"""

from __future__ import annotations

import numpy as np
import torch

from maxsim.compressed.codec import ResidualCodec
from maxsim.compressed.pq import ProductQuantizer
from maxsim.compressed.quantized import dequantize_tokens, prepare_queries, quantize_tokens
from maxsim.search.topk import chunk_offsets, score_packed_chunk, score_quantized_chunk
from maxsim.varlen.packing import packed_to_padded

PQ_CENTROIDS = 256


class Encoding(str):
    """An encoding: a ``str`` (its name) with the behaviour of that encoding. Build one with
    :func:`encoding`."""

    exact = False  # the stored tokens are the given floats, cast (no quantisation)
    has_lookup = False  # a look-up layout can stand in for the tokens on a GPU (lookup_only)
    has_codec = False  # codes of one corpus-level codec (residual, PQ)
    has_scales = False  # per-token fp32 scales beside the values (int8, fp8)
    has_residuals = False  # per-token packed residual bytes beside the codes (residual)
    format_version = 1  # the oldest corpus file format that holds it
    stored_dtype: str  # the manifest's "dtype": the main per-token file's
    torch_dtype: torch.dtype  # that file's tensor dtype in memory
    main_part = "embeddings"  # the manifest's name of the main per-token file

    def __reduce__(self):
        return encoding, (str(self),)

    def __repr__(self) -> str:
        return str.__repr__(self)

    # -- layout ---------------------------------------------------------------------------------
    def row_shape(self, dim: int) -> tuple:
        """A token's row in the main per-token file."""
        return (dim,)

    def residual_bytes(self, dim: int) -> int:
        return 0

    def bytes_per_token(self, dim: int) -> int:
        """Bytes a token takes in memory, on disk and in a streamed chunk."""
        row = int(np.prod(self.row_shape(dim), dtype=np.int64))
        return row * torch.empty(0, dtype=self.torch_dtype).element_size() + 4 * self.has_scales \
            + self.residual_bytes(dim)

    # -- the corpus's tokens ---------------------------------------------------------------------
    def encode(self, embeddings: torch.Tensor, codec=None):
        """Float ``[T, d]`` -> ``(main part, scales or None, residuals or None, codec or None)``, on
        the tokens' device."""
        raise NotImplementedError

    def decode(self, main: torch.Tensor, scales, residuals, codec) -> torch.Tensor:
        """A document's rows -> its tokens ``[L, d]`` (a view of float tokens, else new fp32)."""
        raise NotImplementedError

    def check_codec(self, codec) -> None:
        """A codec given with this encoding must be one that writes it."""
        if codec is not None and of_codec(codec) != self:
            own = str(of_codec(codec))
            raise ValueError(f"maxsim: codec= is a {type(codec).__name__} for encoding {own!r}, but "
                             f"encoding={str(self)!r}: give encoding={own!r} (or leave it out)")

    # -- searching ------------------------------------------------------------------------------
    def scoring_dtype(self) -> torch.dtype | None:
        """The dtype queries are converted to (a float corpus's own), or None: taken as they are."""
        return None

    def query_batch(self, q: torch.Tensor, cu: torch.Tensor, longest: int, cu_host: np.ndarray, *, codec,
                    resident: bool, layouts: bool = False):
        """A batch of packed queries ``q [t, d]`` (offsets ``cu`` on the device, ``cu_host`` on the
        host) in the form :meth:`score_chunk` takes, built once a search. ``resident``: the tokens
        or a look-up layout are on the device; ``layouts``: every segment's look-up layout is
        (``Corpus.to(..., lookup_only=True)``). A look-up encoding's form holds its scorer's
        Choice at index 2 (None: the batch is streamed)."""
        return None

    def score_chunk(self, batch, queries, chunk, segment, start: int, stop: int, token_base: int, *, device,
                    codec) -> torch.Tensor:
        """Scores ``[n, stop - start]`` fp32 of documents ``start:stop`` of ``segment``: ``batch``
        from :meth:`query_batch`, ``queries`` ``(q, cu, longest)`` packed, ``chunk`` the segment's
        parts from row ``token_base`` (on ``device``)."""
        raise NotImplementedError


class Float(Encoding):
    """float16 / bfloat16 / float32 tokens, stored as given (2d or 4d bytes a token)."""

    exact = True

    _DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

    def __new__(cls, name: str):
        self = super().__new__(cls, name)
        self.torch_dtype = cls._DTYPES[name]
        self.stored_dtype = name
        return self

    def encode(self, embeddings, codec=None):
        self.check_codec(codec)
        return embeddings.to(self.torch_dtype), None, None, None

    def decode(self, main, scales, residuals, codec):
        return main

    def scoring_dtype(self):
        return self.torch_dtype

    def score_chunk(self, batch, queries, chunk, segment, start, stop, token_base, *, device, codec):
        q, cu, longest = queries
        return score_packed_chunk(q, cu, longest, chunk[0], segment.offsets, start, stop, token_base,
                                  cu_d=segment.offsets_on(device), max_d=segment.longest)


class OneByte(Encoding):
    """int8 / fp8 (e4m3) values with one fp32 scale a token (d + 4 bytes;
    ``maxsim.compressed.quantized.quantize_tokens``). Resident: the one-byte stream kernel; held
    as its layout on a Hopper GPU (``lookup_only``), the one-byte Gluon scorer."""

    has_scales = True
    has_lookup = True
    format_version = 2
    _FORMATS = {"int8": ("int8", torch.int8, "int8"), "fp8": ("fp8_e4m3", torch.float8_e4m3fn, "float8_e4m3fn")}

    def __new__(cls, name: str):
        self = super().__new__(cls, name)
        self._format, self.torch_dtype, self.stored_dtype = cls._FORMATS[name]
        return self

    def encode(self, embeddings, codec=None):
        self.check_codec(codec)
        values, scales = quantize_tokens(embeddings, self._format)
        return values, scales, None, None

    def decode(self, main, scales, residuals, codec):
        return dequantize_tokens(main, scales)

    def query_batch(self, q, cu, longest, cu_host, *, codec, resident, layouts=False):
        Q = q_mask = choice = None
        if layouts:  # the tokens' layouts on the GPU: the one-byte scorer takes padded queries
            Q, mask = packed_to_padded(q, cu, longest)
            q_mask = None if bool(mask.all()) else mask
            choice = self.lookup_choice(Q, q_mask, codec)
            choice = None if isinstance(choice, str) else choice
        prepared = None
        if choice is None:  # the stream kernel's form (query bytes quantised once), else a list of views
            prepared = prepare_queries(q, cu, longest, self.torch_dtype)
            if prepared is None:
                prepared = [q[int(a):int(b)] for a, b in zip(cu_host[:-1], cu_host[1:])]
        return Q, q_mask, choice, prepared

    def score_chunk(self, batch, queries, chunk, segment, start, stop, token_base, *, device, codec):
        Q, q_mask, choice, prepared = batch
        layout = segment.lookup_on(device) if choice is not None else None
        if layout is not None:  # the tokens on the host, their layout on this GPU
            return self.lookup_scores(Q, q_mask, layout, codec, choice, (start, stop))
        segment.check_scales()
        return score_quantized_chunk(prepared, chunk[0], chunk[1], segment.offsets, start, stop, token_base,
                                     cu_d=segment.offsets_on(device), max_d=segment.longest)

    # -- the one-byte scorer of a corpus held as its layout on a GPU (lookup_only) ---------------
    def lookup_choice(self, Q, q_mask, codec):
        from maxsim.compressed.scoring import onebyte_lookup_scorer

        return onebyte_lookup_scorer(Q, q_mask)

    def lookup_scores(self, Q, q_mask, layout, codec, choice, docs):
        from maxsim.compressed.scoring import onebyte_lookup_scores

        return onebyte_lookup_scores(Q, q_mask, layout, choice, docs=docs)

    def build_lookup(self, codec, parts, cu):
        from maxsim.compressed.onebyte_gluon import DIM, build_layout

        if parts[0].shape[1] != DIM:
            raise ValueError(f"maxsim: the one-byte scorer's layout holds d={DIM} tokens, not d={parts[0].shape[1]}: "
                             "keep the corpus on the GPU as it is (.to('cuda'))")
        return build_layout(parts[0], parts[1], cu)


class _Coded(Encoding):
    """Codes of a corpus-level codec (residual, PQ): the codec's tables are stored once a corpus."""

    has_codec = True
    has_lookup = True
    format_version = 3
    main_part = "codes"
    codec_type: type
    # (table, required) the corpus file stores
    codec_files: tuple = ()

    def encode(self, embeddings, codec=None):
        self.check_codec(codec)
        if codec is None:
            codec = self.train_codec(embeddings)
        if codec.dim != int(embeddings.shape[1]):
            raise ValueError(f"maxsim: the tokens have d={int(embeddings.shape[1])} but the {self} codec has "
                             f"d={codec.dim}")
        if codec.device != embeddings.device:
            codec = codec.to(embeddings.device)
        return self._encode(embeddings, codec) + (codec,)

    def train_codec(self, tokens: torch.Tensor, *, num_centroids: int | None = None, progress=None):
        raise NotImplementedError

    def tables(self, codec) -> dict:
        """The codec's tables as the corpus file stores them (``{name: numpy array}``)."""
        raise NotImplementedError

    def codec_from_tables(self, tables: dict):
        raise NotImplementedError

    def codec_entry(self, tables: dict) -> dict:
        """The manifest's "codec" entry of ``tables`` (without its files)."""
        raise NotImplementedError

    def check_codec_entry(self, entry: dict, dim) -> bool:
        """Whether a manifest's "codec" entry fits codes of this encoding and ``dim``."""
        raise NotImplementedError

    def table_shapes(self, entry: dict, dim: int) -> dict:
        """``{table: (shape or None, allowed numpy dtypes)}`` of a checked codec entry."""
        raise NotImplementedError

    def check_tables(self, tables, dim: int) -> None:
        """Tables given to a write: the names and shapes this encoding stores."""
        self.check_table_names(tables)

    def check_table_names(self, tables) -> None:
        if not isinstance(tables, dict):
            raise ValueError(f"maxsim: a {self} corpus needs its codec's tables")
        known = {name for name, _ in self.codec_files}
        for name, required in self.codec_files:
            if required and name not in tables:
                raise ValueError(f"maxsim: the {self} codec's tables lack {name!r}")
        for name in tables:
            if name not in known:
                raise ValueError(f"maxsim: the {self} codec has no table {name!r}")

    def codec_dim(self, tables: dict) -> int:
        raise NotImplementedError

    def same_codec(self, a, b) -> bool:
        """The same codec: the same object, or equal tables (what decoding reads)."""
        if a is b:
            return True
        if type(a) is not type(b) or of_codec(a) != of_codec(b):
            return False
        return same_tables(self.tables(a), self.tables(b))

    # -- the look-up scorer of a resident corpus (a layout built once a segment) ------------------
    def lookup_choice(self, Q, q_mask, codec):
        """The look-up scorer's Choice for padded queries ``Q [Nq, Lq, d]``, or why not (a str)."""
        raise NotImplementedError

    def lookup_scores(self, Q, q_mask, layout, codec, choice, docs):
        """Scores ``[Nq, hi - lo]`` of documents ``docs = (lo, hi)`` of a segment's layout."""
        raise NotImplementedError

    def lookup_bytes(self, codec, num_tokens: int, num_docs: int) -> int:
        """An upper bound on the device bytes :meth:`build_lookup` takes at its peak."""
        raise NotImplementedError

    def build_lookup(self, codec, parts, cu):
        """A segment's look-up layout from its per-token ``parts`` and offsets ``cu`` (on the
        parts' device)."""
        raise NotImplementedError

    def query_batch(self, q, cu, longest, cu_host, *, codec, resident, layouts=False):
        Q, mask = packed_to_padded(q, cu, longest)  # the residual and PQ scorers take padded queries
        q_mask = None if bool(mask.all()) else mask
        choice = self.lookup_choice(Q, q_mask, codec) if resident else None  # a resident corpus: the look-up
        return Q, q_mask, None if isinstance(choice, str) else choice

    def score_chunk(self, batch, queries, chunk, segment, start, stop, token_base, *, device, codec):
        Q, q_mask, choice = batch
        if choice is not None:
            # where the codes are: built the first time (None: it does not fit); codes held on the
            # host beside a layout on the device (Corpus.to(..., lookup_only=True)): that layout
            on_device = segment.embeddings.device == device
            layout = segment.lookup_layout(self, codec, device) if on_device else segment.lookup_on(device)
            if layout is not None:
                return self.lookup_scores(Q, q_mask, layout, codec, choice, (start, stop))
        t0, t1 = int(segment.offsets[start]), int(segment.offsets[stop])
        cu = chunk_offsets(segment.offsets_on(device), start, stop, t0)
        rows = slice(t0 - token_base, t1 - token_base)
        return self._score_rows(Q, q_mask, chunk, rows, cu, codec, segment.longest)  # [Nq, c]


class Residual(_Coded):
    """PLAID residual codes (``maxsim.compressed.ResidualCodec``): a centroid id (int32) and d * nbits
    / 8 packed residual bytes a token; scored against the decoded, L2-normalised tokens."""

    has_residuals = True
    stored_dtype = "int32"
    torch_dtype = torch.int32
    codec_type = ResidualCodec
    codec_files = (("centroids", True), ("bucket_weights", True), ("bucket_cutoffs", False), ("avg_residual", False))

    def __new__(cls, nbits: int):
        self = super().__new__(cls, f"residual{nbits}")
        self.nbits = nbits
        return self

    def row_shape(self, dim):
        return ()

    def residual_bytes(self, dim):
        return dim * self.nbits // 8

    def train_codec(self, tokens, *, num_centroids=None, progress=None):
        _check_training_tokens(tokens, self)
        if tokens.shape[1] % 8:
            raise ValueError(f"maxsim: {self} needs d to be a multiple of 8 (d * nbits / 8 residual bytes a "
                             f"token); the tokens have d={tokens.shape[1]}")
        if tokens.shape[0] == 0:
            raise ValueError(f"maxsim: cannot train a {self} codec on no tokens: pass codec=")
        return ResidualCodec.train(tokens, self.nbits, num_centroids=num_centroids)

    def _encode(self, embeddings, codec):
        if codec.bucket_cutoffs is None:
            raise ValueError(f"maxsim: this {self} codec has no bucket_cutoffs (one loaded without them decodes "
                             "but cannot encode): encode with a codec that has them")
        codes, residuals = codec.encode(embeddings)
        return codes, None, residuals

    def decode(self, main, scales, residuals, codec):
        return codec.decode(main, residuals, dtype=torch.float32)

    def tables(self, codec):
        centroids = codec.centroids.detach().cpu()
        tables = {"centroids": (centroids if centroids.dtype == torch.float16 else centroids.float()).contiguous().numpy(),
                  "bucket_weights": codec.bucket_weights.detach().cpu().float().contiguous().numpy()}
        if codec.bucket_cutoffs is not None:
            tables["bucket_cutoffs"] = codec.bucket_cutoffs.detach().cpu().float().contiguous().numpy()
        avg = codec.avg_residual
        if avg is not None:
            avg = avg.detach().cpu().float().numpy() if torch.is_tensor(avg) else np.asarray(avg)
            tables["avg_residual"] = np.ascontiguousarray(avg, dtype=np.float32)
        return tables

    def codec_from_tables(self, tables):
        optional = {name: torch.from_numpy(tables[name]) if name in tables else None
                    for name in ("bucket_cutoffs", "avg_residual")}
        return ResidualCodec(torch.from_numpy(tables["centroids"]), torch.from_numpy(tables["bucket_weights"]),
                             self.nbits, **optional)

    def codec_entry(self, tables):
        return {"kind": "residual", "nbits": self.nbits, "num_centroids": int(tables["centroids"].shape[0])}

    def check_codec_entry(self, entry, dim):
        count = entry.get("num_centroids")
        return (entry.get("kind") == "residual" and entry.get("nbits") == self.nbits and isinstance(count, int)
                and count >= 1 and isinstance(dim, int) and dim % 8 == 0)

    def table_shapes(self, entry, dim):
        count = entry["num_centroids"]
        return {"centroids": ((count, dim), (np.float16, np.float32)), "bucket_weights": ((1 << self.nbits,), (np.float32,)),
                "bucket_cutoffs": (((1 << self.nbits) - 1,), (np.float32,)), "avg_residual": (None, (np.float32,))}

    def check_tables(self, tables, dim):
        super().check_tables(tables, dim)
        if tables["centroids"].ndim != 2 or tables["centroids"].shape[1] != dim:
            raise ValueError(f"maxsim: {self} centroids must be [C, {dim}]")

    def codec_dim(self, tables):
        return int(tables["centroids"].shape[1])

    def lookup_choice(self, Q, q_mask, codec):
        from maxsim.compressed.scoring import lookup_scorer

        return lookup_scorer(Q, q_mask, codec)

    def lookup_scores(self, Q, q_mask, layout, codec, choice, docs):
        from maxsim.compressed.scoring import lookup_scores

        return lookup_scores(Q, q_mask, layout, codec, choice, docs=docs)

    def lookup_bytes(self, codec, num_tokens, num_docs):
        from maxsim.compressed.scoring import lookup_layout_bytes

        return lookup_layout_bytes(codec, num_tokens, num_docs)

    def build_lookup(self, codec, parts, cu):
        from maxsim.compressed.scoring import lookup_layout

        return lookup_layout(codec, parts[0], parts[1], cu)

    def _score_rows(self, Q, q_mask, chunk, rows, cu, codec, longest):
        from maxsim.compressed.scoring import maxsim_residual_varlen

        return maxsim_residual_varlen(Q, chunk[0][rows], chunk[1][rows], cu, codec, max_seqlen_d=longest,
                                      q_mask=q_mask)


class PQ(_Coded):
    """Product quantisation (``maxsim.compressed.ProductQuantizer``): m uint8 codes a token (m
    dividing d, 256 centroids a sub-space); scored against the decoded tokens."""

    stored_dtype = "uint8"
    torch_dtype = torch.uint8
    codec_type = ProductQuantizer
    codec_files = (("codebooks", True),)

    def __new__(cls, m: int):
        self = super().__new__(cls, f"pq{m}")
        self.m = m
        return self

    def row_shape(self, dim):
        return (self.m,)

    def train_codec(self, tokens, *, num_centroids=None, progress=None):
        _check_training_tokens(tokens, self)
        if num_centroids is not None:
            raise ValueError(f"maxsim: num_centroids is for residual encodings; a {self} codec has 256 a sub-space")
        total, d = tokens.shape
        if d % self.m:
            choices = ", ".join(f"pq{m}" for m in range(1, d + 1) if d % m == 0)
            raise ValueError(f"maxsim: {self} needs m={self.m} to divide d={d}: use one of {choices}")
        if total < PQ_CENTROIDS:
            raise ValueError(f"maxsim: training a {self} codec needs at least {PQ_CENTROIDS} tokens "
                             f"(one per centroid); got {total}: train it on more tokens and pass codec=")
        return ProductQuantizer.train(tokens, self.m, progress=progress)

    def _encode(self, embeddings, codec):
        return codec.encode(embeddings), None, None

    def decode(self, main, scales, residuals, codec):
        return codec.decode(main.to(codec.device))

    def tables(self, codec):
        return {"codebooks": codec.codebooks.detach().cpu().float().contiguous().numpy()}

    def codec_from_tables(self, tables):
        return ProductQuantizer(torch.from_numpy(tables["codebooks"]))

    def codec_entry(self, tables):
        return {"kind": "pq", "m": self.m}

    def check_codec_entry(self, entry, dim):
        return entry.get("kind") == "pq" and entry.get("m") == self.m and isinstance(dim, int) and dim % self.m == 0

    def table_shapes(self, entry, dim):
        return {"codebooks": ((self.m, PQ_CENTROIDS, dim // self.m), (np.float32,))}

    def check_tables(self, tables, dim):
        super().check_tables(tables, dim)
        if dim % self.m or tuple(tables["codebooks"].shape) != (self.m, PQ_CENTROIDS, dim // self.m):
            raise ValueError(f"maxsim: {self} codebooks must be [{self.m}, {PQ_CENTROIDS}, d / {self.m}] for d={dim}")

    def codec_dim(self, tables):
        return int(tables["codebooks"].shape[0] * tables["codebooks"].shape[2])

    def lookup_choice(self, Q, q_mask, codec):
        from maxsim.compressed.scoring import pq_lookup_scorer

        return pq_lookup_scorer(Q, q_mask, codec)

    def lookup_scores(self, Q, q_mask, layout, codec, choice, docs):
        from maxsim.compressed.scoring import pq_lookup_scores

        return pq_lookup_scores(Q, q_mask, layout, choice, docs=docs)

    def lookup_bytes(self, codec, num_tokens, num_docs):
        from maxsim.compressed.pq_lut import build_bytes

        return build_bytes(num_tokens, num_docs, codec.m)

    def build_lookup(self, codec, parts, cu):
        from maxsim.compressed.pq_lut import build_layout

        return build_layout(codec, parts[0], cu)

    def _score_rows(self, Q, q_mask, chunk, rows, cu, codec, longest):
        from maxsim.compressed.pq import maxsim_pq_varlen

        return maxsim_pq_varlen(Q, chunk[0][rows], cu, codec, q_mask=q_mask)


def _check_training_tokens(tokens, enc) -> None:
    if not torch.is_tensor(tokens) or not tokens.is_floating_point() or tokens.dim() != 2:
        raise TypeError(f"maxsim: a {enc} codec is trained on float tokens [T, d]")


# The documented encodings (the index command's --encoding choices): any "pq<m>" with m dividing d
# is one too (pq32 stands for the family), and residual1 / residual8 (colbert-ai and fast-plaid
# widths) are read and written.
DOCUMENTED = ("float16", "bfloat16", "float32", "int8", "fp8", "residual2", "residual4", "pq32")
RESIDUAL_BITS = (1, 2, 4, 8)


# Every fixed name (the pq<m> family aside), in the order --help lists them.
NAMES = tuple(Float._DTYPES) + tuple(OneByte._FORMATS) + tuple(f"residual{b}" for b in RESIDUAL_BITS)


def parse(name) -> Encoding | None:
    """The Encoding a name means, or None when it names none."""
    if isinstance(name, Encoding):
        return name
    if not isinstance(name, str):
        return None
    if name in Float._DTYPES:
        return Float(name)
    if name in OneByte._FORMATS:
        return OneByte(name)
    if name.startswith("residual") and name[8:] in {str(b) for b in RESIDUAL_BITS}:
        return Residual(int(name[8:]))
    digits = name[2:]
    if name.startswith("pq") and digits.isdigit() and digits.isascii() and not digits.startswith("0"):
        return PQ(int(digits))
    return None


def encoding(name) -> Encoding:
    """The Encoding named ``name`` (an Encoding passes through); a name that means none is one
    ValueError listing the choices."""
    enc = parse(name)
    if enc is None:
        raise ValueError(f"maxsim: encoding must be one of {', '.join(DOCUMENTED)}, residual1, residual8 or pq<m> "
                         f"(m dividing d) (or None: the input's dtype); got {name!r}")
    return enc


def of_codec(codec) -> Encoding:
    """The encoding a codec writes: residual<nbits> for a ResidualCodec, pq<m> for a ProductQuantizer."""
    if isinstance(codec, ResidualCodec):
        return Residual(codec.nbits)
    if isinstance(codec, ProductQuantizer):
        return PQ(codec.m)
    raise TypeError(f"maxsim: codec must be a maxsim.compressed.ResidualCodec or ProductQuantizer; "
                    f"got {type(codec).__name__}")


def of_dtype(dtype: torch.dtype) -> Encoding:
    """The float encoding of a float dtype."""
    return Float(str(dtype).replace("torch.", ""))


def train_codec(tokens: torch.Tensor, name, *, num_centroids: int | None = None, progress=None):
    """A codec for the encoding ``name`` trained on the float ``tokens [T, d]`` (on their device),
    with the library's defaults: residual<nbits> -> ``ResidualCodec.train(tokens, nbits,
    num_centroids=)`` (colbert-ai's recipe and, by default, centroid count, on a sample of the
    tokens); pq<m> -> ``ProductQuantizer.train(tokens, m, progress=progress)`` (k-means on a
    sample of 65536 tokens; a tqdm bar per ``progress``)."""
    enc = encoding(name)
    if not enc.has_codec:
        raise ValueError(f"maxsim: {str(enc)!r} has no codec to train (residual<nbits> or pq<m> have)")
    return enc.train_codec(tokens, num_centroids=num_centroids, progress=progress)


def same_tables(stored: dict, given: dict) -> bool:
    """The tables decoding reads (centroids and bucket weights, or codebooks) are equal, dtype and
    bits."""
    for name in ("centroids", "bucket_weights", "codebooks"):
        if (name in stored) != (name in given):
            return False
        if name in stored:
            a, b = np.asarray(stored[name]), np.asarray(given[name])
            if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
                return False
    return True


__all__ = ["Encoding", "Float", "OneByte", "Residual", "PQ", "encoding", "parse", "of_codec", "of_dtype",
           "train_codec", "DOCUMENTED", "NAMES"]
