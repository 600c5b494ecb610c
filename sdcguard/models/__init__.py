"""Small reference models and their data: the workload of tests, benchmarks, replay, campaigns."""

from sdcguard.models.data import VOCAB_SIZE, ByteBatches, corpus_bytes
from sdcguard.models.encoder import Encoder, mask_tokens, mlm_loss
from sdcguard.models.gemma import Gemma, GemmaConfig
from sdcguard.models.gpt import GPT, GPTConfig, init_params, lm_loss

__all__ = [
    "GPT",
    "VOCAB_SIZE",
    "ByteBatches",
    "Encoder",
    "GPTConfig",
    "Gemma",
    "GemmaConfig",
    "corpus_bytes",
    "init_params",
    "lm_loss",
    "mask_tokens",
    "mlm_loss",
]
