"""Character-level language-modelling data from ``pydoc_data.topics`` (stdlib text, nothing to download)."""

from __future__ import annotations

from functools import cached_property
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


def load_pydoc_text(max_chars: int | None = None) -> str:
    """The documentation topics of the Python standard library, in a fixed order (~465 KB)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return text if max_chars is None else text[:max_chars]


class _Windows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` tokens: item ``i`` is ``(x, y)`` with ``y`` shifted by one."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharTextDataModule(L.LightningDataModule):
    """The first ``1 - val_fraction`` of the text for training, the rest for validation; one token per character.

    Args:
        block_size: tokens per sample (the model's context length).
        batch_size: samples per batch and process.
        val_fraction: share of the text held out for validation, in (0, 1).
        max_chars: use only the first ``max_chars`` characters (``None``: all of it).
        num_workers: data-loader worker processes.
    """

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        max_chars: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid: expected an integer >= 1")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} is invalid: expected an integer >= 1")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction} is invalid: expected a number in (0, 1)")
        if max_chars is not None and max_chars < 4 * (block_size + 1):
            raise ValueError(f"max_chars={max_chars} is invalid: expected None or >= 4 * (block_size + 1)")
        self.save_hyperparameters()
        self.block_size, self.batch_size, self.val_fraction = block_size, batch_size, val_fraction
        self.max_chars, self.num_workers = max_chars, num_workers
        self.train_set: _Windows | None = None
        self.val_set: _Windows | None = None

    @cached_property
    def text(self) -> str:
        return load_pydoc_text(self.max_chars)

    @cached_property
    def vocab(self) -> list[str]:
        """Every character of the whole text, sorted: the same on every rank and for every ``max_chars``."""
        return sorted(set(load_pydoc_text()))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def model_kwargs(self) -> dict[str, Any]:
        """The arguments a model needs from this data: ``vocab_size``."""
        return {"vocab_size": self.vocab_size}

    def encode(self, text: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.vocab)}
        return torch.tensor([index[c] for c in text], dtype=torch.long)

    def decode(self, tokens: torch.Tensor) -> str:
        return "".join(self.vocab[int(t)] for t in tokens)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        tokens = self.encode(self.text)
        split = int(len(tokens) * (1 - self.val_fraction))
        self.train_set = _Windows(tokens[:split], self.block_size)
        self.val_set = _Windows(tokens[split:], self.block_size)
        if len(self.val_set) == 0:
            raise ValueError(
                f"the validation split has {len(tokens) - split} characters, fewer than block_size + 1 ="
                f" {self.block_size + 1}: raise max_chars or val_fraction"
            )

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
