"""The chapter 14 exercise checks, table-driven (``ANSWERS``, graded by tests/test_exercise_tables.py).

Expected values in these answers come from torch and transformers, never from the checks' helpers.
"""
import itertools
import math

import torch
from exercise_table import Answers
from torch import nn

from attnlib import SelfAttentionV1
from attnlib.book.exercises import NOT_SOLVED, grade
from attnlib.models.hf_gpt2 import hf_gpt2_key_map


def stub(*args, **kwargs):
    raise NotImplementedError("your code here")


# ---------------------------------------------------------------- 14.1
def _linear_or_matrix(head, name):
    p = getattr(head, name)
    return p.weight if isinstance(p, nn.Linear) else p


def copy_head(src, dst):
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            source = _linear_or_matrix(src, name)
            _linear_or_matrix(dst, name).copy_(source.T)  # V1 stores (d_model, head_dim), nn.Linear the transpose


def copy_head_shared(src, dst):
    """The source's answer: nn.Parameter(weight.T) works, but the new parameter is a view of src's weight."""
    for name in ("W_query", "W_key", "W_value"):
        if isinstance(dst, SelfAttentionV1):
            setattr(dst, name, nn.Parameter(getattr(src, name).weight.T))
        else:
            getattr(dst, name).weight = nn.Parameter(getattr(src, name).T)


def copy_head_no_transpose(src, dst):
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            source = _linear_or_matrix(src, name)
            target = _linear_or_matrix(dst, name)
            target.copy_(source if source.shape == target.shape else source.T)  # transposes only when forced


def copy_head_reshape(src, dst):
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            target = _linear_or_matrix(dst, name)
            target.copy_(_linear_or_matrix(src, name).reshape(target.shape))


def copy_head_nothing(src, dst):
    pass


# ---------------------------------------------------------------- 14.4
_RENAMES = {"wte": "tok_emb", "wpe": "pos_emb", "ln_f": "ln_f", "ln_1": "ln_1", "ln_2": "ln_2",
            "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.out_proj", "mlp.c_fc": "mlp.fc",
            "mlp.c_proj": "mlp.proj"}


def hf_key(name, tensor):
    if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
        return None
    parts = name.removeprefix("transformer.").split(".")
    prefix = ""
    if parts[0] == "h":  # transformer.h.{i}.<module>.<param>
        prefix, parts = f"blocks.{parts[1]}.", parts[2:]
    module, param = ".".join(parts[:-1]), parts[-1]
    conv1d = module.endswith(("c_attn", "c_proj", "c_fc")) and param == "weight"
    return f"{prefix}{_RENAMES[module]}.{param}", tensor.t().contiguous() if conv1d else tensor


def hf_key_regex(name, tensor):  # another way: regular expressions, transposing every 2-D weight of a block
    import re

    if re.search(r"\.attn\.(masked_)?bias$", name) or name == "lm_head.weight":
        return None
    new = re.sub(r"^transformer\.", "", name)
    new = re.sub(r"^h\.(\d+)\.", r"blocks.\1.", new)
    for theirs, ours in (("wte", "tok_emb"), ("wpe", "pos_emb"), ("c_attn", "qkv"), ("attn.c_proj", "attn.out_proj"),
                         ("c_fc", "fc"), ("mlp.c_proj", "mlp.proj")):
        new = new.replace(theirs, ours)
    return new, tensor.T if new.startswith("blocks.") and tensor.dim() == 2 else tensor


def _inverse_map(n_layers=3):
    return {theirs: (ours, transpose) for ours, (theirs, transpose) in hf_gpt2_key_map(n_layers).items()}


def hf_key_library(name, tensor):  # the library's key map: refused
    if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
        return None
    ours, transpose = _inverse_map()[name]
    return ours, tensor.t() if transpose else tensor


def hf_key_keeps_lm_head(name, tensor):
    if name == "lm_head.weight":
        return "lm_head.weight", tensor
    return hf_key(name, tensor)


def hf_key_transpose_when_needed(name, tensor):
    """Transposes only where the shape says so: misses the square attn.c_proj."""
    if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
        return None
    ours, transposed = hf_key(name, tensor)
    square = tensor.dim() == 2 and tensor.shape[0] == tensor.shape[1]
    return ours, tensor if square else transposed


def hf_key_keeps_buffers(name, tensor):
    if name.endswith(".attn.bias"):
        return name.replace("transformer.h.", "blocks."), tensor
    return hf_key(name, tensor)


def hf_key_transposes_everything(name, tensor):
    answer = hf_key(name, tensor)
    return None if answer is None else (answer[0], tensor.t() if tensor.dim() == 2 else tensor)


def hf_key_in_place(name, tensor):  # transposes the checkpoint's own tensor in place
    answer = hf_key(name, tensor)
    if answer is not None and answer[1] is not tensor and tensor.dim() == 2 and tensor.shape[0] == tensor.shape[1]:
        tensor.copy_(tensor.t().clone())
        return answer[0], tensor
    return answer


def hf_key_no_transpose(name, tensor):
    answer = hf_key(name, tensor)
    return None if answer is None else (answer[0], tensor)


# ---------------------------------------------------------------- 14.5
RESIDUAL = ("attn.out_proj.weight", "mlp.proj.weight")


def _gpt2_like_init(model, residual_std, other_std, ln_weight=1.0, draw="normal"):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(ln_weight if ("ln_" in name and name.endswith("weight")) else 0.0)
                continue
            std = residual_std if name.endswith(RESIDUAL) else other_std(name)
            if draw == "normal":
                p.normal_(0.0, std)
            else:
                p.uniform_(-std * 3**0.5, std * 3**0.5)  # the same std, not a normal


def gpt2_init_(model):
    _gpt2_like_init(model, 0.02 / math.sqrt(2 * model.config.n_layers), lambda name: 0.02)


def gpt2_init_unscaled(model):
    _gpt2_like_init(model, 0.02, lambda name: 0.02)


def gpt2_init_sqrt_n_layers(model):
    _gpt2_like_init(model, 0.02 / math.sqrt(model.config.n_layers), lambda name: 0.02)


def gpt2_init_every_block_scaled(model):
    scaled = 0.02 / math.sqrt(2 * model.config.n_layers)
    _gpt2_like_init(model, scaled, lambda name: scaled if name.startswith("blocks.") else 0.02)


def gpt2_init_layernorm_zero(model):
    _gpt2_like_init(model, 0.02 / math.sqrt(2 * model.config.n_layers), lambda name: 0.02,
                    ln_weight=0.0)


def gpt2_init_uniform(model):
    _gpt2_like_init(model, 0.02 / math.sqrt(2 * model.config.n_layers), lambda name: 0.02,
                    draw="uniform")


def gpt2_init_modules(model):  # another way: module by module, nn.init, the depth from the blocks
    n_residual = 2 * len(model.blocks)
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(n_residual) if name.endswith(("attn.out_proj", "mlp.proj")) else 0.02
            nn.init.normal_(module.weight, 0.0, std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


def gpt2_init_library(model):
    model.reset_parameters()


def gpt2_init_new_tensors(model):
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not model.lm_head:
            module.weight = nn.Parameter(torch.empty_like(module.weight))
    gpt2_init_(model)




# ---------------------------------------------------------------- 14.1 (more)
def copy_head_state_dict(src, dst):  # another way: a state dict in dst's layout, loaded (load_state_dict copies)
    state = {}
    for name in ("W_query", "W_key", "W_value"):
        source = _linear_or_matrix(src, name).detach()
        key = f"{name}.weight" if isinstance(getattr(dst, name), nn.Linear) else name
        state[key] = source.T.clone()
    dst.load_state_dict(state)


def copy_head_two_of_three(src, dst):  # forgets the values
    with torch.no_grad():
        for name in ("W_query", "W_key"):
            _linear_or_matrix(dst, name).copy_(_linear_or_matrix(src, name).T)


def copy_head_moves_src(src, dst):  # transposes src's own matrices in place on the way
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            source = _linear_or_matrix(src, name)
            _linear_or_matrix(dst, name).copy_(source.T)
            source.add_(1e-3)  # a 'harmless' nudge of the source


# ---------------------------------------------------------------- 14.2
def _turn(o, a, b):
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def can_win(k):
    points = [tuple(p) for p in k.tolist()]
    unique = sorted(set(points))
    hull = set(unique)
    if len(unique) > 2:  # Andrew's monotone chain; <= 0 drops the keys on an edge
        hull = set()
        for chain in (unique, unique[::-1]):
            part = []
            for p in chain:
                while len(part) >= 2 and _turn(part[-2], part[-1], p) <= 0:
                    part.pop()
                part.append(p)
            hull |= set(part[:-1])
    return torch.tensor([p in hull and points.count(p) == 1 for p in points], dtype=torch.bool)


def can_win_not_in_others_hull(k):  # another way: key j wins iff it is outside the hull of the other keys
    points = [tuple(p) for p in k.tolist()]

    def in_segment(p, a, b):
        return _turn(a, b, p) == 0 and min(a[0], b[0]) <= p[0] <= max(a[0], b[0]) and \
            min(a[1], b[1]) <= p[1] <= max(a[1], b[1])

    def in_triangle(p, a, b, c):
        d = [_turn(a, b, p), _turn(b, c, p), _turn(c, a, p)]
        return not (min(d) < 0 < max(d))

    wins = []
    for j, p in enumerate(points):
        others = points[:j] + points[j + 1:]
        inside = p in others or any(in_segment(p, a, b) for a, b in itertools.combinations(others, 2)) or any(
            in_triangle(p, a, b, c) for a, b, c in itertools.combinations(others, 3) if _turn(a, b, c) != 0)
        wins.append(not inside)
    return torch.tensor(wins, dtype=torch.bool)


def can_win_axis_extremes(k):  # the width-1 answer, per coordinate
    wins = torch.zeros(k.shape[0], dtype=torch.bool)
    for column in k.T:
        wins |= (column == column.max()) | (column == column.min())
    return wins


def can_win_sampled(k):  # 720 directions around the circle
    angles = torch.arange(720, dtype=torch.float64) * (2 * math.pi / 720)
    q = torch.stack([angles.cos(), angles.sin()], dim=-1)  # (720, 2)
    scores = q @ k.T  # (720, T)
    top = scores.max(dim=-1, keepdim=True).values
    strict = (scores == top).sum(-1) == 1
    wins = torch.zeros(k.shape[0], dtype=torch.bool)
    wins[scores.argmax(-1)[strict]] = True
    return wins


def can_win_with_edges(k):  # keeps the keys on the hull's edges (a turn of 0 is not dropped)
    points = [tuple(p) for p in k.tolist()]
    unique = sorted(set(points))
    hull = set(unique)
    if len(unique) > 2:
        hull = set()
        for chain in (unique, unique[::-1]):
            part = []
            for p in chain:
                while len(part) >= 2 and _turn(part[-2], part[-1], p) < 0:
                    part.pop()
                part.append(p)
            hull |= set(part[:-1])
    return torch.tensor([p in hull and points.count(p) == 1 for p in points], dtype=torch.bool)


def can_win_repeats(k):  # a repeated corner counted as a winner
    points = [tuple(p) for p in k.tolist()]
    unique = torch.tensor(sorted(set(points)), dtype=k.dtype)
    corners = {tuple(p) for p, w in zip(unique.tolist(), can_win(unique).tolist()) if w}
    return torch.tensor([p in corners for p in points], dtype=torch.bool)


def can_win_largest_norms(k):  # the longest keys
    norms = k.norm(dim=-1)
    return norms >= norms.quantile(0.5)


def can_win_indices(k):  # the indices of the winners, not a mask
    return can_win(k).nonzero().flatten()


# ---------------------------------------------------------------- 14.3
def count_parameters(config):
    d, hd, L, V = config.d_model, config.head_dim, config.n_layers, config.vocab_size
    bias = 1 if config.bias else 0
    qkv = (config.n_heads + 2 * config.n_kv_heads) * hd  # queries, then n_kv_heads keys and values
    attn = d * qkv + bias * qkv + config.n_heads * hd * d + bias * d
    mlp = d * config.d_ff + bias * config.d_ff + config.d_ff * d + bias * d
    norm = (2 if bias else 1) * d  # a LayerNorm: weight, and a bias when bias=True
    embeddings = V * d + (config.block_size * d if config.position == "learned" else 0)
    head = 0 if config.tie_embeddings else V * d
    return embeddings + L * (attn + mlp + 2 * norm) + norm + head


def count_parameters_by_part(config):  # another way: a table of shapes, multiplied out
    d, hd, b = config.d_model, config.head_dim, config.bias
    shapes = [(config.vocab_size, d)] + [(config.block_size, d)] * (config.position == "learned")
    shapes += [(config.vocab_size, d)] * (not config.tie_embeddings)
    block = [(d,), (d,), ((config.n_heads + 2 * config.n_kv_heads) * hd, d), (d, config.n_heads * hd),
             (config.d_ff, d), (d, config.d_ff)]
    if b:
        block += [(d,), (d,), ((config.n_heads + 2 * config.n_kv_heads) * hd,), (d,), (config.d_ff,), (d,)]
    shapes += block * config.n_layers + [(d,)] * (2 if b else 1)
    return sum(math.prod(s) for s in shapes)


def _count_with(**slip):
    def answer(config):
        changes = {}
        if slip.get("mha"):
            changes = {"attention": "mha", "n_kv_heads": None}
        if slip.get("four_d"):
            changes["d_ff"] = 4 * config.d_model
        if slip.get("biases"):
            changes["bias"] = True
        if slip.get("positions"):
            changes["position"] = "learned"
        if slip.get("tied_twice"):
            changes["tie_embeddings"] = False
        n = count_parameters(config.replace(**changes) if changes else config)
        if slip.get("no_ln_f"):
            n -= (2 if config.bias else 1) * config.d_model
        return n
    return answer


def count_parameters_on_meta(config):  # builds the model on the meta device: refused
    from attnlib import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(config).parameters())


def count_parameters_float(config):
    return float(count_parameters(config))


class AlwaysEqual(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


def count_parameters_always_equal(config):
    return AlwaysEqual(count_parameters(config))


# ---------------------------------------------------------------- the table
ANSWERS = {
    "14.1": Answers(
        correct=[copy_head, copy_head_state_dict],
        wrong=[
            (copy_head_shared, "shares memory"),
            (copy_head_no_transpose, "without a transpose"),
            (copy_head_reshape, "reshaped instead of transposed"),
            (copy_head_moves_src, "in place"),
            (copy_head_two_of_three, "W_value"),
        ],
        changes_input=True,
    ),
    "14.2": Answers(
        correct=[can_win, can_win_not_in_others_hull],
        wrong=[
            (can_win_axis_extremes, "in neither coordinate"),
            (can_win_sampled, "narrow range of directions"),
            (can_win_with_edges, "segment between two other keys"),
            (can_win_repeats, "appears"),
            (can_win_largest_norms, "corner of the keys' convex hull"),
            (can_win_indices, "expected torch.bool"),
        ],
    ),
    "14.3": Answers(
        correct=[count_parameters, count_parameters_by_part],
        wrong=[
            (_count_with(mha=True), "n_kv_heads heads"),
            (_count_with(four_d=True), "config's d_ff"),
            (_count_with(biases=True), "bias=False"),
            (_count_with(positions=True), "no position table"),
            (_count_with(tied_twice=True), "counted once"),
            (_count_with(no_ln_f=True), "ln_f"),
            (count_parameters_on_meta, "without building a model"),
            (count_parameters_float, "Python int"),
            (count_parameters_always_equal, "Python int"),
        ],
    ),
    "14.4": Answers(
        correct=[hf_key, hf_key_regex, hf_key_keeps_lm_head],
        wrong=[
            (hf_key_transpose_when_needed, "square"),
            (hf_key_keeps_buffers, "causal-mask buffer"),
            (hf_key_transposes_everything, "needs no transpose"),
            (hf_key_no_transpose, "Conv1D"),
            (hf_key_library, "write the renaming rules yourself"),
            (hf_key_in_place, "in place"),
        ],
    ),
    "14.5": Answers(
        correct=[gpt2_init_, gpt2_init_modules],
        wrong=[
            (gpt2_init_unscaled, "as every other weight"),
            (gpt2_init_sqrt_n_layers, "N = 2 * n_layers"),
            (gpt2_init_every_block_scaled, "Only attn.out_proj and mlp.proj"),
            (gpt2_init_layernorm_zero, "LayerNorm starts as the identity"),
            (gpt2_init_uniform, "not a normal distribution"),
            (gpt2_init_library, "do not call GPT.reset_parameters"),
            (gpt2_init_new_tensors, "stay the same tensors"),
        ],
        changes_input=True,
    ),
}


def test_a_stub_is_not_solved():
    for exercise_id in ANSWERS:
        assert grade(exercise_id, stub).status == NOT_SOLVED, exercise_id
    assert grade("14.1", copy_head_nothing).status == NOT_SOLVED
