"""The chapter 09 exercise checks: a table of answers each check accepts and refuses (tests/exercise_table.py)."""
import math

import torch
from exercise_table import Answers

from attnlib.book.exercises import NOT_SOLVED, grade

# 09.1 cross-attention weights with an attention mask (True = real key) ----------------------------

def cross_weights(q, k, attention_mask=None, *, scale=True, tril=False, mask_axis="keys", fill=float("-inf"),
                  zero_empty=True, invert=False):
    scores = q @ k.transpose(-2, -1)  # (B, T_q, d) @ (B, d, T_k) -> (B, T_q, T_k)
    if scale:
        scores = scores / math.sqrt(q.shape[-1])
    allowed = torch.ones_like(scores, dtype=torch.bool)
    if tril:
        allowed = allowed & torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    if attention_mask is not None:
        m = ~attention_mask if invert else attention_mask
        if mask_axis == "keys":
            allowed = allowed & m[:, None, :]
        else:
            allowed = allowed & m[:, : scores.shape[1], None] if m.shape[1] >= scores.shape[1] else allowed
    weights = torch.softmax(scores.masked_fill(~allowed, fill), dim=-1)
    if zero_empty:
        weights = weights.masked_fill(~allowed, 0.0)
    return weights






def cross_weights_masked_softmax(q, k, attention_mask=None):  # the empty-row trick done by the library
    from attnlib.attention.masks import masked_softmax
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return masked_softmax(scores, None if attention_mask is None else attention_mask[:, None, :])


def cross_weights_transformers(q, k, attention_mask=None):  # transformers' eager attention returns the weights
    from transformers.models.llama.modeling_llama import eager_attention_forward
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 1, False
    add = None if attention_mask is None else torch.zeros(attention_mask.shape).masked_fill(
        ~attention_mask, float("-inf"))[:, None, None, :]
    _, w = eager_attention_forward(module, q[:, None], k[:, None], k[:, None], add, scaling=q.shape[-1] ** -0.5)
    return w[:, 0].nan_to_num(0.0)


def _library(q, k, attention_mask):
    from attnlib.attention import attention
    mask = None if attention_mask is None else attention_mask[:, None, :]
    return attention(q, k, torch.zeros(*k.shape[:-1], 1), mask)[1]


def cross_weights_in_a_thread(q, k, attention_mask=None):  # another thread has none of the check's watch
    import threading
    out = []
    worker = threading.Thread(target=lambda: out.append(_library(q, k, attention_mask)))
    worker.start()
    worker.join()
    return out[0]


def cross_weights_profile_off(q, k, attention_mask=None):
    import sys
    sys.setprofile(None)
    return _library(q, k, attention_mask)


def cross_weights_profile_off_by_exec(q, k, attention_mask=None):
    namespace = {"f": _library, "a": (q, k, attention_mask)}
    exec("import sys; sys.setprofile(None); out = f(*a)", namespace)
    return namespace["out"]


def cross_weights_other_frames(q, k, attention_mask=None):  # the check's thread's frames
    import sys
    sys._current_frames()
    return cross_weights(q, k, attention_mask, tril=True)


def cross_weights_gc(q, k, attention_mask=None):  # the check's objects through the garbage collector
    import gc
    gc.get_objects()
    return cross_weights(q, k, attention_mask, tril=True)


def cross_weights_aten_modes_off(q, k, attention_mask=None):  # torch's modes switched off, the raw operator
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask[:, None, :], float("-inf"))
    with torch._C.DisableTorchFunction():
        return torch.ops.aten._safe_softmax.default._op(scores, -1)


def _pass_everything(ch09):
    ch09.expect = lambda *a, **k: None
    ch09.expect_close = lambda *a, **k: None
    ch09.expect_tensor = lambda actual, *a, **k: actual


def cross_weights_integrity_off(q, k, attention_mask=None):  # the integrity check itself replaced
    import attnlib.book.exercises._run as run_module
    import attnlib.book.exercises.ch09 as ch09
    run_module.tampered = lambda: []
    _pass_everything(ch09)
    return torch.zeros(q.shape[0], q.shape[1], k.shape[1])


def cross_weights_snapshot_cleared(q, k, attention_mask=None):
    import attnlib.book.exercises._guard as guard
    import attnlib.book.exercises.ch09 as ch09
    guard._snapshot_of_guarded = None
    _pass_everything(ch09)
    return torch.zeros(q.shape[0], q.shape[1], k.shape[1])


def cross_weights_code_swapped(q, k, attention_mask=None):  # same function objects, other code
    import attnlib.book.exercises.ch09 as ch09
    ch09.expect.__code__ = (lambda *a, **k: None).__code__
    ch09.expect_close.__code__ = (lambda *a, **k: None).__code__
    return cross_weights(q, k, attention_mask, tril=True)


def cross_weights_builtin_shadowed(q, k, attention_mask=None):  # a module global that shadows a builtin
    import attnlib.book.exercises.ch09 as ch09
    ch09.bool = lambda x: True
    return cross_weights(q, k, attention_mask, tril=True)


def cross_weights_tensor_method(q, k, attention_mask=None):  # a method added to torch.Tensor over TensorBase's
    torch.Tensor.double = lambda self: torch.zeros(())
    return cross_weights(q, k, attention_mask, tril=True)


def cross_weights_default_dtype(q, k, attention_mask=None):  # global state left changed
    torch.set_default_dtype(torch.float64)
    return cross_weights(q, k, attention_mask)


# 09.2 additive (Bahdanau) cross-attention ----------------------------------------------------------

def additive(s, m, W_s, W_m, w, mask=None, *, tanh=True, softmax_dim=-1, mask_after=False, scale=False,
             project_values=False):
    features = (s @ W_s.T).unsqueeze(2) + (m @ W_m.T).unsqueeze(1)  # (B, T_q, T_k, d_a)
    scores = (torch.tanh(features) if tanh else features) @ w  # (B, T_q, T_k)
    if scale:
        scores = scores / math.sqrt(W_s.shape[0])
    if mask is not None and not mask_after:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=softmax_dim)
    if mask is not None and mask_after:
        weights = weights * mask[:, None, :]
    values = m @ W_m.T if project_values else m
    return weights @ values, weights









def test_09_2_stub_is_not_solved():
    def stub(*args):
        raise NotImplementedError("scores, softmax, context")

    assert grade("09.2", stub).status == NOT_SOLVED


# 09.3 AUC from ranks ------------------------------------------------------------------------------

def rank_auc(scores, labels, *, ties=True, descending=False, from_zero=False):
    s = -scores if descending else scores
    if ties:
        values, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)
        ends = counts.cumsum(0).double()  # last rank of each group of equal scores
        ranks = (ends - (counts.double() - 1) / 2)[inverse]  # average rank within the group
    else:
        ranks = torch.empty(len(s), dtype=torch.float64)
        ranks[s.argsort()] = torch.arange(1, len(s) + 1, dtype=torch.float64)
    if from_zero:
        ranks = ranks - 1
    pos = labels == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return ((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)).item()


def cross_weights_einsum(q, k, attention_mask=None):  # another way: einsum, then where
    scores = torch.einsum("bqd,bkd->bqk", q, k) / q.shape[-1] ** 0.5
    if attention_mask is None:
        return scores.softmax(-1)
    real = attention_mask[:, None, :]  # (B, 1, T_k)
    weights = scores.masked_fill(~real, float("-inf")).softmax(-1)
    return torch.where(real, weights, torch.zeros(()))  # rows with no real key: 0, not NaN


def cross_weights_library(q, k, attention_mask=None):  # the chapter's import: refused
    from attnlib.attention import attention

    mask = None if attention_mask is None else attention_mask[:, None, :]
    return attention(q, k, torch.zeros(*k.shape[:-1], 1), mask)[1].nan_to_num()


def cross_weights_through_aten(q, k, attention_mask=None):  # SDPA's ATen op reads the weights off an identity
    eye = torch.eye(k.shape[1]).expand(k.shape[0], -1, -1)
    mask = None if attention_mask is None else attention_mask[:, None, :]
    return torch.ops.aten.scaled_dot_product_attention(q, k, eye, attn_mask=mask).nan_to_num()


def cross_weights_in_place(q, k, attention_mask=None):
    q.mul_(1 / q.shape[-1] ** 0.5)  # scaled in the caller's tensor
    return cross_weights(q, k, attention_mask, scale=False)


def cross_weights_float64(q, k, attention_mask=None):
    return cross_weights(q.double(), k.double(), attention_mask)


def additive_einsum(s, m, W_s, W_m, w, mask=None):  # another way: einsum over the attention width
    a = torch.tanh(torch.einsum("bqs,as->bqa", s, W_s)[:, :, None] + torch.einsum("bkm,am->bka", m, W_m)[:, None])
    scores = torch.einsum("bqka,a->bqk", a, w)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    weights = scores.softmax(-1)
    return torch.einsum("bqk,bkm->bqm", weights, m), weights


def additive_swapped(s, m, W_s, W_m, w, mask=None):
    context, weights = additive(s, m, W_s, W_m, w, mask)
    return weights, context


def additive_list(s, m, W_s, W_m, w, mask=None):
    return list(additive(s, m, W_s, W_m, w, mask))


def additive_in_place(s, m, W_s, W_m, w, mask=None):
    out = additive(s, m, W_s, W_m, w, mask)
    s.zero_()
    return out


def rank_auc_tensor(scores, labels):
    return torch.tensor(rank_auc(scores, labels))


def rank_auc_argsort(scores, labels):  # another way: mid-ranks by counting the lower and the equal scores
    s = scores.double()
    lower = (s[None, :] < s[:, None]).sum(1).double()  # (n,): how many scores are below each
    equal = (s[None, :] == s[:, None]).sum(1).double()
    ranks = lower + (equal + 1) / 2  # the average rank of its group of ties
    pos = labels == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def rank_auc_accuracy(scores, labels):  # accuracy at 0 is not AUC
    return ((scores > 0).long() == labels.long()).double().mean().item()


def rank_auc_sorts_in_place(scores, labels):
    scores.copy_(scores.sort().values)  # the labels no longer match
    return rank_auc(scores, labels)


ANSWERS = {
    "09.1": Answers(
        correct=[cross_weights, cross_weights_einsum],
        wrong=[
            (lambda q, k, attention_mask=None: cross_weights(q, k, attention_mask, tril=True), "no causal mask"),
            (lambda q, k, attention_mask=None: cross_weights(q, k, attention_mask, scale=False), "1/sqrt(d)"),
            (lambda q, k, attention_mask=None: cross_weights(q, k, attention_mask, zero_empty=False), "NaN"),
            (lambda q, k, attention_mask=None: cross_weights(q, k, attention_mask, invert=True), "padded key"),
            (lambda q, k, attention_mask=None: cross_weights(q, k, attention_mask, mask_axis="queries"), "padded key"),
            (lambda q, k, attention_mask=None: cross_weights(q, k, attention_mask, fill=-1e9, zero_empty=False),
             "a finite fill"),
            (cross_weights_library, "write the weights with tensor operations"),
            (cross_weights_through_aten, "write the weights with tensor operations"),
            (cross_weights_masked_softmax, "attnlib.attention.masks.masked_softmax"),
            (cross_weights_transformers, "transformers' eager_attention_forward"),
            # generic escapes, refused by run() for every exercise
            (cross_weights_in_a_thread, "_thread.start_new_thread"),
            (cross_weights_profile_off, "sys.setprofile"),
            (cross_weights_profile_off_by_exec, "sys.setprofile"),
            (cross_weights_other_frames, "sys._current_frames"),
            (cross_weights_gc, "gc.get_objects"),
            (cross_weights_aten_modes_off, "aten::_safe_softmax"),
            (cross_weights_integrity_off, "attnlib.book.exercises._run.tampered"),
            (cross_weights_snapshot_cleared, "_snapshot_of_guarded"),
            (cross_weights_code_swapped, "expect.__code__"),
            (cross_weights_builtin_shadowed, "attnlib.book.exercises.ch09.bool"),
            (cross_weights_tensor_method, "Tensor.double"),
            (cross_weights_default_dtype, "global settings"),
            (cross_weights_in_place, "in place"),
            (cross_weights_float64, "dtype"),
        ],
    ),
    "09.2": Answers(
        correct=[additive, additive_einsum],
        wrong=[
            (lambda *a: additive(*a, tanh=False), "tanh"),
            (lambda *a: additive(*a, softmax_dim=-2), "over the keys"),
            (lambda *a: additive(*a, mask_after=True), "-inf before the softmax"),
            (lambda *a: additive(*a, scale=True), "no 1/sqrt(d) scale"),
            (lambda *a: additive(*a, project_values=True), "weighted sum of the encoder states m"),
            (lambda s, m, W_s, W_m, w, mask=None: additive(s, m, W_s, W_m, w), "padded key"),
            (additive_swapped, "in this order"),
            (additive_list, "return a pair"),
            (additive_in_place, "in place"),
        ],
    ),
    "09.3": Answers(
        correct=[rank_auc, rank_auc_argsort],
        wrong=[
            (lambda s, y: rank_auc(s, y, ties=False), "average of their ranks"),
            (lambda s, y: rank_auc(s, y, descending=True), "wrong direction"),
            (lambda s, y: rank_auc(s, y, from_zero=True), "start at 1"),
            (rank_auc_accuracy, "expected"),
            (rank_auc_tensor, "should be a Python float"),
            (rank_auc_sorts_in_place, "in place"),
        ],
    ),
}
