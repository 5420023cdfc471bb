"""A mixture of experts' routing index work as ``torch.library`` custom ops, whose sizes
depend on the routing: so that ``torch.compile`` traces :class:`~.moe.SparseMoE` whole.

* ``sparsenn::kept_choices(keep)``: the positions of the routing choices a capacity
  limit keeps, ascending (``keep.nonzero()``);
* ``sparsenn::moe_dispatch(gate_pos, gate_crd, num_experts, wide)``: the index arrays
  of the expert-major panels of a ``T × E`` CSR gate (see :class:`~.moe.Dispatch`) and
  their capacity ``C``, the most tokens any expert received.

Their fake implementations give the data-dependent sizes (the number of kept choices,
``C``) as unbacked symbolic sizes, so a traced model's later kernels take the sizes of
each call; the index arrays are integer tensors, outside autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["occurrences", "kept_choices", "dispatch_arrays"]


def occurrences(index: Tensor, n: int) -> Tensor:
    """How often each of ``0 .. n-1`` occurs in ``index`` (int64): ``torch.bincount`` with
    the static size ``n``, which a tracer can follow."""
    return torch.zeros(n, dtype=torch.int64, device=index.device).index_add_(
        0, index, torch.ones_like(index, dtype=torch.int64))


@torch.library.custom_op("sparsenn::kept_choices", mutates_args=())
def kept_choices(keep: Tensor) -> Tensor:
    """The (int64) positions where the boolean vector ``keep`` is true, ascending."""
    return keep.nonzero().squeeze(1)


@kept_choices.register_fake
def _(keep: Tensor) -> Tensor:
    count = torch.library.get_ctx().new_dynamic_size()
    torch._check(count <= keep.shape[0])
    return keep.new_empty(count, dtype=torch.int64)


@torch.library.custom_op("sparsenn::moe_dispatch", mutates_args=())
def dispatch_arrays(gate_pos: Tensor, gate_crd: Tensor, num_experts: int,
                    wide: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int]:
    """``(slot_pos, slot_crd, gather_pos, gather_crd, combine_crd, C)`` of a CSR gate with
    row positions ``gate_pos`` (``T + 1``) and expert coordinates ``gate_crd`` (sorted
    within a row), as int64 if ``wide`` else int32:

    * slot ``c`` of expert ``e`` holds the expert's ``c``-th token in token order;
      ``slot_pos``/``slot_crd``: the ``E × C`` CSR of occupied slots;
    * ``gather_pos``/``gather_crd``: the ``(E·C) × T`` CSR with each occupied slot's token;
    * ``combine_crd``: each gate entry's slot ``e·C + c`` (the ``T × (E·C)`` combine
      matrix has the gate's row positions and values).
    """
    index = torch.int64 if wide else torch.int32
    tokens = gate_pos.numel() - 1
    expert = gate_crd.long()
    token = torch.repeat_interleave(torch.arange(tokens), gate_pos.long().diff())
    order = torch.sort(expert, stable=True).indices  # expert-major, tokens ascending within an expert
    counts = occurrences(expert, num_experts)
    capacity = int(counts.max()) if expert.numel() else 0
    slot = torch.empty_like(expert)
    slot[order] = torch.arange(expert.numel()) - (torch.cumsum(counts, 0) - counts)[expert[order]]
    flat = expert * capacity + slot  # ascending within a token row: experts are sorted there
    slot_counts = occurrences(flat, num_experts * capacity)
    zero = counts.new_zeros(1)
    return (torch.cat([zero, torch.cumsum(counts, 0)]).to(index), slot[order].to(index),
            torch.cat([zero, torch.cumsum(slot_counts, 0)]).to(index), token[order].to(index), flat.to(index),
            capacity)


@dispatch_arrays.register_fake
def _(gate_pos: Tensor, gate_crd: Tensor, num_experts: int, wide: bool):
    index = torch.int64 if wide else torch.int32
    tokens, nnz = gate_pos.shape[0] - 1, gate_crd.shape[0]
    capacity = torch.library.get_ctx().new_dynamic_size()
    torch._check(capacity <= tokens)
    new = gate_crd.new_empty
    return (new(num_experts + 1, dtype=index), new(nnz, dtype=index), new(num_experts * capacity + 1, dtype=index),
            new(nnz, dtype=index), new(nnz, dtype=index), capacity)

