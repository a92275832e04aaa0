"""Target attention (DIN): padding cannot matter, empty users give zeros, both modes against hand computations."""
import pytest
import torch

from attnlib.models import TargetAttention

MODES = ["din", "softmax"]


def _inputs(B=3, T=6, d=8, lengths=(6, 3, 1), seed=0):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(B, d, generator=g)
    v = torch.randn(B, T, d, generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T) True = real
    return e, v, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("activation", ["sigmoid", "prelu"])
def test_padding_positions_do_not_affect_the_output(mode, activation):
    torch.manual_seed(0)
    layer = TargetAttention(8, hidden=(16, 4), activation=activation, mode=mode)
    e, v, mask = _inputs()
    y, w = layer(e, v, mask, return_weights=True)
    changed = v.clone()
    changed[~mask] = torch.randn(int((~mask).sum()), 8) * 100.0
    changed[1, 5] = float("inf")
    changed[2, 4] = float("nan")
    y2, w2 = layer(e, changed, mask, return_weights=True)
    torch.testing.assert_close(y2, y, atol=0, rtol=0)
    torch.testing.assert_close(w2, w, atol=0, rtol=0)
    assert torch.equal(w[~mask], torch.zeros(int((~mask).sum())))
    # Padding appended at the end changes nothing either: the same users with T = 10.
    longer = torch.cat([v, torch.randn(3, 4, 8)], dim=1)
    y3 = layer(e, longer, torch.cat([mask, torch.zeros(3, 4, dtype=torch.bool)], dim=1))
    torch.testing.assert_close(y3, y, atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_a_user_with_no_behaviour_gets_zeros_and_finite_gradients(mode):
    torch.manual_seed(0)
    layer = TargetAttention(8, mode=mode)
    e, v, mask = _inputs(lengths=(0, 2, 0))
    e.requires_grad_(True)
    y, w = layer(e, v, mask, return_weights=True)
    assert torch.equal(y[[0, 2]], torch.zeros(2, 8))
    assert torch.equal(w[[0, 2]], torch.zeros(2, 6))
    assert y[1].abs().sum() > 0
    y.sum().backward()
    assert torch.isfinite(e.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
    # T = 0: nothing to pool.
    assert torch.equal(layer(e.detach(), torch.randn(3, 0, 8)), torch.zeros(3, 8))


def test_softmax_weights_sum_to_one_over_real_positions():
    torch.manual_seed(0)
    layer = TargetAttention(8, mode="softmax")
    e, v, mask = _inputs(lengths=(6, 3, 0))
    _, w = layer(e, v, mask, return_weights=True)
    torch.testing.assert_close(w.sum(-1), torch.tensor([1.0, 1.0, 0.0]))
    assert (w[mask] > 0).all()
    # It is exactly a masked softmax of the raw scores.
    scores = layer.scores(e, v)
    expected = torch.softmax(scores[1, :3], dim=0)
    torch.testing.assert_close(w[1, :3], expected)


def test_din_mode_equals_a_hand_computation():
    torch.manual_seed(0)
    layer = TargetAttention(4, hidden=(5,), mode="din")
    e, v, mask = _inputs(B=2, T=3, d=4, lengths=(3, 2))
    lin1, _, lin2 = layer.mlp
    y, w = layer(e, v, mask, return_weights=True)
    for b in range(2):
        expected_y = torch.zeros(4)
        for j in range(3):
            x = torch.cat([e[b], v[b, j], e[b] * v[b, j], e[b] - v[b, j]])  # (4d,)
            a = lin2(torch.sigmoid(lin1(x)))[0]  # the raw score: no softmax
            weight = a if mask[b, j] else torch.tensor(0.0)
            torch.testing.assert_close(w[b, j], weight)
            expected_y += weight * v[b, j]
        torch.testing.assert_close(y[b], expected_y)
    # Raw scores: they need not be positive or sum to 1.
    assert not torch.allclose(w.sum(-1), torch.ones(2))


def test_activation_inputs_layout():
    e = torch.tensor([[1.0, 2.0]])
    v = torch.tensor([[[3.0, 5.0], [0.0, -1.0]]])
    x = TargetAttention.activation_inputs(e, v)
    expected = torch.tensor([[[1.0, 2.0, 3.0, 5.0, 3.0, 10.0, -2.0, -3.0], [1.0, 2.0, 0.0, -1.0, 0.0, -2.0, 1.0, 3.0]]])
    assert torch.equal(x, expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T", [1, 4, 17])
def test_shapes_with_different_lengths(mode, T):
    layer = TargetAttention(6, hidden=(), mode=mode)
    y, w = layer(torch.randn(2, 6), torch.randn(2, T, 6), return_weights=True)
    assert y.shape == (2, 6) and w.shape == (2, T)
    assert layer(torch.randn(5, 6), torch.randn(5, T, 6)).shape == (5, 6)


def test_candidate_changes_the_weights():
    torch.manual_seed(0)
    layer = TargetAttention(8, mode="softmax")
    e, v, mask = _inputs()
    _, w1 = layer(e, v, mask, return_weights=True)
    _, w2 = layer(torch.randn(3, 8), v, mask, return_weights=True)
    assert not torch.allclose(w1[0], w2[0])


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(d_embed=0), ValueError, "d_embed=0"),
        (dict(d_embed=8, hidden=(36, 0)), ValueError, r"hidden\[1\]=0"),
        (dict(d_embed=8, mode="mean"), ValueError, "mode='mean'"),
        (dict(d_embed=8, activation="dice"), ValueError, "activation='dice'"),
    ],
)
def test_bad_configuration(kwargs, error, message):
    with pytest.raises(error, match=message):
        TargetAttention(**kwargs)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m: m(torch.randn(2, 1, 8), torch.randn(2, 4, 8)), ValueError, "candidate must have shape"),
        (lambda m: m(torch.randn(2, 8), torch.randn(2, 4, 6)), ValueError, "d_embed=8"),
        (lambda m: m(torch.randn(2, 8), torch.randn(3, 4, 8)), ValueError, "the same B"),
        (lambda m: m(torch.randn(2, 8), torch.randn(2, 4, 8), torch.ones(2, 4)), TypeError, "boolean"),
        (lambda m: m(torch.randn(2, 8), torch.randn(2, 4, 8), torch.ones(2, 5, dtype=torch.bool)), ValueError, r"\(B, T\)"),
        (lambda m: m(torch.ones(2, 8, dtype=torch.long), torch.randn(2, 4, 8)), TypeError, "floating point"),
    ],
)
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call(TargetAttention(8))
