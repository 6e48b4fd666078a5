"""Progress bars for long work (corpus search, PQ training): tqdm where it is installed and wanted."""

from __future__ import annotations

import sys


_HINTED = []  # the missing-tqdm hint, once per process


def progress_bar(progress, total: int, description: str, unit: str):
    """A tqdm bar of ``total`` ``unit``s, or None: ``progress`` False, or None while stderr is not a
    terminal, or tqdm not installed (an optional dependency: a bar that was wanted then prints,
    once, how to get it)."""
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if not _HINTED:
            _HINTED.append(True)
            print('maxsim: no progress bar without tqdm: pip install tqdm (or "maxsim[search]")', file=sys.stderr)
        return None
    return tqdm(total=total, unit=unit, unit_scale=True, desc=description, leave=False, dynamic_ncols=True)
