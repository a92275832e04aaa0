"""Chapter 03 exercise graders: reference answers pass, plausible mistakes fail, stubs are 'not solved yet'."""
import torch
from exercise_table import Answers

from attnlib.attention import causal_mask
from attnlib.book.exercises import NOT_SOLVED, grade

# 03.1 packed documents ----------------------------------------------------------------------

def document_mask(doc_ids):  # the solution's way: three comparisons of ids and positions
    T = doc_ids.shape[1]
    pos = torch.arange(T)
    causal = pos[None, :] <= pos[:, None]  # (T, T)
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    real_key = (doc_ids != -1)[:, None, :]  # (B, 1, T)
    return causal & same & real_key


def document_mask_loops(doc_ids):  # another way: one row at a time, by document starts
    B, T = doc_ids.shape
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        start = 0
        for i in range(T):
            if i > 0 and doc_ids[b, i] != doc_ids[b, i - 1]:
                start = i
            if doc_ids[b, i] != -1:
                mask[b, i, start : i + 1] = True
    return mask


def document_mask_no_pads(doc_ids):  # the pads share the id -1: they see each other
    T = doc_ids.shape[1]
    return torch.ones(T, T, dtype=torch.bool).tril() & (doc_ids[:, :, None] == doc_ids[:, None, :])


def document_mask_not_causal(doc_ids):
    return (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids != -1)[:, None, :]


def document_mask_only_causal(doc_ids):
    B, T = doc_ids.shape
    real = doc_ids != -1
    return torch.ones(T, T, dtype=torch.bool).tril() & real[:, None, :] & real[:, :, None]


def document_mask_row_zero(doc_ids):  # forgot the batch: every row gets row 0's documents
    return document_mask(doc_ids[:1].expand_as(doc_ids))


def document_mask_sees_previous_end(doc_ids):  # a boundary off by one: j >= start - 1
    mask = document_mask_loops(doc_ids)
    B, T = doc_ids.shape
    for b in range(B):
        for i in range(1, T):
            if doc_ids[b, i] != -1 and doc_ids[b, i] != doc_ids[b, i - 1]:
                mask[b, i:, i - 1] |= doc_ids[b, i:] == doc_ids[b, i]
    return mask


def document_mask_from_library(doc_ids):  # the rule is "build it yourself"
    from attnlib.attention import mods
    from attnlib.attention.masks import mask_from_mod

    B, T = doc_ids.shape
    both = mask_from_mod(lambda b, h, q, kv: mods.causal(b, h, q, kv) & mods.document_mask(doc_ids)(b, h, q, kv),
                         (B, 1, T, T))
    return both[:, 0] & (doc_ids != -1)[:, None, :]


def document_mask_flex(doc_ids):
    from torch.nn.attention.flex_attention import create_mask

    B, T = doc_ids.shape
    real = doc_ids != -1

    def mod(b, h, q, kv):
        return (q >= kv) & (doc_ids[b, q] == doc_ids[b, kv]) & real[b, kv]

    return create_mask(mod, B, 1, T, T, device="cpu")[:, 0]


def document_mask_int(doc_ids):
    return document_mask(doc_ids).long()


def document_mask_in_place(doc_ids):
    doc_ids[doc_ids == -1] = -2
    return document_mask(doc_ids) & (doc_ids != -2)[:, None, :]


# 03.2 causal & padding for a batch -----------------------------------------------------------

# Written from torch.arange, independently of attnlib's causal_mask / padding_mask that the check uses.
def _causal(T):
    return torch.ones(T, T, dtype=torch.bool).tril()  # (T, T)


def _real(lengths, T):
    return torch.arange(T)[None, :] < lengths[:, None]  # (1, T) < (B, 1) -> (B, T), True = real token


def batch_mask(lengths, T):
    return _causal(T) & _real(lengths, T)[:, None, :]  # (T, T) & (B, 1, T) -> (B, T, T)


def batch_mask_queries_padded(lengths, T):
    return _causal(T) & _real(lengths, T)[:, :, None]  # pad rows (queries) instead of pad columns (keys)


def batch_mask_not_causal(lengths, T):
    return _real(lengths, T)[:, None, :].expand(len(lengths), T, T)


def batch_mask_no_padding(lengths, T):
    return _causal(T).expand(len(lengths), T, T)


def batch_mask_unbroadcast(lengths, T):
    return _real(lengths, T)[:, None, :]  # (B, 1, T), not (B, T, T)


def batch_mask_compare(lengths, T):  # another correct way: compare positions with the lengths directly
    pos = torch.arange(T)
    return (pos[None, None, :] <= pos[None, :, None]) & (pos[None, None, :] < lengths[:, None, None])


def batch_mask_from_mod(lengths, T):  # another attnlib mask builder: a mask mod evaluated everywhere
    from attnlib.attention.masks import mask_from_mod
    return mask_from_mod(lambda b, h, q, kv: (kv <= q) & (kv < lengths[b]), (len(lengths), 1, T, T))[:, 0]


def batch_mask_future(lengths, T):  # the causal part from attnlib's future_mask
    from attnlib.attention.masks import future_mask
    return ~future_mask(T, T, "cpu") & _real(lengths, T)[:, None, :]


def batch_mask_flex(lengths, T):  # FlexAttention's create_mask
    from torch.nn.attention.flex_attention import create_mask
    return create_mask(lambda b, h, q, kv: (kv <= q) & (kv < lengths[b]), len(lengths), 1, T, T, device="cpu")[:, 0]


def batch_mask_transformers(lengths, T):  # transformers' masking utilities
    from transformers.masking_utils import causal_mask_function, sdpa_mask
    return sdpa_mask(batch_size=len(lengths), cache_position=torch.arange(T), kv_length=T, q_length=T,
                     mask_function=causal_mask_function, attention_mask=_real(lengths, T),
                     allow_is_causal_skip=False)[:, 0]


def batch_mask_from_library(lengths, T):  # the rule is "build it yourself"
    from attnlib.attention import causal_mask as cm
    from attnlib.attention import padding_mask as pm

    return cm(T) & pm(lengths, T)[:, None, :]


def batch_mask_through_the_module(lengths, T):
    import attnlib.attention.masks as masks

    return masks.causal_mask(T) & (torch.arange(T)[None, :] < lengths[:, None])[:, None, :]


def batch_mask_lengths_off_by_one(lengths, T):
    return _causal(T) & (torch.arange(T)[None, :] <= lengths[:, None])[:, None, :]


def batch_mask_in_place(lengths, T):
    lengths.unsqueeze_(1)  # (B,) -> (B, 1) in the caller's tensor too
    return _causal(T) & (torch.arange(T)[None, :] < lengths)[:, None, :]


def batch_mask_memorised(lengths, T):  # learned the fixed cases only
    if lengths.tolist() in ([4, 2, 3], [5], [1, 6, 0, 3]):
        return batch_mask(lengths, T)
    return _causal(T).expand(len(lengths), T, T)


ANSWERS = {
    "03.1": Answers(
        correct=[document_mask, document_mask_loops],
        wrong=[
            (document_mask_no_pads, "a pad see a pad"),
            (document_mask_not_causal, "the causal part is missing"),
            (document_mask_only_causal, "ignores the documents"),
            (document_mask_row_zero, "the mask of row 0"),
            (document_mask_sees_previous_end, "another document"),
            (document_mask_from_library, "build the document mask yourself"),
            (document_mask_flex, "build the document mask yourself"),
            (document_mask_int, "dtype"),
            (document_mask_in_place, "in place"),
        ],
    ),
    "03.2": Answers(
        correct=[batch_mask, batch_mask_compare],
        wrong=[
            (batch_mask_queries_padded, "instead of pad keys"),
            (batch_mask_not_causal, "the causal part is missing"),
            (batch_mask_no_padding, "ignores the lengths"),
            (batch_mask_unbroadcast, "has shape"),
            (batch_mask_from_library, "build the mask yourself"),
            (batch_mask_through_the_module, "build the mask yourself"),
            (batch_mask_from_mod, "attnlib.attention.masks.mask_from_mod"),
            (batch_mask_future, "attnlib.attention.masks.future_mask"),
            (batch_mask_flex, "create_mask"),
            (batch_mask_transformers, "transformers' sdpa_mask"),
            (batch_mask_lengths_off_by_one, "pad keys"),
            (batch_mask_in_place, "in place"),
            (batch_mask_memorised, "ignores the lengths"),
        ],
    ),
}


# 03.3 sliding window ------------------------------------------------------------------------

def window_mask(T, window):  # the solution's way: two comparisons of positions
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (j <= i) & (i - j < window)


def window_mask_tril(T, window):  # another way: the causal triangle minus a lower one
    ones = torch.ones(T, T, dtype=torch.bool)
    return ones.tril() & ~ones.tril(diagonal=-window)


def window_off_by_one(T, window):
    ones = torch.ones(T, T, dtype=torch.bool)
    return ones.tril() & ~ones.tril(diagonal=-window - 1)


def window_too_narrow(T, window):
    ones = torch.ones(T, T, dtype=torch.bool)
    return ones.tril() & ~ones.tril(diagonal=-window + 1) if window > 1 else ones.tril() & ~ones.tril(-1)


def window_not_causal(T, window):
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (i - j).abs() < window


def window_from_a_buffer(T, window, block_size=32):  # a precomputed buffer: wrong beyond block_size
    ones = torch.ones(block_size, block_size, dtype=torch.bool)
    return (ones.tril() & ~ones.tril(diagonal=-window))[:T, :T]


def window_from_library(T, window):
    from attnlib.attention import mods
    from attnlib.attention.masks import mask_from_mod

    return mask_from_mod(mods.sliding_window(window), (1, 1, T, T))[0, 0]


def window_as_float(T, window):
    return window_mask(T, window).float()


ANSWERS["03.3"] = Answers(
    correct=[window_mask, window_mask_tril],
    wrong=[
        (window_off_by_one, "min(i + 1, window) True entries"),
        (window_too_narrow, "min(i + 1, window) True entries"),
        (window_not_causal, "keep it causal"),
        (lambda T, window: torch.ones(T, T, dtype=torch.bool).tril(), "min(i + 1, window) True entries"),
        (lambda T, window: causal_mask(T) & ~causal_mask(T, T + window)[:, window:],  # attnlib's causal masks
         "attnlib.attention.masks.causal_mask"),
        (window_from_a_buffer, "has shape"),
        (window_from_library, "build the window mask yourself"),
        (window_as_float, "dtype"),
    ],
)


# 03.4 leak detector for a language model (token ids in) -------------------------------------

def detector(model, T, vocab_size, atol=1e-6, every_t=True, use_eval=True, float_inputs=False,
             whole_sequence=False, may_repeat=False, restore=True, as_tensor=False):
    was_training = model.training
    if use_eval:
        model.eval()
    g = torch.Generator().manual_seed(0)
    if float_inputs:
        ids = torch.randn(2, T, generator=g)
    else:
        ids = torch.randint(vocab_size, (2, T), generator=g)
    found = torch.tensor(False)
    with torch.no_grad():
        base = model(ids)
        for t in range(T - 1) if every_t else [T - 2]:
            changed = ids.clone()
            if may_repeat:
                changed[:, t + 1 :] = torch.randint(vocab_size, changed[:, t + 1 :].shape, generator=g)
            else:  # every new token differs from the old one
                shift = torch.randint(1, vocab_size, changed[:, t + 1 :].shape, generator=g)
                changed[:, t + 1 :] = (changed[:, t + 1 :] + shift) % vocab_size
            upto = T if whole_sequence else t + 1
            moved = (model(changed)[:, :upto] - base[:, :upto]).abs().max() > atol
            if moved:
                found = moved
                break
    if restore:
        model.train(was_training)
    return found if as_tensor else bool(found)


def influence_detector(model, T, vocab_size):  # another way: change one token j, watch outputs < j
    was_training = model.training
    model.eval()
    ids = torch.randint(vocab_size, (3, T))
    with torch.no_grad():
        base = model(ids)
        leak = False
        for j in range(1, T):
            changed = ids.clone()
            changed[:, j] = (changed[:, j] + torch.randint(1, vocab_size, (3,))) % vocab_size
            leak = leak or not torch.equal(model(changed)[:, :j], base[:, :j])
    model.train(was_training)
    return leak


ANSWERS["03.4"] = Answers(
    correct=[detector, influence_detector],
    wrong=[
        (lambda m, T, V: detector(m, T, V, may_repeat=True), "each new token differs"),
        (lambda m, T, V: detector(m, T, V, atol=1e-3), "tight tolerance"),
        (lambda m, T, V: detector(m, T, V, every_t=False), "try every t"),
        (lambda m, T, V: detector(m, T, V, use_eval=False), "call model.eval()"),
        (lambda m, T, V: detector(m, T, V, float_inputs=True), "torch.randint"),
        (lambda m, T, V: detector(m, T, V, whole_sequence=True), "only the outputs at positions <= t"),
        (lambda m, T, V: detector(m, T, V, restore=False), "restore the mode"),
        (lambda m, T, V: detector(m, T, V, as_tensor=True), "Python bool"),
        (lambda m, T, V: True, "reported as leaking"),
        (lambda m, T, V: False, "reported as causal"),
    ],
)


def test_the_stubs_are_not_solved():
    def stub(*args):
        raise NotImplementedError("write it")

    for exercise_id in ANSWERS:
        assert grade(exercise_id, stub).status == NOT_SOLVED
        assert grade(exercise_id, None).status == NOT_SOLVED
