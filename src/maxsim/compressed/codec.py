"""PLAID residual codec, bit-exact with colbert-ai 0.2.22 (and fast-plaid, which uses its layout).

A token embedding x [d] is stored as
  code      = argmax_c <centroids[c], x>          (first index on ties)
  bucket[f] = #{cutoffs strictly below x[f] - centroids[code][f]}   in [0, 2**nbits)
and the buckets are packed into d * nbits / 8 bytes: bit j (LSB first) of dimension f's bucket is
stream bit f * nbits + j, and stream bit p is bit 7 - p % 8 of byte p // 8 (numpy ``packbits``
order). Decoding is centroids[code] + bucket_weights[bucket], then an optional L2 normalisation.

colbert-ai has two decoders that differ in rounding: its CPU path adds in fp32; its CUDA path (and
fast-plaid) rounds centroids and bucket weights to fp16 and adds in fp16 (one rounding of the fp32
sum). ``decode(dtype=torch.float32)`` is the first, ``dtype=torch.float16`` the second.
"""

from __future__ import annotations

import json
import math
import os

import torch

from ._fixed import fixed_point_scale

_SUPPORTED_NBITS = (1, 2, 4, 8)
_DECODE_DTYPES = (torch.float16, torch.float32)
# Bound on the temporary memory of encode/decode (bytes of the widest scratch tensor per chunk).
_CHUNK_BYTES = 64 << 20
# On a GPU a larger block: with 2**17 centroids 64 MB is 128 tokens a step, and the loop, not the
# product, would set the pace.
_CUDA_CHUNK_BYTES = 1 << 30


def _unpack_table(nbits: int, device) -> torch.Tensor:
    """[256, 8 // nbits] int64: bucket of each of the dimensions that one residual byte holds."""
    per_byte = 8 // nbits
    byte = torch.arange(256, dtype=torch.int64)
    table = torch.zeros(256, per_byte, dtype=torch.int64)
    for k in range(per_byte):  # k-th dimension inside the byte
        for j in range(nbits):  # bit j (LSB first) of its bucket is stream bit k * nbits + j
            table[:, k] |= ((byte >> (7 - (k * nbits + j))) & 1) << j
    return table.to(device)


class ResidualCodec:
    """Centroid code + nbits-per-dimension residual, as colbert-ai / fast-plaid store it.

    centroids [C, d] float, bucket_weights [2**nbits] float, nbits in {1, 2, 4, 8};
    bucket_cutoffs [2**nbits - 1] (needed by ``encode`` only), avg_residual (kept, unused).
    d must be a multiple of 8 (colbert-ai's packed width is d // 8 * nbits bytes).
    """

    def __init__(self, centroids, bucket_weights, nbits, *, bucket_cutoffs=None, avg_residual=None):
        if isinstance(nbits, bool) or not isinstance(nbits, int) or nbits not in _SUPPORTED_NBITS:
            raise ValueError(f"nbits must be one of {_SUPPORTED_NBITS}, got {nbits!r}")
        if not torch.is_tensor(centroids) or centroids.dim() != 2 or not centroids.is_floating_point():
            raise ValueError(
                "centroids must be a floating-point tensor of shape [C, d], got "
                f"{type(centroids).__name__}{tuple(centroids.shape) if torch.is_tensor(centroids) else ''}"
            )
        if centroids.shape[0] == 0:
            raise ValueError("centroids must hold at least one centroid")
        dim = centroids.shape[1]
        if dim == 0 or dim % 8 != 0:
            raise ValueError(
                f"centroids' dimension d={dim} is not a positive multiple of 8: colbert-ai packs "
                "d // 8 * nbits residual bytes per token and cannot hold it"
            )
        n_buckets = 1 << nbits
        if not torch.is_tensor(bucket_weights) or not bucket_weights.is_floating_point() \
                or tuple(bucket_weights.shape) != (n_buckets,):
            raise ValueError(
                f"bucket_weights must be a floating-point tensor of shape [{n_buckets}] for nbits={nbits}, got "
                f"{tuple(bucket_weights.shape) if torch.is_tensor(bucket_weights) else type(bucket_weights).__name__}"
            )
        if bucket_cutoffs is not None:
            if not torch.is_tensor(bucket_cutoffs) or not bucket_cutoffs.is_floating_point() \
                    or tuple(bucket_cutoffs.shape) != (n_buckets - 1,):
                raise ValueError(
                    f"bucket_cutoffs must be a floating-point tensor of shape [{n_buckets - 1}] for "
                    f"nbits={nbits}, got "
                    f"{tuple(bucket_cutoffs.shape) if torch.is_tensor(bucket_cutoffs) else type(bucket_cutoffs).__name__}"
                )
            bucket_cutoffs = bucket_cutoffs.to(centroids.device)
        self.nbits = nbits
        self.dim = dim
        self.packed_dim = dim // 8 * nbits
        self.centroids = centroids
        self.bucket_weights = bucket_weights.to(centroids.device)
        self.bucket_cutoffs = bucket_cutoffs
        self.avg_residual = avg_residual
        self._tables: dict = {}

    # ------------------------------------------------------------------ construction
    @property
    def device(self) -> torch.device:
        return self.centroids.device

    @property
    def num_centroids(self) -> int:
        return self.centroids.shape[0]

    def to(self, device) -> "ResidualCodec":
        """A copy of the codec with its tensors on ``device``."""
        avg = self.avg_residual.to(device) if torch.is_tensor(self.avg_residual) else self.avg_residual
        return ResidualCodec(
            self.centroids.to(device), self.bucket_weights.to(device), self.nbits,
            bucket_cutoffs=None if self.bucket_cutoffs is None else self.bucket_cutoffs.to(device),
            avg_residual=avg,
        )

    def __repr__(self):
        return (f"ResidualCodec(C={self.num_centroids}, d={self.dim}, nbits={self.nbits}, "
                f"device={self.device})")

    @classmethod
    def train(cls, x, nbits, *, num_centroids=None, centroids=None, iterations=4, sample=None,
              seed=0) -> "ResidualCodec":
        """A codec for the tokens ``x [T, d]`` (unit-norm, as ColBERT models write them), trained on
        x's device as colbert-ai trains one: ``num_centroids`` centroids (default
        ``2**floor(log2(16 sqrt(T)))``, colbert-ai's count, at most T) by spherical k-means
        (``iterations`` Lloyd steps from a random start) on a random ``sample`` of the tokens
        (default ``256 * C``, fast-plaid's points per centroid), then bucket cutoffs at the
        ``i / 2**nbits`` quantiles of the residuals' values and weights at the buckets' middles.
        ``centroids [C, d]``: use these and fit the buckets only. The same codec for a seed on the
        same kind of device (cluster sums are fixed-point integer sums, exact in any order); on CUDA
        the sample is assigned to centroids with fp16 products (the fused kernel, 4x the fp32 rate),
        where a near-tie can go the other way than on the CPU.

            codec = ResidualCodec.train(tokens, nbits=2)
            codes, residuals = codec.encode(tokens)
        """
        if not torch.is_tensor(x) or x.dim() != 2 or not x.is_floating_point() or x.shape[0] == 0:
            raise ValueError(f"x must be a floating-point tensor [T, d] with T >= 1, got "
                             f"{tuple(x.shape) if torch.is_tensor(x) else type(x).__name__}")
        if isinstance(nbits, bool) or nbits not in _SUPPORTED_NBITS:
            raise ValueError(f"nbits must be one of {_SUPPORTED_NBITS}, got {nbits!r}")
        for name, value, lowest in (("iterations", iterations, 0), ("sample", sample, 1),
                                    ("num_centroids", num_centroids, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lowest):
                raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")
        if not bool(torch.isfinite(x).all()):
            raise ValueError("x holds a NaN or an infinity: a codec trained on it would encode nothing")
        total, generator = x.shape[0], torch.Generator().manual_seed(seed)
        if centroids is None:
            count = num_centroids or 2 ** int(math.floor(math.log2(16 * math.sqrt(total))))
            count = min(count, total)
            points = _sample_rows(x, sample or 256 * count, generator)
            centroids = _spherical_kmeans(points, count, iterations, generator)
        else:
            if not torch.is_tensor(centroids) or centroids.dim() != 2 or centroids.shape[1] != x.shape[1]:
                raise ValueError(f"centroids must be [C, {x.shape[1]}], got "
                                 f"{tuple(centroids.shape) if torch.is_tensor(centroids) else type(centroids).__name__}")
            centroids = centroids.to(x.device, torch.float32)
            points = _sample_rows(x, sample or 256 * centroids.shape[0], generator)
        nearest = _nearest(_assignable(points), centroids)  # [n]
        if points.numel() > 1 << 23:  # torch.quantile takes at most 2**24 elements: 2**23 drawn at random
            # (with replacement: a permutation of 2**17 centroids' 33.5M-point sample would be 4.3G indices),
            # each computed alone: the whole [n, d] residual and its gather would be 2 x 17 GB there.
            picked = torch.randint(points.numel(), (1 << 23,), generator=generator).to(x.device)  # [2**23]
            row, col = picked // points.shape[1], picked % points.shape[1]
            residual = points[row, col] - centroids[nearest[row], col]
        else:
            residual = (points - centroids[nearest]).flatten()
        levels = torch.arange(1 << nbits, dtype=torch.float32, device=x.device) / (1 << nbits)
        cutoffs = residual.quantile(levels[1:])
        weights = residual.quantile(levels + 0.5 / (1 << nbits))
        return cls(centroids, weights, nbits, bucket_cutoffs=cutoffs)

    @classmethod
    def from_colbert(cls, index_dir) -> "ResidualCodec":
        """Read centroids.pt, buckets.pt, avg_residual.pt and metadata.json of a colbert-ai index."""
        index_dir = os.fspath(index_dir)
        nbits, dim = _colbert_nbits_dim(index_dir)
        centroids = _torch_load(os.path.join(index_dir, "centroids.pt"))
        buckets = _torch_load(os.path.join(index_dir, "buckets.pt"))
        if not (isinstance(buckets, (tuple, list)) and len(buckets) == 2 and all(torch.is_tensor(b) for b in buckets)):
            raise ValueError(f"{os.path.join(index_dir, 'buckets.pt')} must hold (bucket_cutoffs, bucket_weights)")
        cutoffs, weights = buckets
        avg_path = os.path.join(index_dir, "avg_residual.pt")
        avg = _torch_load(avg_path) if os.path.exists(avg_path) else None
        if not torch.is_tensor(centroids) or centroids.dim() != 2 or centroids.shape[1] != dim:
            raise ValueError(
                f"{os.path.join(index_dir, 'centroids.pt')} holds shape "
                f"{tuple(centroids.shape) if torch.is_tensor(centroids) else type(centroids).__name__}, "
                f"metadata.json says dim={dim}"
            )
        try:
            return cls(centroids, weights, nbits, bucket_cutoffs=cutoffs, avg_residual=avg)
        except ValueError as err:
            raise ValueError(f"colbert-ai index {index_dir}: {err}") from None

    @classmethod
    def from_fast_plaid(cls, index_dir) -> "ResidualCodec":
        """Read centroids.npy, bucket_weights.npy, bucket_cutoffs.npy, avg_residual.npy, metadata.json."""
        import numpy as np

        index_dir = os.fspath(index_dir)
        meta_path = os.path.join(index_dir, "metadata.json")
        meta = _read_json(meta_path)
        if "nbits" not in meta:
            raise ValueError(f"{meta_path} has no 'nbits'")

        def npy(name, required=True):
            path = os.path.join(index_dir, name)
            if not os.path.exists(path):
                if required:
                    raise FileNotFoundError(f"fast-plaid index file missing: {path}")
                return None
            try:
                return torch.from_numpy(np.load(path))
            except Exception as err:
                raise ValueError(f"cannot read {path}: {err}") from None

        centroids = npy("centroids.npy")
        weights = npy("bucket_weights.npy")
        cutoffs = npy("bucket_cutoffs.npy", required=False)
        avg = npy("avg_residual.npy", required=False)
        try:
            return cls(centroids, weights, int(meta["nbits"]), bucket_cutoffs=cutoffs, avg_residual=avg)
        except ValueError as err:
            raise ValueError(f"fast-plaid index {index_dir}: {err}") from None

    # ------------------------------------------------------------------ decode
    def _table(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._tables:
            self._tables[key] = _unpack_table(self.nbits, device)
        return self._tables[key]

    def _check_compressed(self, codes, residuals, codes_name="codes", residuals_name="residuals"):
        if not torch.is_tensor(codes) or codes.dtype.is_floating_point or codes.dtype == torch.bool \
                or codes.is_complex():
            raise TypeError(f"{codes_name} must be an integer tensor, got "
                            f"{codes.dtype if torch.is_tensor(codes) else type(codes).__name__}")
        if not torch.is_tensor(residuals) or residuals.dtype != torch.uint8:
            raise TypeError(f"{residuals_name} must be a uint8 tensor, got "
                            f"{residuals.dtype if torch.is_tensor(residuals) else type(residuals).__name__}")
        if residuals.shape[-1:] != (self.packed_dim,) or tuple(residuals.shape[:-1]) != tuple(codes.shape):
            raise ValueError(
                f"{residuals_name} must have shape {tuple(codes.shape) + (self.packed_dim,)} "
                f"({codes_name}.shape + (d * nbits / 8,)), got {tuple(residuals.shape)}"
            )

    def decode(self, codes, residuals, *, normalize=True, dtype=torch.float16) -> torch.Tensor:
        """codes [...] int, residuals [..., packed_dim] uint8 -> embeddings [..., d] in ``dtype``.

        dtype=torch.float32: colbert-ai's CPU decode (fp32 add); dtype=torch.float16: its CUDA
        decode and fast-plaid's (fp16 centroids and weights, fp16 sum, fp16 normalisation with an
        fp16-rounded norm). Runs on the codec's device (inputs are moved there).
        """
        if dtype not in _DECODE_DTYPES:
            raise ValueError(f"dtype must be torch.float16 or torch.float32, got {dtype}")
        self._check_compressed(codes, residuals)
        lead_shape = tuple(codes.shape)
        codes = codes.reshape(-1)
        residuals = residuals.reshape(-1, self.packed_dim)
        total = codes.shape[0]
        out = torch.empty(total, self.dim, dtype=dtype, device=self.device)
        if total:
            _check_code_range(codes, self.num_centroids, "codes")
        rows = max(1, _CHUNK_BYTES // (8 * self.dim))
        for start in range(0, total, rows):
            stop = min(total, start + rows)
            out[start:stop] = self._decode_rows(
                codes[start:stop].to(self.device), residuals[start:stop].to(self.device), normalize, dtype)
        return out.reshape(*lead_shape, self.dim)

    def _decode_rows(self, codes, residuals, normalize, dtype):
        buckets = self._table(residuals.device)[residuals.long()].reshape(residuals.shape[0], self.dim)  # [n, d]
        centroids = self.centroids.to(dtype).float()[codes.long()]  # [n, d]
        weights = self.bucket_weights.to(dtype).float()[buckets]  # [n, d]
        # fp32 sum of two values of `dtype`, rounded once to `dtype`: what both colbert-ai decoders do
        x = (centroids + weights).to(dtype)
        if not normalize:
            return x
        if dtype == torch.float16:
            norm = x.float().norm(dim=-1, keepdim=True).clamp_min(1e-12).to(torch.float16)  # fp16-rounded norm
            return (x.float() / norm.float()).to(torch.float16)
        return torch.nn.functional.normalize(x, p=2, dim=-1)

    # ------------------------------------------------------------------ encode
    def encode(self, x, *, dtype=torch.float32):
        """x [T, d] -> (codes [T] int32, residuals [T, packed_dim] uint8).

        dtype=torch.float32 follows colbert-ai's CPU indexer (fp32 scores and residuals),
        dtype=torch.float16 its CUDA indexer (fp16 centroids, scores and residuals).
        """
        if self.bucket_cutoffs is None:
            raise ValueError("encode needs bucket_cutoffs: construct the codec with bucket_cutoffs=")
        if dtype not in _DECODE_DTYPES:
            raise ValueError(f"dtype must be torch.float16 or torch.float32, got {dtype}")
        if not torch.is_tensor(x) or not x.is_floating_point() or x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"x must be a floating-point tensor of shape [T, {self.dim}], got "
                             f"{tuple(x.shape) if torch.is_tensor(x) else type(x).__name__}")
        total = x.shape[0]
        codes = torch.empty(total, dtype=torch.int32, device=self.device)
        residuals = torch.empty(total, self.packed_dim, dtype=torch.uint8, device=self.device)
        centroids = self.centroids.to(dtype)
        cutoffs = self.bucket_cutoffs.float()
        bit_shifts = torch.arange(self.nbits, device=self.device, dtype=torch.int64)  # [nbits]
        byte_weights = (1 << torch.arange(7, -1, -1, device=self.device, dtype=torch.int64))  # [8], MSB first
        fused = _fused_assignment(self.device)
        budget = _CUDA_CHUNK_BYTES if self.device.type == "cuda" else _CHUNK_BYTES
        rows = max(1, budget // (8 * self.dim * self.nbits))  # the bit planes: int64 [n, d, nbits]
        if not fused:  # and the [C, n] scores
            rows = max(1, min(rows, budget // (4 * self.num_centroids)))
        for start in range(0, total, rows):
            stop = min(total, start + rows)
            batch = x[start:stop].to(self.device, dtype)  # [n, d]
            if fused:  # the scores never leave the chip: max and argmax fused into the product
                chunk_codes = _nearest(batch, centroids)  # [n]
            else:  # the same product and reduction as colbert-ai (centroids @ batch.T, max over dim 0)
                chunk_codes = (centroids @ batch.T).max(dim=0).indices  # [n]
            residual = batch - centroids[chunk_codes]  # [n, d] in `dtype`
            buckets = torch.bucketize(residual.float(), cutoffs).to(torch.int64)  # [n, d]
            bits = (buckets.unsqueeze(-1) >> bit_shifts) & 1  # [n, d, nbits], bit j LSB first
            bits = bits.reshape(stop - start, self.packed_dim, 8)  # the stream, 8 bits a byte
            residuals[start:stop] = (bits * byte_weights).sum(-1).to(torch.uint8)
            codes[start:stop] = chunk_codes.to(torch.int32)
        return codes, residuals


# ---------------------------------------------------------------------- helpers
def _sample_rows(x, count, generator):
    """Up to ``count`` random rows of x, fp32 and unit-norm, on x's device."""
    rows = torch.randperm(x.shape[0], generator=generator)[:count].to(x.device)
    return torch.nn.functional.normalize(x[rows].float(), dim=-1)


# Scores held at once while assigning points to centroids (fp32 elements).
_ASSIGN_BLOCK = 1 << 26

# Sample rows converted to fixed point at once by k-means (16 bytes a value while converting).
_FIXED_BLOCK = 1 << 20


# The fused assignment: points per "query" of the packed MaxSim kernel, and per launch (bounds
# the argmax buffer and the points' copy in the kernel's dtype).
_FUSED_QUERY_ROWS = 128
_FUSED_BLOCK = 1 << 22


def _fused_assignment(device) -> bool:
    """Whether points are assigned on ``device`` by the packed MaxSim kernel with its argmax (the
    [n, C] scores never written: with 2**17 centroids they are 512 KB a point): on CUDA, and in
    Triton's interpreter under MAXSIM_BACKEND=triton."""
    from maxsim._dispatch import backend_for

    return backend_for(torch.device(device)) == "triton"


def _assignable(points):
    """The training sample as :func:`_nearest` assigns it: fp16 for the fused kernel, as it is elsewhere."""
    return points.half() if _fused_assignment(points.device) else points


def _nearest(points, centroids):
    """Index [n] int64 of each point's highest-scoring centroid (the lowest index on ties).

    On CUDA the packed MaxSim kernel with its argmax: the points as queries of
    ``_FUSED_QUERY_ROWS`` tokens, the centroids as one document; fp32 inputs take the
    split-precision product (tf32x3, fp32-accurate), 16-bit inputs exact products. Elsewhere
    ``points @ centroids.T`` and ``argmax``, in blocks of points."""
    if not _fused_assignment(points.device):
        step = max(1, _ASSIGN_BLOCK // centroids.shape[0])
        return torch.cat([(points[i:i + step] @ centroids.T).argmax(dim=1)
                          for i in range(0, points.shape[0], step)])
    from maxsim.selection import varlen as select
    from maxsim.varlen.forward import varlen_forward

    n, count = points.shape[0], centroids.shape[0]
    dtype = points.dtype if points.dtype in (torch.float16, torch.bfloat16) else torch.float32
    table = centroids.to(dtype).contiguous()  # [C, d]: one document
    cu_d = torch.tensor([0, count], dtype=torch.int64, device=points.device)
    codes = torch.empty(n, dtype=torch.int64, device=points.device)
    for start in range(0, n, _FUSED_BLOCK):
        block = points[start:start + _FUSED_BLOCK].to(dtype).contiguous()  # [m, d]
        m = block.shape[0]
        num_queries = -(-m // _FUSED_QUERY_ROWS)
        cu_q = (torch.arange(num_queries + 1, dtype=torch.int64, device=points.device)
                * _FUSED_QUERY_ROWS).clamp_(max=m)
        choice = select.forward_choice(block, num_queries, _FUSED_QUERY_ROWS, False, True)
        _, argmax = varlen_forward(block, table, cu_q, cu_d, _FUSED_QUERY_ROWS, save_argmax=True,
                                   config=choice.config, max_d=count, precision="tf32x3")  # [Nq, rows]
        codes[start:start + m] = argmax.reshape(-1)[:m]  # the last query's missing rows come last
    return codes


def _spherical_kmeans(points, count, iterations, generator):
    """points [n, d] unit -> [count, d] unit centroids: ``count`` points at random, then Lloyd steps
    (assign to the highest dot product, each centroid the normalised sum of its points; an empty
    cluster keeps its centroid). The sums are fixed-point integer sums (exact in any order)."""
    n = points.shape[0]
    centroids = points[torch.randperm(n, generator=generator)[:count].to(points.device)].clone()
    scale = fixed_point_scale(points, n, signed=True)
    assignable = _assignable(points)
    for _ in range(iterations):
        assign = _nearest(assignable, centroids)
        sums = torch.zeros(count, points.shape[1], dtype=torch.int64, device=points.device)
        # Row blocks: all n points in int64 plus their float64 copy would be 16 bytes a value
        # (67 GB for 2**17 centroids' 33.5M-point sample), where the sums are the same block by block.
        for start in range(0, n, _FIXED_BLOCK):
            block = torch.round(points[start:start + _FIXED_BLOCK].double() * scale).to(torch.int64)  # [b, d]
            sums.index_add_(0, assign[start:start + _FIXED_BLOCK], block)
        filled = torch.bincount(assign, minlength=count) > 0
        centroids[filled] = torch.nn.functional.normalize(sums[filled].double(), dim=-1).float()
    return centroids


def _check_code_range(codes, num_centroids, name):
    lo, hi = int(codes.min()), int(codes.max())
    if lo < 0 or hi >= num_centroids:
        raise ValueError(f"{name} hold centroid ids in [{lo}, {hi}], outside [0, {num_centroids})")


def _read_json(path):
    if not os.path.exists(path):
        raise FileNotFoundError(f"index file missing: {path}")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None


def _torch_load(path, *, mmap=False):
    if not os.path.exists(path):
        raise FileNotFoundError(f"colbert-ai index file missing: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except RuntimeError as err:
        if mmap and "mmap" in str(err):  # legacy (non-zip) torch.save format cannot be mapped
            return _torch_load(path)
        raise ValueError(f"cannot read {path}: {err}") from None
    except Exception as err:
        raise ValueError(f"cannot read {path}: {err}") from None


def _colbert_nbits_dim(index_dir):
    meta_path = os.path.join(index_dir, "metadata.json")
    meta = _read_json(meta_path)
    config = meta.get("config", meta)
    if "nbits" not in config or "dim" not in config:
        raise ValueError(f"{meta_path} has no config.nbits / config.dim")
    return int(config["nbits"]), int(config["dim"])
