"""Output format inference (Scorch, Algorithm 4), from the operands' formats alone.

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
(again the conservative choice). :func:`result_format` adds one structural rule where
the per-mode view is asymptotically wrong (A·Aᵀ of CSR operands is sparse), so whether
``einsum`` returns a tensor or a SparseTensor depends on the operands' formats and
``out_format`` only, never on their values or number of nonzeros.
:func:`densify_by_fill` is the one data-dependent rule, applied only when
``out_format="auto"`` asks for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sparsenn.formats import Format, parse_format

from ..frontend.notation import Assignment, Term

__all__ = ["infer_output_format", "result_format", "densify_by_fill", "mode_is_sparse",
           "SPARSE_OUTPUT_DENSITY"]

# Estimated fill (stored entries / size) from which a sparse result is dense enough to
# be stored dense: for out_format="auto", and for intermediates of contraction paths.
SPARSE_OUTPUT_DENSITY = 1 / 8


def _term_is_sparse(term: Term, index: str, formats: Sequence[Format | None]) -> bool:
    """Multiplication rule: sparse iff some factor stores ``index`` in a sparse level."""
    for access in term.factors:
        fmt = formats[access.operand]
        if fmt is not None and index in access.indices:
            if not fmt.mode_level(access.indices.index(index)).full:
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


def _carried_by_sparse(assignment: Assignment, index: str, formats: Sequence[Format | None]) -> bool:
    """Some sparse operand has ``index`` (in any level: its pattern constrains it)."""
    return any(
        formats[access.operand] is not None and index in access.indices
        for term in assignment.terms
        for access in term.factors
    )


def _carried_by_sparse_only(assignment: Assignment, formats: Sequence[Format | None]) -> bool:
    """No dense operand carries an output index (none can fill an output fiber)."""
    output = set(assignment.output)
    return not any(
        formats[access.operand] is None and output & set(access.indices)
        for term in assignment.terms
        for access in term.factors
    )


def result_format(assignment: Assignment, formats: Sequence[Format | None]) -> Format | None:
    """The result's format when no ``out_format`` is given: Algorithm 4
    (:func:`infer_output_format`), except that a dense result of rank 2 or more whose
    every output index is carried by sparse operands only (no dense operand can fill an
    output fiber) is stored with a dense first level and compressed rest:
    ``A[i,j] A[k,j] -> [i,k]`` (A·Aᵀ with CSR operands) stores ``i`` and ``k`` in dense
    levels, but the result only has the pairs that share a ``j``, and a dense n² result
    costs asymptotically more than a full sparse one. A max, min or epilogue gives a
    dense result (:attr:`~..frontend.notation.Assignment.dense_result`)."""
    if assignment.dense_result:
        return None
    inferred = infer_output_format(assignment, formats)
    output = assignment.output
    if inferred is None and len(output) >= 2 and _carried_by_sparse_only(assignment, formats):
        return parse_format("d" + "c" * (len(output) - 1), len(output))
    return inferred


def densify_by_fill(
    assignment: Assignment, formats: Sequence[Format | None], inferred: Format | None,
    estimated_nnz: Callable[[], float], numel: int,
) -> Format | None:
    """``out_format="auto"``: ``inferred`` (from :func:`result_format`), or None (dense)
    when it has an index after the first sparse one that no sparse operand carries (its
    level is compressed only to follow a sparse one, see the module doc) and the
    estimated fill (``estimated_nnz()``, an upper bound on the result's stored entries,
    only called in this case) reaches ``SPARSE_OUTPUT_DENSITY`` of ``numel``:
    ``A[i,j] B[i,k] -> [j,k]`` (Aᵀ·B, dense B) fills every ``k`` of each stored ``j``."""
    if inferred is None or numel == 0:
        return inferred
    filled = any(
        not inferred.mode_level(m).full and not _carried_by_sparse(assignment, i, formats)
        for m, i in enumerate(assignment.output)
    )
    return None if filled and estimated_nnz() >= SPARSE_OUTPUT_DENSITY * numel else inferred
