"""Runs the warp-specialized forward three times at in-batch 128 x 128 (Nq = Nd = 128, Lq 128,
Ld 1024, d 128, bf16), for Nsight Compute to profile the last launch (gpu_session.sh ncu):

    ncu --launch-skip 2 --launch-count 1 -k regex:fwd_ws python3 benchmarks/ncu_ws.py argmax|plain
"""
import sys

import torch

from maxsim.dense.forward_ws import maxsim_forward_ws

argmax = sys.argv[1] == "argmax"
torch.manual_seed(0)
Q = torch.randn(128, 128, 128, device="cuda", dtype=torch.bfloat16)
D = torch.randn(128, 1024, 128, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    maxsim_forward_ws(Q, D, save_argmax=argmax)
torch.cuda.synchronize()
