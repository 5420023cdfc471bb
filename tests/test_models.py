"""The reference GCN path: Planetoid data, training and benchmarking through the CLI entry point."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from torch_geometric.data import Data

from models import GCN, PlanetoidDataModule, feature_dropout, load_planetoid, normalized_adjacency_csr
from sparsenn.cli import BENCH_FILE, METRICS_FILE, WEIGHTS_FILE, CommandError, _first_call_ms, load_config, main

ROOT = Path(__file__).resolve().parents[1]
CORA = str(ROOT / "configs" / "gcn_cora.yaml")
EPOCHS = 15


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A GCN trained for a few epochs on Cora through ``main(["train", ...])``."""
    out = tmp_path_factory.mktemp("gcn_cora")
    threads_before = torch.get_num_threads()
    assert main(["train", "--config", CORA, "--output-dir", str(out), "--max-epochs", str(EPOCHS)]) == 0
    assert torch.get_num_threads() == threads_before
    return out


def test_train_lowers_the_loss_and_beats_chance(trained):
    metrics = json.loads((trained / METRICS_FILE).read_text())
    losses = metrics["train_loss"]
    assert len(losses) == EPOCHS and metrics["threads"] == 1  # the config's train_threads
    assert losses[-1] < losses[0] - 0.1
    assert metrics["test_acc"] > 0.5 and metrics["val_acc"] > 0.5  # 7 classes: chance is about 0.14
    state = torch.load(trained / WEIGHTS_FILE, weights_only=True)
    assert state["conv1.weight"].shape == (16, 1433) and state["conv2.weight"].shape == (7, 16)


def test_bench_outputs_match_pyg_and_torch_sparse(trained, capsys):
    threads_before = torch.get_num_threads()
    argv = ["bench", "--config", CORA, "--output-dir", str(trained), "--threads", "1", "2",
            "--warmup", "1", "--repeats", "2", "--no-cold-start"]
    assert main(argv) == 0
    assert torch.get_num_threads() == threads_before
    result = json.loads((trained / BENCH_FILE).read_text())
    assert result["ok"]
    assert set(result["max_abs_diff"]) == {"PyG GCNConv", "torch.sparse CSR"}
    assert all(diff < 1e-4 for diff in result["max_abs_diff"].values())
    assert len(set(result["test_acc"].values())) == 1
    assert set(result["timings_ms"]) == {"1", "2"}
    assert all(ms > 0 for row in result["timings_ms"].values() for ms in row.values())
    assert result["first_call"] is None
    printed = capsys.readouterr().out
    assert "PyG GCNConv" in printed and "outputs agree" in printed


def test_first_call_runs_in_a_fresh_process_with_an_empty_kernel_cache(trained):
    first = _first_call_ms(CORA, trained, threads=1)
    assert first["kernels_built"] >= 1
    assert first["first_ms"] > 0 and first["threads"] == 1


def test_bench_without_weights_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--config", CORA, "--output-dir", str(tmp_path), "--no-cold-start"])
    assert exit_info.value.code == 2
    assert "no trained weights" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("model: gcn\nhidden: 16\n", "unknown key(s) hidden"),
    ("model: gcn\nhidden_channels: 16.5\n", "hidden_channels must be int"),
    ("model: gcn\ncached: 1\n", "cached must be bool"),
    ("model: gcn\ndropout: 1.0\n", "dropout must be in [0, 1)"),
    ("model: transformer\n", "model must be one of gcn"),
    ("model: gcn\nbench: {threads: []}\n", "bench.threads must be a non-empty list"),
    ("model: gcn\nbench: {repeat: 3}\n", "unknown key(s) repeat"),
    ("- just a list\n", "expected a mapping"),
    ("model: [gcn\n", "not valid YAML"),
])
def test_bad_config_is_rejected_naming_the_key(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(path), "--output-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_config_defaults_and_command_line_overrides(tmp_path, capsys):
    config = load_config(CORA)
    assert (config.dataset, config.hidden_channels, config.max_epochs, config.lr) == ("Cora", 16, 200, 0.01)
    assert load_config(ROOT / "configs" / "gcn_citeseer.yaml").dataset == "CiteSeer"
    with pytest.raises(CommandError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(SystemExit):
        main(["run", "--config", CORA, "--output-dir", str(tmp_path), "--repeats", "0"])
    assert "bench.repeats must be >= 1" in capsys.readouterr().err


def test_planetoid_public_splits():
    cora = PlanetoidDataModule("Cora")
    assert (cora.num_features, cora.num_classes) == (1433, 7)
    data = load_planetoid("CiteSeer")
    assert (data.num_nodes, int(data.y.max()) + 1) == (3327, 6)
    assert [int(m.sum()) for m in (data.train_mask, data.val_mask, data.test_mask)] == [120, 500, 1000]
    torch.testing.assert_close(data.x.sum(1)[data.x.sum(1) > 0], torch.ones(int((data.x.sum(1) > 0).sum())))
    with pytest.raises(ValueError, match="PubMed.*raw files missing.*shipped here: Cora, CiteSeer"):
        load_planetoid("PubMed")
    served = PlanetoidDataModule.from_data("CiteSeer", data)
    assert next(iter(served.train_dataloader())) is data
    with pytest.raises(ValueError, match="graph has no 'train_mask'"):
        PlanetoidDataModule.from_data("CiteSeer", Data(x=data.x, edge_index=data.edge_index, y=data.y))


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


def test_gcn_model_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="dropout"):
        GCN(8, 3, dropout=1.5)
    with pytest.raises(ValueError, match="lr"):
        GCN(8, 3, lr=0.0)


def test_python_dash_m_sparsenn_is_the_cli(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["sparsenn", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("sparsenn", run_name="__main__")
    assert exit_info.value.code == 0
    assert "{train,bench,run}" in capsys.readouterr().out
