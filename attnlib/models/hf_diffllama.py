"""Loading Hugging Face DiffLlama weights into an :class:`attnlib.Decoder`. Chapter 20.

``transformers``' ``DiffLlamaForCausalLM`` is a Llama whose attention is differential (Ye et al. 2024):
the same projections, norms and feed-forward (loaded by :func:`~attnlib.models.hf_llama.from_hf_llama`'s
mapping), plus four ``λ`` vectors per layer (``self_attn.lambda_q1``, ...) and ``λ_init`` from the layer's
index. Its heads split as :class:`~attnlib.attention.differential.DifferentialAttention`'s: no permutation.

Settings attnlib cannot reproduce are refused with a ``ValueError`` naming them.
"""
from __future__ import annotations

from collections.abc import Mapping

from attnlib.models.config import DecoderConfig
from attnlib.models.decoder import Decoder
from attnlib.models.hf_llama import check_weight_names, config_from_hf_decoder, from_hf_llama, hf_state_and_config

__all__ = ["config_from_hf_diffllama", "from_hf_diffllama"]

LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def _as_llama(hf_config) -> dict:
    """The DiffLlama config as a Llama config's dict (checked: the model type, what Llama lacks)."""
    if isinstance(hf_config, Mapping):
        fields = dict(hf_config)
    elif callable(getattr(hf_config, "to_dict", None)):
        fields = hf_config.to_dict()
    else:
        raise TypeError(f"hf_config must be a transformers DiffLlamaConfig or its dict; got {type(hf_config).__name__}")
    model_type = fields.get("model_type")
    if model_type is not None and model_type != "diffllama":
        raise ValueError(f"this is a {model_type!r} config; from_hf_diffllama loads 'diffllama' models")
    dropout = fields.get("attention_dropout", 0.0)
    if dropout not in (0, 0.0, None):
        raise ValueError(f"cannot reproduce attention_dropout={dropout!r}: the paper defines no dropout of the "
                         "difference (transformers refuses it too)")
    for name in ("num_attention_heads", "num_key_value_heads"):
        value = fields.get(name)
        if isinstance(value, int) and value % 2:
            raise ValueError(f"cannot reproduce {name}={value}: differential attention pairs heads, it must be even")
    return {**fields, "model_type": "llama"}


def config_from_hf_diffllama(hf_config) -> DecoderConfig:
    """The :class:`~attnlib.DecoderConfig` of a ``transformers`` ``DiffLlamaConfig`` (or its dict):
    :func:`~attnlib.models.hf_llama.config_from_hf_decoder`'s Llama with ``attention="differential"``.

    Raises:
        TypeError: ``hf_config`` neither a mapping nor a config object.
        ValueError: another model type; ``attention_dropout > 0``; an odd ``num_attention_heads`` or
            ``num_key_value_heads``; what :func:`~attnlib.models.hf_llama.config_from_hf_decoder` refuses; named.
    """
    return config_from_hf_decoder(_as_llama(hf_config), "llama").replace(attention="differential")


def from_hf_diffllama(model_or_state_dict, config=None) -> Decoder:
    """An attnlib :class:`~attnlib.Decoder` (``attention="differential"``) equal to a ``DiffLlamaForCausalLM``.

    Args:
        model_or_state_dict: a ``DiffLlamaForCausalLM``, or its ``state_dict()`` (then ``config`` is needed).
        config: the ``DiffLlamaConfig`` (or its dict); default: the model's. Given with a model, it must
            describe the same model.

    Returns:
        a model in the weights' dtype whose ``forward(idx)`` gives the same logits (1e-5 in float32).

    Raises:
        TypeError: neither a model nor a mapping; a weight that is not a floating point tensor.
        ValueError: a setting attnlib cannot reproduce (:func:`config_from_hf_diffllama`); missing or unexpected
            weights, ``λ`` vectors included (named); a shape mismatch; an ``lm_head.weight`` that a tied config
            would drop; a ``config`` that contradicts the model's.
    """
    state, config = hf_state_and_config(model_or_state_dict, config, config_from_hf_diffllama)
    ours = Decoder(config_from_hf_diffllama(config))
    c = ours.config
    lambdas = {f"blocks.{i}.attn.{name}": f"model.layers.{i}.self_attn.{name}" for i in range(c.n_layers) for name in LAMBDAS}
    missing = sorted(theirs for theirs in lambdas.values() if theirs not in state)
    unexpected = sorted(k for k in state if k.rsplit(".", 1)[-1] in LAMBDAS and k not in lambdas.values())
    check_weight_names("diffllama", missing, unexpected)
    for theirs in lambdas.values():
        if state[theirs].shape != (c.head_dim,):
            raise ValueError(f"{theirs} has shape {tuple(state[theirs].shape)}; expected ({c.head_dim},)")
    # Everything else is a Llama's: its loader maps and checks it.
    llama = from_hf_llama({k: v for k, v in state.items() if k not in set(lambdas.values())}, _as_llama(config))
    ours.load_state_dict({**llama.state_dict(), **{mine: state[theirs] for mine, theirs in lambdas.items()}})
    return ours.to(state["model.embed_tokens.weight"].dtype)
