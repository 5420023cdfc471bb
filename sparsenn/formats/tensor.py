"""SparseTensor: a tensor stored as a tree of levels (TACO layout).

The root has one position, 0. A dense level of size ``N`` maps parent position
``p`` and coordinate ``i`` to ``p * N + i``; a compressed level stores the
children of ``p`` at ``pos[p] .. pos[p+1] - 1`` with coordinates ``crd``; a
singleton level stores one coordinate ``crd[p]`` per parent position; a
grouped level (``nm(n,m)``) stores ``n`` coordinates ``crd[p * n .. p * n + n - 1]``.
``values[q]`` is the value at position ``q`` of the last storage level.
Stored coordinates, read in storage order, are sorted and unique.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.compiler import is_compiling

from sparsenn.formats import export, indexing
from sparsenn.formats.arithmetic import arithmetic
from sparsenn.formats.construct import Constructors
from sparsenn.formats.format import Format, parse_format
from sparsenn.formats.pack import logical_coords, pack, unpack
from sparsenn.formats.validate import VALUE_DTYPE_NAMES, VALUE_DTYPES, check_array, choose_index_dtype, validate

if TYPE_CHECKING:
    import scipy.sparse


def array_version(array: Tensor | None) -> tuple[int, int | None] | None:
    """What identifies an index array's contents: its data address (changed when the
    array or its ``.data`` is replaced) and its in-place modification counter (None for
    inference-mode tensors, which torch does not version). None for no array, and while
    ``torch.compile``/``torch.export`` trace (arrays are fake; the traced op validates the
    real ones, ``compiler/runtime/ops.py``)."""
    if array is None or is_compiling():
        return None
    return array.data_ptr(), None if array.is_inference() else array._version


def _plain_arrays(arrays: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    """Index arrays computed under a torch.func transform (``grad``, ``vmap``, ...) as the
    plain tensors inside its wrappers: a pattern is a constant of every transform (only
    values are differentiated or batched). ValueError for arrays ``vmap`` batches."""
    plain = []
    for array in arrays:
        while array is not None and torch._C._functorch.is_functorch_wrapped_tensor(array):
            if torch._C._functorch.is_batchedtensor(array):
                raise ValueError("a SparseTensor's index arrays (its pattern) cannot be batched by vmap; "
                                 "batch its values on one pattern instead")
            array = torch._C._functorch.get_unwrapped(array)
        plain.append(array)
    return tuple(plain)


def _stored_positions(level_sizes: tuple[int, ...], crd: tuple[Tensor | None, ...]) -> tuple[int, ...]:
    """Positions of each storage level: a dense level multiplies its parent's count,
    compressed, singleton and grouped levels have one coordinate per position."""
    positions, parents = [], 1
    for size, coordinates in zip(level_sizes, crd):
        parents = parents * size if coordinates is None else coordinates.shape[0]
        positions.append(parents)
    return tuple(positions)


class SparseTensor(Constructors):
    """A sparse tensor: ``shape``, ``format`` and per-storage-level arrays.

    ``pos[l]`` (compressed levels) and ``crd[l]`` (compressed, singleton and
    grouped levels) are 1-D contiguous CPU tensors of ``index_dtype`` (int32 when
    every dimension, level size and position count is below 2**31, else int64),
    None for other levels. ``values`` is a 1-D float32, float64, bfloat16 or float16
    tensor with one entry per position of the last storage level (dense inner
    levels, e.g. BSR blocks, and the padding of ``nm(n,m)`` groups store explicit
    zeros).
    ``values`` may require grad; it is never copied or detached.

    A SparseTensor is immutable (its attributes cannot be reassigned; in-place edits of
    its index arrays are detected before any kernel reads them), so its structure is
    checked once, here.

    ``check=True`` validates every array (ValueError/TypeError naming it);
    ``check=False`` trusts the caller and costs O(number of levels).
    ``index_dtype`` is only needed when no level has index arrays.
    """

    shape: tuple[int, ...]
    format: Format
    pos: tuple[Tensor | None, ...]
    crd: tuple[Tensor | None, ...]
    values: Tensor
    level_sizes: tuple[int, ...]
    index_dtype: torch.dtype
    # (format, shape, stored positions per storage level, index dtype): all of the
    # structure but the coordinates themselves. Compiled kernels are chosen by it.
    signature: tuple

    def __init__(self, shape: Sequence[int], format: str | Format, pos: Sequence[Tensor | None],
                 crd: Sequence[Tensor | None], values: Tensor, check: bool = True,
                 index_dtype: torch.dtype | None = None) -> None:
        # Traced sizes stay symbolic (an expert panel's capacity is decided by the routing).
        shape = tuple(shape) if is_compiling() else tuple(operator.index(n) for n in shape)
        if any(n < 0 for n in shape):
            raise ValueError(f"shape {shape} has a negative dimension")
        fmt = parse_format(format, len(shape))
        sizes = tuple(size for _, size, _ in fmt.storage_levels(shape))
        pos, crd = tuple(pos), tuple(crd)
        if not is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None:
            pos, crd = _plain_arrays(pos), _plain_arrays(crd)
        arrays = [a for a in pos + crd if a is not None]
        if check:
            validate(fmt, shape, sizes, pos, crd, values, index_dtype)
        if arrays:
            index_dtype = arrays[0].dtype
        else:
            counts = [math.prod(sizes[:depth + 1]) for depth in range(len(sizes))]
            index_dtype = choose_index_dtype(shape + sizes + tuple(counts), index_dtype)
        self.__dict__.update(
            shape=shape, format=fmt, pos=pos, crd=crd, values=values, level_sizes=sizes, index_dtype=index_dtype,
            signature=(fmt, shape, _stored_positions(sizes, crd), index_dtype),
            _index_arrays=tuple(arrays), _versions=tuple(array_version(a) for a in arrays),
            _num_values=values.shape[0],
        )

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(
            f"SparseTensor is immutable: cannot set {name!r}; build a new one (with_values(), asformat(), "
            "or the constructor) instead"
        )

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"SparseTensor is immutable: cannot delete {name!r}")

    def __reduce__(self):
        """Pickle, ``copy.deepcopy`` and ``torch.save`` rebuild through the validating
        constructor: the copy gets fresh modification records."""
        return (SparseTensor, (self.shape, self.format, self.pos, self.crd, self.values, True, self.index_dtype))

    # ----------------------------------------------------------------- properties
    @property
    def ndim(self) -> int:
        """Number of logical modes."""
        return len(self.shape)

    def dim(self) -> int:
        """Number of logical modes (as ``torch.Tensor.dim``)."""
        return len(self.shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        """``torch.Size(shape)``, or the size of dimension ``dim`` (negative counts from the end)."""
        if dim is None:
            return torch.Size(self.shape)
        return self.shape[_dimension(dim, self.ndim)]

    @property
    def dtype(self) -> torch.dtype:
        """dtype of ``values`` (float32, float64, bfloat16 or float16)."""
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        """Device of the arrays (always CPU)."""
        return self.values.device

    @property
    def nnz(self) -> int:
        """Number of stored values (explicit zeros of dense inner levels and nm padding included)."""
        return self.values.numel()

    def numel(self) -> int:
        """Number of elements of the logical (dense) tensor."""
        return math.prod(self.shape)

    @property
    def density(self) -> float:
        """``nnz / numel``; 0.0 for an empty shape."""
        numel = self.numel()
        return self.nnz / numel if numel else 0.0

    def num_positions(self, level: int) -> int:
        """Positions of storage level ``level`` (the root, above level 0, has one)."""
        return self.signature[2][level]

    def index_arrays_unmodified(self) -> bool:
        """Whether every pos/crd array is the one validated at construction: same data
        address, same in-place modification counter (half of :meth:`check_unmodified`,
        as a test; not for traced code, whose arrays are fake)."""
        for array, version in zip(self._index_arrays, self._versions):
            if (array.data_ptr(), None if array.is_inference() else array._version) != version:
                return False
        return True

    def check_unmodified(self) -> None:
        """Raise ValueError if a pos/crd array was modified in place (or its ``.data``
        replaced) since construction, or ``values`` no longer has one entry per stored
        position. With the attributes immutable, this is all that can break the
        structure a kernel trusts; it costs O(number of levels)."""
        if is_compiling():  # fake arrays: the traced op checks the real ones
            return
        if not self.index_arrays_unmodified():
            raise ValueError("index arrays of this SparseTensor were modified in place or replaced after "
                             "construction; build a new SparseTensor instead of editing pos/crd")
        values = self.values
        if values.dim() != 1 or values.shape[0] != self._num_values:
            raise ValueError(f"values has shape {tuple(values.shape)}, expected ({self._num_values},) "
                             "(one per stored position); it was resized after construction")

    def __repr__(self) -> str:
        return (f"SparseTensor(shape={self.shape}, format={self.format}, nnz={self.nnz}, "
                f"dtype={self.dtype}, index_dtype={self.index_dtype})")

    # ------------------------------------------------------------ arithmetic
    # Computed by the operations the compiler installs (see sparsenn.formats.arithmetic).
    def __add__(self, other):
        return arithmetic().add(self, other)

    def __radd__(self, other):
        return arithmetic().add(other, self)

    def __sub__(self, other):
        return arithmetic().subtract(self, other)

    def __rsub__(self, other):
        return arithmetic().subtract(other, self)

    def __mul__(self, other):
        return arithmetic().multiply(self, other)

    __rmul__ = __mul__

    def __neg__(self) -> SparseTensor:
        return self.with_values(-self.values)

    def __matmul__(self, other):
        return arithmetic().matmul(self, other)

    def __rmatmul__(self, other):
        return arithmetic().matmul(other, self)

    # ------------------------------------------------------------ views of storage
    def _share(self, shape: tuple[int, ...], fmt: Format, values: Tensor) -> SparseTensor:
        """A SparseTensor sharing this tensor's index arrays (and modification record)."""
        # new values only (mostly this tensor's own format and shape: no dataclass comparison)
        if (fmt is self.format or fmt == self.format) and (shape is self.shape or shape == self.shape):
            view = object.__new__(SparseTensor)
            view.__dict__.update(self.__dict__, values=values)
            return view
        view = SparseTensor(shape, fmt, self.pos, self.crd, values, check=False, index_dtype=self.index_dtype)
        view.__dict__["_versions"] = self._versions
        return view

    def with_values(self, values: Tensor) -> SparseTensor:
        """Same pattern (index arrays shared) with new ``values``; autograd is kept."""
        check_array("values", values, VALUE_DTYPES)
        if values.numel() != self.nnz:
            raise ValueError(f"values has length {values.numel()}, expected {self.nnz}")
        return self._share(self.shape, self.format, values)

    def to(self, *args, **kwargs) -> SparseTensor:
        """``torch.Tensor.to``'s signatures: ``to(dtype)``, ``to(device, dtype)``,
        ``to(other)`` (a tensor or SparseTensor), with ``non_blocking`` and ``copy``.

        Converts ``values`` to any of the value dtypes (``VALUE_DTYPES``), differentiably;
        index arrays are shared unless ``copy=True``. SparseTensors live on the CPU only
        (ValueError for another device). Returns ``self`` when nothing changes."""
        copy = kwargs.pop("copy", False)
        if args and isinstance(args[0], SparseTensor):
            args = (args[0].values,) + args[1:]
        try:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except (RuntimeError, TypeError) as exc:
            raise TypeError(f"SparseTensor.to() takes torch.Tensor.to's arguments: {exc}") from None
        if device is not None and device.type != "cpu":
            raise ValueError(f"SparseTensor arrays live on the CPU only; cannot move to {device}")
        if memory_format is not None:
            raise TypeError("SparseTensor.to() takes no memory_format (a SparseTensor has no strides)")
        if dtype is not None and dtype not in VALUE_DTYPES:
            raise TypeError(f"SparseTensor values must be {VALUE_DTYPE_NAMES}, got {dtype}")
        result = self.clone() if copy else self
        if dtype is None or dtype == self.dtype:
            return result
        return result.with_values(result.values.to(dtype))

    def clone(self) -> SparseTensor:
        """A copy with its own index arrays and ``values.clone()`` (differentiable, as
        ``torch.Tensor.clone``)."""
        pos = tuple(None if a is None else a.clone() for a in self.pos)
        crd = tuple(None if a is None else a.clone() for a in self.crd)
        return SparseTensor(self.shape, self.format, pos, crd, self.values.clone(), check=False,
                            index_dtype=self.index_dtype)

    def detach(self) -> SparseTensor:
        """The same tensor with ``values.detach()`` (index arrays and storage shared)."""
        return self._share(self.shape, self.format, self.values.detach())

    # ------------------------------------------------------------ reductions and indexing
    def sum(self, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        """Sum of the stored values over ``dim`` (every dimension when None), as a dense
        tensor: the compiled einsum ``"ij->i"`` (for ``dim=1`` of a matrix), differentiable
        with respect to ``values``. ``keepdim`` keeps the summed dimensions with size 1."""
        if dim is None:
            dims = set(range(self.ndim))
        else:
            given = (dim,) if hasattr(type(dim), "__index__") else tuple(dim)
            dims = {_dimension(d, self.ndim) for d in given}
            if len(dims) != len(given):
                raise ValueError(f"sum: dim {dim} repeats a dimension")
        letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"[:self.ndim]
        kept = "".join(letter for mode, letter in enumerate(letters) if mode not in dims)
        result = arithmetic(need_einsum=True).einsum(f"{letters}->{kept}", self, out_format="dense")
        if keepdim:
            result = result.reshape(tuple(1 if mode in dims else n for mode, n in enumerate(self.shape)))
        return result

    def __getitem__(self, key: int | slice) -> SparseTensor:
        """``S[i]`` (rank - 1) or ``S[a:b:c]`` along the first dimension, exactly the stored
        entries there, in the same format family (see :mod:`sparsenn.formats.indexing`)."""
        return indexing.select(self, key)

    def permute(self, *dims: int | Sequence[int]) -> SparseTensor:
        """Reorder logical modes: result mode ``k`` is mode ``dims[k]`` of this tensor.

        Only ``shape`` and ``mode_order`` change; all arrays are shared. Blocked
        formats keep row-major blocks, so their ``values`` are re-laid out
        block by block (a differentiable copy); index arrays are still shared.
        An ``nm(n,m)`` tensor only takes the identity permutation (ValueError otherwise).
        """
        order = tuple(dims[0]) if len(dims) == 1 and not isinstance(dims[0], int) else dims
        order = tuple(operator.index(d) + (self.ndim if operator.index(d) < 0 else 0) for d in order)
        if sorted(order) != list(range(self.ndim)):
            raise ValueError(f"permute dims {dims} are not a permutation of range({self.ndim})")
        if self.format.nm is not None:
            if order != tuple(range(self.ndim)):
                raise ValueError(f"a tensor in format {self.format} groups its last dimension and cannot be "
                                 f"permuted by {order}; convert it with asformat (e.g. 'coo') first")
            return self
        inverse = [0] * self.ndim
        for new, old in enumerate(order):
            inverse[old] = new
        fmt = self.format
        mode_order = tuple(inverse[m] for m in fmt.mode_order)
        shape = tuple(self.shape[d] for d in order)
        values = self.values
        block = None
        if fmt.block is not None:
            block = tuple(fmt.block[d] for d in order)
            blocks = values.view(-1, *fmt.block).permute(0, *(1 + d for d in order))
            values = blocks.reshape(-1)
        return self._share(shape, Format(fmt.levels, mode_order, block), values)

    def transpose(self, d0: int = 0, d1: int = 1) -> SparseTensor:
        """Swap modes ``d0`` and ``d1`` (see ``permute``)."""
        order = list(range(self.ndim))
        order[d0], order[d1] = order[d1], order[d0]
        return self.permute(order)

    @property
    def T(self) -> SparseTensor:
        """All modes reversed (the matrix transpose for rank 2)."""
        return self.permute(tuple(reversed(range(self.ndim))))

    # ----------------------------------------------------------------- conversion
    def coords(self) -> tuple[Tensor, Tensor]:
        """``(indices, values)`` of the stored entries, in storage order.

        ``indices`` is ``(ndim, nnz)`` int64 with one row per logical mode;
        ``values`` is ``self.values`` itself (not a copy).
        """
        keys = unpack(self.format, self.shape, self.pos, self.crd)
        return logical_coords(self.format, self.shape, keys), self.values

    def to_dense(self) -> Tensor:
        """A new strided tensor of ``shape`` (differentiable with respect to ``values``)."""
        if self.format.is_dense:
            order = self.format.mode_order
            stored = self.values.view([self.shape[m] for m in order])
            inverse = sorted(range(self.ndim), key=order.__getitem__)
            return stored.permute(inverse).clone(memory_format=torch.contiguous_format)
        indices, values = self.coords()
        return values.new_zeros(self.shape).index_put(tuple(indices), values)

    def asformat(self, format: str | Format, index_dtype: torch.dtype | None = None) -> SparseTensor:
        """Convert to another format without densifying (a dense source drops its zeros).

        Stored entries, explicit zeros included, stay stored. ``index_dtype=None``
        keeps this tensor's index width, widened to int64 if the result needs it.
        An ``nm(n,m)`` target rejects (ValueError) a group holding more than ``n``
        entries, from a dense source too (use ``from_dense`` to keep the largest).
        """
        target = parse_format(format, self.ndim)
        if target == self.format and index_dtype in (None, self.index_dtype):
            return self
        if index_dtype is None and self.index_dtype == torch.int64:
            index_dtype = torch.int64
        if self.format.is_dense:
            if target.nm is not None:
                return self.asformat("coo", index_dtype).asformat(target, index_dtype)
            return SparseTensor.from_dense(self.to_dense(), target, index_dtype)
        indices, values = self.coords()
        packed = pack(target, self.shape, indices, values, index_dtype=index_dtype)
        return SparseTensor(self.shape, target, packed.pos, packed.crd, packed.values,
                            check=False, index_dtype=packed.index_dtype)

    def to_torch(self, layout: torch.layout | None = None,
                 blocksize: tuple[int, int] | None = None) -> Tensor:
        """Convert to a torch tensor of ``layout``.

        ``layout=None`` picks the natural layout: csr, csc, bsr and bsc formats
        give that layout, all-dense formats a strided tensor, every other
        format a coalesced ``sparse_coo`` tensor. ``blocksize`` is needed for
        BSR/BSC output from an unblocked tensor.
        """
        return export.to_torch(self, layout, blocksize)

    def to_scipy(self) -> scipy.sparse.sparray:
        """Convert a rank-2 tensor to a scipy sparse array (copied).

        csr, csc, coo and bsr give ``csr_array``, ``csc_array``, ``coo_array``
        and ``bsr_array``; other formats give ``csr_array``.
        """
        return export.to_scipy(self)


def is_sparse(x: object) -> bool:
    """Whether ``x`` is a :class:`SparseTensor`. Code that ``torch.compile`` traces asks
    here, and builds its unchecked tensors with :func:`unchecked_tensor`, so that the
    tracer reaches the class through this module's name only (a class reached through
    two modules' names costs a Python guard that they are one, on every compiled call)."""
    return isinstance(x, SparseTensor)


def unchecked_tensor(shape: Sequence[int], fmt: Format, pos: Sequence[Tensor | None], crd: Sequence[Tensor | None],
                     values: Tensor) -> SparseTensor:
    """``SparseTensor(shape, fmt, pos, crd, values, check=False)``, for traced code (see
    :func:`is_sparse`)."""
    return SparseTensor(shape, fmt, pos, crd, values, check=False)


def _dimension(dim: object, ndim: int) -> int:
    """``dim`` as an index in ``range(ndim)`` (negative counts from the end), as torch checks it."""
    if isinstance(dim, bool) or not hasattr(type(dim), "__index__"):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    index = operator.index(dim)
    if not -ndim <= index < ndim:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    return index % ndim


from_dense = SparseTensor.from_dense
from_torch = SparseTensor.from_torch
from_scipy = SparseTensor.from_scipy
from_edge_index = SparseTensor.from_edge_index
from_coo = SparseTensor.from_coo
