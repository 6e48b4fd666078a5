"""The training mode of the benchmark: one optimiser step's worth of MaxSim work.

    python -m maxsim bench --mode train

A step is what a ColBERT / ColPali trainer runs per batch: drop the gradients (set to None, as
``optimizer.zero_grad()`` does), score, take a cross-entropy loss, backpropagate into Q and D.

- In-batch negatives (D ``[Nd, Ld, d]`` shared by all queries): ``F.cross_entropy(scores,
  arange(Nq))``, query i's positive is document i (so Nd >= Nq).
- Candidate lists (D ``[Nq, K, Ld, d]``): ``F.cross_entropy(scores, zeros(Nq))``, the positive is
  each query's first candidate.

The check: the scores and both gradients against the autograd of
:func:`maxsim.reference.maxsim_reference` in fp32, on the same inputs and the same device, through
the same loss. The reference runs on fp32 leaves, so its autograd keeps views of them rather than
per-chunk fp32 copies: what it holds is the fp32 inputs and their gradients, the int64 argmax
that ``max`` saves per (query, document, query token), and one chunk's scratch.

The runner (:mod:`maxsim.bench.runner`) does the rest as for the forward: worker subprocesses,
peak memory, timing, the table and the files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from maxsim.bench.shapes import Shape
from maxsim.reference import maxsim_reference

# Scratch budget of one chunk of the reference's similarity tensor (its max_chunk_bytes).
REF_CHUNK_BYTES = 256 * 2**20
# Skip the gradient check (scores are still checked) where the reference would need more.
REF_GRAD_LIMIT_BYTES = 8 * 2**30


def train_labels(shape: Shape, device) -> torch.Tensor:
    """Index of the positive among each query's scores: its own document (in-batch) or the
    first candidate."""
    if shape.candidates:
        return torch.zeros(shape.nq, dtype=torch.long, device=device)
    if shape.nd < shape.nq:
        # Labels past the last column would trip a device-side assert on CUDA.
        raise ValueError(f"in-batch loss needs nd >= nq; {shape.name} has nq={shape.nq}, nd={shape.nd}")
    return torch.arange(shape.nq, device=device)


def training_loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(scores, labels)


def train_step(fn, args, leaves, labels) -> torch.Tensor:
    """One step: gradients of ``leaves`` to None, ``scores = fn(*args)``, loss, backward.
    Returns the scores, detached."""
    for x in leaves:
        x.grad = None
    scores = fn(*args)
    training_loss(scores, labels).backward()
    return scores.detach()


def reference_grad_bytes(shape: Shape) -> int:
    """What the fp32 reference's forward + backward allocates beyond the inputs, roughly: fp32
    copies of Q and D and their fp32 gradients, the int64 argmax saved by ``max`` (with masks,
    two bool masks of that size as well), and the scratch of one chunk in the forward and one in
    the backward."""
    elements = (shape.nq * shape.lq + shape.doc_rows * shape.ld) * shape.d
    winners = shape.nq * shape.nd * shape.lq
    saved = winners * (8 + (2 if shape.masked else 0))
    return 2 * 4 * elements + saved + 2 * REF_CHUNK_BYTES


@dataclass
class Reference:
    scores: torch.Tensor  # fp32
    grad_Q: torch.Tensor | None  # fp32; None when the gradient check was skipped
    grad_D: torch.Tensor | None
    note: str = ""  # why it was skipped


def reference_step(shape: Shape, Q, D, q_mask, d_mask, labels, mask_mode: str = "exclude") -> Reference:
    """The reference's scores and, unless that needs more than ``REF_GRAD_LIMIT_BYTES``, the fp32
    gradients of the training loss with respect to Q and D."""
    need = reference_grad_bytes(shape)
    with_grads = need <= REF_GRAD_LIMIT_BYTES
    Qf = Q.detach().float().requires_grad_(with_grads)
    Df = D.detach().float().requires_grad_(with_grads)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # true fp32 products, whatever a peer set (TF32)
    try:
        with torch.set_grad_enabled(with_grads):
            scores = maxsim_reference(Qf, Df, q_mask, d_mask, mask_mode=mask_mode, max_chunk_bytes=REF_CHUNK_BYTES)
            if not with_grads:
                note = f"grad check skipped: the reference needs ~{need / 2**30:.0f} GB"
                return Reference(scores, None, None, note)
            training_loss(scores, labels).backward()
    finally:
        torch.set_float32_matmul_precision(precision)
    return Reference(scores.detach(), Qf.grad, Df.grad)


def grad_error(grad: torch.Tensor | None, ref: torch.Tensor, what: str) -> float:
    """``||grad - ref|| / ||ref||`` (Frobenius, fp32); NaN when ``grad`` holds a NaN.

    A norm, not the max used for the scores: where two document tokens tie to within rounding,
    a kernel and the reference may pick different winners, both right, and that one row's
    gradient then differs by a whole embedding; a max would report it as a 100 % error."""
    if grad is None:
        raise ValueError(f"no gradient reached {what}")
    if tuple(grad.shape) != tuple(ref.shape):
        raise ValueError(f"{what}.grad has shape {list(grad.shape)}, expected {list(ref.shape)}")
    diff = torch.linalg.vector_norm(grad.float() - ref)
    scale = torch.linalg.vector_norm(ref).clamp_min(torch.finfo(torch.float32).tiny)
    return float(diff / scale)
