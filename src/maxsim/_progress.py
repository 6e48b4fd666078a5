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


def say(bar, text: str) -> None:
    """A message on stderr that a live bar does not overwrite (tqdm clears and redraws it)."""
    if bar is None:
        print(text, file=sys.stderr)
    else:
        bar.write(text, file=sys.stderr)


class stage:
    """``with stage(bar, "training a residual2 codec"):`` names a step that reports no progress of
    its own: the bar shows the name and the seconds it has run (refreshed twice a second), then
    its old description again. Without a bar, nothing (the caller has said what it does)."""

    def __init__(self, bar, name: str):
        self.bar, self.name = bar, name

    def __enter__(self):
        import threading
        import time

        if self.bar is None:
            return self
        self._old = self.bar.desc
        self._done = threading.Event()
        start = time.perf_counter()
        self.bar.set_description_str(self.name, refresh=False)

        def tick():
            while not self._done.wait(0.5):
                self.bar.set_postfix_str(f"{time.perf_counter() - start:.0f} s")

        self._thread = threading.Thread(target=tick, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self._done.set()
            self._thread.join()
            self.bar.set_postfix_str("", refresh=False)
            self.bar.set_description_str(self._old)
        return False
