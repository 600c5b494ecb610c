"""A byte-level language-modelling corpus that needs no download.

The text is the source of a few modules of Python's own standard library, so every machine that
runs sdcguard has it, byte for byte the same for a given Python version.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect

import numpy as np

_CORPUS_MODULES = ("argparse", "textwrap", "difflib", "json.decoder", "string", "heapq")
VOCAB_SIZE = 256


@functools.cache
def corpus_bytes() -> np.ndarray:
    """The corpus as a uint8 array (about 150 kB)."""
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in _CORPUS_MODULES)
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ByteBatches:
    """Deterministic batches of byte windows from the corpus.

    Batch ``i`` is the same on every machine: its window offsets come from ``seed`` and ``i``.

    Attributes:
      batch_size: sequences per batch.
      seq_len: tokens per sequence (the model sees ``seq_len`` inputs and predicts the next).
      seed: seed of the window offsets.
      switch_at: from this batch index on, every byte is mapped through a fixed permutation
        of the 256 byte values (the same text in another alphabet): a lasting change of the
        data's distribution, like a curriculum switch; None: never.
    """

    batch_size: int = 8
    seq_len: int = 64
    seed: int = 0
    switch_at: int | None = None

    def __post_init__(self):
        if self.batch_size < 1 or self.seq_len < 2:
            raise ValueError(
                f"ByteBatches needs batch_size >= 1 and seq_len >= 2, got "
                f"batch_size={self.batch_size}, seq_len={self.seq_len}"
            )

    def batch(self, index: int) -> np.ndarray:
        """Batch ``index`` as int32 ``[batch_size, seq_len + 1]`` (inputs and shifted targets)."""
        data = corpus_bytes()
        rng = np.random.default_rng([self.seed, index])
        starts = rng.integers(0, data.size - self.seq_len - 1, size=self.batch_size)
        windows = np.stack([data[s : s + self.seq_len + 1] for s in starts])
        if self.switch_at is not None and index >= self.switch_at:
            windows = np.random.default_rng([self.seed, 0x5717C4]).permutation(256)[windows]
        return windows.astype(np.int32)

    def __iter__(self):
        i = 0
        while True:
            yield self.batch(i)
            i += 1
