"""Small reference models and their data: the workload of tests, benchmarks, replay, campaigns."""

from sdcguard.models._data import (
    VOCAB_SIZE as VOCAB_SIZE,
    ByteBatches as ByteBatches,
    corpus_bytes as corpus_bytes,
)
from sdcguard.models._encoder import (
    Encoder as Encoder,
    mask_tokens as mask_tokens,
    mlm_loss as mlm_loss,
)
from sdcguard.models._gemma import (
    Gemma as Gemma,
    GemmaConfig as GemmaConfig,
    loss as gemma_loss,
    train_step as gemma_train_step,
)
from sdcguard.models._gpt import (
    GPT as GPT,
    MLP as MLP,
    GPTConfig as GPTConfig,
    init_params as init_params,
    lm_loss as lm_loss,
)

__all__ = [
    "GPT",
    "MLP",
    "VOCAB_SIZE",
    "ByteBatches",
    "Encoder",
    "GPTConfig",
    "Gemma",
    "GemmaConfig",
    "corpus_bytes",
    "gemma_loss",
    "gemma_train_step",
    "init_params",
    "lm_loss",
    "mask_tokens",
    "mlm_loss",
]
