"""`GPTConfig`: the sizes of a decoder-only GPT, checked when it is made."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from attnlib._checks import divisible, positive_int, probability

__all__ = ["GPTConfig"]


@dataclass
class GPTConfig:
    """Hyperparameters of :class:`attnlib.GPT` (chapter 12).

    Attributes:
        vocab_size: number of token ids.
        block_size: longest context (positions) the model sees.
        n_layers: number of Transformer blocks.
        n_heads: query heads per attention layer.
        d_model: width of the residual stream; ``head_dim = d_model // n_heads``.
        n_kv_heads: key/value heads of grouped-query attention (``attention="gqa"``);
            defaults to ``n_heads``. ``"mqa"`` uses one; the other variants ignore it.
        kv_latent_dim: width ``d_c`` of the latent that multi-head latent attention
            (``attention="mla"``) caches instead of keys and values; defaults to
            ``d_model // 4`` (16 for the book's small model, as in the source notebook).
        dropout: dropout probability on attention weights, residual branches and embeddings.
        bias: whether the Linear layers and LayerNorms carry a bias.
        attention: name of the attention variant in
            :data:`attnlib.attention.ATTENTION_REGISTRY` (``"mha"``, ...).
        gelu_approximate: the MLP's GELU, as ``torch.nn.GELU(approximate=...)``:
            ``"none"`` (exact) or ``"tanh"`` (GPT-2's form, needed to reproduce its weights).

    Raises:
        TypeError: a size that is not an int.
        ValueError: a non-positive size, ``d_model`` not divisible by ``n_heads``,
            ``n_heads`` not divisible by ``n_kv_heads``, ``kv_latent_dim < 1``, ``dropout`` outside [0, 1),
            an unknown attention name or GELU form. The message names the value.
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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layers", "n_heads", "d_model"):
            positive_int(name, getattr(self, name))
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        positive_int("n_kv_heads", self.n_kv_heads)
        if self.kv_latent_dim is None:
            self.kv_latent_dim = max(1, self.d_model // 4)
        positive_int("kv_latent_dim", self.kv_latent_dim)
        divisible("d_model", self.d_model, "n_heads", self.n_heads)
        divisible("n_heads", self.n_heads, "n_kv_heads", self.n_kv_heads)
        probability("dropout", self.dropout)
        if not isinstance(self.bias, bool):
            raise TypeError(f"bias must be a bool; got {self.bias!r}")

        from attnlib.attention import ATTENTION_REGISTRY  # late import: the registry imports this module

        if self.attention not in ATTENTION_REGISTRY:
            known = ", ".join(sorted(ATTENTION_REGISTRY))
            raise ValueError(f"attention={self.attention!r} is not a known variant; choose one of: {known}")
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
        """A copy with ``changes``; ``n_kv_heads`` and ``kv_latent_dim`` that held their defaults are derived anew.

        (``dataclasses.replace`` would keep them: ``replace(config, n_heads=2)`` on a config with
        ``n_kv_heads`` defaulted to 4 would fail, 2 not being divisible by 4.)
        """
        fields = asdict(self)
        if "n_kv_heads" not in changes and self.n_kv_heads == self.n_heads:
            fields["n_kv_heads"] = None
        if "kv_latent_dim" not in changes and self.kv_latent_dim == max(1, self.d_model // 4):
            fields["kv_latent_dim"] = None
        return GPTConfig(**{**fields, **changes})

    @property
    def head_dim(self) -> int:
        """Width of one head: ``d_model // n_heads``."""
        return self.d_model // self.n_heads
