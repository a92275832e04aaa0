"""Where a token is: absolute tables added to the embeddings, and RoPE inside attention.

* :mod:`~attnlib.positional.absolute`: sinusoidal and learned position tables (chapter 10);
* :mod:`~attnlib.positional.rotary`: rotary position embedding, RoPE (chapters 10 and 16);
* :mod:`~attnlib.positional.scaling`: RoPE's frequencies and their scalings for longer contexts
  (linear, dynamic NTK, Llama 3, YaRN; chapter 17).

ALiBi, the other relative scheme, is a score modification: :func:`attnlib.attention.mods.alibi`.
"""
from attnlib.positional.absolute import LearnedPositionalEmbedding, SinusoidalPositionalEncoding, sinusoidal_encoding
from attnlib.positional.rotary import LeadingRotaryEmbedding, RotaryEmbedding, interleaved_to_half_split
from attnlib.positional.scaling import ROPE_TYPES, rope_frequencies

__all__ = [
    "ROPE_TYPES",
    "LeadingRotaryEmbedding",
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "interleaved_to_half_split",
    "rope_frequencies",
    "sinusoidal_encoding",
]
