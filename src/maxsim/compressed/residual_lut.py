"""PLAID residual tokens scored on the 8-bit tensor cores, their codes decoded in registers.

A residual token is a centroid ``c_t`` plus a residual ``r_t`` whose dimension f is one of the
codec's ``2**nbits`` bucket weights. Its score against query token ``q_j`` splits in two::

    S[t, j] = (q_j . c_t + q_j . r_t) * inv_norm_t
            = (T[cid_t, j] + s_j s_r (q~_j . r~_t)) * inv_norm_t

- ``T = Q @ C^T`` (``[C, Lq]``, one table a query, built once per call) turns the centroid term
  into a look-up: a token reads one row of T instead of its centroid's ``d`` coordinates.
- The residual term is an int8 tensor-core product: the query quantised per row (``q~_j``, scale
  ``s_j``) and the bucket weights quantised once for the corpus (``w~``, scale ``s_r``). A token's
  codes expand to int8 weights in registers: a byte permute (PTX ``prmt``) indexes a 4-entry
  table held in one 32-bit immediate (2 bits) or two 8-byte halves and a mask (4 bits), four
  dimensions an instruction; no decoded token goes through shared or global memory.
- ``inv_norm_t = 1 / ||c_t + r_t||`` is computed when the corpus is built (fp32 decode) and
  stored, so the kernel never sums squares.

The codes are stored in the order the decoder reads (:func:`kernel_layout`): for each group of
32-byte words the 2-bit codes of four 32-dimension slices (4-bit: two) share each 32-bit word, at
bit ``16 * hi + nbits * lo + 4 * e`` for column ``4 i + e`` of word ``i``, so one shift and one
mask give ``prmt`` its four selectors. Documents are padded to a multiple of ``G`` tokens by
repeating their last token (a repeat cannot change a max), so the kernel reduces groups of G rows
before it looks at document boundaries.

The int32 accumulator starts at ``0x4B400000`` (the bits of 1.5 * 2**23): after the dot its bits
read as the float ``1.5 * 2**23 + acc`` (|acc| < 2**22 always holds: 127 * 127 * d for d <= 256),
so no int-to-float conversion (a quarter-rate instruction) is needed; ``cn = -1.5 * 2**23 * qs``
is exact because ``qs`` is rounded to 22 significant bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from maxsim._dispatch import interpreting
from maxsim._kernels import max_nan

SLICE = 32  # dimensions per 8-bit tensor-core dot (K >= 32 for one-byte operands)
MAGIC_BITS = tl.constexpr(0x4B400000)  # bits of 1.5 * 2**23
MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23


def bit_positions(nbits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(byte [dim] int64, shift [dim] int64): where dimension f's code lies in a token's row of
    ``dim * nbits / 8`` bytes in the kernel layout (field ``(row[byte] >> shift) & (2**nbits - 1)``)."""
    if nbits not in (2, 4):
        raise ValueError(f"the look-up decoder takes nbits 2 or 4, got {nbits}")
    per_group = 4 if nbits == 2 else 2
    per_nibble = 4 // nbits  # codes per nibble of a word
    f = torch.arange(dim, dtype=torch.int64)
    k, c = f // SLICE, f % SLICE  # slice, column
    g, s = k // per_group, k % per_group  # group, slice inside the group
    i, e = c // 4, c % 4  # word, element
    bitpos = 16 * (s // per_nibble) + nbits * (s % per_nibble) + 4 * e
    return 32 * g + 4 * i + bitpos // 8, bitpos % 8


def kernel_layout(buckets: torch.Tensor, nbits: int) -> torch.Tensor:
    """buckets ``[T, d]`` (each in ``[0, 2**nbits)``) -> ``[T, d * nbits / 8]`` uint8 in the
    decoder's layout (module docstring). d must be a multiple of 128 (2 bits) or 64 (4 bits)."""
    T, dim = buckets.shape
    group_dims = SLICE * (4 if nbits == 2 else 2)
    if dim % group_dims:
        raise ValueError(f"the look-up decoder needs d divisible by {group_dims} at {nbits} bits, got {dim}")
    byte, shift = bit_positions(nbits, dim)
    out = torch.zeros(T, dim * nbits // 8, dtype=torch.int32, device=buckets.device)
    vals = buckets.to(torch.int32) << shift.to(buckets.device, torch.int32)  # [T, d]
    out.index_add_(1, byte.to(buckets.device), vals)  # fields never overlap: a sum is an or
    return out.to(torch.uint8)


def quantized_weights(bucket_weights: torch.Tensor) -> tuple[list[int], float]:
    """(int8 weights ``w~`` as Python ints, scale ``s_r``): ``w ~= s_r * w~``, |w~| <= 127."""
    w = bucket_weights.double().cpu()
    scale = float(w.abs().max()) / 127.0 if float(w.abs().max()) > 0 else 1.0
    return [int(v) for v in torch.round(w / scale).clamp(-127, 127).tolist()], scale


def _word(vals: list[int]) -> str:
    """Four int8 values as one 32-bit immediate (value 0 in the low byte)."""
    return hex(sum((v & 0xFF) << (8 * i) for i, v in enumerate(vals)))


def decoder_asm(nbits: int, slot: int, lut: list[int]) -> str:
    """PTX for ``tl.inline_asm_elementwise`` (int8 in, int8 out, pack 4): the int8 weights of slice
    ``slot`` of a group from the group's 32-bit word ($1), looked up in ``lut`` (immediates)."""
    if nbits == 2:
        shift = 16 * (slot // 2) + 2 * (slot % 2)
        return ("{ .reg .b32 s, l; mov.b32 l, %s; shr.b32 s, $1, %d; and.b32 s, s, 0x3333; "
                "prmt.b32 $0, l, l, s; }" % (_word(lut), shift))
    shift = 16 * slot
    return ("{ .reg .b32 x, s, m, lo, hi, l0, l1, l2, l3; "
            "mov.b32 l0, %s; mov.b32 l1, %s; mov.b32 l2, %s; mov.b32 l3, %s; "
            "shr.b32 x, $1, %d; and.b32 s, x, 0x7777; "
            "prmt.b32 lo, l0, l1, s; prmt.b32 hi, l2, l3, s; "
            "shr.b32 m, x, 1; and.b32 m, m, 0x4444; or.b32 m, m, 0x3210; prmt.b32 m, 0, 0xFFFFFFFF, m; "
            "lop3.b32 $0, lo, hi, m, 0xD8; }"
            % (_word(lut[0:4]), _word(lut[4:8]), _word(lut[8:12]), _word(lut[12:16]), shift))


@triton.jit
def _decode_slice(b_words, p_row, lut_ptr, m_t, k: tl.constexpr, ASM: tl.constexpr, USE_ASM: tl.constexpr,
                  NBITS: tl.constexpr):
    """Slice k's int8 weights [BT, 32]: from the group's code bytes b_words [BT, 32] (the byte
    permute), or, under the interpreter, read field by field from the rows (p_row [BT, 1])."""
    if USE_ASM:
        return tl.inline_asm_elementwise(ASM, "=r,r", [b_words], dtype=tl.int8, is_pure=True, pack=4)
    else:
        PER_GROUP: tl.constexpr = 4 if NBITS == 2 else 2
        PER_NIBBLE: tl.constexpr = 4 // NBITS
        g: tl.constexpr = k // PER_GROUP
        s: tl.constexpr = k % PER_GROUP
        o_c = tl.arange(0, 32)
        bitpos = 16 * (s // PER_NIBBLE) + NBITS * (s % PER_NIBBLE) + 4 * (o_c % 4)  # [32]
        byte = 32 * g + 4 * (o_c // 4) + bitpos // 8
        b_b = tl.load(p_row + byte[None, :], mask=m_t[:, None], other=0).to(tl.int32) & 0xFF  # [BT, 32]
        field = (b_b >> (bitpos % 8)[None, :]) & ((1 << NBITS) - 1)
        return tl.load(lut_ptr + field)  # [BT, 32] int8


@triton.jit
def query_slice(q_ptr, o_n, k: tl.constexpr, LQ: tl.constexpr, DIM: tl.constexpr, q0):
    """The quantised query's slice k as the dot's right operand: [32, N] int8 (column n: query
    q0 + n // LQ, token n % LQ)."""
    o_c = tl.arange(0, 32)
    p = q_ptr + ((q0 + o_n // LQ).to(tl.int64) * LQ + o_n % LQ)[None, :] * DIM + (k * 32 + o_c)[:, None]
    return tl.load(p)


@triton.jit
def query_rows(q_ptr, qs_ptr, q0, LQ: tl.constexpr, DIM: tl.constexpr, QPB: tl.constexpr):
    """Queries q0 .. q0 + QPB - 1 as a program holds them: (row scales b_qs [N], the magic
    correction b_cn [N], the four 32-dimension slices [32, N] int8), N = QPB * LQ."""
    o_n = tl.arange(0, QPB * LQ)
    b_qs = tl.load(qs_ptr + q0 * LQ + o_n)  # [N]
    b_cn = -MAGIC * b_qs  # exact (22-bit qs)
    return (b_qs, b_cn, query_slice(q_ptr, o_n, 0, LQ, DIM, q0), query_slice(q_ptr, o_n, 1, LQ, DIM, q0),
            query_slice(q_ptr, o_n, 2, LQ, DIM, q0), query_slice(q_ptr, o_n, 3, LQ, DIM, q0))


@triton.jit
def run_start(cu_ptr, i_run, docs_per_program, Nd, N: tl.constexpr):
    """Run i_run's documents: (j_hi, t_lo, t_hi: its token range, then the walk's state j, lo, hi,
    b_carry at its first document)."""
    j_lo = (i_run * docs_per_program).to(tl.int64)
    j_hi = tl.minimum(j_lo + docs_per_program, Nd)
    t_lo = tl.load(cu_ptr + j_lo)
    t_hi = tl.load(cu_ptr + j_hi)
    hi = tl.load(cu_ptr + j_lo + 1, mask=j_lo < j_hi, other=0)
    return j_hi, t_lo, t_hi, j_lo, t_lo, hi, tl.full([N], float("-inf"), dtype=tl.float32)


@triton.jit
def segment_max(b_s, t0, j, j_hi, lo, hi, b_carry, cu_ptr, out_ptr, o_qb, m_qb, Nd, BT: tl.constexpr,
                G: tl.constexpr, LQ: tl.constexpr, QPB: tl.constexpr):
    """One tile's scores b_s [BT, N] (tokens t0 : t0 + BT, documents padded to multiples of G)
    folded into the documents they belong to: each document that ends in the tile has its score
    (sum over its query's LQ rows of the max over its tokens) stored in out [Nq, Nd] at column j;
    the one running past the tile carries its partial max [N]. Returns (j, lo, hi, b_carry) for
    the next tile (lo, hi: document j's token range)."""
    NG: tl.constexpr = BT // G
    N: tl.constexpr = QPB * LQ
    NEG_INF: tl.constexpr = float("-inf")
    o_g = tl.arange(0, NG) * G
    b_r = tl.reduce(tl.reshape(b_s, [NG, G, N]), 1, max_nan)  # [NG, N]: groups never straddle documents
    while (j < j_hi) & (hi <= t0 + BT):  # every document that ends in this tile
        hi_next = tl.load(cu_ptr + j + 2, mask=j + 1 < j_hi, other=0)
        inside = (t0 + o_g >= lo) & (t0 + o_g < hi)
        b_max = max_nan(tl.reduce(tl.where(inside[:, None], b_r, NEG_INF), 0, max_nan), b_carry)  # [N]
        b_score = tl.sum(tl.reshape(tl.where(hi > lo, b_max, 0.0), [QPB, LQ]), axis=1)  # [QPB]
        tl.store(out_ptr + o_qb.to(tl.int64) * Nd + j, b_score, mask=m_qb)
        b_carry = tl.full([N], NEG_INF, dtype=tl.float32)
        j += 1
        lo = hi
        hi = hi_next
    if j < j_hi:  # document j runs on past this tile
        inside = (t0 + o_g >= lo) & (t0 + o_g < hi)
        b_carry = max_nan(b_carry, tl.reduce(tl.where(inside[:, None], b_r, NEG_INF), 0, max_nan))
    return j, lo, hi, b_carry


@triton.jit(do_not_specialize=["Nq", "Nd", "num_centroids", "docs_per_program", "n_runs"])
def _residual_lut_kernel(
    codes_ptr,  # [Tp, W] uint8: codes in the decoder's layout (Tp: tokens, documents padded to G)
    cid_ptr,  # [Tp] int32 centroid ids
    inv_ptr,  # [Tp] fp32 1 / ||c + r||
    cu_ptr,  # [Nd + 1] int64 offsets (multiples of G)
    q_ptr,  # [Nq_pad, LQ, DIM] int8 quantised queries (zero rows past each query)
    qs_ptr,  # [Nq_pad, LQ] fp32: s_j * s_r (22 significant bits; 0 on padding rows)
    tab_ptr,  # [Nq_pad, C, LQ] fp16 / fp32: Q @ C^T (0 on padding rows)
    lut_ptr,  # [2**NBITS] int8 w~ (the interpreter's decode)
    out_ptr,  # [Nq, Nd] fp32, zeroed (an empty document keeps its 0)
    Nq, Nd, num_centroids, docs_per_program, n_runs,
    DIM: tl.constexpr, NBITS: tl.constexpr, LQ: tl.constexpr, QPB: tl.constexpr, BT: tl.constexpr,
    G: tl.constexpr, USE_ASM: tl.constexpr, ASM0: tl.constexpr, ASM1: tl.constexpr, ASM2: tl.constexpr,
    ASM3: tl.constexpr, NO_TABLE: tl.constexpr, ABLATE: tl.constexpr,
):
    """Each program: QPB queries (N = QPB * LQ columns) against a run of whole documents, walked
    as one stream of BT-token tiles. out[q, j] = sum over the query's rows of the max over the
    document's tokens; a centroid id outside [0, C) makes its document NaN. ABLATE (the probe's
    ablations): 1 one max over each tile instead of the documents', 2 the code bytes multiplied
    as they are, undecoded."""
    N: tl.constexpr = QPB * LQ
    W: tl.constexpr = DIM * NBITS // 8
    pid = tl.program_id(0)
    i_run = pid % n_runs  # runs vary fastest: one query group's tables stay in L2 while it runs
    q0 = (pid // n_runs) * QPB
    o_n = tl.arange(0, N)
    b_qs, b_cn, b_q0, b_q1, b_q2, b_q3 = query_rows(q_ptr, qs_ptr, q0, LQ, DIM, QPB)
    p_tab = tab_ptr + (q0 + o_n // LQ).to(tl.int64)[None, :] * num_centroids * LQ + (o_n % LQ)[None, :]  # [1, N]
    o_qb = q0 + tl.arange(0, QPB)
    m_qb = o_qb < Nq
    j_hi, t_lo, t_hi, j, lo, hi, b_carry = run_start(cu_ptr, i_run, docs_per_program, Nd, N)
    o_tt = tl.arange(0, BT)
    # The next tile's bytes are loaded while this one is scored (registers as the second buffer).
    b_w0, b_w1, b_inv, b_tab = _load_tile(codes_ptr, cid_ptr, inv_ptr, p_tab, t_lo, t_hi, o_tt, num_centroids, W,
                                          NBITS, LQ, N, NO_TABLE)
    for t0 in range(t_lo, t_hi, BT):
        o_t = t0 + o_tt
        m_t = o_t < t_hi
        p_row = codes_ptr + o_t.to(tl.int64)[:, None] * W  # [BT, 1] (the interpreter's decode)
        n_w0, n_w1, n_inv, n_tab = _load_tile(codes_ptr, cid_ptr, inv_ptr, p_tab, t0 + BT, t_hi, o_tt, num_centroids,
                                              W, NBITS, LQ, N, NO_TABLE)
        acc = tl.full([BT, N], MAGIC_BITS, dtype=tl.int32)
        if ABLATE == 2:  # ablation: the bytes as the weights (no decode)
            acc = tl.dot(b_w0.to(tl.int8, bitcast=True), b_q0, acc, out_dtype=tl.int32)
            acc = tl.dot(b_w0.to(tl.int8, bitcast=True), b_q1, acc, out_dtype=tl.int32)
            acc = tl.dot(b_w1.to(tl.int8, bitcast=True), b_q2, acc, out_dtype=tl.int32)
            acc = tl.dot(b_w1.to(tl.int8, bitcast=True), b_q3, acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(_decode_slice(b_w0, p_row, lut_ptr, m_t, 0, ASM0, USE_ASM, NBITS), b_q0, acc,
                         out_dtype=tl.int32)
            acc = tl.dot(_decode_slice(b_w0, p_row, lut_ptr, m_t, 1, ASM1, USE_ASM, NBITS), b_q1, acc,
                         out_dtype=tl.int32)
            acc = tl.dot(_decode_slice(b_w1, p_row, lut_ptr, m_t, 2, ASM2, USE_ASM, NBITS), b_q2, acc,
                         out_dtype=tl.int32)
            acc = tl.dot(_decode_slice(b_w1, p_row, lut_ptr, m_t, 3, ASM3, USE_ASM, NBITS), b_q3, acc,
                         out_dtype=tl.int32)
        b_f = acc.to(tl.float32, bitcast=True)  # 1.5 * 2**23 + acc, exactly
        b_s = tl.fma(b_f, b_qs[None, :], b_cn[None, :])  # [BT, N]
        if not NO_TABLE:
            b_s += b_tab.to(tl.float32)
        b_s = b_s * b_inv[:, None]
        if ABLATE == 1:  # ablation: one max over the tile, no document boundaries
            b_carry = max_nan(b_carry, tl.reduce(b_s, 0, max_nan))
        else:
            j, lo, hi, b_carry = segment_max(b_s, t0, j, j_hi, lo, hi, b_carry, cu_ptr, out_ptr, o_qb, m_qb, Nd,
                                             BT, G, LQ, QPB)
        b_w0, b_w1, b_inv, b_tab = n_w0, n_w1, n_inv, n_tab
    if ABLATE == 1:
        tl.store(out_ptr + o_qb.to(tl.int64) * Nd + i_run * docs_per_program,
                 tl.sum(tl.reshape(b_carry, [QPB, LQ]), axis=1), mask=m_qb)


@triton.jit
def _load_tile(codes_ptr, cid_ptr, inv_ptr, p_tab, t0, t_hi, o_tt, num_centroids, W: tl.constexpr,
               NBITS: tl.constexpr, LQ: tl.constexpr, N: tl.constexpr, NO_TABLE: tl.constexpr):
    """Tile t0's code bytes (two [BT, 32] groups; 2 bits: the same one twice), inverse norms [BT]
    (NaN where the centroid id lies outside [0, C)) and table rows [BT, N]."""
    o_t = t0 + o_tt
    m_t = o_t < t_hi
    p_row = codes_ptr + o_t.to(tl.int64)[:, None] * W + tl.arange(0, 32)[None, :]  # [BT, 32]
    b_w0 = tl.load(p_row, mask=m_t[:, None], other=0)
    if NBITS == 2:
        b_w1 = b_w0  # one group of words holds all four slices
    else:
        b_w1 = tl.load(p_row + 32, mask=m_t[:, None], other=0)
    b_cid = tl.load(cid_ptr + o_t, mask=m_t, other=0)  # [BT]
    b_inv = tl.load(inv_ptr + o_t, mask=m_t, other=0.0)  # [BT]
    m_code = (b_cid >= 0) & (b_cid < num_centroids)
    b_inv = tl.where(m_code, b_inv, float("nan"))
    if NO_TABLE:
        b_tab = tl.zeros([o_tt.shape[0], N], dtype=tl.float16)
    else:
        b_tab = tl.load(p_tab + tl.where(m_code, b_cid, 0).to(tl.int64)[:, None] * LQ, mask=m_t[:, None], other=0.0)
    return b_w0, b_w1, b_inv, b_tab


# ---------------------------------------------------------------------- host side
LUT_DIM = 128  # the decoder's fixed width (4 slices); other widths take the plane-by-plane kernel
# Rows of padding after a layout's last token (and groups after its last group): the Gluon kernel
# reads whole tiles (the ids up to three tiles ahead: 4 x 128 - 2 rows past a run) without masks.
TAIL_TOKENS = 512


class LutLayout:
    """A residual corpus in the look-up scorer's layout (built once, stored with the corpus).

    codes ``[Tp, d * nbits / 8]`` uint8 (:func:`kernel_layout`), cid ``[Tp]`` int32, inv_norm
    ``[Tp]`` fp32, cu ``[Nd + 1]`` int64: documents padded to a multiple of ``group`` tokens by
    repeating their last token. ``lut`` the int8 bucket weights, ``scale`` their scale s_r.
    """

    def __init__(self, codes, cid, inv_norm, cu, nbits, lut, scale, group, group_doc=None):
        self.codes, self.cid, self.inv_norm, self.cu = codes, cid, inv_norm, cu
        self.group_doc = group_documents(cu, group) if group_doc is None else group_doc
        self.nbits, self.lut, self.scale, self.group = nbits, list(lut), float(scale), int(group)

    @property
    def num_docs(self) -> int:
        return self.cu.numel() - 1

    def to(self, device) -> "LutLayout":
        return LutLayout(self.codes.to(device), self.cid.to(device), self.inv_norm.to(device), self.cu.to(device),
                         self.nbits, self.lut, self.scale, self.group, self.group_doc.to(device))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.cid, self.inv_norm, self.cu, self.group_doc))


def group_documents(cu_p: torch.Tensor, group: int) -> torch.Tensor:
    """group_doc ``[Tp / group + TAIL_TOKENS / group + 1]`` int32: the document of each group of
    ``group`` tokens of a padded layout (offsets ``cu_p``), then -1 past its end (the Gluon
    kernels read a tile ahead without masks)."""
    lengths = (cu_p[1:] - cu_p[:-1]) // group
    docs = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_p.device, dtype=torch.int32), lengths)
    return torch.cat([docs, torch.full((TAIL_TOKENS // group + 1,), -1, dtype=torch.int32, device=cu_p.device)])


def padded_offsets(cu: torch.Tensor, group: int) -> torch.Tensor:
    """cu_padded ``[Nd + 1]`` int64: each document's length rounded up to a multiple of ``group``."""
    lengths = cu[1:] - cu[:-1]
    padded = (lengths + group - 1) // group * group
    cu_p = torch.zeros_like(cu)
    cu_p[1:] = torch.cumsum(padded, 0)
    return cu_p


def padded_chunks(cu: torch.Tensor, cu_p: torch.Tensor, chunk: int):
    """Yields ``(rows, source)`` for each run of at most ``chunk`` rows of a padded layout
    (offsets ``cu_p`` of documents ``cu``): ``rows`` a slice of the layout, ``source [n]`` int64 the
    token each row reads (a document's padding rows read its last token). So a layout of any size
    is built with temporaries of one chunk."""
    total = int(cu_p[-1])
    for start in range(0, total, chunk):
        stop = min(total, start + chunk)
        rows = torch.arange(start, stop, device=cu_p.device)
        doc = torch.searchsorted(cu_p, rows, right=True) - 1  # [n]: padded rows lie in non-empty documents
        yield slice(start, stop), torch.minimum(cu[doc] + (rows - cu_p[doc]), cu[doc + 1] - 1)


def build_bytes(codec, num_tokens: int, num_docs: int, *, group: int = 16, chunk: int = 1 << 20) -> int:
    """An upper bound on the device bytes :func:`build_layout` allocates for ``num_tokens`` tokens
    in ``num_docs`` documents: the layout (packed codes, centroid id and inverse norm a padded
    token), the padded offsets' int64 temporaries, and one chunk's decode scratch."""
    padded = num_tokens + num_docs * (group - 1) + TAIL_TOKENS
    layout = padded * (codec.packed_dim + 4 + 4)
    offsets = num_docs * 8 * 2  # the padded offsets, and their lengths' temporary
    scratch = min(chunk, padded) * (16 * codec.packed_dim + 24 * codec.dim + 5 * 8)  # + padded_chunks' rows
    return layout + offsets + scratch


def build_layout(codec, codes: torch.Tensor, residuals: torch.Tensor, cu: torch.Tensor, *, group: int = 16,
                 chunk: int = 1 << 20) -> LutLayout:
    """The look-up layout of packed residual documents (codes ``[T]``, residuals ``[T, P]``,
    ``cu [Nd + 1]``), on their device, ``chunk`` tokens at a time: the chunk bounds the build's
    temporaries (its buckets, shifted fields and fp32 decode), whatever the corpus's size."""
    if codec.dim != LUT_DIM or codec.nbits not in (2, 4):
        raise ValueError(f"the look-up scorer takes d {LUT_DIM} and nbits 2 or 4, got d {codec.dim}, "
                         f"nbits {codec.nbits}")
    device = residuals.device
    cu = cu.to(device=device, dtype=torch.int64)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= codec.num_centroids):
        raise ValueError(f"maxsim: a centroid id lies outside [0, {codec.num_centroids}) (the codec's table)")
    cu_p = padded_offsets(cu, group)
    total = int(cu_p[-1])
    out_codes = torch.zeros(total + TAIL_TOKENS, codec.packed_dim, dtype=torch.uint8, device=device)
    out_cid = torch.zeros(total + TAIL_TOKENS, dtype=torch.int32, device=device)
    out_inv = torch.zeros(total + TAIL_TOKENS, dtype=torch.float32, device=device)
    table = codec._table(device)
    for rows, src in padded_chunks(cu, cu_p, chunk):
        c, r = codes[src].to(device), residuals[src]
        buckets = table[r.long()].reshape(r.shape[0], codec.dim)  # [n, d]
        out_codes[rows] = kernel_layout(buckets, codec.nbits)
        out_cid[rows] = c.to(torch.int32)
        x = codec.decode(c, r, normalize=False, dtype=torch.float32).to(device)  # [n, d]
        out_inv[rows] = 1.0 / x.norm(dim=-1).clamp_min(1e-12)
    lut, scale = quantized_weights(codec.bucket_weights)
    return LutLayout(out_codes, out_cid, out_inv, cu_p, codec.nbits, lut, scale, group)


def round22(x: torch.Tensor) -> torch.Tensor:
    """fp32 x truncated to 22 significant bits (so 1.5 * 2**23 * x is exact in fp32)."""
    return (x.float().contiguous().view(torch.int32) & ~0x3).view(torch.float32)


def quantized_rows(Q: torch.Tensor, *, q_mask=None, qpb: int = 1, rows: int | None = None,
                   column_scales: torch.Tensor | None = None):
    """(q~ [Nq_pad, LQ, d] int8, s [Nq_pad, LQ] fp32 (0 on zero rows), q [Nq_pad, LQ, d] fp32, LQ)
    for Q ``[Nq, Lq, d]``: q holds Q (times ``column_scales [d]`` when given) with masked and
    padding rows 0 (Nq_pad: Nq rounded up to ``qpb``); each row quantised to int8 with one scale,
    q ~= s q~. LQ: ``rows`` (>= Lq), else the next power of two >= 16."""
    Nq, Lq, dim = Q.shape
    LQ = max(16, triton.next_power_of_2(Lq)) if rows is None else rows
    if LQ < Lq:
        raise ValueError(f"rows ({rows}) must hold the query's {Lq} tokens")
    Nq_pad = -(-Nq // qpb) * qpb
    q = torch.zeros(Nq_pad, LQ, dim, dtype=torch.float32, device=Q.device)
    q[:Nq, :Lq] = Q.float()
    if q_mask is not None:
        q[:Nq, :Lq] *= q_mask.to(device=Q.device, dtype=torch.float32)[..., None]
    scaled = q if column_scales is None else q * column_scales.to(device=Q.device, dtype=torch.float32)
    amax = scaled.abs().amax(-1)  # [Nq_pad, LQ]
    # a tensor divisor (true division on every device: CUDA's scalar division is a reciprocal's product)
    s = torch.where(amax > 0, amax / torch.full((), 127.0, device=Q.device), torch.ones_like(amax))
    q8 = torch.round(scaled / s[..., None]).clamp(-127, 127).to(torch.int8)
    return q8.contiguous(), torch.where(amax > 0, s, torch.zeros_like(s)), q, LQ


def prepare_queries(Q: torch.Tensor, centroids: torch.Tensor, scale: float, *, q_mask=None, qpb: int = 1,
                    table_dtype=torch.float16, rows: int | None = None):
    """(q~ [Nq_pad, LQ, d] int8, qs [Nq_pad, LQ] fp32, T [Nq_pad, C, LQ], LQ) for Q ``[Nq, Lq, d]``:
    rows quantised to int8 with one scale each (:func:`quantized_rows`), qs = s_j * s_r, T = Q @ C^T
    (masked and padding rows 0, so they add nothing to a score)."""
    q8, s, q, LQ = quantized_rows(Q, q_mask=q_mask, qpb=qpb, rows=rows)
    qs = round22(s * scale)
    tab = torch.matmul(centroids.to(device=Q.device, dtype=torch.float32), q.transpose(1, 2)).to(table_dtype)  # [n, C, LQ]
    return q8, qs.contiguous(), tab.contiguous(), LQ


def document_range(layout, Nq: int, docs, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu [Nd + 1] of ``docs = (lo, hi)`` (None: all) in a layout, the zeroed scores [Nq, Nd] fp32:
    an empty document keeps its 0)."""
    lo, hi = (0, layout.num_docs) if docs is None else docs
    return layout.cu[lo:hi + 1], torch.zeros(Nq, hi - lo, dtype=torch.float32, device=device)


def run_grid(Nd: int, waves: int, device) -> tuple[int, int]:
    """(documents a run, runs): ``waves`` programs an SM (one in the interpreter) over Nd documents."""
    from maxsim.tuning import multiprocessors

    slots = 1 if interpreting() else waves * multiprocessors(device.index or 0)
    docs_per_program = max(1, -(-Nd // max(1, slots)))
    return docs_per_program, -(-Nd // docs_per_program)


def lut_scores(Q: torch.Tensor, layout: LutLayout, centroids: torch.Tensor, *, q_mask=None, qpb: int = 1,
               block_tokens: int = 128, num_warps: int = 4, num_stages: int = 3, waves: int = 4,
               table_dtype=torch.float16, no_table: bool = False, ablate: int = 0, docs=None) -> torch.Tensor:
    """Scores ``[Nq, Nd]`` fp32 of queries ``Q [Nq, Lq, 128]`` against a :class:`LutLayout` on
    Q's device (``docs``: ``(lo, hi)``, only documents lo..hi-1, Nd = hi - lo): the residual term
    on the int8 tensor cores (query quantised per row), the centroid term from ``Q @ C^T``, each
    token divided by its stored norm."""
    Nq = Q.shape[0]
    cu, out = document_range(layout, Nq, docs, Q.device)
    Nd = out.shape[1]
    if Nq == 0 or Nd == 0:
        return out
    q8, qs, tab, LQ = prepare_queries(Q, centroids, layout.scale, q_mask=q_mask, qpb=qpb, table_dtype=table_dtype)
    lut_t = torch.tensor(layout.lut, dtype=torch.int8, device=Q.device)
    interpret = interpreting()
    docs_per_program, n_runs = run_grid(Nd, waves, Q.device)
    n_qgroups = q8.shape[0] // qpb
    asms = [decoder_asm(layout.nbits, s % (4 if layout.nbits == 2 else 2), layout.lut) for s in range(4)]
    _residual_lut_kernel[(n_runs * n_qgroups,)](
        layout.codes, layout.cid, layout.inv_norm, cu, q8, qs, tab, lut_t, out,
        Nq, Nd, centroids.shape[0], docs_per_program, n_runs,
        DIM=LUT_DIM, NBITS=layout.nbits, LQ=LQ, QPB=qpb, BT=block_tokens, G=layout.group,
        USE_ASM=not interpret, ASM0=asms[0], ASM1=asms[1], ASM2=asms[2], ASM3=asms[3], NO_TABLE=no_table,
        ABLATE=ablate,
        num_warps=num_warps, num_stages=num_stages)
    return out


def lut_reference(Q: torch.Tensor, codec, codes, residuals, cu, *, q_mask=None) -> torch.Tensor:
    """What :func:`lut_scores` approximates, in float64 on the CPU: the fp32 decode (not
    normalised) divided by its norm, against Q."""
    x = codec.decode(codes, residuals, normalize=False, dtype=torch.float32).double().cpu()
    x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    q = Q.double().cpu()
    if q_mask is not None:
        q = q * q_mask.cpu().double()[..., None]
    out = torch.zeros(Q.shape[0], cu.numel() - 1, dtype=torch.float64)
    cu = cu.cpu()
    for j in range(cu.numel() - 1):
        lo, hi = int(cu[j]), int(cu[j + 1])
        if hi > lo:
            out[:, j] = (q @ x[lo:hi].T).amax(-1).sum(-1)
    return out


def lut_emulation(Q: torch.Tensor, codec, codes, residuals, cu, layout: LutLayout, *, q_mask=None,
                  table_dtype=torch.float16) -> torch.Tensor:
    """:func:`lut_scores`' arithmetic in float64 on the CPU (the same quantised query, int8
    weights, table and stored norms): the kernel must match it to fp32 rounding."""
    q8, qs, tab, LQ = prepare_queries(Q.cpu(), codec.centroids.cpu(), layout.scale, q_mask=None if q_mask is None
                                      else q_mask.cpu(), table_dtype=table_dtype)
    codes, residuals, cu = codes.cpu(), residuals.cpu(), cu.cpu()
    buckets = codec._table("cpu")[residuals.long()].reshape(-1, codec.dim)
    w8 = torch.tensor(layout.lut, dtype=torch.float64)[buckets]  # [T, d]
    x = codec.decode(codes, residuals, normalize=False, dtype=torch.float32).cpu()
    inv = (1.0 / x.norm(dim=-1).clamp_min(1e-12)).double()  # [T]
    Nq = Q.shape[0]
    out = torch.zeros(Nq, cu.numel() - 1, dtype=torch.float64)
    for j in range(cu.numel() - 1):
        lo, hi = int(cu[j]), int(cu[j + 1])
        if hi > lo:
            acc = torch.einsum("nld,td->ntl", q8[:Nq].double(), w8[lo:hi])  # [Nq, t, LQ]
            s = (tab[:Nq, codes[lo:hi].long(), :].double() + qs[:Nq, None, :].double() * acc) * inv[None, lo:hi, None]
            out[:, j] = s.amax(1).sum(-1)
    return out
