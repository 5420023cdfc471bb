"""The ``sparsenn`` command: Lightning's ``LightningCLI`` over the reference models, plus
an inference benchmark and the main job.

``sparsenn fit | validate | test | predict --config configs/<model>.yaml`` trains or evaluates
the ``model:`` and ``data:`` of a config (``class_path`` + ``init_args``: any LightningModule
and LightningDataModule, e.g. ``models.gcn.GCN`` with ``models.planetoid.PlanetoidDataModule``)
with the ``trainer:`` settings; ``sparsenn bench --config ... [--ckpt_path ...]`` times CPU
inference of the model against the same weights in torch.sparse, dense PyTorch and PyG
(``models/bench.py``); ``sparsenn run`` is the main job (:mod:`sparsenn.main_job`). Any setting
can be overridden on the command line (``--trainer.max_epochs 5``,
``--model.init_args.hidden_channels 16``); ``--print_config`` prints the resolved config.
Config paths are looked up in the working directory, then in the checkout. Kernel builds are
logged on the ``sparsenn`` logger.

The reference models (``models/``) and configs (``configs/``) live in the source checkout, next
to the ``sparsenn`` package of an editable install; the command needs the ``models`` extra
(Lightning, jsonargparse, PyG, matplotlib), imported only once a subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "checkout", "SparsennCLI", "SparsennTrainer", "SavePredictions", "TorchThreads"]

REPO_ROOT = Path(__file__).resolve().parents[1]
"""Where the checkout is when the package is imported from one (an editable install)."""

EXTRA_MODULES = ("lightning", "jsonargparse", "torch_geometric", "matplotlib")
"""What the ``models`` extra installs and the command imports."""

DESCRIPTION = " ".join(__doc__.split("\n\n")[0].replace("``", "'").split())

INSTALL_EXTRA = 'pip install "sparsenn-torch[models]" (in a checkout: pip install -e ".[models]")'
INSTALL_CHECKOUT = 'git clone <the sparsenn repository> sparsenn && cd sparsenn && pip install -e ".[models]"'

SUBCOMMANDS = {
    "fit": "train the config's model on its data",
    "validate": "one evaluation epoch over the validation set",
    "test": "one evaluation epoch over the test set",
    "predict": "run inference and save the predictions",
    "bench": "time CPU inference against torch.sparse, dense PyTorch (and PyG for GCN) with the same weights",
    "run": "the main job: train and benchmark the reference models, print tables, write a chart",
}

_LIGHTNING_NAMES = ("SparsennCLI", "SparsennTrainer", "SavePredictions", "TorchThreads")


def __getattr__(name: str) -> Any:
    """The Lightning classes (named ``sparsenn.cli.<name>`` in configs), imported on first use."""
    if name in _LIGHTNING_NAMES:
        return getattr(importlib.import_module("sparsenn.lightning_cli"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def checkout() -> Path | None:
    """The source checkout the package was imported from (its ``models/`` and ``configs/``),
    or None for an installed copy."""
    markers = (REPO_ROOT / "pyproject.toml", REPO_ROOT / "models" / "__init__.py", REPO_ROOT / "configs")
    return REPO_ROOT if all(path.exists() for path in markers) else None


def no_checkout_error(what: str) -> FileNotFoundError:
    """Why ``what`` cannot run from an installed copy, and how to get a checkout."""
    return FileNotFoundError(
        f"{what} needs the reference models and configs of a source checkout (models/ and configs/ beside the "
        f"sparsenn package), and sparsenn is imported from {REPO_ROOT / 'sparsenn'}, which is not one. Get a "
        f"checkout and install it editable: {INSTALL_CHECKOUT}")


def _help_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparsenn", description=DESCRIPTION,
        epilog="`sparsenn <subcommand> --help` lists a subcommand's options.")
    subcommands = parser.add_subparsers(title="subcommands", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, text in SUBCOMMANDS.items():
        subcommands.add_parser(name, help=text)
    return parser


def _missing_extra() -> list[str]:
    return [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]


def _importable_models() -> None:
    """The reference models are the checkout's ``models/`` package: make it importable from
    any working directory."""
    if checkout() is not None and str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))


def _show_sparsenn_logs() -> None:
    """Kernel builds are logged on ``sparsenn`` at INFO: print them unless logging is already set up."""
    logger = logging.getLogger("sparsenn")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _quiet_lightning_hints() -> None:
    """Hide warnings that are noise here: data-loader worker hints (the data sits in memory),
    a deprecation inside Lightning, and LightningCLI's note on ``args`` (which :func:`main`
    passes with config paths resolved)."""
    for message in (".*does not have many workers.*", r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",
                    ".*LightningCLI's args parameter is intended to run from within Python.*"):
        warnings.filterwarnings("ignore", message=message)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``sparsenn`` / ``python -m sparsenn``: ``run`` is the main job, anything
    else goes to :class:`SparsennCLI`. Returns the exit status (1 when a benchmarked variant's
    output disagrees with sparsenn's; 2 for usage errors, a missing file, extra or checkout)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in ([], ["-h"], ["--help"]):
        parser = _help_parser()
        if argv:
            parser.print_help()
            return 0
        parser.print_usage(sys.stderr)
        print("sparsenn: error: a subcommand is required (sparsenn --help lists them)", file=sys.stderr)
        return 2
    missing = _missing_extra()
    if missing:
        print(f"sparsenn: error: the sparsenn command needs the models extra (missing: {', '.join(missing)}): "
              f"{INSTALL_EXTRA}", file=sys.stderr)
        return 2
    _importable_models()
    _show_sparsenn_logs()
    _quiet_lightning_hints()
    try:
        if argv[0] == "run":
            from sparsenn.main_job import main_job_command

            return main_job_command(argv[1:])
        from sparsenn.lightning_cli import SparsennCLI

        cli = SparsennCLI(argv)
    except FileNotFoundError as exc:  # a data file, checkpoint or checkout: the message says where and how to get it
        print(f"sparsenn: error: {exc}", file=sys.stderr)
        return 2
    return 1 if cli.subcommand == "bench" and not cli.bench_result.ok else 0
