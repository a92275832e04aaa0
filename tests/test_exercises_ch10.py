"""Chapter 10 graders: the reference is correct, plausible slips are wrong with a hint that names
them, a stub is not solved."""
import math

import torch
import torch.nn.functional as F
from exercise_table import Answers

from attnlib.book.exercises import grade
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


# 10.3 the decoder's mask -----------------------------------------------------

def mask(tgt, pad_id):
    T = tgt.shape[1]
    return torch.ones(T, T, dtype=torch.bool).tril() & (tgt != pad_id)[:, None, None, :]


def padding_queries(tgt, pad_id):  # masks padding rows instead of columns
    T = tgt.shape[1]
    return torch.ones(T, T, dtype=torch.bool).tril() & (tgt != pad_id)[:, None, :, None]


def causal_only(tgt, pad_id):
    T = tgt.shape[1]
    return torch.ones(T, T, dtype=torch.bool).tril().expand(tgt.shape[0], 1, T, T)


def upper_triangle(tgt, pad_id):
    T = tgt.shape[1]
    return torch.ones(T, T, dtype=torch.bool).triu() & (tgt != pad_id)[:, None, None, :]


def no_head_axis(tgt, pad_id):
    return mask(tgt, pad_id)[:, 0]


def float_mask(tgt, pad_id):
    return mask(tgt, pad_id).float()


def inverted(tgt, pad_id):  # True = masked, as nn.MultiheadAttention's key_padding_mask
    return ~mask(tgt, pad_id)


def rows_and_keys(tgt, pad_id):  # padding queries masked as well as padding keys
    return mask(tgt, pad_id) & (tgt != pad_id)[:, None, :, None]


def strictly_lower(tgt, pad_id):  # tril(-1): a query cannot see itself
    T = tgt.shape[1]
    return torch.ones(T, T, dtype=torch.bool).tril(-1) & (tgt != pad_id)[:, None, None, :]


def mask_from_arange(tgt, pad_id):  # another way: compare positions
    pos = torch.arange(tgt.shape[1])
    return (pos[None, :] <= pos[:, None])[None, None] & (tgt != pad_id)[:, None, None, :]


class AlwaysEqual(torch.Tensor):  # a subclass whose == and equal are always true
    def __eq__(self, other):
        return True


def subclass_mask(tgt, pad_id):
    return mask(tgt, pad_id).as_subclass(AlwaysEqual)


def memorised_mask(tgt, pad_id):  # right for batches of two, causal only otherwise
    return mask(tgt, pad_id) if tgt.shape[0] == 2 else causal_only(tgt, pad_id)


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
        correct=[mask, mask_from_arange],
        wrong=[
            (padding_queries, "padding QUERIES (rows)"),
            (causal_only, "padding KEYS"),
            (upper_triangle, "lower triangle"),
            (no_head_axis, "(B, 1, T, T)"),
            (float_mask, "boolean tensor"),
            (inverted, "inverted"),
            (rows_and_keys, "padding QUERIES (rows) were masked too"),
            (strictly_lower, "diagonal is masked"),
            (subclass_mask, "should be a torch.Tensor"),
            (memorised_mask, "padding KEYS"),
        ],
    ),
}


def through_aten_caught(logits, targets, eps, pad_id):  # catches the refusal and falls back
    try:
        return through_aten(logits, targets, eps, pad_id)
    except Exception:
        return smoothed(logits, targets, eps, pad_id)


ANSWERS["10.2"].wrong.append((through_aten_caught, "without F.cross_entropy"))
