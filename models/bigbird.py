"""BigBird text classifier (Zaheer et al. 2020) as a LightningModule: a small transformer
encoder whose self-attention is :class:`sparsenn.BlockSparseAttention`, the Scorch paper's
Table 3 model (embedding 128, FFN 256, 2 layers, 4 heads, blocks of 16 with 2 global, 2
window and 2 random blocks; AdamW, lr 1e-3), or the same model with dense attention."""

from __future__ import annotations

import inspect
from typing import Callable

import lightning as L
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

import sparsenn
from sparsenn.layers.arguments import checked_int

__all__ = ["BigBirdClassifier", "EncoderLayer", "MaskedDenseAttention"]

ATTENTIONS = ("sparse", "dense")


class MaskedDenseAttention(nn.Module):
    """The self-attention of a :class:`sparsenn.BlockSparseAttention`, with its parameters,
    computed densely: ``scaled_dot_product_attention`` under its eval-mode mask
    (``attention_mask``: BigBird's pattern and the key padding). Equals the block-sparse
    computation; a query with no allowed key gives zero, as there. Quadratic in length:
    a reference, for inference."""

    def __init__(self, block_sparse: sparsenn.BlockSparseAttention) -> None:
        super().__init__()
        self.block_sparse = block_sparse

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> tuple[Tensor, None]:
        attention = self.block_sparse
        q, k, v = (rearrange(t, "b l (h d) -> b h l d", h=attention.num_heads)
                   for t in F.linear(x, attention.in_proj_weight, attention.in_proj_bias).chunk(3, -1))
        allowed = attention.attention_mask(x.shape[1], key_padding_mask)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        out = out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
        return attention.out_proj(rearrange(out, "b h l d -> b l (h d)")), None


class EncoderLayer(nn.Module):
    r"""A transformer encoder layer around a given self-attention module.

    .. math::
        \text{pre-LN:}\quad x \gets x + \mathrm{drop}(\mathrm{Attn}(\mathrm{LN}_1(x))),\quad
        x \gets x + \mathrm{drop}(W_2\, \mathrm{drop}(\mathrm{GELU}(W_1 \mathrm{LN}_2(x))))

    (post-LN: ``x = LN_1(x + drop(Attn(x)))``, ``x = LN_2(x + drop(FFN(x)))``). ``attention``
    is an ``nn.MultiheadAttention``, a :class:`sparsenn.BlockSparseAttention` or a
    :class:`MaskedDenseAttention`; all three have the same parameters.
    """

    def __init__(self, attention: nn.Module, embed_dim: int, ffn_dim: int, dropout: float, norm_first: bool) -> None:
        super().__init__()
        self.attention = attention
        self.norm1, self.norm2 = nn.LayerNorm(embed_dim), nn.LayerNorm(embed_dim)
        self.ffn = nn.Sequential(nn.Linear(embed_dim, ffn_dim), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(ffn_dim, embed_dim))
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def _attend(self, x: Tensor, padding: Tensor) -> Tensor:
        if isinstance(self.attention, nn.MultiheadAttention):
            return self.attention(x, x, x, key_padding_mask=padding, need_weights=False)[0]
        if isinstance(self.attention, sparsenn.BlockSparseAttention):
            return self.attention(x, key_padding_mask=padding, need_weights=False)[0]
        return self.attention(x, key_padding_mask=padding)[0]

    def forward(self, x: Tensor, padding: Tensor) -> Tensor:
        if self.norm_first:
            x = x + self.dropout(self._attend(self.norm1(x), padding))
            return x + self.dropout(self.ffn(self.norm2(x)))
        x = self.norm1(x + self.dropout(self._attend(x, padding)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class BigBirdClassifier(L.LightningModule):
    r"""Sequence classifier: token and learned positional embeddings, ``num_layers``
    :class:`EncoderLayer`\ s, a final layer norm (pre-LN), the mean of the unpadded
    positions, and a linear head.

    .. math::
        h^{(0)}_t = E[x_t] + P[t],\qquad
        \mathrm{logits} = W \frac{\sum_t [\lnot\mathrm{pad}_t]\, h^{(N)}_t}{\sum_t [\lnot\mathrm{pad}_t]} + b

    ``attention="sparse"``: :class:`sparsenn.BlockSparseAttention` (BigBird's pattern, the
    random blocks of layer ``l`` from ``pattern_seed + l`` in eval mode, redrawn at every
    training step); ``"dense"``: ``nn.MultiheadAttention`` over every unpadded key. The two
    have the same parameters, so one's weights load into the other. Trained with AdamW
    (weight decay on the linear layers' weight matrices only) on the cross-entropy; logs ``train_loss``,
    ``val_loss``/``val_acc`` and ``test_loss``/``test_acc``. Batches are
    ``(token_ids, padding_mask, labels)`` (:class:`models.imdb.IMDBDataModule`).

    Args:
        vocab_size: token ids (at least the data module's vocabulary).
        num_classes: output classes.
        max_length: longest sequence (the positional embeddings' size).
        embed_dim, ffn_dim, num_layers, num_heads: the encoder's shape.
        dropout: on the embeddings, attention probabilities, FFN and residual branches.
        attention: ``"sparse"`` or ``"dense"``.
        block_size, num_global_blocks, num_window_blocks, num_random_blocks: BigBird's pattern.
        norm_first: pre-LN (True) or post-LN layers.
        lr, weight_decay: AdamW.
        pattern_seed: seed of the random blocks.
    """

    def __init__(self, vocab_size: int = 20000, num_classes: int = 2, max_length: int = 1024, embed_dim: int = 128,
                 ffn_dim: int = 256, num_layers: int = 2, num_heads: int = 4, dropout: float = 0.1,
                 attention: str = "sparse", block_size: int = 16, num_global_blocks: int = 2,
                 num_window_blocks: int = 2, num_random_blocks: int = 2, norm_first: bool = True, lr: float = 1e-3,
                 weight_decay: float = 0.01, pattern_seed: int = 0) -> None:
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        for name, value, minimum in (("vocab_size", vocab_size, 1), ("num_classes", num_classes, 2),
                                     ("max_length", max_length, 1), ("embed_dim", embed_dim, 1),
                                     ("ffn_dim", ffn_dim, 1), ("num_layers", num_layers, 1),
                                     ("num_heads", num_heads, 1), ("pattern_seed", pattern_seed, 0)):
            checked_int(name, value, minimum)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        self.save_hyperparameters()
        self.token_embedding = nn.Embedding(vocab_size, embed_dim)
        self.position_embedding = nn.Embedding(max_length, embed_dim)
        self.embedding_dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            EncoderLayer(self._attention(attention, layer), embed_dim, ffn_dim, dropout, norm_first)
            for layer in range(num_layers))
        self.final_norm = nn.LayerNorm(embed_dim) if norm_first else nn.Identity()
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.position_embedding.weight, std=0.02)

    def _attention(self, kind: str, layer: int) -> nn.Module:
        """A fresh attention module of ``kind`` for encoder layer ``layer``."""
        h = self.hparams
        if kind == "dense":
            return nn.MultiheadAttention(h.embed_dim, h.num_heads, dropout=h.dropout, batch_first=True)
        return sparsenn.BlockSparseAttention(
            h.embed_dim, h.num_heads, block_size=h.block_size, num_global_blocks=h.num_global_blocks,
            num_window_blocks=h.num_window_blocks, num_random_blocks=h.num_random_blocks, dropout=h.dropout,
            batch_first=True, seed=h.pattern_seed + layer)

    def forward(self, token_ids: Tensor, padding_mask: Tensor) -> Tensor:
        """Class logits ``(batch, num_classes)`` of ``token_ids`` (long, ``(batch, L)``,
        ``L <= max_length``); ``padding_mask`` (bool, same shape) is True at padding."""
        if not isinstance(token_ids, Tensor) or token_ids.dtype != torch.long or token_ids.dim() != 2:
            raise TypeError(f"token_ids must be a 2-D long tensor, got "
                            f"{token_ids.dtype if isinstance(token_ids, Tensor) else type(token_ids).__name__}")
        if not isinstance(padding_mask, Tensor) or padding_mask.dtype != torch.bool:
            raise TypeError("padding_mask must be a bool tensor (True at padding)")
        if padding_mask.shape != token_ids.shape:
            raise ValueError(f"padding_mask has shape {tuple(padding_mask.shape)}, token_ids {tuple(token_ids.shape)}")
        length = token_ids.shape[1]
        if length > self.hparams.max_length:
            raise ValueError(f"sequences of {length} tokens exceed max_length={self.hparams.max_length} "
                             f"(the positional embeddings' size)")
        x = self.token_embedding(token_ids) + self.position_embedding.weight[:length]
        x = self.embedding_dropout(x)
        for layer in self.layers:
            x = layer(x, padding_mask)
        x = self.final_norm(x)
        keep = (~padding_mask).unsqueeze(-1).to(x.dtype)
        pooled = (x * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.head(pooled)

    # ------------------------------------------------------------------ training
    def setup(self, stage: str) -> None:
        """Check that the data module's vocabulary and length fit the embeddings."""
        datamodule = getattr(self.trainer, "datamodule", None)
        vocab = getattr(datamodule, "vocab_size", None) if datamodule is not None else None
        if vocab is not None and vocab > self.hparams.vocab_size:
            raise ValueError(f"the data's vocabulary has {vocab} ids but the model's vocab_size is "
                             f"{self.hparams.vocab_size}")
        length = getattr(datamodule, "max_length", None)
        if length is not None and length > self.hparams.max_length:
            raise ValueError(f"the data's max_length ({length}) exceeds the model's max_length "
                             f"({self.hparams.max_length})")

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        token_ids, padding_mask, labels = batch
        loss = F.cross_entropy(self(token_ids, padding_mask), labels)
        self.log("train_loss", loss, prog_bar=True, batch_size=labels.shape[0])
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate("val", batch)

    def test_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate("test", batch)

    def predict_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        """Class logits of the batch."""
        return self(batch[0], batch[1])

    def _evaluate(self, split: str, batch: tuple[Tensor, Tensor, Tensor]) -> None:
        token_ids, padding_mask, labels = batch
        logits = self(token_ids, padding_mask)
        size = labels.shape[0]
        self.log(f"{split}_loss", F.cross_entropy(logits, labels), batch_size=size)
        self.log(f"{split}_acc", (logits.argmax(-1) == labels).float().mean(), prog_bar=True, batch_size=size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        named = list(self.named_parameters())
        decayed = {name for name, p in named if p.dim() >= 2 and "embedding" not in name}
        return torch.optim.AdamW([
            {"params": [p for name, p in named if name in decayed], "weight_decay": self.hparams.weight_decay},
            {"params": [p for name, p in named if name not in decayed], "weight_decay": 0.0},
        ], lr=self.hparams.lr)

    # ------------------------------------------------------------------ bench protocol
    def bench_batch(self, datamodule: L.LightningDataModule) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """``((token_ids, padding_mask), labels)``: the first test batch of ``datamodule``
        (shuffled reviews, both classes; at a long ``max_length`` most positions are padding:
        IMDB's median review has about 180 tokens)."""
        datamodule.setup("test")
        token_ids, padding_mask, labels = next(iter(datamodule.test_dataloader()))
        return (token_ids, padding_mask), labels

    def with_attention(self, kind: str) -> BigBirdClassifier:
        """A copy in eval mode with the same weights and ``kind`` of attention: ``"sparse"``,
        ``"dense"`` (``nn.MultiheadAttention``, every key) or ``"masked dense"``
        (:class:`MaskedDenseAttention`: BigBird's mask, computed densely)."""
        if kind not in (*ATTENTIONS, "masked dense"):
            raise ValueError(f"kind must be 'sparse', 'dense' or 'masked dense', got {kind!r}")
        settings = {name: self.hparams[name] for name in inspect.signature(BigBirdClassifier).parameters}
        twin = BigBirdClassifier(**{**settings, "attention": "dense" if kind == "dense" else "sparse"})
        twin.load_state_dict(self.state_dict())
        if kind == "masked dense":
            for layer in twin.layers:
                layer.attention = MaskedDenseAttention(layer.attention)
        return twin.to(self.dtype).eval()

    def inference_variants(self) -> dict[str, Callable[..., Tensor]]:
        """Name -> eval-mode ``callable(token_ids, padding_mask)`` giving logits, all with
        these weights: ``"sparsenn"`` (block-sparse attention through the compiler),
        ``"dense attention, BigBird mask"`` (the same attention as dense SDPA under the mask:
        equal outputs) and ``"dense attention, full (nn.MultiheadAttention)"`` (every key:
        the dense model, the speed baseline; its outputs differ)."""
        models = {"sparsenn": self.with_attention("sparse"),
                  "dense attention, BigBird mask": self.with_attention("masked dense"),
                  "dense attention, full (nn.MultiheadAttention)": self.with_attention("dense")}
        return {name: _inference(model) for name, model in models.items()}

    def bench_baselines(self) -> frozenset[str]:
        """Full dense attention attends to every key: the speed baseline, not BigBird's function."""
        return frozenset({"dense attention, full (nn.MultiheadAttention)"})

    def bench_metric(self, output: Tensor, target: Tensor) -> tuple[str, float]:
        """``("accuracy", fraction of rows whose arg-max logit is the target)``."""
        return "accuracy", float((output.argmax(-1) == target).float().mean())


def _inference(model: nn.Module) -> Callable[..., Tensor]:
    """``model``'s forward under ``torch.inference_mode``."""
    def run(token_ids: Tensor, padding_mask: Tensor) -> Tensor:
        with torch.inference_mode():
            return model(token_ids, padding_mask)
    return run
