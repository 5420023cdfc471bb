"""The kernel ABI, defined once: the entry points a generated kernel exports (the C++
generator spells them from :data:`RUN`, :data:`FINISH`; the assembly header defines
:data:`SIZES`, :data:`FREE`), the order of their array arguments (:func:`slot_arrays`,
:func:`finish_arrays`), the layout of ``sn_sizes`` (:class:`OutputSizes`) and their
ctypes signatures (:func:`bind`, for the launcher).

Entry points, all ``extern "C"``; errors (allocation failure) are non-zero return
codes, never exceptions across the C boundary:

``int sn_run(void* const* arrays, const int64_t* dims, int nthreads, void** handle)``
    computes the expression. ``arrays``: each slot's arrays, slot by slot (see
    :func:`slot_arrays`); then, if the kernel writes a dense array
    (``LoweredKernel.dense_output``), that array: the output in loop order, or the
    values of an output sampled at an operand's pattern; zeroed, or uninitialised when
    the kernel overwrites every element. ``dims``: the size of each index variable, in
    the kernel's index order. A sparse output's ``*handle`` receives the result under
    assembly (a two-phase output keeps ``arrays`` and ``dims``, which must stay valid
    until ``sn_finish``); a dense output ignores ``handle`` (pass None).

Kernels that assemble a sparse output also export:

``void sn_sizes(void* handle, int64_t* sizes)``
    writes ``2 * rank + 1`` sizes (see :class:`OutputSizes`).
``int sn_finish(void* handle, void* const* out, int wide, int nthreads)``
    writes the output into caller-owned arrays in the order of :func:`finish_arrays`
    (index arrays int32, or int64 when ``wide``) and frees the handle, whatever it
    returns.
``void sn_free(void* handle)``
    frees the handle without finishing (after a failed ``sn_run``).

A launcher::

    entry = abi.bind(library, assembles_sparse_output=not kernel.dense_output)
    code = entry.run(arrays, dims, nthreads, ctypes.byref(handle))
    sizes = entry.output_sizes(handle, rank)  # an OutputSizes
    # allocate finish_arrays(rank, num_dense): pos arrays of sizes.positions(level)
    # entries, crd arrays of sizes.coordinates[level], values of sizes.values
    code = entry.finish(handle, out, wide, nthreads)
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..lower.kernel import Slot

__all__ = [
    "MAX_OUTPUT_RANK", "EntryPoint", "EntryPoints", "OutputSizes", "RUN", "SIZES", "FINISH", "FREE",
    "entry_points", "bind", "slot_arrays", "finish_arrays",
]

# The highest output rank a kernel produces (the assembly's coordinate buffers hold 16).
MAX_OUTPUT_RANK = 8

# C parameter and return types used by the entry points, as ctypes passes them.
_CTYPES: dict[str, Any] = {
    "int": ctypes.c_int, "void": None, "void*": ctypes.c_void_p, "void**": ctypes.c_void_p,
    "void* const*": ctypes.c_void_p, "const int64_t*": ctypes.c_void_p, "int64_t*": ctypes.c_void_p,
}


@dataclass(frozen=True)
class EntryPoint:
    """One exported function: name, C return type and (C type, name) parameters."""

    name: str
    restype: str
    params: tuple[tuple[str, str], ...]

    @property
    def declaration(self) -> str:
        """The C++ definition's head, e.g. ``extern "C" void sn_free(void* handle)``."""
        params = ", ".join(f"{ctype} {name}" for ctype, name in self.params)
        return f'extern "C" {self.restype} {self.name}({params})'

    def bind(self, library: ctypes.CDLL) -> Any:
        """``library``'s function, with ``argtypes`` and ``restype`` set."""
        function = getattr(library, self.name)
        function.argtypes = [_CTYPES[ctype] for ctype, _ in self.params]
        function.restype = _CTYPES[self.restype]
        return function


RUN = EntryPoint(
    "sn_run", "int",
    (("void* const*", "arrays"), ("const int64_t*", "dims"), ("int", "nthreads"), ("void**", "handle")),
)
SIZES = EntryPoint("sn_sizes", "void", (("void*", "handle"), ("int64_t*", "sizes")))
FINISH = EntryPoint(
    "sn_finish", "int", (("void*", "handle"), ("void* const*", "out"), ("int", "wide"), ("int", "nthreads"))
)
FREE = EntryPoint("sn_free", "void", (("void*", "handle"),))


def entry_points(assembles_sparse_output: bool) -> tuple[EntryPoint, ...]:
    """The entry points a kernel exports."""
    return (RUN, SIZES, FINISH, FREE) if assembles_sparse_output else (RUN,)


@dataclass(frozen=True)
class OutputSizes:
    """``sn_sizes``'s report on a sparse output of rank ``rank``: per output level (in
    storage order) the coordinates it stores and the per-parent counts it holds, then
    the number of values. Laid out as ``sizes[2 * level]``, ``sizes[2 * level + 1]``,
    ``sizes[2 * rank]``; a level the kernel does not assemble (a dense one) reports 0, 0."""

    coordinates: tuple[int, ...]
    counts: tuple[int, ...]
    values: int

    @staticmethod
    def length(rank: int) -> int:
        """Entries of the ``sizes`` array ``sn_sizes`` fills."""
        return 2 * rank + 1

    @classmethod
    def decode(cls, sizes: Sequence[int], rank: int) -> OutputSizes:
        return cls(tuple(sizes[0 : 2 * rank : 2]), tuple(sizes[1 : 2 * rank : 2]), sizes[2 * rank])

    def positions(self, level: int) -> int:
        """Entries of an assembled level's ``pos`` array: one more than its parents (the
        counts it holds, or for level 0 the one root)."""
        return (self.counts[level] if level > 0 else 1) + 1


@dataclass(frozen=True)
class EntryPoints:
    """A loaded kernel's entry points (ctypes functions; ``sizes``, ``finish`` and
    ``free`` are None unless it assembles a sparse output)."""

    run: Any
    sizes: Any = None
    finish: Any = None
    free: Any = None

    def output_sizes(self, handle: ctypes.c_void_p, rank: int) -> OutputSizes:
        """Call ``sn_sizes`` on ``handle`` and decode its report."""
        sizes = (ctypes.c_int64 * OutputSizes.length(rank))()
        self.sizes(handle, sizes)
        return OutputSizes.decode(sizes, rank)


def bind(library: ctypes.CDLL, assembles_sparse_output: bool) -> EntryPoints:
    """``library``'s entry points with their ctypes signatures set."""
    functions = [entry.bind(library) for entry in entry_points(assembles_sparse_output)]
    return EntryPoints(*functions)


def slot_arrays(slot: Slot) -> list[tuple[str, int]]:
    """The arrays a slot passes to ``sn_run``, in order: ("pos"|"crd", level) for each
    level that stores them, then ("val", -1); a dense slot passes ("dense", -1)."""
    if slot.fmt is None:
        return [("dense", -1)]
    arrays: list[tuple[str, int]] = []
    for level, lvl in enumerate(slot.fmt.levels):
        if lvl.has_pos:
            arrays.append(("pos", level))
        if lvl.has_crd:
            arrays.append(("crd", level))
    return arrays + [("val", -1)]


def finish_arrays(rank: int, num_dense: int) -> list[tuple[str, int]]:
    """The arrays ``sn_finish`` writes, in order: ("pos", level), ("crd", level) for
    each assembled level (those after the ``num_dense`` dense ones), then ("val", -1)."""
    return [(kind, level) for level in range(num_dense, rank) for kind in ("pos", "crd")] + [("val", -1)]
