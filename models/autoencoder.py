"""The sparse autoencoder of the Scorch paper (Table 2) on MNIST as a LightningModule: a
90 %-sparse :class:`sparsenn.SparseLinear` encoder and a dense decoder."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

import sparsenn
from sparsenn.layers.linear import check_weight_format, resolve_sparsity, shape_problem

__all__ = ["SparseAutoencoder"]

_ENCODE = sparsenn.compile("H[b,o] = relu(X[b,i] * W[o,i] + bias[o])", out_format="dense")
"""The sparse encoder and its ReLU as one compiled kernel (the ReLU applied as each output is finished)."""


class SparseAutoencoder(L.LightningModule):
    r"""One-hidden-layer autoencoder with a sparse encoder.

    .. math::
        \hat{x} = \sigma\big(W_2\, \mathrm{ReLU}(W_1 x + b_1) + b_2\big), \qquad
        \mathcal{L} = \frac{1}{B\,n} \sum_{b,i} (\hat{x}_{bi} - x_{bi})^2

    ``W_1`` (``hidden_features × in_features``) is a :class:`sparsenn.SparseLinear` weight keeping
    ``1 - sparsity`` of its entries in ``encoder_format`` (``"csr"``: unstructured; ``"bsr(16,16)"``:
    whole 16 × 16 blocks), or a dense ``nn.Linear`` when ``encoder_format="dense"`` (the dense
    baseline). Its pattern is random and fixed when ``dense_epochs`` is 0; otherwise the encoder
    trains dense for ``dense_epochs`` epochs and is then pruned to its largest weights
    (:meth:`sparsenn.SparseLinear.from_dense`, magnitude; for blocks, Frobenius norm), and the
    optimizer restarts on the sparse parameters. The decoder ``W_2`` is a dense ``nn.Linear``.
    Trained with Adam on the mean squared reconstruction error; validation and test log
    ``val_mse`` / ``test_mse``; ``predict`` returns the reconstructions. Loading a state saved
    after the pruning prunes first, then adopts the saved pattern.

    Args:
        in_features: pixels per image (784 for MNIST).
        hidden_features: code size (256).
        encoder_format: ``"dense"`` or a :class:`sparsenn.SparseLinear` weight format.
        sparsity: fraction of the encoder's weights removed (0.9); ignored when dense.
        dense_epochs: epochs trained dense before pruning (0: a random pattern from the start).
            Pruning swaps the encoder module, so it is not supported under DDP (several processes).
        lr: Adam learning rate (0.01).
    """

    def __init__(self, in_features: int = 784, hidden_features: int = 256, encoder_format: str = "csr",
                 sparsity: float = 0.9, dense_epochs: int = 0, lr: float = 0.01) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if isinstance(dense_epochs, bool) or not isinstance(dense_epochs, int) or dense_epochs < 0:
            raise ValueError(f"dense_epochs must be an int >= 0, got {dense_epochs!r}")
        self.save_hyperparameters()
        self.encoder_format, self.sparsity = encoder_format, sparsity
        self.dense_epochs, self.lr = dense_epochs, float(lr)
        if encoder_format == "dense" or dense_epochs > 0:
            if encoder_format != "dense":
                _check_encoder_format(encoder_format, sparsity, hidden_features, in_features)
            self.encoder: nn.Module = nn.Linear(in_features, hidden_features)
        else:
            self.encoder = sparsenn.SparseLinear(in_features, hidden_features, sparsity=sparsity,
                                                 format=encoder_format)
        self.decoder = nn.Linear(hidden_features, in_features)

    @property
    def pruning_pending(self) -> bool:
        """Whether the encoder is still dense but meant to be sparse."""
        return self.encoder_format != "dense" and isinstance(self.encoder, nn.Linear)

    def prune(self) -> None:
        """Replace the dense encoder by a :class:`sparsenn.SparseLinear` keeping its largest weights."""
        self.encoder = sparsenn.SparseLinear.from_dense(self.encoder, sparsity=self.sparsity,
                                                        format=self.encoder_format)

    def on_fit_start(self) -> None:
        if not self.pruning_pending:
            return
        if self.trainer.world_size > 1:
            raise ValueError("dense_epochs > 0 (train dense, then prune) swaps the encoder mid-training, which DDP "
                             "does not support; set model.init_args.dense_epochs to 0 for several processes")
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and 0 <= max_epochs <= self.dense_epochs:
            raise ValueError(f"max_epochs {max_epochs} <= dense_epochs {self.dense_epochs}: the encoder would never "
                             "be pruned to a sparse layer")

    def on_train_epoch_start(self) -> None:
        """Prune after ``dense_epochs`` epochs and restart the optimizer on the new parameters."""
        if self.pruning_pending and self.current_epoch >= self.dense_epochs:
            self.prune()
            self.trainer.strategy.setup_optimizers(self.trainer)
            rank_zero_info(f"epoch {self.current_epoch}: encoder pruned to {self.encoder}")

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """As ``nn.Module.load_state_dict``; a state saved after pruning prunes this model first."""
        if self.pruning_pending and "encoder.weight_values" in state_dict:
            self.prune()
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def encode(self, x: Tensor) -> Tensor:
        """``ReLU(W_1 x + b_1)``: one compiled kernel for a sparse encoder."""
        if isinstance(self.encoder, sparsenn.SparseLinear):
            return _ENCODE(x, self.encoder.weight, self.encoder.bias)
        return F.relu(self.encoder(x))

    def forward(self, x: Tensor) -> Tensor:
        """Reconstructions of ``x`` (``(batch, in_features)``, pixels in [0, 1])."""
        return torch.sigmoid(self.decoder(self.encode(x)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images = batch[0]
        loss = F.mse_loss(self(images), images)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_mse", F.mse_loss(self(batch[0]), batch[0]), prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test_mse", F.mse_loss(self(batch[0]), batch[0]))

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """The reconstructed images."""
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    # ------------------------------------------------------------------ bench protocol
    def bench_batch(self, datamodule: Any) -> tuple[tuple[Tensor], Tensor]:
        """``((images,), images)``: the first test batch (the data module's ``batch_size``)."""
        images = next(iter(datamodule.test_dataloader()))[0]
        return (images,), images

    def inference_variants(self) -> dict[str, Callable[..., Tensor]]:
        """sparsenn, then the same weights with the encoder as a torch.sparse CSR ``F.linear``
        and as a dense ``nn.Linear`` (the decoder is the same dense ``nn.Linear`` in all)."""
        if isinstance(self.encoder, sparsenn.SparseLinear):
            dense_encoder = self.encoder.to_dense()
        else:
            dense_encoder = self.encoder
        weight = dense_encoder.weight.detach()
        csr, bias = weight.to_sparse_csr(), dense_encoder.bias.detach()
        decoder = self.decoder

        def torch_sparse(x: Tensor) -> Tensor:
            return torch.sigmoid(decoder(F.relu(F.linear(x, csr, bias))))

        def dense(x: Tensor) -> Tensor:
            return torch.sigmoid(decoder(F.relu(dense_encoder(x))))

        return {"sparsenn": self, "torch.sparse": torch_sparse, "dense": dense}

    def bench_metric(self, output: Tensor, target: Tensor) -> tuple[str, float]:
        """Mean squared reconstruction error."""
        return "mse", float(F.mse_loss(output, target))


def _check_encoder_format(encoder_format: str, sparsity: float, hidden_features: int, in_features: int) -> None:
    """The errors SparseLinear would raise for this format and sparsity, before it is built at pruning time."""
    fmt = check_weight_format(encoder_format)
    resolve_sparsity(fmt, sparsity)
    problem = shape_problem(fmt, hidden_features, in_features)
    if problem is not None:
        raise ValueError(f"format {fmt} does not fit the encoder's {hidden_features}×{in_features} weight: {problem}")
