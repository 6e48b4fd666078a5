import cProfile, pstats, torch, maxsim, time
Q = torch.randn(1, 128, 128, device="cuda", dtype=torch.float16)
D = torch.randn(1000, 1024, 128, device="cuda", dtype=torch.float16)
for _ in range(20): maxsim.maxsim(Q, D)
torch.cuda.synchronize()
p = cProfile.Profile(); p.enable()
for _ in range(200): maxsim.maxsim(Q, D)
p.disable(); torch.cuda.synchronize()
pstats.Stats(p).sort_stats("tottime").print_stats(18)
