"""Corpus-scale exact search: top-k MaxSim, a corpus object and file, streaming, sharding.

    from maxsim.search import topk, Corpus
    scores, indices = topk(Q, D, k=100)                   # [Nq, 100] fp32, int64
    corpus = Corpus.from_list(docs, ids=names)            # packed [T, d] + offsets + ids
    corpus.save("corpus/"); corpus = Corpus.load("corpus/", mmap=True)
    result = corpus.search(Q, k=100, gpu_memory=2 << 30)  # streams a host corpus to the GPU

Optional packages: tqdm (progress bars), safetensors (reading .safetensors embeddings in the
``index`` command). Neither is imported unless used.
"""

from maxsim.search.corpus import Corpus, SearchResult
from maxsim.search.topk import merge_topk, topk

__all__ = ["topk", "merge_topk", "Corpus", "SearchResult"]
