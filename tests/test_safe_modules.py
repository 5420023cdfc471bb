"""Safe modules: a layer whose pattern buffers were edited, replaced, emptied or partly loaded
raises a ValueError naming the buffer at its next forward (never a crash, never a wrong
result); unchanged buffers are not re-validated; whole patterns load and re-validate."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import sparsenn
from sparsenn import SparseGCNConv, SparseLinear

REPO_ROOT = pathlib.Path(sparsenn.__file__).resolve().parents[1]

# The situations of issue 19 ("Found"), each in a fresh process: a crash would give a
# negative return code instead of the caught error's 0.
FOUND = {
    "edited in place": "lin.weight_crd1[0] = 10**6",
    "reassigned": "lin.weight_crd1 = torch.full_like(lin.weight_crd1, 10**6)",
    "emptied": "model.to_empty(device='cpu')",
    "partly loaded": """
        other = nn.Sequential(sparsenn.SparseLinear(16, 8))
        state = other.state_dict()
        del state['0.weight_crd1']
        print(model.load_state_dict(state, strict=False).missing_keys)
    """,
}
EXPECTED = {
    "edited in place": "weight_crd1 was modified in place: weight_crd1 (level 1, compressed) has coordinate 1000000 "
                       "out of range [0, 16) at position 0",
    "reassigned": "weight_crd1 was replaced: weight_crd1 (level 1, compressed) has coordinate 1000000",
    "emptied": "after weight_pos1 was replaced and weight_crd1 was replaced: weight_",
    "partly loaded": "weight_crd1 was not loaded: load_state_dict got weight_pos1, weight_values of the weight's "
                     "pattern but not weight_crd1",
}


def run_script(body: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent("""
        import torch
        from torch import nn
        import sparsenn
        torch.manual_seed(0)
        model = nn.Sequential(sparsenn.SparseLinear(16, 8))
        lin = model[0]
        x = torch.randn(4, 16)
        model(x)
    """) + textwrap.dedent(body) + textwrap.dedent("""
        try:
            model(x)
        except ValueError as error:
            print("caught:", error)
        else:
            print("no error")
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("case", FOUND)
def test_found_cases_raise_a_clean_error_in_a_fresh_process(case):
    result = run_script(FOUND[case])
    assert result.returncode == 0, result.stderr
    assert "caught: SparseLinear:" in result.stdout, result.stdout
    assert EXPECTED[case] in result.stdout, result.stdout


def masked_linear(layer: SparseLinear, x: torch.Tensor) -> torch.Tensor:
    weight = torch.zeros(layer.out_features, layer.in_features, dtype=x.dtype)
    rows, cols = layer.weight.coords()[0]
    weight[rows, cols] = layer.weight_values.detach()
    return nn.functional.linear(x, weight, layer.bias)


@pytest.mark.parametrize(("format", "buffer"), [("csr", "weight_crd1"), ("coo", "weight_crd1"),
                                                ("dcsc", "weight_pos1"), ("bsr(2,4)", "weight_crd1"),
                                                ("nm(2,4)", "weight_crd3")])
def test_in_place_corruption_names_the_buffer_in_every_format(format, buffer):
    torch.manual_seed(1)
    layer = SparseLinear(16, 8, format=format, sparsity=None if format.startswith("nm") else 0.5)
    x = torch.randn(3, 16)
    layer(x)
    with torch.no_grad():
        layer.get_buffer(buffer)[-1] = 10**6
    with pytest.raises(ValueError, match=f"{buffer} was modified in place: {buffer} "):
        layer(x)
    with pytest.raises(ValueError, match=buffer):  # still invalid: raised again, not cached as valid
        layer.weight.coords()


def test_an_edit_leaving_a_valid_pattern_is_adopted():
    torch.manual_seed(2)
    layer = SparseLinear(4, 3, pattern=torch.tensor([[0, 1, 2], [0, 1, 2]]), bias=False)
    x = torch.randn(5, 4)
    layer(x)
    with torch.no_grad():
        layer.weight_crd1[2] = 3  # output 2 now reads input 3: still sorted and in range
    assert layer.mask()[2].tolist() == [False, False, False, True]
    torch.testing.assert_close(layer(x), masked_linear(layer, x))


def test_a_removed_buffer_and_resized_values_are_named():
    layer = SparseLinear(6, 4, sparsity=0.5)
    x = torch.randn(2, 6)
    layer(x)
    layer.weight_values = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"weight_values has length 3, expected 12"):
        layer(x)
    fresh = SparseLinear(6, 4, sparsity=0.5)
    fresh(x)
    del fresh.weight_crd1
    with pytest.raises(ValueError, match=r"weight_crd1 was removed: weight_crd1 \(level 1, compressed\) is missing"):
        fresh(x)


def test_unchanged_buffers_are_validated_once():
    layer = SparseLinear(10, 6, sparsity=0.5)
    pattern = layer._weight_pattern
    x = torch.randn(4, 10)
    for _ in range(5):
        layer(x).sum().backward()
    with torch.no_grad():
        layer.weight_values.mul_(2.0)  # values are not the pattern
    layer(x)
    assert pattern.validations == 1
    layer.weight_crd1.add_(0)  # any in-place write bumps the version: checked again
    layer(x)
    assert pattern.validations == 2


def test_a_whole_pattern_of_the_same_format_loads_and_revalidates():
    torch.manual_seed(3)
    source, target = SparseLinear(12, 6, sparsity=0.5), SparseLinear(12, 6, sparsity=0.5)
    x = torch.randn(5, 12)
    target(x)
    values = target.weight_values
    target.load_state_dict(source.state_dict())
    assert target.weight_values is values and torch.equal(target.mask(), source.mask())
    torch.testing.assert_close(target(x), source(x))
    state = source.state_dict()
    state["weight_crd1"] = state["weight_crd1"].flip(0).contiguous()  # a consistent-looking but unsorted pattern
    with pytest.raises(RuntimeError, match="saved weight pattern is invalid: crd"):
        target.load_state_dict(state)
    torch.testing.assert_close(target(x), source(x))  # nothing was copied


def test_a_partial_load_is_repaired_by_a_whole_one():
    torch.manual_seed(4)
    source, target = SparseLinear(12, 6, sparsity=0.5), SparseLinear(12, 6, sparsity=0.5)
    x = torch.randn(5, 12)
    for missing in ("weight_pos1", "weight_values"):
        partial = {k: v for k, v in source.state_dict().items() if k != missing}
        result = target.load_state_dict(partial, strict=False)
        assert result.missing_keys == [missing]
        with pytest.raises(ValueError, match=f"{missing} was not loaded"):
            target(x)
    target.load_state_dict(source.state_dict())
    torch.testing.assert_close(target(x), source(x))
    # The values alone, for the same pattern, are a legitimate partial state dict.
    target.load_state_dict({"weight_values": source.weight_values.detach() * 2}, strict=False)
    torch.testing.assert_close(target(x), source(x) * 2 - source.bias.detach())


def test_a_strict_partial_load_raises_and_leaves_the_layer_unusable():
    source, target = SparseLinear(8, 4, sparsity=0.5), SparseLinear(8, 4, sparsity=0.5)
    with pytest.raises(RuntimeError, match="Missing key"):
        target.load_state_dict({k: v for k, v in source.state_dict().items() if k != "weight_crd1"})
    with pytest.raises(ValueError, match="weight_crd1 was not loaded"):
        target(torch.randn(2, 8))


def test_a_partial_load_from_another_format_names_the_buffers():
    torch.manual_seed(5)
    source, target = SparseLinear(8, 4, sparsity=0.5, format="coo"), SparseLinear(8, 4, sparsity=0.5)
    state = {k: v for k, v in source.state_dict().items() if k != "weight_crd0"}
    target.load_state_dict(state, strict=False)
    with pytest.raises(ValueError, match="was not loaded: load_state_dict got weight_pos0, weight_crd1, weight_values "
                                         "of the weight's pattern but not weight_crd0"):
        target(torch.randn(2, 8))


def test_buffers_made_in_inference_mode_are_checked_at_every_call():
    with torch.inference_mode():
        layer = SparseLinear(8, 4, sparsity=0.5)
        x = torch.randn(2, 8)
        layer(x)
        layer.weight_crd1[0] = 10**6  # inference tensors keep no version counter
        with pytest.raises(ValueError, match="weight_crd1 .* out of range"):
            layer(x)


def test_gcn_cached_adjacency_edits_are_caught_and_to_empty_is_safe():
    torch.manual_seed(6)
    conv = SparseGCNConv(5, 3, cached=True)
    x, edges = torch.randn(6, 5), torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]])
    conv(x, edges)
    conv._cached_adjacency.crd[1][0] = 10**6
    with pytest.raises(ValueError, match="modified in place"):
        conv(x, edges)
    conv.reset_cache()
    conv.to_empty(device="cpu")  # parameters only: uninitialised values, as for nn.Linear
    conv.reset_parameters()
    assert conv(x, edges).shape == (6, 3)
