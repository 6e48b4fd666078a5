"""Product-quantised corpora: a PQ codec (k-means per sub-space) and MaxSim through a look-up table.

A :class:`ProductQuantizer` cuts each d-dimensional token into ``m`` sub-vectors of ``d // m``
dimensions and stores each as the index (one byte) of the nearest of 256 centroids of its
sub-space: a token costs ``m`` bytes instead of ``2 d``.

Scoring never decodes the corpus. Per query it builds the look-up table

    lut[q, i, j, c] = <Q[q, i, j-th sub-vector], codebooks[j, c]>          # [Nq, Lq, m, 256] fp32

so that a query token's similarity to a document token is ``sum_j lut[q, i, j, codes[t, j]]``
(exactly the dot product with the decoded token, up to fp32 rounding), then takes the max over the
document's real tokens and sums over query tokens (the exclude rule: padding never wins, masked
query tokens add nothing, empty documents score 0). That path is PyTorch: it runs on CPU and
CUDA tensors alike, a bounded chunk of documents at a time, and carries gradients.

Packed documents on the Triton backend (CUDA) without a gradient take the packed stream kernel
instead (:mod:`maxsim.varlen.stream`): each tile of tokens is decoded on chip (a dimension's code,
then its centroid's coordinate, from codebooks in Q's dtype held in L1 / L2) and multiplied on
the tensor cores, with no look-up table in memory (docs/pq.md).
"""

from __future__ import annotations

import os
import secrets
import zipfile
import zlib

import numpy as np
import torch

from maxsim._dispatch import backend_for
from maxsim._progress import progress_bar

from ._fixed import fixed_point as _fixed_point
from ._inputs import check_chunk_documents, check_cu_seqlens, check_d_mask, check_q_mask, check_query

NUM_CENTROIDS = 256  # per sub-space: one uint8 code
FORMAT_NAME = "maxsim-product-quantizer"
FORMAT_VERSION = 1
# Scratch budget of one chunk: the fp32 similarities [Nq * Lq, tokens] of a chunk of documents,
# a block of look-up tables, one chunk of k-means distances or of encode differences.
_SCRATCH_BYTES = 64 << 20
# On a GPU more rows a step: 64 MB is 1,024 tokens of 32 sub-spaces, and each step reads a flag
# on the host, so the steps, not the work, would set the pace.
_CUDA_SCRATCH_BYTES = 1 << 30
# k-means++ seeds on at most this many training points (the Lloyd iterations see them all).
_SEEDING_POINTS = 16384


class PQFormatError(ValueError):
    """A product quantizer file that cannot be read: truncated, corrupted, another format or version."""


# ---------------------------------------------------------------------- the quantizer
class ProductQuantizer:
    """m sub-spaces of ``d // m`` dimensions, 256 centroids each.

    codebooks [m, 256, d // m] float (kept as fp32, contiguous). Encode/decode run on the device
    of their input (the codebooks, 256·d floats, are copied there once and cached).
    """

    def __init__(self, codebooks):
        if not torch.is_tensor(codebooks) or not codebooks.is_floating_point() or codebooks.dim() != 3:
            raise ValueError(
                "maxsim: codebooks must be a floating-point tensor of shape [m, 256, d // m], got "
                f"{type(codebooks).__name__}{tuple(codebooks.shape) if torch.is_tensor(codebooks) else ''}"
            )
        m, num_centroids, sub_dim = codebooks.shape
        if m < 1 or sub_dim < 1 or num_centroids != NUM_CENTROIDS:
            raise ValueError(f"maxsim: codebooks must have shape [m >= 1, {NUM_CENTROIDS}, d // m >= 1], got "
                             f"{tuple(codebooks.shape)}")
        codebooks = codebooks.detach().to(torch.float32).contiguous()
        if not bool(torch.isfinite(codebooks).all()):
            raise ValueError("maxsim: codebooks hold NaN or infinite values")
        self.codebooks = codebooks  # [m, 256, sub_dim] fp32
        self.m = m
        self.sub_dim = sub_dim
        self.dim = m * sub_dim
        self._copies: dict = {str(codebooks.device): codebooks}

    @property
    def device(self) -> torch.device:
        return self.codebooks.device

    def to(self, device) -> "ProductQuantizer":
        """A copy of the quantizer with its codebooks on ``device``."""
        return ProductQuantizer(self.codebooks.to(device))

    def __repr__(self):
        return f"ProductQuantizer(m={self.m}, d={self.dim}, sub_dim={self.sub_dim}, device={self.device})"

    def codebooks_on(self, device) -> torch.Tensor:
        """The codebooks [m, 256, sub_dim] fp32 on ``device`` (copied once per device)."""
        key = str(torch.device(device))
        if key not in self._copies:
            self._copies[key] = self.codebooks.to(device)
        return self._copies[key]

    # ------------------------------------------------------------------ training
    @classmethod
    def train(cls, x, m, *, iterations=20, sample=65536, seed=0, progress=None) -> "ProductQuantizer":
        """k-means (k-means++ seeding, then Lloyd iterations) in each of the m sub-spaces of x [T, d].

        Trains on ``sample`` tokens drawn at random without replacement (all of them when T is
        smaller), on x's device; a given seed gives the same codebooks on a given device. A
        cluster left empty is re-seeded with the point farthest from its centroid. Stops early
        when no assignment changes. ``progress``: a tqdm bar over the iterations (None: when stderr
        is a terminal and tqdm is installed; True / False: always / never).
        """
        if not torch.is_tensor(x) or not x.is_floating_point() or x.dim() != 2:
            raise ValueError(f"maxsim: x must be a floating-point tensor of shape [T, d], got "
                             f"{type(x).__name__}{tuple(x.shape) if torch.is_tensor(x) else ''}")
        _check_int("m", m, minimum=1)
        _check_int("iterations", iterations, minimum=0)
        _check_int("sample", sample, minimum=NUM_CENTROIDS)
        _check_int("seed", seed, minimum=None)
        total, dim = x.shape
        if dim % m != 0:
            raise ValueError(f"maxsim: x's dimension d={dim} is not a multiple of m={m}")
        if total < NUM_CENTROIDS:
            raise ValueError(f"maxsim: x must hold at least {NUM_CENTROIDS} tokens (one per centroid), got T={total}")
        generator = torch.Generator(device="cpu").manual_seed(seed)  # on the CPU: the same draws on any device
        if total > sample:
            rows = torch.randperm(total, generator=generator)[:sample]
            points = x[rows.to(x.device)]
        else:
            points = x
        points = points.to(torch.float32)
        if not bool(torch.isfinite(points).all()):
            raise ValueError("maxsim: x holds NaN or infinite values")
        sub_dim = dim // m
        points = points.reshape(-1, m, sub_dim).transpose(0, 1).contiguous()  # [m, n, sub_dim]
        centers = _kmeans_plus_plus(points, generator)
        previous = None
        bar = progress_bar(progress, iterations, "maxsim PQ k-means", "iteration")
        try:
            for _ in range(iterations):
                assignment, distance = _assign(points, centers)  # [m, n], [m, n]
                reseeded = _update(points, centers, assignment, distance)
                if bar is not None:
                    bar.update(1)
                if not reseeded and previous is not None and torch.equal(assignment, previous):
                    break
                previous = assignment
        finally:
            if bar is not None:
                bar.close()
        return cls(centers)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, x) -> torch.Tensor:
        """x [..., d] float -> codes [..., m] uint8: the nearest centroid of each sub-space.

        Squared L2 distance from the differences, sum((x_j - c)²), lowest index on ties. On a CUDA
        device one kernel computes all 256 distances (:mod:`maxsim.compressed.pq_encode`); elsewhere
        the GEMM expansion |x|² - 2 x·c + |c|² only shortlists candidates. Runs on x's device.
        """
        if not torch.is_tensor(x) or not x.is_floating_point() or x.dim() < 1 or x.shape[-1] != self.dim:
            raise ValueError(f"maxsim: x must be a floating-point tensor of shape [T, {self.dim}], got "
                             f"{type(x).__name__}{tuple(x.shape) if torch.is_tensor(x) else ''}")
        lead_shape = tuple(x.shape[:-1])
        flat = x.reshape(-1, self.m, self.sub_dim)  # [T, m, sub_dim]
        if flat.shape[0] and not bool(torch.isfinite(flat).all()):
            raise ValueError("maxsim: x holds NaN or infinite values")
        codebooks = self.codebooks_on(x.device)
        if x.device.type == "cuda" and backend_for(x.device) == "triton":  # one fused kernel (pq_encode.py)
            from .pq_encode import pq_encode

            return pq_encode(flat.reshape(flat.shape[0], self.dim).contiguous(), codebooks).reshape(
                *lead_shape, self.m)
        codes = torch.empty(flat.shape[0], self.m, dtype=torch.uint8, device=x.device)
        scratch = _CUDA_SCRATCH_BYTES if x.device.type == "cuda" else _SCRATCH_BYTES
        rows = max(1, scratch // (4 * NUM_CENTROIDS * 2 * self.m))
        for start in range(0, flat.shape[0], rows):
            chunk = flat[start:start + rows].to(torch.float32)  # [n, m, sub_dim]
            codes[start:start + rows] = _nearest_centroids(chunk, codebooks).to(torch.uint8)
        return codes.reshape(*lead_shape, self.m)

    def decode(self, codes) -> torch.Tensor:
        """codes [..., m] (uint8, or integers in [0, 256)) -> tokens [..., d] fp32, on codes' device."""
        _check_codes(codes, self.m, "codes", None)
        if codes.dtype != torch.uint8 and codes.numel():
            _check_code_range(codes, "codes")
        return _decode(self.codebooks_on(codes.device), codes.long())

    # ------------------------------------------------------------------ files
    def save(self, path) -> None:
        """Write the codebooks to ``path`` (.npz: format name, format_version, codebooks).

        Written under a temporary name in the same folder and renamed over ``path``, so an
        interrupted save leaves a previous file intact.
        """
        path = os.fspath(path)
        arrays = {
            "format": np.array(FORMAT_NAME),
            "format_version": np.array(FORMAT_VERSION, dtype=np.int64),
            "codebooks": self.codebooks.cpu().numpy(),
        }
        tmp = f"{path}.tmp-{secrets.token_hex(6)}"
        try:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    @classmethod
    def load(cls, path, *, device=None) -> "ProductQuantizer":
        """Read a file written by :meth:`save` (codebooks onto ``device``, default CPU).

        A missing file is a FileNotFoundError; a truncated or corrupted file, another format or
        another format version is a ValueError naming the file.
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"maxsim: product quantizer file missing: {path}")
        try:
            stored = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as err:
            raise PQFormatError(f"maxsim: cannot read product quantizer file {path} (truncated or corrupted?): {err}") from None
        if not hasattr(stored, "files"):  # a bare .npy array, not an .npz archive
            raise PQFormatError(f"maxsim: {path} is not a maxsim product quantizer file (.npz expected)")
        try:
            with stored:
                fields = set(stored.files)
                if "format_version" not in fields or "format" not in fields:
                    raise PQFormatError(f"maxsim: {path} is not a maxsim product quantizer file: no format / "
                                        f"format_version field")
                name = str(stored["format"])
                version = stored["format_version"]
                if name != FORMAT_NAME:
                    raise PQFormatError(f"maxsim: {path} holds format {name!r}, not {FORMAT_NAME!r}")
                if version.shape != () or version.dtype.kind not in "iu":
                    raise PQFormatError(f"maxsim: {path} has a malformed format_version field")
                if int(version) != FORMAT_VERSION:
                    raise PQFormatError(f"maxsim: {path} has format_version {int(version)}; this maxsim reads "
                                        f"version {FORMAT_VERSION}")
                if "codebooks" not in fields:
                    raise PQFormatError(f"maxsim: {path} has no codebooks field")
                codebooks = torch.from_numpy(np.array(stored["codebooks"]))
        except PQFormatError:
            raise
        except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as err:
            raise PQFormatError(f"maxsim: cannot read product quantizer file {path} (truncated or corrupted?): {err}") from None
        try:
            quantizer = cls(codebooks)
        except ValueError as err:
            raise PQFormatError(f"maxsim: product quantizer file {path}: {err}") from None
        return quantizer if device is None else quantizer.to(device)


# ---------------------------------------------------------------------- k-means pieces
def _kmeans_plus_plus(points, generator):
    """points [m, n, s] fp32 -> centers [m, 256, s]: k-means++ seeding in every sub-space at once,
    on at most _SEEDING_POINTS of the points (a random subset).

    Each new center is a point drawn with probability proportional to its squared distance to
    the nearest center so far (inverse CDF of a uniform from ``generator``, so no device sync).
    """
    m, n, sub_dim = points.shape
    device = points.device
    if n > _SEEDING_POINTS:  # seeding costs 256 passes over its points: a random subset is enough
        subset = torch.randperm(n, generator=generator)[:_SEEDING_POINTS].to(device)
        points = points[:, subset]
        n = _SEEDING_POINTS
    centers = torch.empty(m, NUM_CENTROIDS, sub_dim, dtype=torch.float32, device=device)
    subspace = torch.arange(m, device=device)
    first = torch.randint(n, (m,), generator=generator).to(device)
    point_norms = points.square().sum(-1)  # [m, n]

    def squared_distance(center):  # center [m, s] -> [m, n]; the expansion is enough for sampling weights
        dots = torch.bmm(points, center.unsqueeze(-1)).squeeze(-1)  # [m, n]
        return (point_norms - 2 * dots + center.square().sum(-1, keepdim=True)).clamp_min_(0.0)

    centers[:, 0] = points[subspace, first]
    nearest = squared_distance(centers[:, 0])  # [m, n] squared distance to the nearest center so far
    uniforms = torch.rand(m, NUM_CENTROIDS, generator=generator, dtype=torch.float64).to(device)
    for c in range(1, NUM_CENTROIDS):
        cumulative = _fixed_point(nearest, n).cumsum(-1)  # [m, n] int64: exact, the same in any order
        target = (uniforms[:, c] * cumulative[:, -1].double()).to(torch.int64).unsqueeze(-1)  # [m, 1]
        # first point whose cumulative mass exceeds the target: never one at distance 0 unless all are
        pick = torch.searchsorted(cumulative, target, right=True).squeeze(-1).clamp_max(n - 1)  # [m]
        centers[:, c] = points[subspace, pick]
        torch.minimum(nearest, squared_distance(centers[:, c]), out=nearest)
    return centers


# Candidates per sub-space whose exact distance encode computes (the GEMM's shortlist).
_CANDIDATES = 4
# Unit roundoff of an fp32 GEMM under torch.set_float32_matmul_precision: IEEE fp32, TF32, bf16.
_GEMM_ROUNDOFF = {"highest": 2.0**-24, "high": 2.0**-11, "medium": 2.0**-8}


def _nearest_centroids(chunk, codebooks):
    """chunk [n, m, s] fp32, codebooks [m, 256, s] -> [n, m] int64: argmin_c sum((x_j - c)²), the first c
    on ties, exactly as the brute force over all 256 differences would choose.

    A GEMM shortlists the _CANDIDATES nearest by the expansion |c|² - 2 x·c; their exact distances
    decide (in index order, so a tie goes to the lowest index). Where the shortlist's last member
    is within the expansion's rounding bound of its first, more centroids could be the nearest:
    those rows are computed exactly over all 256.
    """
    n, m, sub_dim = chunk.shape
    points = chunk.transpose(0, 1)  # [m, n, s]
    center_norms = codebooks.square().sum(-1)  # [m, 256]
    approx = torch.baddbmm(center_norms.unsqueeze(1), points, codebooks.transpose(1, 2), alpha=-2.0)  # [m, n, 256]
    shortlist_values, shortlist = approx.topk(_CANDIDATES, dim=-1, largest=False, sorted=True)  # [m, n, k]
    shortlist_by_index = shortlist.sort(-1).values  # [m, n, k]
    subspace = torch.arange(m, device=chunk.device).view(m, 1, 1)
    candidates = codebooks[subspace, shortlist_by_index]  # [m, n, k, s]
    exact = (points.unsqueeze(2) - candidates).square().sum(-1)  # [m, n, k]
    nearest = shortlist_by_index.gather(-1, exact.argmin(-1, keepdim=True)).squeeze(-1)  # [m, n]
    # a bound on the expansion's rounding error (|x·c| <= (|x|² + |c|²) / 2), generously scaled
    scale = points.square().sum(-1) + center_norms.amax(-1, keepdim=True)  # [m, n]
    roundoff = _GEMM_ROUNDOFF.get(torch.get_float32_matmul_precision(), 2.0**-8)
    tolerance = (4 * sub_dim + 16) * roundoff * scale
    unsure = shortlist_values[..., -1] - shortlist_values[..., 0] <= 2 * tolerance  # [m, n]
    if bool(unsure.any()):
        which, row = unsure.nonzero(as_tuple=True)
        full = (points[which, row].unsqueeze(1) - codebooks[which]).square().sum(-1)  # [u, 256]
        nearest[which, row] = full.argmin(-1)
    return nearest.transpose(0, 1)


def _assign(points, centers):
    """Nearest center per point: (assignment [m, n] int64, squared distance [m, n] fp32).

    The |x|² - 2 x·c + |c|² expansion through batched GEMMs (training needs speed, not bitwise
    tie rules), a bounded chunk of points at a time.
    """
    m, n, _ = points.shape
    center_norms = centers.square().sum(-1).unsqueeze(1)  # [m, 1, 256]
    assignment = torch.empty(m, n, dtype=torch.int64, device=points.device)
    distance = torch.empty(m, n, dtype=torch.float32, device=points.device)
    rows = max(1, _SCRATCH_BYTES // (4 * m * NUM_CENTROIDS))
    for start in range(0, n, rows):
        chunk = points[:, start:start + rows]  # [m, r, s]
        partial = torch.baddbmm(center_norms, chunk, centers.transpose(1, 2), alpha=-2.0)  # [m, r, 256]
        best, index = partial.min(-1)
        assignment[:, start:start + rows] = index
        distance[:, start:start + rows] = (best + chunk.square().sum(-1)).clamp_min_(0.0)
    return assignment, distance


def _update(points, centers, assignment, distance) -> bool:
    """Move each center (in place) to the mean of its points; re-seed empty clusters with the
    points farthest from their centers. Returns whether any cluster was re-seeded.

    The sums are integer sums of the points in fixed point (:func:`_fixed_point`): exact, so the
    same on every run and every device whatever order the adds take (floating-point atomics and
    a GPU's parallel scans are not).
    """
    m, n, sub_dim = points.shape
    device = points.device
    fixed, scale = _fixed_point(points, n, signed=True, return_scale=True)  # [m, n, s] int64
    sums = torch.zeros(m, NUM_CENTROIDS, sub_dim, dtype=torch.int64, device=device)
    sums.scatter_add_(1, assignment.unsqueeze(-1).expand(m, n, sub_dim), fixed)  # [m, 256, s]
    counts = torch.zeros(m, NUM_CENTROIDS, dtype=torch.int64, device=device)
    counts.scatter_add_(1, assignment, torch.ones_like(assignment))
    filled = counts > 0  # [m, 256]
    means = (sums.double() / scale / counts.clamp_min(1).unsqueeze(-1)).to(torch.float32)
    centers.copy_(torch.where(filled.unsqueeze(-1), means, centers))
    empty_per_subspace = (~filled).sum(-1).tolist()  # [m]
    if not any(empty_per_subspace):
        return False
    for j, num_empty in enumerate(empty_per_subspace):
        if num_empty:
            farthest = torch.sort(distance[j], descending=True, stable=True).indices[:num_empty]
            empty = torch.nonzero(~filled[j]).squeeze(-1)[: farthest.numel()]
            centers[j, empty] = points[j, farthest[: empty.numel()]]
    return True


def _decode(codebooks, codes):
    """codebooks [m, 256, s], codes [..., m] int64 (same device) -> [..., m * s] fp32."""
    m, _, sub_dim = codebooks.shape
    subspace = torch.arange(m, device=codes.device)
    return codebooks[subspace, codes].reshape(*codes.shape[:-1], m * sub_dim)


# ---------------------------------------------------------------------- checks
def _check_int(name, value, *, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"maxsim: {name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"maxsim: {name} must be >= {minimum}, got {value}")


def _check_codes(codes, m, name, dims):
    if not torch.is_tensor(codes) or codes.dtype.is_floating_point or codes.dtype == torch.bool \
            or codes.is_complex():
        raise TypeError(f"maxsim: {name} must be a uint8 (or integer) tensor, got "
                        f"{codes.dtype if torch.is_tensor(codes) else type(codes).__name__}")
    if (dims is not None and codes.dim() != dims) or codes.dim() < 1 or codes.shape[-1] != m:
        expected = {None: f"[..., {m}]", 2: f"[T, {m}]", 3: f"[Nd, Ld, {m}]"}[dims]
        raise ValueError(f"maxsim: {name} must have shape {expected} (m = {m} sub-spaces), got {tuple(codes.shape)}")


def _check_code_range(codes, name):
    lo, hi = int(codes.min()), int(codes.max())
    if lo < 0 or hi >= NUM_CENTROIDS:
        raise ValueError(f"maxsim: {name} hold values in [{lo}, {hi}], outside [0, {NUM_CENTROIDS})")


def _check_query(Q, pq):
    if not isinstance(pq, ProductQuantizer):
        raise TypeError(f"maxsim: pq must be a maxsim.compressed.pq.ProductQuantizer, got {type(pq).__name__}")
    check_query(Q, pq.dim, "pq")




def _check_codes_device(codes, Q):
    if codes.device != Q.device and codes.device.type != "cpu":
        raise ValueError(f"maxsim: codes must be on Q's device ({Q.device}) or on the CPU (streamed a chunk at a "
                         f"time), got {codes.device}")




# ---------------------------------------------------------------------- scoring
class _Layout:
    """Where each document's tokens lie in ``codes_flat`` [T, m].

    starts, lengths: [Nd] int64 on the CPU; padded_len: Ld for the padded layout (document j is
    rows j·Ld .. j·Ld + lengths[j], the rest padding), None for the packed one.
    """

    def __init__(self, codes_flat, starts, lengths, padded_len):
        self.codes_flat = codes_flat
        self.starts = starts
        self.lengths = lengths
        self.padded_len = padded_len
        self.num_docs = starts.numel()

    def chunks(self, rows_per_block, chunk_documents):
        """[(d0, d1)]: runs of documents whose similarity scratch stays within the budget."""
        num_docs = self.num_docs
        if chunk_documents is not None:
            return [(d0, min(num_docs, d0 + chunk_documents)) for d0 in range(0, num_docs, chunk_documents)]
        budget_tokens = max(1, _SCRATCH_BYTES // (4 * max(1, rows_per_block)))
        if self.padded_len is not None:
            step = max(1, budget_tokens // max(1, self.padded_len))
            return [(d0, min(num_docs, d0 + step)) for d0 in range(0, num_docs, step)]
        # packed: the padded view [rows, n, longest] of a chunk must fit (at least one document each)
        chunks, d0, longest = [], 0, 0
        for d, length in enumerate(self.lengths.tolist()):
            widest = max(longest, length)
            if d > d0 and (d - d0 + 1) * widest > budget_tokens:
                chunks.append((d0, d))
                d0, widest = d, length
            longest = widest
        if num_docs:
            chunks.append((d0, num_docs))
        return chunks


def _chunk_best(lut, layout, d0, d1, device, need_winners):
    """Max over the real tokens of documents d0:d1 for every query row.

    lut [m, R, 256] fp32. Returns (best [R, n] fp32, 0 for an empty document; winner [R, n] int64
    row of codes_flat of the winning token, -1 for none; None unless need_winners).
    """
    m, rows, _ = lut.shape
    num = d1 - d0
    starts, lengths = layout.starts[d0:d1], layout.lengths[d0:d1]
    if layout.padded_len is not None:
        width = layout.padded_len
        lo, hi = d0 * width, d1 * width
    else:
        lo, hi = int(starts[0]) if num else 0, int(starts[-1] + lengths[-1]) if num else 0
        width = int(lengths.max()) if num else 0
    lengths_dev = lengths.to(device)
    valid = torch.arange(width, device=device) < lengths_dev.unsqueeze(-1)  # [n, width]
    if width == 0 or hi == lo:
        best = torch.zeros(rows, num, dtype=torch.float32, device=device)
        winner = torch.full((rows, num), -1, dtype=torch.int64, device=device) if need_winners else None
        return best, winner
    codes = layout.codes_flat[lo:hi].to(device, non_blocking=True)  # [tokens, m]
    if layout.padded_len is not None:
        real = valid.reshape(-1)
        if codes.dtype != torch.uint8:
            # padding may hold anything: only the real tokens must be valid codes
            if bool(real.any()):
                _check_code_range(codes[real], "codes")
            codes = torch.where(real.unsqueeze(-1), codes, torch.zeros_like(codes))
    elif codes.dtype != torch.uint8:
        _check_code_range(codes, "codes")
    codes = codes.long()
    similarity = lut[0].index_select(1, codes[:, 0])  # [R, tokens]
    for j in range(1, m):
        similarity += lut[j].index_select(1, codes[:, j])
    if layout.padded_len is not None:
        similarity = similarity.view(rows, num, width)
    else:
        # each document's tokens as a row of the padded view [R, n, width]
        local_starts = (starts - lo).to(device)
        positions = local_starts.unsqueeze(-1) + torch.arange(width, device=device)  # [n, width]
        positions = torch.where(valid, positions, torch.zeros_like(positions))
        similarity = similarity[:, positions.reshape(-1)].view(rows, num, width)
    similarity = similarity.masked_fill(~valid, float("-inf"))
    nonempty = valid[:, 0]  # [n]: a document with a real token has one at position 0
    if need_winners:
        best, index = similarity.max(-1)  # [R, n]
        token = starts.to(device).unsqueeze(0) + index
        winner = torch.where(nonempty, token, torch.full_like(token, -1))
    else:
        best, winner = similarity.amax(-1), None
    best = torch.where(nonempty, best, torch.zeros_like(best))
    return best, winner


def _scores(Q, q_mask, pq, layout, chunk_documents, need_winners):
    """Q [Nq, Lq, d] -> (scores [Nq, Nd] fp32, winners [Nq, Lq, Nd] or None)."""
    device = Q.device
    num_queries, query_len, _ = Q.shape
    m, sub_dim = pq.m, pq.sub_dim
    codebooks = pq.codebooks_on(device)
    num_docs = layout.num_docs
    scores = torch.zeros(num_queries, num_docs, dtype=torch.float32, device=device)
    winners = None
    if need_winners:
        index_dtype = torch.int32 if layout.codes_flat.shape[0] < 2**31 else torch.int64
        winners = torch.full((num_queries, query_len, num_docs), -1, dtype=index_dtype, device=device)
    if num_queries == 0 or query_len == 0 or num_docs == 0:
        return scores, winners
    # queries in blocks whose look-up tables [block, Lq, m, 256] fit the scratch budget
    block = max(1, _SCRATCH_BYTES // (4 * query_len * m * NUM_CENTROIDS))
    chunks = layout.chunks(min(block, num_queries) * query_len, chunk_documents)
    for q0 in range(0, num_queries, block):
        q1 = min(num_queries, q0 + block)
        rows = (q1 - q0) * query_len
        sub_vectors = Q[q0:q1].to(torch.float32).reshape(q1 - q0, query_len, m, sub_dim)
        lut = torch.einsum("qijs,jcs->jqic", sub_vectors, codebooks).reshape(m, rows, NUM_CENTROIDS).contiguous()
        keep = None if q_mask is None else q_mask[q0:q1].reshape(rows, 1)  # [R, 1]
        for d0, d1 in chunks:
            best, winner = _chunk_best(lut, layout, d0, d1, device, need_winners)  # [R, n]
            if keep is not None:
                best = torch.where(keep, best, torch.zeros_like(best))  # masked query tokens add nothing
            scores[q0:q1, d0:d1] = best.view(q1 - q0, query_len, d1 - d0).sum(1)
            if need_winners:
                if keep is not None:
                    winner = torch.where(keep, winner, torch.full_like(winner, -1))
                winners[q0:q1, :, d0:d1] = winner.view(q1 - q0, query_len, d1 - d0)
    return scores, winners


def _winners_grad(grad_scores, winners, codes_flat, codebooks):
    """grad_Q [Nq, Lq, d] fp32 = sum over documents of grad[q, j] times the decoded winner of
    query token (q, i) in document j (winners [Nq, Lq, Nd], -1: none), a chunk of documents at a time."""
    num_queries, query_len, num_docs = winners.shape
    device = winners.device
    m, _, sub_dim = codebooks.shape
    grad = torch.zeros(num_queries, query_len, m * sub_dim, dtype=torch.float32, device=device)
    per_doc = max(1, num_queries * query_len * (4 * m * sub_dim + 8 * m))  # decoded winners + their codes
    step = max(1, _SCRATCH_BYTES // per_doc)
    grad_scores = grad_scores.to(torch.float32)
    for j0 in range(0, num_docs, step):
        j1 = min(num_docs, j0 + step)
        winner = winners[:, :, j0:j1].long()  # [Nq, Lq, n]
        won = winner >= 0
        codes = codes_flat[winner.clamp_min(0).to(codes_flat.device)].to(device).long()  # [Nq, Lq, n, m]
        decoded = _decode(codebooks, codes)  # [Nq, Lq, n, d]
        weight = grad_scores[:, None, j0:j1] * won  # [Nq, Lq, n]
        grad += torch.einsum("qin,qind->qid", weight, decoded)
    return grad


class _PQScores(torch.autograd.Function):
    """The look-up-table scores, saving each query token's winner; the backward decodes the winners."""

    @staticmethod
    def forward(ctx, Q, q_mask, pq, layout, chunk_documents):
        scores, winners = _scores(Q, q_mask, pq, layout, chunk_documents, need_winners=True)
        ctx.save_for_backward(winners)
        ctx.codes_flat, ctx.codebooks, ctx.q_dtype = layout.codes_flat, pq.codebooks_on(Q.device), Q.dtype
        ctx.set_materialize_grads(False)
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        if grad_scores is None:
            return (None,) * 5
        (winners,) = ctx.saved_tensors
        grad_q = _winners_grad(grad_scores, winners, ctx.codes_flat, ctx.codebooks)
        return (grad_q.to(ctx.q_dtype),) + (None,) * 4


def _run(Q, q_mask, pq, layout, chunk_documents, single_query):
    if torch.is_grad_enabled() and Q.requires_grad:
        out = _PQScores.apply(Q, q_mask, pq, layout, chunk_documents)
    else:
        out, _ = _scores(Q, q_mask, pq, layout, chunk_documents, need_winners=False)
    return out[0] if single_query else out


def _prepare_query(Q, pq, q_mask):
    _check_query(Q, pq)
    q_mask = check_q_mask(q_mask, Q)
    if Q.dim() == 2:
        return Q.unsqueeze(0), (None if q_mask is None else q_mask.unsqueeze(0)), True
    return Q, q_mask, False


def maxsim_pq(Q, codes, pq, *, q_mask=None, d_mask=None, d_lengths=None, chunk_documents=None):
    """MaxSim of Q against padded product-quantised documents, through a per-query look-up table.

    Q [Nq, Lq, d] (or [Lq, d]) float16/bfloat16/float32; codes [Nd, Ld, m] uint8 (or integers in
    [0, 256)), on Q's device or the CPU; pq: the :class:`ProductQuantizer`; the real tokens as
    ``maxsim.maxsim`` takes them: q_mask Q.shape[:-1], d_mask [Nd, Ld] (True = real) or d_lengths
    [Nd] (None = all real; a padding token's codes are never read). Returns [Nq, Nd] fp32 ([Nd]
    for a 2-D Q), equal to ``maxsim.maxsim(Q.float(), pq.decode(codes), q_mask, d_mask)`` to fp32
    rounding. Empty documents score 0. chunk_documents: documents per chunk (default: as many as
    keep the fp32 similarities [Nq·Lq, tokens] of a chunk within 64 MB). Differentiable in Q (the
    codebooks are constants).
    """
    Q, q_mask, single_query = _prepare_query(Q, pq, q_mask)
    _check_codes(codes, pq.m, "codes", 3)
    _check_codes_device(codes, Q)
    check_chunk_documents(chunk_documents)
    num_docs, doc_len, _ = codes.shape
    real = check_d_mask(d_mask, d_lengths, (num_docs, doc_len), torch.device("cpu"))  # [Nd, Ld] bool or None
    if real is None:
        starts = torch.arange(num_docs, dtype=torch.int64) * doc_len
        layout = _Layout(codes.reshape(num_docs * doc_len, pq.m), starts, torch.full((num_docs,), doc_len), doc_len)
    else:  # the real tokens, packed in order: the packed layout
        lengths = real.sum(dim=1)  # [Nd]
        starts = torch.zeros(num_docs, dtype=torch.int64)
        torch.cumsum(lengths[:-1], 0, out=starts[1:])
        tokens = codes.reshape(num_docs * doc_len, pq.m)[real.reshape(-1).to(codes.device)]
        layout = _Layout(tokens, starts, lengths, None)
    return _run(Q, q_mask, pq, layout, chunk_documents, single_query)


def maxsim_pq_varlen(Q, codes, cu_seqlens_d, pq, *, q_mask=None, chunk_documents=None):
    """MaxSim of Q against packed product-quantised documents (document j is codes[cu[j]:cu[j+1]]).

    Q [Nq, Lq, d] (or [Lq, d]); codes [T, m] uint8 (or integers in [0, 256)); cu_seqlens_d [Nd + 1]
    int (starts at 0, never decreases, ends at T). Returns [Nq, Nd] fp32 ([Nd] for a 2-D Q);
    empty documents score 0; otherwise as :func:`maxsim_pq` (chunk_documents default: chunks
    whose padded similarities [Nq·Lq, n, longest] stay within 64 MB).

    On the Triton backend (CUDA) without a gradient, uint8 codes on Q's device and no
    ``chunk_documents``: the packed stream kernel decodes each tile of tokens on chip, the
    codebooks rounded once to Q's dtype (fp16 / bf16; fp32 stays fp32), and multiplies on the
    tensor cores: the scores of ``maxsim_varlen(Q, pq.decode(codes).to(Q.dtype))``, exact products
    and fp32 sums, with no look-up table and no decoded token in memory.
    """
    Q, q_mask, single_query = _prepare_query(Q, pq, q_mask)
    _check_codes(codes, pq.m, "codes", 2)
    _check_codes_device(codes, Q)
    check_chunk_documents(chunk_documents)
    total = codes.shape[0]
    if chunk_documents is None:
        out = _on_chip(Q, q_mask, codes, cu_seqlens_d, pq)
        if out is not None:
            return out[0] if single_query else out
    cu = check_cu_seqlens(cu_seqlens_d, total)
    layout = _Layout(codes, cu[:-1].clone(), cu[1:] - cu[:-1], None)
    return _run(Q, q_mask, pq, layout, chunk_documents, single_query)


def _on_chip(Q, q_mask, codes, cu_seqlens_d, pq):
    """Scores [Nq, Nd] fp32 from the packed stream kernel's on-chip decode, or None where the
    look-up-table path scores (no Triton backend, a gradient, codes not uint8 on Q's device)."""
    from maxsim._dispatch import backend_for
    from maxsim.varlen.queries import packed_queries
    from maxsim.selection import varlen as select_varlen
    from maxsim.selection.common import device_of, precision_choice
    from maxsim.varlen.stream import stream_forward

    if backend_for(Q.device) != "triton" or (torch.is_grad_enabled() and Q.requires_grad) \
            or codes.dtype != torch.uint8 or codes.device != Q.device or Q.shape[1] == 0:
        return None
    cu_d = check_cu_seqlens(cu_seqlens_d, codes.shape[0], on_host=False).to(Q.device)
    q_packed, cu_q, _, max_q = packed_queries(Q, q_mask)  # masked query tokens left out
    if max_q == 0:
        return None
    family = device_of(Q)[1]
    choice = select_varlen.pq_forward_choice(q_packed, cu_q.numel() - 1, max_q, family)
    codebooks = pq.codebooks_on(Q.device).to(Q.dtype).contiguous()  # [m, 256, d / m]
    precision = precision_choice(Q.dtype, "auto", family)[0]
    return stream_forward(q_packed.contiguous(), codes.contiguous(), cu_q, cu_d, max_q, config=choice.config,
                          codebooks=codebooks, precision=precision)
