"""The implementations the benchmark compares, behind one calling convention.

A provider is a name plus ``fn(Q, D, q_arg, d_arg) -> scores [Nq, Nd] fp32`` and an
``available(device)`` check. D is ``[Nd, Ld, d]`` (cross product) or ``[Nq, K, Ld, d]``
(per-query candidate lists, scores ``[Nq, K]``). ``prepare(Q, D, q_mask, d_mask)`` runs once, outside the timed region,
and turns the harness's bool masks into whatever the provider consumes natively (flash-maxsim
takes lengths), so a provider is not charged for converting inputs its users would already have.
``mask_mode`` names the masking rule the provider implements; the error column compares it with
``maxsim_reference(..., mask_mode=...)`` so that it measures numerics, not a rule difference.

Each mode has its registry: ``PROVIDERS`` for the forward, ``TRAIN_PROVIDERS`` for the training
step, whose ``fn`` must be differentiable in Q and D (the harness calls ``backward()`` on a loss
of its scores).
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
    available: Callable[[str], bool]  # available(device)
    prepare: Callable = _as_is
    mask_mode: str = "exclude"
    dist: str | None = None  # distribution name, for the version in the header


# --- maxsim -------------------------------------------------------------------------------------


def _maxsim_fn(Q, D, q_mask, d_mask):
    import maxsim

    return maxsim.maxsim(Q, D, q_mask, d_mask).float()


def _maxsim_with_backward(strategy: str) -> Callable:
    """maxsim with the given grad_D strategy (``auto``, ``unified``, ``lowmem``)."""

    def fn(Q, D, q_mask, d_mask):
        import maxsim

        return maxsim.maxsim(Q, D, q_mask, d_mask, backward=strategy).float()

    return fn


def _maxsim_available(device: str) -> bool:
    try:
        import maxsim
    except Exception:
        return False
    return callable(getattr(maxsim, "maxsim", None))


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


def _always(device: str) -> bool:
    return True


def _peer_available(module: str) -> Callable[[str], bool]:
    # The peers import without a GPU but need one to run.
    return lambda device: device == "cuda" and _importable(module)


PROVIDERS = {
    p.name: p
    for p in [
        Provider("maxsim", _maxsim_fn, _maxsim_available, dist="maxsim"),
        Provider("naive", _naive_fn, _always, mask_mode="multiply"),
        Provider(
            "late-interaction-kernels",
            _lik_fn,
            _peer_available("late_interaction_kernels"),
            dist="late-interaction-kernels",
        ),
        Provider(
            "flash-maxsim",
            _flash_fn,
            _peer_available("flash_maxsim"),
            prepare=_flash_prepare,
            dist="flash-maxsim",
        ),
        Provider("selftest-crash", _selftest_crash_fn, _always),
    ]
}
DEFAULT_PROVIDERS = ["maxsim", "naive", "late-interaction-kernels", "flash-maxsim"]

# The training step: the same calls where they are differentiable as they are (late-interaction-
# kernels' maxsim is; naive is through autograd), flash-maxsim's autograd entry point, and maxsim
# once per backward strategy ("maxsim" itself is backward="auto").
TRAIN_PROVIDERS = {
    p.name: p
    for p in [
        Provider("maxsim", _maxsim_with_backward("auto"), _maxsim_available, dist="maxsim"),
        Provider("maxsim-unified", _maxsim_with_backward("unified"), _maxsim_available),
        Provider("maxsim-lowmem", _maxsim_with_backward("lowmem"), _maxsim_available),
        PROVIDERS["naive"],
        PROVIDERS["late-interaction-kernels"],
        Provider(
            "flash-maxsim",
            _flash_train_fn,
            _peer_available("flash_maxsim"),
            prepare=_flash_train_prepare,
            dist="flash-maxsim",
        ),
        PROVIDERS["selftest-crash"],
    ]
}
DEFAULT_TRAIN_PROVIDERS = [
    "maxsim", "maxsim-unified", "maxsim-lowmem", "naive", "late-interaction-kernels", "flash-maxsim",
]  # fmt: skip

# mode -> (registry, default provider names)
REGISTRIES = {
    "forward": (PROVIDERS, DEFAULT_PROVIDERS),
    "train": (TRAIN_PROVIDERS, DEFAULT_TRAIN_PROVIDERS),
}


def is_maxsim(name: str) -> bool:
    """maxsim itself or one of its variants (``maxsim-lowmem``): a row of ours, not a peer's."""
    return name == "maxsim" or name.startswith("maxsim-")


def get_providers(names: list[str], mode: str = "forward") -> list[Provider]:
    registry = REGISTRIES[mode][0]
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ValueError(f"unknown provider(s) {', '.join(unknown)}; known: {', '.join(registry)}")
    return [registry[n] for n in names]
