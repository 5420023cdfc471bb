"""The sparse autoencoder of the Scorch paper (Table 2) on MNIST as a LightningModule: a
90 %-sparse :class:`sparsenn.SparseLinear` encoder and a dense decoder."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import sparsenn

__all__ = ["SparseAutoencoder"]

_ENCODE = sparsenn.compile("H[b,o] = relu(X[b,i] * W[o,i] + bias[o])", out_format="dense")
"""The sparse encoder and its ReLU as one compiled kernel (the ReLU applied as each output is finished)."""


class SparseAutoencoder(L.LightningModule):
    r"""One-hidden-layer autoencoder with a sparse encoder.

    .. math::
        \hat{x} = \sigma\big(W_2\, \mathrm{ReLU}(W_1 x + b_1) + b_2\big), \qquad
        \mathcal{L} = \frac{1}{B\,n} \sum_{b,i} (\hat{x}_{bi} - x_{bi})^2

    ``W_1`` (``hidden_features × in_features``) is a :class:`sparsenn.SparseLinear` weight of
    fixed random pattern keeping ``1 - sparsity`` of its entries in ``encoder_format``
    (``"csr"``: unstructured; ``"bsr(16,16)"``: whole 16 × 16 blocks), or a dense ``nn.Linear``
    when ``encoder_format="dense"`` (the dense baseline). The decoder ``W_2`` is a dense
    ``nn.Linear``. Trained with Adam on the mean squared reconstruction error; validation
    and test log ``val_mse`` / ``test_mse``; ``predict`` returns the reconstructions.

    Args:
        in_features: pixels per image (784 for MNIST).
        hidden_features: code size (256).
        encoder_format: ``"dense"`` or a :class:`sparsenn.SparseLinear` weight format.
        sparsity: fraction of the encoder's weights removed (0.9); ignored when dense.
        lr: Adam learning rate (0.01).
    """

    def __init__(self, in_features: int = 784, hidden_features: int = 256, encoder_format: str = "csr",
                 sparsity: float = 0.9, lr: float = 0.01) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        self.save_hyperparameters()
        if encoder_format == "dense":
            self.encoder: nn.Module = nn.Linear(in_features, hidden_features)
        else:
            self.encoder = sparsenn.SparseLinear(in_features, hidden_features, sparsity=sparsity,
                                                 format=encoder_format)
        self.decoder = nn.Linear(hidden_features, in_features)
        self.lr = float(lr)

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
