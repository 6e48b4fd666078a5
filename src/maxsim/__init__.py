"""maxsim: fused Triton kernels for late-interaction (MaxSim) scoring.

    scores = maxsim.maxsim(Q, D, q_mask, d_mask)   # Q [Nq, Lq, d], D [Nd, Ld, d] -> [Nq, Nd] fp32
"""

from maxsim import compressed, index, reference
from maxsim.chamfer import chamfer_distance
from maxsim.dense.ops import maxsim
from maxsim.head import maxsim_from_hidden, maxsim_from_hidden_varlen
from maxsim.search import Corpus, topk
from maxsim.selection import explain
from maxsim.selection.head import explain_from_hidden
from maxsim.varlen.ops import check_packed, maxsim_varlen, score_pairs_packed
from maxsim.varlen.packing import pack, packed_to_padded, pad, padded_to_packed
from maxsim.warmup import warmup

__version__ = "0.1.0"
__all__ = [
    "maxsim",
    "explain",
    "maxsim_from_hidden",
    "maxsim_from_hidden_varlen",
    "explain_from_hidden",
    "chamfer_distance",
    "topk",
    "Corpus",
    "maxsim_varlen",
    "score_pairs_packed",
    "check_packed",
    "pack",
    "pad",
    "packed_to_padded",
    "padded_to_packed",
    "reference",
    "compressed",
    "index",
    "warmup",
    "__version__",
]

# The per-encoding scorers and codecs live in maxsim.compressed (a Corpus of any encoding searches
# with Corpus.search); the old top-level names say where they went, in one line.
_MOVED = {name: "maxsim.compressed" for name in (
    "ResidualCodec", "ProductQuantizer", "maxsim_residual", "maxsim_residual_varlen", "plaid_approx_score",
    "maxsim_quantized", "maxsim_quantized_varlen", "maxsim_pq", "maxsim_pq_varlen", "quantize_tokens",
    "dequantize_tokens")}


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(f"maxsim.{name} moved: from {_MOVED[name]} import {name} (or search a maxsim.Corpus "
                             f"of that encoding)")
    raise AttributeError(f"module 'maxsim' has no attribute {name!r}")
