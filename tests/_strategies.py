"""Random expressions for the property-based tests (test_fuzz.py).

A case has two parts:

* a **skeleton** — everything that decides which kernel gets generated: the
  equation, each operand's format (or a plain dense tensor) and index width, the
  value dtype and the requested ``out_format``. Skeleton ``k`` is built by
  ``random.Random(k)``, so a run draws from a bounded pool of skeletons
  (``pool_size``) and the number of distinct kernels it compiles stays bounded
  (each new kernel costs ~0.5 s to build; later ones load from the disk cache);
* the **data**, drawn freely by hypothesis: index sizes (zero-size dimensions
  included), per operand a density (empty, single element, random, fully dense),
  values, and for dense operands a memory layout (contiguous, transposed, strided,
  broadcast with stride 0).

The reference is ``torch.einsum`` on float64 dense copies; :func:`tolerance` bounds
the rounding error by ``eps * sum |products|`` rather than a fixed atol.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import sparsenn
from sparsenn import SparseTensor

LETTERS = "abcdef"
VALUE_DTYPES = (torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
DENSITIES = ("empty", "single", "random", "full")
DENSE_LAYOUTS = ("contiguous", "transposed", "strided", "broadcast")
RANK2_NAMES = ("csr", "csc", "dcsr", "dcsc", "coo", "csf")


# ----------------------------------------------------------------------------- skeletons


@dataclass(frozen=True)
class OperandSkeleton:
    """One operand: its indices, format (None: a dense torch.Tensor) and index width."""

    indices: str
    format: str | None
    index_dtype: torch.dtype

    @property
    def blocks(self) -> dict[str, int]:
        """Index -> block size that must divide its extent (blocked formats only)."""
        return block_sizes(self.format, self.indices)


@dataclass(frozen=True)
class EinsumSkeleton:
    """An einsum call up to its data: equation, formats, dtypes, ``out_format``."""

    operands: tuple[OperandSkeleton, ...]
    output: str | None  # None: implicit output (no "->")
    out_format: str | None
    dtype: torch.dtype

    @property
    def equation(self) -> str:
        lhs = ",".join(op.indices for op in self.operands)
        return lhs if self.output is None else f"{lhs}->{self.output}"

    @property
    def letters(self) -> str:
        return "".join(sorted(set("".join(op.indices for op in self.operands))))

    @property
    def output_indices(self) -> str:
        """The output's indices, implicit ones resolved like torch (once-only, sorted)."""
        if self.output is not None:
            return self.output
        joined = "".join(op.indices for op in self.operands)
        return "".join(sorted(i for i in set(joined) if joined.count(i) == 1))

    def multiples(self) -> dict[str, int]:
        """Index -> the number its extent must be a multiple of (blocked formats)."""
        needs: dict[str, int] = {}
        for blocks in [op.blocks for op in self.operands] + [block_sizes(self.out_format, self.output_indices)]:
            for index, size in blocks.items():
                needs[index] = math.lcm(needs.get(index, 1), size)
        return needs


def block_sizes(fmt: str | None, indices: str) -> dict[str, int]:
    """``{"i": 2, "j": 1}`` for ``fmt = "bsr(2,1)"`` over ``indices = "ij"``, ``{"j": 4}``
    for ``"nm(2,4)"`` (groups along the last index); {} if unblocked."""
    if fmt is None or "(" not in fmt:
        return {}
    if fmt.startswith("nm("):
        return {indices[-1]: int(fmt[fmt.index(",") + 1 : -1])}
    sizes = [int(n) for n in fmt[fmt.index("(") + 1 : -1].split(",")]
    return dict(zip(indices, sizes))


def random_level_string(rng: random.Random, rank: int) -> str:
    """Level letters with a mode order, e.g. ``"dcs[2,0,1]"`` ('s' only after 'c' or 's')."""
    letters = ""
    for _ in range(rank):
        letters += rng.choice("dcs" if letters[-1:] in ("c", "s") else "dc")
    order = list(range(rank))
    rng.shuffle(order)
    return f"{letters}[{','.join(map(str, order))}]"


def random_format(rng: random.Random, rank: int, grouped: bool = True) -> str:
    """A named format valid for ``rank`` (csr, csc, dcsr, dcsc, bsr/bsc, coo, csf, dense,
    and with ``grouped`` nm(n,m)), a random level string with a mode order, or one with
    blocks of 1-3 per mode."""
    if rank == 0:
        return "dense"
    roll = rng.random()
    if roll < 0.1:
        return "dense"
    if grouped and roll < 0.15:
        m = rng.choice([2, 3, 4])
        return f"nm({rng.randint(1, m)},{m})"
    if roll < 0.4:
        return random_level_string(rng, rank)
    if roll < 0.5:
        return random_level_string(rng, rank) + f"({','.join(str(rng.choice([1, 2, 3])) for _ in range(rank))})"
    if rank == 2:
        if roll < 0.6:
            return f"{rng.choice(['bsr', 'bsc'])}({rng.choice([1, 2])},{rng.choice([1, 2])})"
        return rng.choice(RANK2_NAMES)
    return rng.choice(["coo", "csf"])


def random_einsum_skeleton(seed: int, dtype: torch.dtype | None = None) -> EinsumSkeleton:
    """Skeleton number ``seed``: 1-4 operands of rank 1-4 over up to six indices.

    ``dtype`` forces the value dtype."""
    rng = random.Random(seed)
    alphabet = LETTERS[: rng.randint(2, len(LETTERS))]
    count = rng.randint(1, 4)
    operands = []
    for _ in range(count):
        rank = rng.randint(1, min(4, len(alphabet)))
        indices = "".join(rng.sample(alphabet, rank))
        fmt = None if rng.random() < 0.3 else random_format(rng, rank)
        operands.append(OperandSkeleton(indices, fmt, rng.choice(INDEX_DTYPES)))
    if all(op.format is None for op in operands) and rng.random() < 0.8:
        first = operands[0]  # mostly keep a sparse operand: all-dense calls go to torch
        fmt = random_format(rng, len(first.indices))
        operands[0] = OperandSkeleton(first.indices, fmt, first.index_dtype)
    used = sorted(set("".join(op.indices for op in operands)))
    output: str | None = None
    if rng.random() > 0.1:
        output = "".join(rng.sample(used, rng.randint(0, min(4, len(used)))))
    skeleton = EinsumSkeleton(tuple(operands), output, None, dtype or rng.choice(VALUE_DTYPES))
    rank = len(skeleton.output_indices)
    roll = rng.random()
    out_format = None
    if roll < 0.1:
        out_format = "dense"
    elif roll < 0.3 and rank > 0:
        out_format = random_format(rng, rank, grouped=False)  # nm drops entries: a request, not a result
    return EinsumSkeleton(skeleton.operands, output, out_format, skeleton.dtype)


# ----------------------------------------------------------------------------- data


def random_values(shape: tuple[int, ...], density: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` whose nonzeros follow ``density`` (see DENSITIES)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=g, dtype=torch.float64)
    numel = values.numel()
    if density == "empty" or numel == 0:
        values.zero_()
    elif density == "single":
        keep = int(torch.randint(numel, (1,), generator=g))
        values = torch.zeros(numel, dtype=torch.float64).index_fill_(0, torch.tensor([keep]), 1.5).view(shape)
    elif density == "random":
        values *= torch.rand(shape, generator=g) < torch.rand((), generator=g)
    return values.to(dtype)


def irregular_matrix(rows: int, cols: int, density: float, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A random ``rows x cols`` matrix of about ``density`` nonzeros with an empty row (3)
    and a long one (row 5: its first half all 1.5)."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    dense[torch.rand(rows, cols, generator=g) > density] = 0
    dense[3] = 0
    dense[5, : cols // 2] = 1.5
    return dense.to(dtype)


def close(dtype: torch.dtype) -> dict:
    """``assert_close`` tolerances for a short sum computed in ``dtype``, compared in float64."""
    return {torch.bfloat16: dict(atol=6e-2, rtol=3e-2), torch.float32: dict(atol=1e-4, rtol=1e-4),
            torch.float64: dict(atol=1e-10, rtol=1e-10)}[dtype]


def dense_with_layout(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` (same contents) stored with ``layout``: a transposed or strided view,
    or a stride-0 broadcast of its first row (then every row equals the first)."""
    if values.dim() == 0 or values.numel() == 0 or layout == "contiguous":
        return values.clone()
    if layout == "transposed":
        reverse = tuple(reversed(range(values.dim())))
        return values.permute(reverse).contiguous().permute(reverse)
    if layout == "strided":
        wide = torch.zeros((2 * values.shape[0],) + values.shape[1:], dtype=values.dtype)
        wide[::2] = values
        return wide[::2]
    return values[:1].expand(values.shape)


@dataclass
class EinsumCase:
    skeleton: EinsumSkeleton
    operands: list  # torch.Tensor or SparseTensor, in the skeleton's order
    sizes: dict[str, int]

    @property
    def equation(self) -> str:
        return self.skeleton.equation

    def dense_operands(self) -> list[torch.Tensor]:
        """float64 dense copies for the reference."""
        return [to_dense(op).double() for op in self.operands]

    def __repr__(self) -> str:
        ops = ", ".join(
            f"{op.format}{op.shape} nnz={op.nnz} {op.index_dtype}" if isinstance(op, SparseTensor)
            else f"dense{tuple(op.shape)} strides={op.stride()}"
            for op in self.operands
        )
        return (f"EinsumCase({self.equation!r}, {self.skeleton.dtype}, out_format={self.skeleton.out_format!r}, "
                f"sizes={self.sizes}, operands=[{ops}])")


def to_dense(x) -> torch.Tensor:
    return x.to_dense() if isinstance(x, SparseTensor) else x


def make_operand(skeleton: OperandSkeleton, shape: tuple[int, ...], density: str, layout: str,
                 dtype: torch.dtype, seed: int):
    values = random_values(shape, density, dtype, seed)
    if skeleton.format is None:
        return dense_with_layout(values, layout)
    return SparseTensor.from_dense(values, format=skeleton.format, index_dtype=skeleton.index_dtype)


@st.composite
def index_sizes(draw, letters: str, multiples: dict[str, int], max_size: int) -> dict[str, int]:
    """An extent per index in 1..max_size (times its block multiple); sometimes one is 0."""
    sizes = {i: draw(st.integers(1, max_size)) * multiples.get(i, 1) for i in letters}
    if letters and draw(st.integers(0, 9)) == 0:
        sizes[draw(st.sampled_from(letters))] = 0
    return sizes


@st.composite
def einsum_cases(draw, pool_size: int, max_size: int = 4, dtype: torch.dtype | None = None,
) -> EinsumCase:
    """A random einsum call over a skeleton drawn from a pool of ``pool_size``."""
    skeleton = random_einsum_skeleton(draw(st.integers(0, pool_size - 1)), dtype)
    sizes = draw(index_sizes(skeleton.letters, skeleton.multiples(), max_size))
    operands = []
    for op in skeleton.operands:
        shape = tuple(sizes[i] for i in op.indices)
        density = draw(st.sampled_from(DENSITIES))
        layout = draw(st.sampled_from(DENSE_LAYOUTS))
        operands.append(make_operand(op, shape, density, layout, skeleton.dtype, draw(st.integers(0, 2**16))))
    return EinsumCase(skeleton, operands, sizes)


# ----------------------------------------------------------------------------- sums of products


@dataclass(frozen=True)
class SumSkeleton:
    """``Out[output] = +- prod(factors) +- ...``; a name used twice is the same operand."""

    output: str
    terms: tuple[tuple[float, tuple[tuple[str, str], ...]], ...]  # (sign, ((name, indices), ...))
    formats: dict[str, str | None]
    index_dtypes: dict[str, torch.dtype]
    dtype: torch.dtype
    parenthesise: tuple[bool, ...]  # per term: wrap its factors in parentheses

    @property
    def text(self) -> str:
        parts = []
        for n, ((sign, factors), paren) in enumerate(zip(self.terms, self.parenthesise)):
            body = " * ".join(f"{name}[{','.join(indices)}]" for name, indices in factors)
            body = f"({body})" if paren else body
            op = "-" if sign < 0 else "+"
            parts.append(body if n == 0 and sign > 0 else f"{op} {body}" if n else f"-{body}")
        return f"Out[{','.join(self.output)}] = " + " ".join(parts)

    @property
    def names(self) -> tuple[str, ...]:
        """Operand names in order of first appearance."""
        seen: dict[str, None] = {}
        for _, factors in self.terms:
            for name, _ in factors:
                seen.setdefault(name, None)
        return tuple(seen)

    def operand_indices(self) -> dict[str, str]:
        """Each operand's indices at its first use (its shape is taken from those)."""
        first: dict[str, str] = {}
        for _, factors in self.terms:
            for name, indices in factors:
                first.setdefault(name, indices)
        return first

    def tied(self) -> list[set[str]]:
        """Groups of indices that must share an extent: a reused operand read as
        ``A[i,j]`` and ``A[j,k]`` forces ``i``, ``j`` and ``k`` to one size."""
        first = self.operand_indices()
        groups = [{i} for i in sorted({i for _, f in self.terms for _, idx in f for i in idx})]

        def find(i: str) -> set[str]:
            return next(g for g in groups if i in g)

        for _, factors in self.terms:
            for name, indices in factors:
                for a, b in zip(first[name], indices):
                    ga, gb = find(a), find(b)
                    if ga is not gb:
                        ga |= gb
                        groups.remove(gb)
        return groups


def random_sum_skeleton(seed: int, dtype: torch.dtype | None = None) -> SumSkeleton:
    """Skeleton number ``seed``: 1-3 terms of 1-3 factors of rank 1-3 over i, j, k, l."""
    rng = random.Random(seed)
    letters = "ijkl"
    names = iter("ABCDEFGHIJ")
    ranks: dict[str, int] = {}
    terms = []
    for _ in range(rng.randint(1, 3)):
        factors = []
        for _ in range(rng.randint(1, 3)):
            if ranks and rng.random() < 0.2:  # reuse an operand under other indices
                name = rng.choice(sorted(ranks))
            else:
                name = next(names)
                ranks[name] = rng.randint(1, 3)
            factors.append((name, "".join(rng.sample(letters, ranks[name]))))
        terms.append((rng.choice([1.0, -1.0]), tuple(factors)))
    used = sorted({i for _, f in terms for _, idx in f for i in idx})
    output = "".join(rng.sample(used, rng.randint(0, min(3, len(used)))))
    formats: dict[str, str | None] = {}
    for name, rank in ranks.items():
        fmt = None if rng.random() < 0.3 else random_format(rng, rank)
        while fmt is not None and "(" in fmt:  # blocks would tie extents to multiples
            fmt = random_format(rng, rank)
        formats[name] = fmt
    index_dtypes = {name: rng.choice(INDEX_DTYPES) for name in ranks}
    parenthesise = tuple(rng.random() < 0.3 for _ in terms)
    return SumSkeleton(output, tuple(terms), formats, index_dtypes, dtype or rng.choice(VALUE_DTYPES), parenthesise)


@dataclass
class SumCase:
    skeleton: SumSkeleton
    operands: dict[str, object]
    sizes: dict[str, int]

    def expected(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(reference value, sum of |products|) in float64: each term contracted by
        torch.einsum onto the output indices it has, broadcast over the others."""
        out_shape = tuple(self.sizes[i] for i in self.skeleton.output)
        value = torch.zeros(out_shape, dtype=torch.float64)
        bound = torch.zeros(out_shape, dtype=torch.float64)
        dense = {name: to_dense(op).double() for name, op in self.operands.items()}
        for sign, factors in self.skeleton.terms:
            present = "".join(i for i in self.skeleton.output if any(i in idx for _, idx in factors))
            equation = ",".join(idx for _, idx in factors) + "->" + present
            view = [self.sizes[i] if i in present else 1 for i in self.skeleton.output]
            term = torch.einsum(equation, *[dense[name] for name, _ in factors])
            size = torch.einsum(equation, *[dense[name].abs() for name, _ in factors])
            value = value + sign * term.reshape(view)
            bound = bound + size.reshape(view)
        return value, bound

    def __repr__(self) -> str:
        ops = ", ".join(
            f"{n}: {op.format}{op.shape} nnz={op.nnz} {op.index_dtype}" if isinstance(op, SparseTensor)
            else f"{n}: dense{tuple(op.shape)}"
            for n, op in self.operands.items()
        )
        return f"SumCase({self.skeleton.text!r}, {self.skeleton.dtype}, sizes={self.sizes}, {{{ops}}})"


@st.composite
def sum_cases(draw, pool_size: int, max_size: int = 4, dtype: torch.dtype | None = None) -> SumCase:
    """A random sum of products over a skeleton drawn from a pool of ``pool_size``."""
    skeleton = random_sum_skeleton(draw(st.integers(0, pool_size - 1)), dtype)
    sizes: dict[str, int] = {}
    for group in skeleton.tied():
        size = draw(st.integers(0, max_size)) if draw(st.integers(0, 9)) == 0 else draw(st.integers(1, max_size))
        sizes.update(dict.fromkeys(group, size))
    operands = {}
    for name, indices in skeleton.operand_indices().items():
        shape = tuple(sizes[i] for i in indices)
        density = draw(st.sampled_from(DENSITIES))
        layout = draw(st.sampled_from(DENSE_LAYOUTS))
        spec = OperandSkeleton(indices, skeleton.formats[name], skeleton.index_dtypes[name])
        operands[name] = make_operand(spec, shape, density, layout, skeleton.dtype, draw(st.integers(0, 2**16)))
    return SumCase(skeleton, operands, sizes)


def tolerance(bound: torch.Tensor, dtype: torch.dtype, terms: int) -> torch.Tensor:
    """Elementwise error allowed for a result whose exact value has ``sum |products|``
    equal to ``bound``, summed over at most ``terms`` products: a rounding-error bound
    ``~terms * eps * bound`` with a safety factor of 4, plus a tiny absolute floor."""
    eps = torch.finfo(dtype).eps
    return 4 * (terms + 2) * eps * bound + torch.finfo(dtype).tiny


def reduction_length(sizes: dict[str, int], indices: str) -> int:
    """How many products one output element sums (the extents of the reduced indices)."""
    return math.prod(sizes[i] for i in set(sizes) - set(indices))


def assert_valid_result(result, dtype: torch.dtype, out_format: str | None, rank: int) -> None:
    """A result is a tensor of ``dtype``, or a SparseTensor whose arrays pass full
    validation and whose format is the requested one."""
    if isinstance(result, SparseTensor):
        assert out_format != "dense", "out_format='dense' gave a SparseTensor"
        SparseTensor(result.shape, result.format, result.pos, result.crd, result.values,
                     check=True, index_dtype=result.index_dtype)
        if out_format is not None:
            assert result.format == sparsenn.parse_format(out_format, rank), (result.format, out_format)
        assert result.dtype == dtype
    else:
        assert isinstance(result, torch.Tensor), type(result)
        assert result.dtype == dtype


# ----------------------------------------------------------------------------- nonlinear


SMOOTH = ("gelu", "sigmoid", "tanh", "exp", "silu", "neg")  # differentiable everywhere
KINKED = ("relu", "abs", "max", "min")  # not differentiable at ties and zeros


@dataclass(frozen=True)
class NonlinearSkeleton:
    """An einsum skeleton made an assignment with a value tree over its factors, a
    reduction (sum, max or min) and maybe an epilogue reading a dense bias over the
    output indices (the bias is the last operand)."""

    einsum: EinsumSkeleton
    assignment: object  # sparsenn.compiler.frontend.notation.Assignment

    @property
    def out_format(self) -> str | None:
        return self.einsum.out_format


def random_value(rng: random.Random, factors: int, smooth: bool):
    """A value tree over ``factors`` factors: each factor, maybe through a function,
    combined pairwise by products, sums, differences, max/min or division by ``1 + x²``."""
    from sparsenn.compiler.frontend.functions import apply
    from sparsenn.compiler.frontend.notation import Constant, Factor

    unary = SMOOTH if smooth else SMOOTH + ("relu", "abs", "sqrt_abs", "log1p_abs")
    parts = []
    for k in range(factors):
        x = Factor(k)
        roll = rng.random()
        if roll < 0.6:
            name = rng.choice(unary)
            if name == "sqrt_abs":
                x = apply("sqrt", apply("abs", x))
            elif name == "log1p_abs":
                x = apply("log", apply("add", Constant(1.0), apply("abs", x)))
            else:
                x = apply(name, x)
        parts.append(x)
    value = parts[0]
    combine = ("mul", "add", "sub", "div") if smooth else ("mul", "add", "sub", "div", "max", "min")
    for x in parts[1:]:
        how = rng.choice(combine)
        if how == "div":
            value = apply("div", value, apply("add", Constant(1.0), apply("mul", x, x)))
        else:
            value = apply(how, value, x)
    return value


def random_nonlinear_skeleton(seed: int, dtype: torch.dtype | None = None, smooth: bool = False) -> NonlinearSkeleton:
    """Skeleton ``seed``: an einsum skeleton's single term with a random value, reduction
    and epilogue. ``smooth``: sums only, through smooth functions (for gradcheck)."""
    from sparsenn.compiler.frontend.functions import apply
    from sparsenn.compiler.frontend.notation import Access, Assignment, Epilogue, Factor, Reduced, Term

    base = random_einsum_skeleton(seed, dtype)
    rng = random.Random(seed + 1_000_003)
    output = tuple(base.output_indices)
    factors = tuple(Access(n, tuple(op.indices)) for n, op in enumerate(base.operands))
    value = random_value(rng, len(factors), smooth)
    reduction = "sum" if smooth or rng.random() < 0.5 else rng.choice(["max", "min"])
    epilogue, operands = None, base.operands
    if rng.random() < 0.3 and reduction == "sum":
        bias = rng.random() < 0.6 and output
        reduced = apply("add", Reduced(), Factor(0)) if bias else Reduced()
        epilogue = Epilogue((Access(len(factors), output),) if bias else (), apply(rng.choice(SMOOTH), reduced))
        if bias:
            operands = operands + (OperandSkeleton("".join(output), None, torch.int32),)
    out_format = base.out_format
    if reduction != "sum" or epilogue is not None:
        out_format = rng.choice([None, "dense"])
    names = tuple(f"operand{n}" for n in range(len(operands)))
    assignment = Assignment(output, (Term(1.0, factors, value),), names, reduction, epilogue)
    skeleton = EinsumSkeleton(operands, base.output, out_format, base.dtype)
    return NonlinearSkeleton(skeleton, assignment)


@dataclass
class NonlinearCase:
    skeleton: NonlinearSkeleton
    operands: list
    sizes: dict[str, int]

    def __repr__(self) -> str:
        ops = ", ".join(
            f"{op.format}{op.shape} nnz={op.nnz}" if isinstance(op, SparseTensor) else f"dense{tuple(op.shape)}"
            for op in self.operands
        )
        return (f"NonlinearCase({self.skeleton.assignment}, {self.skeleton.einsum.dtype}, "
                f"out_format={self.skeleton.out_format!r}, sizes={self.sizes}, operands=[{ops}])")


@st.composite
def nonlinear_cases(draw, pool_size: int, max_size: int = 4, dtype: torch.dtype | None = None,
                    smooth: bool = False) -> NonlinearCase:
    """A random nonlinear assignment over a skeleton drawn from a pool of ``pool_size``."""
    skeleton = random_nonlinear_skeleton(draw(st.integers(0, pool_size - 1)), dtype, smooth)
    einsum = skeleton.einsum
    sizes = draw(index_sizes(einsum.letters, einsum.multiples(), max_size))
    operands = []
    for op in einsum.operands:
        shape = tuple(sizes[i] for i in op.indices)
        density = draw(st.sampled_from(DENSITIES))
        layout = draw(st.sampled_from(DENSE_LAYOUTS))
        operands.append(make_operand(op, shape, density, layout, einsum.dtype, draw(st.integers(0, 2**16))))
    return NonlinearCase(skeleton, operands, sizes)


def pattern(op) -> torch.Tensor:
    """Where ``op`` stores entries (explicit zeros included): everywhere for a tensor."""
    if isinstance(op, SparseTensor):
        return op.with_values(torch.ones_like(op.values)).to_dense() != 0
    return torch.ones(op.shape, dtype=torch.bool)


def _spread(t: torch.Tensor, indices, space) -> torch.Tensor:
    order = sorted(range(len(indices)), key=lambda m: space.index(indices[m]))
    return t.permute(order).reshape([t.shape[indices.index(i)] if i in indices else 1 for i in space])


def value_magnitude(value, factors):
    """A bound on the magnitudes a value tree's rounding errors scale with: sums of the
    magnitudes of what is added, products of what is multiplied, and for a function
    ``|f(x)| (1 + m(x)) + m(x)`` (its slope is at most about ``max(1, |f|)``)."""
    from sparsenn.compiler.frontend.functions import evaluate
    from sparsenn.compiler.frontend.notation import Apply, Constant, Factor

    if isinstance(value, Factor):
        return factors[value.k].abs()
    if isinstance(value, Constant):
        return torch.tensor(abs(value.value), dtype=torch.float64)
    assert isinstance(value, Apply)
    parts = [value_magnitude(a, factors) for a in value.args]
    if value.function in ("add", "sub", "max", "min"):
        return parts[0] + parts[1]
    if value.function == "mul":
        return parts[0] * parts[1]
    if value.function == "div":
        return parts[0] / evaluate(value.args[1], factors).abs()
    result = evaluate(value, factors).abs()
    return result * (1 + parts[0]) + parts[0]


def nonlinear_reference(assignment, operands, magnitude: bool = False) -> torch.Tensor:
    """The assignment's value in float64 from its definition: each term's value where
    all its sparse factors store an entry, reduced, then the epilogue. ``magnitude``:
    :func:`value_magnitude` (what rounding errors scale with) summed, or, for a max or
    min, its largest value; no epilogue."""
    from sparsenn.compiler.frontend.functions import IDENTITY, evaluate

    dense = [to_dense(op).double() for op in operands]
    output = assignment.output
    sizes = {i: dense[a.operand].shape[m] for a in assignment.accesses for m, i in enumerate(a.indices)}
    out_shape = [sizes[i] for i in output]
    identity = 0.0 if magnitude else IDENTITY[assignment.reduction]
    out = torch.full(out_shape, identity, dtype=torch.float64)
    for term in assignment.terms:
        space = list(output) + [i for i in term.indices if i not in output]
        full = [sizes[i] for i in space]
        factors = [_spread(dense[a.operand], a.indices, space) for a in term.factors]
        visited = torch.ones(full, dtype=torch.bool)
        for a in term.factors:
            visited = visited & _spread(pattern(operands[a.operand]), a.indices, space)
        if term.value is None:
            value = math.prod(factors, start=torch.ones((), dtype=torch.float64))
        elif magnitude:
            value = value_magnitude(term.value, factors)
        else:
            value = evaluate(term.value, factors)
        value = (term.coefficient * value).expand(full)
        if magnitude:
            value = value.abs()
        value = torch.where(visited, value, torch.tensor(identity, dtype=torch.float64))
        reduced = tuple(range(len(output), len(space)))
        if assignment.reduction == "sum":
            out = out + (value.sum(reduced) if reduced else value)
        elif value.numel():
            combine = torch.amax if assignment.reduction == "max" or magnitude else torch.amin
            out = combine(value, reduced) if reduced else value
    if assignment.epilogue is not None and not magnitude:
        factors = [_spread(dense[a.operand], a.indices, output) for a in assignment.epilogue.factors]
        out = evaluate(assignment.epilogue.value, factors, reduced=out).expand(out_shape)
    return out
