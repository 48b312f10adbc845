"""BERT family: BertForPreTraining (MLM + NSP) from a BertConfig, random weights."""

from __future__ import annotations

import torch
from torch import nn

from models.synthetic import Batch, token_batch


class BertModel(nn.Module):
    """BERT pre-training whose forward returns the MLM + NSP loss of a batch."""

    def __init__(
        self, *, hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int,
        seq_len: int, vocab_size: int = 30522, dropout: float = 0.1,
    ) -> None:
        from transformers import BertConfig, BertForPreTraining  # seconds to import: on use

        super().__init__()
        config = BertConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
            num_attention_heads=num_heads, intermediate_size=intermediate_size,
            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
            max_position_embeddings=max(512, seq_len),
        )
        self.net = BertForPreTraining(config)
        self.seq_len = seq_len
        self.vocab_size = vocab_size

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.net(**batch).loss

    def make_batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        return token_batch(batch_size, self.seq_len, self.vocab_size, generator)
