"""A corpus's codec and the tables its file stores (format.py): the one conversion each way, shared
by a whole save (corpus.py) and a save of changes (changes.py)."""

from __future__ import annotations

import numpy as np
import torch

from maxsim.compressed.codec import ResidualCodec
from maxsim.compressed.pq import ProductQuantizer
from maxsim.search import format as corpus_format


def codec_tables(codec) -> dict:
    """A codec's tables as the corpus file stores them (``{name: numpy array}``; format.py):
    fp16 centroids stay fp16, every other table is fp32 (decoding gives the same tokens)."""
    if isinstance(codec, ProductQuantizer):
        return {"codebooks": codec.codebooks.detach().cpu().float().contiguous().numpy()}
    centroids = codec.centroids.detach().cpu()
    tables = {"centroids": (centroids if centroids.dtype == torch.float16 else centroids.float()).contiguous().numpy(),
              "bucket_weights": codec.bucket_weights.detach().cpu().float().contiguous().numpy()}
    if codec.bucket_cutoffs is not None:
        tables["bucket_cutoffs"] = codec.bucket_cutoffs.detach().cpu().float().contiguous().numpy()
    avg = codec.avg_residual
    if avg is not None:
        avg = avg.detach().cpu().float().numpy() if torch.is_tensor(avg) else np.asarray(avg)
        tables["avg_residual"] = np.ascontiguousarray(avg, dtype=np.float32)
    return tables


def codec_from_tables(encoding: str, tables: dict):
    if "codebooks" in tables:
        return ProductQuantizer(torch.from_numpy(tables["codebooks"]))
    optional = {name: torch.from_numpy(tables[name]) if name in tables else None
                for name in ("bucket_cutoffs", "avg_residual")}
    return ResidualCodec(torch.from_numpy(tables["centroids"]), torch.from_numpy(tables["bucket_weights"]),
                         corpus_format.RESIDUAL_ENCODINGS[encoding], **optional)
