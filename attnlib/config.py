"""`GPTConfig`: the sizes of a decoder-only GPT, checked when it is made."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from attnlib._checks import divisible, positive_int, probability

__all__ = ["ATTENTION_VARIANTS", "GPTConfig"]

#: The attention variants a GPT can use (the keys of :data:`attnlib.attention.ATTENTION_REGISTRY`).
ATTENTION_VARIANTS = ("mha", "talking_heads", "mqa", "gqa", "mla")


@dataclass(frozen=True)
class GPTConfig:
    """Hyperparameters of :class:`attnlib.GPT` (chapter 12). Frozen: change one with :meth:`replace`.

    Attributes:
        vocab_size: number of token ids.
        block_size: longest context (positions) the model sees.
        n_layers: number of Transformer blocks.
        n_heads: query heads per attention layer.
        d_model: width of the residual stream; ``head_dim = d_model // n_heads``.
        n_kv_heads: key/value heads of grouped-query attention (``attention="gqa"``; default
            ``n_heads``). Given for another variant it must agree with it (``"mha"``: ``n_heads``;
            ``"mqa"``: 1), and it is refused for ``"talking_heads"`` and ``"mla"``. Kept as given
            (``None`` when not given); the value used is :attr:`kv_heads`.
        kv_latent_dim: width ``d_c`` of the latent that ``attention="mla"`` caches instead of
            keys and values (default ``d_model // 4``, as in the source notebook); refused for
            other variants. Kept as given; the value used is :attr:`latent_dim`.
        dropout: dropout probability on attention weights, residual branches and embeddings.
        bias: whether the Linear layers and LayerNorms carry a bias.
        attention: one of :data:`ATTENTION_VARIANTS` (``"mha"``, ...).
        gelu_approximate: the MLP's GELU, as ``torch.nn.GELU(approximate=...)``:
            ``"none"`` (exact) or ``"tanh"`` (GPT-2's form, needed to reproduce its weights).
        sliding_window: ``None`` (full causal attention) or ``w``: each position attends to itself
            and the ``w - 1`` before it (Mistral; chapter 17); the KV cache then keeps ``w``
            positions per layer (:class:`attnlib.cache.RingLayerCache`).

    Raises:
        TypeError: a size that is not an int, ``bias`` not a bool.
        ValueError: a non-positive size, ``d_model`` not divisible by ``n_heads``, ``n_heads`` not
            divisible by ``n_kv_heads``, a setting that contradicts the variant, ``dropout`` outside
            [0, 1), an unknown attention name or GELU form. The message names the value.
    """

    vocab_size: int = 65
    block_size: int = 32
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 64
    n_kv_heads: int | None = None
    kv_latent_dim: int | None = None
    dropout: float = 0.0
    bias: bool = True
    attention: str = "mha"
    gelu_approximate: str = "none"
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layers", "n_heads", "d_model"):
            positive_int(name, getattr(self, name))
        if self.attention not in ATTENTION_VARIANTS:
            raise ValueError(f"attention={self.attention!r} is not a known variant; choose one of: {', '.join(ATTENTION_VARIANTS)}")
        divisible("d_model", self.d_model, "n_heads", self.n_heads)
        if self.n_kv_heads is not None:
            positive_int("n_kv_heads", self.n_kv_heads)
            expected = {"mha": self.n_heads, "mqa": 1}.get(self.attention)
            if self.attention in ("talking_heads", "mla"):
                raise ValueError(f"n_kv_heads={self.n_kv_heads} does not apply to attention={self.attention!r}; leave it None")
            if expected is not None and self.n_kv_heads != expected:
                raise ValueError(
                    f"n_kv_heads={self.n_kv_heads} contradicts attention={self.attention!r}, which has {expected} "
                    f"key/value head(s); use attention='gqa' for another number"
                )
            divisible("n_heads", self.n_heads, "n_kv_heads", self.n_kv_heads)
        if self.kv_latent_dim is not None:
            positive_int("kv_latent_dim", self.kv_latent_dim)
            if self.attention != "mla":
                raise ValueError(f"kv_latent_dim={self.kv_latent_dim} applies to attention='mla' only; got {self.attention!r}")
        if self.sliding_window is not None:
            positive_int("sliding_window", self.sliding_window)
        probability("dropout", self.dropout)
        if not isinstance(self.bias, bool):
            raise TypeError(f"bias must be a bool; got {self.bias!r}")
        if self.gelu_approximate not in ("none", "tanh"):
            raise ValueError(f"gelu_approximate={self.gelu_approximate!r} must be 'none' or 'tanh'")

    @classmethod
    def gpt2(cls, size: str = "small", **overrides) -> GPTConfig:
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

    def replace(self, **changes) -> GPTConfig:
        """A copy with ``changes`` (validated anew). Fields not given stay as they were given: a defaulted
        ``n_kv_heads`` stays ``None`` and so follows a new ``n_heads``."""
        return dataclasses.replace(self, **changes)

    @property
    def head_dim(self) -> int:
        """Width of one head: ``d_model // n_heads``."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads the attention layers use: 1 for ``"mqa"``, ``n_kv_heads`` (default ``n_heads``) otherwise."""
        if self.attention == "mqa":
            return 1
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def latent_dim(self) -> int:
        """The MLA latent width used: ``kv_latent_dim``, default ``max(1, d_model // 4)``."""
        return max(1, self.d_model // 4) if self.kv_latent_dim is None else self.kv_latent_dim
