"""sparsenn.convert on ordinary models: outputs equal the masked dense model, training works,
the report says what happened, bad arguments fail clearly."""

import copy
import math

import pytest
import torch
from torch import nn

import sparsenn
from sparsenn import SparseLinear
from _machines import AVX2, AVX512
from sparsenn.compiler.api import kernel_schedule
from sparsenn.compiler.frontend.notation import parse_einsum
from sparsenn.compiler.plan.dense_path import dense_product_cycles, restore_cycles
from sparsenn.convert import ConversionReport, Converted, predicted_speedup


def masked_dense(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every SparseLinear replaced by its equivalent nn.Linear."""
    model = copy.deepcopy(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, SparseLinear):
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, module.to_dense())
    return model


def count(model: nn.Module, kind: type) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Sequential(nn.Linear(36, 32), nn.ReLU()),
                         nn.Sequential(nn.Linear(32, 32), nn.Tanh()), nn.Linear(32, 5))


def test_mlp_outputs_match_masked_dense_and_it_trains():
    torch.manual_seed(0)
    model = mlp()
    original = copy.deepcopy(model)
    converted, report = sparsenn.convert(model, sparsity=0.75, return_report=True)
    assert converted is model and count(model, SparseLinear) == 3 and count(model, nn.Linear) == 0
    assert [d.name for d in report.layers] == ["1.0", "2.0", "3"]
    assert report["1.0"].nnz == 36 * 32 // 4 and report["1.0"].format == "csr" and report["1.0"].converted
    x = torch.randn(16, 6, 6)
    torch.testing.assert_close(model(x), masked_dense(model)(x))
    # magnitude pruning keeps each layer's largest weights of the original
    kept = original[1][0].weight.detach().abs()[model[1][0].mask()]
    assert kept.min() >= original[1][0].weight.detach().abs()[~model[1][0].mask()].max()
    target = torch.randint(0, 5, (16,))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    losses = []
    for _ in range(25):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


class SmallNet(nn.Module):
    """torchvision-style classifier: conv features, pooling, then a Linear head."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 10))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def test_classifier_head_exclude_and_copy():
    torch.manual_seed(1)
    model = SmallNet()
    converted, report = sparsenn.convert(model, sparsity=0.5, exclude=["classifier.3"], inplace=False,
                                         format="csc", method="random", return_report=True)
    assert count(model, SparseLinear) == 0  # inplace=False leaves the original alone
    assert isinstance(converted.classifier[1], SparseLinear) and isinstance(converted.classifier[3], nn.Linear)
    assert isinstance(converted.features[0], nn.Conv2d)
    assert report["classifier.3"].reason == "excluded by 'classifier.3'" and not report["classifier.3"].converted
    assert report["classifier.1"].format == "csc"
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(converted(x), masked_dense(converted)(x))


def test_transformer_encoder_layer_train_and_fused_eval_paths():
    torch.manual_seed(2)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    model, report = sparsenn.convert(layer, sparsity=0.8, return_report=True)
    assert isinstance(model.linear1, SparseLinear) and isinstance(model.linear2, SparseLinear)
    assert type(model.self_attn.out_proj) is not SparseLinear
    assert "MultiheadAttention reads out_proj.weight" in report["self_attn.out_proj"].reason
    reference = masked_dense(model)
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(model(x), reference(x))
    model(x).sum().backward()
    assert model.linear1.weight_values.grad is not None
    model.eval(), reference.eval()
    with torch.no_grad():  # torch would take its fused kernel here (it reads linear1.weight densely)
        torch.testing.assert_close(model(x), reference(x), rtol=1e-4, atol=1e-5)


def test_transformer_encoder_with_padding_mask_in_eval():
    torch.manual_seed(3)
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True), 2,
        enable_nested_tensor=False)
    encoder.use_nested_tensor = True  # as torch sets it when its layers qualify
    model, report = sparsenn.convert(encoder, sparsity=0.5, return_report=True)
    assert len(report.converted) == 4 and model.use_nested_tensor is False
    reference = masked_dense(model).eval()
    model.eval()
    x = torch.randn(2, 4, 8)
    padding = torch.tensor([[False, False, False, True], [False, False, False, False]])
    with torch.no_grad():
        torch.testing.assert_close(model(x, src_key_padding_mask=padding),
                                   reference(x, src_key_padding_mask=padding), rtol=1e-4, atol=1e-5)


def test_nested_module_dict_predicate_and_min_features():
    torch.manual_seed(4)
    model = nn.ModuleDict({
        "encoder": nn.Sequential(nn.Linear(20, 40), nn.ReLU(), nn.Linear(40, 20)),
        "heads": nn.ModuleDict({"small": nn.Linear(20, 2), "big": nn.Linear(20, 30)}),
    })
    _, report = sparsenn.convert(model, sparsity=0.9, min_features=10,
                                 exclude=lambda name, module: module.out_features == 20, return_report=True)
    assert {d.name: d.converted for d in report.layers} == {
        "encoder.0": True, "encoder.2": False, "heads.small": False, "heads.big": True}
    assert report["encoder.2"].reason == "excluded by the exclude predicate"
    assert report["heads.small"].reason == "min(in, out) = 2 < min_features = 10"
    assert isinstance(model["heads"]["big"], SparseLinear) and model["heads"]["big"].nnz == 60
    text = str(report)
    assert "heads.big" in text and "(30, 20)" in text and "min_features" in text
    assert isinstance(report, ConversionReport) and len(report) == 4 and len(report.kept_dense) == 2


def test_exclude_glob_covers_a_subtree_and_shared_layers_convert_once():
    shared = nn.Linear(8, 8)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)))
    _, report = sparsenn.convert(model, sparsity=0.5, exclude="3", return_report=True)
    assert [d.name for d in report.layers] == ["0", "3.0", "3.1"]
    assert report["3.1"].reason == "excluded by '3' (matches 3)"
    assert isinstance(model[0], SparseLinear) and model[0] is model[2]
    assert isinstance(model[3][0], nn.Linear)


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_skip_slower_weighs_the_planners_costs(target):
    def speedup(in_features, out_features, sparsity):
        weight = SparseLinear.from_dense(nn.Linear(in_features, out_features), sparsity).weight
        return predicted_speedup(weight, target=target)

    # a tiny layer is all launch cost; a large, very sparse one a fraction of the work
    assert speedup(16, 16, 0.5) < 1.0 < speedup(2048, 2048, 0.99)
    assert speedup(1024, 1024, 0.9) > speedup(1024, 1024, 0.7) > speedup(1024, 1024, 0.5)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 2048))
    model.append(nn.Linear(2048, 2048))
    with sparsenn.compiler.use_target(target):
        _, report = sparsenn.convert(model, sparsity=0.99, skip_slower=True, return_report=True)
    assert not report["0"].converted and "skip_slower" in report["0"].reason
    assert report["2"].converted and "planned sparse speedup" in report["2"].reason
    assert isinstance(model[2], SparseLinear) and isinstance(model[0], nn.Linear)


def test_blas_runs_wider_vectors_on_avx512_so_sparse_gains_less_there():
    weight = SparseLinear.from_dense(nn.Linear(1024, 1024), 0.9).weight
    assert predicted_speedup(weight, target=AVX512) < predicted_speedup(weight, target=AVX2)


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_predicted_speedup_counts_re_storing_an_nm_weight_as_the_planner_does(target):
    # dX reads the n:m weight across its rows: its kernel re-stores the weight's values
    # at every call, as the dense path weighs it
    weight = sparsenn.from_dense(torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)), format="nm(2,4)")
    x = torch.empty(64, 1024)
    assignment = parse_einsum("bo,oi->bi", 2)
    with sparsenn.compiler.use_target(target):
        forward = kernel_schedule("bi,oi->bo", x, weight, out_format="dense")
        backward = kernel_schedule("bo,oi->bi", x, weight, out_format="dense")
    restored = [[k for (_, k), _ in sched.transposes] for sched in (forward, backward)]
    assert 1 not in restored[0] and 1 in restored[1]  # the weight, factor 1
    restore = restore_cycles(assignment, backward, [0, weight.nnz], 4, target)
    assert restore > 0 and restore_cycles(assignment, forward, [0, weight.nnz], 4, target) == 0
    blas = 3 * dense_product_cycles(assignment, [(64, 1024), (1024, 1024)], 4, target)
    speedup = predicted_speedup(weight, target=target)
    assert blas / speedup > restore  # the sparse step's cycles include it


def test_predicted_speedup_rejects_what_is_not_a_sparse_weight():
    with pytest.raises(TypeError, match="SparseTensor weight"):
        predicted_speedup(torch.randn(4, 4))
    weight = SparseLinear.from_dense(nn.Linear(8, 8), 0.5).weight
    with pytest.raises(ValueError, match="batch must be a positive int"):
        predicted_speedup(weight, batch=0)


def test_unsupported_dtype_is_kept_dense_with_a_reason():
    model = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 4))
    _, report = sparsenn.convert(model, sparsity=0.5, return_report=True)
    assert not report["0"].converted and "bfloat16" in report["0"].reason and report["1"].converted


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(sparsity=1.0), ValueError, r"sparsity must be in \[0, 1\)"),
        (dict(sparsity=-0.5), ValueError, r"sparsity must be in \[0, 1\)"),
        (dict(sparsity="0.5"), TypeError, "sparsity must be a number"),
        (dict(format="nm(2,4)", sparsity=0.9), ValueError, r"nm\(2,4\) fixes the sparsity at 1 - n/m"),
        (dict(format="dense"), ValueError, "dense"),
        (dict(format="xyz"), ValueError, "unknown weight format 'xyz'"),
        (dict(include=(nn.Conv2d,)), ValueError, "include may only contain nn.Linear.*got Conv2d"),
        (dict(include=(str,)), TypeError, "include must contain nn.Module types"),
        (dict(include=()), ValueError, "include is empty"),
        (dict(method="l1"), ValueError, "method must be"),
        (dict(exclude=["nothing.here"]), ValueError, "matches no submodule"),
        (dict(exclude=[3]), TypeError, "exclude must be module names"),
        (dict(min_features=-1), ValueError, "min_features must be a non-negative int"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        sparsenn.convert(mlp(), **kwargs)


def test_blocked_format_keeps_layers_the_block_does_not_divide_dense():
    torch.manual_seed(5)
    model = nn.ModuleDict({"body": nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64)),
                           "side": nn.Linear(50, 100)})
    original = copy.deepcopy(model)
    converted, report = sparsenn.convert(model, sparsity=0.5, format="bsr(32,32)", return_report=True)
    assert converted is model and [d.converted for d in report.layers] == [True, True, False]
    assert report["body.0"].format == "bsr(32,32)" and report["body.0"].nnz == 3 * 32 * 32  # 3 of 6 blocks
    assert report["side"].format == "dense" and report["side"].reason == "block (32,32) does not divide 100×50"
    assert isinstance(model["side"], nn.Linear) and str(model["body"][2].format) == "bsr(32,32)"
    text = str(report)
    assert "bsr(32,32)" in text and "block (32,32) does not divide 100×50" in text
    layer, weight = model["body"][0], original["body"][0].weight.detach()
    norms = weight.view(3, 32, 2, 32).square().sum((1, 3))
    kept = layer.mask().view(3, 32, 2, 32).all(3).all(1)
    assert norms[kept].min() > norms[~kept].max()  # the blocks of largest norm
    torch.testing.assert_close(layer.to_dense().weight, weight * layer.mask(), rtol=0, atol=0)
    x = torch.randn(4, 64)
    with torch.no_grad():  # inference; the next test trains
        torch.testing.assert_close(model["body"](x), masked_dense(model["body"])(x))


def test_blocked_converted_model_gradients_match_masked_dense():
    torch.manual_seed(7)
    model = sparsenn.convert(nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 4)), sparsity=0.5,
                             format="bsr(4,4)")
    reference = masked_dense(model)
    x = torch.randn(6, 8)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for sparse, dense in ((model[0], reference[0]), (model[2], reference[2])):
        rows, cols = sparse.weight.coords()[0]
        torch.testing.assert_close(sparse.weight_values.grad, dense.weight.grad[rows, cols])
        torch.testing.assert_close(sparse.bias.grad, dense.bias.grad)


def test_nm_format_implies_the_sparsity_and_reports_it():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    original = copy.deepcopy(model)
    _, report = sparsenn.convert(model, format="nm(2,4)", return_report=True)
    assert [d.converted for d in report.layers] == [True, True, False]
    assert report["0"].format == "nm(2,4)" and report["0"].nnz == 64 and report["0"].sparsity == 0.5
    assert report["4"].reason == "groups of 4 inputs (nm(2,4)) do not divide in_features = 6"
    assert "nm(2,4)" in str(report)
    groups = original[0].weight.detach().abs().view(8, 4, 4)
    kept = model[0].mask().view(8, 4, 4)
    assert torch.equal(kept.sum(-1), torch.full((8, 4), 2))
    assert bool((groups.masked_fill(~kept, math.inf).amin(-1) > groups.masked_fill(kept, -math.inf).amax(-1)).all())
    x = torch.randn(5, 16)
    out = model(x)
    torch.testing.assert_close(out, masked_dense(model)(x))
    out.sum().backward()
    assert model[0].weight_values.grad is not None


def test_default_sparsity_is_unchanged_for_unstructured_formats():
    _, report = sparsenn.convert(nn.Sequential(nn.Linear(20, 10)), return_report=True)
    assert report["0"].nnz == 20 and report["0"].format == "csr"


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        sparsenn.convert(lambda x: x)


class TinyLM(nn.Module):
    """An embedding, a body and an LM head sharing the embedding's weight (as GPT-2's)."""

    def __init__(self, vocab: int = 50, d: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)))


def test_returns_the_model_like_torch_ao_convert():
    torch.manual_seed(8)
    model = mlp()
    converted = sparsenn.convert(model, sparsity=0.5)
    assert converted is model and isinstance(converted[3], SparseLinear)
    assert converted(torch.randn(2, 6, 6)).shape == (2, 5)
    copied = sparsenn.convert(mlp(), sparsity=0.5, inplace=False, return_report=True)
    assert isinstance(copied, Converted) and len(copied.report) == 3
    with pytest.raises(TypeError, match="positional"):
        sparsenn.convert(mlp(), 0.5)  # sparsity and everything after the model are keyword-only


def test_a_head_tied_to_the_embedding_stays_dense_and_tied():
    torch.manual_seed(9)
    model = TinyLM()
    tokens = torch.randint(0, 50, (3, 7))
    converted, report = sparsenn.convert(model, sparsity=0.5, return_report=True)
    assert not report["head"].converted
    assert report["head"].reason.startswith("weight is tied to embed.weight (a sparse copy would untie them)")
    assert report["body.0"].converted and report["body.2"].converted
    assert converted.head.weight is converted.embed.weight  # still tied
    converted(tokens).sum().backward()
    assert converted.embed.weight.grad is not None
    assert "dense: weight is tied to embed.weight" in str(report)
    copied = sparsenn.convert(TinyLM(), sparsity=0.5, inplace=False)  # deepcopy keeps the tie
    assert copied.head.weight is copied.embed.weight and isinstance(copied.head, nn.Linear)


def test_linears_sharing_a_parameter_stay_dense_but_one_shared_linear_converts():
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    second.bias = first.bias
    shared = nn.Linear(8, 8)
    model = nn.Sequential(first, second, shared, shared)
    _, report = sparsenn.convert(model, sparsity=0.5, return_report=True)
    assert "bias is tied to 1.bias" in report["0"].reason and "bias is tied to 0.bias" in report["1"].reason
    assert report["2"].converted and model[2] is model[3] and isinstance(model[2], SparseLinear)


def test_a_parametrized_weight_stays_dense():
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)), nn.Linear(8, 4))
    _, report = sparsenn.convert(model, sparsity=0.5, return_report=True)
    assert not report["0"].converted and "parametrized" in report["0"].reason
    assert report["1"].converted
