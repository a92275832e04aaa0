"""attnlib: the library of *Attention, from scratch*.

Each public class and function names the chapter that derives it; each chapter
builds the piece by hand and checks it equals the version here.
"""
from attnlib import attention, data, functional, generate, serving, tokenizers
from attnlib._device import device
from attnlib.attention import (
    ATTENTION_FUNCTIONS,
    ATTENTION_REGISTRY,
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    MultiHeadLatentAttention,
    SelfAttentionV1,
    SelfAttentionV2,
    TalkingHeadsAttention,
)
from attnlib.config import GPTConfig
from attnlib.gpt2 import from_hf_gpt2
from attnlib.hf_decoder import from_hf_llama, from_hf_mistral, from_hf_qwen3
from attnlib.kv_memory import kv_cache_bytes
from attnlib.model import GPT
from attnlib.modern import ModernConfig, ModernDecoder
from attnlib.norms import LayerNorm, RMSNorm
from attnlib.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    rope_frequencies,
)
from attnlib.transformer import DecoderLayer, EncoderLayer, FeedForward, Transformer

__version__ = "1.0.0"

__all__ = [
    "ATTENTION_FUNCTIONS",
    "ATTENTION_REGISTRY",
    "CausalAttention",
    "DecoderLayer",
    "EncoderLayer",
    "FeedForward",
    "GPT",
    "GPTConfig",
    "LayerNorm",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "ModernConfig",
    "ModernDecoder",
    "MultiHeadLatentAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SelfAttentionV1",
    "SelfAttentionV2",
    "SinusoidalPositionalEncoding",
    "TalkingHeadsAttention",
    "Transformer",
    "attention",
    "data",
    "device",
    "from_hf_gpt2",
    "from_hf_llama",
    "from_hf_mistral",
    "from_hf_qwen3",
    "functional",
    "generate",
    "kv_cache_bytes",
    "rope_frequencies",
    "serving",
    "tokenizers",
]
