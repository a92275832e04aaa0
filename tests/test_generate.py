"""Generation, sampling and beam search: one decode loop, its checks, stop tokens in every decoder, length
penalties, top-p on a GPT-2-sized vocabulary, integer dtypes, the eval-mode context and the ignored-target loss."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlib import GPT, GPTConfig
from attnlib._checks import cross_entropy_loss, eval_mode, token_id_list, token_ids
from attnlib.generation import beam_search, generate, sample_next_token, top_k_filter, top_p_filter
from attnlib.models.transformer import Transformer
from attnlib.tokenizers import BPETokenizer, CharTokenizer, WordTokenizer

SMALL = dict(vocab_size=20, block_size=16, n_layers=2, n_heads=2, d_model=16)
PAD, BOS, EOS = 0, 1, 2


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(**SMALL)).eval()


@pytest.fixture(scope="module")
def seq2seq():
    torch.manual_seed(0)
    return Transformer(20, 17, d_model=32, n_heads=4, n_layers=2, block_size=24).eval()


# --- greedy == argmax of a forward pass written out by hand ---------------------------------------------------------

def forward_by_hand(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """GPT-2's forward pass from the model's weights with torch primitives only (no attnlib module is called)."""
    c = model.config
    p = dict(model.named_parameters())
    T = idx.shape[1]
    x = p["tok_emb.weight"][idx] + p["pos_emb.weight"][:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(c.n_layers):
        layer = {name.removeprefix(f"blocks.{i}."): t for name, t in p.items() if name.startswith(f"blocks.{i}.")}
        w = layer.__getitem__
        h = F.layer_norm(x, (c.d_model,), w("ln_1.weight"), w("ln_1.bias"))
        q, k, v = (h @ w("attn.qkv.weight").T + w("attn.qkv.bias")).split(c.d_model, dim=-1)
        heads = [slice(j * c.head_dim, (j + 1) * c.head_dim) for j in range(c.n_heads)]
        out = []
        for s in heads:
            scores = (q[..., s] @ k[..., s].transpose(-1, -2)) / math.sqrt(c.head_dim)
            out.append(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[..., s])
        x = x + torch.cat(out, dim=-1) @ w("attn.out_proj.weight").T + w("attn.out_proj.bias")
        h = F.layer_norm(x, (c.d_model,), w("ln_2.weight"), w("ln_2.bias"))
        h = F.gelu(h @ w("mlp.fc.weight").T + w("mlp.fc.bias"), approximate=c.gelu_approximate)
        x = x + h @ w("mlp.proj.weight").T + w("mlp.proj.bias")
    x = F.layer_norm(x, (c.d_model,), p["ln_f.weight"], p["ln_f.bias"])
    return x @ p["tok_emb.weight"].T


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generation_is_the_argmax_of_a_forward_pass_by_hand(gpt, use_cache):
    prompt = torch.randint(0, 20, (2, 4), generator=torch.Generator().manual_seed(1))
    out = gpt.generate(prompt, 18, temperature=0, use_cache=use_cache)  # 22 > block_size: the window slides
    assert out.shape == (2, 22) and torch.equal(out[:, :4], prompt)
    with torch.no_grad():
        for t in range(4, 22):
            expected = forward_by_hand(gpt, out[:, max(0, t - 16) : t])[:, -1].argmax(-1)
            assert torch.equal(out[:, t], expected)


# --- integer dtypes ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8, torch.int8])
def test_prompts_of_any_integer_dtype_generate_the_same_tokens(gpt, dtype):
    prompt = torch.tensor([[3, 7, 1], [19, 0, 5]])
    expected = gpt.generate(prompt, 6, temperature=0)
    out = gpt.generate(prompt.to(dtype), 6, temperature=0)
    assert out.dtype == torch.long and torch.equal(out, expected)
    tokens, score = beam_search(gpt, prompt[:1].to(dtype), 4, beam_width=2)
    expected_tokens, expected_score = beam_search(gpt, prompt[:1], 4, beam_width=2)
    assert torch.equal(tokens, expected_tokens) and score == expected_score


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_the_transformer_takes_any_integer_dtype(seq2seq, dtype):
    src, tgt = torch.randint(3, 17, (2, 6)), torch.randint(3, 17, (2, 5))
    logits, loss = seq2seq(src, tgt, tgt)
    logits_d, loss_d = seq2seq(src.to(dtype), tgt.to(dtype), tgt.to(dtype))
    torch.testing.assert_close(logits_d, logits)
    torch.testing.assert_close(loss_d, loss)
    assert torch.equal(seq2seq.greedy_decode(src.to(dtype), 5), seq2seq.greedy_decode(src, 5))


def test_tokenizers_decode_integer_tensors_of_any_dtype():
    chars = CharTokenizer("hello world")
    ids = torch.tensor(chars.encode("hello"))
    for dtype in (torch.int16, torch.uint8, torch.int32):
        assert chars.decode(ids.to(dtype)) == "hello"
    assert chars.decode(np.array(chars.encode("low"))) == "low"  # numpy integers too
    words = WordTokenizer.from_corpus("the cat sat")
    assert words.decode(torch.tensor(words.encode("the cat"), dtype=torch.int16)) == "the cat"


# --- top-p on a GPT-2-sized vocabulary ------------------------------------------------------------------------------

def test_top_p_one_keeps_all_50257_float32_logits():
    logits = torch.randn(4, 50257, generator=torch.Generator().manual_seed(0)) * 3  # float32
    probs = logits.softmax(-1).sort(dim=-1, descending=True).values
    assert ((probs.cumsum(-1) - probs) >= 1.0).any()  # the float32 cumsum reaches 1 before the last tokens
    assert torch.equal(top_p_filter(logits, 1.0), logits)
    g = torch.Generator().manual_seed(0)
    assert sample_next_token(logits, top_p=1.0, generator=g).shape == (4, 1)
    # below 1: the kept set is the reference's, computed in float64 by hand
    for p in (0.5, 0.9, 0.999999):
        sorted64 = logits.double().softmax(-1).sort(dim=-1, descending=True).values
        n_kept = ((sorted64.cumsum(-1) - sorted64) < p).sum(-1)
        assert torch.equal(torch.isfinite(top_p_filter(logits, p)).sum(-1), n_kept)


def test_a_tiny_temperature_is_greedy_not_nan():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    assert torch.isinf(logits.abs().max() / 1e-40)  # the plain division overflows
    out = sample_next_token(logits, temperature=1e-40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out[:, 0], logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_temperature_below_float32s_smallest_number_is_greedy_not_nan(dtype):
    # 1e-300 is 0 in float32 (where half precision divides too): 0 / 0 was nan (a logit of 0, or the shifted
    # maximum), and torch.multinomial raised a RuntimeError
    temperature = 1e-300
    logits = torch.tensor([[0.0], [1.0], [-1.0], [0.0]]) + torch.tensor([[0.0, -2.0, float("-inf")]])
    logits = torch.cat([logits, torch.tensor([[0.0, 0.0, -1.0]])]).to(dtype)
    assert torch.isnan(logits / temperature).any()
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        out = sample_next_token(logits, temperature=temperature, generator=g)[:, 0]
        assert torch.equal(out[:-1], torch.zeros(4, dtype=torch.long)) and out[-1].item() in (0, 1)


def test_float64_logits_whose_scaled_values_pass_float32s_range_are_greedy_not_nan():
    logits = torch.tensor([[0.0, 1.0, -1.0], [2.0, 0.0, float("-inf")]], dtype=torch.float64)
    assert torch.isfinite(logits[:, :2] / 1e-300).all()  # finite in float64, +inf in the float32 softmax
    out = sample_next_token(logits, temperature=1e-300, generator=torch.Generator().manual_seed(0))
    assert out[:, 0].tolist() == [1, 0]


# --- beam search: length penalty, stop tokens -----------------------------------------------------------------------

class TableDecoder:
    """A decoder whose next-token probabilities depend on the last token only (rows of ``table``), with the
    interface every decoding loop drives (:mod:`attnlib.generation.step`); it keeps no cache."""

    config = SimpleNamespace(vocab_size=3, block_size=64)

    def __init__(self):
        # token 0 = stop. From 2: stop 0.5, 1 0.45, 2 0.05. From 1: stop 0.9, 1 0.05, 2 0.05.
        self.table = torch.tensor([[1.0, 0.0, 0.0], [0.9, 0.05, 0.05], [0.5, 0.45, 0.05]]).log()
        self.calls = 0

    def new_cache(self, windows=True):
        return None

    def __call__(self, tokens, cache=None, attention_mask=None, positions=None, last_only=False):
        self.calls += 1
        logits = self.table[tokens]  # (B, T) -> (B, T, vocab_size)
        return (logits[:, -1:] if last_only else logits), None


def test_the_length_penalty_divides_each_beam_by_its_own_length():
    # Beams after two steps, both finished: [stop] with log 0.5 (1 token) and [1, stop] with log 0.45 + log 0.9
    # (2 tokens). By total, the short one wins; per token (alpha = 1), the long one: -0.693 < -0.904 / 2.
    short, long = math.log(0.5), math.log(0.45) + math.log(0.9)
    assert short > long and short / 1 < long / 2
    tokens, score = beam_search(TableDecoder(), torch.tensor([[2]]), 3, beam_width=2, stop_tokens=[0])
    assert tokens.tolist() == [[2, 0, 0, 0]] and score == pytest.approx(short)
    tokens, score = beam_search(TableDecoder(), torch.tensor([[2]]), 3, beam_width=2, stop_tokens=[0],
                                length_penalty=1.0)
    assert tokens.tolist() == [[2, 1, 0, 0]] and score == pytest.approx(long)


def test_beam_search_stops_when_every_beam_has_finished():
    decoder = TableDecoder()
    tokens, _ = beam_search(decoder, torch.tensor([[2]]), 10, beam_width=2, stop_tokens=0)
    assert decoder.calls == 2 and tokens.shape == (1, 11)  # padded with the stop token
    free, _ = beam_search(TableDecoder(), torch.tensor([[2]]), 3, beam_width=2)  # no stop token: never finishes
    assert free.tolist() == [[2, 0, 0, 0]]


def test_gpt_generate_stops_and_pads_each_row(gpt):
    prompt = torch.tensor([[3, 4], [5, 6]])
    free = gpt.generate(prompt, 8, temperature=0)
    stop = int(free[0, 4])  # the third token generated for row 0
    out = gpt.generate(prompt, 8, temperature=0, stop_tokens=torch.tensor([stop]))
    for row in range(2):
        generated = free[row, 2:].tolist()
        if stop in generated:
            first = generated.index(stop)
            assert out[row, 2 : 3 + first].tolist() == generated[: first + 1]
            assert (out[row, 3 + first :] == stop).all()
    assert torch.equal(gpt.generate(prompt, 8, temperature=0, stop_tokens=[]), free)


def test_the_transformer_decoders_stop_at_any_stop_token(seq2seq):
    src = torch.randint(3, 20, (2, 5))
    model = Transformer(20, 17, d_model=32, n_heads=4, n_layers=1, block_size=24).eval()
    with torch.no_grad():
        model.lm_head.bias.fill_(0.0)
        model.lm_head.bias[7] = 100.0  # always emits 7
    assert model.greedy_decode(src, 5, stop_tokens=[7]).tolist() == [[BOS, 7], [BOS, 7]]
    assert model.greedy_decode(src, 3).tolist() == [[BOS, 7, 7, 7]] * 2  # 7 is not eos: no stop
    tokens, score = model.beam_decode(src[:1], beam_width=3, max_new_tokens=5, stop_tokens=(7, 9))
    assert tokens.tolist() == [[BOS, 7]] and -1e-3 < score <= 0.0
    with torch.no_grad():
        model.lm_head.bias[7] = 0.0
        model.lm_head.bias[EOS] = 100.0
    assert model.beam_decode(src[:1], beam_width=2, max_new_tokens=5)[0].tolist() == [[BOS, EOS]]
    assert model.greedy_decode(src, 0).tolist() == [[BOS], [BOS]]


# --- bad input: every setting checked before any forward pass, even for max_new_tokens=0 ----------------------------

@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens=-1 must be an int >= 0"),
        (dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be an int; got 2.0"),
        (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an int; got True"),
        (dict(temperature=-0.5), ValueError, "temperature=-0.5 must be >= 0"),
        (dict(temperature=float("nan")), ValueError, "temperature=nan must be a finite number"),
        (dict(temperature=float("inf")), ValueError, "temperature=inf must be a finite number"),
        (dict(temperature="hot"), TypeError, "temperature must be a number; got 'hot'"),
        (dict(top_k=0), ValueError, "top_k=0 must be a positive integer"),
        (dict(top_k=2.5), TypeError, "top_k must be an int; got 2.5"),
        (dict(top_k=True), TypeError, "top_k must be an int; got True"),
        (dict(top_p=0.0), ValueError, "top_p=0.0 must be a number in \\(0, 1\\]"),
        (dict(top_p=1.5), ValueError, "top_p=1.5 must be a number in \\(0, 1\\]"),
        (dict(top_p=float("nan")), ValueError, "top_p=nan must be a number in \\(0, 1\\]"),
        (dict(top_p="0.9"), TypeError, "top_p must be a number in \\(0, 1\\]; got '0.9'"),
        (dict(stop_tokens=[20]), ValueError, "stop_tokens holds token id 20, outside the vocabulary \\[0, 20\\)"),
        (dict(stop_tokens=[3, -1]), ValueError, "stop_tokens holds token id -1, outside the vocabulary"),
        (dict(stop_tokens="eos"), TypeError, "stop_tokens must be an id or a sequence of ids; got 'eos'"),
        (dict(stop_tokens=[2.0]), TypeError, "stop_tokens\\[0\\]=2.0 is not an integer token id"),
        (dict(stop_tokens=torch.tensor([1.0])), TypeError, "stop_tokens must hold integer token ids.*torch.float32"),
    ],
)
@pytest.mark.parametrize("max_new_tokens", [0, 3])
def test_generate_checks_every_setting_up_front(gpt, kwargs, error, message, max_new_tokens):
    kwargs = {"max_new_tokens": max_new_tokens, **kwargs}
    with pytest.raises(error, match=message):
        gpt.generate(torch.zeros(1, 2, dtype=torch.long), **kwargs)


@pytest.mark.parametrize(
    "idx, error, message",
    [
        (torch.tensor([[1, 2, 20]]), ValueError, "idx holds token id 20, outside the vocabulary \\[0, 20\\)"),
        (torch.zeros(1, 2), TypeError, "idx must hold integer token ids.*got dtype torch.float32"),
        (torch.ones(1, 2, dtype=torch.bool), TypeError, "idx must hold integer token ids.*got dtype torch.bool"),
        (torch.zeros(3, dtype=torch.long), ValueError, "idx must have shape \\(B, T\\); got \\(3,\\)"),
        ([[1, 2]], TypeError, "idx must be a torch.Tensor of token ids; got list"),
        (torch.zeros(2, 0, dtype=torch.long), ValueError, "at least one prompt token.*\\(2, 0\\)"),
        # the bad id lies outside the last block_size=16 tokens the model would see: still refused
        (torch.cat([torch.tensor([[-4]]), torch.zeros(1, 20, dtype=torch.long)], 1), ValueError,
         "idx holds token id -4, outside the vocabulary \\[0, 20\\) \\(at index \\(0, 0\\)\\)"),
    ],
)
def test_generate_checks_every_prompt_id(gpt, idx, error, message):
    with pytest.raises(error, match=message):
        gpt.generate(idx, 0)
    if not (isinstance(idx, torch.Tensor) and idx.dim() == 2 and idx.shape[0] > 1):
        with pytest.raises(error, match=message):
            beam_search(gpt, idx, 0)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(beam_width=0), ValueError, "beam_width=0 must be a positive integer"),
        (dict(beam_width=1.5), TypeError, "beam_width must be an int; got 1.5"),
        (dict(length_penalty=float("nan")), ValueError, "length_penalty=nan must be a finite number"),
        (dict(length_penalty=float("-inf")), ValueError, "length_penalty=-inf must be a finite number"),
        (dict(length_penalty=None), TypeError, "length_penalty must be a number; got None"),
        (dict(stop_tokens=[99]), ValueError, "stop_tokens holds token id 99, outside the vocabulary \\[0, 20\\)"),
        (dict(max_new_tokens=-2), ValueError, "max_new_tokens=-2 must be an int >= 0"),
    ],
)
def test_beam_search_checks_every_setting_up_front(gpt, kwargs, error, message):
    kwargs = {"max_new_tokens": 0, **kwargs}
    with pytest.raises(error, match=message):
        beam_search(gpt, torch.zeros(1, 2, dtype=torch.long), **kwargs)


def test_beam_search_takes_one_prompt(gpt):
    with pytest.raises(ValueError, match="idx must have shape \\(1, T\\) \\(one prompt\\); got \\(2, 3\\)"):
        beam_search(gpt, torch.zeros(2, 3, dtype=torch.long), 3)
    with pytest.raises(TypeError, match="model must be a decoder with vocab_size or config.vocab_size; got object"):
        beam_search(object(), torch.zeros(1, 3, dtype=torch.long), 3)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m: m.greedy_decode(torch.randint(3, 20, (1, 5)), 24), ValueError,
         "max_new_tokens=24 \\+ 1 \\(bos\\) exceeds the model's block_size=24"),
        (lambda m: m.greedy_decode(torch.randint(3, 20, (1, 5)), -1), ValueError, "max_new_tokens=-1 must be an int >= 0"),
        (lambda m: m.greedy_decode(torch.randint(3, 20, (1, 5)), 4, stop_tokens=[17]), ValueError,
         "stop_tokens holds token id 17, outside the vocabulary \\[0, 17\\)"),
        (lambda m: m.greedy_decode(torch.full((1, 5), 20), 4), ValueError,
         "src holds token id 20, outside the vocabulary \\[0, 20\\)"),
        (lambda m: m.greedy_decode(torch.zeros(1, 5), 4), TypeError, "src must hold integer token ids.*torch.float32"),
        (lambda m: m.beam_decode(torch.randint(3, 20, (1, 5)), beam_width=0), ValueError,
         "beam_width=0 must be a positive integer"),
        (lambda m: m.beam_decode(torch.randint(3, 20, (1, 5)), length_penalty=float("inf")), ValueError,
         "length_penalty=inf must be a finite number"),
        (lambda m: m.beam_decode(torch.randint(3, 20, (2, 5))), ValueError, "one source of shape \\(1, T_src\\); got \\(2, 5\\)"),
        (lambda m: m(torch.randint(3, 20, (1, 5)), torch.randint(3, 17, (1, 3)), torch.full((1, 3), 17)), ValueError,
         "targets holds token id 17, outside the vocabulary \\[0, 17\\)"),
        (lambda m: m(torch.randint(3, 20, (1, 0)), torch.randint(3, 17, (1, 3))), ValueError,
         "src must hold at least one token per row; got shape \\(1, 0\\)"),
    ],
)
def test_the_transformer_decoders_check_their_input(seq2seq, call, error, message):
    with pytest.raises(error, match=message):
        call(seq2seq)


@pytest.mark.parametrize(
    "ids, error, message",
    [
        (torch.tensor([1.0, 2.0]), TypeError, "ids must hold integer token ids.*torch.float32"),
        (torch.tensor([True, False]), TypeError, "ids must hold integer token ids.*torch.bool"),
        (torch.tensor([[1, 2]]), ValueError, "ids must be a 1-D tensor; got shape \\(1, 2\\)"),
        ([1, 99], ValueError, "ids holds token id 99, outside the vocabulary \\[0, 8\\) \\(at index 1\\)"),
        ([1, "a"], TypeError, "ids\\[1\\]='a' is not an integer token id"),
        ("abc", TypeError, "ids must be a sequence of ints; got str"),
    ],
)
def test_tokenizers_check_ids_with_the_shared_helper(ids, error, message):
    chars = CharTokenizer("abcdefgh")
    with pytest.raises(error, match=message):
        chars.decode(ids)
    words = WordTokenizer(["w1", "w2", "w3", "w4"])  # 8 ids with the specials
    with pytest.raises(error, match=message):
        words.decode(ids)


def test_bpe_and_pad_batch_check_ids():
    bpe = BPETokenizer()
    with pytest.raises(ValueError, match="ids holds token id 256, not in the vocabulary of 256 tokens"):
        bpe.decode([104, 256])
    with pytest.raises(TypeError, match="ids must hold integer token ids.*torch.float64"):
        bpe.decode(torch.tensor([104.0], dtype=torch.float64))
    words = WordTokenizer(["a", "b"])
    with pytest.raises(ValueError, match="batch\\[1\\] holds token id 6, outside the vocabulary \\[0, 6\\)"):
        words.pad_batch([[1, 4], [1, 6]])


def test_token_id_helpers():
    assert token_ids("x", torch.tensor([[1, 2]], dtype=torch.uint8), 3).dtype == torch.long
    kept = torch.tensor([[1, 2]])
    assert token_ids("x", kept, 3) is kept  # int64 is not copied
    assert token_ids("y", torch.tensor([[-100, 2]]), 3, ignore_index=-100).tolist() == [[-100, 2]]
    assert token_id_list("ids", (np.int64(2), 1), 3) == [2, 1]
    with pytest.raises(ValueError, match="y holds token id -99, outside the vocabulary \\[0, 3\\)"):
        token_ids("y", torch.tensor([[-99, 2]]), 3, ignore_index=-100)


# --- eval mode -------------------------------------------------------------------------------------------------------

def test_eval_mode_restores_every_submodules_own_mode():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.Sequential(nn.Dropout(0.5)))
    model.train()
    model[2].eval()  # a frozen part stays frozen
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert model.training and model[1].training and not model[2].training and not model[2][0].training
    with pytest.raises(RuntimeError, match="boom"):
        with eval_mode(model):
            raise RuntimeError("boom")
    assert model.training and not model[2].training
    with pytest.raises(TypeError, match="eval_mode needs an nn.Module; got str"):
        with eval_mode("model"):
            pass


def test_generation_runs_in_eval_mode_and_restores_the_modes():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, dropout=0.5)).train()
    model.blocks[0].eval()
    prompt = torch.zeros(1, 2, dtype=torch.long)
    a = model.generate(prompt, 8, temperature=0)
    b = model.generate(prompt, 8, temperature=0)
    assert torch.equal(a, b)  # no dropout while generating
    beam_search(model, prompt, 3)
    assert model.training and not model.blocks[0].training and model.blocks[1].training


# --- the loss when every target is ignored ---------------------------------------------------------------------------

def test_cross_entropy_loss_equals_torch_and_is_zero_when_every_target_is_ignored():
    logits = torch.randn(2, 5, 7, requires_grad=True)
    targets = torch.randint(0, 7, (2, 5))
    targets[0, 1] = -100
    expected = F.cross_entropy(logits.reshape(10, 7), targets.reshape(10))
    torch.testing.assert_close(cross_entropy_loss(logits, targets), expected)
    ignored = torch.full((2, 5), -100)
    assert torch.isnan(F.cross_entropy(logits.reshape(10, 7), ignored.reshape(10)))  # what torch gives
    loss = cross_entropy_loss(logits, ignored)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    with pytest.raises(ValueError, match="targets of shape \\(2, 4\\) do not match logits of shape \\(2, 5, 7\\)"):
        cross_entropy_loss(logits, targets[:, :4])


def test_the_transformer_loss_is_finite_when_every_target_is_padding(seq2seq):
    src, tgt = torch.randint(3, 20, (2, 6)), torch.randint(3, 17, (2, 4))
    _, loss = seq2seq(src, tgt, torch.full((2, 4), PAD))
    assert loss.item() == 0.0


def test_generate_with_an_empty_batch_returns_it(gpt):
    empty = torch.zeros(0, 3, dtype=torch.long)
    assert generate(gpt, empty, 4).shape == (0, 3)
    assert top_k_filter(torch.zeros(0, 5), 2).shape == (0, 5)
