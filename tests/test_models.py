"""The model registry: the study's models, their laptop flavors, seeded batches."""

from __future__ import annotations

import pytest
import torch

import models
from harness import config


def _model(name: str) -> tuple[str, dict]:
    cfg = config.load([f"model={name}"]).model
    return cfg.family, dict(cfg.build)


def test_resnet50_intensity_matches_the_study() -> None:
    info = models.describe(*_model("resnet50"))
    assert info["model_params"] == 25_557_032 and info["model_tensors"] == 161
    assert abs(info["model_intensity"] - 470) / 470 < 0.05, info


def test_bert_sizes_are_the_published_ones() -> None:
    base, large = models.describe(*_model("bert_base")), models.describe(*_model("bert_large"))
    assert 105e6 < base["model_params"] < 115e6  # BERT-Base: 110M
    assert 330e6 < large["model_params"] < 345e6  # BERT-Large: 340M (1.34 GB of fp32)
    assert large["model_tensors"] > base["model_tensors"]


def test_resnet50_small_has_the_same_tensors_as_resnet50() -> None:
    small = models.build(*_model("resnet50_small"), seed=0)
    full = models.build(*_model("resnet50"), seed=0)
    assert [p.shape for p in small.parameters()] == [p.shape for p in full.parameters()]


@pytest.mark.parametrize("name", ["resnet50_small", "bert_tiny"])
def test_laptop_flavors_train_on_seeded_batches(name: str) -> None:
    cfg = config.load([f"model={name}"]).model
    model = models.build(cfg.family, cfg.build, seed=3)
    again = models.build(cfg.family, cfg.build, seed=3)
    for a, b in zip(model.parameters(), again.parameters()):
        torch.testing.assert_close(a, b)
    batch = model.make_batch(cfg.local_batch_size, torch.Generator().manual_seed(1))
    same = model.make_batch(cfg.local_batch_size, torch.Generator().manual_seed(1))
    other = model.make_batch(cfg.local_batch_size, torch.Generator().manual_seed(2))
    key = next(iter(batch))
    assert torch.equal(batch[key], same[key]) and not torch.equal(batch[key], other[key])
    assert batch[key].shape[0] == cfg.local_batch_size
    loss = model(batch)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_unknown_family_names_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of: .*bert.*vision"):
        models.build("audio", {}, seed=0)
