"""Selection for ``maxsim.topk``: the fused top-k kernel or the chunked path, and why.

The fused kernel (:mod:`maxsim.search.fused_topk`) must return the scores ``maxsim.maxsim`` returns,
bit for bit, so it runs the tile the dense selection (:mod:`maxsim.selection.dense`) gives the same
call, with a top-k epilogue. It runs a call when:

- the Triton kernels run the tensors (CUDA, or the interpreter with ``MAXSIM_BACKEND=triton``);
- the documents are padded and shared by every query (no ``subset=``, not packed);
- ``k`` fits its per-program buffer (:data:`maxsim.tuning.tables.TOPK_FUSED_SM90`);
- the dense selection chose its Triton kernel (not the warp-specialized Gluon kernel, whose sums the
  Triton kernel does not reproduce bit for bit), and each query fits one row block of that tile
  (a longer query's score is a sum of several programs' partial sums).

Every other call runs the chunked path (:mod:`maxsim.search.topk`), which scores with the public
functions and so is exact by construction.
"""

from __future__ import annotations

import torch

from maxsim._capability import dtype_name
from maxsim._dispatch import backend_for
from maxsim.dense import specs as dense_specs
from maxsim.search import specs
from maxsim.selection import dense
from maxsim.selection.common import Choice, call_of, device_of, not_yet_on_gpu
from maxsim.tuning import tables as T
from maxsim.tuning.rules import first_match, next_pow2, tile_of

# (the launcher's limits, restated here so that the selection imports no kernel module)
_MAX_FUSED_DOCUMENTS = 2**31 - 1
_CHUNKED_RECORD = "not tuned"
_CHUNKED_WHY_NOT = ("scores each chunk of documents into an [Nq, chunk] buffer before its top-k; "
                    "the fused kernel writes only its programs' candidates")


def topk_slots(k: int) -> int:
    """KB: per-query slots of a program's buffer (as :func:`maxsim.search.fused_topk.topk_slots`)."""
    return max(16, next_pow2(k))


def topk_choice(Q: torch.Tensor, D: torch.Tensor, k: int, *, masked: bool, normalize: bool,
                layout: str = "cross", family: str | None = None, exact_words: bool = False) -> Choice:
    """Which path ``maxsim.topk`` runs: ``search.fused_topk`` (config: the dense tile, a
    :class:`maxsim.tuning.configs.ForwardConfig`) or ``search.chunked_topk`` (config None).

    Q: ``[Nq, Lq, d]``.  D: padded ``[Nd, Ld, d]`` (layout ``"cross"``), or any tensor of the
    documents for ``"candidates"`` (``subset=``) and ``"packed"``.  family: decide as that GPU
    family would (``maxsim.explain``-style, any machine); None: the tensors' device, and CPU
    tensors (the PyTorch backend) run the chunked path.  exact_words: the dense rejections quote
    the call's own numbers.
    """
    if family is None:
        backend = backend_for(Q.device)
        if backend != "triton":
            return _chunked(f"tensors on {Q.device} run the PyTorch backend (no kernel): maxsim.maxsim scores "
                            "each chunk there")
        family = device_of(Q)[1]
    call = call_of(Q.dtype, Q.shape[-1], layout, masked, normalize, False, family)
    why = specs.FUSED_TOPK.unsupported(call)
    if layout == "packed":
        why = "packed documents are not fused yet: maxsim_varlen scores each chunk"
    elif layout == "candidates":
        why = "subset= ranks a candidate list per query: the chunked path gathers and scores them"
    why = why or not_yet_on_gpu(specs.FUSED_TOPK, family)
    if why is not None:
        return _chunked(why)
    Nq, Lq, d = Q.shape
    Nd = D.shape[0]
    limits = tile_of(first_match(T.TOPK_FUSED_SM90, {}), {})
    if k > limits["MAX_K"]:
        return _chunked(f"k = {k} > {limits['MAX_K']}: a program's buffer of k keys per query would not fit "
                        "in registers (not tuned)")
    if Nd > _MAX_FUSED_DOCUMENTS:
        return _chunked(f"{Nd} documents: the kernel counts documents in int32 (at most {_MAX_FUSED_DOCUMENTS})")
    forward = dense.forward_choice(Q, D[None], masked, normalize, False, family=family, exact_words=exact_words)
    if forward.kernel is not dense_specs.TRITON_FORWARD:
        return _chunked(f"maxsim.maxsim scores this call with {forward.kernel.name} ({forward.rule}), whose sums "
                        "the fused Triton kernel does not reproduce bit for bit: the chunked path scores with it")
    config = forward.config
    seg = next_pow2(max(Lq, 1))
    if seg > config.BM:
        return _chunked(f"queries of {Lq} tokens are longer than the tile's {config.BM} rows: each score is a sum "
                        "of several programs' partial sums")
    KB = topk_slots(k)
    per_block = config.BM // seg
    if per_block * KB > limits["MAX_SLOTS"]:
        return _chunked(f"{per_block} queries a row block x {KB} slots = {per_block * KB} buffered keys a program, "
                        f"above the {limits['MAX_SLOTS']} that fit in registers beside the tile (not tuned)")
    rule = (f"the dense tile of maxsim.maxsim ({forward.rule}) with a top-k epilogue of {KB} slots for each of "
            f"its {per_block} queries a row block")
    record = f"{forward.record}; top-k epilogue not tuned"
    return Choice(specs.FUSED_TOPK, config, rule, record, ((specs.CHUNKED_TOPK.name, _CHUNKED_WHY_NOT),))


def _chunked(why_not_fused: str) -> Choice:
    return Choice(specs.CHUNKED_TOPK, None, "the chunked path runs every call the fused kernel does not",
                  _CHUNKED_RECORD, ((specs.FUSED_TOPK.name, why_not_fused),))


def explain_topk(Q, D, k: int, q_mask=None, d_mask=None, *, normalize: bool = False, mask_mode: str = "exclude",
                 subset=None, cu_seqlens_d=None, gpu: str | None = None) -> str:
    """Which path ``maxsim.topk(Q, D, k, q_mask, d_mask, ...)`` runs and why, in words (``gpu``:
    as that family would, e.g. ``"sm90"`` from a laptop). Padded ``Q [Nq, Lq, d]`` or ``[Lq, d]``."""
    packed = isinstance(D, (list, tuple)) or cu_seqlens_d is not None
    Q3 = Q[None] if isinstance(Q, torch.Tensor) and Q.dim() == 2 else Q
    if not isinstance(Q3, torch.Tensor) or Q3.dim() != 3:
        raise ValueError("maxsim: explain_topk takes padded queries Q [Nq, Lq, d] or [Lq, d]")
    layout = "packed" if packed else ("candidates" if subset is not None else "cross")
    docs = D[0] if isinstance(D, (list, tuple)) and D else D
    choice = topk_choice(Q3, docs if not packed else Q3, k, masked=q_mask is not None or d_mask is not None,
                         normalize=normalize, layout=layout, family=gpu,
                         exact_words=True)
    where = f"D {list(D.shape)}" if isinstance(D, torch.Tensor) else f"{len(D)} packed documents"
    header = f"maxsim.topk: Q {list(Q3.shape)} {dtype_name(Q3.dtype)}, {where}, k={k}, layout {layout}"
    return "\n".join([header, choice.describe("  top-k")])
