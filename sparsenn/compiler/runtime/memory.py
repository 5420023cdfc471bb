"""Kernel outputs in memory the kernel can fill fast.

A large output (a sampled product's values: ``nnz`` of them, tens of MiB for attention
scores) is fresh memory from the system on every call, and a kernel writing it first
takes one page fault per 4 KiB page: about 1.5 µs each, as long as the arithmetic for
a sampled dot product. :func:`empty` asks Linux to back such a tensor with transparent
huge pages (``madvise(MADV_HUGEPAGE)`` over the whole 2 MiB pages inside it, before
anything touches them): one fault per 2 MiB. Elsewhere, or when the kernel refuses
(huge pages disabled), the tensor is ordinary memory.
"""

from __future__ import annotations

import ctypes
import sys

import torch

__all__ = ["empty", "filled", "HUGE_PAGE", "MIN_HUGE_BYTES"]

HUGE_PAGE = 2 << 20
MIN_HUGE_BYTES = 4 * HUGE_PAGE  # below this, faults on the unaligned ends cost as much as the rest
_MADV_HUGEPAGE = 14  # linux/mman.h


def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


_MADVISE = _madvise()


def advise_huge_pages(t: torch.Tensor) -> None:
    """Back the whole huge pages inside ``t``'s memory with huge pages (best effort)."""
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.nbytes) // HUGE_PAGE * HUGE_PAGE
    if _MADVISE is not None and end > start:
        _MADVISE(start, end - start, _MADV_HUGEPAGE)


def empty(*size: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(*size, dtype=dtype)``, on huge pages from :data:`MIN_HUGE_BYTES`."""
    t = torch.empty(*size, dtype=dtype)
    if t.nbytes >= MIN_HUGE_BYTES:
        advise_huge_pages(t)
    return t


def filled(value: float, *size: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.full(size, value, dtype=dtype)``, on huge pages as :func:`empty`."""
    return empty(*size, dtype=dtype).fill_(value)
