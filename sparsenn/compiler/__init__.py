"""The sparse einsum compiler, behind :func:`einsum`, :func:`compile_expression` and
:func:`explain` (all three in ``api.py``).

One call, from ``SparseLinear.forward`` to the C++ it runs, read in module order:

1. ``layers/linear.py``: ``forward`` calls ``einsum("bi,oi->bo", x, W, out_format="dense")``
   (with a bias, the compiled ``Y[b,o] = X[b,i] * W[o,i] + bias[o]``).
2. ``api.py``: :func:`einsum` rewrites torch's grammar (ellipses, repeated letters) into
   the core notation (``frontend/equation.py``, with ``frontend/diagonal.py``), parses it
   (``frontend/notation.py``, cached; terms may apply the scalar functions of
   ``frontend/functions.py`` to their factors, reduce by max or min, and end in an
   epilogue) and hands it to ``autograd.py``, which records the call when gradients are
   needed (backward passes are einsums too, derived in ``derivatives.py``; ``gradients.py``
   and ``batching.py`` under torch.func transforms) and calls ``runtime/evaluate.py``.
   A layer's call site (``call_site.py``) holds its calls' launches; for a training call
   it asks ``plan/dense_path.py`` once whether the whole step (forward and gradients) is
   cheaper dense, and if so runs it as ``dense_step.py``'s BLAS products on a kept dense
   copy of the weight, whose gradient is sampled back to its pattern.
3. ``runtime/evaluate.py``: a call seen before (same expression, ``out_format``,
   shapes, strides, formats, stored positions: ``runtime/validate.py::call_key``) runs
   its cached launch at once. Otherwise ``validate.check_call`` checks the operands,
   and the call resolves to the same call over split indices when an operand is blocked
   or n:m (``frontend/blocks.py``: block and in-block coordinates, the operands viewed
   so), ``torch.einsum`` (a sum of products of dense operands), pairwise contractions
   (``plan/contract.py``) or one kernel, biases and the factors a sum does not vary
   along moved into its epilogue (``plan/bias.py``).
4. ``plan/planner.py``: the result's format from the operands' formats and
   ``out_format`` (``plan/infer.py``; a result sampled on an operand's pattern takes it:
   ``plan/anchor.py``), then the schedule (``plan/schedule.py`` searches loop orders
   with the cost model of ``plan/cost.py``, places workspaces, tiles and panels, designs
   each nest's micro-kernel in ``plan/microkernel.py``: register blocks, register,
   grouped and dot tiles, packing, and records every code decision of
   ``plan/decisions.py``: vector and sparse reductions, row blocks, prefetching loops,
   store-once, ``omp simd``, the output's assembly, threads; the result's types in
   ``plan/nest.py``), all for an explicit machine model (``plan/target.py``: the host's,
   its BLAS efficiency timed once per host by ``plan/calibrate.py``, or one given with
   ``use_target``). The plan is looked up by those decisions, so every
   batch size with the same decisions shares one kernel. A new plan is lowered, then
   built by ``planner.build_kernel``, the one function that calls the back end:
   ``lower/kernel.py`` builds the loop IR (``loops/ir.py``) of the nests
   (``lower/dense_output.py`` with ``lower/epilogue.py`` and its micro-kernels in
   ``lower/microkernel.py``, ``lower/register_tile.py`` and ``lower/grouped_tile.py``, or
   ``lower/sparse_output.py`` with ``lower/assembly.py`` for a sparse result), iterating each storage level through
   its capabilities (``formats/level.py`` via ``lower/iterators.py``) and co-iterating
   levels in one routine (``lower/merge.py``); ``loops/simplify.py`` folds and hoists;
   ``backend/c.py`` prints the C++ and ``backend/codegen.py`` wraps it into a
   translation unit around the runtime headers (``backend/runtime/*.h``) with the entry
   points of ``backend/abi.py``; ``backend/jit.py`` compiles and loads it (cached on disk).
5. ``runtime/launcher.py``: the plan bound to the call's shapes and layouts runs
   ``sn_run`` through ctypes with the GIL released and returns the dense result, or
   the sparse one the kernel assembled.

A fused program, ``sparsenn.softmax`` or ``sparsenn.compile("M[i] = max[j](S[i,j]);
E<S>[i,j] = exp(S[i,j] - M[i]); Z[i] = sum[j](E[i,j]); P<S>[i,j] = E[i,j] / Z[i]")``:
``api.compile_expression`` parses the text once (``frontend/expression.py``: functions,
explicit reductions, masks; statements separated by ``;`` or newlines, a later one
reading earlier results by name) and, per formats signature of its operands,
``frontend/staging.py`` stages it into a program of assignments (``frontend/program.py``;
a plain sum of products is one assignment, run as in steps 2-5). ``runtime/programs.py`` runs the program: when
nothing records it for autograd, ``plan/fusion.py`` groups its consecutive stages that
share their team loops and read earlier results only at their own team coordinates (the
row max, the exponentials, their sum, the scaling; BlockSparseAttention's block SDDMM
before them and its SpMM after), decided from the stages' plans before anything runs,
with a reason for every boundary. ``planner.fused_kernel`` lowers each group
(``lower/fuse.py``) into one kernel that runs every stage per coordinate while its rows
are in cache and builds it through ``planner.build_kernel`` as in step 4; the launcher
runs it as a ``FusedLaunch``, every stage's bound launch supplying its arguments to the
one ``sn_run`` (step 5); a stage alone runs as in steps 2-5. When gradients
are needed ``program_autograd.py`` records the program as one autograd node (keeping
the results its gradients read, not those it can rebuild), whose backward is a program
too: ``gradient_program.py`` writes each stage's gradient einsums (``autograd.py``)
down in reverse, pointwise ones substituted into those reading them, and it runs fused
as above.

Under ``torch.compile``, ``torch.export`` or ``torch.jit.trace``
(``runtime/tracing.py``), step 2 records one ``sparsenn::evaluate`` op per call instead
of running it: its call string (``runtime/callspec.py``: versioned text holding the
call as written, an assignment in ``frontend/notation_text.py``'s exact form, the
operands' formats and the request) and its operands flattened into tensors
(``runtime/traced_operands.py``). The op's kernels (``runtime/ops.py``, registered on
import) read the string back and evaluate as in steps 3-5 or as a program (a repeated
call replayed: ``runtime/replay.py``); its backward runs ``autograd.py``'s gradients.

``explain(equation, *operands)`` prints steps 3-4 for a call, C++ included; a compiled
program's ``explain`` adds the fusion decisions and the fused kernels' C++.

The compiler's caches (parsed equations, calls, plans per shape and per decisions,
contraction paths and their pair schedules, re-stored patterns) are bounded LRU caches
(``runtime/cache.py``): :func:`cache_stats` reports their sizes and hit counts,
:func:`clear_caches` empties them (compiled kernels stay loaded and on disk).
"""

from dataclasses import replace

from sparsenn.formats.arithmetic import install_arithmetic

from .backend.jit import CompilerNotFoundError, KernelBuildError
from .frontend.notation import NotationError
from .frontend.operators import ARITHMETIC
from .plan.target import Target
from .api import CompiledExpression, compile_expression, compiled_once, einsum, explain, use_target
from .runtime.cache import cache_stats, clear_caches
from .runtime.memory import poison_outputs, set_output_pool_limit
from .runtime.ops import evaluate_op as _evaluate_op  # registers the sparsenn::evaluate ops that traces record

install_arithmetic(replace(ARITHMETIC, einsum=einsum))  # SparseTensor's + - * @ and sum run through the compiler

__all__ = [
    "einsum",
    "compile_expression",
    "compiled_once",
    "explain",
    "CompiledExpression",
    "NotationError",
    "KernelBuildError",
    "CompilerNotFoundError",
    "clear_caches",
    "cache_stats",
    "poison_outputs",
    "Target",
    "use_target",
    "set_output_pool_limit",
]
