"""The corpus file format: a directory of ``.npy`` files and a small JSON manifest.

Layout (format version 1; version 2 adds the one-byte encodings, version 3 the residual and PQ
encodings)::

    corpus/
      manifest.json                       the commit point: what is listed here is the corpus
      codec-<tag>.centroids.npy           [C, d] fp16 / fp32 centroids        (residual corpora only,
      codec-<tag>.bucket_weights.npy      [2**nbits] fp32                       one set a corpus)
      codec-<tag>.bucket_cutoffs.npy      [2**nbits - 1] fp32 (when the codec has them)
      codec-<tag>.avg_residual.npy        fp32 (when the codec has it; kept, unused)
      codec-<tag>.codebooks.npy           [m, 256, d / m] fp32                (PQ corpora only)
      seg-00000-<tag>.emb.npy             [t, d] token embeddings of segment 0 (C order)
      seg-00000-<tag>.scl.npy             [t] fp32 scale of each token (int8 / fp8 corpora only)
      seg-00000-<tag>.codes.npy           [t] int32 centroid ids (residual) or [t, m] uint8 (PQ),
                                          in place of .emb.npy
      seg-00000-<tag>.res.npy             [t, d * nbits / 8] uint8 packed residuals (residual only)
      seg-00000-<tag>.len.npy             [n] int64 token count of each document
      seg-00000-<tag>.ids.npy | .ids.json [n] int64 ids, or a JSON list of n strings
      seg-00001-<tag>....                 one segment per save/append

    manifest.json = {"format": "maxsim-corpus", "version": 1, "dim": d, "dtype": "float16",
                     "encoding": "float16", "id_type": "int" | "str", "num_documents": N,
                     "num_tokens": T, "segments": [{"num_documents": n, "num_tokens": t,
                                   "files": {"embeddings": {"name", "bytes", "crc32"},
                                             "lengths": {...}, "ids": {...}}}]}
    version 3 (residual / PQ) adds  "codec": {"kind": "residual", "nbits": 2, "num_centroids": C,
                                              "files": {"centroids": {...}, "bucket_weights": {...},
                                                        ...}}
                                or  "codec": {"kind": "pq", "m": m, "files": {"codebooks": {...}}}
                    and its segments list "codes" (and "residuals") in place of "embeddings".

Encodings: "float16" / "bfloat16" / "float32" store the embeddings as they are (version 1; a
manifest without "encoding", as the first version-1 writers left it, means its "dtype"). "int8" /
"fp8" (version 2, so that an older maxsim refuses them by version rather than misreading them)
store per-token quantised values (``maxsim.compressed.quantized.quantize_tokens``): "dtype" is
"int8" or "float8_e4m3fn", and each segment adds a "scales" file, ``[t]`` fp32. NumPy has no
float8: fp8 values are stored as their uint8 bits. "residual<nbits>" (nbits 1, 2, 4 or 8;
"residual2" and "residual4" are the documented ones) and "pq<m>" (version 3) store PLAID residual
codes (``maxsim.compressed.ResidualCodec``: a centroid id and d * nbits / 8 bytes a token; "dtype"
"int32", the codes') or product-quantisation codes (``maxsim.compressed.ProductQuantizer``: m
bytes a token; "dtype" "uint8"); their codec's tables are stored once per corpus, as checked files
listed under the manifest's "codec", and every segment is encoded with that codec.

Why ``.npy`` (not safetensors): ``numpy.load(mmap_mode=...)`` maps the file with no copy and no
extra dependency (numpy is already one of maxsim's); a header of a few dozen bytes, padded to a
64-byte boundary, precedes the raw C-order data, so the mapped array is aligned; and a segment is
written from any array-like in a streaming ``tofile``, where safetensors' writer takes a dict of
whole in-memory tensors. NumPy has no bfloat16: bf16 embeddings are stored as their uint16 bits and
the manifest's ``dtype`` says "bfloat16".

Safety:
- Every file's exact size and CRC-32 are in the manifest (segment and codec files alike). Opening
  checks every size and header (a truncated or extended file is an error naming it);
  ``verify=True`` also checks every CRC (one sequential read of the corpus), so a corrupted byte
  is an error, never a wrong answer.
- A manifest of a newer format version is refused with an error naming the file.
- Writes are atomic: codec and segment files are written under a temporary name, fsynced and
  renamed to names with a fresh random tag (never over a file the current manifest lists); then
  the manifest is written to a temporary name, fsynced and renamed over the old one (and the
  directory fsynced). An interrupted save or append leaves the previous manifest, hence the
  previous corpus, intact; the orphaned files it may leave are removed by the next write.
- One writer at a time (no locking).
"""

from __future__ import annotations

import json
import os
import secrets
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from maxsim.search import encodings
from maxsim.search.encodings import Encoding

FORMAT_NAME = "maxsim-corpus"
# The newest version this code reads; float corpora are still written as version 1, int8 / fp8 as
# version 2, residual / PQ as version 3, any corpus with deleted documents (tombstones) as version 4,
# so that a maxsim from before deletions refuses it instead of showing its deleted documents.
FORMAT_VERSION = 4
TOMBSTONES_FORMAT_VERSION = 4
MANIFEST = "manifest.json"
_CRC_BLOCK = 16 << 20
# dtype names of the manifest -> the numpy dtype the .npy file holds.
STORED_DTYPES = {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16, "int8": np.int8,
                 "float8_e4m3fn": np.uint8, "int32": np.int32, "uint8": np.uint8}
class CorpusFormatError(ValueError):
    """A corpus directory or file that cannot be read: missing, truncated, corrupted, too new."""


@dataclass
class Segment:
    """One segment as read from disk: ``embeddings [t, d]`` (numpy, maybe memory-mapped, bf16 as
    uint16, fp8 as uint8; for a residual / PQ corpus its codes, ``[t]`` int32 / ``[t, m]`` uint8),
    ``lengths [n]`` int64, ``ids`` (int64 numpy array or list of str), ``scales [t]`` fp32 (maybe
    memory-mapped) for an int8 / fp8 corpus, else None; ``residuals [t, d * nbits / 8]`` uint8 for
    a residual corpus, else None."""

    embeddings: np.ndarray
    lengths: np.ndarray
    ids: object
    scales: np.ndarray | None = None
    residuals: np.ndarray | None = None


def format_version(encoding, tombstones: bool = False) -> int:
    """The version a corpus of ``encoding`` (with deleted documents or not) is written as: the
    oldest that can hold it."""
    return TOMBSTONES_FORMAT_VERSION if tombstones else encodings.encoding(encoding).format_version


def manifest_encoding(manifest: dict) -> Encoding | None:
    """The Encoding of a manifest (one without the field: its dtype, a float); None when the name
    means none (read_manifest refuses such a manifest)."""
    return encodings.parse(manifest.get("encoding", manifest["dtype"]))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CRC_BLOCK)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def _write_array(path: Path, array: np.ndarray) -> None:
    """Write a .npy atomically: temporary name, fsync, rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.lib.format.write_array(f, np.ascontiguousarray(array) if not array.flags.c_contiguous else array,
                                  allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _replace_manifest(directory: Path, manifest: dict) -> None:
    """The commit point of every write."""
    _write_json(directory / MANIFEST, manifest)
    _fsync_dir(directory)


def _describe(path: Path) -> dict:
    return {"name": path.name, "bytes": path.stat().st_size, "crc32": file_crc32(path)}


def read_manifest(directory) -> dict:
    """Read and check a corpus manifest (format name, version, fields)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise CorpusFormatError(f"maxsim: {directory} is not a corpus: {path} is missing")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorpusFormatError(f"maxsim: corpus manifest {path} is corrupted: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CorpusFormatError(f"maxsim: {path} is not a maxsim corpus manifest")
    version = manifest.get("version")
    if not isinstance(version, int):
        raise CorpusFormatError(f"maxsim: corpus manifest {path} has no format version")
    if version > FORMAT_VERSION:
        raise CorpusFormatError(
            f"maxsim: corpus {path} was written by a newer format version ({version}); this maxsim reads "
            f"versions up to {FORMAT_VERSION}: upgrade maxsim")
    for key in ("dim", "dtype", "id_type", "num_documents", "num_tokens", "segments"):
        if key not in manifest:
            raise CorpusFormatError(f"maxsim: corpus manifest {path} lacks {key!r}")
    if manifest["dtype"] not in STORED_DTYPES:
        raise CorpusFormatError(f"maxsim: corpus manifest {path} has an unknown dtype {manifest['dtype']!r}")
    encoding = manifest_encoding(manifest)
    if encoding is None or manifest["dtype"] != encoding.stored_dtype or version < encoding.format_version:
        named = manifest.get("encoding", manifest["dtype"])
        raise CorpusFormatError(f"maxsim: corpus manifest {path} has an inconsistent encoding {named!r} "
                                f"(dtype {manifest['dtype']!r}, version {version})")
    if encoding.has_codec:
        _check_codec_entry(path, manifest, encoding)
    return manifest


def _check_codec_entry(path: Path, manifest: dict, encoding: Encoding) -> None:
    """The "codec" entry of a residual / PQ manifest: its kind, parameters and files."""
    codec, dim = manifest.get("codec"), manifest["dim"]
    if not isinstance(codec, dict) or not isinstance(codec.get("files"), dict):
        raise CorpusFormatError(f"maxsim: corpus manifest {path} of {encoding} codes lists no codec")
    if not encoding.check_codec_entry(codec, dim):
        raise CorpusFormatError(f"maxsim: corpus manifest {path} has a codec entry that does not fit its "
                                f"{encoding} codes of d={dim}")
    for name, required in encoding.codec_files:
        if required and name not in codec["files"]:
            raise CorpusFormatError(f"maxsim: corpus manifest {path} lists no {name} file for its {encoding} codec")


def _check_file(directory: Path, entry: dict, verify: bool) -> Path:
    path = directory / entry["name"]
    if not path.is_file():
        raise CorpusFormatError(f"maxsim: corpus file {path} is missing")
    size = path.stat().st_size
    if size != entry["bytes"]:
        what = "truncated" if size < entry["bytes"] else "longer than written"
        raise CorpusFormatError(f"maxsim: corpus file {path} is {what}: {size} bytes, the manifest says {entry['bytes']}")
    if verify and file_crc32(path) != entry["crc32"]:
        raise CorpusFormatError(f"maxsim: corpus file {path} is corrupted (CRC-32 mismatch)")
    return path


def _load_npy(path: Path, mmap: bool, dtype, shape) -> np.ndarray:
    try:
        # "c" (copy-on-write) maps the file read-only on disk but gives a writable array, which
        # torch.from_numpy takes without a warning; nothing is ever written back.
        array = np.load(path, mmap_mode="c" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise CorpusFormatError(f"maxsim: corpus file {path} cannot be read as .npy: {err}") from None
    if array.dtype != np.dtype(dtype) or tuple(array.shape) != tuple(shape):
        raise CorpusFormatError(f"maxsim: corpus file {path} holds {array.dtype} {list(array.shape)}; "
                                f"the manifest says {np.dtype(dtype)} {list(shape)}")
    return array


def read_codec(directory, manifest: dict, *, verify: bool = True) -> dict[str, np.ndarray] | None:
    """The codec tables of a checked residual / PQ manifest -> ``{name: array}`` (read into memory,
    sizes, headers and shapes checked; CRCs with ``verify``); None for other encodings."""
    directory = Path(directory)
    encoding = manifest_encoding(manifest)
    if not encoding.has_codec:
        return None
    shapes = encoding.table_shapes(manifest["codec"], manifest["dim"])  # {name: (shape or None, dtypes)}
    entry = manifest["codec"]
    tables = {}
    for name, file in entry["files"].items():
        if name not in shapes:
            raise CorpusFormatError(f"maxsim: corpus manifest {directory / MANIFEST} lists an unknown codec "
                                    f"file {name!r}")
        path = _check_file(directory, file, verify)
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as err:
            raise CorpusFormatError(f"maxsim: corpus file {path} cannot be read as .npy: {err}") from None
        shape, allowed = shapes[name]
        if array.dtype not in [np.dtype(t) for t in allowed] or (shape is not None and tuple(array.shape) != shape):
            want = " or ".join(str(np.dtype(t)) for t in allowed)
            raise CorpusFormatError(f"maxsim: corpus file {path} holds {array.dtype} {list(array.shape)}; the "
                                    f"manifest says {want} {list(shape) if shape is not None else '[...]'}")
        tables[name] = array
    return tables


def open_corpus(directory, *, mmap: bool = True, verify: bool = True) -> tuple[dict, list[Segment]]:
    """Check and open every segment of a corpus directory -> ``(manifest, segments)`` (a residual /
    PQ corpus's codec: :func:`read_codec`)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    dim, stored = manifest["dim"], STORED_DTYPES[manifest["dtype"]]
    encoding = manifest_encoding(manifest)
    quantized, residual = encoding.has_scales, encoding.has_residuals
    main, row = encoding.main_part, encoding.row_shape(dim)
    segments = []
    total_docs = total_tokens = 0
    for number, entry in enumerate(manifest["segments"]):
        files = entry["files"]
        n, t = entry["num_documents"], entry["num_tokens"]
        needed = [main, "lengths", "ids"] + (["scales"] if quantized else []) + (["residuals"] if residual else [])
        for key in needed:
            if key not in files:
                raise CorpusFormatError(f"maxsim: corpus manifest {directory / MANIFEST} lists no {key} file for "
                                        f"segment {number} of its {encoding} tokens")
        emb_path = _check_file(directory, files[main], verify)
        len_path = _check_file(directory, files["lengths"], verify)
        ids_path = _check_file(directory, files["ids"], verify)
        embeddings = _load_npy(emb_path, mmap, stored, (t,) + row)
        scales = residuals = None
        if quantized:
            scales = _load_npy(_check_file(directory, files["scales"], verify), mmap, np.float32, (t,))
        if residual:
            packed = encoding.residual_bytes(dim)
            residuals = _load_npy(_check_file(directory, files["residuals"], verify), mmap, np.uint8, (t, packed))
        lengths = _load_npy(len_path, False, np.int64, (n,))
        if (lengths < 0).any() or int(lengths.sum()) != t:
            raise CorpusFormatError(f"maxsim: corpus file {len_path} does not add up to the {t} tokens of {emb_path.name}")
        if manifest["id_type"] == "str":
            try:
                ids = json.loads(ids_path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise CorpusFormatError(f"maxsim: corpus file {ids_path} is corrupted: {err}") from None
            if not isinstance(ids, list) or len(ids) != n or not all(isinstance(x, str) for x in ids):
                raise CorpusFormatError(f"maxsim: corpus file {ids_path} must hold {n} string ids")
        else:
            ids = _load_npy(ids_path, False, np.int64, (n,))
        segments.append(Segment(embeddings, lengths, ids, scales, residuals))
        total_docs += n
        total_tokens += t
    if total_docs != manifest["num_documents"] or total_tokens != manifest["num_tokens"]:
        raise CorpusFormatError(f"maxsim: corpus manifest {directory / MANIFEST} does not add up over its segments")
    return manifest, segments


def _listed(manifest: dict) -> set:
    listed = {f["name"] for s in manifest["segments"] for f in s["files"].values()}
    codec = manifest.get("codec")
    if isinstance(codec, dict):
        listed.update(f["name"] for f in codec.get("files", {}).values())
    return listed


def _remove_orphans(directory: Path, manifest: dict) -> None:
    """Delete segment and codec files (and temporaries) that the manifest does not list."""
    listed = _listed(manifest)
    for path in directory.iterdir():
        if path.name.startswith(("seg-", "codec-")) and path.name not in listed:
            path.unlink(missing_ok=True)
        elif path.name.startswith(MANIFEST) and path.name != MANIFEST:
            path.unlink(missing_ok=True)


def _write_segment(directory: Path, number: int, embeddings: np.ndarray, lengths: np.ndarray, ids,
                   scales: np.ndarray | None = None, residuals: np.ndarray | None = None,
                   coded: bool = False) -> dict:
    tag = secrets.token_hex(4)
    stem = f"seg-{number:05d}-{tag}"
    main = "codes" if coded else "embeddings"
    emb_path = directory / f"{stem}.{'codes' if coded else 'emb'}.npy"
    len_path = directory / f"{stem}.len.npy"
    _write_array(emb_path, embeddings)
    files = {main: _describe(emb_path)}
    if residuals is not None:
        res_path = directory / f"{stem}.res.npy"
        _write_array(res_path, np.asarray(residuals, dtype=np.uint8))
        files["residuals"] = _describe(res_path)
    _write_array(len_path, np.asarray(lengths, dtype=np.int64))
    files["lengths"] = _describe(len_path)
    if scales is not None:
        scl_path = directory / f"{stem}.scl.npy"
        _write_array(scl_path, np.asarray(scales, dtype=np.float32))
        files["scales"] = _describe(scl_path)
    if isinstance(ids, np.ndarray):
        ids_path = directory / f"{stem}.ids.npy"
        _write_array(ids_path, ids.astype(np.int64, copy=False))
    else:
        ids_path = directory / f"{stem}.ids.json"
        _write_json(ids_path, list(ids))
    files["ids"] = _describe(ids_path)
    return {"num_documents": int(len(lengths)), "num_tokens": int(embeddings.shape[0]), "files": files}


def _write_codec(directory: Path, encoding: Encoding, tables: dict) -> dict:
    """Write the codec tables under a fresh tag -> the manifest's "codec" entry."""
    tag = secrets.token_hex(4)
    entry = encoding.codec_entry(tables)
    files = {}
    for name, array in tables.items():
        path = directory / f"codec-{tag}.{name}.npy"
        _write_array(path, np.asarray(array))
        files[name] = _describe(path)
    entry["files"] = files
    return entry


def write_corpus(directory, embeddings: np.ndarray, lengths: np.ndarray, ids, dtype_name: str, *,
                 append: bool = False, overwrite: bool = False, encoding: str | None = None,
                 scales: np.ndarray | None = None, residuals: np.ndarray | None = None,
                 codec: dict | None = None) -> dict:
    """Write one segment and commit it -> the new manifest.

    ``embeddings [t, d]`` in the stored numpy dtype (bf16 as uint16, fp8 as uint8), ``lengths
    [n]``, ``ids`` an int64 array or list of n str. ``encoding`` (default ``dtype_name``): "int8"
    and "fp8" also take ``scales [t]`` fp32. A residual / PQ encoding takes its codes as
    ``embeddings`` (``[t]`` int32 / ``[t, m]`` uint8), ``residuals [t, d * nbits / 8]`` uint8
    (residual), and ``codec``: its tables ``{name: array}`` (residual: centroids [C, d] fp16 / fp32,
    bucket_weights, optionally bucket_cutoffs and avg_residual, fp32; PQ: codebooks [m, 256, d / m]
    fp32), written once per corpus; an append must bring the corpus's codec. ``append``: add to the
    corpus at ``directory`` (same d, encoding, codec and id type; ids must stay unique). Otherwise
    a new corpus; an existing one is replaced only with ``overwrite`` (its files are deleted after
    the new manifest is committed).
    """
    directory = Path(directory)
    named = dtype_name if encoding is None else encoding
    encoding = encodings.parse(named)
    if encoding is None or encoding.stored_dtype != dtype_name:
        raise ValueError(f"maxsim: encoding {named!r} does not hold {dtype_name} embeddings")
    if (scales is not None) != encoding.has_scales:
        raise ValueError(f"maxsim: a {encoding} corpus {'needs' if scales is None else 'takes no'} per-token scales")
    if (residuals is not None) != encoding.has_residuals:
        raise ValueError(f"maxsim: a {encoding} corpus {'needs' if residuals is None else 'takes no'} residuals")
    compressed = encoding.has_codec
    if (codec is not None) != compressed:
        raise ValueError(f"maxsim: a {encoding} corpus {'needs' if codec is None else 'takes no'} codec tables")
    id_type = "int" if isinstance(ids, np.ndarray) else "str"
    if compressed:
        encoding.check_table_names(codec)  # names first: the dim comes from a table
        dim = encoding.codec_dim(codec)
        encoding.check_tables(codec, dim)
        want = (embeddings.shape[0],) + encoding.row_shape(dim)
        if embeddings.dtype != np.dtype(STORED_DTYPES[dtype_name]) or tuple(embeddings.shape) != want:
            raise ValueError(f"maxsim: {encoding} codes must be {np.dtype(STORED_DTYPES[dtype_name])} {list(want)}; "
                             f"got {embeddings.dtype} {list(embeddings.shape)}")
        packed = encoding.residual_bytes(dim)
        if residuals is not None and tuple(residuals.shape) != (embeddings.shape[0], packed):
            raise ValueError(f"maxsim: {encoding} residuals must be [{embeddings.shape[0]}, {packed}]; "
                             f"got {list(residuals.shape)}")
    else:
        dim = int(embeddings.shape[1])
    exists = (directory / MANIFEST).is_file()
    if append and exists:
        manifest, segments = open_corpus(directory, mmap=True, verify=False)
        where = directory / MANIFEST
        stored = manifest_encoding(manifest)
        if manifest["dim"] != dim:
            raise ValueError(f"maxsim: cannot append d={dim} embeddings to corpus {where} of d={manifest['dim']}")
        if stored != encoding:
            if stored.has_codec:
                raise TypeError(f"maxsim: cannot append {encoding} embeddings to corpus {where} of {stored}: encode "
                                f"the documents with its codec: Corpus.from_list(docs, ids, "
                                f"codec=Corpus.load({str(directory)!r}).codec)")
            raise TypeError(f"maxsim: cannot append {encoding} embeddings to corpus {where} of "
                            f"{stored}: build the documents with encoding={stored!r}")
        if compressed and not encodings.same_tables(read_codec(directory, manifest, verify=True), codec):
            raise ValueError(f"maxsim: cannot append {encoding} codes of another codec to corpus {where}: encode "
                             f"the documents with its codec: Corpus.from_list(docs, ids, "
                             f"codec=Corpus.load({str(directory)!r}).codec)")
        if manifest["id_type"] != id_type:
            raise TypeError(f"maxsim: cannot append {id_type} ids to corpus {where} of {manifest['id_type']} ids")
        old_ids = set()
        for s in segments:
            old_ids.update(s.ids.tolist() if isinstance(s.ids, np.ndarray) else s.ids)
        new_ids = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        clash = next((x for x in new_ids if x in old_ids), None)
        if clash is not None:
            raise ValueError(f"maxsim: document id {clash!r} is already in corpus {where}")
        _remove_orphans(directory, manifest)
        number = len(manifest["segments"])
    else:
        if exists and not overwrite:
            raise FileExistsError(f"maxsim: {directory} already holds a corpus (pass overwrite=True or append=True)")
        if directory.exists() and not directory.is_dir():
            raise FileExistsError(f"maxsim: {directory} exists and is not a directory")
        if directory.is_dir() and not exists:
            strangers = [p.name for p in directory.iterdir() if not p.name.startswith(("seg-", "codec-", MANIFEST))]
            if strangers:
                raise FileExistsError(f"maxsim: {directory} is not empty and not a corpus ({strangers[0]}, ...)")
        directory.mkdir(parents=True, exist_ok=True)
        manifest = {"format": FORMAT_NAME, "version": format_version(encoding), "dim": dim,
                    "dtype": dtype_name, "encoding": encoding, "id_type": id_type, "num_documents": 0,
                    "num_tokens": 0, "segments": []}
        old = read_manifest(directory) if exists else None
        number = (len(old["segments"]) if old else 0)
        if compressed:  # before the segment and the manifest, under its own tag: never over the old corpus's
            manifest["codec"] = _write_codec(directory, encoding, codec)
    segment = _write_segment(directory, number, embeddings, lengths, ids, scales, residuals, coded=compressed)
    manifest = dict(manifest)
    manifest["encoding"] = encoding
    manifest["segments"] = list(manifest["segments"]) + [segment]
    manifest["num_documents"] = int(manifest["num_documents"]) + segment["num_documents"]
    manifest["num_tokens"] = int(manifest["num_tokens"]) + segment["num_tokens"]
    manifest["version"] = max(int(manifest["version"]), format_version(encoding))
    _replace_manifest(directory, manifest)
    _remove_orphans(directory, manifest)
    return manifest
