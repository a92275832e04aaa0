"""Exercise 21.1: one chunk of Kimi Delta Attention (the delta rule with a per-channel decay), by its recurrence.

``kda_chunk(q, k, v, beta, g, S0) -> (o, S)``: q, k ``(B, H, C, d_k)`` (unit-length keys), v ``(B, H, C, d_v)``,
beta ``(B, H, C)`` in [0, 1], g ``(B, H, C, d_k)`` log decays ``<= 0``, S0 ``(B, H, d_k, d_v)``; token by token

    S_t = (I - β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ,   α_t = exp(g_t),   o_t = S_tᵀ q_t

(Kimi Team 2025, "Kimi Linear: an expressive, efficient attention architecture"; transformers' ``kimi_linear``
torch fallback: decay the state's rows, read ``Sᵀ k_t``, write ``k_t (β_t (v_t - Sᵀ k_t))ᵀ``, read the output; q is
used as given, no ``1/√d_k``). Checked
against a float64 loop on fixed and fresh random cases (a decay of one channel near 0 and another near 1,
``d_k = d_v`` so that decaying the wrong axis fits the shapes, β of 0 and of 1, a decay that empties some channels);
the usual slips are recomputed (:func:`kda_loop`'s keyword arguments) and named when the answer matches one.
attnlib's attention code (``gated_delta_rule`` and the rest of :mod:`attnlib.attention`) and transformers'
delta-rule functions are refused.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil

import torch
import torch.nn.functional as F

import attnlib.attention
from attnlib.book.exercises._core import NotSolved, Wrong, case_rng, exercise, expect, expect_tensor, randint
from attnlib.book.exercises._run import Refuse, run

__all__ = ["attention_library", "check_kda_chunk", "kda_loop"]

#: transformers' delta-rule functions (Kimi Linear's and Qwen3-Next / Qwen3.5's), refused by name
HF_DELTA = ("recurrent_kimi_delta_attention", "chunk_kimi_delta_attention", "torch_recurrent_gated_delta_rule",
            "torch_chunk_gated_delta_rule", "fused_recurrent_kda", "chunk_kda")


@functools.cache
def attention_library() -> tuple:
    """Every function and class defined in a module of :mod:`attnlib.attention` (those of chapter 21 included)."""
    targets = []
    for info in pkgutil.iter_modules(attnlib.attention.__path__):
        try:
            module = importlib.import_module(f"attnlib.attention.{info.name}")
        except ImportError:  # pragma: no cover - an optional backend's module
            continue
        targets += [obj for obj in vars(module).values()
                    if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__]
    return tuple(targets)


def _refused() -> Refuse:
    return Refuse("write the recurrence yourself, without attnlib's attention code (gated_delta_rule, ...) or "
                  "transformers' delta-rule functions", *attention_library(), named=HF_DELTA)


def kda_loop(q, k, v, beta, g, S0, *, order: str = "decay, erase", scalar: bool = False, exp: bool = True,
             axis: str = "rows", beta_write: bool = True, beta_erase: bool = True, read: str = "after",
             scale: bool = False, start: bool = True, stop: int | None = None):
    """``(o, S)`` of the recurrence in float64; the keyword arguments give the slips' variants.

    ``order``: ``"decay, erase"`` (right), ``"erase, decay"`` (Diag(α)(I - βkkᵀ)S + βkvᵀ), ``"after"`` (the
    whole update decayed); ``read``: ``"after"`` (o from S_t), ``"before"`` (from S_{t-1}); ``stop``: the state
    returned after that many tokens.
    """
    q, k, v, beta, g = (t.double() for t in (q, k, v, beta, g))
    S = S0.double() if start else torch.zeros_like(S0, dtype=torch.float64)
    if scalar:
        g = g.mean(-1, keepdim=True).expand_as(g)
    alpha = g.exp() if exp else g
    if scale:
        q = q * q.shape[-1] ** -0.5
    outs, kept = [], S
    for t in range(q.shape[2]):
        k_t, v_t, b_t = k[:, :, t], v[:, :, t], beta[:, :, t, None]  # (B, H, d_k), (B, H, d_v), (B, H, 1)
        a_t = alpha[:, :, t, :, None] if axis == "rows" else alpha[:, :, t, None, :]  # the rows of S, or its columns
        before = S
        if order == "decay, erase":
            S = S * a_t
        erase = b_t if beta_erase else torch.ones_like(b_t)
        read_k = torch.einsum("bhk,bhkv->bhv", k_t, S)  # Sᵀ k_t
        S = S - torch.einsum("bhk,bhv->bhkv", k_t, erase * read_k)
        if order == "erase, decay":
            S = S * a_t
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, (b_t if beta_write else 1.0) * v_t)
        if order == "after":
            S = S * a_t
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S if read == "after" else before))
        if stop is not None and t + 1 == stop:
            kept = S
    return torch.stack(outs, 2), (S if stop is None else kept)


_DECAY_FIRST = ("decay first, then the delta rule: S_t = (I - β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ; "
                "the state read under k_t is the decayed one, and the new write is not decayed (with one decay per "
                "channel the order matters)")
_BETA = ("β_t is the step size of the whole correction: erase β_t k_t (k_tᵀ S) and write β_t k_t v_tᵀ, i.e. "
         "S + k_t (β_t (v_t - Sᵀ k_t))ᵀ")


def _slips(d_k: int, d_v: int, C: int) -> dict[str, tuple[str, dict]]:
    """name -> (hint, :func:`kda_loop`'s keyword arguments); the first that fits the answer is named."""
    slips = {
        "scalar": ("the decay is per channel: α_t = exp(g_t) holds one factor per key channel and Diag(α_t) scales "
                   "row i of S by α_t,i; one decay per head (g averaged over the channels) is gated DeltaNet's",
                   dict(scalar=True)),
        "after": (_DECAY_FIRST, dict(order="after")),
        "between": (_DECAY_FIRST, dict(order="erase, decay")),
        "no decay": (_DECAY_FIRST + "; you did not decay at all", dict(order="none")),
        "exp": ("g is the log of the decay: α_t = exp(g_t), in (0, 1]", dict(exp=False)),
        "beta write": (_BETA + "; you wrote k_t v_tᵀ without β_t", dict(beta_write=False)),
        "beta erase": (_BETA + "; you erased k_t k_tᵀ S without β_t", dict(beta_erase=False)),
        "no beta": (_BETA + "; you left β out", dict(beta_write=False, beta_erase=False)),
        "read before": ("o_t reads the state after token t's update, o_t = S_tᵀ q_t, not S_{t-1}ᵀ q_t: a token "
                        "sees its own key and value", dict(read="before")),
        "scale": ("q is used as given, o_t = S_tᵀ q_t: no 1/√d_k here (a layer scales q before)", dict(scale=True)),
        "start": ("start from the given state S0 (the chunk follows earlier tokens), not from zeros",
                  dict(start=False)),
        "S0": ("return the state after the chunk's C tokens, S_C, not the state it started from", dict(stop=0)),
    }
    if C > 1:
        slips["C - 1"] = ("return the state after all C tokens, S_C, not S_{C-1}", dict(stop=C - 1))
    if d_k == d_v:  # only then does decaying the columns fit the shapes
        slips["axis"] = ("α_t has one factor per key channel: it scales the rows of S (d_k × d_v), "
                         "S * α_t[..., :, None], not its columns", dict(axis="columns"))
    return slips


def _cases(g: torch.Generator) -> list[dict]:
    """(B, H, C, d_k, d_v), the range of g, of β, and the scale of S0: fixed edges and fresh random ones."""
    cases = [dict(size=(1, 1, 1, 1, 1)),
             dict(size=(1, 2, 6, 4, 4), g=(-4.0, 0.0)),  # d_k = d_v: the columns fit too
             dict(size=(2, 2, 8, 3, 5)),
             dict(size=(1, 3, 5, 4, 3), beta=(1.0, 1.0)),  # β = 1: a full replacement
             dict(size=(2, 1, 4, 5, 2), beta=(0.0, 0.0)),  # β = 0: no write, only the decay
             dict(size=(1, 2, 16, 8, 4), g=(-1.0, 0.0), empty=True),  # some channels emptied (g = -30)
             dict(size=(2, 2, 7, 4, 6), S0=0.0, dtype=torch.float64)]  # from a zero state, float64
    for _ in range(3):
        d_k = randint(g, 1, 8)
        cases.append(dict(size=(randint(g, 1, 2), randint(g, 1, 3), randint(g, 1, 12), d_k,
                                (d_k, randint(g, 1, 8))[randint(g, 0, 1)]),
                          g=(-float(torch.rand((), generator=g)) * 4 - 0.1, 0.0),
                          dtype=(torch.float32, torch.float64)[randint(g, 0, 1)]))
    return cases


def _inputs(g: torch.Generator, case: dict) -> tuple[torch.Tensor, ...]:
    B, H, C, d_k, d_v = case["size"]
    dtype = case.get("dtype", torch.float32)

    def rand(*shape, low=0.0, high=1.0):
        return low + (high - low) * torch.rand(*shape, generator=g, dtype=torch.float64)

    q = torch.randn(B, H, C, d_k, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(B, H, C, d_k, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, C, d_v, generator=g, dtype=torch.float64)
    beta = rand(B, H, C, low=case.get("beta", (0.0, 1.0))[0], high=case.get("beta", (0.0, 1.0))[1])
    lo, hi = case.get("g", (-2.0, 0.0))
    decay = rand(B, H, C, d_k, low=lo, high=hi)
    decay[..., 0] = rand(B, H, C, low=-0.05, high=0.0)  # one channel that keeps its memory
    if d_k > 1:
        decay[..., -1] = rand(B, H, C, low=lo - 2.0, high=lo)  # one that forgets fast
    if case.get("empty"):
        decay[..., 1::3] = -30.0
    S0 = torch.randn(B, H, d_k, d_v, generator=g, dtype=torch.float64) * case.get("S0", 1.0)
    return tuple(t.to(dtype) for t in (q, k, v, beta, decay, S0))


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return bool(torch.allclose(a.double(), b.double(), atol=tol, rtol=1e-4))


@exercise("21.1")
def check_kda_chunk(answer) -> None:
    """Check ``answer(q, k, v, beta, g, S0) -> (o (B, H, C, d_v), S (B, H, d_k, d_v))`` against a float64 loop.

    Every case runs first; wrong values are then explained by the slips that give the answer's in every case (one
    case alone often fits several: with d_k = 1 a key erases the whole state).
    """
    rng, refuse = case_rng(), _refused()
    results = []  # (what, inputs, o, S, the expected o and S, tolerance, right)
    for case in _cases(rng):
        inputs = _inputs(rng, case)
        q, k, v, beta, g, S0 = inputs
        B, H, C, d_k, d_v = case["size"]
        what = (f"kda_chunk(q, k {tuple(q.shape)}, v {tuple(v.shape)}, beta {tuple(beta.shape)}, g {tuple(g.shape)}, "
                f"S0 {tuple(S0.shape)}) in {q.dtype}")
        try:
            got = run(answer, q, k, v, beta, g, S0, what=what, refuse=refuse)
        except Wrong:
            if any(not r[-1] for r in results):
                break  # an earlier case's wrong values say more than this one's error
            raise
        if got is None:
            raise NotSolved("return the pair (o, S), not None")
        expect(type(got) in (tuple, list) and len(got) == 2,
               f"{what}: return the pair (o (B, H, C, d_v), S (B, H, d_k, d_v)), the outputs and the state after "
               f"the chunk; got {type(got).__name__}" + (f" of length {len(got)}" if type(got) in (tuple, list) else ""))
        o, S = got
        if isinstance(o, torch.Tensor) and isinstance(S, torch.Tensor) and C != d_k:
            expect(not (tuple(o.shape) == (B, H, d_k, d_v) and tuple(S.shape) == (B, H, C, d_v)),
                   f"{what}: you returned (S, o); return (o, S) in this order")
        expect_tensor(o, f"o of {what}", shape=(B, H, C, d_v))
        expect(not (isinstance(S, torch.Tensor) and S.dim() == 5),
               f"S of {what} has shape {tuple(getattr(S, 'shape', ()))}: return only the last state, S_C "
               f"({B}, {H}, {d_k}, {d_v}), not one per token")
        expect(not (isinstance(S, torch.Tensor) and d_k != d_v and tuple(S.shape) == (B, H, d_v, d_k)),
               f"S of {what} has shape {tuple(getattr(S, 'shape', ()))}: the state is (B, H, d_k, d_v), keys on the "
               "rows (o_t = S_tᵀ q_t)")
        expect_tensor(S, f"S of {what}", shape=(B, H, d_k, d_v))
        for name, t in (("o", o), ("S", S)):
            expect(t.dtype == q.dtype, f"{name} of {what} has dtype {t.dtype}: return it in q's dtype, {q.dtype}")
            expect(not t.isnan().any(), f"{name} of {what} holds NaN: with α_t = exp(g_t) the decays are in [0, 1], "
                                        "nothing to divide by; a chunked form's exp(γ_r - γ_s) must not subtract "
                                        "-inf from -inf")
        # the expected values, after the answer ran: the recurrence in float64
        want_o, want_S = kda_loop(*inputs)
        tol = (1e-5 if q.dtype == torch.float32 else 1e-9) * max(1.0, want_o.abs().max().item(),
                                                                  want_S.abs().max().item())
        results.append((what, inputs, o, S, want_o, want_S, tol, _close(o, want_o, tol) and _close(S, want_S, tol)))
    wrong = [r for r in results if not r[-1]]
    if not wrong:
        return

    def fits(name: str, result: tuple) -> bool:
        what, inputs, o, S, *_ = result
        table = _slips(inputs[0].shape[-1], inputs[2].shape[-1], inputs[0].shape[2])
        if name not in table:
            return True
        slip_o, slip_S = kda_loop(*inputs, **table[name][1])
        return _close(o, slip_o, result[-2]) and _close(S, slip_S, result[-2])

    tables = [_slips(r[1][0].shape[-1], r[1][2].shape[-1], r[1][0].shape[2]) for r in results]
    hints = {}  # name -> hint, from the first case whose sizes define the slip
    for table in tables:
        for name, (hint, _) in table.items():
            hints.setdefault(name, hint)
    hints = [hint for name, hint in hints.items() if all(fits(name, r) for r in results)]
    what, inputs, o, S, want_o, want_S, tol, _ = wrong[0]
    expect(not hints, f"{what}: " + "; or ".join(dict.fromkeys(hints)))
    expect(_close(o, want_o, tol), f"o of {what} differs from the recurrence by up to "
                                   f"{(o.double() - want_o).abs().max().item():.3g} (S_t = (I - β_t k_t k_tᵀ) "
                                   "Diag(exp(g_t)) S_{t-1} + β_t k_t v_tᵀ, o_t = S_tᵀ q_t)")
    expect(False, f"the outputs of {what} are right but the state S differs from the recurrence's S_C by up to "
                  f"{(S.double() - want_S).abs().max().item():.3g}")
