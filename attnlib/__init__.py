"""attnlib: the library of *Attention, from scratch*.

Each public class and function names the chapter that derives it; each chapter
builds the piece by hand and checks it equals the version here.
"""
from attnlib import attention, data, functional, generate, tokenizers
from attnlib._device import device
from attnlib.attention import (
    ATTENTION_REGISTRY,
    CausalAttention,
    CausalSelfAttention,
    GroupedQueryAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    MultiHeadLatentAttention,
    MultiQueryAttention,
    SelfAttentionV1,
    SelfAttentionV2,
    TalkingHeadsAttention,
)
from attnlib.config import GPTConfig
from attnlib.model import GPT

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_REGISTRY",
    "CausalAttention",
    "CausalSelfAttention",
    "GPT",
    "GPTConfig",
    "GroupedQueryAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadLatentAttention",
    "MultiQueryAttention",
    "SelfAttentionV1",
    "SelfAttentionV2",
    "TalkingHeadsAttention",
    "attention",
    "data",
    "device",
    "functional",
    "generate",
    "tokenizers",
]
