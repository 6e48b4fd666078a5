"""MaxSim over padded tensors: ``Q [Nq, Lq, d]`` against ``D [Nd, Ld, d]`` or ``[Nq, K, Ld, d]``."""
