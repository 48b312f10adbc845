"""Seeded synthetic batches, as the study used: no data set is read."""

from __future__ import annotations

import torch

Batch = dict[str, torch.Tensor]


def image_batch(batch_size: int, image_size: int, num_classes: int, gen: torch.Generator) -> Batch:
    """Normal random images and uniform labels."""
    return {
        "images": torch.randn(batch_size, 3, image_size, image_size, generator=gen),
        "labels": torch.randint(0, num_classes, (batch_size,), generator=gen),
    }


def token_batch(batch_size: int, seq_len: int, vocab_size: int, gen: torch.Generator) -> Batch:
    """Random unpadded sentence pairs (no attention mask needed), ~15% MLM targets, NSP labels."""
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    masked = torch.rand(batch_size, seq_len, generator=gen) < 0.15
    masked[:, 0] = True  # at least one MLM target per sentence
    return {
        "input_ids": ids,
        "token_type_ids": (torch.arange(seq_len) >= seq_len // 2).long().expand(batch_size, -1),
        "labels": torch.where(masked, ids, torch.full_like(ids, -100)),
        "next_sentence_label": torch.randint(0, 2, (batch_size,), generator=gen),
    }
