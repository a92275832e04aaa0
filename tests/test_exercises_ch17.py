"""The chapter 17 exercise checks: the table of answers each must accept and refuse (tests/exercise_table.py)."""
import math

import numpy as np
import torch
import torch.nn.functional as F
from exercise_table import Answers

from attnlib.book.exercises import NOT_SOLVED, grade
from attnlib.cache import RingLayerCache
from attnlib.positional import RotaryEmbedding


def test_stubs_are_not_solved():
    def stub(*args):
        raise NotImplementedError("write it")

    for exercise_id in ("17.1", "17.2", "17.3", "17.4", "17.5", "17.6"):
        assert grade(exercise_id, stub).status == NOT_SOLVED


# ---------------------------------------------------------------- 17.1
def ntk_base(base, head_dim, factor):
    return base * factor ** (head_dim / (head_dim - 2))


def ntk_base_by_logs(base, head_dim, factor):  # b' from log b' = log b + d/(d - 2) log s
    return math.exp(math.log(base) + head_dim / (head_dim - 2) * math.log(factor))


# ---------------------------------------------------------------- 17.2
def reach(windows, T):
    if None in windows:
        return T
    return min(T, 1 + sum(w - 1 for w in windows))


def reach_by_walking(windows, T):  # the earliest input the last output reads, layer by layer
    earliest = T - 1
    for w in windows:
        earliest = 0 if w is None else max(0, earliest - (w - 1))
    return T - earliest


def reach_ignoring_global(windows, T):
    return min(T, 1 + sum(w - 1 for w in windows if w is not None))


def reach_uniform(windows, T):
    return min(T, 1 + len(windows) * ((windows[0] or T) - 1))


def reach_sum_of_windows(windows, T):
    return T if None in windows else min(T, sum(windows))


def reach_without_itself(windows, T):
    return T if None in windows else min(T, sum(w - 1 for w in windows))


def reach_unclipped(windows, T):
    return T if None in windows else 1 + sum(w - 1 for w in windows)


class _AlwaysEqual(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


# ---------------------------------------------------------------- 17.3
def streaming_keys(position, window, n_sink, sinks=True, extra=0, dedup=True, sinks_in_window=False,
                   future_sinks=False):
    first = list(range(n_sink if future_sinks else min(n_sink, position + 1))) if sinks else []
    span = window - n_sink if sinks_in_window else window
    recent = list(range(max(0, position - span + 1 - extra), position + 1))
    keys = first + recent
    return sorted(set(keys)) if dedup else sorted(keys)


def streaming_keys_by_filter(position, window, n_sink):
    return [p for p in range(position + 1) if p < n_sink or p > position - window]


def streaming_renumbered(position, window, n_sink):
    return list(range(len(streaming_keys(position, window, n_sink))))


# ---------------------------------------------------------------- 17.4
def softcap_grad(scores, cap):
    return 1 - torch.tanh(scores / cap) ** 2


def softcap_grad_by_autograd(scores, cap):
    s = scores.detach().clone().requires_grad_(True)
    (cap * torch.tanh(s / cap)).sum().backward()
    return s.grad


def softcap_grad_in_place(scores, cap):
    return 1 - scores.div_(cap).tanh_() ** 2


# ---------------------------------------------------------------- 17.5
# The scores written here with complex numbers for the rotation, independently of the check's float64 helper.
def _scores(q, k, base, factor, L, length=None, clamp=True, plain=False, exponent=None, query_at=None,
            own=False, scale=True, interleaved=False):
    h, T, d = k.shape

    def theta(n):
        n = max(n, L) if clamp else n
        s = n / L if plain else factor * n / L - (factor - 1)
        b = base * s ** (d / (d - 2) if exponent is None else exponent)
        return 1.0 / b ** (torch.arange(0, d, 2, dtype=torch.float64) / d)

    def turn(x, angle):
        if interleaved:
            z = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
        else:
            z = torch.complex(x[..., : d // 2], x[..., d // 2 :])
        return z * torch.polar(torch.ones_like(angle), angle)

    now = theta(T if length is None else length)
    angles = torch.stack([j * (theta(j + 1) if own else now) for j in range(T)])  # (T, d/2)
    keys = turn(k, angles)  # (h, T, d/2) complex
    query = turn(q, (T - 1 if query_at is None else query_at) * now)  # (h, d/2)
    scores = (query[:, None, :] * keys.conj()).real.sum(-1)  # Re(q conj k) = the dot product of the pairs
    return scores / math.sqrt(d) if scale else scores


def dynamic_scores(q, k, base, factor, original_length):  # the solution's way, with real numbers
    h, T, d = k.shape
    s = max(T, original_length) * factor / original_length - (factor - 1)
    new_base = base * s ** (d / (d - 2))
    theta = 1.0 / new_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)

    def rope(x, positions):
        angle = positions[:, None].double() * theta  # (T, d/2)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], dim=-1)

    q_rot = rope(q[:, None, :], torch.tensor([T - 1]))  # (h, 1, d)
    return (q_rot @ rope(k, torch.arange(T)).transpose(-2, -1))[:, 0] / math.sqrt(d)


def dynamic_scores_float32(q, k, base, factor, original_length):  # angles in float32, as the chapter's rope()
    return _scores(q.float().double(), k, base, factor, original_length).float().double()


def dynamic_by_library(q, k, base, factor, original_length):
    rope = RotaryEmbedding(q.shape[-1], base, {"rope_type": "dynamic", "factor": factor}, original_length)
    T = k.shape[1]
    q_rot = rope.rotate(q[:, None, :], torch.tensor([T - 1]))
    return (q_rot @ rope.rotate(k, torch.arange(T)).transpose(-2, -1))[:, 0] / math.sqrt(q.shape[-1])


def dynamic_by_transformers(q, k, base, factor, original_length):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    h, T, d = k.shape
    config = LlamaConfig(hidden_size=2 * d, num_attention_heads=2, head_dim=d,
                         max_position_embeddings=original_length,
                         rope_parameters={"rope_type": "dynamic", "factor": factor, "rope_theta": base})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, None, seq_len=T)
    angle = torch.arange(T)[:, None].double() * inv_freq.double()  # (T, d/2)
    keys = torch.cat([k[..., : d // 2] * angle.cos() - k[..., d // 2 :] * angle.sin(),
                      k[..., : d // 2] * angle.sin() + k[..., d // 2 :] * angle.cos()], dim=-1)
    a = angle[-1]
    query = torch.cat([q[:, : d // 2] * a.cos() - q[:, d // 2 :] * a.sin(),
                       q[:, : d // 2] * a.sin() + q[:, d // 2 :] * a.cos()], dim=-1)
    return (keys @ query[:, :, None])[..., 0] / math.sqrt(d)


# ---------------------------------------------------------------- 17.6
class RingCache:  # the solution's way: attend over (old ring + chunk) with a per-query mask, then write
    def __init__(self, window, batch_size, n_heads, head_dim):
        self.window = window
        self.k = torch.zeros(batch_size, n_heads, window, head_dim)
        self.v = torch.zeros(batch_size, n_heads, window, head_dim)

    def positions(self, start):  # the position each slot holds before the chunk (< 0: empty)
        return start - 1 - (start - 1 - torch.arange(self.window)) % self.window

    def attend(self, q, k, v, start, held, causal=True, scale=True):
        w, T = self.window, q.shape[2]
        new = start + torch.arange(T)
        pos = torch.cat([held, new])
        age = new[:, None] - pos[None, :]
        visible = (pos >= 0) & (age < w) & ((age >= 0) | (not causal))
        scores = q @ torch.cat([self.k, k], 2).transpose(-2, -1)
        scores = scores / math.sqrt(q.shape[-1]) if scale else scores
        return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ torch.cat([self.v, v], 2)

    def write(self, k, v, start):
        n = min(k.shape[2], self.window)
        slots = (start + k.shape[2] - n + torch.arange(n)) % self.window  # the chunk's last n positions
        self.k[:, :, slots], self.v[:, :, slots] = k[:, :, -n:], v[:, :, -n:]

    def step(self, q, k, v, start):
        out = self.attend(q, k, v, start, self.positions(start))
        self.write(k, v, start)
        return out


class RingCacheTokenByToken:  # another way: Exercise 08.1's write-then-attend, one token of the chunk at a time
    def __init__(self, window, batch_size, n_heads, head_dim):
        self.window = window
        self.k = torch.zeros(batch_size, n_heads, window, head_dim)
        self.v = torch.zeros_like(self.k)

    def step(self, q, k, v, start):
        outs = []
        for i in range(q.shape[2]):
            p = start + i
            self.k[:, :, p % self.window], self.v[:, :, p % self.window] = k[:, :, i], v[:, :, i]
            n = min(p + 1, self.window)  # the slots 0 ... n - 1 are filled
            outs.append(F.scaled_dot_product_attention(q[:, :, i : i + 1], self.k[:, :, :n], self.v[:, :, :n]))
        return torch.cat(outs, dim=2)


class RingWritesFirst(RingCache):  # 08.1's order for a whole chunk: write, then attend over the ring
    def step(self, q, k, v, start):
        self.write(k, v, start)
        end = start + q.shape[2]
        held = end - 1 - (end - 1 - torch.arange(self.window)) % self.window  # the slots after the write
        w, T = self.window, q.shape[2]
        new = start + torch.arange(T)
        age = new[:, None] - held[None, :]
        visible = (held >= 0) & (age >= 0) & (age < w)
        scores = q @ self.k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ self.v


class RingInOrder(RingCache):  # the mask reads the old ring as positions start - window ... start - 1 in slot order
    def step(self, q, k, v, start):
        out = self.attend(q, k, v, start, start - self.window + torch.arange(self.window))
        self.write(k, v, start)
        return out


class RingLongChunkMisplaced(RingCache):  # a chunk longer than the window: its last w keys put from slot start % w
    def write(self, k, v, start):
        n = min(k.shape[2], self.window)
        slots = (start + torch.arange(n)) % self.window
        self.k[:, :, slots], self.v[:, :, slots] = k[:, :, -n:], v[:, :, -n:]


class RingOneTokenOnly(RingCache):  # Exercise 08.1's step: only the chunk's first token is written
    def step(self, q, k, v, start):
        slot = start % self.window
        self.k[:, :, slot], self.v[:, :, slot] = k[:, :, 0], v[:, :, 0]
        scores = q @ self.k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        filled = torch.arange(self.window) <= start
        return scores.masked_fill(~filled, float("-inf")).softmax(-1) @ self.v


class RingKeepsEverything(RingCache):
    def __init__(self, window, batch_size, n_heads, head_dim):
        super().__init__(window, batch_size, n_heads, head_dim)
        self.all_k, self.all_v = [], []

    def step(self, q, k, v, start):
        self.all_k.append(k)
        self.all_v.append(v)
        return super().step(q, k, v, start)


class RingZerosSeen(RingCache):  # the empty slots' negative positions are not masked: zero keys get weight
    def attend(self, q, k, v, start, held, causal=True, scale=True):
        new = start + torch.arange(q.shape[2])
        age = new[:, None] - torch.cat([held, new])[None, :]
        visible = (age >= 0) & (age < self.window)
        scores = q @ torch.cat([self.k, k], 2).transpose(-2, -1) / math.sqrt(q.shape[-1])
        return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ torch.cat([self.v, v], 2)


class RingNotCausal(RingCache):
    def step(self, q, k, v, start):
        out = self.attend(q, k, v, start, self.positions(start), causal=False)
        self.write(k, v, start)
        return out


class RingUnscaled(RingCache):
    def step(self, q, k, v, start):
        out = self.attend(q, k, v, start, self.positions(start), scale=False)
        self.write(k, v, start)
        return out


class RingThroughAttnlib(RingCache):
    def __init__(self, window, batch_size, n_heads, head_dim):
        super().__init__(window, batch_size, n_heads, head_dim)
        self.ring = RingLayerCache(10_000, window)


class RingThroughKeptCache(RingCache):  # the ring's rule from the caches' private base, called unbound
    def step(self, q, k, v, start):
        from types import SimpleNamespace

        from attnlib.cache.windowed import _KeptCache
        _KeptCache.still_held(SimpleNamespace(capacity=self.window), torch.tensor([start]), start + 1)
        return super().step(q, k, v, start)


class RingScalesInPlace(RingCache):
    def step(self, q, k, v, start):
        q.mul_(1 / math.sqrt(q.shape[-1]))  # the caller's queries, scaled where they lie
        return super().step(q * math.sqrt(q.shape[-1]), k, v, start)


class RingFlat(RingCache):
    def step(self, q, k, v, start):
        return super().step(q, k, v, start)[:, :, 0]  # (B, h, head_dim): the T axis dropped


ANSWERS = {
    "17.1": Answers(
        correct=[ntk_base, ntk_base_by_logs],
        wrong=[
            (lambda b, d, s: b * s, "slowed by only"),
            (lambda b, d, s: b * s ** ((d - 2) / d), "exponent is upside down"),
            (lambda b, d, s: b / s, "a smaller base makes every pair turn faster"),
            (lambda b, d, s: b * s ** (d / 2), "i = d_h/2 - 1"),
            (lambda b, d, s: b * s ** (d / (d - 1)), "the fastest pair (i = 0) never changes"),
            (lambda b, d, s: torch.tensor(ntk_base(b, d, s)), "use .item()"),
            (lambda b, d, s: np.float64(ntk_base(b, d, s)), "should be a Python float"),
        ],
    ),
    "17.2": Answers(
        correct=[reach, reach_by_walking],
        wrong=[
            (reach_ignoring_global, "a global layer"),
            (reach_uniform, "each layer adds its own w - 1"),
            (reach_sum_of_windows, "adds w - 1, not w"),
            (reach_without_itself, "count the last position itself"),
            (reach_unclipped, "there are only T"),
            (lambda windows, T: float(reach(windows, T)), "should be a Python int"),
            (lambda windows, T: _AlwaysEqual(reach(windows, T)), "should be a Python int"),
        ],
    ),
    "17.3": Answers(
        correct=[streaming_keys, streaming_keys_by_filter],
        wrong=[
            (lambda p, w, n: streaming_keys(p, w, n, sinks=False), "never evicted"),
            (lambda p, w, n: streaming_keys(p, w, n, extra=1), "the window counts the token itself"),
            (lambda p, w, n: streaming_keys(p, w, n, dedup=False), "list it once"),
            (lambda p, w, n: streaming_keys(p, w, n, sinks_in_window=True), "besides the sinks"),
            (lambda p, w, n: streaming_keys(p, w, n, future_sinks=True), "once its token has arrived"),
            (streaming_renumbered, "not the positions 0, 1, ..."),
            (lambda p, w, n: streaming_keys(p, w, n)[::-1], "ascending order"),
            (lambda p, w, n: streaming_keys(p, w, n, extra=-1), "keys, the token itself and the"),
            (lambda p, w, n: torch.tensor(streaming_keys(p, w, n)), "use .tolist()"),
            (lambda p, w, n: [np.int64(x) for x in streaming_keys(p, w, n)], "plain Python ints"),
        ],
    ),
    "17.4": Answers(
        correct=[softcap_grad, softcap_grad_by_autograd],
        wrong=[
            (lambda s, c: c * (1 - torch.tanh(s / c) ** 2), "chain rule"),
            (lambda s, c: 1 - torch.tanh(s) ** 2, "the tanh is of s / cap"),
            (lambda s, c: 1 / torch.cosh(s / c), "(squared)"),
            (lambda s, c: torch.where(s == 0, torch.ones_like(s), c * torch.tanh(s / c) / s), "the secant"),
            (softcap_grad_in_place, "in place"),
            (lambda s, c: softcap_grad(s, c).float(), "keep scores' dtype"),
        ],
    ),
    "17.5": Answers(
        correct=[dynamic_scores, dynamic_scores_float32],
        wrong=[
            (lambda q, k, b, f, L: _scores(q, k, b, f, L, length=L), "these are plain RoPE's scores"),
            (lambda q, k, b, f, L: _scores(q, k, b, f, L, clamp=False), "it never shrinks it"),
            (lambda q, k, b, f, L: _scores(q, k, b, f, L, own=True), "a cache of keys rotated on arrival"),
            (lambda q, k, b, f, L: _scores(q, k, b, f, L, length=k.shape[1] - 1), "not T - 1"),
            (lambda q, k, b, f, L: _scores(q, k, b, f, L, plain=True), "s = factor * T / L - (factor - 1)"),
            (lambda q, k, b, f, L: _scores(q, k, b, f, L, exponent=1.0), "s ** (d_h / (d_h - 2))"),
            (lambda q, k, b, f, L: _scores(q, k, b, f, L, query_at=k.shape[1]), "the query is the newest token"),
            (lambda q, k, b, f, L: _scores(q, k, b, f, L, scale=False), "scale the scores"),
            (lambda q, k, b, f, L: _scores(q, k, b, f, L, interleaved=True), "rotate half-split pairs"),
            (dynamic_by_library, "compute the dynamic base and the rotation yourself"),
            (dynamic_by_transformers, "compute the dynamic base and the rotation yourself"),
        ],
    ),
    "17.6": Answers(
        correct=[RingCache, RingCacheTokenByToken],
        wrong=[
            (RingWritesFirst, "writing the chunk into the ring before attending overwrote keys"),
            (RingInOrder, "the ring wraps"),
            (RingLongChunkMisplaced, "of a chunk longer than the window only its last"),
            (RingOneTokenOnly, "an answer for T = 1 is not enough"),
            (RingKeepsEverything, "a ring keeps only the last window positions"),
            (RingZerosSeen, "mask the empty slots"),
            (RingNotCausal, "sees the chunk's later keys"),
            (RingUnscaled, "scale the scores by 1/sqrt(head_dim)"),
            (RingThroughAttnlib, "write the ring buffer yourself"),
            (RingThroughKeptCache, "attnlib.cache.windowed._KeptCache"),
            (RingScalesInPlace, "in place"),
            (RingFlat, "has shape"),
        ],
        function=False,
    ),
}


def test_the_solutions_equal_outside_references():
    """17.5's answer = transformers' dynamic frequencies; 17.6's rings (both ways) = banded SDPA over the whole text."""
    g = torch.Generator().manual_seed(0)
    for T, L, f in ((20, 32, 1.0), (96, 24, 2.0), (41, 10, 4.0)):
        q, k = torch.randn(2, 16, generator=g, dtype=torch.float64), torch.randn(2, T, 16, generator=g,
                                                                                 dtype=torch.float64)
        theirs = dynamic_by_transformers(q, k, 10000.0, f, L)  # transformers' frequencies are float32
        torch.testing.assert_close(dynamic_scores(q, k, 10000.0, f, L), theirs, rtol=1e-5, atol=1e-5)
    for window, sizes in ((3, [1, 2, 4, 1, 7, 3]), (4, [9, 1, 4, 6])):  # chunks: shorter, equal, longer, wrapping
        T = sum(sizes)
        q, k, v = (torch.randn(1, 2, T, 4, generator=g) for _ in range(3))
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        band = (j <= i) & (i - j < window)  # sliding-window attention over the whole text, no cache
        whole = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
        for ours in (RingCache(window, 1, 2, 4), RingCacheTokenByToken(window, 1, 2, 4)):
            start = 0
            for n in sizes:
                chunk = (t[:, :, start : start + n] for t in (q, k, v))
                torch.testing.assert_close(ours.step(*chunk, start), whole[:, :, start : start + n])
                start += n
            last = torch.arange(T - window, T)  # the ring ends with the last window positions, slots p % window
            torch.testing.assert_close(ours.k[:, :, last % window], k[:, :, last])
