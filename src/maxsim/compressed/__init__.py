"""Compressed corpora: PLAID residual codes (colbert-ai, fast-plaid, PyLate), int8 / fp8 tokens and
product quantisation, and scoring on them."""

from .codec import ResidualCodec
from .pq import PQFormatError, ProductQuantizer, maxsim_pq, maxsim_pq_varlen
from .quantized import dequantize_tokens, maxsim_quantized, maxsim_quantized_varlen, quantize_tokens
from .scoring import maxsim_residual, maxsim_residual_varlen, plaid_approx_score

__all__ = [
    "ResidualCodec",
    "maxsim_residual",
    "maxsim_residual_varlen",
    "plaid_approx_score",
    "quantize_tokens",
    "dequantize_tokens",
    "maxsim_quantized",
    "maxsim_quantized_varlen",
    "ProductQuantizer",
    "PQFormatError",
    "maxsim_pq",
    "maxsim_pq_varlen",
]
