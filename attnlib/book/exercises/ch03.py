"""Exercise checks for chapter 03 (causal attention): masks and a leak detector.

* 03.1 ``document_mask(doc_ids)`` -> bool ``(B, T, T)`` (packed documents: causal, within one
  document, pads (id -1) in no document)
* 03.2 ``batch_attention_mask(lengths, T)`` -> bool ``(B, T, T)`` (causal & right padding)
* 03.3 ``sliding_window_mask(T, window)`` -> bool ``(T, T)`` (causal, at most ``window`` keys per query)
* 03.4 ``leaks(model, T, vocab_size)`` -> bool (does a language model, token ids in and logits
  out, let a later token move an earlier output?)

Every check runs the answer through :func:`~attnlib.book.exercises._run.run` on fixed edge cases and
fresh random ones (:func:`~attnlib.book.exercises._core.case_rng`); the expected masks are built
after the answer ran, from ``torch.arange`` comparisons. ``grade`` runs the checks inside
``torch.random.fork_rng``, so checking an answer never changes the notebook's random state.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from attnlib.attention import causal_mask, mods, padding_mask
from attnlib.attention import masks as _masks
from attnlib.attention.masks import mask_from_mod
from attnlib.attention.teaching import CausalAttention, SelfAttentionV2
from attnlib.book.exercises._core import case_rng, exercise, expect, expect_close, expect_tensor, randint
from attnlib.book.exercises._run import Refuse, run

__all__ = [
    "check_document_mask",
    "check_batch_attention_mask",
    "check_sliding_window_mask",
    "check_leak_detector",
]


def _expect_bool_mask(mask: object, shape: tuple[int, ...], what: str) -> None:
    expect_tensor(mask, what)
    expect(tuple(mask.shape) == shape, f"{what} has shape {tuple(mask.shape)}, expected {shape}")
    expect(mask.dtype == torch.bool, f"{what} has dtype {mask.dtype}; return a boolean mask (True = may attend)")


def _causal(T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] <= torch.arange(T)[:, None]  # (T, T): key j <= query i


# --------------------------------------------------------------------------- 03.1

#: 03.1 is "build it yourself": the library's document mask and the mask builders are refused.
#: Every mask builder within reach: attnlib's (masks, mods), FlexAttention's, transformers' (by name: its
#: masking_utils and AttentionMaskConverter); "build the mask yourself" refuses them all, whatever the exercise.
_MASK_BUILDERS = Refuse("", *[f for module in (_masks, mods) for f in vars(module).values()
                              if callable(f) and getattr(f, "__module__", None) == module.__name__],
                        create_mask, create_block_mask, named=(
    "sdpa_mask", "sdpa_mask_recent_torch", "sdpa_mask_older_torch", "eager_mask", "create_causal_mask",
    "causal_mask_function", "padding_mask_function", "and_masks", "or_masks", "sliding_window_overlay",
    "sliding_window_causal_mask_function", "create_sliding_window_causal_mask", "packed_sequence_mask_function",
    "_prepare_4d_causal_attention_mask", "_prepare_4d_attention_mask", "_make_causal_mask", "_expand_mask",
    "to_causal_4d", "to_4d", "_prepare_4d_causal_attention_mask_for_sdpa"))


def _own(why: str, *targets) -> Refuse:
    refuse = Refuse(why, *targets) + _MASK_BUILDERS
    refuse.why = why
    return refuse


_OWN_DOCUMENT_MASK = _own(
    "build the document mask yourself from comparisons of doc_ids, not with attnlib's mods.document_mask, "
    "mask_from_mod or FlexAttention's create_mask", mods.document_mask, mask_from_mod, create_mask)


def _random_doc_ids(g: torch.Generator, B: int, T: int) -> list[list[int]]:
    rows = []
    for _ in range(B):
        n_pad = randint(g, 0, T // 3)
        row, doc = [], randint(g, 0, 3)
        while len(row) < T - n_pad:
            row += [doc] * min(randint(g, 1, 5), T - n_pad - len(row))
            doc += randint(g, 1, 3)  # document ids are labels: increasing, not 0, 1, 2, ...
        rows.append(row + [-1] * n_pad)
    return rows


@exercise("03.1")
def check_document_mask(fn) -> None:
    """Check a ``(B, T, T)`` mask for packed documents: causal, same document, pads in none."""
    g = case_rng()
    cases = [
        [[0, 0, 0, 1, 1, 2, -1, -1]],
        [[7, 7, 7, 7, 7], [0, 1, 2, 3, 4]],  # one document; every token its own document
        [[-1, -1, -1], [3, 3, -1]],  # a row of pads only
        [[0] * 20 + [1] * 21 + [-1] * 3],  # long documents
    ]
    for _ in range(3):
        T = randint(g, 2, 14)
        cases.append(_random_doc_ids(g, randint(g, 1, 4), T))
    for rows in cases:
        doc_ids = torch.tensor(rows)
        B, T = doc_ids.shape
        what = f"document_mask(torch.tensor({rows}))" if T <= 14 else f"document_mask(doc_ids of shape {(B, T)})"
        mask = run(fn, doc_ids, what=what, refuse=_OWN_DOCUMENT_MASK)
        _expect_bool_mask(mask, (B, T, T), what)
        causal = _causal(T)
        same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, 1) == (B, 1, T) -> (B, T, T)
        real = doc_ids != -1  # (B, T)
        expected = causal & same & real[:, None, :] & real[:, :, None]
        if torch.equal(mask, expected):
            continue
        expect(not bool((mask & ~causal).any()), f"{what} lets query i see a key j > i: the causal part is missing")
        pad_pairs = ~(real[:, None, :] & real[:, :, None])
        expect(not bool((mask & pad_pairs).any()),
               f"{what} lets a pad see a pad: the pads share the id -1 but are no document; a pad query sees "
               "nothing and no query sees a pad key")
        if B > 1 and any(rows[b] != rows[0] for b in range(B)):
            first_row = causal & (doc_ids[:1, :, None] == doc_ids[:1, None, :]) & real[:1, None, :] & real[:1, :, None]
            expect(not torch.equal(mask, first_row.expand(B, T, T)),
                   f"{what} gives every row of the batch the mask of row 0; row b's mask compares row b's ids")
        if bool((mask & ~same).any()):
            expect(not torch.equal(mask, causal & real[:, None, :] & real[:, :, None]),
                   f"{what} ignores the documents: a query may only see keys of its own document")
            expect(False, f"{what} lets a query see a key of another document (check the document boundaries)")
        expect(False, f"{what}: a query must see every earlier key of its own document, itself included; your mask "
                      f"hides {int((expected & ~mask).sum())} of them")


# --------------------------------------------------------------------------- 03.2


#: 03.2 is "build the mask yourself": attnlib's mask helpers are refused wherever they are reached from.
_OWN_MASK = _own("build the mask yourself from torch.arange or torch.tril, not with attnlib's mask helpers",
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


#: 03.3: the library's sliding-window mask function is the whole answer, so it is refused.
_OWN_WINDOW = _own("build the window mask yourself from comparisons or torch.tril, not with attnlib's "
                     "mods.sliding_window or mask_from_mod", mods.sliding_window, mask_from_mod, create_mask)


@exercise("03.3")
def check_sliding_window_mask(fn) -> None:
    """Check a causal mask in which each query sees at most ``window`` keys, itself included."""
    g = case_rng()
    # fixed edges: window 1 (the diagonal), window = T and > T (the causal mask), one token, a long sequence
    cases = [(6, 3), (6, 1), (6, 6), (5, 10), (1, 1), (40, 17)]
    for _ in range(3):
        T = randint(g, 2, 16)
        cases.append((T, randint(g, 1, T + 2)))
    for T, window in cases:
        what = f"sliding_window_mask({T}, {window})"
        mask = run(fn, T, window, what=what, refuse=_OWN_WINDOW)
        _expect_bool_mask(mask, (T, T), what)
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        expected = (j <= i) & (i - j < window)
        if torch.equal(mask, expected):
            continue
        expect(not bool((mask & ~(j <= i)).any()), f"{what} lets query i see a key j > i: keep it causal")
        counts, want = mask.sum(-1), expected.sum(-1)
        if not torch.equal(counts, want):
            expect(False, f"{what}: row i should have min(i + 1, window) True entries, i.e. {want.tolist()}; "
                          f"got {counts.tolist()} (the window counts the query's own position)")
        expect_close(mask, expected, what)


# --------------------------------------------------------------------------- 03.4


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


class _Spy(nn.Module):
    """Hands every batch of token ids on to ``model`` and keeps a copy (to check how the future was redrawn)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.seen: list[torch.Tensor] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):
            self.seen.append(ids.detach().clone())
        return self.model(ids)


def _gap(changed: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether some row of ``changed`` differs from ``base`` at two positions but not at one between them."""
    for row in changed.ne(base):  # (T,) per row
        where = row.nonzero().flatten()
        if len(where) > 1 and not bool(row[int(where[0]) : int(where[-1]) + 1].all()):
            return True
    return False


def _kept_some_future_token(seen: list[torch.Tensor]) -> bool:
    """A call whose redrawn future left a token unchanged, measured against every earlier call."""
    for n, ids in enumerate(seen):
        earlier = [e for e in seen[:n] if e.shape == ids.shape and e.dtype == ids.dtype]
        if earlier and all(_gap(ids, e) for e in earlier):
            return True
    return False


_SAME_TOKEN_HINT = ("make sure each new token differs from the old one: with a small vocabulary a random redraw "
                    "often gives back the same token, and a leak from that position goes unseen (add a random "
                    "shift in [1, vocab_size) modulo vocab_size)")


@exercise("03.4")
def check_leak_detector(fn) -> None:
    """Check a leak detector for language models (token ids in, logits out)."""
    g = case_rng()
    T, vocab_size, d_model, head_dim = randint(g, 6, 9), 5, 8, 4
    torch.manual_seed(randint(g, 0, 2**31))  # the models' weights (grade() forks the RNG: the notebook's is kept)

    def lm(layer: nn.Module) -> _TinyLM:
        return _TinyLM(vocab_size, d_model, layer, head_dim)

    def causal_head(dropout: float = 0.0) -> CausalAttention:
        return CausalAttention(d_model, head_dim, block_size=16, dropout=dropout)

    peek = randint(g, 1, T - 2)
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
        (f"a model whose output {peek} also reads token {peek + 1}", lm(_PeekOneAhead(causal_head(), peek)), True,
         f"a leak from position {peek + 1} into position {peek} only went unnoticed: try every t, change the "
         f"tokens after t and compare the outputs up to t; and {_SAME_TOKEN_HINT}"),
    ]
    torch.manual_seed(randint(g, 0, 2**31))  # a detector that draws from the global generator: fresh, reproducible
    for name, model, should_leak, hint in models:
        spy = _Spy(model).train(model.training)
        was_training = spy.training
        answer = run(fn, spy, T, vocab_size, what=f"leaks(model, {T}, {vocab_size}) on {name}", copy_args=False)
        expect(type(answer) is bool,
               f"leaks(...) should return True or False (a Python bool), got {type(answer).__name__}"
               + (": use bool(...) or .item() on a one-element tensor" if isinstance(answer, torch.Tensor) else ""))
        if answer != should_leak or not should_leak:
            expect(not _kept_some_future_token(spy.seen), f"on {name}: {_SAME_TOKEN_HINT}")
        expect(answer == should_leak, f"on {name}: {hint}")
        expect(spy.training == was_training,
               f"on {name}: leaks() left the model in {'training' if spy.training else 'evaluation'} "
               "mode; restore the mode it had (module.train(was_training))")
