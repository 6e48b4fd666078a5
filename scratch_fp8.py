"""Replay test_inference_reads_the_bytes_in_the_stream_kernel[bf16-fp8_e4m3] at seed 2617039553 on the GPU."""
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "tests")
sys.path.insert(0, "tests/compressed")
from test_quantized import _oracle, _packed_corpus, _padded_from_packed  # noqa: E402

from maxsim.compressed.quantized import maxsim_quantized_varlen, quantize_tokens  # noqa: E402

seed = int(sys.argv[1]) if len(sys.argv) > 1 else 2617039553
torch.manual_seed(seed)
lengths = [3, 0, 7, 5, 1, 12]
values, scales, cu = _packed_corpus(lengths, 16, "fp8_e4m3")
Q_host = torch.randn(2, 4, 16).to(torch.bfloat16)
q_mask = torch.tensor([[True, True, False, True], [True, True, True, True]])
import os
dev = os.environ.get("DEV", "cuda")
both = maxsim_quantized_varlen(Q_host.to(dev), values.to(dev), scales.to(dev), cu.to(dev), q_mask=q_mask.to(dev),
                               quantize_query=True).cpu().double()
D, d_mask = _padded_from_packed(values.double() * scales.double()[:, None], cu)
qv_cpu, qs_cpu = quantize_tokens(Q_host.float(), "fp8_e4m3")
qv_gpu, qs_gpu = quantize_tokens(Q_host.to(dev).float(), "fp8_e4m3")
print("query bytes equal:", torch.equal(qv_cpu.view(torch.uint8), qv_gpu.cpu().view(torch.uint8)),
      "scales equal:", torch.equal(qs_cpu, qs_gpu.cpu()))
exp = _oracle(qv_cpu.double() * qs_cpu.double()[..., None], D, q_mask, d_mask)
print("kernel\n", both, "\noracle\n", exp, "\ndiff\n", both - exp)
# per-token dots in byte units: exact vs the tensor cores
qb = qv_cpu[q_mask].double()  # [Tq, 16]
db = values.double()  # [Td, 16]
exact = qb @ db.T


@triton.jit
def _dot(a_ptr, b_ptr, o_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, KD: tl.constexpr, IMPRECISE: tl.constexpr):
    om, on, ok = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + om[:, None] * KD + ok[None, :], mask=(ok < KD)[None, :], other=0).to(tl.float8e4nv, bitcast=True)
    b = tl.load(b_ptr + on[:, None] * KD + ok[None, :], mask=(ok < KD)[None, :], other=0).to(tl.float8e4nv, bitcast=True)
    acc = tl.zeros([M, N], dtype=tl.float32)
    if IMPRECISE:
        acc = tl.dot(a, tl.trans(b), acc)
    else:
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=0)
    tl.store(o_ptr + om[:, None] * N + on[None, :], acc)


M, N = 64, 64
a = torch.zeros(M, 16, dtype=torch.uint8)
a[:qb.shape[0]] = qv_cpu[q_mask].view(torch.uint8)
b = torch.zeros(N, 16, dtype=torch.uint8)
b[:db.shape[0]] = values.view(torch.uint8)
for imprecise in (True, False):
    o = torch.empty(M, N, device=dev)
    _dot[(1,)](a.to(dev), b.to(dev), o, M, N, 32, 16, imprecise)
    got = o.cpu().double()[:qb.shape[0], :db.shape[0]]
    err = (got - exact).abs()
    print(f"imprecise={imprecise}: max |dot err| bytes {err.max().item():.3f} at {divmod(err.argmax().item(), db.shape[0])}, "
          f"max |dot| {exact.abs().max().item():.1f}")
print("query scales", qs_cpu[q_mask])
print("doc scales", scales)
print("q bytes", qv_cpu[q_mask].float())
