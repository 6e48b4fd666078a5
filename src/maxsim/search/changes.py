"""Corpora that change: tombstones on disk, the writer of a corpus's changes, leftovers of
interrupted writes, and the id -> position look-up behind ``Corpus.delete`` and ``subset=``.

Tombstones live next to the segment they belong to. A segment entry of the manifest (format.py)
may list, besides its embeddings / lengths / ids files::

    "files": {..., "deleted": {"name": "seg-00000-<tag>.del-<tag2>.npy", "bytes", "crc32"}},
    "num_deleted": m                      # [m] int64 positions in the segment, increasing

and a manifest with any tombstone says ``"tombstones": 1`` (the version of this layout; a larger
one is refused). The file name starts with the segment's stem, so format.py's orphan sweep and its
list of a manifest's files treat it as one of the segment's files: an older maxsim's append keeps
it, and an unlisted one is removed like any orphan. Old corpora (no "deleted" entry) read as
corpora without deletions. A corpus with tombstones is format version 4 (format.py's), which a
maxsim from before deletions refuses ("upgrade maxsim") rather than show deleted documents again;
compacting it away writes the encoding's own version again.

Every write here follows format.py's rule: new files under fresh names (temporary name, fsync,
rename), then the manifest replaced last (the commit point), then unlisted files removed. A kill
at any point leaves the previous or the new manifest, each listing only complete files.
"""

from __future__ import annotations

import copy
import io
import secrets
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch

from maxsim.search import format as corpus_format

# The version of the tombstone layout above (the manifest's "tombstones").
TOMBSTONE_VERSION = 1


class CorpusLeftoversWarning(UserWarning):
    """A corpus folder holds files its manifest does not list (an interrupted or unfinished write)."""


# ---------------------------------------------------------------------------------------------
# ids -> positions


def wanted_ids(ids, int_ids: bool, what: str):
    """Ids a caller names (one id, a list, a numpy array or a tensor) -> an int64 array (a corpus of
    int ids) or a list of str, checked against the corpus's id type."""
    if isinstance(ids, (str, bytes, int, np.integer)) and not isinstance(ids, bool):
        ids = [ids]
    if hasattr(ids, "detach"):  # a torch tensor
        ids = ids.detach().cpu().numpy()
    if isinstance(ids, np.ndarray):
        ids = ids.reshape(-1)
        if int_ids and ids.dtype.kind in "iu":
            return ids.astype(np.int64)
        ids = ids.tolist()
    ids = list(ids)
    if int_ids:
        bad = next((x for x in ids if not isinstance(x, (int, np.integer)) or isinstance(x, bool)), None)
        if bad is not None:
            raise TypeError(f"maxsim: {what} must be int ids, as the corpus's are; got {bad!r}")
        return np.asarray(ids, dtype=np.int64).reshape(-1)
    bad = next((x for x in ids if not isinstance(x, str)), None)
    if bad is not None:
        raise TypeError(f"maxsim: {what} must be str ids, as the corpus's are; got {bad!r}")
    return ids


class IdIndex:
    """Every position of every id (live or deleted: after an update an id has a deleted position
    and a live one). Built once per id list; a delete leaves it valid (it changes no id)."""

    def __init__(self, ids):
        if isinstance(ids, np.ndarray):
            self._order = np.argsort(ids, kind="stable")
            self._sorted = ids[self._order]
            self._first = None
        else:
            self._first = dict(zip(ids, range(len(ids))))  # an id's last position when repeated
            self._more = {}
            if len(self._first) != len(ids):
                for j, x in enumerate(ids):
                    if self._first[x] != j:
                        self._more.setdefault(x, []).append(j)

    def lookup(self, wanted) -> tuple[np.ndarray, np.ndarray]:
        """``wanted`` (as :func:`wanted_ids` gives them) -> ``(which, positions)``: each position
        holding ``wanted[which]``, int64 arrays of one length."""
        if self._first is None:
            lo = np.searchsorted(self._sorted, wanted, side="left")
            counts = np.searchsorted(self._sorted, wanted, side="right") - lo
            which = np.repeat(np.arange(len(wanted), dtype=np.int64), counts)
            starts = np.repeat(lo - (np.cumsum(counts) - counts), counts)
            return which, self._order[starts + np.arange(which.size, dtype=np.int64)].astype(np.int64)
        which, positions = [], []
        for i, x in enumerate(wanted):
            j = self._first.get(x)
            if j is not None:
                for p in [j] + self._more.get(x, []):
                    which.append(i)
                    positions.append(p)
        return np.asarray(which, dtype=np.int64), np.asarray(positions, dtype=np.int64)


def ids_at(ids, positions: np.ndarray):
    """The ids (an int array or a list) at ``positions [Nq, k]`` (into ``ids``); position -1 (no
    answer) has id -1 (int ids, an int64 tensor) or None (str ids, lists)."""
    found = positions >= 0
    local = np.where(found, positions, 0)
    if isinstance(ids, np.ndarray):
        picked = ids[local] if len(ids) else np.zeros(local.shape, dtype=np.int64)
        return torch.from_numpy(np.where(found, picked, -1))
    return [[ids[j] if f else None for f, j in zip(frow, row)] for frow, row in zip(found.tolist(), local.tolist())]


def live_ids(ids, deleted: np.ndarray | None):
    """The ids of the live documents (``deleted``: bool ``[N]``, or None when none is)."""
    if deleted is None:
        return ids
    if isinstance(ids, np.ndarray):
        return ids[~deleted]
    return [x for x, dead in zip(ids, deleted.tolist()) if not dead]


def check_live_ids_unique(ids, deleted: np.ndarray | None, where: str) -> None:
    """Live ids are unique (a deleted document's id may repeat: it was updated)."""
    live = live_ids(ids, deleted)
    if isinstance(live, np.ndarray):
        ordered = np.sort(live)
        twice = ordered[1:][ordered[1:] == ordered[:-1]]
        clash = int(twice[0]) if twice.size else None
    elif len(set(live)) == len(live):
        clash = None
    else:
        seen = set()
        clash = next(x for x in live if x in seen or seen.add(x))
    if clash is not None:
        raise corpus_format.CorpusFormatError(f"maxsim: {where} lists the live document id {clash!r} twice")


# ---------------------------------------------------------------------------------------------
# reading tombstones, leftovers


def read_tombstones(directory: Path, manifest: dict, verify: bool) -> list:
    """The deleted positions of each segment of a checked manifest: an int64 array or None."""
    where = directory / corpus_format.MANIFEST
    version = manifest.get("tombstones", 0)
    if not isinstance(version, int) or version < 0:
        raise corpus_format.CorpusFormatError(f"maxsim: corpus manifest {where} has a bad 'tombstones' entry")
    if version > TOMBSTONE_VERSION:
        raise corpus_format.CorpusFormatError(
            f"maxsim: corpus {where} holds deletions of a newer layout (tombstones {version}); this maxsim reads "
            f"up to {TOMBSTONE_VERSION}: upgrade maxsim")
    out = []
    for number, entry in enumerate(manifest["segments"]):
        file = entry["files"].get("deleted")
        if file is None:
            out.append(None)
            continue
        n, count = entry["num_documents"], entry.get("num_deleted")
        if not isinstance(count, int) or not 0 < count <= n:
            raise corpus_format.CorpusFormatError(f"maxsim: corpus manifest {where} has a bad num_deleted for "
                                                  f"segment {number}")
        path = corpus_format._check_file(directory, file, verify)
        positions = corpus_format._load_npy(path, False, np.int64, (count,))
        if positions[0] < 0 or positions[-1] >= n or (np.diff(positions) <= 0).any():
            raise corpus_format.CorpusFormatError(f"maxsim: corpus file {path} must hold increasing positions in "
                                                  f"0..{n - 1}")
        out.append(positions)
    return out


def leftovers(directory: Path, manifest: dict) -> list[Path]:
    """Files of the corpus folder that ``manifest`` does not list and a write leaves behind when it
    is interrupted: temporaries (``*.tmp``), segment or codec files renamed but never committed,
    or files of a replaced manifest not yet removed (format.py's orphans)."""
    listed = corpus_format._listed(manifest)
    found = []
    for path in directory.iterdir():
        name = path.name
        if (name.startswith(("seg-", "codec-")) and name not in listed) or \
                (name.startswith(corpus_format.MANIFEST) and name != corpus_format.MANIFEST):
            found.append(path)
    return sorted(found)


def _size(total: int) -> str:
    if total < 1024:
        return f"{total} bytes"
    exponent = min(3, int(np.log2(total) // 10))
    return f"{total / 1024 ** exponent:.1f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"


def warn_leftovers(directory: Path, manifest: dict, stacklevel: int = 3) -> None:
    """One warning line naming the leftovers of an interrupted write, their size and the fix.
    Loading never deletes them: a reader may run beside a writer whose files these are, or on a
    read-only copy."""
    found = leftovers(directory, manifest)
    if not found:
        return
    total = 0
    for path in found:
        try:
            total += path.stat().st_size
        except OSError:  # removed meanwhile
            pass
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    warnings.warn(f"maxsim: corpus {directory} holds {len(found)} file(s), {_size(total)}, that its manifest does "
                  f"not list ({found[0].name}{more}), left by an interrupted or unfinished write; the corpus is "
                  f"intact: Corpus.cleanup({str(directory)!r}) or its next save removes them",
                  CorpusLeftoversWarning, stacklevel=stacklevel)


def cleanup(directory) -> list[str]:
    """Remove the leftovers of interrupted writes from a corpus folder -> their names. A write: run
    it when no other process writes the corpus (one writer at a time, format.py)."""
    directory = Path(directory)
    manifest = corpus_format.read_manifest(directory)
    removed = []
    for path in leftovers(directory, manifest):
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def has_tombstones(directory: Path) -> bool:
    """Whether the corpus at ``directory`` lists a deleted document."""
    manifest = corpus_format.read_manifest(directory)
    return any("deleted" in s["files"] for s in manifest["segments"])


# ---------------------------------------------------------------------------------------------
# writing


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _same_content(entry: dict, array: np.ndarray) -> bool:
    data = _npy_bytes(array)
    return entry["bytes"] == len(data) and entry["crc32"] == zlib.crc32(data)


def _write_tombstones(directory: Path, entry: dict, positions: np.ndarray) -> dict:
    """The segment's tombstone file, under a fresh name starting with the segment's stem."""
    main = entry["files"].get("embeddings", entry["files"].get("codes"))
    stem = main["name"].split(".", 1)[0]
    path = directory / f"{stem}.del-{secrets.token_hex(4)}.npy"
    corpus_format._write_array(path, positions)
    return corpus_format._describe(path)


def _dead(corpus, s) -> np.ndarray:
    """The deleted positions of segment ``s`` of ``corpus``: int64, increasing (maybe empty)."""
    if corpus._deleted is None:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(corpus._deleted[s.first_document:s.first_document + s.num_documents]).astype(np.int64)


def _write_segments(directory: Path, corpus, manifest: dict, reuse: bool) -> dict:
    """Write what ``manifest`` lacks of ``corpus`` and commit -> the new manifest. ``reuse``: the
    folder is the corpus's origin, whose segments it loaded (``CorpusSegment.source``) stay."""
    entries = []
    for number, s in enumerate(corpus._segments):
        old = None
        if reuse and s.source is not None:
            entry = copy.deepcopy(s.source)
            old = entry["files"].pop("deleted", None)
            entry.pop("num_deleted", None)
        else:
            array, lengths, ids, scales, residuals = corpus._stored_segment(s)
            entry = corpus_format._write_segment(directory, number, array, lengths, ids, scales, residuals,
                                                 coded=corpus.encoding.has_codec)
        dead = _dead(corpus, s)
        if dead.size:
            same = old is not None and _same_content(old, dead)
            entry["files"]["deleted"] = old if same else _write_tombstones(directory, entry, dead)
            entry["num_deleted"] = int(dead.size)
        entries.append(entry)
    manifest = dict(manifest)
    manifest["segments"] = entries
    manifest["num_documents"] = sum(e["num_documents"] for e in entries)
    manifest["num_tokens"] = sum(e["num_tokens"] for e in entries)
    manifest["encoding"] = corpus_format.manifest_encoding(manifest)
    deleted = any("deleted" in e["files"] for e in entries)
    manifest["version"] = corpus_format.format_version(manifest["encoding"], tombstones=deleted)
    if deleted:
        manifest["tombstones"] = TOMBSTONE_VERSION
    else:
        manifest.pop("tombstones", None)
    corpus_format._replace_manifest(directory, manifest)
    corpus_format._remove_orphans(directory, manifest)
    return manifest


def write_new(directory, corpus, *, overwrite: bool) -> dict:
    """Write ``corpus`` (with its tombstones) as a new corpus at ``directory``, replacing one there
    only with ``overwrite`` -> the manifest. One commit: the corpus and its deletions appear
    together."""
    directory = Path(directory)
    exists = (directory / corpus_format.MANIFEST).is_file()
    if exists and not overwrite:
        raise FileExistsError(f"maxsim: {directory} already holds a corpus (pass overwrite=True or append=True)")
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"maxsim: {directory} exists and is not a directory")
    if directory.is_dir() and not exists:
        strangers = [p.name for p in directory.iterdir()
                     if not p.name.startswith(("seg-", "codec-", corpus_format.MANIFEST))]
        if strangers:
            raise FileExistsError(f"maxsim: {directory} is not empty and not a corpus ({strangers[0]}, ...)")
    directory.mkdir(parents=True, exist_ok=True)
    encoding = corpus.encoding
    manifest = {"format": corpus_format.FORMAT_NAME, "version": corpus_format.format_version(encoding),
                "dim": corpus.dim, "dtype": encoding.stored_dtype, "encoding": encoding,
                "id_type": "int" if isinstance(corpus.ids, np.ndarray) else "str", "num_documents": 0,
                "num_tokens": 0, "segments": []}
    if encoding.has_codec:
        manifest["codec"] = corpus_format._write_codec(directory, encoding, encoding.tables(corpus.codec))
    return _write_segments(directory, corpus, manifest, reuse=False)


def write_changes(directory: Path, corpus) -> dict:
    """Write ``corpus``'s changes to its origin ``directory`` (the folder it was loaded from):
    segments appended or compacted since, and its tombstones; the segments it loaded are not
    rewritten. Refused when the folder changed since (another write), whose changes this would
    drop. -> the manifest."""
    manifest = corpus_format.read_manifest(directory)
    if manifest["segments"] != corpus._origin[1]:
        raise ValueError(f"maxsim: the corpus {directory} changed on disk since this corpus was loaded from it "
                         "(another write): load it again and redo the changes")
    stored = read_tombstones(directory, manifest, verify=False)
    kept = [s.source is not None and s.source == entry
            and np.array_equal(_dead(corpus, s), np.zeros(0) if dead is None else dead)
            for s, entry, dead in zip(corpus._segments, manifest["segments"], stored)]
    if len(corpus._segments) == len(manifest["segments"]) and all(kept):
        return manifest  # nothing changed: no write
    return _write_segments(directory, corpus, manifest, reuse=True)
