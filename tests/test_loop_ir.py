"""The loop IR, its simplifier and the C++ printer."""

from __future__ import annotations

from sparsenn.compiler.backend.c import ONE_COPY_LINES, print_block, print_expr
from sparsenn.compiler.loops import ir
from sparsenn.compiler.loops.simplify import fold, simplify

I, Q, H, ACC = ir.Var("i0"), ir.Var("q1"), ir.Var("h1"), ir.Var("acc1")
CRD, VAL = ir.Array("crd", 0, 1), ir.Array("val", 0)
X = ir.Array("dense", 1)


def test_arrays_are_spelled_by_the_printer():
    assert print_expr(ir.Load(ir.Array("pos", 0, 1), ir.add(Q, 1))) == "s0_pos1[q1 + 1]"
    assert print_expr(ir.Load(CRD, Q)) == "s0_crd1[q1]"
    assert print_expr(ir.Load(VAL, Q)) == "s0_val[q1]"
    assert print_expr(ir.Load(X, I)) == "d1[i0]"
    assert print_expr(ir.Load(ir.Array("out"), I)) == "out[i0]"
    assert print_expr(ir.VectorLoad(X, ir.mul(I, ir.Var("N2")))) == "sn_load(d1 + i0 * N2)"


def test_precedence_keeps_the_evaluation_order():
    a, b, d = ir.Var("a"), ir.Var("b"), ir.Var("d")
    assert print_expr(ir.mul(ir.add(a, b), d)) == "(a + b) * d"
    assert print_expr(ir.mul(a, ir.mul(b, d))) == "a * (b * d)"  # floating point: not reassociated
    assert print_expr(ir.mul(ir.mul(a, b), d)) == "a * b * d"
    assert print_expr(ir.sub(a, ir.sub(b, d))) == "a - (b - d)"
    assert print_expr(ir.Cast("index", ir.Load(CRD, Q))) == "(int64_t)s0_crd1[q1]"
    assert print_expr(ir.Cast("index", ir.add(a, 1))) == "(int64_t)(a + 1)"
    assert print_expr(ir.min_(a, b)) == "sn_imin(a, b)"
    assert print_expr(ir.Call("lower_bound", (CRD, a, b, d))) == "sn_lower_bound(s0_crd1 + a, s0_crd1 + b, (I)(d)) - s0_crd1"
    assert print_expr(ir.Const(2.0)) == "V(2.0)"


def test_folding():
    i, n = ir.Var("i"), ir.Var("N0")
    assert fold(ir.add(ir.mul(0, n), i)) == i
    assert fold(ir.mul(1, ir.add(i, 0))) == i
    assert fold(ir.add(ir.Const(2), ir.Const(3))) == ir.Const(5)
    assert fold(ir.mul(ir.Const(1.0), i)) == ir.mul(ir.Const(1.0), i)  # floating point kept


def test_unused_declarations_are_dropped():
    used, unused, chain = ir.Var("u"), ir.Var("x"), ir.Var("y")
    block = ir.Block((
        ir.Decl(unused, "index", ir.Var("N0"), const=True),
        ir.Decl(chain, "index", ir.Var("N1"), const=True),
        ir.Decl(ir.Var("z"), "index", chain, const=True),  # only user of y, itself unused
        ir.Decl(used, "index", ir.Var("N2"), const=True),
        ir.Assign(ir.Load(ir.Array("out"), ir.Const(0)), used),
    ), scoped=False)
    assert simplify(block).stmts == block.stmts[3:]


def test_a_sparse_dot_product_prints_as_cpp():
    body = ir.Block((
        ir.Decl(ACC, "V", ir.Const(0)),
        ir.For(None, ir.lt(Q, H), ir.Incr(Q), ir.Block((
            ir.Assign(ACC, ir.mul(ir.Load(VAL, Q), ir.Load(X, ir.Load(CRD, Q))), "+="),
        ))),
    ), scoped=False)
    assert print_block(body, depth=0) == (
        "V acc1 = 0;\n"
        "for (; q1 < h1; ++q1) {\n"
        "  acc1 += s0_val[q1] * d1[s0_crd1[q1]];\n"
        "}"
    )


def test_pragmas_and_the_one_thread_copy_of_a_short_nest():
    loop = ir.For(
        ir.Decl(I, "index", ir.Const(0)), ir.lt(I, ir.Var("N0")), ir.Incr(I),
        ir.Block((ir.Assign(ACC, ir.Load(X, I), "+="),)), "simd_reduction", ACC,
    )
    text = print_block(ir.Block((ir.Parallel(ir.Block((loop,), scoped=False)),)), depth=0)
    assert text.count("#pragma omp simd reduction(+:acc1)") == 2
    assert text.startswith("if (nthreads > 1) {\n#pragma omp parallel num_threads(nthreads)".replace("\n#", "\n  #"))
    assert "} else {" in text
    long_nest = ir.Block(tuple(loop for _ in range(ONE_COPY_LINES // 3 + 1)), scoped=False)
    once = print_block(ir.Block((ir.Parallel(long_nest),)), depth=0)
    assert once.startswith("#pragma omp parallel num_threads(nthreads) if(nthreads > 1)\n{")
    assert once.count("#pragma omp simd reduction(+:acc1)") == len(long_nest.stmts)
    assert "else" not in once
    unrolled = ir.For(ir.Decl(ir.Var("v"), "int", ir.Const(0)), ir.lt(ir.Var("v"), 4), ir.Incr(ir.Var("v")),
                      ir.Block(()), "unroll")
    assert print_block(ir.Block((unrolled,)), depth=0).startswith("#pragma GCC unroll 16\nfor (int v = 0; v < 4; ++v) {")


def test_assembly_operations_are_spelled_by_the_printer():
    error, at = ir.Var("sn_error"), ir.Var("at3")
    body = ir.Block((
        ir.Team(ir.Block((
            ir.Effect("declare_workspace", ("fill",)),
            ir.Guarded(ir.Block((ir.Effect("init_workspace", (ir.Var("N2"),)),)), error),
            ir.If(error, ir.Block((ir.Continue(),))),
            ir.Effect("ws_add", (I, ir.Load(VAL, Q))),
            ir.Assign(ir.Load(ir.Array("out_crd"), at), I),
            ir.Assign(ir.Load(ir.Array("out_val"), at), ir.Load(VAL, Q)),
            ir.Assign(at, ir.RuntimeCall("ws_drain_row", (at,)), "+="),
        )), ir.Var("nthreads")),
        ir.If(error, ir.Block((ir.Return(error),))),
    ), scoped=False)
    assert print_block(body, depth=0) == (
        "#pragma omp parallel num_threads(nthreads)\n"
        "{\n"
        "  FillWS ws;\n"
        "  try {\n"
        "    ws.init(N2);\n"
        "  } catch (const std::bad_alloc&) {\n"
        "    sn_fail(sn_error);\n"
        "  }\n"
        "  if (sn_error) {\n"
        "    continue;\n"
        "  }\n"
        "  ws.add(i0, s0_val[q1]);\n"
        "  sn_out_crd.put(at3, i0);\n"
        "  sn_out_val[at3] = s0_val[q1];\n"
        "  at3 += ws.drain(sn_out_crd, at3, sn_out_val + at3);\n"
        "}\n"
        "if (sn_error) {\n"
        "  return sn_error;\n"
        "}"
    )
    mark = ir.Var("m4")
    count = ir.RuntimeCall("crd_count", (ir.Const(1),))
    close = ir.If(ir.eq(count, mark), ir.Block((ir.Effect("drop_crd", (ir.Const(0),)),)),
                  ir.Block((ir.Effect("append_count", (ir.Const(1), ir.sub(count, mark))),)))
    assert print_block(ir.Block((close,)), depth=0) == (
        "if (C.crd[1].size() == m4) {\n"
        "  C.crd[0].pop_back();\n"
        "} else {\n"
        "  C.cnt[1].push_back((int64_t)(C.crd[1].size() - m4));\n"
        "}"
    )
    assert print_expr(ir.Const((1 << 63) - 1)) == "INT64_MAX"


def test_runtime_operations_are_checked_and_never_dropped():
    import pytest

    with pytest.raises(ValueError, match="unknown effect"):
        ir.Effect("ws_insert", (I,))
    with pytest.raises(ValueError, match="unknown runtime call"):
        ir.RuntimeCall("count")
    counted = ir.Decl(ir.Var("n1"), "index", ir.RuntimeCall("ws_count"))  # unused, but it starts the next row
    block = ir.Block((counted, ir.Decl(ir.Var("x"), "index", ir.Var("N0"))), scoped=False)
    assert simplify(block).stmts == (counted,)


def test_invariants_leave_their_loops():
    from sparsenn.compiler.loops.simplify import hoist

    n, x, y, z, w = ir.Var("N0"), ir.Var("x"), ir.Var("y"), ir.Var("z"), ir.Var("w")
    invariant = ir.Decl(x, "index", ir.min_(ir.add(n, 1), ir.mul(I, 2)), const=True)
    varying = ir.Decl(y, "index", ir.add(Q, 1), const=True)  # q changes in the loop
    load = ir.Decl(z, "index", ir.Load(CRD, ir.Const(0)), const=True)  # may not be readable if no iteration
    quotient = ir.Decl(w, "index", ir.Bin("/", n, I), const=True)  # may divide by zero
    use = ir.Assign(ACC, ir.Cast("V", ir.add(ir.add(x, y), ir.add(z, w))), "+=")
    inner = ir.For(None, ir.lt(Q, H), ir.Incr(Q), ir.Block((invariant, varying, load, quotient, use)))
    outer = ir.For(ir.Decl(I, "index", ir.Const(0)), ir.lt(I, n), ir.Incr(I), ir.Block((inner,)))
    (loop,) = hoist(ir.Block((outer,))).stmts  # x depends on i: out of the inner loop only
    assert loop.body.stmts[0] == invariant
    assert loop.body.stmts[1].body.stmts == (varying, load, quotient, use)
    # A name the enclosing block declares again elsewhere stays put.
    again = ir.Block((ir.Decl(x, "index", n, const=True), inner), scoped=True)
    assert hoist(again) == again
