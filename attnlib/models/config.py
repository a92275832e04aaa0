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
from collections.abc import Mapping
from dataclasses import dataclass, field

from attnlib._checks import divisible, finite_number, positive_int, probability
from attnlib.attention.registry import ATTENTION_FUNCTIONS
from attnlib.positional.rotary import RotaryEmbedding

__all__ = ["ATTENTION_VARIANTS", "FEEDFORWARD_KINDS", "LAYER_TYPES", "LINEAR_LAYERS", "NORMS", "POSITIONS",
           "DecoderConfig", "GPTConfig"]

#: The attention of a decoder's softmax layers (chapter 13): MHA, GQA and MQA are one layer with
#: ``n_kv_heads`` = ``n_heads``, given, 1; talking heads (chapter 05); latent attention (chapter 07).
ATTENTION_VARIANTS = ("mha", "talking_heads", "mqa", "gqa", "mla")
#: ``layer_types`` entries: transformers' strings. Full causal attention; a sliding window
#: (``sliding_window``); attention within chunks (``attention_chunk_size``, Llama 4); a linear layer
#: (``linear_layer``: gated DeltaNet, as Qwen3-Next's ``"linear_attention"``, or linear attention).
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")
#: How positions enter: learned table (GPT-2), RoPE, ALiBi, none (NoPE). Chapters 10, 16, 17.
POSITIONS = ("learned", "rope", "alibi", "nope")
NORMS = ("layernorm", "rmsnorm")
#: ``"pre"``: ``x + f(norm(x))``; ``"sandwich"``: ``x + norm(f(norm(x)))`` (Gemma 2 and 3).
NORM_PLACEMENTS = ("pre", "sandwich")
FEEDFORWARD_KINDS = ("gelu", "swiglu", "geglu")
LINEAR_LAYERS = ("gated_deltanet", "linear")
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
    _derived: dict | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = {}
        for name in DERIVED:  # a derived value carried over by replace() is derived again
            value = getattr(self, name)
            derived_before = (self._derived or {}).get(name, object())
            given[name] = value is not None and not (name in (self._derived or {}) and value == derived_before)
            if not given[name]:
                object.__setattr__(self, name, None)
        self._check_fields()
        derived = {name: self._derive(name) for name in DERIVED if not given[name]}
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_derived", derived)
        self._check_combinations()

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
        return "eager" if self.score_mods() else "sdpa"  # attn_fn

    def _check_fields(self) -> None:
        for name in ("vocab_size", "block_size", "n_layers", "n_heads", "d_model"):
            positive_int(name, getattr(self, name))
        for name in ("n_kv_heads", "head_dim", "kv_latent_dim", "sliding_window", "attention_chunk_size", "d_ff"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        choices = {"attention": ATTENTION_VARIANTS, "linear_layer": LINEAR_LAYERS, "position": POSITIONS,
                   "norm": NORMS, "norm_placement": NORM_PLACEMENTS, "feedforward": FEEDFORWARD_KINDS,
                   "gelu_approximate": ("none", "tanh")}
        for name, options in choices.items():
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in options:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {options}")
        for name in ("qk_norm", "bias", "attention_bias", "mlp_bias", "tie_embeddings"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool; got {getattr(self, name)!r}")
        probability("dropout", self.dropout)
        if finite_number("norm_eps", self.norm_eps) <= 0:
            raise ValueError(f"norm_eps={self.norm_eps!r} must be > 0 (it keeps the norm's division away from 0)")
        for name in ("rope_base", "rope_local_base"):
            if getattr(self, name) is not None:
                finite_number(name, getattr(self, name), above=1)
        if self.attn_softcap is not None and finite_number("attn_softcap", self.attn_softcap) <= 0:
            raise ValueError(f"attn_softcap must be a finite number > 0, got {self.attn_softcap!r}")
        if self.layer_types is not None:
            if isinstance(self.layer_types, str) or not hasattr(self.layer_types, "__iter__"):
                raise TypeError(f"layer_types must be a list of {LAYER_TYPES}, one per layer; got {self.layer_types!r}")
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if bad or len(self.layer_types) != self.n_layers:
                raise ValueError(f"layer_types must give one of {LAYER_TYPES} for each of the n_layers={self.n_layers} "
                                 f"layers; got {list(self.layer_types)}")
        if isinstance(self.nope_layers, (str, bytes)) or not hasattr(self.nope_layers, "__iter__"):
            raise TypeError(f"nope_layers must be a list of layer indices; got {self.nope_layers!r}")
        object.__setattr__(self, "nope_layers", tuple(self.nope_layers))
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers for i in self.nope_layers) \
                or len(set(self.nope_layers)) != len(self.nope_layers):
            raise ValueError(f"nope_layers must be distinct layer indices in [0, {self.n_layers}); got {list(self.nope_layers)}")
        if isinstance(self.rope_scaling, Mapping):  # a copy: later edits of the caller's dict cannot reach it
            object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))

    def _check_combinations(self) -> None:
        expected = {"mha": self.n_heads, "mqa": 1}.get(self.attention)
        if "n_kv_heads" not in self._derived:
            if self.attention in ("talking_heads", "mla"):
                raise ValueError(f"n_kv_heads={self.n_kv_heads} does not apply to attention={self.attention!r}; leave it None")
            if expected is not None and self.n_kv_heads != expected:
                raise ValueError(f"n_kv_heads={self.n_kv_heads} contradicts attention={self.attention!r}, which has "
                                 f"{expected} key/value head(s); use attention='gqa' for another number")
        divisible("n_heads", self.n_heads, "n_kv_heads", self.n_kv_heads)
        if self.kv_latent_dim is not None and self.attention != "mla":
            raise ValueError(f"kv_latent_dim={self.kv_latent_dim} applies to attention='mla' only; got {self.attention!r}")
        for kind, size, name in (("sliding_attention", self.sliding_window, "sliding_window"),
                                 ("chunked_attention", self.attention_chunk_size, "attention_chunk_size")):
            used = kind in self.layer_types
            if used != (size is not None):
                raise ValueError(f"{name}={size!r} but layer_types has {'a' if used else 'no'} {kind!r} layer; "
                                 f"give both or neither")
        rope_only = {"rope_scaling": self.rope_scaling, "rope_local_base": self.rope_local_base,
                     "nope_layers": self.nope_layers or None}
        for name, value in rope_only.items():
            if value is not None and self.position != "rope":
                raise ValueError(f"{name}={value!r} is given but position={self.position!r} does not use RoPE")
        if self.rope_local_base is not None and "sliding_attention" not in self.layer_types:
            raise ValueError(f"rope_local_base={self.rope_local_base} is for sliding layers; layer_types has none")
        if self.attention == "mla" and (self.position == "rope" or self.qk_norm):
            raise ValueError("attention='mla' takes neither RoPE (DeepSeek-V2's decoupled RoPE key is not built "
                             "here) nor qk_norm; use position='learned', 'alibi' or 'nope'")
        if self.attention in ("talking_heads", "mla") and self.head_dim * self.n_heads != self.d_model:
            raise ValueError(f"head_dim={self.head_dim} with n_heads={self.n_heads} must make d_model={self.d_model} "
                             f"for attention={self.attention!r}")
        if self.attention == "talking_heads" and self.score_mods():
            raise ValueError("attention='talking_heads' mixes raw scores itself: it takes no ALiBi or attn_softcap")
        if self.attn_fn not in ATTENTION_FUNCTIONS:
            raise ValueError(f"attn_fn={self.attn_fn!r} is not one of {sorted(ATTENTION_FUNCTIONS)}")
        if self.dropout and self.attn_fn in ("tiled", "flash"):
            raise ValueError(f"dropout={self.dropout} needs attn_fn='eager' or 'sdpa' ({self.attn_fn!r} has no dropout)")
        if self.score_mods() and self.attn_fn in ("sdpa", "flash"):
            raise ValueError(f"attn_fn={self.attn_fn!r} cannot modify scores (ALiBi / attn_softcap): use 'eager' or 'tiled'")
        if self.position == "rope":
            for base in {self.rope_base, self.rope_local_base or self.rope_base}:
                RotaryEmbedding(self.head_dim, base, self.rope_scaling, self.block_size)  # checks RoPE's settings

    # ---------------------------------------------------------------- use

    def score_mods(self) -> list[str]:
        """Which score modifications the softmax layers apply: ``"alibi"`` and/or ``"softcap"``."""
        return (["alibi"] if self.position == "alibi" else []) + (["softcap"] if self.attn_softcap is not None else [])

    def uses_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates its queries and keys (RoPE, not a NoPE or linear layer)."""
        return self.position == "rope" and layer not in self.nope_layers and self.layer_types[layer] != "linear_attention"

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


#: Chapter 12's name for the configuration: a :class:`DecoderConfig` (whose defaults are the GPT's).
GPTConfig = DecoderConfig
