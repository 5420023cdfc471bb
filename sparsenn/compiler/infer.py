"""Output format inference (Scorch, Algorithm 4).

Each output mode is inferred independently from the level kinds that store its index
variable in the operands:

* a product is sparse at a mode if any factor is sparse there (the result is at least
  as sparse as that factor); factors lacking the index are neutral;
* a sum is dense at a mode if any term is dense there, and sparse + sparse is sparse
  (conservative: a sparse result costs a constant factor when it turns out dense, a
  dense result can cost asymptotically more when it turns out sparse);
* a term that lacks an output index broadcasts over it, so it is dense there.

Generated kernels assemble sparse outputs as a dense prefix followed by compressed
levels, so a dense level that would follow a sparse one is stored compressed too
(again the conservative choice).
"""

from __future__ import annotations

from collections.abc import Sequence

from sparsenn.formats import Format, parse_format

from .notation import Assignment, Term

__all__ = ["infer_output_format", "mode_is_sparse", "sparse_by_estimate", "SPARSE_OUTPUT_DENSITY"]

SPARSE_OUTPUT_DENSITY = 1 / 8


def _level_letter(fmt: Format, mode: int) -> str:
    return fmt.letters[fmt.mode_order.index(mode)]


def _term_is_sparse(term: Term, index: str, formats: Sequence[Format | None]) -> bool:
    """Multiplication rule: sparse iff some factor stores ``index`` in a sparse level."""
    for access in term.factors:
        fmt = formats[access.operand]
        if fmt is not None and index in access.indices:
            if _level_letter(fmt, access.indices.index(index)) != "d":
                return True
    return False


def mode_is_sparse(assignment: Assignment, index: str, formats: Sequence[Format | None]) -> bool:
    """Addition rule over the terms: dense if any term is dense at ``index``."""
    return all(_term_is_sparse(t, index, formats) for t in assignment.terms)


def infer_output_format(
    assignment: Assignment, formats: Sequence[Format | None]
) -> Format | None:
    """The output's format, or ``None`` for a dense result (a plain ``torch.Tensor``).

    ``formats[n]`` is operand n's format, ``None`` for a dense ``torch.Tensor``.
    """
    letters = ["c" if mode_is_sparse(assignment, i, formats) else "d" for i in assignment.output]
    if "c" not in letters:
        return None
    first_sparse = letters.index("c")
    letters[first_sparse:] = "c" * (len(letters) - first_sparse)
    return parse_format("".join(letters), len(letters))


def sparse_by_estimate(
    assignment: Assignment, formats: Sequence[Format | None], estimated_nnz: float, numel: int
) -> Format | None:
    """A sparse format for a result Algorithm 4 calls dense, when that is asymptotically
    wrong: ``A[i,j] A[k,j]`` (A·Aᵀ with CSR operands) stores ``i`` and ``k`` in dense
    levels, yet the result only has the pairs that share a ``j``. When every output index
    is carried by sparse operands only (no dense operand can fill a row) and the
    schedule's estimate of the result's nonzeros is below ``SPARSE_OUTPUT_DENSITY`` of
    its size, the result is stored with a dense first level and compressed rest."""
    output = assignment.output
    if len(output) < 2 or numel == 0 or estimated_nnz >= SPARSE_OUTPUT_DENSITY * numel:
        return None
    for term in assignment.terms:
        for access in term.factors:
            if formats[access.operand] is None and set(access.indices) & set(output):
                return None
    return parse_format("d" + "c" * (len(output) - 1), len(output))
