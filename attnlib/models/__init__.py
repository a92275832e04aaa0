"""Models: one decoder configured layer by layer, its loaders, and the other models of the book.

* :class:`DecoderConfig` and :class:`Decoder` (:mod:`~attnlib.models.config`, :mod:`~attnlib.models.decoder`):
  GPT-2 (chapter 12, where they are :data:`GPTConfig` and :data:`GPT`), the attention variants
  (chapter 13), Llama / Qwen3 / Mistral (chapter 16), mixed layer types (chapters 17, 18);
  their parts: :mod:`~attnlib.models.layers`;
* loaders from ``transformers``: :func:`from_hf_gpt2` (chapter 14), :func:`from_hf_llama`,
  :func:`from_hf_qwen3`, :func:`from_hf_mistral` (chapter 16), :func:`from_hf_diffllama`,
  :func:`from_hf_gemma3`, :func:`from_hf_gemma4`, :func:`from_hf_smollm3` (chapter 20), :func:`from_hf_qwen3_5`
  (chapter 21); the vision-language checkpoints of Gemma 3, Gemma 4 and Qwen3.5 load as their text decoder
  (:mod:`~attnlib.models.hf_vision_language`);
  :mod:`~attnlib.models.hf_llama4` and :mod:`~attnlib.models.hf_gpt_oss`: Llama 4's and gpt-oss's attention,
  layer by layer (chapter 20);
* :class:`Transformer`: the encoder–decoder of Vaswani et al. (chapter 10);
* :class:`TargetAttention`: DIN's target attention for recommenders (chapter 09).
"""
from attnlib.models.config import DecoderConfig, GPTConfig
from attnlib.models.decoder import GPT, Block, Decoder
from attnlib.models.din import TargetAttention
from attnlib.models.hf_diffllama import from_hf_diffllama
from attnlib.models.hf_gemma import from_hf_gemma3
from attnlib.models.hf_gemma4 import from_hf_gemma4
from attnlib.models.hf_gpt2 import from_hf_gpt2
from attnlib.models.hf_llama import from_hf_llama, from_hf_mistral, from_hf_qwen3, from_hf_smollm3
from attnlib.models.hf_qwen3_5 import from_hf_qwen3_5
from attnlib.models.transformer import DecoderLayer, EncoderLayer, Transformer

__all__ = [
    "GPT",
    "Block",
    "Decoder",
    "DecoderConfig",
    "DecoderLayer",
    "EncoderLayer",
    "GPTConfig",
    "TargetAttention",
    "Transformer",
    "from_hf_diffllama",
    "from_hf_gemma3",
    "from_hf_gemma4",
    "from_hf_gpt2",
    "from_hf_llama",
    "from_hf_mistral",
    "from_hf_qwen3",
    "from_hf_qwen3_5",
    "from_hf_smollm3",
]
