"""``python -m attnlib.bench train``: one AdamW step of attnlib's GPT against a GPT made of PyTorch's own layers.

Chapter 15. Both models have the same sizes, vocabulary, batch and parameter count:

* **attnlib**: :class:`attnlib.GPT` (chapter 12): token + learned position embeddings,
  pre-LN blocks (causal multi-head attention on SDPA, GELU MLP), final LayerNorm, output
  head tied to the token embedding.
* **torch** (:class:`TorchGPT`): the same embeddings, final LayerNorm and tied head around
  ``torch.nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout,
  activation="gelu", norm_first=True, batch_first=True)`` layers, called the way PyTorch
  documents as fastest for a causal model: a causal ``src_mask`` *and* ``is_causal=True``
  (``nn.MultiheadAttention`` then drops the mask and calls SDPA with ``is_causal=True``).

A step is ``forward → cross-entropy → backward → AdamW.step → zero_grad``, timed in
rounds that alternate the two models (:func:`attnlib.bench.time_calls`), median reported.
The ratio is attnlib's time over torch's: below 1 means attnlib's GPT trains faster.

With ``modern=True`` (chapter 16) each row also times the Llama-style :class:`attnlib.Decoder` at the
same width, depth, heads, vocabulary and batch (:func:`modern_config`, a :meth:`attnlib.DecoderConfig.llama`:
RoPE, RMSNorm, SwiGLU of ``8/3 · d_model``, tied head, no biases), in the same alternating rounds;
``modern_ratio`` is its step time over attnlib's GPT's (issue 14 asks for at most 1.05). The same decoder
without RoPE (``position="nope"``) is timed beside it, so the table shows what the rotation costs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnlib.bench._common import format_table, resolve_device, time_calls
from attnlib.bench._common import threads as using_threads
from attnlib.models import GPT, Decoder, DecoderConfig, GPTConfig

__all__ = ["TRAIN_SIZES", "TRAIN_SMALL", "TorchGPT", "format_train", "modern_config", "train_rows"]

#: The sizes compared: ``(name, config, batch)``. ``book``: the book's small model (``GPTConfig()``'s
#: defaults, batch 16 as ``attnlib.train.TrainConfig``); ``10M``: 6 layers, 6 heads, d_model 384, T 256.
TRAIN_SIZES = {
    "book": (GPTConfig(), 16),
    "10M": (GPTConfig(vocab_size=65, block_size=256, n_layers=6, n_heads=6, d_model=384), 8),
}
#: ``--small``: a model that steps in milliseconds, for tests and the install check.
TRAIN_SMALL = {"tiny": (GPTConfig(vocab_size=32, block_size=16, n_layers=2, n_heads=2, d_model=32), 4)}


class TorchGPT(nn.Module):
    """A GPT of ``config``'s sizes built from ``nn.TransformerEncoderLayer`` (pre-LN, GELU, causal).

    Shapes: ``forward(idx (B, T) int64, targets (B, T) int64 | None)`` →
    ``(logits (B, T, vocab_size), loss scalar | None)``, as :meth:`attnlib.GPT.forward`.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.tok_emb = nn.Embedding(config.vocab_size, d)
        self.pos_emb = nn.Embedding(config.block_size, d)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, config.n_heads, 4 * d, config.dropout, activation="gelu", norm_first=True,
                                       batch_first=True, bias=config.bias)
            for _ in range(config.n_layers)
        )
        self.ln_f = nn.LayerNorm(d, bias=config.bias)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied, as in attnlib.GPT
        mask = nn.Transformer.generate_square_subsequent_mask(config.block_size, dtype=torch.float32)
        self.register_buffer("causal", mask, persistent=False)  # float, -inf above the diagonal

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, d_model)
        mask = self.causal[:T, :T].to(x.dtype)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)  # the documented hint: SDPA runs with is_causal=True
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab_size)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def modern_config(config: GPTConfig) -> DecoderConfig:
    """The :meth:`DecoderConfig.llama` of ``config``'s vocabulary, context, depth, heads, width and dropout.

    Key/value heads as ``config.n_kv_heads`` (all of them for MHA); SwiGLU width ``8/3 · d_model``
    rounded up to a multiple of 8 (about the GELU MLP's parameters); head tied to the embedding,
    as the GPT's; no biases (Llama); RMSNorm's eps 1e-6, as in the committed ``bench_modern.json``
    (attnlib 1.x's ``ModernConfig``, whose defaults these are).
    """
    return DecoderConfig.llama(vocab_size=config.vocab_size, block_size=config.block_size, n_layers=config.n_layers,
                               n_heads=config.n_heads, d_model=config.d_model, n_kv_heads=config.n_kv_heads,
                               dropout=config.dropout, norm_eps=1e-6, tie_embeddings=True)


def _step_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, lr: float):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step():
        _, loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def train_rows(
    sizes: dict[str, tuple[GPTConfig, int]] | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
    threads: int | None = None,
    modern: bool = False,
) -> list[dict]:
    """Seconds per AdamW step of attnlib's GPT and of :class:`TorchGPT`, one row per size.

    Args:
        sizes: ``name -> (GPTConfig, batch)`` (default :data:`TRAIN_SIZES`); sequences are
            ``config.block_size`` long, ``dropout`` as in the config (0 by default).
        device: where to run (``None``: :func:`attnlib.device`).
        dtype: of the parameters.
        repeats: timed steps per model (medians reported), in alternating rounds.
        warmup: untimed steps of each model first.
        seed: for the weights and the batch.
        threads: ``torch.set_num_threads`` for the run (``None``: as it is).
        modern: also time the :class:`attnlib.Decoder` of :func:`modern_config` (chapter 16).

    Returns:
        Dicts with ``size, n_layers, n_heads, d_model, block_size, vocab_size, batch,
        parameters`` (attnlib's, tied head counted once), ``torch_parameters``,
        ``attnlib_ms``, ``torch_ms`` and ``ratio`` (attnlib / torch); with ``modern`` also
        ``modern_parameters``, ``modern_ms`` and ``modern_ratio`` (the Llama-style decoder / attnlib's GPT),
        and ``nope_ms``, ``nope_ratio`` for the same decoder without RoPE.
    """
    with using_threads(threads):
        return _train_rows(TRAIN_SIZES if sizes is None else sizes, device, dtype, repeats, warmup, seed, modern)


def _train_rows(sizes, device, dtype, repeats, warmup, seed, modern=False):
    device = resolve_device(device)
    rows = []
    for name, (config, batch) in sizes.items():
        torch.manual_seed(seed)
        ours = GPT(config).to(device, dtype).train()
        theirs = TorchGPT(config).to(device, dtype).train()
        g = torch.Generator().manual_seed(seed)
        data = torch.randint(config.vocab_size, (batch, config.block_size + 1), generator=g).to(device)
        idx, targets = data[:, :-1], data[:, 1:]
        steps = {"attnlib": _step_fn(ours, idx, targets, 1e-4), "torch": _step_fn(theirs, idx, targets, 1e-4)}
        if modern:
            torch.manual_seed(seed)
            decoder = Decoder(modern_config(config)).to(device, dtype).train()
            steps["modern"] = _step_fn(decoder, idx, targets, 1e-4)
            torch.manual_seed(seed)
            unrotated = Decoder(modern_config(config).replace(position="nope")).to(device, dtype).train()
            steps["nope"] = _step_fn(unrotated, idx, targets, 1e-4)
        seconds = time_calls(steps, repeats=repeats, warmup=warmup)
        extra = {} if not modern else dict(modern_parameters=decoder.num_parameters(),
                                           modern_ms=1e3 * seconds["modern"],
                                           modern_ratio=seconds["modern"] / seconds["attnlib"],
                                           nope_ms=1e3 * seconds["nope"],
                                           nope_ratio=seconds["nope"] / seconds["attnlib"])
        rows.append(
            dict(
                size=name,
                **{k: getattr(config, k) for k in ("n_layers", "n_heads", "d_model", "block_size", "vocab_size")},
                batch=batch,
                parameters=ours.num_parameters(),
                torch_parameters=sum(p.numel() for p in theirs.parameters()),
                attnlib_ms=1e3 * seconds["attnlib"],
                torch_ms=1e3 * seconds["torch"],
                ratio=seconds["attnlib"] / seconds["torch"],
                **extra,
            )
        )
    return rows


COLUMNS = [
    ("size", "model", "s"),
    ("n_layers", "layers", "d"),
    ("n_heads", "heads", "d"),
    ("d_model", "d_model", "d"),
    ("block_size", "T", "d"),
    ("batch", "batch", "d"),
    ("parameters", "parameters", ",d"),
    ("attnlib_ms", "attnlib GPT ms", ".1f"),
    ("torch_ms", "TransformerEncoderLayer GPT ms", ".1f"),
    ("ratio", "ratio", ".3f"),
]
MODERN_COLUMNS = [
    ("size", "model", "s"),
    ("parameters", "GPT parameters", ",d"),
    ("modern_parameters", "Llama decoder parameters", ",d"),
    ("attnlib_ms", "GPT ms", ".1f"),
    ("modern_ms", "Llama decoder ms", ".1f"),
    ("modern_ratio", "ratio", ".3f"),
    ("nope_ratio", "ratio without RoPE", ".3f"),
]


def format_train(rows: list[dict], settings: dict | None = None) -> str:
    """The table and how it was measured."""
    parts = []
    if settings:
        parts.append(
            f"One AdamW step (forward, loss, backward, step, zero_grad), {settings['dtype']}; median of "
            f"{settings['repeats']} alternating steps after {settings['warmup']} warm-up steps each."
        )
    parts.append(
        "torch: nn.TransformerEncoderLayer(norm_first=True, activation='gelu', batch_first=True) with a causal "
        "src_mask and is_causal=True; same embeddings, final LayerNorm, tied head. ratio = attnlib / torch."
    )
    parts.append(format_table(rows, COLUMNS))
    worst = max(rows, key=lambda r: r["ratio"])
    parts.append(f"\nattnlib's GPT at {worst['ratio']:.3f}x the TransformerEncoderLayer GPT at worst ({worst['size']}).")
    if all("modern_ms" in row for row in rows):
        parts.append("\nLlama decoder (Decoder(DecoderConfig.llama(...)): RoPE, RMSNorm, SwiGLU 8/3 d_model, tied head, "
                     "no biases) at the same width, depth, heads and batch; ratio = Llama decoder / attnlib's GPT "
                     "(target <= 1.05); "
                     "without RoPE: the same decoder with position='nope', over attnlib's GPT.")
        parts.append(format_table(rows, MODERN_COLUMNS))
        worst = max(rows, key=lambda r: r["modern_ratio"])
        parts.append(f"\nThe Llama decoder at {worst['modern_ratio']:.3f}x attnlib's GPT at worst ({worst['size']}).")
    return "\n".join(parts)
