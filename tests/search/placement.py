"""Where a corpus lives for a streaming test, and a search held to a GPU memory budget (the GPU
streaming tests of the float and the one-byte corpora share them)."""

import torch


def place(corpus, where, tmp_path):
    """The corpus in pinned host memory, pageable host memory, a memory-mapped file or on the GPU."""
    if where == "pinned":
        return corpus.pin_memory()
    if where == "device":
        return corpus.to("cuda")
    if where == "mmap":
        corpus.save(tmp_path / "c")
        return type(corpus).load(tmp_path / "c", mmap=True)
    return corpus


def search_within_budget(corpus, queries, k, budget, where):
    """corpus.search under ``gpu_memory=budget``; a streamed search must stay within it."""
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = corpus.search(queries, k, gpu_memory=budget, progress=False)
    if where != "device":
        assert torch.cuda.max_memory_allocated() - base <= budget
    return result
