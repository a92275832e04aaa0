"""Chapter 10 graders: the reference is correct, plausible slips are wrong with a hint that names
them, a stub is not solved."""
import math

import torch
import torch.nn.functional as F
from exercise_table import Answers

from attnlib.book.exercises import grade
from attnlib.layers import LayerNorm
from attnlib.positional import sinusoidal_encoding


def stub(*args):
    raise NotImplementedError("write me")


# 10.1 the shift matrix ---------------------------------------------------------

def shift(k, d_model, exponent=2.0, block=lambda c, s: [[c, -s], [s, c]]):
    m = torch.zeros(d_model, d_model)
    for i in range(d_model // 2):
        a = k * 10000 ** (-exponent * i / d_model)
        m[2 * i: 2 * i + 2, 2 * i: 2 * i + 2] = torch.tensor(block(math.cos(a), math.sin(a)))
    return m


def shift_by_least_squares(k, d_model):  # a different route to the same matrix
    pe = sinusoidal_encoding(k + 200, d_model).double()
    return torch.linalg.lstsq(pe[:200], pe[k:]).solution.float()


def transposed(k, d_model):  # column-vector convention: shifts by -k
    return shift(k, d_model).T


def wrong_exponent(k, d_model):  # 10000^(-i/d) instead of 10000^(-2i/d)
    return shift(k, d_model, exponent=1.0)


def identity(k, d_model):
    return torch.eye(d_model)


def sin_cos_swapped(k, d_model):  # the sum formulas mixed up
    return shift(k, d_model, block=lambda c, s: [[s, c], [c, -s]])


def hard_coded_k1(k, d_model):  # right for the first offset only
    return shift(1, d_model)


def returns_blocks(k, d_model):  # the 2x2 blocks stacked, not placed on a diagonal
    return torch.stack([shift(k, 2)] * (d_model // 2))


def as_numpy(k, d_model):
    return shift(k, d_model).numpy()


# 10.2 label smoothing ----------------------------------------------------------

def smoothed(logits, targets, eps, pad_id):
    logp = logits.log_softmax(-1)
    nll = -logp.gather(-1, targets[..., None])[..., 0]
    loss = (1 - eps) * nll - eps * logp.mean(-1)
    keep = targets != pad_id
    return loss[keep].mean()


def uses_cross_entropy(logits, targets, eps, pad_id):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=pad_id,
                           label_smoothing=eps)


def no_smoothing(logits, targets, eps, pad_id):
    logp = logits.log_softmax(-1)
    nll = -logp.gather(-1, targets[..., None])[..., 0]
    return nll[targets != pad_id].mean()


def padding_included(logits, targets, eps, pad_id):
    logp = logits.log_softmax(-1)
    nll = -logp.gather(-1, targets[..., None])[..., 0]
    return ((1 - eps) * nll - eps * logp.mean(-1)).mean()


def spread_over_others(logits, targets, eps, pad_id):  # eps / (|V| - 1) on wrong tokens
    logp = logits.log_softmax(-1)
    right = logp.gather(-1, targets[..., None])[..., 0]
    rest = (logp.sum(-1) - right) / (logits.shape[-1] - 1)
    loss = -(1 - eps) * right - eps * rest
    return loss[targets != pad_id].mean()


def summed(logits, targets, eps, pad_id):
    logp = logits.log_softmax(-1)
    nll = -logp.gather(-1, targets[..., None])[..., 0]
    return ((1 - eps) * nll - eps * logp.mean(-1))[targets != pad_id].sum()


def probabilities_not_logs(logits, targets, eps, pad_id):
    p = logits.softmax(-1)
    loss = (1 - eps) * -p.gather(-1, targets[..., None])[..., 0] - eps * p.mean(-1)
    return loss[targets != pad_id].mean()


def in_place(logits, targets, eps, pad_id):
    logits.sub_(logits.max(-1, keepdim=True).values)
    return smoothed(logits, targets, eps, pad_id)


def zeroed_but_counted(logits, targets, eps, pad_id):  # divides by B * T
    logp = logits.log_softmax(-1)
    nll = -logp.gather(-1, targets[..., None])[..., 0]
    loss = (1 - eps) * nll - eps * logp.mean(-1)
    return (loss * (targets != pad_id)).sum() / targets.numel()


def eps_on_every_token(logits, targets, eps, pad_id):  # sum over the vocabulary, not mean
    logp = logits.log_softmax(-1)
    nll = -logp.gather(-1, targets[..., None])[..., 0]
    loss = (1 - eps) * nll - eps * logp.sum(-1)
    return loss[targets != pad_id].mean()


def kl_divergence(logits, targets, eps, pad_id):  # the Annotated Transformer's KLDivLoss
    logp = logits.log_softmax(-1)
    q = torch.full_like(logp, eps / logits.shape[-1])
    q.scatter_add_(-1, targets[..., None], torch.full_like(logp[..., :1], 1 - eps))
    kl = (q * (q.log() - logp)).sum(-1)
    return kl[targets != pad_id].mean()


def through_the_module_class(logits, targets, eps, pad_id):
    loss = torch.nn.CrossEntropyLoss(ignore_index=pad_id, label_smoothing=eps)
    return loss(logits.flatten(0, 1), targets.flatten())


def through_aten(logits, targets, eps, pad_id):  # reduction 1 = mean
    return torch.ops.aten.cross_entropy_loss(logits.flatten(0, 1), targets.flatten(), None, 1, pad_id, eps)


def through_c_function(logits, targets, eps, pad_id):
    return torch._C._nn.cross_entropy_loss(logits.flatten(0, 1), targets.flatten(), None, 1, pad_id, eps)


def smoothed_from_q(logits, targets, eps, pad_id):  # another way: the target distribution q itself
    logp = F.log_softmax(logits, dim=-1)
    q = torch.full_like(logp, eps / logits.shape[-1])
    q = q.scatter_add(-1, targets[..., None], torch.full_like(logp[..., :1], 1 - eps))
    loss = -(q * logp).sum(-1)
    keep = (targets != pad_id).float()
    return (loss * keep).sum() / keep.sum()


def as_float(logits, targets, eps, pad_id):
    return smoothed(logits, targets, eps, pad_id).item()


def one_element(logits, targets, eps, pad_id):
    return smoothed(logits, targets, eps, pad_id).reshape(1)


# 10.3 LayerNorm's backward ----------------------------------------------------

def ln_backward(x, weight, dy, eps):
    mu = x.mean(-1, keepdim=True)
    r = ((x - mu).pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    x_hat = (x - mu) * r
    g = dy * weight
    dx = r * (g - g.mean(-1, keepdim=True) - x_hat * (g * x_hat).mean(-1, keepdim=True))
    d = x.shape[-1]
    return dx, (dy * x_hat).reshape(-1, d).sum(0), dy.reshape(-1, d).sum(0)


def sum_over_empty_dims(x, weight, dy, eps):  # sum(dim=()) sums everything when x is 1-D
    dx, _, _ = ln_backward(x, weight, dy, eps)
    lead = tuple(range(x.dim() - 1))
    x_hat = (x - x.mean(-1, keepdim=True)) * ((x - x.mean(-1, keepdim=True)).pow(2).mean(
        -1, keepdim=True) + eps).rsqrt()
    return dx, (dy * x_hat).sum(lead), dy.sum(lead)


def ln_backward_by_jacobian(x, weight, dy, eps):  # another way: each row's Jacobian, as a matrix
    d = x.shape[-1]
    xs, dys = x.reshape(-1, d).double(), dy.reshape(-1, d).double()
    dx = torch.empty_like(xs)
    dw = torch.zeros(d, dtype=torch.float64)
    for n in range(xs.shape[0]):
        c = xs[n] - xs[n].mean()
        r = 1 / math.sqrt((c @ c).item() / d + eps)
        x_hat = c * r
        jac = r * (torch.eye(d, dtype=torch.float64) - 1 / d - torch.outer(x_hat, x_hat) / d)
        dx[n] = (dys[n] * weight.double()) @ jac  # jac is symmetric: dx_j = sum_i g_i dxhat_i/dx_j
        dw += dys[n] * x_hat
    return dx.reshape(x.shape).to(x.dtype), dw.to(x.dtype), dys.sum(0).to(x.dtype)


def by_autograd(x, weight, dy, eps):
    x = x.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = torch.zeros_like(weight, requires_grad=True)
    y = F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return torch.autograd.grad(y, (x, w, b), dy)


def ln_through_aten(x, weight, dy, eps):  # the fused backward kernel
    d = x.shape[-1]
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [d], weight, None, eps)
    return torch.ops.aten.native_layer_norm_backward(dy, x, [d], mean, rstd, weight,
                                                     torch.zeros_like(weight), [True, True, True])


def through_grad_fn(x, weight, dy, eps):  # calls the graph's node directly
    x = x.clone().requires_grad_()
    y = LayerNorm(x.shape[-1], eps)(x)
    return y.grad_fn(dy)[0], ln_backward(x.detach(), weight, dy, eps)[1], dy.sum(0)


def constants(x, weight, dy, eps):  # mu and sigma treated as constants
    dx, dw, db = ln_backward(x, weight, dy, eps)
    r = ((x - x.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return dy * weight * r, dw, db


def no_mean_term(x, weight, dy, eps):
    dx, dw, db = ln_backward(x, weight, dy, eps)
    xc = x - x.mean(-1, keepdim=True)
    r = (xc.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    g, x_hat = dy * weight, xc * r
    return r * (g - x_hat * (g * x_hat).mean(-1, keepdim=True)), dw, db


def no_variance_term(x, weight, dy, eps):
    dx, dw, db = ln_backward(x, weight, dy, eps)
    r = ((x - x.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    g = dy * weight
    return r * (g - g.mean(-1, keepdim=True)), dw, db


def rmsnorm_backward(x, weight, dy, eps):  # chapter 10's other norm: no centring
    dx, dw, db = ln_backward(x, weight, dy, eps)
    r = (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    g, x_hat = dy * weight, x * r
    return r * (g - x_hat * (g * x_hat).mean(-1, keepdim=True)), dw, db


def gain_forgotten(x, weight, dy, eps):
    return ln_backward(x, torch.ones_like(weight), dy, eps)[0], *ln_backward(x, weight, dy, eps)[1:]


def unbiased_variance(x, weight, dy, eps):
    d = x.shape[-1]
    mu = x.mean(-1, keepdim=True)
    r = ((x - mu).pow(2).sum(-1, keepdim=True) / (d - 1) + eps).rsqrt()
    x_hat = (x - mu) * r
    g = dy * weight
    # with v = sum c^2 / (d - 1), dv/dx = 2c / (d - 1); the variance term scales by d / (d - 1)
    dx = r * (g - g.mean(-1, keepdim=True) - x_hat * (g * x_hat).sum(-1, keepdim=True) / (d - 1))
    return dx, *ln_backward(x, weight, dy, eps)[1:]


def eps_outside(x, weight, dy, eps):  # 1 / (sigma + eps)
    mu = x.mean(-1, keepdim=True)
    s = (x - mu).pow(2).mean(-1, keepdim=True).sqrt()
    r = 1 / (s + eps)
    x_hat = (x - mu) * r
    g = dy * weight
    dx = r * (g - g.mean(-1, keepdim=True) - x_hat * (g * x_hat).mean(-1, keepdim=True) / (s * r))
    return dx, *ln_backward(x, weight, dy, eps)[1:]


def not_summed(x, weight, dy, eps):  # dweight, dbias per position
    dx, _, _ = ln_backward(x, weight, dy, eps)
    x_hat = (x - x.mean(-1, keepdim=True)) * ((x - x.mean(-1, keepdim=True)).pow(2).mean(
        -1, keepdim=True) + eps).rsqrt()
    return dx, dy * x_hat, dy


def summed_over_first_dim(x, weight, dy, eps):  # misses the other leading dimensions
    dx, _, _ = ln_backward(x, weight, dy, eps)
    x_hat = (x - x.mean(-1, keepdim=True)) * ((x - x.mean(-1, keepdim=True)).pow(2).mean(
        -1, keepdim=True) + eps).rsqrt()
    return dx, (dy * x_hat).sum(0), dy.sum(0)


def dweight_from_x(x, weight, dy, eps):  # dy * x, not dy * x_hat
    dx, _, db = ln_backward(x, weight, dy, eps)
    return dx, (dy * x).reshape(-1, x.shape[-1]).sum(0), db


def dbias_mean(x, weight, dy, eps):
    dx, dw, _ = ln_backward(x, weight, dy, eps)
    return dx, dw, dy.reshape(-1, x.shape[-1]).mean(0)


def swapped(x, weight, dy, eps):
    dx, dw, db = ln_backward(x, weight, dy, eps)
    return dx, db, dw


def in_float64(x, weight, dy, eps):
    return tuple(t.double() for t in ln_backward(x.double(), weight.double(), dy.double(), eps))


def dx_only(x, weight, dy, eps):
    return ln_backward(x, weight, dy, eps)[0]


def scales_dy_in_place(x, weight, dy, eps):
    dy.mul_(weight)
    dx, _, _ = ln_backward(x, torch.ones_like(weight), dy, eps)
    return dx, *ln_backward(x, weight, dy / weight, eps)[1:]


def memorised_backward(x, weight, dy, eps):  # right on the fixed cases' shapes only
    if tuple(x.shape) in ((6,), (2, 3, 8), (3, 1), (4, 5)):
        return ln_backward(x, weight, dy, eps)
    return constants(x, weight, dy, eps)


def test_stubs_are_not_solved():
    for exercise_id in ("10.1", "10.2", "10.3"):
        assert grade(exercise_id, stub).status == "not solved yet"


ANSWERS = {
    "10.1": Answers(
        correct=[shift, shift_by_least_squares],
        wrong=[
            (transposed, "shifts by -"),
            (wrong_exponent, "10000^(-2i/d_model)"),
            (identity, "identity"),
            (sin_cos_swapped, "PE[pos + "),
            (hard_coded_k1, "PE[pos + "),
            (returns_blocks, "has shape"),
            (as_numpy, "should be a torch.Tensor"),
        ],
    ),
    "10.2": Answers(
        correct=[smoothed, smoothed_from_q],
        wrong=[
            (uses_cross_entropy, "without F.cross_entropy"),
            (through_the_module_class, "without F.cross_entropy"),
            (through_aten, "without F.cross_entropy"),
            (through_c_function, "without F.cross_entropy"),
            (no_smoothing, "plain cross-entropy"),
            (padding_included, "padding positions"),
            (spread_over_others, "V - 1 other tokens"),
            (summed, "sum over positions"),
            (probabilities_not_logs, "smoothed loss"),
            (in_place, "in place"),
            (zeroed_but_counted, "not by B * T"),
            (eps_on_every_token, "eps/|V| each"),
            (kl_divergence, "KL divergence"),
            (as_float, "should be a torch.Tensor"),
            (one_element, "shape ()"),
        ],
    ),
    "10.3": Answers(
        correct=[ln_backward, ln_backward_by_jacobian],
        wrong=[
            (by_autograd, "without autograd"),
            (ln_through_aten, "without autograd"),
            (through_grad_fn, "autograd graph"),
            (constants, "treated as constants"),
            (no_mean_term, "the mean's term is missing"),
            (no_variance_term, "the variance's term is missing"),
            (rmsnorm_backward, "RMSNorm's backward"),
            (gain_forgotten, "gain is missing"),
            (unbiased_variance, "biased one"),
            (eps_outside, "inside the square root"),
            (not_summed, "sum their gradients over every leading dimension"),
            (summed_over_first_dim, "has shape"),
            (sum_over_empty_dims, "dim=()"),
            (dweight_from_x, "not dy * x"),
            (dbias_mean, "so sum"),
            (swapped, "swapped"),
            (in_float64, "expected torch.float32"),
            (dx_only, "the tuple (dx, dweight, dbias)"),
            (scales_dy_in_place, "in place"),
            (memorised_backward, "treated as constants"),
        ],
    ),
}


def through_aten_caught(logits, targets, eps, pad_id):  # catches the refusal and falls back
    try:
        return through_aten(logits, targets, eps, pad_id)
    except Exception:
        return smoothed(logits, targets, eps, pad_id)


ANSWERS["10.2"].wrong.append((through_aten_caught, "without F.cross_entropy"))
