"""Host side of one 128-token query against 1,000 documents of 1,024 tokens (GPU): cProfile of 200
calls of ``maxsim.maxsim``, the warp-specialized path since WS_ONE_BLOCK_MIN_TOKENS is 2^18.

    PYTHONPATH=src python benchmarks/profile_ws_host.py
"""

import cProfile
import pstats

import torch

import maxsim

Q = torch.randn(1, 128, 128, device="cuda", dtype=torch.float16)
D = torch.randn(1000, 1024, 128, device="cuda", dtype=torch.float16)
for _ in range(20):
    maxsim.maxsim(Q, D)
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    maxsim.maxsim(Q, D)
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(18)
