"""The implementations the benchmark compares, behind one calling convention.

A provider is a name plus ``fn(*prepare(Q, D, q_mask, d_mask)) -> scores [Nq, Nd] fp32``. D is
``[Nd, Ld, d]`` (cross product) or ``[Nq, K, Ld, d]`` (per-query candidate lists, scores
``[Nq, K]``). ``prepare`` runs once, outside the timed region, and turns the harness's padded
inputs and bool masks into whatever the provider consumes natively (flash-maxsim takes lengths,
the varlen providers packed tokens), so a provider is not charged for converting inputs its users
would already have. ``mask_mode`` names the masking rule the provider implements; the error
column compares it with ``maxsim_reference(..., mask_mode=...)`` so that it measures numerics,
not a rule difference.

Each mode has its registry: ``PROVIDERS`` for the forward, ``TRAIN_PROVIDERS`` for the training
step, whose ``fn`` must be differentiable in Q and D (the harness calls ``backward()`` on a loss
of its scores), ``VARLEN_PROVIDERS`` for ragged batches.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable

import torch

from maxsim.bench.shapes import prefix_mask


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # a broken install fails in many ways, not just ImportError
        return False
    return True


def _as_is(Q, D, q_mask, d_mask):
    return Q, D, q_mask, d_mask


@dataclass(frozen=True)
class Provider:
    name: str
    fn: Callable  # fn(*prepare(Q, D, q_mask, d_mask)) -> [Nq, Nd] fp32
    prepare: Callable = _as_is
    mask_mode: str = "exclude"
    dist: str | None = None  # distribution name, for the version in the header
    module: str | None = None  # a peer's import name; None: part of this package, always there
    needs_cuda: bool = False  # the peers import without a GPU but need one to run
    internal: bool = False  # a test fixture: accepted by name, listed nowhere
    default: bool = True  # runs when --providers is not given

    def installed(self) -> bool:
        return self.module is None or _importable(self.module)

    def runs_on(self, device: str) -> bool:
        return device == "cuda" or not self.needs_cuda


# --- maxsim -------------------------------------------------------------------------------------


def _maxsim_fn(Q, D, q_mask, d_mask):
    import maxsim

    return maxsim.maxsim(Q, D, q_mask, d_mask).float()


def _maxsim_with(**options) -> Callable:
    """maxsim with fixed keyword options: a backward strategy (``backward="lowmem"``) or fp32
    inputs' products (``precision="tf32x3"``; 16-bit inputs ignore it)."""

    def fn(Q, D, q_mask, d_mask):
        import maxsim

        return maxsim.maxsim(Q, D, q_mask, d_mask, **options).float()

    return fn


# --- naive: what PyLate users run today ---------------------------------------------------------


def _naive_fn(Q, D, q_mask, d_mask):
    """PyLate's torch path in the input dtype: the full ``[Nq, Nd, Lq, Ld]`` similarity tensor,
    masks multiplied in (a masked similarity becomes 0 and still takes part in the max).
    Candidate lists (4-D D) as PyLate's ``colbert_kd_scores``. Differentiable through autograd."""
    if D.dim() == 4:
        S = torch.einsum("ash,abth->abst", Q, D)
        d_mask = d_mask[:, :, None, :] if d_mask is not None else None
    else:
        S = torch.einsum("ash,bth->abst", Q, D)
        d_mask = d_mask[None, :, None, :] if d_mask is not None else None
    if q_mask is not None:
        S = S * q_mask[:, None, :, None]
    if d_mask is not None:
        S = S * d_mask
    return S.max(-1).values.sum(-1).float()


# --- late-interaction-kernels -------------------------------------------------------------------


def _lik_fn(Q, D, q_mask, d_mask):
    import late_interaction_kernels

    return late_interaction_kernels.maxsim(Q, D, q_mask, d_mask).float()


# --- flash-maxsim: lengths instead of masks -----------------------------------------------------


def _lengths(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Bool prefix mask ``[N, L]`` (or ``[Nq, K, L]``) -> int32 lengths ``[N]`` (``[Nq * K]``,
    flash-maxsim's layout for candidate lists); refuses masks with holes."""
    if mask is None:
        return None
    lengths = mask.sum(-1, dtype=torch.int32)
    if not torch.equal(mask, prefix_mask(lengths, mask.shape[-1])):
        raise ValueError("flash-maxsim only supports prefix (length) masks")
    return lengths.reshape(-1)


def _flash_prepare(Q, D, q_mask, d_mask):
    q_len, d_len = _lengths(q_mask), _lengths(d_mask)
    if Q.shape[0] == 1 and D.dim() == 3 and q_len is not None:
        # The single-query entry point has no query length: pass only the real tokens.
        Q, q_len = Q[:, : int(q_len[0])], None
    return Q, D, q_len, d_len


def _flash_fn(Q, D, q_len, d_len):
    import flash_maxsim

    if Q.shape[0] == 1 and D.dim() == 3:
        return flash_maxsim.flash_maxsim(Q[0], D, d_len).float().unsqueeze(0)
    shared = D.dim() == 3  # False: per-query candidate lists [Nq, K, Ld, d]
    return flash_maxsim.flash_maxsim_batched(
        Q, D, doc_lengths=d_len, shared_docs=shared, query_lengths=q_len
    ).float()


def _flash_train_prepare(Q, D, q_mask, d_mask):
    # No cut-off query padding here: Q must stay the leaf the gradient is checked on.
    return Q, D, _lengths(q_mask), _lengths(d_mask)


def _flash_train_fn(Q, D, q_len, d_len):
    """flash-maxsim's differentiable batched entry point; it takes both layouts. (Its other one,
    ``flash_maxsim_train``, scores a single 2-D query only.)"""
    import flash_maxsim

    return flash_maxsim.flash_maxsim_batched_train(
        Q, D, shared_docs=D.dim() == 3, doc_lengths=d_len, query_lengths=q_len
    ).float()


# --- self-test fixture --------------------------------------------------------------------------


def _selftest_crash_fn(Q, D, q_mask, d_mask):
    """Dies the way a faulty kernel does, so tests can exercise crash isolation without a GPU:
    odd Nd -> the process aborts; Nd = 2 mod 4 -> a CUDA-style error that poisons the context;
    otherwise the reference result."""
    nd = D.shape[0]
    if nd % 2 == 1:
        os.abort()
    if nd % 4 == 2:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
    from maxsim.reference import maxsim_reference

    return maxsim_reference(Q, D, q_mask, d_mask)


# --- varlen: packed ragged batches -------------------------------------------------------------


def _packed(X: torch.Tensor, mask: torch.Tensor | None):
    """Padded ``X [N, L, d]`` (+ bool mask ``[N, L]``) -> ``(packed [T, d], cu_seqlens [N + 1], max L)``."""
    import maxsim

    if mask is None:
        mask = torch.ones(X.shape[:-1], dtype=torch.bool, device=X.device)
    return maxsim.padded_to_packed(X, mask)


def _varlen_prepare(Q, D, q_mask, d_mask):
    q, cu_q, max_q = _packed(Q, q_mask)
    d, cu_d, max_d = _packed(D, d_mask)
    return q, d, cu_q, cu_d, max_q, max_d


def _maxsim_varlen_fn(q, d, cu_q, cu_d, max_q, max_d):
    import maxsim

    return maxsim.maxsim_varlen(q, d, cu_q, cu_d, max_seqlen_q=max_q, max_seqlen_d=max_d).float()


def _lik_varlen_prepare(Q, D, q_mask, d_mask):
    q, d, cu_q, cu_d, max_q, max_d = _varlen_prepare(Q, D, q_mask, d_mask)
    return q, d, cu_q.to(torch.int32), cu_d.to(torch.int32), max_q, max_d  # its offsets are int32


def _lik_varlen_fn(q, d, cu_q, cu_d, max_q, max_d):
    import late_interaction_kernels

    return late_interaction_kernels.maxsim_varlen(q, d, cu_q, cu_d, max_q, max_d).float()


def _flash_packed_prepare(Q, D, q_mask, d_mask):
    """flash-maxsim's packed entry point scores one 2-D query: one query's real tokens each."""
    queries = [Q[i, : int(q_mask[i].sum())] if q_mask is not None else Q[i] for i in range(Q.shape[0])]
    d, cu_d, max_d = _packed(D, d_mask)
    return queries, d, cu_d.to(torch.int32), max_d


def _flash_packed_fn(queries, d, cu_d, max_d):
    import flash_maxsim

    return torch.stack([flash_maxsim.flash_maxsim_packed(q, d, cu_d, max_d) for q in queries]).float()


# --- registries ---------------------------------------------------------------------------------

_LIK = dict(dist="late-interaction-kernels", module="late_interaction_kernels", needs_cuda=True)
_FLASH = dict(dist="flash-maxsim", module="flash_maxsim", needs_cuda=True)
_SELFTEST = Provider("selftest-crash", _selftest_crash_fn, internal=True)

PROVIDERS = {
    p.name: p
    for p in [
        Provider("maxsim", _maxsim_fn, dist="maxsim"),
        Provider("naive", _naive_fn, mask_mode="multiply"),
        Provider("late-interaction-kernels", _lik_fn, **_LIK),
        Provider("flash-maxsim", _flash_fn, prepare=_flash_prepare, **_FLASH),
        # fp32 products asked for by name ("maxsim" is precision="auto": see maxsim.explain).
        Provider("maxsim-ieee", _maxsim_with(precision="ieee"), default=False),
        Provider("maxsim-fp16x3", _maxsim_with(precision="fp16x3"), default=False),
        Provider("maxsim-tf32x3", _maxsim_with(precision="tf32x3"), default=False),
        Provider("maxsim-tf32", _maxsim_with(precision="tf32"), default=False),
        _SELFTEST,
    ]
}

# The training step: the same calls where they are differentiable as they are (late-interaction-
# kernels' maxsim is; naive is through autograd), flash-maxsim's autograd entry point, and maxsim
# once per backward strategy ("maxsim" itself is backward="auto").
TRAIN_PROVIDERS = {
    p.name: p
    for p in [
        Provider("maxsim", _maxsim_with(backward="auto"), dist="maxsim"),
        Provider("maxsim-unified", _maxsim_with(backward="unified")),
        Provider("maxsim-lowmem", _maxsim_with(backward="lowmem")),
        PROVIDERS["naive"],
        PROVIDERS["late-interaction-kernels"],
        Provider("flash-maxsim", _flash_train_fn, prepare=_flash_train_prepare, **_FLASH),
        _SELFTEST,
    ]
}

# Ragged batches: maxsim on the packed tokens ("maxsim") and on the padded batch with a document
# mask ("maxsim-padded": the speed-up of packing), naive PyTorch on the padded batch, the peers'
# packed entry points.
VARLEN_PROVIDERS = {
    p.name: p
    for p in [
        Provider("maxsim", _maxsim_varlen_fn, prepare=_varlen_prepare, dist="maxsim"),
        Provider("maxsim-padded", _maxsim_fn),
        PROVIDERS["naive"],
        Provider("late-interaction-kernels", _lik_varlen_fn, prepare=_lik_varlen_prepare, **_LIK),
        Provider("flash-maxsim", _flash_packed_fn, prepare=_flash_packed_prepare, **_FLASH),
    ]
}

# mode -> (registry, default provider names: every provider that is not internal and runs by default)
REGISTRIES = {
    mode: (registry, [name for name, p in registry.items() if not p.internal and p.default])
    for mode, registry in [("forward", PROVIDERS), ("train", TRAIN_PROVIDERS), ("varlen", VARLEN_PROVIDERS)]
}
DEFAULT_PROVIDERS = REGISTRIES["forward"][1]
DEFAULT_TRAIN_PROVIDERS = REGISTRIES["train"][1]


def is_maxsim(name: str) -> bool:
    """maxsim itself or one of its variants (``maxsim-lowmem``): a row of ours, not a peer's."""
    return name == "maxsim" or name.startswith("maxsim-")


def get_providers(names: list[str], mode: str = "forward") -> list[Provider]:
    registry, _ = REGISTRIES[mode]
    unknown = [n for n in names if n not in registry]
    if unknown:
        known = [name for name, p in registry.items() if not p.internal]
        raise ValueError(f"unknown provider(s) {', '.join(unknown)} for --mode {mode}; known: {', '.join(known)}")
    return [registry[n] for n in names]
