"""How a tile table is read: ordered rules, the first whose conditions hold gives the tile.

A table is data (:mod:`maxsim.tuning.tables`); this module only matches a call's bucketed features
against it. Features are small integers and flags of power-of-two buckets, so a new batch size or
document length never selects, and never compiles, anything new.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


@dataclass(frozen=True)
class When:
    """Conditions on a call's features; None = any. Ranges are inclusive ``(low, high)``.

    dtype: ``"fp32"`` or ``"16bit"``.  long_corpus: at least ``WS_ONE_BLOCK_MIN_TOKENS`` document
    tokens.  d: the embedding dim.  rows: the stacked query rows of a
    program's block (a power of two).  seg: the query length's power-of-two bucket.
    big_corpus: at least ``BIG_CORPUS_TOKENS`` document tokens.  argmax: the forward saves the
    argmax (training).  candidates: per-query candidate lists.  lq: the query length.
    scatter: the backward adds grad_D by atomics (unified).  per_row: entries per grad_D row.
    row_blocks: how many query row blocks read (and, in the fused head, project) each document tile.
    masked: the call has a query or document mask (with a document mask under the exclusion rule,
    documents walk only to their last real token; a query mask alone or PyLate's rule walks every tile).
    precision: the product fp32 tiles take (``"ieee"``, ``"tf32"``, ``"tf32x3"``, ``"fp16x3"``).
    """

    dtype: str | None = None
    d: tuple[int, int] | None = None
    rows: tuple[int, int] | None = None
    seg: tuple[int, int] | None = None
    big_corpus: bool | None = None
    long_corpus: bool | None = None
    argmax: bool | None = None
    candidates: bool | None = None
    lq: tuple[int, int] | None = None
    scatter: bool | None = None
    per_row: tuple[float, float] | None = None
    row_blocks: tuple[int, int] | None = None
    masked: bool | None = None
    precision: str | None = None

    def holds(self, features: dict) -> bool:
        for name, want in self.__dict__.items():
            if want is None:
                continue
            have = features[name]
            if isinstance(want, tuple):
                if not want[0] <= have <= want[1]:
                    return False
            elif have != want:
                return False
        return True


INF = 1 << 62


@dataclass(frozen=True)
class Rule:
    """One row of a table: ``when`` the call's features hold, use ``tile``.

    name: a short label that ``maxsim.explain`` prints.  record: the benchmark record the tile
    was measured in (a file under ``benchmarks/results/`` or a section of BENCHMARKS.md /
    benchmarks/HISTORY.md); "not tuned" for fixed starting points.
    Tile values may be symbolic: ``"rows"`` = max(16, rows), ``"rows<=128"`` = min(128, max(16,
    rows)) (``"rows<=64"``, ``"rows<=32"`` likewise), ``"d"`` = max(16, next_pow2(d)), ``"d<=64"`` = min(64, max(16,
    next_pow2(d))) (``"d<=128"`` likewise).
    """

    name: str
    when: When
    tile: dict = field(default_factory=dict)
    record: str = "not tuned"


def resolve(value, features: dict):
    """A tile value with its symbols replaced by the call's numbers."""
    if not isinstance(value, str):
        return value
    rows, bk = max(16, features.get("rows", 16)), max(16, next_pow2(features.get("d", 16)))
    return {"rows": rows, "rows<=128": min(128, rows), "rows<=64": min(64, rows), "rows<=32": min(32, rows), "d": bk, "d<=64": min(64, bk),
            "d<=128": min(128, bk)}[value]


def first_match(table: tuple[Rule, ...], features: dict) -> Rule:
    """The first rule of ``table`` that holds (every table ends with a rule that always does)."""
    for rule in table:
        if rule.when.holds(features):
            return rule
    raise LookupError(f"maxsim: no tile rule holds for {features}")  # a table without a default row


def tile_of(rule: Rule, features: dict) -> dict:
    return {k: resolve(v, features) for k, v in rule.tile.items()}
