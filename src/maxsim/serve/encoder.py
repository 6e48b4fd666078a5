"""The text model of ``python -m maxsim serve CORPUS --model PATH``.

A local multi-vector model folder, loaded once: PyLate's ``ColBERT`` when PyLate imports, else
Sentence Transformers 6's ``MultiVectorEncoder``. It turns query texts (the model's query side:
PyLate's ``is_query=True``, Sentence Transformers' ``encode_query``) and document texts (the
document side) into ``[L, d]`` float32 arrays; the server then treats them exactly as token
arrays sent by a client. Nothing is fetched from the Hugging Face hub (``local_files_only``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings

import numpy as np

INSTALL = 'pip install pylate (or "sentence-transformers>=6")'


def _first_line(err: BaseException, limit: int = 300) -> str:
    """An exception's first non-empty line (libraries' load errors run to paragraphs)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else type(err).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _library():
    """``("pylate", ColBERT)`` or ``("sentence-transformers", MultiVectorEncoder)``, whichever
    imports first; neither: an ImportError that says why and names the install command."""
    from importlib import metadata, util

    why = []
    if util.find_spec("pylate") is None:
        why.append("PyLate is not installed")
    else:
        try:
            from pylate.models import ColBERT

            return "pylate", ColBERT
        except Exception as err:  # installed against other versions: try the other library
            why.append(f"PyLate does not import ({_first_line(err)})")
    if util.find_spec("sentence_transformers") is None:
        why.append("Sentence Transformers is not installed")
    else:
        try:
            from sentence_transformers import MultiVectorEncoder  # Sentence Transformers >= 6

            return "sentence-transformers", MultiVectorEncoder
        except Exception as err:
            try:
                version = metadata.version("sentence-transformers")
            except metadata.PackageNotFoundError:
                version = "?"
            major = version.split(".")[0]
            why.append(f"sentence-transformers {version} has no MultiVectorEncoder (6 has)"
                       if major.isdigit() and int(major) < 6 and isinstance(err, ImportError)
                       else f"Sentence Transformers does not import ({_first_line(err)})")
    raise ImportError(f"maxsim: --model needs PyLate or Sentence Transformers 6 ({'; '.join(why)}): {INSTALL}")


@contextlib.contextmanager
def _quiet():
    """The libraries' loading chatter (progress bars, "no sentence-transformers model found",
    warnings) silenced, so that a failed start is one line; levels restored afterwards."""
    loggers = [logging.getLogger(name) for name in ("transformers", "sentence_transformers", "pylate",
                                                     "huggingface_hub")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    bars = None
    try:
        from transformers.utils import logging as transformers_logging

        bars = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()
    except Exception:
        transformers_logging = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if transformers_logging is not None and bars:
            transformers_logging.enable_progress_bar()


def _arrays(out) -> list[np.ndarray]:
    """A model's output (a list of ``[L, d]`` tensors or arrays) as float32 numpy arrays."""
    items = list(out) if isinstance(out, (list, tuple)) else [out[i] for i in range(len(out))]
    return [np.asarray(x.detach().float().cpu().numpy() if hasattr(x, "detach") else x, dtype=np.float32)
            for x in items]


class TextEncoder:
    """The model folder ``path`` on ``device``: :meth:`queries` and :meth:`documents` (blocking,
    thread-safe: one encode at a time), ``dim``, ``library``, ``path``.

    Raises ImportError (neither library imports) or ValueError (``path`` is not a folder, does not
    load, or does not encode), each one line naming the cause."""

    def __init__(self, path, device=None):
        self.path = str(path)
        if not os.path.isdir(self.path):
            raise ValueError(f"maxsim: the model {self.path} is not a folder (--model takes a local model folder)")
        self.library, model_class = _library()
        self.device = None if device is None else str(device)
        what = "a PyLate ColBERT" if self.library == "pylate" else "a Sentence Transformers MultiVectorEncoder"
        try:
            with _quiet():
                self.model = model_class(model_name_or_path=self.path, device=self.device, local_files_only=True)
                self.model.eval()
        except Exception as err:
            raise ValueError(f"maxsim: the model folder {self.path} does not load as {what} model: "
                             f"{_first_line(err)}") from None
        self._lock = threading.Lock()
        try:
            probe = self.queries(["maxsim"])
        except Exception as err:
            raise ValueError(f"maxsim: the model {self.path} loads but does not encode: {_first_line(err)}") from None
        if len(probe) != 1 or probe[0].ndim != 2:
            raise ValueError(f"maxsim: the model {self.path} is not a multi-vector model: it encodes a text as "
                             f"shape {list(probe[0].shape) if probe else []}, not [tokens, d]")
        self.dim = int(probe[0].shape[1])

    def _encode(self, texts: list, query: bool) -> list[np.ndarray]:
        with self._lock:  # a tokenizer is not safe to share between threads
            if self.library == "pylate":
                out = self.model.encode(texts, is_query=query, show_progress_bar=False, convert_to_numpy=True)
            else:
                side = self.model.encode_query if query else self.model.encode_document
                out = side(texts, show_progress_bar=False, convert_to_numpy=True)
        return _arrays(out)

    def queries(self, texts: list) -> list[np.ndarray]:
        """Query texts -> one ``[L, d]`` float32 array each (the model's query side)."""
        return self._encode(texts, True)

    def documents(self, texts: list) -> list[np.ndarray]:
        """Document texts -> one ``[L, d]`` float32 array each (the model's document side)."""
        return self._encode(texts, False)
