"""`DecoderConfig`: every choice of a decoder-only language model, layer by layer, checked when it is made.

Chapter 12 introduces it field by field as the GPT's configuration (:data:`GPTConfig` is its name
there, and its defaults are GPT-2's layout); chapter 13 varies the attention; chapter 16 turns it into
a Llama / Qwen3 / Mistral decoder (:meth:`DecoderConfig.llama`, ...); chapters 17 and 18 mix layer
types with ``layer_types`` (transformers' strings, one per layer). Derived sizes are resolved once,
in :meth:`DecoderConfig.__post_init__`, under the field's own name (gpt-fast's ``ModelArgs``):
``head_dim`` given stays as given; not given, it *is* ``d_model // n_heads`` afterwards.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from attnlib._checks import divisible
from attnlib.models.config_checks import (
    ATTENTION_VARIANTS,
    FEEDFORWARD_KINDS,
    LAYER_TYPES,
    LINEAR_LAYERS,
    NORM_PLACEMENTS,
    NORMS,
    POSITIONS,
    check_combinations,
    check_fields,
)

__all__ = ["ATTENTION_VARIANTS", "FEEDFORWARD_KINDS", "LAYER_TYPES", "LINEAR_LAYERS", "NORMS", "NORM_PLACEMENTS", "POSITIONS",
           "DecoderConfig", "GPTConfig"]

#: The fields resolved when not given, each to the value in use (see the module docstring).
DERIVED = ("n_kv_heads", "head_dim", "kv_latent_dim", "layer_types", "d_ff", "attention_bias", "mlp_bias", "attn_fn")


@dataclass(frozen=True)
class DecoderConfig:
    """Hyperparameters of :class:`attnlib.Decoder` (chapter 12 onwards). Frozen: change one with :meth:`replace`.

    The defaults are GPT-2's layout at the book's small size. Fields marked *derived* are resolved
    once when not given (``None``), to the value in use; :meth:`replace` (and ``dataclasses.replace``)
    derives them again from the new fields unless they were given.

    Attributes:
        vocab_size: number of token ids.
        block_size: the longest sequence (positions) the model sees.
        n_layers: number of blocks. n_heads: query heads per attention layer.
        d_model: width of the residual stream.
        n_kv_heads: key/value heads (*derived*: ``n_heads``; 1 for ``"mqa"``). Given for ``"mha"``/``"mqa"``
            it must agree; refused for ``"talking_heads"`` and ``"mla"``.
        head_dim: width of a head (*derived*: ``d_model // n_heads``; Qwen3 sets it apart).
        attention: the softmax layers' attention, one of :data:`ATTENTION_VARIANTS`.
        kv_latent_dim: MLA's latent width ``d_c`` (*derived* for ``"mla"``: ``max(1, d_model // 4)``; else None).
        layer_types: one of :data:`LAYER_TYPES` per layer (*derived*: every layer ``"sliding_attention"``
            with a ``sliding_window``, ``"chunked_attention"`` with an ``attention_chunk_size``, else
            ``"full_attention"``).
        sliding_window: the window ``w`` of sliding layers: a query sees itself and the ``w - 1`` before it.
        attention_chunk_size: the chunk of chunked layers (Llama 4).
        linear_layer: what a ``"linear_attention"`` layer is, one of :data:`LINEAR_LAYERS` (chapter 18).
        position: one of :data:`POSITIONS`.
        rope_base: RoPE's ``rope_theta``. rope_scaling: ``transformers``-format dict or None
            (:func:`attnlib.positional.rope_frequencies`).
        rope_local_base: the RoPE base of sliding layers (Gemma 3's ``rope_local_base_freq``); None: ``rope_base``.
        nope_layers: indices of layers without RoPE (SmolLM3, Llama 4's NoPE layers).
        norm: one of :data:`NORMS`; norm_eps its epsilon; norm_placement: one of :data:`NORM_PLACEMENTS`.
        qk_norm: an RMSNorm on each head's queries and keys (Qwen3).
        feedforward: ``"gelu"`` (GPT's MLP), ``"swiglu"`` (Llama), ``"geglu"`` (Gemma).
        d_ff: the feed-forward hidden width (*derived*: ``4 · d_model`` for GELU, ``8/3 · d_model`` rounded up
            to a multiple of 8 for the gated blocks).
        gelu_approximate: the GELU MLP's form, ``"none"`` or ``"tanh"`` (GPT-2's; GeGLU always uses tanh).
        bias: biases in Linear layers and LayerNorms (nanoGPT's switch).
        attention_bias, mlp_bias: biases on the attention's and the MLP's projections (*derived*: ``bias``).
        tie_embeddings: the output head shares the token embedding's weight.
        dropout: on attention weights, residual branches and embeddings, in [0, 1).
        attn_fn: the attention function's name (*derived*: ``"sdpa"``, or ``"eager"`` when scores are
            modified by ALiBi or soft-capping, which SDPA cannot do).
        attn_softcap: None or Gemma 2's cap on attention scores, ``cap · tanh(s / cap)``.
        attention_scale: the factor on ``q · k`` (None: ``1/√head_dim``; Gemma 3: ``query_pre_attn_scalar**-0.5``,
            Gemma 4: 1, its queries and keys being RMS-normalised). Chapter 20.
        scale_embeddings: multiply the token embeddings by ``√d_model`` (rounded to their dtype; Gemma).
        logit_softcap: None or the cap on the output logits, ``cap · tanh(z / cap)`` (Gemma 2's
            ``final_logit_softcapping``).
        attention_sinks: a learned sink logit per head in every softmax layer's denominator (gpt-oss; chapter 20;
            not StreamingLLM's sink tokens); the derived ``attn_fn`` is then ``"eager"`` (SDPA cannot add it).
        qk_norm_type: with ``qk_norm``, one of :data:`~attnlib.attention.temperature.QK_NORMS`: ``"rmsnorm"``
            (a learned weight, on every softmax layer: Qwen3) or ``"l2"`` (no weight, on the RoPE layers only:
            Llama 4's ``use_qk_norm``). Chapter 20.
        attn_temperature_tuning: Llama 4's temperature tuning on the layers without RoPE (``nope_layers``, or every
            layer with ``position="nope"``): the query at position ``p`` is multiplied by
            ``log(floor((p + 1) / floor_scale) + 1) · attn_scale + 1``. floor_scale (> 0), attn_scale (>= 0): its
            two numbers (Llama 4's 8192 and 0.1), other values only with ``attn_temperature_tuning``.
        num_kv_shared_layers: the last ``num_kv_shared_layers`` layers compute no keys or values: each attends
            with those of the last earlier layer of its type, and has no cache of its own (cross-layer KV
            sharing, Gemma 4; :meth:`kv_source`). Chapter 20.
        global_head_dim: the head width of the ``"full_attention"`` layers (Gemma 4's ``global_head_dim``);
            None: ``head_dim``. global_n_kv_heads: their key/value heads (``num_global_key_value_heads``); None:
            ``n_kv_heads``. See :meth:`head_dim_of`, :meth:`n_kv_heads_of`.
        global_partial_rotary_factor: None, or the share of a full-attention head's pairs that RoPE turns, the
            others left unrotated, frequencies as over the whole head (Gemma 4's ``"proportional"`` RoPE).
        attention_k_eq_v: full-attention layers take their values from the key projection, before the key's
            norm and RoPE (no value projection; transformers' ``attention_k_eq_v``).
        value_norm: an RMSNorm without scale over each value head (Gemma 4's ``v_norm``).
        d_per_layer_input: None, or the width of the per-layer inputs each layer adds to its output (Gemma 4's
            ``hidden_size_per_layer_input``): a second token embedding of ``n_layers · d_per_layer_input`` and a
            projection of the embeddings, one slice per layer, gated into the residual stream.
        layer_scalar: each layer's output multiplied by a stored scalar (a buffer, 1 until loaded; Gemma 4).
        partial_rotary_factor: None, or the share of each head that RoPE turns on every RoPE layer: its leading
            ``int(factor · head_dim)`` numbers, at the frequencies of that width
            (:class:`~attnlib.positional.LeadingRotaryEmbedding`; Qwen3-Next, Qwen3.5; chapter 21).
        attn_output_gate: every softmax layer's heads multiplied by ``σ(x W_g)``, one gate per head and channel,
            before the output projection (:class:`~attnlib.attention.sparse.GatedAttention`; Qwen3-Next, Qwen3.5).
        linear_conv_kernel_dim: None (chapter 18's gated DeltaNet), or the kernel of the short causal convolution
            over q, k, v of the ``"linear_attention"`` layers (Qwen3-Next's and Qwen3.5's layer, which also takes
            its gated norm's epsilon from ``norm_eps`` and L2-normalises as fla does; chapter 21).
        linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim: the gated
            DeltaNet layers' own head counts and widths (None: ``n_heads``, ``n_heads``, ``d_model // n_heads``
            twice); value heads a multiple of key heads (:class:`~attnlib.attention.GatedDeltaNet`).

    Raises:
        TypeError / ValueError: a size that is not a positive int, a name that is not one of its choices,
            sizes that do not divide, a setting that contradicts another (a window no layer uses, RoPE
            settings without RoPE, ...), a number out of range; the message names the field and value.
    """

    vocab_size: int = 65
    block_size: int = 32
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 64
    n_kv_heads: int | None = None
    head_dim: int | None = None
    attention: str = "mha"
    kv_latent_dim: int | None = None
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    linear_layer: str = "gated_deltanet"
    position: str = "learned"
    rope_base: float = 10000.0
    rope_scaling: dict | None = None
    rope_local_base: float | None = None
    nope_layers: tuple[int, ...] = ()
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_placement: str = "pre"
    qk_norm: bool = False
    feedforward: str = "gelu"
    d_ff: int | None = None
    gelu_approximate: str = "none"
    bias: bool = True
    attention_bias: bool | None = None
    mlp_bias: bool | None = None
    tie_embeddings: bool = True
    dropout: float = 0.0
    attn_fn: str | None = None
    attn_softcap: float | None = None
    attention_scale: float | None = None
    scale_embeddings: bool = False
    logit_softcap: float | None = None
    attention_sinks: bool = False
    qk_norm_type: str = "rmsnorm"
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    num_kv_shared_layers: int = 0
    global_head_dim: int | None = None
    global_n_kv_heads: int | None = None
    global_partial_rotary_factor: float | None = None
    attention_k_eq_v: bool = False
    value_norm: bool = False
    d_per_layer_input: int | None = None
    layer_scalar: bool = False
    partial_rotary_factor: float | None = None
    attn_output_gate: bool = False
    linear_conv_kernel_dim: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    _derived: dict | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = {}
        for name in DERIVED:  # a derived value carried over by replace() is derived again
            value = getattr(self, name)
            derived_before = (self._derived or {}).get(name, object())
            given[name] = value is not None and not (name in (self._derived or {}) and value == derived_before)
            if not given[name]:
                object.__setattr__(self, name, None)
        check_fields(self)
        derived = {name: self._derive(name) for name in DERIVED if not given[name]}
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_derived", derived)
        check_combinations(self)

    # ---------------------------------------------------------------- resolution

    def _derive(self, name: str):
        if name == "n_kv_heads":
            return 1 if self.attention == "mqa" else self.n_heads
        if name == "head_dim":
            divisible("d_model", self.d_model, "n_heads", self.n_heads)
            return self.d_model // self.n_heads
        if name == "kv_latent_dim":
            return max(1, self.d_model // 4) if self.attention == "mla" else None
        if name == "layer_types":
            kind = ("sliding_attention" if self.sliding_window is not None else
                    "chunked_attention" if self.attention_chunk_size is not None else "full_attention")
            return (kind,) * self.n_layers
        if name == "d_ff":
            return 4 * self.d_model if self.feedforward == "gelu" else 8 * math.ceil(8 * self.d_model / 3 / 8)
        if name in ("attention_bias", "mlp_bias"):
            return self.bias
        return "eager" if self.score_mods() or self.attention_sinks else "sdpa"  # attn_fn

    # ---------------------------------------------------------------- use

    def score_mods(self) -> list[str]:
        """Which score modifications the softmax layers apply: ``"alibi"`` and/or ``"softcap"``."""
        return (["alibi"] if self.position == "alibi" else []) + (["softcap"] if self.attn_softcap is not None else [])

    def uses_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates its queries and keys (RoPE, not a NoPE or linear layer)."""
        return self.position == "rope" and layer not in self.nope_layers and self.layer_types[layer] != "linear_attention"

    def head_dim_of(self, layer: int) -> int:
        """Layer ``layer``'s head width: ``global_head_dim`` on a full-attention layer when given, else ``head_dim``."""
        wide = self.layer_types[layer] == "full_attention" and self.global_head_dim is not None
        return self.global_head_dim if wide else self.head_dim

    def n_kv_heads_of(self, layer: int) -> int:
        """Layer ``layer``'s key/value heads: ``global_n_kv_heads`` on a full-attention layer when given."""
        wide = self.layer_types[layer] == "full_attention" and self.global_n_kv_heads is not None
        return self.global_n_kv_heads if wide else self.n_kv_heads

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values layer ``layer`` attends with: the last layer of its type before the
        ``num_kv_shared_layers`` shared ones (transformers' ``kv_sharing_modes``), or None (its own)."""
        first = self.n_layers - self.num_kv_shared_layers
        if layer < first:
            return None
        return max(i for i in range(first) if self.layer_types[i] == self.layer_types[layer])

    def replace(self, **changes) -> DecoderConfig:
        """A copy with ``changes``, checked again; derived fields are derived again unless given."""
        return dataclasses.replace(self, **changes)

    def to_dict(self, derived: bool = True) -> dict:
        """The fields and their values in use (for results files): ``dataclasses.asdict`` without private state.

        ``derived=False``: the fields as given, the derived ones ``None``, so that ``DecoderConfig(**d)``
        rebuilds this config and derives them again on :meth:`replace` (what a checkpoint stores).
        """
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
        return fields if derived else {k: None if k in self._derived else v for k, v in fields.items()}

    # ---------------------------------------------------------------- presets

    @classmethod
    def gpt2(cls, size: str = "small", **overrides) -> DecoderConfig:
        """The sizes of OpenAI's GPT-2 (Radford et al. 2019): ``"small"`` (124M), ``"medium"``, ``"large"``, ``"xl"``.

        Vocabulary 50,257, context 1,024, biases, the tanh GELU; chapter 14. ``overrides``
        replace any field (e.g. ``n_layers=2`` for a quick test).

        Raises:
            ValueError: an unknown size.
        """
        sizes = {
            "small": dict(n_layers=12, n_heads=12, d_model=768),
            "medium": dict(n_layers=24, n_heads=16, d_model=1024),
            "large": dict(n_layers=36, n_heads=20, d_model=1280),
            "xl": dict(n_layers=48, n_heads=25, d_model=1600),
        }
        if size not in sizes:
            raise ValueError(f"size={size!r} is not one of {list(sizes)}")
        fields = dict(vocab_size=50257, block_size=1024, bias=True, dropout=0.0, gelu_approximate="tanh")
        return cls(**{**fields, **sizes[size], **overrides})

    @classmethod
    def llama(cls, **fields) -> DecoderConfig:
        """A Llama-style decoder (chapter 16): RoPE, RMSNorm (eps 1e-5), SwiGLU, grouped-query attention, no
        biases, an untied output head. ``fields`` set the sizes and replace any choice."""
        modern = dict(attention="gqa", position="rope", norm="rmsnorm", norm_eps=1e-5, feedforward="swiglu",
                      bias=False, tie_embeddings=False)
        return cls(**{**modern, **fields})

    @classmethod
    def qwen3(cls, **fields) -> DecoderConfig:
        """A Qwen3-style decoder: :meth:`llama` with QK-norm and RMSNorm's eps 1e-6."""
        return cls.llama(**{"qk_norm": True, "norm_eps": 1e-6, **fields})

    @classmethod
    def mistral(cls, sliding_window: int, **fields) -> DecoderConfig:
        """A Mistral-style decoder: :meth:`llama` with a sliding window on every layer (chapter 17)."""
        return cls.llama(**{"sliding_window": sliding_window, **fields})

    @classmethod
    def gemma3(cls, sliding_window: int, **fields) -> DecoderConfig:
        """A Gemma-3-style decoder (chapter 20): :meth:`llama` with five sliding-window layers to one global layer
        (layers 6, 12, ... global), the sliding layers' RoPE base 10,000 and the global layers' 1,000,000, pre- and
        post-norms around attention and feed-forward ("sandwich"), QK-norm, GeGLU, the embedding scaled by
        √d_model, a tied output head, RMSNorm's eps 1e-6. ``fields`` set the sizes and replace any choice."""
        n_layers = fields.get("n_layers", cls.n_layers)
        types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers))
        gemma = dict(sliding_window=sliding_window, layer_types=types, rope_base=1_000_000.0, rope_local_base=10_000.0,
                     norm_placement="sandwich", qk_norm=True, feedforward="geglu", scale_embeddings=True,
                     tie_embeddings=True, norm_eps=1e-6)
        return cls.llama(**{**gemma, **fields})


#: Chapter 12's name for the configuration: a :class:`DecoderConfig` (whose defaults are the GPT's).
GPTConfig = DecoderConfig
