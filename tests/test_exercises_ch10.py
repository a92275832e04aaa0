"""Chapter 10 graders: the reference is correct, a plausible slip is wrong, a stub is not solved."""
import torch

from attnlib.book.exercises import ch10, grade  # noqa: F401
from attnlib.positional import sinusoidal_encoding


def stub(*args):
    raise NotImplementedError("write me")


def test_10_1():
    assert grade("10.1", sinusoidal_encoding).status == "correct"

    def swapped(T, d_model):
        pe = sinusoidal_encoding(T, d_model)
        return torch.stack([pe[:, 1::2], pe[:, 0::2]], dim=-1).flatten(1)

    def half_exponent(T, d_model):
        ang = torch.arange(T)[:, None] / 10000 ** (torch.arange(d_model // 2) / d_model)
        return torch.stack([ang.sin(), ang.cos()], dim=-1).flatten(1)

    for wrong in (swapped, half_exponent):
        assert grade("10.1", wrong).status == "wrong"
    assert grade("10.1", stub).status == "not solved yet"


def test_10_2():
    def rms(x, weight, eps):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def root_twice(x, weight, eps):  # the source's formula
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * weight

    assert grade("10.2", rms).status == "correct"
    verdict = grade("10.2", root_twice)
    assert verdict.status == "wrong" and "twice" in verdict.detail
    assert grade("10.2", stub).status == "not solved yet"


def test_10_3():
    def mask(tgt, pad_id):
        T = tgt.shape[1]
        return torch.ones(T, T, dtype=torch.bool).tril() & (tgt != pad_id)[:, None, None, :]

    def padding_queries(tgt, pad_id):  # masks padding rows instead of columns
        T = tgt.shape[1]
        return torch.ones(T, T, dtype=torch.bool).tril() & (tgt != pad_id)[:, None, :, None]

    def causal_only(tgt, pad_id):
        T = tgt.shape[1]
        return torch.ones(T, T, dtype=torch.bool).tril().expand(tgt.shape[0], 1, T, T)

    assert grade("10.3", mask).status == "correct"
    assert grade("10.3", padding_queries).status == "wrong"
    assert grade("10.3", causal_only).status == "wrong"
    assert grade("10.3", stub).status == "not solved yet"
