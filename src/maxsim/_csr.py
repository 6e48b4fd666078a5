"""Inverting an argmax for the destination-owned (lowmem) backward kernels."""

import torch


def group_by_row(dest: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries grouped by destination row, in CSR form, without a host synchronisation.

    Args:
        dest: ``[E]`` integer destination row of each entry; ``n_rows`` (a sentinel row) for an
            entry that goes nowhere.
        n_rows: number of real destination rows.

    Returns:
        ``order [E]`` int64 entry ids sorted by destination, ascending entry id within a row (a
        stable sort, so each row sums its entries in a fixed order: bitwise deterministic), and
        ``rowptr [n_rows + 1]`` int64 with row r's entries at ``order[rowptr[r]:rowptr[r + 1]]``.
    """
    keys, order = torch.sort(dest, stable=True)
    # The first position of each row in the sorted keys (searchsorted, unlike bincount, knows its
    # output size without reading the data on the host).
    bounds = torch.arange(n_rows + 1, device=dest.device, dtype=keys.dtype)
    return order, torch.searchsorted(keys, bounds)
