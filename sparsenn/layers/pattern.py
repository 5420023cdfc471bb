"""Pattern buffers: the index arrays of a module's fixed-pattern sparse weight, kept as
buffers ``{name}_pos{l}`` / ``{name}_crd{l}`` next to the parameter ``{name}_values``.

Buffers are public module state: ``load_state_dict``, ``to_empty``, ``.to()``, assignment
and in-place edits can change them. Kernels trust a pattern's structure (sorted, unique,
in-range coordinates), so before one reads them :meth:`PatternBuffers.tensor` checks that
the buffers are the tensors last validated, unmodified (their data pointer and torch's
in-place version counter; O(number of levels)), and validates them in full otherwise,
raising a ValueError that names the buffer. An edit that leaves a valid pattern is adopted:
the buffers are the weight's structure, as a parameter is its values.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.compiler import is_compiling

from sparsenn.formats import Format, SparseTensor, parse_format
from sparsenn.formats.tensor import unchecked_tensor
from sparsenn.formats.tensor import array_version
from sparsenn.layers.optimizer_state import watch_resized

__all__ = ["PatternBuffers"]

_ARRAY = re.compile(r"\b(pos|crd)\[(\d+)\]")


def _record_test(names: tuple[str, ...], record: tuple[tuple[Tensor, int, int | None], ...]
                 ) -> Callable[[dict], bool] | None:
    """``test(buffers)``: whether the buffers ``names`` are the recorded tensors with the
    recorded data pointers and versions, written out as one expression (a loop costs as
    much again); None when a buffer has no version counter (an inference tensor: checked
    in full at every call)."""
    if any(version is None for _, _, version in record):
        return None
    tests = [f"(a{n} := buffers.get({name!r})) is array{n} and a{n}.data_ptr() == {address} "
             f"and a{n}._version == {version}" for n, (name, (_, address, version)) in enumerate(zip(names, record))]
    arrays = {f"array{n}": array for n, (array, _, _) in enumerate(record)}
    return eval(f"lambda buffers: {' and '.join(tests) or 'True'}", arrays)


def _holder(names: tuple[str, ...], record: tuple[tuple[Tensor, int, int | None], ...], values_name: str,
            weight: SparseTensor) -> Callable[[dict, dict], SparseTensor | None]:
    """``held(buffers, parameters)``: ``weight`` while the parameter ``values_name`` is its
    values and the buffers ``names`` are the recorded arrays (the same objects), else
    None; written out as one expression, as :func:`_record_test` is."""
    tests = [f"parameters.get({values_name!r}) is values"]
    tests += [f"buffers.get({name!r}) is array{n}" for n, name in enumerate(names)]
    arrays = {f"array{n}": array for n, (array, _, _) in enumerate(record)}
    return eval(f"lambda buffers, parameters: weight if {' and '.join(tests)} else None",
                {**arrays, "values": weight.values, "weight": weight})


def _none(buffers: dict, parameters: dict) -> None:
    return None


def _token(array: Tensor | None) -> tuple | None:
    """What identifies a buffer's current contents: the object and its data version."""
    return None if array is None else (id(array), array_version(array))


class PatternBuffers:
    """The buffers holding the pattern of the ``shape`` weight ``name`` of a module.

    ``format`` is the weight's storage format; the buffer names (``names``) follow its
    levels (``weight_pos1``, ``weight_crd1`` for csr). Kept in the module's ``__dict__`` (not a
    submodule); it holds the SparseTensor last validated over the buffers and a record
    of those buffers (object, data pointer, version counter). ``validations`` counts the
    full checks of the buffers: one while they stay unchanged, one more after each edit.
    """

    def __init__(self, name: str, shape: tuple[int, int], fmt: Format) -> None:
        self.name, self.shape, self.format = name, shape, fmt
        self.names = self.buffer_names()
        self._checked: SparseTensor | None = None  # over the buffers as last validated
        self._weight: SparseTensor | None = None  # _checked with the values parameter, as last returned
        self._record: tuple[tuple[Tensor, int, int | None], ...] = ()  # (buffer, data pointer, version)
        self._unchanged: Callable[[dict], bool] | None = None  # the record as a test of the buffers, if versioned
        self.held: Callable[[dict, dict], SparseTensor | None] = _none  # see _hold
        self._unloaded: dict[str, tuple[tuple | None, str]] = {}  # buffer -> (token when marked, why)
        self.deferred: str | None = None  # why the buffers hold no pattern yet (a layer built on the meta device)
        self.validations = 0

    def __getstate__(self) -> dict:  # the record's tests are code made in this process: made again from the record
        return {**self.__dict__, "_unchanged": None, "held": None}

    def __setstate__(self, state: dict) -> None:
        if "_names" in state:  # pickled when the names were private
            state["names"] = state.pop("_names")
        self.__dict__.update(state)
        if self._record:
            self._unchanged = _record_test(self.names, self._record)
        self._hold(self._weight)

    def _hold(self, weight: SparseTensor | None) -> SparseTensor | None:
        """Remember ``weight`` as the one :meth:`tensor` last returned (None: none) and
        write ``held(module._buffers, module._parameters)``: that weight while the buffers
        and the values parameter are still its objects (versioned ones), else None. Their
        contents are not checked there: for a kernel call whose guard checks them (every
        index array's data pointer and version, the values' shape, dtype and layout:
        :func:`~sparsenn.compiler.runtime.validate.call_guard`); any other use takes
        :meth:`tensor`."""
        self._weight = weight
        self.held = (_none if weight is None or self._unchanged is None
                      else _holder(self.names, self._record, self.values_name, weight))
        return weight

    @property
    def values_name(self) -> str:
        return f"{self.name}_values"

    def buffer_names(self, fmt: Format | None = None) -> tuple[str, ...]:
        """Names of the pattern buffers of format ``fmt`` (default: the current one)."""
        fmt = self.format if fmt is None else fmt
        return tuple(f"{self.name}_{kind}{level}" for kind in ("pos", "crd") for level, lvl in enumerate(fmt.levels)
                     if (lvl.has_pos if kind == "pos" else lvl.has_crd))

    def register(self, module: nn.Module, fmt: Format, pos: tuple[Tensor | None, ...],
                 crd: tuple[Tensor | None, ...]) -> None:
        """Register ``fmt``'s index arrays as buffers of ``module``, replacing the old ones."""
        for name in self.buffer_names():
            if name in module._buffers:
                delattr(module, name)
        self.format = fmt
        for kind, arrays in (("pos", pos), ("crd", crd)):
            for level, array in enumerate(arrays):
                if array is not None:
                    module.register_buffer(f"{self.name}_{kind}{level}", array)
        self.names = self.buffer_names()
        self._checked, self._record, self._unloaded = None, (), {}
        self._unchanged = None
        self._hold(None)
        self.deferred = None

    def _arrays(self, module: nn.Module) -> tuple[tuple[Tensor | None, ...], tuple[Tensor | None, ...]]:
        levels = range(len(self.format.levels))
        buffers = module._buffers
        return (tuple(buffers.get(f"{self.name}_pos{level}") for level in levels),
                tuple(buffers.get(f"{self.name}_crd{level}") for level in levels))

    def tensor(self, module: nn.Module) -> SparseTensor:
        """The weight as a SparseTensor over the buffers, its values the parameter.

        O(levels) while the buffers are the tensors last validated, with the same data
        pointers and in-place version counters; validated in full (ValueError naming the
        buffer) after they were edited, replaced or partly loaded. Buffers created under
        ``torch.inference_mode`` carry no version counter: they are validated at every call.
        The same SparseTensor is returned while the buffers and the parameter object are."""
        values = module._parameters.get(f"{self.name}_values")
        if is_compiling():  # fake arrays: the traced op validates the real ones (runtime/ops.py)
            pos, crd = self._arrays(module)
            return unchecked_tensor(self.shape, self.format, pos, crd, values)
        checked, unchanged = self._checked, self._unchanged
        if (checked is not None and unchanged is not None and values is not None
                and values.shape == checked.values.shape and unchanged(module._buffers)):
            weight = self._weight
            if weight is None or weight.values is not values:  # the same parameter: the same weight
                weight = self._hold(checked.with_values(values))
            return weight
        return self._hold(self._validate(module, values).with_values(values))

    def _validate(self, module: nn.Module, values: Tensor | None) -> SparseTensor:
        """Check the buffers in full; remember them as validated."""
        self.validations += 1
        owner = type(module).__name__
        if self.deferred is not None:
            raise ValueError(f"{owner}: {self.deferred}")
        for name, (token, why) in list(self._unloaded.items()):
            if _token(module._buffers.get(name, module._parameters.get(name))) == token:
                raise ValueError(f"{owner}: {name} was not loaded: {why}")
            del self._unloaded[name]  # set again since the load
        if not isinstance(values, Tensor):
            raise ValueError(f"{owner}: the parameter {self.values_name} is missing")
        pos, crd = self._arrays(module)
        try:
            checked = SparseTensor(self.shape, self.format, pos, crd, values.detach(), check=True)
        except (TypeError, ValueError) as exc:
            detail = _ARRAY.sub(lambda m: f"{self.name}_{m[1]}{m[2]}", str(exc))
            detail = re.sub(r"^values\b", self.values_name, detail)
            raise ValueError(f"{owner}: the {self.format} pattern of the {self.shape} {self.name} is invalid"
                             f"{self._changes(module)}: {detail}. The pattern buffers are the weight's "
                             f"structure ({', '.join(self.names)}); load a whole pattern with "
                             "load_state_dict or build a new layer") from None
        arrays = tuple(module._buffers[name] for name in self.names)
        self._checked = checked
        self._record = tuple((a, a.data_ptr(), None if a.is_inference() else a._version) for a in arrays)
        self._unchanged = _record_test(self.names, self._record)
        return checked

    def _changes(self, module: nn.Module) -> str:
        """`` after weight_crd1 was modified in place``: what changed since the last validation."""
        changes = []
        for name, (array, address, version) in zip(self.names, self._record):
            current = module._buffers.get(name)
            if current is None:
                changes.append(f"{name} was removed")
            elif current is not array:
                changes.append(f"{name} was replaced")
            elif version is None or (current.data_ptr(), current._version) != (address, version):
                changes.append(f"{name} was modified in place")
        return f" after {' and '.join(changes)}" if changes else ""

    # ------------------------------------------------------------------ loading
    def saved_format(self, state_dict: Mapping[str, Any], prefix: str) -> Format | str | None:
        """The format recorded in the module's ``_extra_state`` (None when there is none),
        or a description of why the saved record is unusable."""
        extra = state_dict.get(prefix + "_extra_state")
        if not isinstance(extra, Mapping) or "format" not in extra:
            return None
        if tuple(extra.get("shape", ())) != self.shape:
            return f"saved {self.name} shape {tuple(extra.get('shape', ()))} differs from this layer's {self.shape}"
        try:
            return parse_format(extra["format"], len(self.shape))
        except (TypeError, ValueError) as exc:
            return f"saved {self.name} format is invalid: {exc}"

    def split_keys(self, state_dict: Mapping[str, Any], prefix: str,
                   saved: Format | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The pattern's keys (buffers of format ``saved``, default the current one, and
        values; without ``prefix``) present in and missing from ``state_dict``."""
        keys = self.buffer_names(saved) + (self.values_name,)
        return (tuple(key for key in keys if prefix + key in state_dict),
                tuple(key for key in keys if prefix + key not in state_dict))

    def is_partial(self, present: tuple[str, ...], missing: tuple[str, ...]) -> bool:
        """Whether a state dict with these keys holds part of a pattern (not all of it,
        not its values alone, not nothing)."""
        return bool(present) and bool(missing) and present != (self.values_name,)

    def adopt(self, module: nn.Module, state_dict: Mapping[str, Any], prefix: str, fmt: Format) -> str | None:
        """Validate the saved whole pattern of format ``fmt`` and re-register this module's
        buffers (and resize its values) to receive it; a description of the problem, or
        None. Nothing changes when the saved pattern is invalid."""
        arrays = {name: state_dict[prefix + name] for name in self.buffer_names(fmt)}
        levels = range(len(fmt.levels))
        pos = tuple(arrays.get(f"{self.name}_pos{level}") for level in levels)
        crd = tuple(arrays.get(f"{self.name}_crd{level}") for level in levels)
        values = state_dict[prefix + self.values_name]
        try:
            SparseTensor(self.shape, fmt, pos, crd, values.detach(), check=True)
        except (TypeError, ValueError, AttributeError) as exc:
            return f"saved {self.name} pattern is invalid: {exc}"
        self.register(module, fmt, tuple(None if p is None else torch.empty_like(p) for p in pos),
                      tuple(None if c is None else torch.empty_like(c) for c in crd))
        parameter = module._parameters[self.values_name]
        if parameter.shape != values.shape:
            watch_resized(parameter, prefix + self.values_name, parameter.shape)
            parameter.data = parameter.new_empty(values.shape)
            parameter.grad = None  # the old pattern's
        return None

    def mark_unloaded(self, module: nn.Module, missing: tuple[str, ...], loaded: tuple[str, ...],
                      saved: Format | None) -> None:
        """After loading part of a pattern: the next :meth:`tensor` raises, naming a
        missing buffer, until the whole pattern is loaded or the buffer set again."""
        names = self.buffer_names() + (self.values_name,)
        stale = names if saved is not None and saved != self.format else tuple(n for n in names if n in missing)
        why = (f"load_state_dict got {', '.join(loaded) or 'none'} of the {self.name}'s pattern but not "
               f"{', '.join(missing)}, so it would mix two patterns; load a state dict holding the whole "
               f"pattern ({', '.join(self.buffer_names(saved) + (self.values_name,))})")
        for name in stale:
            self._unloaded[name] = (_token(module._buffers.get(name, module._parameters.get(name))), why)
        self._checked = None
        self._hold(None)
