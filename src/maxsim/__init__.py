"""maxsim: fused Triton kernels for late-interaction (MaxSim) scoring.

    scores = maxsim.maxsim(Q, D, q_mask, d_mask)   # Q [Nq, Lq, d], D [Nd, Ld, d] -> [Nq, Nd] fp32
"""

from maxsim import reference
from maxsim.dense.ops import maxsim

__version__ = "0.1.0"
__all__ = ["maxsim", "reference", "__version__"]
