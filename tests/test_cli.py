"""The ``sparsenn`` command (LightningCLI): fit / test / predict / bench on the tiny configs,
checkpoints that reload sparse layers exactly, bad configs, the main job, and DDP training."""

import json
import logging
import os
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from models import GCN, SparseAutoencoder
from sparsenn.cli import SparsennCLI, _show_sparsenn_logs, main
from sparsenn.main_job import MAIN_JOB, MainJobStep, run_main_job

ROOT = Path(__file__).resolve().parents[1]
GCN_TINY = str(ROOT / "configs" / "gcn_cora_tiny.yaml")
AE_TINY = str(ROOT / "configs" / "autoencoder_mnist_tiny.yaml")
QUICK_BENCH = ["--threads=[1,2]", "--warmup=1", "--repeats=2", "--first_call=false"]


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(config: str, root: Path) -> tuple[SparsennCLI, list[float]]:
    cli = SparsennCLI(["--config", config, f"--trainer.default_root_dir={root}"], run=False)
    recorder = LossRecorder()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli, recorder.losses


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Both tiny configs fitted once: ``{name: (cli, losses, root)}``."""
    out = {}
    for name, config in (("gcn", GCN_TINY), ("autoencoder", AE_TINY)):
        root = tmp_path_factory.mktemp(name)
        cli, losses = _fit(config, root)
        out[name] = (cli, losses, root)
    return out


@pytest.mark.parametrize("name, steps", [("gcn", 4), ("autoencoder", 8)])
def test_tiny_configs_train_with_a_decreasing_loss(trained, name, steps):
    cli, losses, root = trained[name]
    assert len(losses) == steps
    assert losses[-1] < losses[0]
    assert (root / "checkpoints" / "model.ckpt").is_file() and (root / "config.yaml").is_file()
    assert torch.get_num_threads() >= 1  # TorchThreads restored the count after fit


@pytest.mark.parametrize("name, model_class", [("gcn", GCN), ("autoencoder", SparseAutoencoder)])
def test_checkpoint_reloads_sparse_layers_exactly(trained, name, model_class):
    cli, _, root = trained[name]
    model = cli.model.eval()
    reloaded = model_class.load_from_checkpoint(root / "checkpoints" / "model.ckpt").eval()
    if name == "autoencoder":  # the reloaded encoder adopted the saved random pattern
        assert torch.equal(reloaded.encoder.mask(), model.encoder.mask())
    inputs, _ = model.bench_batch(cli.datamodule)
    with torch.no_grad():
        assert torch.equal(reloaded(*inputs), model(*inputs))


def test_fit_test_predict_bench_commands(tmp_path, capsys):
    root = tmp_path / "run"
    assert main(["fit", "--config", AE_TINY, f"--trainer.default_root_dir={root}"]) == 0
    checkpoint = root / "checkpoints" / "model.ckpt"
    assert checkpoint.is_file()
    ckpt = ["--ckpt_path", str(checkpoint), f"--trainer.default_root_dir={root}"]
    assert main(["test", "--config", AE_TINY, *ckpt]) == 0
    assert "test_mse" in capsys.readouterr().out
    assert main(["predict", "--config", AE_TINY, *ckpt]) == 0
    predictions = torch.load(root / "predictions.pt")
    assert len(predictions) == 2 and predictions[0].shape == (32, 784)  # limit_predict_batches, batch_size
    model = SparseAutoencoder.load_from_checkpoint(checkpoint).eval()
    images = next(iter(SparsennCLI(["--config", AE_TINY], run=False).datamodule.test_dataloader()))[0]
    with torch.no_grad():
        assert torch.equal(predictions[0], model(images))
    capsys.readouterr()
    assert main(["bench", "--config", AE_TINY, *ckpt, *QUICK_BENCH]) == 0
    printed = capsys.readouterr().out
    assert "outputs agree" in printed and "torch.sparse" in printed and "untrained" not in printed
    result = json.loads((root / "bench.json").read_text())
    assert result["ok"] and [v["name"] for v in result["variants"]] == ["sparsenn", "torch.sparse", "dense"]
    assert set(result["variants"][0]["median_ms"]) == {"1", "2"}
    assert (root / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_gcn_against_pyg_with_a_first_call_in_a_fresh_process(trained, tmp_path, capsys):
    _, _, root = trained["gcn"]
    argv = ["bench", "--config", GCN_TINY, "--ckpt_path", str(root / "checkpoints" / "model.ckpt"),
            f"--output_dir={tmp_path}", "--threads=[1]", "--warmup=1", "--repeats=2"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert [v["name"] for v in result["variants"]] == ["sparsenn", "torch.sparse", "dense", "PyG GCNConv"]
    assert result["ok"] and result["metric_name"] == "accuracy"
    assert result["first_call"]["kernels_built"] >= 1 and result["first_call"]["ms"] > 0
    assert "first sparsenn call in a fresh process" in capsys.readouterr().out


def test_bench_without_a_checkpoint_uses_the_initial_weights(tmp_path, capsys):
    assert main(["bench", "--config", GCN_TINY, f"--trainer.default_root_dir={tmp_path}", *QUICK_BENCH]) == 0
    assert "initial, untrained weights" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["fit", "--config", GCN_TINY, "--model.class_path=models.gcn.NoSuchModel"], "NoSuchModel"),
    (["fit", "--config", GCN_TINY, "--model.init_args.dropout=1.5"], "dropout must be in [0, 1), got 1.5"),
    (["fit", "--config", GCN_TINY, "--model.init_args.hidden=3"], "hidden"),
    (["fit", "--config", "configs/no_such_config.yaml"], "no_such_config.yaml"),
    (["bench", "--model=lightning.pytorch.demos.boring_classes.BoringModel",
      "--data=lightning.pytorch.demos.boring_classes.BoringDataModule"],
     "BoringModel cannot be benchmarked: it has no bench_batch"),
])
def test_bad_configs_are_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, path", [
    (["fit", "--config", GCN_TINY, "--data.init_args.root={tmp}"], "{tmp}/Cora/raw"),
    (["test", "--config", AE_TINY, "--data.init_args.data_dir={tmp}"], "{tmp}/t10k-images-idx3-ubyte.gz"),
    (["bench", "--config", AE_TINY, "--ckpt_path={tmp}/missing.ckpt"], "{tmp}/missing.ckpt"),
])
def test_missing_files_name_the_path(tmp_path, capsys, args, path):
    args = [a.format(tmp=tmp_path) for a in args] + [f"--trainer.default_root_dir={tmp_path}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("sparsenn: error: ") and path.format(tmp=tmp_path) in err


def test_print_config_and_help(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", GCN_TINY, "--model.init_args.hidden_channels=5", "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "class_path: models.gcn.GCN" in printed and "hidden_channels: 5" in printed
    monkeypatch.setattr(sys, "argv", ["sparsenn", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("sparsenn", run_name="__main__")
    assert exit_info.value.code == 0
    assert "{fit,validate,test,predict,bench,run}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0 and "--trainer.max_epochs" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--help"])
    assert exit_info.value.code == 0 and "--output_dir" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--repeats", "0"])
    assert exit_info.value.code == 2 and "--repeats must be >= 1" in capsys.readouterr().err


def test_kernel_build_logs_are_shown(monkeypatch, capsys):
    logger = logging.getLogger("sparsenn")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    _show_sparsenn_logs()
    logger.info("built kernel spmm_csr")
    assert "sparsenn: built kernel spmm_csr" in capsys.readouterr().err


def test_config_paths_resolve_from_the_repository(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["fit", "--config", "configs/gcn_cora_tiny.yaml", "--print_config"])
    assert "class_path: models.gcn.GCN" in capsys.readouterr().out


def test_main_job_trains_benches_and_charts_every_step(tmp_path, capsys):
    assert all((ROOT / step.config).is_file() for step in MAIN_JOB)
    steps = [MainJobStep(GCN_TINY, overrides=("--trainer.max_epochs=2",)),
             MainJobStep(AE_TINY, overrides=("--model.init_args.hidden_features=16",), train=False)]
    results = run_main_job(tmp_path, steps, bench={"threads": (1,), "warmup": 1, "repeats": 2, "first_call": False})
    assert [r.name for r in results] == ["gcn_cora_tiny", "autoencoder_mnist_tiny"] and all(r.ok for r in results)
    assert (tmp_path / "gcn_cora_tiny" / "checkpoints" / "model.ckpt").is_file()
    assert not (tmp_path / "autoencoder_mnist_tiny" / "checkpoints").exists()  # benchmarked untrained
    assert "Tensor[32, 784]" in results[1].inputs
    assert len(json.loads((tmp_path / "bench.json").read_text())) == 2
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "gcn_cora_tiny: trained in" in printed and "PyG GCNConv" in printed
    assert "autoencoder_mnist_tiny: trained" not in printed


DDP_SCRIPT = """
import sys
import torch
from lightning.pytorch.callbacks import Callback
from sparsenn.cli import SparsennCLI


class SaveRankWeights(Callback):
    def on_train_end(self, trainer, pl_module):
        torch.save(pl_module.state_dict(), f"{sys.argv[1]}/rank{trainer.global_rank}.pt")


cli = SparsennCLI(sys.argv[2:], run=False)
cli.trainer.callbacks.append(SaveRankWeights())
cli.trainer.fit(cli.model, datamodule=cli.datamodule)
"""


def test_ddp_on_cpu_ends_with_identical_weights_on_both_ranks(tmp_path):
    script = tmp_path / "fit_ddp.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, str(script), str(tmp_path), "--config", AE_TINY, f"--trainer.default_root_dir={tmp_path}",
            "--trainer.strategy=ddp", "--trainer.accelerator=cpu", "--trainer.devices=2"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert rank0.keys() == rank1.keys() and "encoder.weight_values" in rank0
    for key in rank0:
        if isinstance(rank0[key], torch.Tensor):
            assert torch.equal(rank0[key], rank1[key]), key


class EncoderValues(Callback):
    """The encoder's stored values at the first step after pruning (epoch 1)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.current_epoch == 1 and batch_idx == 0:
            self.after_pruning = pl_module.encoder.weight_values.detach().clone()


def test_autoencoder_trained_dense_then_pruned_keeps_training_and_reloads_exactly(tmp_path):
    cli = SparsennCLI(["--config", AE_TINY, f"--trainer.default_root_dir={tmp_path}", "--trainer.max_epochs=2",
                       "--trainer.limit_train_batches=3", "--model.init_args.dense_epochs=1"], run=False)
    values = EncoderValues()
    cli.trainer.callbacks.append(values)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    model = cli.model.eval()
    assert model.encoder.sparsity == pytest.approx(0.9, abs=0.01)
    assert not torch.equal(model.encoder.weight_values, values.after_pruning)  # the new optimizer trains it
    reloaded = SparseAutoencoder.load_from_checkpoint(tmp_path / "checkpoints" / "model.ckpt").eval()
    images = torch.rand(4, 784)
    with torch.no_grad():
        assert torch.equal(reloaded(images), model(images))
    with pytest.raises(ValueError, match="max_epochs 1 <= dense_epochs 1"):
        SparsennCLI(["fit", "--config", AE_TINY, f"--trainer.default_root_dir={tmp_path}",
                     "--model.init_args.dense_epochs=1"])
