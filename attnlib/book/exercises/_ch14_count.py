"""Exercise checks 14.2 (which keys can a head of width 2 ever prefer?) and 14.3 (count a GPT's parameters).

:mod:`ch14` imports them, which registers them.

* 14.2 ``can_win(k)``: keys ``(T, 2)``; a bool ``(T,)`` saying which key is the strict favourite
  (the largest score ``q · k_j``) of some query ``q``: the corners of the keys' convex hull.
  Checked exactly on integer keys (collinear and repeated keys included) against a hull the check
  computes in integers, and on keys whose corners win only in a narrow range of directions.
* 14.3 ``count_parameters(config)``: the parameters of ``attnlib.GPT(config)`` for GPT-2's layout
  with other sizes, GQA, another ``d_ff``, no biases, an untied head or RoPE, without building a
  model; checked against a model the check builds on the ``meta`` device afterwards.
"""
from __future__ import annotations

import torch
from torch import nn

from attnlib.book.exercises._core import NotSolved, case_rng, exercise, expect, expect_int, expect_tensor, randint
from attnlib.book.exercises._run import Refuse, run
from attnlib.models import GPT, GPTConfig
from attnlib.models.hf_gpt2 import parameter_breakdown


# ---------------------------------------------------------------- 14.2
def _cross(o, a, b) -> int:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def _corners(points: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """The strict corners of the convex hull of distinct integer points (Andrew's monotone chain)."""
    pts = sorted(set(points))
    if len(pts) <= 2:
        return set(pts)
    hull = []
    for chain in (pts, pts[::-1]):
        part: list[tuple[int, int]] = []
        for p in chain:
            while len(part) >= 2 and _cross(part[-2], part[-1], p) <= 0:  # <= 0: drop collinear points
                part.pop()
            part.append(p)
        hull += part[:-1]
    return set(hull)


def _on_hull_edge(p, corners) -> bool:
    """Whether ``p`` lies on the segment between two corners (a key that ties, never wins)."""
    cs = list(corners)
    return any(_cross(a, b, p) == 0 and min(a[0], b[0]) <= p[0] <= max(a[0], b[0])
               and min(a[1], b[1]) <= p[1] <= max(a[1], b[1]) for i, a in enumerate(cs) for b in cs[i + 1:])


def _key_sets(g: torch.Generator) -> list[tuple[str, list[tuple[int, int]]]]:
    cases = [
        ("a pentagon: one corner is extreme in neither coordinate", [(0, 0), (4, 1), (6, 4), (3, 7), (-1, 3)]),
        ("a square and its centre", [(0, 0), (4, 0), (4, 4), (0, 4), (2, 2)]),
        ("keys on the edges of a triangle", [(0, 0), (3, 0), (6, 0), (3, 3), (0, 6), (1, 1)]),
        ("a corner key repeated", [(0, 0), (5, 1), (5, 1), (2, 4), (1, 1)]),
        ("one key", [(3, -2)]),
        ("the same key four times", [(1, 1)] * 4),
        ("keys on a line", [(0, 0), (2, 1), (4, 2), (6, 3)]),
        ("61 keys on a parabola: every one a corner, most for a narrow range of directions",
         [(i, i * i) for i in range(-30, 31)]),
    ]
    for _ in range(3):  # fresh keys each run: small integers, so collinear and repeated keys occur
        T = randint(g, 3, 30)
        cases.append((f"{T} random integer keys", [tuple(p) for p in torch.randint(-6, 7, (T, 2), generator=g).tolist()]))
    return cases


def _can_win_hint(what, got, expected, keys) -> str:
    corners = _corners(keys)
    xs, ys = [p[0] for p in keys], [p[1] for p in keys]
    axis = {i for i, p in enumerate(keys) if p[0] in (min(xs), max(xs)) or p[1] in (min(ys), max(ys))}
    missing = [i for i in range(len(keys)) if expected[i] and not got[i]]
    extra = [i for i in range(len(keys)) if got[i] and not expected[i]]
    if extra:
        j = extra[0]
        if keys.count(keys[j]) > 1:
            return (f"{what}: key {j} {keys[j]} appears {keys.count(keys[j])} times; equal keys always tie, so "
                    "neither has the strictly largest score for any q")
        if _on_hull_edge(keys[j], corners):
            return (f"{what}: key {j} {keys[j]} lies on the segment between two other keys: its score is at most "
                    "the larger of theirs for every q (a tie at best), so it never wins")
        return (f"{what}: key {j} {keys[j]} lies inside the hull of the others: for every q some other key "
                "scores at least as high")
    j = missing[0]
    if all(not got[i] or i in axis for i in range(len(keys))) and j not in axis:
        return (f"{what}: key {j} {keys[j]} is the largest or smallest in neither coordinate and still wins for "
                "some q: in two dimensions q need not point along an axis")
    return (f"{what}: key {j} {keys[j]} wins for some q, perhaps only in a narrow range of directions "
            "(sampling directions misses it). Decide exactly: a key can win iff it is a corner of the keys' "
            "convex hull")


@exercise("14.2")
def check_can_win(can_win) -> None:
    """Check ``can_win(k) -> bool (T,)`` exactly on integer keys of width 2."""
    for what, keys in _key_sets(case_rng()):
        k = torch.tensor(keys, dtype=torch.float64)  # (T, 2): integers, exact in float64
        got = run(can_win, k, what=f"can_win(<{what}>)")
        if got is None:
            raise NotSolved("return a bool tensor (T,), not None")
        expect_tensor(got, f"can_win(<{what}>)", shape=(len(keys),), dtype=torch.bool)
        corners = _corners(keys)  # the check's own hull, after the answer ran
        expected = [keys.count(p) == 1 and p in corners for p in keys]
        if got.tolist() != expected:
            expect(False, _can_win_hint(what, got.tolist(), expected, keys))


# ---------------------------------------------------------------- 14.3
#: 14.3 is "count, do not build": no module may be constructed (the meta device included), nor counted for you
_NO_MODEL = Refuse("count from the sizes, without building a model (not even on the meta device)",
                   nn.Module.__init__, parameter_breakdown, GPT.num_parameters)


def _configs(g: torch.Generator) -> list[GPTConfig]:
    fixed = [GPTConfig.gpt2("small"), GPTConfig(vocab_size=50, block_size=16, n_layers=2, n_heads=4, d_model=32,
                                                  attention="gqa", n_kv_heads=2),
             GPTConfig(vocab_size=70, block_size=24, n_layers=3, n_heads=2, d_model=24, tie_embeddings=False),
             GPTConfig(vocab_size=61, block_size=8, n_layers=1, n_heads=4, d_model=16, d_ff=40, bias=False),
             GPTConfig(vocab_size=33, block_size=64, n_layers=2, n_heads=2, d_model=16, position="rope")]
    for _ in range(3):  # fresh sizes and switches each run
        n_heads, n_kv = [(2, 1), (4, 2), (4, 4), (6, 3), (8, 2)][randint(g, 0, 4)]
        fixed.append(GPTConfig(
            vocab_size=randint(g, 10, 5000), block_size=randint(g, 4, 2048), n_layers=randint(g, 1, 12),
            n_heads=n_heads, d_model=n_heads * 2 * randint(g, 1, 12),  # head_dim even, as RoPE needs
            attention="gqa" if n_kv < n_heads else "mha",
            n_kv_heads=n_kv, d_ff=randint(g, 8, 300), bias=bool(randint(g, 0, 1)),
            tie_embeddings=bool(randint(g, 0, 1)), position=["learned", "rope"][randint(g, 0, 1)]))
    return fixed


def _variants(c: GPTConfig) -> dict[str, int]:
    """What a few plausible slips count (the hints' evidence), from the sizes alone."""
    d, hd, L, V = c.d_model, c.head_dim, c.n_layers, c.vocab_size
    b = 1 if c.bias else 0
    kv = (c.n_heads + 2 * c.n_kv_heads) * hd
    def total(kv=kv, d_ff=c.d_ff, ln=(2 if b else 1), bias=b, pos=c.position == "learned", head=not c.tie_embeddings,
              ln_f=True):
        attn = d * kv + bias * kv + c.n_heads * hd * d + bias * d
        mlp = 2 * d * d_ff + bias * (d_ff + d)
        return V * d + pos * c.block_size * d + head * V * d + L * (attn + mlp + 2 * ln * d) + ln_f * ln * d
    return {"right": total(), "mha": total(kv=3 * c.n_heads * hd), "4d": total(d_ff=4 * d),
            "biases": total(ln=2, bias=1), "pos": total(pos=True), "head": total(head=c.tie_embeddings),
            "ln_f": total(ln_f=False)}


_COUNT_HINTS = {
    "mha": "keys and values have n_kv_heads heads, not n_heads: the qkv projection is "
           "d_model x (n_heads + 2 n_kv_heads) head_dim",
    "4d": "the MLP is d_model x d_ff and d_ff x d_model with the config's d_ff, not 4 d_model",
    "biases": "with bias=False no Linear has a bias and a LayerNorm keeps its weight only",
    "pos": "position='rope' rotates the queries and keys: no position table, no parameters",
    "head": "an untied output head is a second vocab_size x d_model matrix; a tied one is the token embedding, "
            "counted once",
    "ln_f": "the final LayerNorm (ln_f) after the last block",
}


@exercise("14.3")
def check_count_parameters(count_parameters) -> None:
    """Check ``count_parameters(config) -> int`` against ``GPT(config)`` built on the meta device afterwards."""
    for config in _configs(case_rng()):
        what = (f"count_parameters(GPTConfig(vocab_size={config.vocab_size}, block_size={config.block_size}, "
                f"n_layers={config.n_layers}, n_heads={config.n_heads}, n_kv_heads={config.n_kv_heads}, "
                f"d_model={config.d_model}, d_ff={config.d_ff}, bias={config.bias}, "
                f"tie_embeddings={config.tie_embeddings}, position={config.position!r}))")
        got = expect_int(run(count_parameters, config, what=what, refuse=_NO_MODEL), what)
        with torch.device("meta"):
            expected = GPT(config).num_parameters()
        if got == expected:
            continue
        variants = _variants(config)
        for slip, hint in _COUNT_HINTS.items():
            if variants[slip] != expected and got == variants[slip]:
                expect(False, f"{what} = {got:,}, expected {expected:,}: {hint}")
        expect(False, f"{what} = {got:,}, expected {expected:,}: count each part: the embeddings, per block two "
                      "LayerNorms, qkv, out_proj, fc and proj (with their biases), and ln_f")
