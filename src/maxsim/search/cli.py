"""``python -m maxsim index``, ``search``, ``delete`` and ``compact``: corpus files and TREC runs.

Each command adds its subparser (``add_index_parser``, ``add_search_parser``,
``add_delete_parser``, ``add_compact_parser``) and sets its run function; :mod:`maxsim.cli`
registers them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from maxsim._progress import progress_bar, say, stage
from maxsim.search import encodings
from maxsim.search import format as corpus_format

INDEX_EXAMPLE = """example:
  python -m maxsim index --out corpus/ docs.npy --lengths doc_lengths.npy --ids doc_ids.txt
  python -m maxsim index --out corpus/ --append more_docs.pt
  python -m maxsim index --out corpus8/ --encoding int8 docs.npy --lengths doc_lengths.npy
  python -m maxsim index --out plaid2/ --encoding residual2 docs.npy --lengths doc_lengths.npy
  python -m maxsim index --out pq/ --encoding pq32 docs.npy --lengths doc_lengths.npy
"""
SEARCH_EXAMPLE = """example:
  python -m maxsim search --corpus corpus/ --queries queries.pt -k 100 --out run.trec
  trec_eval qrels.txt run.trec          # or ir_measures
"""
DELETE_EXAMPLE = """example:
  python -m maxsim delete corpus/ --ids gone.txt        # tombstones: no token is rewritten
  python -m maxsim compact corpus/                      # later: rewrite without them
"""
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class _EncodingChoices(tuple):
    """The documented encodings (encodings.DOCUMENTED, listed by --help and in errors) that also
    hold every name the format takes: any pq<m>, residual1 and residual8."""

    def __contains__(self, name) -> bool:
        return encodings.parse(name) is not None


ENCODING_CHOICES = _EncodingChoices(encodings.DOCUMENTED)


def _parse_bytes(text: str) -> int:
    units = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "m": 2**20, "mb": 2**20, "g": 2**30, "gb": 2**30,
             "kib": 2**10, "mib": 2**20, "gib": 2**30}
    t = text.strip().lower()
    number = t.rstrip("kmgib")
    try:
        value = float(number) * units[t[len(number):]]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GB, 512MB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive: {text!r}")
    return int(value)


def _read_ids(path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def _as_ids(ids):
    if ids is None:
        return None
    if isinstance(ids, torch.Tensor):
        return ids.cpu().numpy()
    ids = list(ids)
    return [str(x) for x in ids] if any(isinstance(x, str) for x in ids) else ids


def load_embeddings(path, lengths_path=None, lengths_option: str = "--lengths"):
    """An embedding file -> ``(packed [T, d] tensor, lengths int64 numpy [N], ids or None)``.
    ``lengths_option``: the command's option for a lengths file, named in errors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"maxsim: embedding file {path} does not exist")
    suffix = path.suffix.lower()
    lengths = None if lengths_path is None else _read(lengths_path, np.load).astype(np.int64).reshape(-1)
    ids = None
    if suffix == ".npy":
        array = _read(path, lambda p: np.load(p, mmap_mode="c"))
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        packed, lengths = _from_array(path, tensor, lengths, lengths_option)
    elif suffix in (".pt", ".pth"):
        obj = _read(path, lambda p: torch.load(p, map_location="cpu", weights_only=True))
        if isinstance(obj, dict):
            ids = _as_ids(obj.get("ids"))
            if "lengths" in obj and lengths is None:
                lengths = np.asarray(torch.as_tensor(obj["lengths"]).cpu(), dtype=np.int64)
            if "embeddings" not in obj:
                raise ValueError(f"maxsim: {path} holds a dict without 'embeddings' (its keys: "
                                 f"{', '.join(map(str, obj)) or 'none'}); expected 'embeddings' (and 'lengths', 'ids')")
            obj = obj["embeddings"]
        if isinstance(obj, (list, tuple)):
            items = [torch.as_tensor(x) for x in obj]
            if not items or any(x.dim() != 2 for x in items):
                raise ValueError(f"maxsim: {path} must hold a non-empty list of [L, d] tensors")
            packed = torch.cat(items, 0)
            lengths = np.array([x.shape[0] for x in items], dtype=np.int64)
        elif isinstance(obj, torch.Tensor):
            packed, lengths = _from_array(path, obj, lengths, lengths_option)
        else:
            raise ValueError(f"maxsim: {path} holds {type(obj).__name__}; expected a list of [L, d] tensors "
                             "or a dict with 'embeddings'")
    elif suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ImportError("maxsim: reading .safetensors needs the optional package safetensors "
                              "(pip install safetensors)") from None
        tensors = _read(path, lambda p: load_file(str(p)))
        if "embeddings" in tensors:
            if lengths is None and "lengths" not in tensors:
                raise ValueError(f"maxsim: {path} has 'embeddings' but no 'lengths' (give {lengths_option})")
            lengths = lengths if lengths is not None else tensors["lengths"].numpy().astype(np.int64)
            packed, lengths = _from_array(path, tensors["embeddings"], lengths, lengths_option)
        else:
            names = list(tensors)  # the file's order
            items = [tensors[n] for n in names]
            if not items or any(x.dim() != 2 for x in items):
                raise ValueError(f"maxsim: {path} must hold 'embeddings' + 'lengths' or one [L, d] tensor per item")
            packed = torch.cat(items, 0)
            lengths = np.array([x.shape[0] for x in items], dtype=np.int64)
            ids = names
    else:
        raise ValueError(f"maxsim: unknown embedding file type {path.suffix!r} ({path}): use .npy, .pt or .safetensors")
    return packed, lengths, ids


def _read(path, loader):
    """``loader(path)``, with an empty or unreadable file as one ValueError that names it."""
    path = Path(path)
    if path.is_file() and path.stat().st_size == 0:
        raise ValueError(f"maxsim: {path} is empty (0 bytes): write the array again")
    try:
        return loader(path)
    except Exception as err:  # a file that does not parse (truncated, another format): the user's to fix
        if isinstance(err, MemoryError) or (isinstance(err, OSError) and not path.is_file()):
            raise
        first = " ".join(str(err).split())[:160] or type(err).__name__
        raise ValueError(f"maxsim: {path} could not be read as a {path.suffix or 'numpy'} file ({first}): "
                         "write it again with numpy.save, torch.save or safetensors") from err


def _from_array(path, tensor: torch.Tensor, lengths, lengths_option: str = "--lengths"):
    if lengths is not None and (lengths < 0).any():
        first = int(np.flatnonzero(lengths < 0)[0])
        raise ValueError(f"maxsim: the lengths for {path} must be >= 0; entry {first} is {int(lengths[first])}")
    if tensor.dim() == 2:
        if lengths is None:
            raise ValueError(f"maxsim: {path} is packed [T, d]: give the token count of each item ({lengths_option})")
        if int(lengths.sum()) != tensor.shape[0]:
            raise ValueError(f"maxsim: the lengths add up to {int(lengths.sum())} tokens but {path} has {tensor.shape[0]}")
        return tensor, lengths
    if tensor.dim() == 3:
        N, L = tensor.shape[:2]
        if lengths is None:
            lengths = np.full(N, L, dtype=np.int64)
        if lengths.size != N or (lengths > L).any():
            raise ValueError(f"maxsim: lengths must be {N} values in 0..{L} for the padded {path}")
        mask = torch.arange(L)[None, :] < torch.from_numpy(lengths)[:, None]
        return tensor[mask], lengths
    raise ValueError(f"maxsim: {path} must be [T, d] or [N, L, d]; got {list(tensor.shape)}")


def _device(name: str | None) -> torch.device:
    """--device, checked: a CUDA device that is not there is one line naming the fix."""
    if name is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"maxsim: --device {name!r} is not a device (cuda, cuda:1 or cpu)") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"maxsim: --device {name} but this machine has "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA device(s) visible "
                         f"(torch {torch.__version__}): use --device cpu")
    return device


def _check_finite(tokens: torch.Tensor, lengths: np.ndarray, path, what: str) -> None:
    """A NaN or infinite embedding value -> one line naming the item (it would score NaN and rank first)."""
    bad = ~torch.isfinite(tokens).all(dim=-1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        item = int(np.searchsorted(np.cumsum(lengths), row, side="right"))
        raise ValueError(f"maxsim: {what} {item} of {path} holds a NaN or infinite value: every score against it "
                         "would be NaN (fix or drop it)")


# ---------------------------------------------------------------------------------------------
# index


INDEX_HELP = "Build a corpus file (a directory of .npy files and a manifest) from embeddings on disk, or append to one.\n\n"
SEARCH_HELP = "Exact top-k of every query against a corpus file; writes a TREC run file or JSON lines.\n\n"
EMBEDDING_FILES = """embedding files, by suffix:
  .npy          packed [T, d] with --lengths L.npy (token count per item), or padded [N, L, d]
                (with --lengths: the first lengths[i] tokens of item i are real)
  .pt / .pth    a list of [L_i, d] tensors, or a dict with "embeddings" (such a list, or packed
                [T, d] with "lengths") and optionally "ids" (loaded with weights_only=True)
  .safetensors  "embeddings" [T, d] + "lengths" [N], or one [L, d] tensor per item named by its id
                (needs the optional package safetensors)
ids: --ids FILE (one per line) or those in the file; default 0 .. N - 1.
"""


def add_index_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("index", help="build (or append to) a corpus file from embeddings on disk",
                              description=INDEX_HELP + EMBEDDING_FILES, epilog=INDEX_EXAMPLE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="embedding files (.npy, .pt, .safetensors), added in order")
    p.add_argument("--out", required=True, help="corpus directory to write")
    p.add_argument("--lengths", action="append", help="lengths .npy for a .npy/.safetensors input (once per input)")
    p.add_argument("--ids", action="append", help="text file of ids, one per line (once per input)")
    stored = p.add_mutually_exclusive_group()
    stored.add_argument("--encoding", choices=ENCODING_CHOICES,
                        metavar="{" + ",".join(encodings.NAMES) + ",pq<m>}",
                        help="store the tokens as this: a float dtype; int8 / fp8 (e4m3) values with an fp32 "
                             "scale per token, d + 4 bytes a token; residual2 / residual4, PLAID residual codes "
                             "(a centroid id and 2 or 4 bits a dimension, d * nbits / 8 + 4 bytes a token; d a "
                             "multiple of 8); or pq<m> (pq16, pq32, pq64, ...: m bytes a token, m dividing d), "
                             "product quantisation. A residual / PQ codec is trained on the first input's tokens "
                             "(on --device) and encodes every input (default: the input's dtype; with --append, "
                             "the corpus's own encoding, and its codec)")
    stored.add_argument("--dtype", choices=sorted(_DTYPES), help="store in this float dtype (as --encoding)")
    p.add_argument("--refine", choices=["float16", "bfloat16", "float32", "int8", "fp8"],
                   help="also store the tokens in this encoding in OUT/refine (a compressed corpus's exact second "
                        "stage: search --refine); appends to a corpus that has one extend it too")
    p.add_argument("--num-centroids", type=int,
                   help="residual encodings: centroids of the trained codec (default: colbert-ai's, "
                        "2**floor(log2(16 sqrt(T))) for T training tokens)")
    p.add_argument("--device", help="where a residual / PQ codec is trained and the tokens encoded: cuda, cuda:1 or "
                        "cpu (default: cuda when available)")
    p.add_argument("--append", action="store_true", help="add to the corpus at --out")
    p.add_argument("--overwrite", action="store_true", help="replace the corpus at --out")
    p.add_argument("--quiet", action="store_true", help="no summary line, no progress bar")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it shows on a terminal, with tqdm)")
    p.set_defaults(run=run_index)
    return p


def _train_codec(args, encoding: str, packed: torch.Tensor, device: torch.device, bar=None):
    """The codec of a new residual / PQ corpus, trained on ``packed`` (one input's tokens) on
    ``device``; ``bar`` (the index's bar) names the step while it runs."""
    from maxsim.search.encodings import train_codec

    if not args.quiet:
        say(bar, f"maxsim index: training a {encoding} codec on {packed.shape[0]} tokens on {device} ...")
    with stage(bar, f"maxsim index: training the {encoding} codec"):
        return train_codec(packed.to(device), encoding, num_centroids=args.num_centroids,
                           progress=False if args.quiet else None)


def run_index(args) -> int:
    from maxsim.search.corpus import Corpus

    start = time.perf_counter()
    for option in ("lengths", "ids"):
        given = getattr(args, option) or []
        if given and len(given) != len(args.inputs):
            print(f"maxsim index: give --{option} once per input ({len(args.inputs)}), or not at all", file=sys.stderr)
            return 2
    if args.num_centroids is not None and args.num_centroids < 1:
        print(f"maxsim index: --num-centroids must be at least 1; got {args.num_centroids}", file=sys.stderr)
        return 2
    append = args.append
    encoding = encodings.parse(args.encoding or args.dtype)  # None: the inputs' dtype
    codec = None
    existing = None
    if append and Path(args.out, "manifest.json").is_file():
        existing = Corpus.load(args.out, mmap=True, verify=False)
        if existing.encoding.has_codec:
            # documents appended to a residual / PQ corpus are encoded with its codec, never a new one
            if encoding is not None and encoding != existing.encoding:
                raise TypeError(f"maxsim: cannot append {encoding} documents to the corpus {args.out} of "
                                f"{existing.encoding}: leave --encoding out (its codec encodes them), or build a "
                                "new corpus from the float tokens")
            encoding, codec = existing.encoding, existing.codec
        elif encoding is not None and encoding.has_codec:
            raise TypeError(f"maxsim: cannot append {encoding} documents to the corpus {args.out} of "
                            f"{existing.encoding}: build a new corpus (without --append)")
        elif encoding is None and existing.encoding.has_scales:
            # float documents appended to a one-byte corpus are quantised like its own
            encoding = existing.encoding
    if args.num_centroids is not None and not (encoding is not None and encoding.has_residuals):
        print("maxsim index: --num-centroids is for a new corpus of a residual encoding", file=sys.stderr)
        return 2
    compressed = encoding is not None and encoding.has_codec
    refine_dir = Path(args.out, Corpus.REFINE_FOLDER)
    has_refine = (refine_dir / corpus_format.MANIFEST).is_file()
    if existing is not None and has_refine:  # appends keep the stored refine tokens aligned
        stored = corpus_format.manifest_encoding(corpus_format.read_manifest(refine_dir))
        if args.refine is not None and args.refine != stored:
            print(f"maxsim index: {refine_dir} holds {stored} tokens: leave --refine out (appends extend it) or "
                  "build a new corpus", file=sys.stderr)
            return 2
        args.refine = stored
    elif existing is not None and args.refine is not None:
        print(f"maxsim index: {args.out} has no refine tokens to extend: build a new corpus with --refine",
              file=sys.stderr)
        return 2
    device = _device(args.device)
    if not append and not args.overwrite and Path(args.out, "manifest.json").is_file():
        print(f"maxsim index: {args.out} already holds a corpus: --append adds to it, --overwrite replaces it",
              file=sys.stderr)
        return 2
    # one step an input file's bytes: load, check, (train,) encode and save it
    sizes = [Path(path).stat().st_size if Path(path).is_file() else 0 for path in args.inputs]
    bar = progress_bar(False if args.quiet or args.no_progress else None, sum(sizes), "maxsim index", "B")
    try:
        return _index_inputs(args, bar, sizes, start, existing, encoding, codec, compressed, device, append,
                             refine_dir)
    finally:
        if bar is not None:
            bar.close()


def _index_inputs(args, bar, sizes, start, existing, encoding, codec, compressed, device, append, refine_dir) -> int:
    from maxsim.search.corpus import Corpus

    documents = tokens = next_id = 0
    for n, path in enumerate(args.inputs):
        if bar is not None:
            bar.set_postfix_str(f"{Path(path).name}: loading", refresh=True)
        packed, lengths, ids = load_embeddings(path, (args.lengths or [None] * len(args.inputs))[n])
        if encoding is None and packed.dtype not in _DTYPES.values():
            say(bar, f"maxsim index: {path} holds {str(packed.dtype).replace('torch.', '')} embeddings: store them "
                  "with --dtype float32 (or float16, bfloat16, or an --encoding)")
            return 2
        if packed.is_floating_point():
            _check_finite(packed, lengths, path, "item")
        if args.ids:
            ids = _read_ids(args.ids[n])
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if ids is None:  # default ids continue the corpus's (or the previous input's) numbering
            if n == 0 and existing is not None:
                old = existing.ids
                next_id = int(old.max()) + 1 if isinstance(old, np.ndarray) and len(old) else 0
            ids = np.arange(next_id, next_id + lengths.size, dtype=np.int64)
            next_id += lengths.size
        if bar is not None:
            bar.set_postfix_str(f"{Path(path).name}: {'encoding' if encoding else 'storing'} {lengths.size} documents",
                                refresh=True)
        if compressed:
            if codec is None:
                codec = _train_codec(args, encoding, packed, device, bar)
            # encoded on --device; save copies the codes to the host
            corpus = Corpus(packed.to(device), offsets, ids, codec=codec)
            codec = corpus.codec  # (on the device: the next input encodes there too)
        else:
            corpus = Corpus(packed, offsets, ids, encoding=encoding)
        corpus.save(args.out, append=append, overwrite=args.overwrite and n == 0)
        if args.overwrite and n == 0 and args.refine is None and (refine_dir / corpus_format.MANIFEST).is_file():
            shutil.rmtree(refine_dir)  # the replaced corpus's refine tokens: never pair them with the new one
        if args.refine is not None:  # the same documents, in the refine encoding, beside the codes
            Corpus(packed, offsets, ids, encoding=args.refine).save(Path(args.out, Corpus.REFINE_FOLDER),
                                                                   append=append, overwrite=args.overwrite and n == 0)
        append = True
        documents += len(corpus)
        tokens += corpus.num_tokens
        if bar is not None:
            bar.update(sizes[n])
    seconds = time.perf_counter() - start
    if not args.quiet:
        say(bar, f"maxsim index: {documents} documents, {tokens} tokens -> {args.out} in {seconds:.2f} s "
              f"({documents / max(seconds, 1e-9):.0f} documents/s)")
    return 0


# ---------------------------------------------------------------------------------------------
# search


def add_search_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("search", help="exact top-k of queries against a corpus file -> TREC run or JSON lines",
                              description=SEARCH_HELP + EMBEDDING_FILES, epilog=SEARCH_EXAMPLE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", help="corpus directory (python -m maxsim index): exact search")
    source.add_argument("--index", help="a PLAID index folder (colbert-ai or fast-plaid / PyLate): "
                        "PLAID search, colbert-ai's defaults by k (maxsim.index.load)")
    p.add_argument("--queries", required=True, help="query embeddings (.npy, .pt, .safetensors)")
    p.add_argument("--refine", metavar="CORPUS", nargs="?", const="",
                   help="refine to exact scores: --corpus keeps k x --refine-factor candidates, scored again from a "
                        "float16 / int8 corpus of the same documents (memory-mapped): CORPUS, or without it the one "
                        "stored in --corpus's refine/ folder (index --refine)")
    p.add_argument("--refine-factor", type=int, default=4, help="candidates kept a result with --refine (default 4)")
    p.add_argument("--query-lengths", help="lengths .npy for packed .npy/.safetensors queries")
    p.add_argument("--query-ids", help="text file of query ids, one per line (default: the file's, or 0..)")
    p.add_argument("-k", type=int, default=100, help="documents per query (default 100)")
    p.add_argument("--out", required=True, help="output file ('-' = stdout)")
    p.add_argument("--format", choices=["trec", "jsonl"], help="default: jsonl for *.jsonl/*.json, else trec")
    p.add_argument("--tag", default="maxsim", help="run tag, the TREC file's last column")
    p.add_argument("--batch-size", type=int, help="queries scored together against each corpus chunk")
    p.add_argument("--gpu-memory", type=_parse_bytes, help="device memory budget, e.g. 2GB (default: 1/4 of free)")
    p.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda when available)")
    p.add_argument("--load", choices=["mmap", "host", "pinned", "device", "lookup"], default="mmap",
                   help="how to hold the corpus: memory-mapped (default), in host memory, pinned, on the device, or "
                        "lookup: a residual / PQ / int8 / fp8 corpus's codes memory-mapped and only the look-up "
                        "scorer's layouts on the GPU (Corpus.to(device, lookup_only=True))")
    p.add_argument("--plaid", action="store_true",
                   help="search a residual --corpus through PLAID's candidate generation (maxsim.index.from_corpus, "
                        "colbert-ai's defaults by k) instead of exhaustively; --refine rescores its candidates")
    p.add_argument("--no-verify", action="store_true", help="skip the CRC-32 check of the corpus files (sizes still checked)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--quiet", action="store_true", help="no summary line")
    p.set_defaults(run=run_search)
    return p


def write_run(out, query_ids, result, tag: str, fmt: str) -> None:
    """TREC run lines ``qid Q0 docid rank score tag`` (rank from 1), or JSON lines
    ``{"qid", "docids", "scores"}``."""
    ids = result.ids.tolist() if isinstance(result.ids, torch.Tensor) else result.ids
    scores = result.scores.cpu().tolist()
    for qid, doc_ids, row in zip(query_ids, ids, scores):
        if fmt == "jsonl":
            out.write(json.dumps({"qid": qid, "docids": doc_ids, "scores": row}) + "\n")
        else:
            for rank, (doc, score) in enumerate(zip(doc_ids, row), 1):
                out.write(f"{qid} Q0 {doc} {rank} {score:.6f} {tag}\n")


def write_output(path, write) -> None:
    """``write(file)`` to ``path``: a regular file (or a new one) is written beside it and renamed
    over it, so a reader never sees half a run; a symlink's target is treated the same (the link
    stays); a FIFO, a device or anything else that is not a regular file is written through."""
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():  # /dev/null, a FIFO, a terminal: write through
        with open(target, "w", encoding="utf-8") as f:
            write(f)
        return
    tmp = target.with_name(target.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            write(f)
        tmp.replace(target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _index_search(path, queries, k: int, device):
    """PLAID search of padded queries against the index at ``path`` -> (result, words)."""
    import maxsim

    index = maxsim.index.load(path, device=device)
    Q, q_mask = maxsim.pad([q.to(device) for q in queries])
    return index.search(Q, k=k, q_mask=q_mask), f"{len(index)} documents (a {index.format} PLAID index)"


def _corpus_mode_problem(corpus, args, device) -> str | None:
    """Why ``--plaid`` / ``--load lookup`` cannot hold this corpus (one line naming the fix), or None."""
    from maxsim.search.encodings import Residual

    if args.plaid and not isinstance(corpus.encoding, Residual):
        return (f"--plaid needs a residual corpus; {args.corpus} is {corpus.encoding}: build one with "
                "`python -m maxsim index --encoding residual2`")
    if args.plaid and corpus.num_deleted:
        return f"--plaid: {args.corpus} has {corpus.num_deleted} deleted documents: run `python -m maxsim compact` first"
    if args.load == "lookup" and (not corpus.encoding.has_lookup or device.type != "cuda"):
        return (f"--load lookup holds a residual / PQ / int8 / fp8 corpus's look-up layouts on a GPU; {args.corpus} is "
                f"{corpus.encoding} and the device is {device}: use --load mmap, host, pinned or device")
    return None


def _corpus_plaid_search(corpus, queries, k: int, device, refine, refine_factor: int):
    """PLAID search of a residual corpus (its lists built on ``device``) -> (result, words)."""
    import maxsim

    index = maxsim.index.from_corpus(corpus, device=device)
    Q, q_mask = maxsim.pad([q.to(device) for q in queries])
    result = index.search(Q, k=k, q_mask=q_mask, refine=refine, refine_factor=refine_factor)
    words = f"{len(index)} documents (PLAID over a {corpus.encoding} corpus, {corpus.where()})"
    if refine is not None:
        words += f", refined from {refine.encoding} x{refine_factor}"
    return result, words


def run_search(args) -> int:
    from maxsim.search.corpus import Corpus

    if args.k < 1:
        print(f"maxsim search: -k must be at least 1; got {args.k}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    device = _device(args.device)
    if args.refine is not None and not args.corpus:
        print("maxsim search: --refine refines a --corpus search (a PLAID --index reranks on its own)", file=sys.stderr)
        return 2
    if args.plaid and not args.corpus:
        print("maxsim search: --plaid searches a residual --corpus as a PLAID index (an --index is one already)",
              file=sys.stderr)
        return 2
    if args.corpus:
        corpus = Corpus.load(args.corpus, mmap=args.load in ("mmap", "lookup"), verify=not args.no_verify,
                             pin_memory=args.load == "pinned" and device.type == "cuda",
                             device=device if args.load == "device" else None)
        problem = _corpus_mode_problem(corpus, args, device)
        if problem:
            print(f"maxsim search: {problem}", file=sys.stderr)
            return 2
        if args.load == "lookup":
            corpus = corpus.to(device, lookup_only=True)
    refine = None if args.refine is None else True if args.refine == "" else \
        Corpus.load(args.refine, mmap=True, verify=not args.no_verify)
    packed, lengths, query_ids = load_embeddings(args.queries, args.query_lengths, "--query-lengths")
    if not packed.is_floating_point() or packed.dtype == torch.float64:
        print(f"maxsim search: {args.queries} holds {str(packed.dtype).replace('torch.', '')} queries: save them as "
              "float32, float16 or bfloat16", file=sys.stderr)
        return 2
    if lengths.size == 0:
        print(f"maxsim search: {args.queries} holds no queries (shape {list(packed.shape)})", file=sys.stderr)
        return 2
    _check_finite(packed, lengths, args.queries, "query")
    if args.query_ids:
        query_ids = _read_ids(args.query_ids)
    if query_ids is None:
        query_ids = list(range(lengths.size))
    if isinstance(query_ids, np.ndarray):
        query_ids = query_ids.tolist()
    if len(query_ids) != lengths.size:
        print(f"maxsim search: {len(query_ids)} query ids for {lengths.size} queries", file=sys.stderr)
        return 2
    wanted = corpus.encoding.scoring_dtype() if args.corpus else None  # a float corpus's dtype
    if wanted is not None and packed.dtype != wanted:
        if not args.quiet:  # (an encoder's fp32 output against an fp16 corpus)
            print(f"maxsim search: {str(packed.dtype).replace('torch.', '')} queries scored as the corpus's "
                  f"{str(wanted).replace('torch.', '')}", file=sys.stderr)
        packed = packed.to(wanted)
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    queries = [packed[int(a):int(b)] for a, b in zip(offsets[:-1], offsets[1:])]
    try:
        if args.index:
            result, described = _index_search(args.index, queries, args.k, device)
        elif args.plaid:
            source = corpus.stored_refine() if refine is True else refine
            result, described = _corpus_plaid_search(corpus, queries, args.k, device, source, args.refine_factor)
        else:
            result = corpus.search(queries, args.k, batch_size=args.batch_size, gpu_memory=args.gpu_memory,
                                   progress=False if args.no_progress else None, device=device, refine=refine,
                                   refine_factor=args.refine_factor)
            deleted = f", {corpus.num_deleted} deleted ones left out" if corpus.num_deleted else ""
            described = f"{corpus.num_live} documents ({corpus.num_tokens} tokens{deleted}, {corpus.where()})"
            if refine is not None:
                source = corpus.stored_refine() if refine is True else refine
                described += f", refined from {source.encoding} x{args.refine_factor}"
    except KeyboardInterrupt:
        print("maxsim search: interrupted; nothing written", file=sys.stderr)
        return 130
    nan_rows = torch.isnan(result.scores).any(dim=-1).nonzero().flatten().tolist()
    if nan_rows:  # a NaN token in the corpus: its document scores NaN and would rank first
        first = result.indices[nan_rows[0]][torch.isnan(result.scores[nan_rows[0]])][0]
        print(f"maxsim search: document {int(first)} of the corpus scores NaN (a NaN or infinite token): rebuild "
              f"the corpus from finite embeddings; nothing written", file=sys.stderr)
        return 2
    fmt = args.format or ("jsonl" if str(args.out).endswith((".jsonl", ".json")) else "trec")
    if args.out == "-":
        try:
            write_run(sys.stdout, query_ids, result, args.tag, fmt)
            sys.stdout.flush()
        except BrokenPipeError:  # the reader stopped early (`| head`): not an error of ours
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            return 0
    else:
        write_output(args.out, lambda f: write_run(f, query_ids, result, args.tag, fmt))
    seconds = time.perf_counter() - start
    if not args.quiet:
        print(f"maxsim search: {len(queries)} queries x {described} on {device}, k={args.k}: {seconds:.2f} s, "
              f"{len(queries) / max(seconds, 1e-9):.1f} queries/s -> {args.out}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# delete, compact


def add_delete_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("delete", help="delete documents of a corpus file by id (tombstones)",
                              description="Mark documents of a corpus file deleted: search never returns them. "
                              "Only a small tombstone file a segment is written (crash-safely: the manifest is "
                              "replaced last); `compact` later rewrites the corpus without them.",
                              epilog=DELETE_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("corpus", help="corpus directory")
    p.add_argument("--ids", required=True, help="text file of the ids to delete, one per line")
    p.add_argument("--missing", choices=["error", "ignore"], default="error",
                   help="an id the corpus does not hold: an error that deletes nothing (default), or skipped")
    p.add_argument("--quiet", action="store_true", help="no summary line")
    p.set_defaults(run=run_delete)
    return p


def add_compact_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("compact", help="rewrite a corpus file without its deleted documents",
                              description="Rewrite the segments of a corpus file that hold deleted documents from "
                              "their live ones and drop the tombstones (crash-safely: new segments, then the "
                              "manifest, then the old files removed). Every file's CRC-32 is checked first.",
                              epilog=DELETE_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("corpus", help="corpus directory")
    p.add_argument("--quiet", action="store_true", help="no summary line")
    p.set_defaults(run=run_compact)
    return p


def _ids_for(corpus, path):
    """The ids of a text file, as the corpus's id type (int ids: each line an int)."""
    ids = _read_ids(path)
    if not isinstance(corpus.ids, np.ndarray):
        return ids
    out = []
    for x in ids:
        try:
            out.append(int(x))
        except ValueError:
            raise ValueError(f"maxsim: {path} holds {x!r} but the corpus's ids are int: one int a line") from None
    return np.array(out, dtype=np.int64)


def run_delete(args) -> int:
    from maxsim.search.corpus import Corpus

    corpus = Corpus.load(args.corpus, mmap=True, verify=False)  # no token is read or rewritten
    ids = _ids_for(corpus, args.ids)
    try:
        count = corpus.delete(ids, missing=args.missing)
    except ValueError as err:  # the library names its argument; the command its option
        raise ValueError(str(err).replace("missing='ignore'", "--missing ignore")) from None
    if count:
        corpus.save(args.corpus, overwrite=True)
        refine = corpus.stored_refine()
        if refine is not None:  # the same documents leave the stored refine tokens (kept aligned)
            refine.delete(ids, missing="ignore")
            refine.save(refine.path, overwrite=True)
    if not args.quiet:
        print(f"maxsim delete: {count} of {len(ids)} ids deleted -> {args.corpus}: {corpus.num_live} live documents, "
              f"{corpus.num_deleted} deleted (python -m maxsim compact {args.corpus} drops them)", file=sys.stderr)
    return 0


def run_compact(args) -> int:
    from maxsim.search.corpus import Corpus

    start = time.perf_counter()
    # verified: a segment rewritten from a corrupted file would carry the damage under a fresh CRC
    corpus = Corpus.load(args.corpus, mmap=True, verify=True)
    dropped, tokens = corpus.num_deleted, corpus.num_tokens
    corpus.compact(args.corpus)
    refine_dir = Path(args.corpus, Corpus.REFINE_FOLDER)
    if (refine_dir / corpus_format.MANIFEST).is_file():  # compacted alike: positions stay aligned
        Corpus.load(refine_dir, mmap=True, verify=True).compact(refine_dir)
    if not args.quiet:
        print(f"maxsim compact: dropped {dropped} deleted documents ({tokens - corpus.num_tokens} tokens) -> "
              f"{args.corpus}: {len(corpus)} documents in {len(corpus.segments)} segment(s), "
              f"{time.perf_counter() - start:.2f} s", file=sys.stderr)
    return 0
