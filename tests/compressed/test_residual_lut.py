"""The look-up residual scorer (maxsim.compressed.residual_lut): its code layout, the byte-permute
decoder's contract (emulated bit by bit on the CPU), and its scores against a float64 emulation of
the same arithmetic and against the exact scores within the quantisation's worst-case bound."""

import pytest
import torch

from conftest import HAS_CUDA, KERNEL_DEVICE
from maxsim.compressed import ResidualCodec
from maxsim.compressed.residual_lut import (
    bit_positions,
    build_layout,
    decoder_asm,
    kernel_layout,
    lut_emulation,
    lut_reference,
    lut_scores,
    prepare_queries,
)


# The fp16 table T = Q @ C^T of unit vectors: a CPU and a GPU fp32 product may round an entry to
# neighbouring fp16 values, 2**-11 apart below 1 (each query row's max moves by at most that).
TABLE_ROUNDING = 2.0 ** -11


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte (nibble i of sel & 7) of {b, a}."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = pool[nib & 7]
        if nib & 8:  # sign-replicate mode: never used by the decoder
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _run_asm(asm: str, word: int) -> int:
    """Executes the decoder's PTX (mov, shr, and, or, prmt, lop3) on one 32-bit word."""
    regs = {"$1": word}
    body = asm.strip("{} ").split(";")
    for stmt in body:
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        args = [a.strip() for a in args.split(",")]
        val = [regs[a] if a in regs else int(a, 0) for a in args[1:]]
        if op == "mov.b32":
            r = val[0]
        elif op == "shr.b32":
            r = val[0] >> val[1]
        elif op == "and.b32":
            r = val[0] & val[1]
        elif op == "or.b32":
            r = val[0] | val[1]
        elif op == "prmt.b32":
            r = _prmt(val[0], val[1], val[2])
        elif op == "lop3.b32":
            a, b, c, lut = val
            r = 0
            for bit in range(32):
                idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
                r |= ((lut >> idx) & 1) << bit  # the truth table indexed by the three input bits
        else:
            raise AssertionError(f"unexpected PTX {op}")
        regs[args[0]] = r & 0xFFFFFFFF
    return regs["$0"]


@pytest.mark.parametrize("nbits", [2, 4])
def test_layout_puts_every_code_where_the_decoder_reads_it(nbits):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    buckets = torch.randint(0, 1 << nbits, (7, 128), generator=g)
    rows = kernel_layout(buckets, nbits)  # [7, 128 * nbits / 8]
    assert rows.shape == (7, 128 * nbits // 8) and rows.dtype == torch.uint8
    byte, shift = bit_positions(nbits, 128)
    fields = (rows[:, byte].long() >> shift) & ((1 << nbits) - 1)
    assert torch.equal(fields, buckets)


@pytest.mark.parametrize("nbits", [2, 4])
def test_decoder_asm_expands_each_word_to_its_weights(nbits):
    """The PTX each slice runs, executed on the CPU: word i of a group gives columns 4i..4i+3 of
    its slice, byte e holding lut[bucket of column 4i + e] (the pack order the GPU run confirmed)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    lut = torch.randint(-127, 128, (1 << nbits,), generator=g).tolist()
    buckets = torch.randint(0, 1 << nbits, (3, 128), generator=g)
    rows = kernel_layout(buckets, nbits).long()
    per_group = 4 if nbits == 2 else 2
    for t in range(3):
        for k in range(4):
            grp, slot = divmod(k, per_group)
            asm = decoder_asm(nbits, slot, lut)
            for i in range(8):
                w = sum(int(rows[t, 32 * grp + 4 * i + e]) << (8 * e) for e in range(4))
                out = _run_asm(asm, w)
                got = [((out >> (8 * e)) & 0xFF) - (256 if (out >> (8 * e)) & 0x80 else 0) for e in range(4)]
                want = [lut[int(buckets[t, 32 * k + 4 * i + e])] for e in range(4)]
                assert got == want, (t, k, i)


def _case(nbits, seed, num_docs=23, dim=128):
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.normalize(torch.randn(2000, dim, generator=g), dim=-1)
    codec = ResidualCodec.train(x, nbits, num_centroids=32, seed=seed % 1000)
    lengths = torch.randint(0, 41, (num_docs,), generator=g)
    lengths[2] = 0
    lengths[-1] = 0
    cu = torch.zeros(num_docs + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    tokens = torch.nn.functional.normalize(torch.randn(int(cu[-1]), dim, generator=g), dim=-1)
    codes, residuals = codec.encode(tokens)
    Q = torch.nn.functional.normalize(torch.randn(3, 20, dim, generator=g), dim=-1)
    return codec, codes, residuals, cu, Q


@pytest.mark.parametrize("nbits", [2, 4])
@pytest.mark.parametrize("block", [32, 64])
def test_scores_match_the_emulation(nbits, block):
    codec, codes, residuals, cu, Q = _case(nbits, int(torch.randint(0, 2**31, ()).item()))
    layout = build_layout(codec, codes, residuals, cu)
    q_mask = torch.ones(3, 20, dtype=torch.bool)
    q_mask[1, 15:] = False
    got = lut_scores(Q.to(KERNEL_DEVICE), layout.to(KERNEL_DEVICE), codec.centroids.to(KERNEL_DEVICE),
                     q_mask=q_mask.to(KERNEL_DEVICE), block_tokens=block,
                     table_dtype=torch.float32).cpu()
    want = lut_emulation(Q, codec, codes, residuals, cu, layout, q_mask=q_mask, table_dtype=torch.float32)
    assert got.shape == (3, cu.numel() - 1)
    # fp32 rounding of 20 row maxima of terms up to ~1.5 (plus the table and the stored norm);
    # Triton's interpreter rounds the fma's product before its sum, up to 2 qs_j a row (times the
    # token's inverse norm), where the GPU's fma rounds once
    qs = prepare_queries(Q, codec.centroids, layout.scale, q_mask=q_mask)[1][:3].double()  # [Nq, LQ]
    slack = 2 * qs.sum(-1)[:, None] * float(layout.inv_norm.max())
    err = (got.double() - want).abs()
    assert torch.all(err <= slack + 1e-5 * want.abs() + 1e-4), float(err.max())
    assert torch.all(got[:, 2] == 0) and torch.all(got[:, -1] == 0)  # empty documents


@pytest.mark.parametrize("nbits", [2, 4])
def test_scores_within_the_quantisation_bound_of_the_exact_ones(nbits):
    """|error| <= sum_j d max|q_j| max|w| / 127 * max inv_norm, plus the fp16 table's rounding:
    the worst case of rounding q_j and the weights to int8 (each off by half a step)."""
    codec, codes, residuals, cu, Q = _case(nbits, int(torch.randint(0, 2**31, ()).item()))
    layout = build_layout(codec, codes, residuals, cu)
    got = lut_scores(Q.to(KERNEL_DEVICE), layout.to(KERNEL_DEVICE), codec.centroids.to(KERNEL_DEVICE)).double().cpu()
    exact = lut_reference(Q, codec, codes, residuals, cu)
    w_max = float(codec.bucket_weights.abs().max())
    inv_max = float(layout.inv_norm.max())
    bound = (128 * Q.abs().amax(-1).double().sum(-1) * w_max / 127 * inv_max  # [Nq]
             + Q.shape[1] * 2.0 ** -11 * inv_max * 1.01)
    err = (got - exact).abs()
    assert torch.all(err <= bound[:, None]), float((err - bound[:, None]).max())
    assert float(err.max()) > 0  # a real approximation: the bound is not met by accident of equality


def test_a_centroid_id_outside_the_table_makes_its_document_nan():
    codec, codes, residuals, cu, Q = _case(2, int(torch.randint(0, 2**31, ()).item()))
    layout = build_layout(codec, codes, residuals, cu)
    doc = int(torch.nonzero(cu[1:] > cu[:-1])[1])  # a document with tokens (lengths may be 0)
    layout.cid[layout.cu[doc]] = codec.num_centroids  # its first token
    got = lut_scores(Q.to(KERNEL_DEVICE), layout.to(KERNEL_DEVICE), codec.centroids.to(KERNEL_DEVICE)).cpu()
    assert torch.isnan(got[:, doc]).all()
    others = torch.ones(got.shape[1], dtype=torch.bool)
    others[doc] = False
    assert not torch.isnan(got[:, others]).any()


def test_layout_refuses_ids_outside_the_table():
    codec, codes, residuals, cu, _ = _case(2, int(torch.randint(0, 2**31, ()).item()))
    codes = codes.clone()
    codes[5] = codec.num_centroids
    with pytest.raises(ValueError, match="outside"):
        build_layout(codec, codes, residuals, cu)


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability()[0] != 9, reason="the Gluon kernel is Hopper's")
@pytest.mark.parametrize("nbits", [2, 4])
@pytest.mark.parametrize("table,qpb,pairs", [(torch.float16, 1, False), (torch.float32, 1, False),
                                             (torch.float16, 2, False), (torch.float16, 4, False),
                                             (torch.float32, 1, True), (torch.float16, 4, True)])
def test_gluon_kernel_matches_the_emulation(nbits, table, qpb, pairs):
    from maxsim.compressed.residual_gluon import gluon_scores

    codec, codes, residuals, cu, Q = _case(nbits, int(torch.randint(0, 2**31, ()).item()), num_docs=300)
    layout = build_layout(codec, codes, residuals, cu)
    got = gluon_scores(Q.cuda(), layout.to("cuda"), codec.centroids.cuda(), table_dtype=table, qpb=qpb, pairs=pairs)
    got = got.double().cpu()  # [3, Nd]: 3 queries, so with qpb 2 and 4 the last group is part padding
    want = lut_emulation(Q, codec, codes, residuals, cu, layout, table_dtype=table)
    atol = 1e-4 if table == torch.float32 else TABLE_ROUNDING * Q.shape[1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
    assert torch.all(got[:, 2] == 0) and torch.all(got[:, -1] == 0)


@pytest.mark.parametrize("nbits", [2, 4])
def test_a_document_range_scores_its_slice_of_the_columns(nbits):
    """``docs=(lo, hi)`` (a search's chunk of a stored layout) gives columns lo..hi-1 of the whole."""
    codec, codes, residuals, cu, Q = _case(nbits, int(torch.randint(0, 2**31, ()).item()), num_docs=60)
    layout = build_layout(codec, codes, residuals, cu).to(KERNEL_DEVICE)
    Q, C = Q.to(KERNEL_DEVICE), codec.centroids.to(KERNEL_DEVICE)
    whole = lut_scores(Q, layout, C).cpu()
    lo = int(torch.randint(1, 30, ()).item())
    hi = int(torch.randint(lo + 1, 60, ()).item())
    part = lut_scores(Q, layout, C, docs=(lo, hi)).cpu()
    assert part.shape == (3, hi - lo)
    torch.testing.assert_close(part, whole[:, lo:hi], rtol=0, atol=0)


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability()[0] != 9, reason="the Gluon kernel is Hopper's")
@pytest.mark.parametrize("nbits", [2, 4])
@pytest.mark.parametrize("qpb", [1, 4])
def test_gluon_kernel_takes_short_masked_queries_and_document_ranges(nbits, qpb):
    from maxsim.compressed.residual_gluon import gluon_scores

    codec, codes, residuals, cu, _ = _case(nbits, int(torch.randint(0, 2**31, ()).item()), num_docs=300)
    Q = torch.nn.functional.normalize(torch.randn(5, 12, 128), dim=-1)  # 12 rows: padded to 32
    q_mask = torch.rand(5, 12) > 0.3
    layout = build_layout(codec, codes, residuals, cu)
    # an fp32 table: the CPU's and the GPU's fp32 Q @ C^T may round to neighbouring fp16 values
    want = lut_emulation(Q, codec, codes, residuals, cu, layout, q_mask=q_mask, table_dtype=torch.float32)
    lay, Qc, C = layout.to("cuda"), Q.cuda(), codec.centroids.cuda()
    got = gluon_scores(Qc, lay, C, q_mask=q_mask.cuda(), qpb=qpb, table_dtype=torch.float32).double().cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    part = gluon_scores(Qc, lay, C, q_mask=q_mask.cuda(), qpb=qpb, docs=(37, 211),
                        table_dtype=torch.float32).double().cpu()
    torch.testing.assert_close(part, got[:, 37:211], rtol=0, atol=0)


def test_layout_pads_documents_by_repeating_their_last_token():
    codec, codes, residuals, cu, _ = _case(4, int(torch.randint(0, 2**31, ()).item()))
    layout = build_layout(codec, codes, residuals, cu, group=16)
    lengths = cu[1:] - cu[:-1]
    padded = layout.cu[1:] - layout.cu[:-1]
    assert torch.equal(padded, (lengths + 15) // 16 * 16)
    for j in torch.nonzero(lengths).flatten().tolist():
        lo, hi, plo = int(cu[j]), int(cu[j + 1]), int(layout.cu[j])
        assert torch.equal(layout.cid[plo:plo + hi - lo], codes[lo:hi].int())
        assert torch.all(layout.cid[plo + hi - lo:int(layout.cu[j + 1])] == int(codes[hi - 1]))
    n_groups = int(layout.cu[-1]) // 16
    assert torch.equal(layout.group_doc[:n_groups], torch.repeat_interleave(torch.arange(lengths.numel()), padded // 16).int())
    assert torch.all(layout.group_doc[n_groups:] == -1)  # the tail the kernels read past the end
    small = build_layout(codec, codes, residuals, cu, group=16, chunk=5)  # bounded temporaries, same layout
    assert all(torch.equal(a, b) for a, b in ((small.codes, layout.codes), (small.cid, layout.cid),
                                              (small.inv_norm, layout.inv_norm), (small.cu, layout.cu)))


def test_the_layout_tail_covers_the_gluon_scorers_reads_ahead():
    """The Gluon scorer walks two tiles an iteration and loads the ids a tile ahead of that, without
    masks: a run's last iteration reads up to 4 tiles - 2 rows past its end, which the layout's tail
    must hold for every tile it takes (and the sm90 table picks)."""
    from maxsim.compressed.residual_gluon import GLUON_BLOCK_TOKENS
    from maxsim.compressed.residual_lut import TAIL_TOKENS
    from maxsim.tuning.tables import LOOKUP_GLUON_SM90

    assert {rule.tile["BT"] for rule in LOOKUP_GLUON_SM90} <= set(GLUON_BLOCK_TOKENS)
    assert all(4 * bt - 2 <= TAIL_TOKENS for bt in GLUON_BLOCK_TOKENS)


def test_rejects_what_the_decoder_cannot_read():
    x = torch.nn.functional.normalize(torch.randn(500, 64), dim=-1)
    codec = ResidualCodec.train(x, 2, num_centroids=8)
    codes, residuals = codec.encode(x[:10])
    with pytest.raises(ValueError, match="d 128"):
        build_layout(codec, codes, residuals, torch.tensor([0, 10]))


def test_maxsim_residual_varlen_quantize_query(monkeypatch):
    """The public call's look-up path: the emulation's scores; a call it cannot take says why."""
    from maxsim.compressed import maxsim_residual_varlen

    codec, codes, residuals, cu, Q = _case(2, int(torch.randint(0, 2**31, ()).item()), num_docs=30)
    want = lut_emulation(Q, codec, codes, residuals, cu, build_layout(codec, codes, residuals, cu))
    if not HAS_CUDA:
        monkeypatch.setenv("MAXSIM_BACKEND", "triton")  # the kernels in the interpreter
    dev = KERNEL_DEVICE
    got = maxsim_residual_varlen(Q.to(dev), codes.to(dev), residuals.to(dev), cu.to(dev), codec.to(dev),
                                 quantize_query=True).double().cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=TABLE_ROUNDING * Q.shape[1])
    with pytest.raises(ValueError, match="normalize=False"):
        maxsim_residual_varlen(Q.to(dev), codes.to(dev), residuals.to(dev), cu.to(dev), codec.to(dev),
                               quantize_query=True, normalize=False)
    with pytest.raises(TypeError, match="quantize_query must be True or False"):
        maxsim_residual_varlen(Q, codes, residuals, cu, codec, quantize_query="yes")
