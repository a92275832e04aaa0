"""Vision-language checkpoints read as their language model: Qwen3.5, Gemma 3 and Gemma 4 as they are published.

``Qwen3_5ForConditionalGeneration``, ``Gemma3ForConditionalGeneration`` and ``Gemma4ForConditionalGeneration``
hold a text decoder under ``model.language_model.`` beside their vision (and audio) towers, and a config whose
``text_config`` describes that decoder. On token ids alone the decoder is the family's ``...ForCausalLM``
(chapters 20, 21): its loader reads the ``text_config`` (:func:`text_config_of`) and the decoder's weights under
the text model's names (:func:`language_model_weights`); the towers are not built.

Transformers ties such a model's output head to its embedding by the outer config's ``tie_word_embeddings``,
not by the ``text_config``'s: :func:`text_config_of` carries the outer flag into the text config it returns.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping

from attnlib.models.hf_llama import _flag, config_getter

__all__ = ["language_model_weights", "text_config_of"]

#: Where a vision-language model keeps its text decoder.
INNER = "model.language_model."


def text_config_of(hf_config, vision_language_type: str):
    """``hf_config``'s ``text_config``, tied as the whole model is, if ``hf_config`` is of ``vision_language_type``
    (``"qwen3_5"``, ``"gemma3"``, ``"gemma4"``); any other config (or dict) as it is.

    A dict's ``text_config`` comes back a dict, a config's a copy of its text config object.

    Raises:
        TypeError: a ``text_config`` neither a config nor a dict.
        ValueError: a vision-language config without a ``text_config``; a ``tie_word_embeddings`` that is not a
            bool (named).
    """
    get = config_getter(hf_config)
    if get("model_type", None) != vision_language_type:
        return hf_config
    text = get("text_config", None)
    if text is None:
        raise ValueError(f"model_type={vision_language_type!r} (vision-language) config without a text_config")
    if not isinstance(text, Mapping) and not hasattr(text, "__dict__"):
        raise TypeError(f"text_config must be a transformers config or its dict; got {type(text).__name__}")
    tied = _flag(get, "tie_word_embeddings")
    if isinstance(text, Mapping):
        return {**text, "tie_word_embeddings": tied}
    text = copy.deepcopy(text)
    text.tie_word_embeddings = tied
    return text


def language_model_weights(state: dict, family: str) -> tuple[dict, str]:
    """A vision-language state dict's text decoder under the text model's names (``model.language_model.*`` as
    ``model.*``), the rest of ``model.*`` (towers, projectors) left out, names outside ``model.`` (``lm_head``)
    kept; and what weight-name errors call the model (``family``, saying how names were read). A text
    checkpoint's state dict comes back as it is."""
    if not any(k.startswith(INNER) for k in state):
        return state, family
    text = {("model." + k[len(INNER):] if k.startswith(INNER) else k): v
            for k, v in state.items() if k.startswith(INNER) or not k.startswith("model.")}
    return text, f"{family} language ({INNER}* read as model.*)"
