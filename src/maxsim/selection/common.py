"""What the dense and packed selectors share: the call's device family, the backward strategy
rule of ``backward="auto"``, config clamps, and the plan's words for ``maxsim.explain``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from maxsim._capability import Call, KernelSpec
from maxsim._checks import check_choice
from maxsim._dispatch import cuda_index, interpreting
from maxsim.tuning import gpu_family
from maxsim.tuning import tables as T

STRATEGIES = ("auto", "unified", "lowmem")
TRITON_VERSION = tuple(int(x) for x in triton.__version__.split(".")[:2])


def device_of(t: torch.Tensor) -> tuple[int, str]:
    """(device index, tile family) of the tensors a launch will run on (-1 in the interpreter)."""
    index = -1 if interpreting() else cuda_index(t)
    return index, gpu_family(index)


def call_of(dtype, d, layout, masked, normalize, argmax, family, layout_notes=()) -> Call:
    return Call(dtype, d, layout, masked, normalize, argmax, family, TRITON_VERSION, layout_notes)


@dataclass(frozen=True)
class Choice:
    """One decision: the kernel chosen, its configuration, the rule that gave it, and every other
    candidate with the reason it was not taken."""

    kernel: KernelSpec
    config: object
    rule: str
    record: str
    rejected: tuple[tuple[str, str], ...] = ()

    def describe(self, what: str) -> str:
        lines = [f"{what}: {self.kernel.name} — {self.kernel.summary}",
                 f"    configuration: {format_config(self.config)}",
                 f"    rule: {self.rule} (record: {self.record})"]
        lines += [f"    not {name}: {why}" for name, why in self.rejected]
        return "\n".join(lines)


def parse_tile_spec(spec: str, variable: str, config_type, required: tuple[str, ...], extra: tuple[str, ...] = ()):
    """``"BM=128,BN=64,..."`` (a tuning sweep's forced tile, from the environment variable
    ``variable``) -> (``config_type``'s fields as ints, or bools for its bool fields; the ``extra``
    keys as given). Anything else (a field without a value, an unknown one, a non-number, a
    required one missing) is one ValueError naming the fields."""
    fields = {f.name: f for f in dataclasses.fields(config_type)}
    items = [item.split("=", 1) for item in spec.replace(" ", "").split(",") if item]
    given = dict(item for item in items if len(item) == 2)
    flags = {name for name, f in fields.items() if f.type in (bool, "bool")}
    well_formed = (len(given) == len(items) and set(given) <= set(fields) | set(extra) and set(required) <= set(given)
                   and all(v.isdigit() for k, v in given.items() if k in fields and k not in flags))
    if not well_formed:
        optional = [name for name in fields if name not in required] + list(extra)
        raise ValueError(f"maxsim: {variable} needs {', '.join(required)} as integers "
                         f"(and may set {', '.join(optional)}); got {spec!r}")
    values = {k: (v.lower() in ("1", "true", "yes")) if k in flags else int(v) for k, v in given.items()
              if k in fields}
    return values, {k: v for k, v in given.items() if k in extra}


def format_config(config) -> str:
    if config is None:
        return "(none)"
    if dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)
    return " ".join(f"{k}={v}" for k, v in config.items() if v is not False)


PRECISIONS = ("auto", "ieee", "fp16x3", "tf32x3", "tf32")
_PRECISION_WORDS = {
    "ieee": "IEEE fp32 FMAs on the CUDA cores (exact products)",
    "fp16x3": ("split precision on chip: each fp32 tile row scaled by a power of two and split into two "
               "fp16 terms, three fp16 tensor-core products summed in fp32 (fp32-accurate)"),
    "fp16x3-copy": ("split precision through the 16-bit kernels: an fp16 copy of each value as two terms "
                    "(6 bytes a value), three fp16 tensor-core products summed in fp32 (fp32-accurate)"),
    "tf32x3": "split precision on the tensor cores: three TF32 products summed in fp32 (fp32-accurate)",
    "tf32": "one TF32 tensor-core product (10-bit mantissas: relative error near 1e-4)",
}


def precision_choice(dtype: torch.dtype, precision: str, family: str, rows: int = 0,
                     doc_values: int = 0, packed: bool = False, training: bool = False) -> tuple[str, str]:
    """(the fp32 product a call runs, why) for inputs of ``dtype``, a call's ``precision=``, the
    device family and ``rows``, the query rows that share each document token (Nq Lq for a cross
    product, Lq for candidate lists). The product: "ieee", "tf32x3", "tf32" (Triton's
    ``input_precision`` in the fp32 kernels), "fp16x3" (the split on chip, in the same kernels) or
    "fp16x3-copy" (the split copied once, through the 16-bit kernels: where many rows share each
    document token, so the product and not the read sets the time). ``doc_values``: the documents'
    values (tokens x d; ``packed``: packed documents, whose copy is made whole, so it is bounded).
    ``training``: the forward feeds a backward, where the split stays on chip up to a larger call.
    16-bit inputs' products are exact in fp32 whatever it says."""
    check_choice("precision", precision, PRECISIONS)
    if dtype != torch.float32:
        return "tf32", "16-bit inputs: every product is exact in fp32 (precision= applies to fp32 inputs)"
    if precision == "auto" and family not in T.SPLIT16_FAMILIES:
        if family in T.SPLIT_FP32_FAMILIES:
            return "tf32x3", f"{_PRECISION_WORDS['tf32x3']}, verified on {family}"
        return "ieee", (f"{_PRECISION_WORDS['ieee']}: no split-precision product has been verified on "
                        f"{family} (precision='fp16x3' or 'tf32x3' asks for one)")
    if precision not in ("auto", "fp16x3"):
        return precision, _PRECISION_WORDS[precision]
    copy_bytes = doc_values * 6 if packed else 0
    if rows < T.SPLIT16_MIN_ROWS:
        return "fp16x3", (f"{_PRECISION_WORDS['fp16x3']}: {rows} query rows share each document token "
                          f"(< {T.SPLIT16_MIN_ROWS}), where reading the fp32 documents sets the time")
    if training and rows * doc_values < T.SPLIT16_MIN_PRODUCTS_TRAINING:
        return "fp16x3", (f"{_PRECISION_WORDS['fp16x3']}: a training step's forward of "
                          f"{rows * doc_values / 1e9:.2g}G products (< {T.SPLIT16_MIN_PRODUCTS_TRAINING / 1e9:.3g}G), "
                          f"where the copy and its argmax forward at 3 x d cost more than the split")
    if rows * doc_values < T.SPLIT16_MIN_PRODUCTS:
        return "fp16x3", (f"{_PRECISION_WORDS['fp16x3']}: a small call ({rows * doc_values / 1e9:.2g}G products "
                          f"< {T.SPLIT16_MIN_PRODUCTS / 1e9:.2g}G), where the copy's extra launches cost more "
                          f"host time than its product saves")
    limit = T.split16_scratch_bytes(doc_values * 4)
    if copy_bytes > limit:
        return "fp16x3", (f"{_PRECISION_WORDS['fp16x3']}: a copy of the packed documents would take "
                          f"{copy_bytes / 2**20:.0f} MiB, past the scratch limit ({limit / 2**20:.0f} MiB: 256 MiB "
                          f"or 5 % of the documents)")
    return "fp16x3-copy", (f"{_PRECISION_WORDS['fp16x3-copy']}: {rows} query rows share each document token "
                           f"(>= {T.SPLIT16_MIN_ROWS}), where the product sets the time")


def auto_strategy(one_query_per_document: bool, lq: int, fp32_buffer_bytes: int,
                  one_hot_kernel: bool) -> tuple[str, str, str, str]:
    """``backward="auto"``, the one rule for dense and packed calls: (strategy, why, why not the
    other, the benchmark record behind it). ``one_query_per_document``: each document belongs to one query (candidate lists);
    ``one_hot_kernel``: the family has lowmem's one-hot kernel for that case (a declared
    capability: the dense family has it, the packed one not)."""
    gib = fp32_buffer_bytes / 2**30
    limit = T.UNIFIED_MAX_FP32_BYTES / 2**30
    if one_query_per_document and one_hot_kernel and lq <= T.LISTS_MAX_LQ:
        return ("lowmem", f"candidate lists with Lq {lq} <= {T.LISTS_MAX_LQ}: the one-hot kernel is faster there "
                f"and needs no fp32 buffer",
                f"slower on candidate lists up to Lq {T.LISTS_MAX_LQ}, and needs an fp32 buffer of D's size",
                "results/lists-threshold-20261130-0136.log")
    if fp32_buffer_bytes > T.UNIFIED_MAX_FP32_BYTES:
        return ("lowmem", f"unified's fp32 buffer would be {gib:.1f} GiB, above the {limit:.0f} GiB auto limit",
                f"its fp32 buffer of {gib:.1f} GiB passes the {limit:.0f} GiB limit of backward='auto'",
                "a memory rule, not a timing")
    return ("unified", "the fastest strategy here (fp32 atomics; the last bits of grad_D vary run to run)",
            "slower here (deterministic and lighter: pick it with backward='lowmem')",
            "results/train-20261130-012414.csv")


def clamp(config, family: str, varlen: bool = False):
    """The sm90 choice as run on ``family``: unchanged on sm90, clamped on the interpreter and on
    GPUs nobody measured (:mod:`maxsim.tuning.tables`)."""
    if family == "sm90":
        return config
    if family == "interpreter":
        c = T.VARLEN_INTERPRETER_CLAMP if varlen else T.INTERPRETER_CLAMP
        fields = dict(BM=min(config["BM"], c["BM_MAX"]), BN=min(config["BN"], c["BN_MAX"]),
                      num_warps=c["num_warps"], num_stages=c["num_stages"])
        if "waves" in c:
            fields["waves"] = c["waves"]
        return {**config, **fields}
    c = T.UNMEASURED_CLAMP
    out = {**config, "BM": min(config["BM"], c["BM_MAX"]), "BN": min(config["BN"], c["BN_MAX"]),
           "num_stages": min(config["num_stages"], c["STAGES_MAX"])}
    if "tma" in out:
        out["tma"] = c["tma"]
    return out
