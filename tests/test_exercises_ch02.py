"""Chapter 02's exercise checks: the answers they must accept and the mistakes they must refuse.

``ANSWERS`` is graded by ``tests/test_exercise_tables.py`` (under two seeds, with the generic cheats).
"""
import math

import torch
from exercise_table import Answers
from torch import nn

from attnlib.book.exercises import NOT_SOLVED, grade

# --------------------------------------------------------------------------- 02.1 dL/dq by hand


def query_gradient(q, k, v, g):  # the solution's way: the chain rule, one line per step
    scale = 1 / math.sqrt(q.shape[-1])
    weights = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1)  # (..., T_q, T_k)
    d_weights = g @ v.transpose(-2, -1)  # dL/dalpha: (..., T_q, T_k)
    d_scores = weights * (d_weights - (weights * d_weights).sum(-1, keepdim=True))
    return d_scores @ k * scale  # (..., T_q, T_k) @ (..., T_k, d) -> (..., T_q, d)


def query_gradient_jacobian(q, k, v, g):  # another way: the softmax's Jacobian as a matrix per query
    scale = 1 / math.sqrt(q.shape[-1])
    a = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1)
    jacobian = torch.diag_embed(a) - a.unsqueeze(-1) * a.unsqueeze(-2)  # (..., T_q, T_k, T_k)
    d_a = (g @ v.transpose(-2, -1)).unsqueeze(-2)  # (..., T_q, 1, T_k)
    d_s = (d_a @ jacobian).squeeze(-2)  # symmetric Jacobian
    return d_s @ k * scale


def _grad(q, k, v, g, scale_forward=True, scale_backward=True, jacobian="full"):
    scale = 1 / math.sqrt(q.shape[-1])
    a = torch.softmax(q @ k.transpose(-2, -1) * (scale if scale_forward else 1.0), dim=-1)
    d_a = g @ v.transpose(-2, -1)
    if jacobian == "full":
        d_s = a * (d_a - (a * d_a).sum(-1, keepdim=True))
    elif jacobian == "diagonal":
        d_s = a * d_a
    elif jacobian == "none":
        d_s = d_a
    else:  # the mean over the queries
        d_s = a * (d_a - (a * d_a).sum(-2, keepdim=True))
    return d_s @ k * (scale if scale_backward else 1.0)


def grad_no_backward_scale(q, k, v, g):
    return _grad(q, k, v, g, scale_backward=False)


def grad_unscaled(q, k, v, g):
    return _grad(q, k, v, g, scale_forward=False, scale_backward=False)


def grad_diagonal_jacobian(q, k, v, g):
    return _grad(q, k, v, g, jacobian="diagonal")


def grad_skips_softmax(q, k, v, g):
    return _grad(q, k, v, g, jacobian="none")


def grad_mean_over_queries(q, k, v, g):
    return _grad(q, k, v, g, jacobian="queries")


def grad_by_autograd(q, k, v, g):
    q = q.clone().requires_grad_()
    out = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v
    (out * g).sum().backward()
    return q.grad


def grad_by_torch_func(q, k, v, g):
    def loss(q_):
        return (torch.softmax(q_ @ k.transpose(-2, -1) / math.sqrt(q_.shape[-1]), dim=-1) @ v * g).sum()

    return torch.func.grad(loss)(q)


def grad_by_a_graph(q, k, v, g):  # autograd's engine called directly, past every refused name
    q = q.detach().requires_grad_()
    loss = (torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v * g).sum()
    engine = torch.autograd.Variable._execution_engine
    (grad,) = engine.run_backward((loss,), (torch.ones_like(loss),), False, False, (q,), True, False)
    return grad


def grad_wrt_keys(q, k, v, g):  # dL/dk instead: the shape of k
    a = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    d_a = g @ v.transpose(-2, -1)
    d_s = a * (d_a - (a * d_a).sum(-1, keepdim=True))
    return d_s.transpose(-2, -1) @ q / math.sqrt(q.shape[-1])


def grad_in_float64(q, k, v, g):
    return query_gradient(q.double(), k.double(), v.double(), g.double())


def grad_in_place(q, k, v, g):
    out = query_gradient(q, k, v, g)
    g.zero_()
    return out


# --------------------------------------------------------------------------- 02.2 fused QKV


def fuse_reference(sa_v2):  # the solution's way: stack the weights (and biases) as rows
    parts = (sa_v2.W_query, sa_v2.W_key, sa_v2.W_value)
    has_bias = sa_v2.W_query.bias is not None
    fused = nn.Linear(sa_v2.d_model, 3 * sa_v2.head_dim, bias=has_bias)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts], dim=0))
        if has_bias:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


def fuse_state_dict(sa_v2):  # another way: build the state dict and load it
    names = ("W_query", "W_key", "W_value")
    state = {"weight": torch.cat([getattr(sa_v2, n).weight.detach() for n in names])}
    if sa_v2.W_query.bias is not None:
        state["bias"] = torch.cat([getattr(sa_v2, n).bias.detach() for n in names])
    fused = nn.Linear(sa_v2.d_model, 3 * sa_v2.head_dim, bias="bias" in state)
    fused.load_state_dict(state)
    return fused


def _fuse(sa_v2, order=("W_query", "W_key", "W_value"), bias=None, transpose=False):
    parts = [getattr(sa_v2, name) for name in order]
    has_bias = sa_v2.W_query.bias is not None if bias is None else bias
    fused = nn.Linear(sa_v2.d_model, 3 * sa_v2.head_dim, bias=has_bias)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight.T if transpose else p.weight for p in parts]))
        if has_bias and sa_v2.W_query.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


def fuse_wrong_order(sa_v2):
    return _fuse(sa_v2, order=("W_key", "W_query", "W_value"))


def fuse_without_bias(sa_v2):
    return _fuse(sa_v2, bias=False)


def fuse_always_bias(sa_v2):  # nn.Linear's default bias=True, left with its random values
    return _fuse(sa_v2, bias=True)


def fuse_fresh_weights(sa_v2):
    return nn.Linear(sa_v2.d_model, 3 * sa_v2.head_dim, bias=sa_v2.W_query.bias is not None)


def fuse_transposed(sa_v2):  # copies W.T: fits the shape only when the head is square
    return _fuse(sa_v2, transpose=True)


class _Forwarding(nn.Linear):
    def __init__(self, sa_v2):
        super().__init__(sa_v2.d_model, 3 * sa_v2.head_dim, bias=sa_v2.W_query.bias is not None)
        self.head = sa_v2

    def forward(self, x):
        return torch.cat(self.head.project(x), dim=-1)


def fuse_subclass(sa_v2):  # a subclass whose forward calls the head: not a fused layer
    return _Forwarding(sa_v2)


def fuse_changes_the_head(sa_v2):
    fused = fuse_reference(sa_v2)
    with torch.no_grad():
        sa_v2.W_query.weight.zero_()
    return fused


# --------------------------------------------------------------------------- 02.3 variance of q.k


def variance_reference(head_dim, n, std=1.0, generator=None):
    q = std * torch.randn(n, head_dim, generator=generator)
    k = std * torch.randn(n, head_dim, generator=generator)
    dots = (q * k).sum(dim=-1)
    return dots.var().item(), (dots / math.sqrt(head_dim)).var().item()


def variance_einsum(head_dim, n, std=1.0, generator=None):  # another way: normal_ and einsum, mean of squares
    q = torch.empty(n, head_dim).normal_(0.0, std, generator=generator)
    k = torch.empty(n, head_dim).normal_(0.0, std, generator=generator)
    dots = torch.einsum("nd,nd->n", q, k)
    return float(dots.var()), float((dots * head_dim**-0.5).var())


def variance_divided_by_head_dim(head_dim, n, std=1.0, generator=None):
    unscaled, scaled = variance_reference(head_dim, n, std, generator)
    return unscaled, scaled / head_dim  # the variance of dots / head_dim


def variance_uniform_entries(head_dim, n, std=1.0, generator=None):
    q = std * torch.rand(n, head_dim, generator=generator)
    k = std * torch.rand(n, head_dim, generator=generator)
    dots = (q * k).sum(dim=-1)
    return dots.var().item(), (dots / math.sqrt(head_dim)).var().item()


def variance_ignores_std(head_dim, n, std=1.0, generator=None):
    return variance_reference(head_dim, n, 1.0, generator)


def variance_formula(head_dim, n, std=1.0, generator=None):
    return head_dim * std**4, std**4


def variance_global_rng(head_dim, n, std=1.0, generator=None):  # ignores the generator
    return variance_reference(head_dim, n, std, None)


def variance_as_tensors(head_dim, n, std=1.0, generator=None):
    q = std * torch.randn(n, head_dim, generator=generator)
    k = std * torch.randn(n, head_dim, generator=generator)
    dots = (q * k).sum(dim=-1)
    return dots.var(), (dots / math.sqrt(head_dim)).var()


ANSWERS = {
    "02.1": Answers(
        correct=[query_gradient, query_gradient_jacobian],
        wrong=[
            (grad_no_backward_scale, "factor 1/sqrt(head_dim) is missing"),
            (grad_unscaled, "divided by sqrt(head_dim)"),
            (grad_diagonal_jacobian, "only its diagonal"),
            (grad_skips_softmax, "skipped the softmax"),
            (grad_mean_over_queries, "keys of each query (dim=-1)"),
            (grad_by_autograd, "without autograd"),
            (grad_by_torch_func, "without autograd"),
            (grad_by_a_graph, "recorded an autograd graph"),
            (grad_wrt_keys, "the shape of k"),
            (grad_in_float64, "dtype"),
            (grad_in_place, "in place"),
        ],
    ),
    "02.2": Answers(
        correct=[fuse_reference, fuse_state_dict],
        wrong=[
            (fuse_wrong_order, "[W_query; W_key; W_value]"),
            (fuse_without_bias, "needs one too"),
            (fuse_always_bias, "should have none"),
            (fuse_fresh_weights, "compared with sa_v2.W_"),
            (fuse_transposed, "transposed"),
            (fuse_subclass, "exactly"),
            (fuse_changes_the_head, "in place"),
        ],
    ),
    "02.3": Answers(
        correct=[variance_reference, variance_einsum],
        wrong=[
            (variance_divided_by_head_dim, "divided the dot products by head_dim"),
            (variance_uniform_entries, "mean 0"),
            (variance_ignores_std, "multiply them by std"),
            (variance_formula, "random samples"),
            (variance_global_rng, "same seed gave different numbers"),
            (variance_as_tensors, ".item()"),
        ],
    ),
}


def test_the_stubs_are_not_solved():
    def stub(*args):
        raise NotImplementedError("write it")

    for exercise_id in ANSWERS:
        assert grade(exercise_id, stub).status == NOT_SOLVED
        assert grade(exercise_id, None).status == NOT_SOLVED
