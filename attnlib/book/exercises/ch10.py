"""Exercise checks for chapter 10 (the Transformer).

* 10.1 ``check_shift_matrix``: the linear map ``M_k`` with ``PE[pos + k] = PE[pos] @ M_k`` for the
  sinusoidal table of Vaswani et al. 2017, §3.5 ("PE_{pos+k} can be represented as a linear
  function of PE_pos").
* 10.2 ``check_smoothed_loss``: cross-entropy with label smoothing (Vaswani et al. 2017, §5.4),
  PyTorch's convention (``eps / |V|`` on every token), padding ignored, without
  ``F.cross_entropy`` (refused under any name, ``torch.ops.aten`` included).
* 10.3 ``check_layernorm_backward``: ``(dx, dweight, dbias)`` of LayerNorm (Ba et al. 2016) given ``dy``,
  by hand: autograd (``saved_tensors_hooks`` notice any graph), ``native_layer_norm_backward`` and
  attnlib's written-out RMSNorm backward are refused; compared with float64 autograd.

Every check calls the answer through :func:`run` and draws fresh random cases from
:func:`case_rng` besides its fixed edge cases.
"""
from __future__ import annotations

import math

import torch
import torch.autograd.forward_ad
import torch.autograd.functional
import torch.func
import torch.nn.functional as F

from attnlib.book.exercises._autograd import AUTOGRAD, GraphWatch
from attnlib.book.exercises._ch10_doors import RefuseOps
from attnlib.book.exercises._core import case_rng, exercise, expect, expect_close, expect_tensor, randint
from attnlib.book.exercises._run import Refuse, run
from attnlib.layers.norms import _RMSNormFunction
from attnlib.positional import sinusoidal_encoding

__all__ = ["check_layernorm_backward", "check_shift_matrix", "check_smoothed_loss"]


# ---------------------------------------------------------------- 10.1
def _blocks(k: float, d_model: int, exponent: float = 2.0) -> torch.Tensor:
    """Block-diagonal rotations: row vector (sin a, cos a) times the block gives (sin, cos) of a + k w."""
    m = torch.zeros(d_model, d_model, dtype=torch.float64)
    for i in range(d_model // 2):
        angle = k * 10000 ** (-exponent * i / d_model)
        c, s = math.cos(angle), math.sin(angle)
        m[2 * i, 2 * i], m[2 * i, 2 * i + 1] = c, -s
        m[2 * i + 1, 2 * i], m[2 * i + 1, 2 * i + 1] = s, c
    return m


@exercise("10.1")
def check_shift_matrix(answer) -> None:
    """Check ``answer(k, d_model)``: ``PE[pos + k] == PE[pos] @ M`` for every position."""
    g = case_rng()
    cases = [(1, 2), (3, 8), (0, 6), (57, 32), (200, 64)]  # fixed edges: one pair, k = 0, a large k
    cases += [(randint(g, 1, 90), 2 * randint(g, 2, 24)) for _ in range(3)]  # fresh each run
    for k, d_model in cases:
        what = f"shift_matrix({k}, {d_model})"
        out = expect_tensor(run(answer, k, d_model, what=what), what, shape=(d_model, d_model))
        expect(out.is_floating_point(), f"{what} has dtype {out.dtype}; return a float matrix")
        out = out.detach().double()
        pe = sinusoidal_encoding(k + 40, d_model).double()  # (k + 40, d_model)
        if torch.allclose(pe[:40] @ out, pe[k:], atol=1e-4, rtol=0):
            continue
        if k:
            expect(not torch.allclose(out, torch.eye(d_model, dtype=torch.float64), atol=1e-5),
                   f"{what} is the identity: it must move the table by {k} positions")
            expect(not torch.allclose(out, _blocks(k, d_model).T, atol=1e-5),
                   f"{what} shifts by -{k} (PE[pos - {k}]): the rows are positions, so the row vector "
                   f"is multiplied on the left, PE[pos] @ M; transpose each 2x2 block")
        if d_model > 2:
            expect(not torch.allclose(out, _blocks(k, d_model, exponent=1.0), atol=1e-5),
                   f"{what}: pair i turns at 10000^(-2i/d_model), the exponent of its column 2i, "
                   f"not 10000^(-i/d_model)")
        expect_close(pe[:40] @ out, pe[k:], f"PE[pos] @ {what} against PE[pos + {k}] for pos < 40",
                     atol=1e-4, rtol=0)


# ---------------------------------------------------------------- 10.2
#: "without calling F.cross_entropy": refused under any name (the module, its C function, the loss class)
_NO_CROSS_ENTROPY = Refuse("build the loss from log_softmax, without F.cross_entropy or nn.CrossEntropyLoss",
                           F.cross_entropy, torch.nn.CrossEntropyLoss, torch._C._nn.cross_entropy_loss,
                           aten="cross_entropy")


def _loss_cases(g: torch.Generator) -> list[tuple[int, int, int, int, float]]:
    cases = [(2, 5, 7, 0, 0.1), (3, 4, 11, 3, 0.25), (1, 6, 5, 2, 0.0), (2, 3, 2, 1, 1.0)]  # eps 0 and 1
    for _ in range(2):
        V = randint(g, 3, 40)
        cases.append((randint(g, 1, 4), randint(g, 3, 9), V, randint(g, 0, V - 1),
                      float(torch.empty(()).uniform_(0.05, 0.4, generator=g))))
    return cases


@exercise("10.2")
def check_smoothed_loss(answer) -> None:
    """Check ``answer(logits, targets, eps, pad_id)`` against ``F.cross_entropy(..., label_smoothing=eps)``."""
    g = case_rng()
    for B, T, V, pad_id, eps in _loss_cases(g):
        logits = torch.randn(B, T, V, generator=g) * 2
        targets = torch.randint(0, V, (B, T), generator=g)
        targets[targets == pad_id] = (pad_id + 1) % V
        targets[0, -2:] = pad_id  # some padding; every case keeps real targets in its other positions
        what = f"smoothed_loss(logits {(B, T, V)}, targets, eps={eps:.3f}, pad_id={pad_id})"
        ops = RefuseOps(_NO_CROSS_ENTROPY.why, "cross_entropy")  # torch.ops.aten.cross_entropy_loss
        out = run(answer, logits, targets, eps, pad_id, what=what, refuse=_NO_CROSS_ENTROPY, inside=(ops,))
        ops.verdict()
        expect_tensor(out, what)
        expect(out.shape == (), f"{what} has shape {tuple(out.shape)}; return the mean loss, a scalar "
                                "tensor of shape ()")
        out = out.detach().double()
        # the expected values, computed after the answer ran, from the definition -sum_j q_j log p_j
        flat_l, flat_t = logits.double().flatten(0, 1), targets.flatten()
        keep = flat_t != pad_id
        logp = flat_l.log_softmax(-1)  # (N, V)
        nll = -logp.gather(-1, flat_t[:, None])[:, 0]  # (N,)
        q = torch.full_like(logp, eps / V).scatter_add_(-1, flat_t[:, None], torch.full_like(nll[:, None], 1 - eps))
        per_position = -(q * logp).sum(-1)  # (N,)
        if torch.allclose(out, per_position[keep].mean(), atol=1e-5, rtol=1e-5):
            continue

        def near(value: torch.Tensor, out: torch.Tensor = out) -> bool:
            return bool(torch.allclose(out, value, atol=1e-5, rtol=1e-5))

        expect(eps == 0 or not near(nll[keep].mean()),
               f"{what}: that is the plain cross-entropy: mix in eps times the mean of -log p over the vocabulary")
        expect(not near(per_position.mean()), f"{what}: padding positions were averaged in: keep only "
                                              "targets != pad_id")
        others = (1 - eps) * nll + eps * (-(logp.sum(-1) + nll) / (V - 1))
        expect(eps == 0 or not near(others[keep].mean()),
               f"{what}: eps is spread over the V - 1 other tokens; PyTorch's convention spreads it over all "
               f"|V| tokens, the right one included (eps/|V| each)")
        expect(not near(per_position[keep].sum()),
               f"{what}: that is the sum over positions; take the mean over the non-padding ones")
        expect(not near((per_position * keep).sum() / keep.numel()),
               f"{what}: the padding positions were zeroed but still counted: divide by the number "
               f"of non-padding positions, not by B * T")
        expect(eps == 0 or not near(((1 - eps) * nll - eps * logp.sum(-1))[keep].mean()),
               f"{what}: eps was put on every token (the sum of -log p over the vocabulary); "
               f"it is spread evenly, eps/|V| each: take the mean over the vocabulary")
        entropy = -(q * q.clamp_min(1e-300).log()).sum(-1)  # (N,): H(q), what KL(q || p) leaves out
        expect(not near((per_position - entropy)[keep].mean()),
               f"{what}: that is the KL divergence KL(q || p) (nn.KLDivLoss, as in the Annotated "
               f"Transformer), the cross-entropy minus the entropy of q; the loss asked for is "
               f"the cross-entropy -sum q log p")
        expect_close(out, per_position[keep].mean(), f"the smoothed loss for {what}", atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- 10.3
#: "by hand": autograd (reverse and forward mode) and every written-out backward of a norm are refused
_BY_HAND = Refuse(
    "work out LayerNorm's backward by hand, without autograd or a library's backward",
    *AUTOGRAD, _RMSNormFunction,
    aten=("layer_norm_backward", "rms_norm_backward"))


def _ln(x: torch.Tensor, w: torch.Tensor, eps: float, unbiased: bool = False, eps_outside: bool = False):
    mu = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True, unbiased=unbiased)
    scale = var.sqrt() + eps if eps_outside else (var + eps).sqrt()
    return (x - mu) / scale * w


def _vjp(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float, **slip: bool) -> tuple[torch.Tensor, ...]:
    """(dx, dweight) of sum(LN(x) * dy) by float64 autograd, for LayerNorm or one of its slips."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    with torch.enable_grad():
        return torch.autograd.grad((_ln(x64, w64, eps, **slip) * dy.double()).sum(), (x64, w64))


def _slips(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float) -> dict[str, torch.Tensor]:
    """dx as the usual slips give it, most specific first (float64)."""
    x, w, dy = x.double(), w.double(), dy.double()
    xc = x - x.mean(-1, keepdim=True)
    r = (xc.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    x_hat, g = xc * r, dy * w
    r_rms = (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    slips = {
        "the mean and the variance were treated as constants: both depend on every x_j, so dx has two "
        "more terms (differentiate mu and sigma^2 too)": g * r,
        "that is RMSNorm's backward: LayerNorm also subtracts the mean, which depends on every x_j":
            r_rms * (g - x * r_rms * (g * x * r_rms).mean(-1, keepdim=True)),
        "the variance's term is missing: sigma^2 depends on x too (the term -x_hat * mean(g * x_hat))":
            r * (g - g.mean(-1, keepdim=True)),
        "the mean's term is missing: mu depends on x too (the term -mean(g))":
            r * (g - x_hat * (g * x_hat).mean(-1, keepdim=True)),
        "the gain is missing from dx: the gradient reaching x_hat is dy * weight, not dy":
            r * (dy - dy.mean(-1, keepdim=True) - x_hat * (dy * x_hat).mean(-1, keepdim=True)),
    }
    if x.shape[-1] > 1:  # with d = 1 both divide by zero
        slips["LayerNorm's variance is the biased one (divide by d, as nn.LayerNorm does), not d - 1"] = \
            _vjp(x, w, dy, eps, unbiased=True)[0]
        slips["eps goes inside the square root, 1/sqrt(sigma^2 + eps), not 1/(sigma + eps)"] = \
            _vjp(x, w, dy, eps, eps_outside=True)[0]
    return slips


def _norm_cases(g: torch.Generator) -> list[tuple[tuple[int, ...], int, float, float]]:
    """(leading dims, d, eps, scale of x): a vector; two leading dims; eps larger than the variance; d = 1."""
    cases = [((), 6, 1e-5, 2.0), ((2, 3), 8, 1e-5, 1.0), ((4,), 5, 1e-2, 0.05), ((3,), 1, 1e-5, 1.0)]
    for _ in range(3):
        lead = tuple(randint(g, 1, 4) for _ in range(randint(g, 0, 2)))
        cases.append((lead, randint(g, 2, 24), (1e-5, 1e-3, 1e-1)[randint(g, 0, 2)], (0.1, 1.0, 3.0)[randint(g, 0, 2)]))
    return cases


@exercise("10.3")
def check_layernorm_backward(answer) -> None:
    """Check ``answer(x, weight, dy, eps) -> (dx, dweight, dbias)`` against float64 autograd, autograd refused."""
    rng = case_rng()
    for lead, d, eps, scale in _norm_cases(rng):
        x = torch.randn(*lead, d, generator=rng) * scale + torch.randn((), generator=rng)  # off-centre
        w = torch.empty(d).uniform_(0.5, 2.0, generator=rng) * torch.randn(d, generator=rng).sign()
        dy = torch.randn(*lead, d, generator=rng)
        what = f"layernorm_backward(x {tuple(x.shape)}, weight ({d},), dy {tuple(dy.shape)}, eps={eps:g})"
        watch, ops = GraphWatch(), RefuseOps(_BY_HAND.why, "layer_norm_backward", "rms_norm_backward")
        out = run(answer, x, w, dy, eps, what=what, refuse=_BY_HAND, inside=(watch, ops))
        ops.verdict()
        expect(not watch.recorded, f"{what}: {_BY_HAND.why}: your code recorded an autograd graph "
                                   "(requires_grad on a tensor); write the chain rule out with tensor ops")
        expect(type(out) in (tuple, list) and len(out) == 3,
               f"{what} should return the tuple (dx, dweight, dbias), got {type(out).__name__}"
               + (f" of length {len(out)}" if type(out) in (tuple, list) else ""))
        dx, dw, db = out
        expect_tensor(dx, f"dx of {what}", shape=tuple(x.shape), dtype=x.dtype)
        for name, t in (("dweight", dw), ("dbias", db)):
            expect_tensor(t, f"{name} of {what}")
            expect(not (lead and tuple(t.shape) == tuple(x.shape)),
                   f"{name} of {what} has the shape of x: weight and bias are shared by every position, "
                   f"so sum their gradients over every leading dimension, to shape ({d},)")
            expect(lead or tuple(t.shape) != (), f"{name} of {what} has shape (): for a 1-D x there is no "
                   f"leading dimension to sum over, and x.sum(dim=()) sums over EVERY dimension; "
                   f"flatten the leading ones first, reshape(-1, d).sum(0)")
            expect_tensor(t, f"{name} of {what}", shape=(d,), dtype=x.dtype)
        # the expected values, computed after the answer ran, by float64 autograd of the definition
        exp_dx, exp_dw = _vjp(x, w, dy, eps)
        exp_db = dy.double().reshape(-1, d).sum(0)

        # float32's rounding scales with the terms that cancel in dx, r * |dy * weight| (large where a row's
        # variance is small), not with dx itself (about 0 when d = 2: LayerNorm then gives +-weight + bias)
        x64 = x.double()
        r = ((x64 - x64.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + eps).rsqrt()
        terms = (r * (dy.double() * w.double()).abs()).max().item()

        def near(got: torch.Tensor, want: torch.Tensor, size: float = 0.0) -> bool:
            tol = 1e-5 * max(1.0, want.abs().max().item(), size)
            return bool(torch.allclose(got.detach().double(), want, atol=tol, rtol=1e-4))

        expect(not (near(dw, exp_db) and near(db, exp_dw)) or near(dw, exp_dw),
               f"{what}: dweight and dbias are swapped: return (dx, dweight, dbias) in that order")
        if not near(dx, exp_dx, terms):
            for hint, slip in _slips(x, w, dy, eps).items():
                expect(not near(dx, slip, terms), f"dx of {what}: {hint}")
            expect(d != 1 or bool(dx.abs().max() < 1e-6),
                   f"dx of {what}: with d = 1, LayerNorm's output is 0 whatever x (x - mu = 0), so dx must be 0")
            expect(False, f"dx of {what} differs from autograd's (max abs difference "
                          f"{(dx.double() - exp_dx).abs().max().item():.3g})")
        x_plain = (x.double() - x.double().mean(-1, keepdim=True)).reshape(-1, d)
        expect(near(dw, exp_dw) or not near(dw, (dy.double().reshape(-1, d) * x_plain).sum(0)),
               f"dweight of {what}: the gain multiplies the normalised x_hat = (x - mu) / sqrt(sigma^2 + eps), "
               "so dweight = sum of dy * x_hat, not dy * (x - mu)")
        expect(near(dw, exp_dw) or not near(dw, (dy.double() * x.double()).reshape(-1, d).sum(0)),
               f"dweight of {what}: the gain multiplies the normalised x_hat, so dweight = sum of dy * x_hat, "
               "not dy * x")
        expect(near(dw, exp_dw), f"dweight of {what} differs from autograd's: the sum over every position "
                                 "of dy * x_hat")
        expect(near(db, exp_db) or not near(db, exp_db / (dy.numel() // d)),
               f"dbias of {what}: that is the mean of dy over the positions; the loss sums over them, so sum")
        expect(near(db, exp_db), f"dbias of {what} differs from autograd's: the sum of dy over every position")
