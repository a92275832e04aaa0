"""attnlib: the library of *Attention, from scratch*.

Each public class and function names the chapter that derives it; each chapter builds the piece
by hand and checks it equals the version here. The packages, in the order a token meets them:

* :mod:`attnlib.tokenizers`: text to token ids (chapter 11);
* :mod:`attnlib.positional`: where a token is (chapters 10, 16, 17);
* :mod:`attnlib.attention`: attention functions, masks and layers (chapters 01–09, 15, 17, 18);
* :mod:`attnlib.layers`: the norms and feed-forward blocks around attention (chapters 10, 16);
* :mod:`attnlib.models`: the decoder built from them, its loaders, the encoder–decoder (chapters 10, 12–14, 16–20);
* :mod:`attnlib.cache`: what each layer keeps from past tokens (chapters 08, 17–19);
* :mod:`attnlib.generation`: the decoding step and the loops that drive it (chapters 08, 12, 19);
* :mod:`attnlib.serving`: batches of requests (chapter 19).

Training and data: :mod:`attnlib.train`, :mod:`attnlib.data`, :mod:`attnlib.history`.
"""
from attnlib import attention, cache, data, generation, layers, models, positional, serving, tokenizers
from attnlib._device import device
from attnlib.attention import (
    ATTENTION_FUNCTIONS,
    CausalAttention,
    DifferentialAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    MultiHeadLatentAttention,
    SelfAttentionV1,
    SelfAttentionV2,
    TalkingHeadsAttention,
)
from attnlib.cache import KVCache, kv_cache_bytes
from attnlib.layers import FeedForward, LayerNorm, RMSNorm
from attnlib.models import (
    GPT,
    Decoder,
    DecoderConfig,
    DecoderLayer,
    EncoderLayer,
    GPTConfig,
    Transformer,
    from_hf_diffllama,
    from_hf_gemma3,
    from_hf_gemma4,
    from_hf_gpt2,
    from_hf_llama,
    from_hf_mistral,
    from_hf_qwen3,
    from_hf_qwen3_5,
    from_hf_smollm3,
)
from attnlib.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    rope_frequencies,
)

__version__ = "2.0.0"

__all__ = [
    "ATTENTION_FUNCTIONS",
    "CausalAttention",
    "Decoder",
    "DecoderConfig",
    "DecoderLayer",
    "DifferentialAttention",
    "EncoderLayer",
    "FeedForward",
    "GPT",
    "GPTConfig",
    "KVCache",
    "LayerNorm",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadLatentAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SelfAttentionV1",
    "SelfAttentionV2",
    "SinusoidalPositionalEncoding",
    "TalkingHeadsAttention",
    "Transformer",
    "attention",
    "cache",
    "data",
    "device",
    "from_hf_diffllama",
    "from_hf_gemma3",
    "from_hf_gemma4",
    "from_hf_gpt2",
    "from_hf_llama",
    "from_hf_mistral",
    "from_hf_qwen3",
    "from_hf_qwen3_5",
    "from_hf_smollm3",
    "generation",
    "kv_cache_bytes",
    "layers",
    "models",
    "positional",
    "rope_frequencies",
    "serving",
    "tokenizers",
]
