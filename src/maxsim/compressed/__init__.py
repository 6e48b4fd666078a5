"""Compressed corpora: PLAID residual codes (colbert-ai, fast-plaid, PyLate) and scoring on them."""

from .codec import ResidualCodec
from .scoring import maxsim_residual, maxsim_residual_varlen, plaid_approx_score

__all__ = ["ResidualCodec", "maxsim_residual", "maxsim_residual_varlen", "plaid_approx_score"]
