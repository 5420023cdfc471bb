"""The reference models and their data: Planetoid and MNIST data modules (MNIST on small idx
fixtures written here), the GCN and the sparse autoencoder, their inference variants and the
bench runner."""

import gzip
import struct

import pytest
import torch
from torch_geometric.data import Data

import sparsenn
from models import (
    GCN,
    MNISTDataModule,
    PlanetoidDataModule,
    SparseAutoencoder,
    feature_dropout,
    load_planetoid,
    normalized_adjacency_csr,
    read_idx,
)
from models.bench import (BUSY_MARGIN, BenchResult, BenchSettings, VariantResult, busy_warning, chart,
                          check_benchmarkable, format_table, memoized_conversion, run_bench, write_chart)


# ------------------------------------------------------------------------------- Planetoid
@pytest.fixture(scope="module")
def cora():
    module = PlanetoidDataModule("Cora")
    module.setup("fit")
    return module


def test_planetoid_public_split_with_sparse_bag_of_words_features(cora):
    graph = cora.graph
    assert (cora.num_features, cora.num_classes) == (1433, 7)
    assert isinstance(graph.x, sparsenn.SparseTensor) and str(graph.x.format) == str(sparsenn.parse_format("csr", 2))
    assert 0.01 < graph.x.density < 0.015  # bag of words: 1.3 % of Cora's entries
    dense = load_planetoid("Cora")
    torch.testing.assert_close(graph.x.to_dense(), dense.x, rtol=0, atol=0)
    assert [int(m.sum()) for m in (graph.train_mask, graph.val_mask, graph.test_mask)] == [140, 500, 1000]
    assert next(iter(cora.train_dataloader())) is graph


def test_planetoid_dense_features_and_citeseer():
    module = PlanetoidDataModule("CiteSeer", sparse_features=False)
    data = module.graph
    assert isinstance(data.x, torch.Tensor) and (data.num_nodes, module.num_classes) == (3327, 6)
    rows = data.x.sum(1)
    torch.testing.assert_close(rows[rows > 0], torch.ones(int((rows > 0).sum())))  # normalize_features


def test_missing_planetoid_files_name_the_path_and_the_source(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"PubMed.*raw files missing.*shipped here: Cora, CiteSeer.*"
                                                r"github.com/kimiyoung/planetoid"):
        load_planetoid("PubMed")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "Cora" / "raw")):
        PlanetoidDataModule("Cora", root=str(tmp_path)).setup("fit")
    with pytest.raises(TypeError, match="name must be a str"):
        PlanetoidDataModule(3)


def test_normalized_adjacency_matches_pyg_gcn_norm():
    from torch_geometric.nn.conv.gcn_conv import gcn_norm

    edge_index = torch.tensor([[0, 1, 1, 2, 2, 3], [1, 0, 2, 1, 2, 0]])  # one existing self-loop (2, 2)
    ours = normalized_adjacency_csr(edge_index, 5).to_dense()
    pyg_edges, pyg_weight = gcn_norm(edge_index, num_nodes=5, add_self_loops=True)
    expected = torch.zeros(5, 5).index_put_((pyg_edges[1], pyg_edges[0]), pyg_weight, accumulate=True)
    torch.testing.assert_close(ours, expected)


def test_feature_dropout_keeps_zeros_and_scales_the_kept_features():
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(200, 300, generator=generator) * (torch.rand(200, 300, generator=generator) < 0.05)
    torch.manual_seed(0)
    y = feature_dropout(x, 0.25)
    assert torch.all(y[x == 0] == 0)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    assert abs(kept.sum() / (x != 0).sum() - 0.75) < 0.03  # about 3000 Bernoulli(0.75) draws: sd 0.008
    assert feature_dropout(x, 0.25, training=False) is x and feature_dropout(x, 0.0) is x
    sparse = sparsenn.from_dense(x, format="csr")
    dropped = feature_dropout(sparse, 0.25)
    assert dropped.nnz == sparse.nnz  # same pattern: dropped features are stored zeros
    kept = dropped.values != 0
    torch.testing.assert_close(dropped.values[kept], sparse.values[kept] / 0.75)
    assert abs(float(kept.float().mean()) - 0.75) < 0.03


def test_gcn_rejects_bad_hyperparameters_and_mismatched_features(cora):
    with pytest.raises(ValueError, match="dropout"):
        GCN(8, 3, dropout=1.5)
    with pytest.raises(ValueError, match="lr"):
        GCN(8, 3, lr=0.0)
    with pytest.raises(ValueError, match=r"x must have shape \(num_nodes, 3703\)"):
        GCN(3703, 6)(cora.graph.x, cora.graph.edge_index)


def test_gcn_sparse_and_dense_features_give_the_same_logits(cora):
    torch.manual_seed(0)
    model = GCN(1433, 7, hidden_channels=16).eval()
    graph = cora.graph
    with torch.no_grad():
        sparse = model(graph.x, graph.edge_index)
        dense = model(graph.x.to_dense(), graph.edge_index)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_gcn_as_one_program_equals_its_layers_and_their_gradients(cora, threads):
    """Without dropout the GCN runs as one fused program (models/gcn.py); its logits and
    gradients equal the two layers' computed one by one."""
    torch.manual_seed(0)
    model = GCN(1433, 7, hidden_channels=128, dropout=0.0)
    torch.nn.init.normal_(model.conv1.bias)
    torch.nn.init.normal_(model.conv2.bias)
    graph = cora.graph
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with torch.no_grad():
            layers = model.conv2(torch.relu(model.conv1(graph.x, graph.edge_index)), graph.edge_index)
            for _ in range(2):
                torch.testing.assert_close(model(graph.x, graph.edge_index), layers, rtol=1e-4, atol=1e-5)
        model(graph.x, graph.edge_index).square().sum().backward()
        program_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model.conv2(torch.relu(model.conv1(graph.x, graph.edge_index)), graph.edge_index).square().sum().backward()
    finally:
        torch.set_num_threads(before)
    for got, want in zip(program_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_gcn_inference_variants_agree_and_score_the_test_nodes(cora):
    torch.manual_seed(0)
    model = GCN(1433, 7, hidden_channels=16).eval()
    (x, edge_index), target = model.bench_batch(cora)
    assert int((target >= 0).sum()) == 1000 and bool((target[~cora.graph.test_mask] == -1).all())
    variants = model.inference_variants()
    assert list(variants) == ["sparsenn", "torch.sparse", "dense", "PyG GCNConv"]
    with torch.no_grad():
        outputs = {name: call(x, edge_index) for name, call in variants.items()}
    for name, out in outputs.items():
        torch.testing.assert_close(out, outputs["sparsenn"], rtol=1e-4, atol=1e-5, msg=name)
    name, value = model.bench_metric(outputs["sparsenn"], target)
    expected = float((outputs["sparsenn"].argmax(1) == cora.graph.y)[cora.graph.test_mask].float().mean())
    assert name == "accuracy" and value == pytest.approx(expected)


def test_memoized_conversion_converts_once_per_input_object():
    calls = []
    convert = memoized_conversion(lambda t: calls.append(t) or t * 2)
    a, b = torch.ones(3), torch.ones(3)
    assert torch.equal(convert(a), 2 * a) and convert(a) is convert(a)
    convert(b)
    assert len(calls) == 2


# ----------------------------------------------------------------------------------- MNIST
def _write_idx(path, array: torch.Tensor, code: int = 0x08, compress: bool = True) -> None:
    header = bytes([0, 0, code, array.dim()]) + b"".join(struct.pack(">I", n) for n in array.shape)
    dtype = {0x08: ">u1", 0x0C: ">i4", 0x0D: ">f4"}[code]
    raw = header + array.numpy().astype(dtype).tobytes()
    if compress:
        path.write_bytes(gzip.compress(raw))
    else:
        path.write_bytes(raw)


@pytest.fixture
def mnist_dir(tmp_path):
    """100 training and 20 test 28 x 28 images with labels, as (gzipped) idx files."""
    generator = torch.Generator().manual_seed(0)
    for prefix, count, compress in (("train", 100, True), ("t10k", 20, False)):
        images = torch.randint(0, 256, (count, 28, 28), generator=generator, dtype=torch.uint8)
        labels = torch.randint(0, 10, (count,), generator=generator, dtype=torch.uint8)
        suffix = ".gz" if compress else ""
        _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte{suffix}", images, compress=compress)
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte{suffix}", labels, compress=compress)
    return tmp_path


def test_read_idx_parses_every_type_code(tmp_path):
    values = torch.arange(-6, 6, dtype=torch.int32).reshape(3, 4)
    _write_idx(tmp_path / "ints.gz", values, code=0x0C)
    assert torch.equal(read_idx(tmp_path / "ints.gz"), values)
    floats = torch.linspace(-1, 1, 10).reshape(2, 5)
    _write_idx(tmp_path / "floats", floats, code=0x0D, compress=False)
    assert torch.equal(read_idx(tmp_path / "floats"), floats)


@pytest.mark.parametrize("raw, message", [
    (b"\x00\x00\x08", "not an idx file"),
    (b"\x01\x02\x08\x01" + struct.pack(">I", 2) + b"ab", "not an idx file"),
    (b"\x00\x00\x08\x02" + struct.pack(">I", 2), "truncated idx header"),
    (b"\x00\x00\x08\x01" + struct.pack(">I", 5) + b"abc", "an idx file of shape (5,)"),
])
def test_read_idx_rejects_malformed_files_naming_them(tmp_path, raw, message):
    path = tmp_path / "bad-idx"
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=str(path)) as info:
        read_idx(path)
    assert message in str(info.value)
    broken_gzip = tmp_path / "bad.gz"
    broken_gzip.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="cannot read it as an idx file"):
        read_idx(broken_gzip)


def test_mnist_data_module_on_a_fixture(mnist_dir):
    module = MNISTDataModule(str(mnist_dir), batch_size=16, val_size=10)
    module.setup("fit")
    images, labels = next(iter(module.train_dataloader()))
    assert images.shape == (16, 784) and images.dtype == torch.float32 and labels.dtype == torch.int64
    assert 0.0 <= float(images.min()) and float(images.max()) <= 1.0
    assert sum(len(b[0]) for b in module.train_dataloader()) == 90
    assert sum(len(b[0]) for b in module.val_dataloader()) == 10
    test_images = torch.cat([b[0] for b in module.test_dataloader()])  # uncompressed files are read too
    raw = read_idx(mnist_dir / "t10k-images-idx3-ubyte")
    assert torch.equal(test_images, raw.reshape(20, 784).float() / 255)
    with pytest.raises(ValueError, match="val_size 100 leaves no training images"):
        MNISTDataModule(str(mnist_dir), val_size=100).setup("fit")
    with pytest.raises(ValueError, match="batch_size must be positive"):
        MNISTDataModule(batch_size=0)


def test_missing_mnist_files_name_the_path_and_the_source(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "t10k-images-idx3-ubyte.gz")) as info:
        MNISTDataModule(str(tmp_path)).setup("test")
    assert "yann.lecun.com/exdb/mnist" in str(info.value)


def test_shipped_mnist_has_the_official_shapes():
    images, labels = read_idx(MNISTDataModule().data_dir / "t10k-images-idx3-ubyte.gz"), None
    labels = read_idx(MNISTDataModule().data_dir / "t10k-labels-idx1-ubyte.gz")
    assert images.shape == (10000, 28, 28) and images.dtype == torch.uint8
    assert torch.bincount(labels.long()).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


# ----------------------------------------------------------------------------- autoencoder
@pytest.mark.parametrize("encoder_format", ["csr", "bsr(16,16)", "dense"])
def test_autoencoder_variants_agree(mnist_dir, encoder_format):
    torch.manual_seed(0)
    model = SparseAutoencoder(hidden_features=64, encoder_format=encoder_format).eval()
    if encoder_format != "dense":
        assert isinstance(model.encoder, sparsenn.SparseLinear) and model.encoder.sparsity == pytest.approx(0.9, 0.02)
    module = MNISTDataModule(str(mnist_dir), batch_size=8, val_size=10)
    (images,), target = model.bench_batch(module)
    assert images.shape == (8, 784) and target is images
    variants = model.inference_variants()
    assert list(variants) == ["sparsenn", "torch.sparse", "dense"]
    with torch.no_grad():
        outputs = {name: call(images) for name, call in variants.items()}
    for name, out in outputs.items():
        torch.testing.assert_close(out, outputs["sparsenn"], rtol=1e-4, atol=1e-5, msg=name)
    name, value = model.bench_metric(outputs["sparsenn"], target)
    assert name == "mse" and value == pytest.approx(float(((outputs["sparsenn"] - images) ** 2).mean()))


def test_autoencoder_rejects_bad_settings():
    with pytest.raises(ValueError, match="unknown weight format 'nope'"):
        SparseAutoencoder(encoder_format="nope")
    with pytest.raises(ValueError, match=r"block \(16,16\) does not divide 250"):
        SparseAutoencoder(hidden_features=250, encoder_format="bsr(16,16)")
    with pytest.raises(ValueError, match="lr must be positive"):
        SparseAutoencoder(lr=-1.0)


# ----------------------------------------------------------------------------------- bench
def test_run_bench_times_every_variant_and_checks_agreement(mnist_dir, tmp_path):
    torch.manual_seed(0)
    model = SparseAutoencoder(hidden_features=32)
    module = MNISTDataModule(str(mnist_dir), batch_size=8, val_size=10)
    threads_before = torch.get_num_threads()
    result = run_bench(model, module, BenchSettings(threads=(1, 2), warmup=1, repeats=2, first_call=False), "tiny")
    assert torch.get_num_threads() == threads_before and not model.training
    assert result.ok and result.first_call is None and result.metric_name == "mse"
    assert [v.name for v in result.variants] == ["sparsenn", "torch.sparse", "dense"]
    assert all(set(v.median_ms) == {1, 2} and all(ms > 0 for ms in v.median_ms.values()) for v in result.variants)
    assert len({v.metric for v in result.variants}) <= 2  # the same reconstructions up to rounding
    table = format_table(result)
    assert "torch.sparse" in table and "outputs agree" in table and "2 threads" in table
    assert set(result.load_average) == {1, 2} and min(min(pair) for pair in result.load_average.values()) >= 0
    assert "load average (1 min) at the start / end of each timing: 1 thread " in table
    assert result.to_json()["load_average"].keys() == {"1", "2"}
    assert write_chart([result, result], tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"


def test_a_busy_machine_is_reported_and_times_100x_apart_stay_readable():
    variants = (VariantResult("sparsenn", {1: 1.0, 2: 0.6}, 0.5, 0.0, True),
                VariantResult("dense", {1: 150.0, 2: 90.0}, 0.5, 0.0, True))
    quiet = BenchResult("quiet", "x", "accuracy", BenchSettings(), variants, None, {1: (0.2, 1.0), 2: (1.0, 2.0)})
    busy = BenchResult("busy", "x", "accuracy", BenchSettings(), variants, None,
                       {1: (0.3, 1.0 + BUSY_MARGIN + 0.1), 2: (4.7, 2.1)})
    assert quiet.busy_threads == () and busy_warning(quiet) is None and "WARNING" not in format_table(quiet)
    assert busy.busy_threads == (1, 2) and busy.to_json()["busy_threads"] == [1, 2]
    assert "WARNING: the machine was busy while timing at 1 thread (load average up to 1.6), 2 threads (load " \
           "average up to 4.7)" in format_table(busy)
    figure = chart([quiet, busy])
    for axis in figure.axes:
        bottom, top = axis.get_ylim()
        assert axis.get_yscale() == "log" and bottom < 0.6 and top > 150
    assert [label.get_text() for label in figure.axes[1].get_xticklabels()] == ["1 thread (busy)", "2 threads (busy)"]


def test_bench_reports_a_disagreeing_variant(mnist_dir):
    class Broken(SparseAutoencoder):
        def inference_variants(self):
            variants = super().inference_variants()
            return {**variants, "dense": lambda x: variants["dense"](x) + 1e-2}

    torch.manual_seed(0)
    result = run_bench(Broken(hidden_features=32), MNISTDataModule(str(mnist_dir), batch_size=8, val_size=10),
                       BenchSettings(threads=(1,), warmup=0, repeats=1, first_call=False))
    assert not result.ok and [v.agrees for v in result.variants] == [True, True, False]
    assert "DISAGREE" in format_table(result)


def test_bench_protocol_and_settings_are_checked():
    with pytest.raises(TypeError, match="Data cannot be benchmarked: it has no bench_batch, inference_variants"):
        check_benchmarkable(Data())
    for bad, message in (({"threads": ()}, "non-empty"), ({"threads": (1, 1)}, "distinct"),
                         ({"threads": (0,)}, "positive"), ({"repeats": 0}, "repeats"), ({"warmup": -1}, "warmup")):
        with pytest.raises(ValueError, match=message):
            BenchSettings(**bad)


@pytest.mark.parametrize("encoder_format", ["csr", "bsr(16,16)"])
def test_autoencoder_state_reloads_the_saved_pattern_exactly(tmp_path, encoder_format):
    torch.manual_seed(0)
    saved = SparseAutoencoder(hidden_features=64, encoder_format=encoder_format).eval()
    torch.save(saved.state_dict(), tmp_path / "state.pt")
    torch.manual_seed(1)  # another random pattern, replaced by the saved one on load
    loaded = SparseAutoencoder(hidden_features=64, encoder_format=encoder_format).eval()
    assert not torch.equal(loaded.encoder.mask(), saved.encoder.mask())
    loaded.load_state_dict(torch.load(tmp_path / "state.pt"))
    images = torch.rand(16, 784)
    with torch.no_grad():
        assert torch.equal(loaded(images), saved(images))


def test_dense_then_pruned_autoencoder_checks_its_settings_and_reloads_pruned_states(tmp_path):
    with pytest.raises(ValueError, match=r"block \(16,16\) does not divide 250"):
        SparseAutoencoder(hidden_features=250, encoder_format="bsr(16,16)", dense_epochs=1)
    with pytest.raises(ValueError, match="sparsity must be in"):
        SparseAutoencoder(sparsity=1.5, dense_epochs=1)
    with pytest.raises(ValueError, match="dense_epochs must be an int >= 0"):
        SparseAutoencoder(dense_epochs=-1)
    torch.manual_seed(0)
    model = SparseAutoencoder(hidden_features=64, encoder_format="bsr(16,16)", dense_epochs=2).eval()
    assert isinstance(model.encoder, torch.nn.Linear) and model.pruning_pending
    model.prune()
    assert isinstance(model.encoder, sparsenn.SparseLinear) and not model.pruning_pending
    kept = model.encoder.to_dense().weight != 0
    assert model.encoder.sparsity == pytest.approx(0.9, abs=0.01) and kept.float().mean() <= 0.11
    fresh = SparseAutoencoder(hidden_features=64, encoder_format="bsr(16,16)", dense_epochs=2).eval()
    fresh.load_state_dict(model.state_dict())
    images = torch.rand(8, 784)
    with torch.no_grad():
        assert torch.equal(fresh(images), model(images))
