"""The BigBird reference model: the IMDB tokenizer and data module on small csv.gz fixtures,
the three configs through LightningCLI, training on the tiny config, sparse attention
against dense attention under the same mask, checkpoint round trip, the bench protocol,
and bad configs and data. Shapes match tests/test_attention.py (embed 16, 2 heads,
blocks of 4), so the attention kernels are shared."""

from __future__ import annotations

import csv
import gzip
import random
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import nn

import sparsenn
from models.bigbird import BigBirdClassifier, MaskedDenseAttention
from models.imdb import IMDB_URL, IMDBDataModule, WordTokenizer, default_data_dir, read_imdb_csv, write_imdb_csv

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
TINY = CONFIGS / "bigbird_imdb_tiny.yaml"
SHIPPED_FIXTURE = ROOT / "models" / "data" / "imdb_tiny"

GOOD = ["great", "wonderful", "loved", "superb", "brilliant", "moving"]
BAD = ["awful", "boring", "hated", "terrible", "dull", "waste"]
NEUTRAL = ["the", "film", "movie", "plot", "actor", "story", "scene", "music", "a", "it", "was", "and", "of", "i"]


def synthetic_reviews(count: int, seed: int) -> list[tuple[int, str]]:
    """``count`` (label, text) pairs, grouped by class as the IMDB files are: neutral words
    with a few of the class's sentiment words, 8 to 70 tokens, some ``<br />`` breaks."""
    rng = random.Random(seed)
    rows = []
    for label, words in ((0, BAD), (1, GOOD)):
        for _ in range(count // 2):
            tokens = rng.choices(NEUTRAL, k=rng.randint(6, 66)) + rng.choices(words, k=rng.randint(2, 4))
            rng.shuffle(tokens)
            text = " ".join(tokens).capitalize()
            rows.append((label, text.replace(" plot ", " plot.<br /><br />", 1) + rng.choice([".", "!", "?"])))
    return rows


def write_fixture(data_dir: Path, train: int = 96, test: int = 32, extra_test_text: str = "") -> Path:
    """``train.csv.gz`` and ``test.csv.gz`` of synthetic reviews in ``data_dir``."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for split, count, seed in (("train", train, 1), ("test", test, 2)):
        rows = synthetic_reviews(count, seed)
        if split == "test" and extra_test_text:
            rows[0] = (rows[0][0], rows[0][1] + " " + extra_test_text)
        with gzip.open(data_dir / f"{split}.csv.gz", "wt", newline="", encoding="utf-8") as file:
            writer = csv.writer(file, lineterminator="\n")
            writer.writerow(("label", "rating", "file", "text"))
            for number, (label, text) in enumerate(rows):
                rating = 8 if label else 2
                writer.writerow((label, rating, f"{split}/{'pos' if label else 'neg'}/{number}_{rating}.txt", text))
    return data_dir


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory) -> Path:
    return write_fixture(tmp_path_factory.mktemp("imdb"), extra_test_text="zyzzyva")


def tiny_cli(*overrides: str, config: Path = TINY) -> LightningCLI:
    """The config instantiated as ``sparsenn`` does (subclass mode), without running."""
    with mock.patch("sys.argv", ["sparsenn"]):
        return LightningCLI(subclass_mode_model=True, subclass_mode_data=True, run=False, save_config_callback=None,
                            args=["--config", str(config), *overrides])


def tiny_model(**kwargs) -> BigBirdClassifier:
    settings = dict(vocab_size=40, max_length=48, embed_dim=16, ffn_dim=32, num_heads=2, block_size=4,
                    num_window_blocks=2, num_random_blocks=1, pattern_seed=3)
    return BigBirdClassifier(**{**settings, **kwargs})


def random_batch(batch: int = 3, length: int = 48, vocab: int = 40, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (batch, length), generator=generator)
    lengths = torch.tensor([length, 29, 5])[:batch]
    padding = torch.arange(length) >= lengths[:, None]
    return ids.masked_fill(padding, 0), padding


# ----------------------------------------------------------------------------- tokenizer
def test_tokenizer_splits_lower_cased_words_and_marks():
    text = "I didn't LIKE it...<br /><br />Really? 10/10 -- NOT!"
    assert WordTokenizer.split(text) == ["i", "didn't", "like", "it", "really", "?", "10", "10", "not", "!"]
    assert WordTokenizer.split("Café naïve_test") == ["café", "naïve", "test"]


def test_tokenizer_vocabulary_by_count_with_limits():
    texts = ["b a b c", "a b d", "b e"]
    tokenizer = WordTokenizer.fit(texts, vocab_size=100, min_freq=1)
    assert tokenizer.words == ["<pad>", "<unk>", "b", "a", "c", "d", "e"]  # ties in order of first appearance
    assert WordTokenizer.fit(texts, vocab_size=4, min_freq=1).words == ["<pad>", "<unk>", "b", "a"]
    assert WordTokenizer.fit(texts, vocab_size=100, min_freq=2).words == ["<pad>", "<unk>", "b", "a"]
    with pytest.raises(ValueError, match="vocab_size must be >= 3"):
        WordTokenizer.fit(texts, vocab_size=2)
    with pytest.raises(ValueError, match="starts with"):
        WordTokenizer(["a", "b"])


def test_tokenizer_encodes_truncates_and_pads():
    tokenizer = WordTokenizer(["<pad>", "<unk>", "good", "film"])
    ids, padding = tokenizer.encode(["Good film", "good bad film good film", "", "!?"], max_length=4)
    assert ids.tolist() == [[2, 3, 0, 0], [2, 1, 3, 2], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert padding.tolist() == [[False, False, True, True], [False] * 4, [False, True, True, True],
                                [False, False, True, True]]
    assert ids.dtype == torch.long and padding.dtype == torch.bool


# ----------------------------------------------------------------------------- data module
def test_data_module_splits_shuffles_and_builds_the_vocabulary_from_training_reviews(fixture_dir):
    data = IMDBDataModule(str(fixture_dir), max_length=32, vocab_size=100, min_freq=1, batch_size=8, val_size=16)
    data.setup("fit")
    assert {split: len(d) for split, d in data.datasets.items()} == {"train": 80, "val": 16, "test": 32}
    assert "zyzzyva" not in data.tokenizer.ids  # only in a test review
    assert set(data.tokenizer.words) <= {"<pad>", "<unk>", "!", "?", *GOOD, *BAD, *NEUTRAL}
    ids, padding, labels = next(iter(data.test_dataloader()))
    assert ids.shape == padding.shape == (8, 32) and labels.shape == (8,)
    assert 0 < labels.sum() < 8  # shuffled: the file is grouped by class
    assert torch.equal(ids == 0, padding) and not padding[:, 0].any()
    train_labels = torch.cat([batch[2] for batch in data.train_dataloader()])
    assert train_labels.sum() + data.datasets["val"].tensors[2].sum() == 48
    again = IMDBDataModule(str(fixture_dir), max_length=32, vocab_size=100, min_freq=1, batch_size=8, val_size=16)
    again.setup("test")
    assert torch.equal(again.datasets["val"].tensors[0], data.datasets["val"].tensors[0])
    other_seed = IMDBDataModule(str(fixture_dir), max_length=32, min_freq=1, val_size=16, seed=1)
    other_seed.setup()
    assert not torch.equal(other_seed.datasets["val"].tensors[0], data.datasets["val"].tensors[0])


def test_data_module_cache_round_trip(fixture_dir, tmp_path):
    settings = dict(max_length=24, min_freq=1, val_size=8, cache_dir=str(tmp_path / "cache"))
    first = IMDBDataModule(str(fixture_dir), **settings)
    first.setup()
    assert len(list((tmp_path / "cache").glob("imdb-*.pt"))) == 1
    assert not list((tmp_path / "cache").glob("*.partial"))
    cached = IMDBDataModule(str(fixture_dir), **settings)
    cached.setup()
    assert cached.tokenizer.words == first.tokenizer.words
    for split in ("train", "val", "test"):
        for mine, theirs in zip(cached.datasets[split].tensors, first.datasets[split].tensors):
            assert torch.equal(mine, theirs)
    IMDBDataModule(str(fixture_dir), **{**settings, "max_length": 25}).setup()
    assert len(list((tmp_path / "cache").glob("imdb-*.pt"))) == 2  # another setting, another file


def test_missing_and_bad_data_files(tmp_path, fixture_dir):
    with pytest.raises(FileNotFoundError, match=r"IMDB file not found: .*train\.csv\.gz.*aclImdb_v1\.tar\.gz"):
        IMDBDataModule(str(tmp_path / "nowhere")).setup()
    assert IMDB_URL.endswith("aclImdb_v1.tar.gz")
    with pytest.raises(RuntimeError, match="setup"):
        IMDBDataModule(str(tmp_path)).vocab_size
    bad = tmp_path / "bad"
    write_fixture(bad)
    with gzip.open(bad / "train.csv.gz", "wt", newline="", encoding="utf-8") as file:
        file.write("label,rating,file,text\n2,5,x,some text\n")
    with pytest.raises(ValueError, match=r"line 2: label must be 0 or 1, got '2'"):
        IMDBDataModule(str(bad)).setup()
    with gzip.open(bad / "train.csv.gz", "wt", newline="", encoding="utf-8") as file:
        file.write("label,review\n1,some text\n")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['text'\]"):
        read_imdb_csv(bad / "train.csv.gz")
    with pytest.raises(ValueError, match="val_size .* must be smaller than the 96 training reviews"):
        IMDBDataModule(str(fixture_dir), val_size=96).setup()
    with pytest.raises(TypeError, match="max_length must be an int"):
        IMDBDataModule(str(fixture_dir), max_length=1.5)
    assert default_data_dir().name == "imdb"


def test_write_imdb_csv_from_an_aclimdb_folder(tmp_path):
    for split in ("train", "test"):
        for polarity, rating in (("neg", 3), ("pos", 9)):
            folder = tmp_path / "aclImdb" / split / polarity
            folder.mkdir(parents=True)
            for review in (10, 2):
                (folder / f"{review}_{rating}.txt").write_text(f"{polarity} review {review}, \"quoted\"<br />ok")
    write_imdb_csv(tmp_path / "aclImdb", tmp_path / "out")
    texts, labels = read_imdb_csv(tmp_path / "out" / "train.csv.gz")
    assert labels == [0, 0, 1, 1]
    assert texts[0] == 'neg review 2, "quoted"<br />ok' and texts[3].startswith("pos review 10")
    with pytest.raises(FileNotFoundError, match="unpacked aclImdb folder"):
        write_imdb_csv(tmp_path / "missing", tmp_path / "out")


# ----------------------------------------------------------------------------- configs
def test_configs_instantiate_through_lightning_cli():
    paper = tiny_cli("--trainer.logger=false", config=CONFIGS / "bigbird_imdb.yaml")
    assert isinstance(paper.model, BigBirdClassifier) and isinstance(paper.datamodule, IMDBDataModule)
    h = paper.model.hparams
    assert (h.embed_dim, h.ffn_dim, h.num_layers, h.num_heads, h.dropout, h.max_length) == (128, 256, 2, 4, 0.1, 1024)
    assert (h.block_size, h.num_global_blocks, h.num_window_blocks, h.num_random_blocks) == (16, 2, 2, 2)
    assert h.lr == 1e-3 and paper.datamodule.batch_size == 64 and paper.datamodule.max_length == 1024
    assert all(isinstance(layer.attention, sparsenn.BlockSparseAttention) for layer in paper.model.layers)
    assert isinstance(paper.model.layers[0].ffn[1], nn.GELU)
    dense = tiny_cli("--trainer.logger=false", config=CONFIGS / "bigbird_imdb_dense.yaml")
    assert all(isinstance(layer.attention, nn.MultiheadAttention) for layer in dense.model.layers)
    assert dense.model.state_dict().keys() == paper.model.state_dict().keys()
    tiny = tiny_cli()
    assert tiny.datamodule.data_dir == Path("models/data/imdb_tiny")
    assert (ROOT / tiny.datamodule.data_dir / "train.csv.gz").is_file()  # shipped: the tiny config runs anywhere


def test_bad_configs():
    with pytest.raises(ValueError, match="attention must be one of"):
        tiny_cli("--model.init_args.attention=flash")
    with pytest.raises(ValueError, match=r"embed_dim \(16\) must be divisible by num_heads \(3\)"):
        tiny_model(num_heads=3)
    with pytest.raises(ValueError, match="dropout must be a float in"):
        tiny_model(dropout=1.0)
    with pytest.raises(TypeError, match="num_layers must be an int"):
        tiny_model(num_layers=2.0)


# ----------------------------------------------------------------------------- training
def test_tiny_config_trains_with_a_decreasing_loss(fixture_dir, tmp_path):
    cli = tiny_cli(f"--data.init_args.data_dir={fixture_dir}", f"--trainer.default_root_dir={tmp_path}",
                   "--trainer.max_epochs=3")
    cli.datamodule.setup("fit")
    train = cli.datamodule.datasets["train"].tensors

    def train_loss() -> float:
        cli.model.eval()
        with torch.no_grad():
            return float(F.cross_entropy(cli.model(train[0], train[1]), train[2]))

    before = train_loss()
    cli.model.train()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 15  # 80 reviews in batches of 16, 3 epochs
    after = train_loss()
    assert after < before - 0.2, (before, after)
    assert cli.trainer.callback_metrics["val_acc"] > 0.75  # two classes; the sentiment words decide
    assert "train_loss" in cli.trainer.logged_metrics
    result = cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)[0]
    assert result["test_acc"] > 0.75
    logits = torch.cat(cli.trainer.predict(cli.model, datamodule=cli.datamodule))
    assert logits.shape == (32, 2)


def test_checkpoint_round_trip_predicts_bit_identically(fixture_dir, tmp_path):
    cli = tiny_cli(f"--data.init_args.data_dir={fixture_dir}", f"--trainer.default_root_dir={tmp_path}",
                   "--trainer.max_steps=2", "--trainer.limit_val_batches=0")
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli.trainer.save_checkpoint(tmp_path / "tiny.ckpt")
    loaded = BigBirdClassifier.load_from_checkpoint(tmp_path / "tiny.ckpt")
    ids, padding, _ = cli.datamodule.datasets["test"].tensors
    with torch.no_grad():
        assert torch.equal(cli.model.eval()(ids, padding), loaded.eval()(ids, padding))
    for mine, theirs in zip(cli.model.layers, loaded.layers):
        assert torch.equal(mine.attention.pattern(48).to_dense(), theirs.attention.pattern(48).to_dense())


def test_data_longer_than_the_positional_embeddings_is_rejected(fixture_dir, tmp_path):
    cli = tiny_cli(f"--data.init_args.data_dir={fixture_dir}", f"--trainer.default_root_dir={tmp_path}",
                   "--data.init_args.max_length=64")
    with pytest.raises(ValueError, match=r"the data's max_length \(64\) exceeds the model's max_length \(48\)"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli = tiny_cli(f"--data.init_args.data_dir={fixture_dir}", f"--trainer.default_root_dir={tmp_path}",
                   "--model.init_args.vocab_size=5")
    with pytest.raises(ValueError, match="vocabulary has .* ids but the model's vocab_size is 5"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)


def test_forward_rejects_bad_input():
    model = tiny_model().eval()
    ids, padding = random_batch()
    with pytest.raises(TypeError, match="token_ids must be a 2-D long tensor"):
        model(ids.int(), padding)
    with pytest.raises(TypeError, match="padding_mask must be a bool tensor"):
        model(ids, padding.long())
    with pytest.raises(ValueError, match="padding_mask has shape"):
        model(ids, padding[:, :-1])
    with pytest.raises(ValueError, match="exceed max_length=48"):
        model(torch.zeros(1, 49, dtype=torch.long), torch.zeros(1, 49, dtype=torch.bool))


# ----------------------------------------------------------------------------- attention variants
def test_sparse_attention_equals_dense_attention_under_the_same_mask():
    model = tiny_model()
    with torch.no_grad():  # trained-like weights: the embeddings' init is small
        model.token_embedding.weight.normal_()
    ids, padding = random_batch()
    variants = model.inference_variants()
    assert list(variants) == ["sparsenn", "dense attention, BigBird mask",
                              "dense attention, full (nn.MultiheadAttention)"]
    sparse, masked, full = (variant(ids, padding) for variant in variants.values())
    torch.testing.assert_close(sparse, masked, rtol=1e-5, atol=1e-5)
    assert (sparse - full).abs().max() > 1e-3  # BigBird's pattern really leaves keys out
    mask = model.layers[0].attention.attention_mask(48)
    assert 0.3 < mask.float().mean() < 0.8
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids, padding), sparse)
    twin = model.with_attention("masked dense")
    assert isinstance(twin.layers[0].attention, MaskedDenseAttention) and not twin.training
    with pytest.raises(ValueError, match="kind must be"):
        model.with_attention("flash")


def test_dense_model_shares_the_sparse_models_weights():
    sparse = tiny_model()
    dense = tiny_model(attention="dense")
    dense.load_state_dict(sparse.state_dict())
    ids, padding = random_batch()
    dense.eval()
    with torch.no_grad():
        own = dense(ids, padding)
    variants = dense.inference_variants()
    torch.testing.assert_close(variants["dense attention, full (nn.MultiheadAttention)"](ids, padding), own)
    expected = sparse.inference_variants()["sparsenn"](ids, padding)
    torch.testing.assert_close(variants["sparsenn"](ids, padding), expected)


def test_bench_protocol_with_a_longer_sequence(fixture_dir, tmp_path):
    cli = tiny_cli(f"--data.init_args.data_dir={fixture_dir}", "--data.init_args.max_length=96",
                   "--model.init_args.max_length=96")
    inputs, target = cli.model.bench_batch(cli.datamodule)
    token_ids, padding = inputs
    assert token_ids.shape == padding.shape == (16, 96) and target.shape == (16,)
    outputs = {name: variant(*inputs) for name, variant in cli.model.inference_variants().items()}
    assert all(out.shape == (16, 2) for out in outputs.values())
    torch.testing.assert_close(outputs["sparsenn"], outputs["dense attention, BigBird mask"], rtol=1e-5, atol=1e-5)
    name, value = cli.model.bench_metric(outputs["sparsenn"], target)
    assert name == "accuracy" and isinstance(value, float) and 0.0 <= value <= 1.0
    assert cli.model.bench_metric(torch.tensor([[0.0, 1.0], [2.0, 1.0]]), torch.tensor([1, 1])) == ("accuracy", 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 96 tokens: a sparse pattern, no dense fallback
        cli.model.inference_variants()["sparsenn"](*inputs)


def test_full_dense_attention_is_a_baseline_that_need_not_agree():
    from models.bench import BenchResult, BenchSettings, VariantResult

    assert BigBirdClassifier.bench_baselines(None) == {"dense attention, full (nn.MultiheadAttention)"}
    variants = (VariantResult("sparsenn", {1: 1.0}, 0.5, 0.0, True),
                VariantResult("dense attention, full (nn.MultiheadAttention)", {1: 9.0}, 0.5, 0.1, False, True))
    assert BenchResult("m", "x", "accuracy", BenchSettings(), variants, None).ok
    assert not BenchResult("m", "x", "accuracy", BenchSettings(), (variants[0], VariantResult(
        "dense attention, BigBird mask", {1: 3.0}, 0.5, 0.1, False)), None).ok
