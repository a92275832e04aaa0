"""Exercise checks for chapter 03 (causal attention): masks and a leak detector.

* 03.1 ``bottom_right_causal_mask(T_q, T_k)`` -> bool ``(T_q, T_k)``
* 03.2 ``batch_attention_mask(lengths, T)`` -> bool ``(B, T, T)`` (causal & right padding)
* 03.3 ``sliding_window_mask(T, window)`` -> bool ``(T, T)`` (causal, at most ``window`` keys per query)
* 03.4 ``leaks(model, T, vocab_size)`` -> bool (does a language model, token ids in and logits
  out, let a later token move an earlier output?)

The graders draw their random inputs from a local ``torch.Generator``; ``grade`` runs
them inside ``torch.random.fork_rng``, so checking an answer never changes the
notebook's global random state.
"""
from __future__ import annotations

import torch
from torch import nn

from attnlib.attention import causal_mask, padding_mask
from attnlib.attention.teaching import CausalAttention, SelfAttentionV2
from attnlib.book.exercises._core import case_rng, exercise, expect, expect_close, randint
from attnlib.book.exercises._run import Refuse, run

__all__ = [
    "check_bottom_right_causal_mask",
    "check_batch_attention_mask",
    "check_sliding_window_mask",
    "check_leak_detector",
]


def _expect_bool_mask(mask: object, shape: tuple[int, ...], what: str) -> None:
    expect(isinstance(mask, torch.Tensor), f"{what} should be a torch.Tensor, got {type(mask).__name__}")
    expect(tuple(mask.shape) == shape, f"{what} has shape {tuple(mask.shape)}, expected {shape}")
    expect(mask.dtype == torch.bool, f"{what} has dtype {mask.dtype}; return a boolean mask (True = may attend)")


@exercise("03.1")
def check_bottom_right_causal_mask(fn) -> None:
    """Check a ``(T_q, T_k)`` causal mask aligned to the bottom-right corner."""
    for T_q, T_k in [(1, 1), (4, 4), (2, 6), (1, 5), (3, 8), (5, 7)]:
        what = f"bottom_right_causal_mask({T_q}, {T_k})"
        mask = fn(T_q, T_k)
        _expect_bool_mask(mask, (T_q, T_k), what)
        expected = causal_mask(T_q, T_k)
        if T_q < T_k and torch.equal(mask, torch.ones(T_q, T_k, dtype=torch.bool).tril()):
            expect(False, f"{what} is aligned to the top-left: the last query is the newest token and must see all "
                          f"{T_k} keys; shift the diagonal by T_k - T_q")
        expect(bool(mask[-1].all()), f"{what}: the last query (the newest token) must see every key")
        expect(not bool((mask & ~expected).any()), f"{what} lets a query see a key after its own position "
                                                   f"T_k - T_q + i")
        expect_close(mask, expected, what)


#: 03.2 is "build the mask yourself": attnlib's mask helpers are refused wherever they are reached from.
_OWN_MASK = Refuse("build the mask yourself from torch.arange or torch.tril, not with attnlib's mask helpers",
                   causal_mask, padding_mask)


@exercise("03.2")
def check_batch_attention_mask(fn) -> None:
    """Check a ``(B, T, T)`` mask combining the causal mask with right padding."""
    g = case_rng()
    cases = [([4, 2, 3], 4), ([5], 5), ([1, 6, 0, 3], 6)]  # fixed edges: an empty row, a full row
    for _ in range(3):  # fresh cases each run: an answer cannot learn the check's inputs
        T = randint(g, 2, 12)
        cases.append((torch.randint(0, T + 1, (randint(g, 1, 5),), generator=g).tolist(), T))
    for lengths, T in cases:
        what = f"batch_attention_mask(lengths=torch.tensor({lengths}), T={T})"
        mask = run(fn, torch.tensor(lengths), T, what=what, refuse=_OWN_MASK)
        _expect_bool_mask(mask, (len(lengths), T, T), what)
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        causal = j <= i  # (T, T)
        real = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T), True = real token
        expected = causal & real[:, None, :]  # pad keys are the last dimension
        if torch.equal(mask, expected):
            continue
        if torch.equal(mask, causal.expand_as(mask)):
            expect(False, f"{what} ignores the lengths: no query may attend to a pad key j >= lengths[b]")
        expect(not bool((mask & ~causal).any()), f"{what} lets query i see a key j > i: the causal part is missing")
        if torch.equal(mask, causal & real[:, :, None]):
            expect(False, f"{what} masks pad queries (rows) instead of pad keys (columns)")
        expect(not bool((mask & ~real[:, None, :]).any()),
               f"{what} lets a query attend to pad keys (j >= lengths[b]); mask the key dimension (the last one)")
        expect(False, f"{what}: a real query i of row b must see every real key j <= i; your mask hides "
                      f"{int((expected & ~mask).sum())} of them")


@exercise("03.3")
def check_sliding_window_mask(fn) -> None:
    """Check a causal mask in which each query sees at most ``window`` keys, itself included."""
    for T, window in [(6, 3), (6, 1), (6, 6), (5, 10), (1, 1), (9, 4)]:
        what = f"sliding_window_mask({T}, {window})"
        mask = fn(T, window)
        _expect_bool_mask(mask, (T, T), what)
        i = torch.arange(T)[:, None]
        j = torch.arange(T)[None, :]
        expected = (j <= i) & (i - j < window)
        expect(not bool((mask & ~causal_mask(T)).any()), f"{what} lets query i see a key j > i: keep it causal")
        counts = mask.sum(-1)
        want = expected.sum(-1)
        if not torch.equal(counts, want):
            expect(False, f"{what}: row i should have min(i + 1, window) True entries, i.e. {want.tolist()}; "
                          f"got {counts.tolist()} (the window counts the query's own position)")
        expect_close(mask, expected, what)


class _LeakTokenEverywhere(nn.Module):
    """A causal head plus a tiny term from the last input added to every position."""

    def __init__(self, head: nn.Module, size: float) -> None:
        super().__init__()
        self.head, self.size = head, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(x)  # (B, T, head_dim)
        return out + self.size * x[:, -1:, : out.shape[-1]]  # (B, 1, head_dim) broadcast over T


class _PeekOneAhead(nn.Module):
    """A causal head whose output at one middle position also reads the next input."""

    def __init__(self, head: nn.Module, position: int) -> None:
        super().__init__()
        self.head, self.position = head, position

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(x).clone()
        t = self.position
        out[:, t] = out[:, t] + 0.5 * x[:, t + 1, : out.shape[-1]]
        return out


class _RunningMean(nn.Module):
    """Causal without attention: the mean of the inputs up to each position, through a Linear."""

    def __init__(self, d_model: int, out_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[:, None]  # (T, 1)
        return torch.tanh(self.proj(x.cumsum(1) / counts))  # (B, T, d_model) -> (B, T, out_dim)


class _TinyLM(nn.Module):
    """Token ids ``(B, T)`` -> logits ``(B, T, vocab_size)``: an embedding, a layer, a readout."""

    def __init__(self, vocab_size: int, d_model: int, layer: nn.Module, out_dim: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, d_model)
        self.layer = layer
        self.readout = nn.Linear(out_dim, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            kind = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise TypeError(
                f"this model reads token ids, an integer tensor of shape (B, T), got {kind}: "
                "draw them with torch.randint(vocab_size, (B, T)), not torch.randn"
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise IndexError(
                f"token ids must lie in [0, vocab_size={self.vocab_size}), got ids from "
                f"{int(ids.min())} to {int(ids.max())}"
            )
        return self.readout(self.layer(self.embed(ids)))  # (B, T) -> (B, T, vocab_size)


@exercise("03.4")
def check_leak_detector(fn) -> None:
    """Check a leak detector for language models (token ids in, logits out)."""
    T, vocab_size, d_model, head_dim = 7, 5, 8, 4
    torch.manual_seed(30)

    def lm(layer: nn.Module) -> _TinyLM:
        return _TinyLM(vocab_size, d_model, layer, head_dim)

    def causal_head(dropout: float = 0.0) -> CausalAttention:
        return CausalAttention(d_model, head_dim, block_size=16, dropout=dropout)

    models = [
        ("a causal model", lm(causal_head()), False,
         "a causal model was reported as leaking: compare only the outputs at positions <= t "
         "(the outputs after t may change), and use the same model both times"),
        ("a causal model with dropout 0.2, in training mode", lm(causal_head(0.2)).train(), False,
         "dropout makes two runs differ by chance: call model.eval() before comparing "
         "(and restore its mode afterwards)"),
        ("a causal running mean", lm(_RunningMean(d_model, head_dim)), False,
         "a causal model was reported as leaking: compare only the outputs at positions <= t"),
        ("a model without mask", lm(SelfAttentionV2(d_model, head_dim)), True,
         "a model that sees everything was reported as causal"),
        ("a causal model plus 1e-4 times the last input", lm(_LeakTokenEverywhere(causal_head(), 1e-4)),
         True, "a leak of size 1e-4 went unnoticed: use a tight tolerance (1e-6), not a loose allclose"),
        ("a model whose output 3 also reads token 4", lm(_PeekOneAhead(causal_head(), position=3)), True,
         "a leak from position 4 into position 3 only went unnoticed: try every t, change the tokens "
         "after t and compare the outputs up to t; and make sure each new token differs from the "
         "old one (with a small vocabulary a random redraw often gives back the same token)"),
    ]
    # The learner's detector probably draws from the global generator: seed it so the verdict is
    # reproducible (grade() forks the RNG, so the notebook's random state is untouched).
    torch.manual_seed(31)
    for name, model, should_leak, hint in models:
        was_training = model.training
        answer = fn(model, T, vocab_size)
        expect(
            isinstance(answer, bool) or (isinstance(answer, torch.Tensor) and answer.numel() == 1),
            f"leaks(...) should return True or False, got {type(answer).__name__}",
        )
        expect(bool(answer) == should_leak, f"on {name}: {hint}")
        expect(
            model.training == was_training,
            f"on {name}: leaks() left the model in {'training' if model.training else 'evaluation'} "
            "mode; restore the mode it had (module.train(was_training))",
        )
