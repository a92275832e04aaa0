"""Bad inputs at attnlib's edges (issue 26): tokenizers, data helpers, the device, training, saved files.

Every case asserts the exception type and (re.escape'd) the part of the message that names the argument
or the file and what is wrong; none accepts "any exception". A malformed saved file is refused with a
ValueError naming its path.
"""
import json
import re

import pytest
import torch

import attnlib
from attnlib import GPT, GPTConfig
from attnlib.data import FILENAME, ChecksumError, get_batch, load_char_corpus, load_tiny_shakespeare, train_val_split
from attnlib.history import History
from attnlib.tokenizers import BPETokenizer, CharTokenizer, WordTokenizer
from attnlib.train import TrainConfig, load_checkpoint, save_checkpoint, train

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
NO_MPS = pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
SMALL = dict(vocab_size=10, block_size=8, n_layers=1, n_heads=2, d_model=8)


def small_gpt(**kw):
    return GPT(GPTConfig(**{**SMALL, **kw}))


# ---------------------------------------------------------------- the device: ATTNLIB_DEVICE and attnlib.device()
@pytest.mark.parametrize(
    "value, message",
    [
        ("gpu", "ATTNLIB_DEVICE='gpu' is not a torch device (expected cpu, cuda, cuda:N or mps)"),
        ("cuda:x", "ATTNLIB_DEVICE='cuda:x' is not a torch device"),
        ("tpu", "ATTNLIB_DEVICE='tpu' is not a torch device"),
        ("CPU", "ATTNLIB_DEVICE='CPU' is not a torch device"),
        (" cpu", "ATTNLIB_DEVICE=' cpu' is not a torch device"),
        ("meta", "ATTNLIB_DEVICE='meta': attnlib runs on cpu, cuda or mps"),
        ("xla", "ATTNLIB_DEVICE='xla': attnlib runs on cpu, cuda or mps"),
        pytest.param("cuda", "ATTNLIB_DEVICE='cuda': this machine has no CUDA device", marks=NO_CUDA),
        pytest.param("cuda:1", "ATTNLIB_DEVICE='cuda:1': this machine has no CUDA device", marks=NO_CUDA),
        pytest.param("mps", "ATTNLIB_DEVICE='mps': MPS is not available on this machine", marks=NO_MPS),
    ],
)
def test_attnlib_device_refuses_a_bad_environment_variable(monkeypatch, value, message):
    monkeypatch.setenv("ATTNLIB_DEVICE", value)
    with pytest.raises(ValueError, match=re.escape(message)):
        attnlib.device()


@pytest.mark.parametrize("value", ["cpu", "cpu:0", ""])
def test_attnlib_device_keeps_cpu_and_unset_working(monkeypatch, value):
    monkeypatch.setenv("ATTNLIB_DEVICE", value)
    if value:
        assert attnlib.device() == torch.device(value)
    else:
        assert isinstance(attnlib.device(), torch.device)


# ---------------------------------------------------------------- TrainConfig and train()
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(device="gpu"), ValueError, "device='gpu' is not a torch device (expected cpu, cuda, cuda:N or mps)"),
        (dict(device="cuda:x"), ValueError, "device='cuda:x' is not a torch device"),
        (dict(device="meta"), ValueError, "device='meta': attnlib runs on cpu, cuda or mps"),
        (dict(device=0), TypeError, "device must be a str or a torch.device (cpu, cuda, cuda:N or mps); got 0 (int)"),
        (dict(learning_rate="1e-3"), TypeError, "learning_rate must be a number; got '1e-3' (str)"),
        (dict(learning_rate=True), TypeError, "learning_rate must be a number; got True (bool)"),
        (dict(learning_rate=float("inf")), ValueError, "learning_rate=inf must be a finite number"),
        (dict(weight_decay="0"), TypeError, "weight_decay must be a number; got '0' (str)"),
        (dict(grad_clip="1"), TypeError, "grad_clip must be a number; got '1' (str)"),
        (dict(grad_clip=float("nan")), ValueError, "grad_clip=nan must be a finite number"),
        (dict(seed="1"), TypeError, "seed must be an int; got '1' (str)"),
        (dict(seed=1.5), TypeError, "seed must be an int; got 1.5 (float)"),
        (dict(batch_size=2.0), TypeError, "batch_size must be an int; got 2.0 (float)"),
    ],
)
def test_train_config_refuses_bad_types_and_devices(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        TrainConfig(**kwargs)


def quick(**kw):
    return TrainConfig(**{**dict(batch_size=2, max_iters=1, eval_interval=1, eval_iters=1), **kw})


DATA = torch.arange(100) % 10


@pytest.mark.parametrize(
    "args, error, message",
    [
        (dict(config=quick(device="cuda")), ValueError, "device='cuda': this machine has no CUDA device"),
        (dict(config=quick(device="cuda:0")), ValueError, "device='cuda:0': this machine has no CUDA device"),
        (dict(config={"max_iters": 1}), TypeError, "config must be a TrainConfig or None; got dict"),
        (dict(train_data=DATA.tolist()), TypeError, "train_data must be a 1-D torch.Tensor of token ids; got list"),
        (dict(val_data=None), TypeError, "val_data must be a 1-D torch.Tensor of token ids; got NoneType"),
        (dict(train_data=DATA.float()), TypeError, "train_data must hold integer token ids (e.g. torch.long); got dtype torch.float32"),
        (dict(val_data=DATA > 3), TypeError, "val_data must hold integer token ids (e.g. torch.long); got dtype torch.bool"),
        (dict(train_data=DATA.view(10, 10)), ValueError, "train_data must be 1-D and longer than block_size=8; got shape (10, 10)"),
        (dict(val_data=DATA[:8]), ValueError, "val_data must be 1-D and longer than block_size=8; got shape (8,)"),
    ],
)
def test_train_refuses_bad_data_and_devices_before_any_work(args, error, message):
    if "cuda" in message and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    model = small_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    call = {"train_data": DATA, "val_data": DATA, "config": quick(device="cpu"), **args}
    with pytest.raises(error, match=re.escape(message)):
        train(model, call["train_data"], call["val_data"], call["config"], progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing trained


# ---------------------------------------------------------------- checkpoints
@pytest.fixture
def checkpoint_dir(tmp_path):
    torch.manual_seed(0)
    model = small_gpt()
    save_checkpoint(tmp_path / "good.pt", model, chars="abc")
    return tmp_path, model


def _write_checkpoint(case, path, model):
    cfg = model.config.to_dict(derived=False)
    sd = dict(model.state_dict())
    if case == "random-bytes":
        path.write_bytes(bytes(range(256)) * 2)
    elif case == "text":
        path.write_text("hello, this is not a checkpoint")
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "tensor":
        torch.save(torch.zeros(3), path)
    elif case == "other-dict":
        torch.save({"weights": 1}, path)
    elif case == "bare-state-dict":
        torch.save(sd, path)
    elif case == "no-state-dict":
        torch.save({"config": cfg}, path)
    elif case == "config-a-list":
        torch.save({"config": [1], "state_dict": sd}, path)
    elif case == "state-dict-a-list":
        torch.save({"config": cfg, "state_dict": [1]}, path)
    elif case == "config-unknown-key":
        torch.save({"config": {**cfg, "colour": 1}, "state_dict": sd}, path)
    elif case == "config-invalid":
        torch.save({"config": {**cfg, "n_heads": 3}, "state_dict": sd}, path)
    elif case == "other-width":
        torch.save({"config": cfg, "state_dict": small_gpt(d_model=16).state_dict()}, path)
    elif case == "more-layers":
        torch.save({"config": cfg, "state_dict": small_gpt(n_layers=2).state_dict()}, path)
    elif case == "missing-parameter":
        sd.pop("tok_emb.weight")
        torch.save({"config": cfg, "state_dict": sd}, path)
    elif case == "parameter-a-str":
        torch.save({"config": cfg, "state_dict": {**sd, "tok_emb.weight": "x"}}, path)
    elif case == "int8-weights":  # a quantised checkpoint: its scales are elsewhere, a cast would be wrong
        torch.save({"config": cfg, "state_dict": {**sd, "tok_emb.weight": (sd["tok_emb.weight"] * 100).to(torch.int8)}},
                   path)


@pytest.mark.parametrize(
    "case, message",
    [
        ("random-bytes", "is not a checkpoint written by save_checkpoint: torch.load failed ("),
        ("text", "is not a checkpoint written by save_checkpoint: torch.load failed ("),
        ("empty", "is not a checkpoint written by save_checkpoint: torch.load failed (EOFError)"),
        ("tensor", "is not a checkpoint written by save_checkpoint: it holds a Tensor, not a dict with 'config' and 'state_dict'"),
        ("other-dict", "is not a checkpoint written by save_checkpoint: it has no 'config' (its keys: ['weights'])"),
        ("bare-state-dict", "is not a checkpoint written by save_checkpoint: it has no 'config'"),
        ("no-state-dict", "is not a checkpoint written by save_checkpoint: it has no 'state_dict' (its keys: ['config'])"),
        ("config-a-list", ": 'config' is a list, expected a dict"),
        ("state-dict-a-list", ": 'state_dict' is a list, expected a dict"),
        ("config-unknown-key", ": its 'config' is not a valid GPTConfig: "),
        ("config-invalid", ": its 'config' is not a valid GPTConfig: d_model=8 is not divisible by n_heads=3"),
        ("other-width", ": parameter 'tok_emb.weight' has shape (10, 16), but the model of its config expects (10, 8)"),
        ("more-layers", ": the checkpoint has a parameter 'blocks.1.ln_1.weight' that the model of its config lacks"),
        ("missing-parameter", ": the checkpoint lacks the parameter 'tok_emb.weight' (1 missing in all)"),
        ("parameter-a-str", ": parameter 'tok_emb.weight' is a str, not a tensor"),
        ("int8-weights", ": parameter 'tok_emb.weight' has dtype torch.int8; the model's is floating point"),
    ],
)
def test_load_checkpoint_refuses_a_file_that_is_not_one(checkpoint_dir, case, message):
    tmp_path, model = checkpoint_dir
    path = tmp_path / f"{case}.pt"
    _write_checkpoint(case, path, model)
    with pytest.raises(ValueError, match=re.escape(f"{path}") + ".*" + re.escape(message)):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda d: load_checkpoint(d / "nope.pt"), FileNotFoundError, "no checkpoint at "),
        (lambda d: load_checkpoint(5), TypeError, "path must be a str or os.PathLike; got 5 (int)"),
        (lambda d: load_checkpoint(None), TypeError, "path must be a str or os.PathLike; got None (NoneType)"),
        (lambda d: load_checkpoint(d / "good.pt", "gpu"), ValueError, "map_location='gpu' is not a torch device"),
        (lambda d: load_checkpoint(d / "good.pt", 5), TypeError, "map_location must be a str or a torch.device; got 5 (int)"),
        (lambda d: save_checkpoint(None, small_gpt()), TypeError, "path must be a str or os.PathLike; got None (NoneType)"),
        (lambda d: save_checkpoint(d / "x.pt", torch.nn.Linear(2, 2)), TypeError,
         "model must be an nn.Module with a config.to_dict() (as attnlib.GPT has); got Linear"),
        (lambda d: save_checkpoint(d / "x.pt", small_gpt(), config={}), ValueError, "extra key 'config' is reserved"),
        (lambda d: save_checkpoint(d / "x.pt", small_gpt(), state_dict={}), ValueError, "extra key 'state_dict' is reserved"),
        (lambda d: save_checkpoint(d / "x.pt", small_gpt(), step=object()), ValueError, "extra step=<object object at"),
    ],
)
def test_checkpoint_functions_refuse_bad_arguments(checkpoint_dir, call, error, message):
    tmp_path, _ = checkpoint_dir
    with pytest.raises(error, match=re.escape(message)):
        call(tmp_path)
    assert not (tmp_path / "x.pt").exists()  # nothing half-written


@NO_CUDA
def test_load_checkpoint_refuses_cuda_map_location_without_cuda(checkpoint_dir):
    tmp_path, _ = checkpoint_dir
    with pytest.raises(ValueError, match=re.escape("map_location='cuda': this machine has no CUDA device")):
        load_checkpoint(tmp_path / "good.pt", "cuda")


def test_a_good_checkpoint_still_loads(checkpoint_dir):
    tmp_path, model = checkpoint_dir
    loaded, extra = load_checkpoint(tmp_path / "good.pt")
    assert extra == {"chars": "abc"}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


# ---------------------------------------------------------------- History files
GOOD_HISTORY = dict(steps=[0, 10], train_loss=[2.0, 1.5], val_loss=[2.1, 1.6], step_loss=[2.0], elapsed_s=1.0,
                    tokens_per_s=5.0)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x80\x00\xff", " is not a history: not UTF-8 text (invalid start byte at byte 0)"),
        ('{"steps": [1],\n "x": }', " is not a history: invalid JSON (Expecting value: line 2 column 7 (char 21))"),
        ("", " is not a history: invalid JSON (Expecting value: line 1 column 1 (char 0))"),
        ("[1, 2]", " is not a history: it holds a JSON list, expected an object with the keys steps, train_loss"),
        ({**GOOD_HISTORY, "colour": 1}, " is not a history: unknown key 'colour' (expected steps, train_loss"),
        ({}, " is not a history: it lacks the key 'steps'"),
        ({k: v for k, v in GOOD_HISTORY.items() if k != "val_loss"}, " is not a history: it lacks the key 'val_loss'"),
        ({**GOOD_HISTORY, "steps": "abc"}, ": 'steps' is 'abc', expected a list of ints"),
        ({**GOOD_HISTORY, "steps": [0.5, 1]}, ": 'steps' is [0.5, 1], expected a list of ints"),
        ({**GOOD_HISTORY, "train_loss": ["a", 1]}, ": 'train_loss' is ['a', 1], expected a list of numbers"),
        ({**GOOD_HISTORY, "step_loss": None}, ": 'step_loss' is None, expected a list of numbers"),
        ({**GOOD_HISTORY, "elapsed_s": "3"}, ": 'elapsed_s' is '3', expected a number"),
        ({**GOOD_HISTORY, "val_loss": [1.0]}, ": steps, train_loss and val_loss must have one entry per evaluation; "
                                              "got lengths {'steps': 2, 'train_loss': 2, 'val_loss': 1}"),
    ],
)
def test_history_from_json_refuses_a_file_that_is_not_one(tmp_path, content, message):
    path = tmp_path / "history.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=re.escape(f"{path}{message}")):
        History.from_json(path)


@pytest.mark.parametrize("path", [5, None, b"h.json"])
def test_history_paths_must_be_paths(path):
    message = f"path must be a str or os.PathLike; got {path!r} ({type(path).__name__})"
    with pytest.raises(TypeError, match=re.escape(message)):
        History.from_json(path)
    with pytest.raises(TypeError, match=re.escape(message)):
        History().to_json(path)


def test_a_history_round_trips(tmp_path):
    History(**GOOD_HISTORY).to_json(tmp_path / "h.json")
    assert History.from_json(tmp_path / "h.json") == History(**GOOD_HISTORY)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nope.json"))):
        History.from_json(tmp_path / "nope.json")


# ---------------------------------------------------------------- data helpers
IDS = torch.arange(100)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: load_tiny_shakespeare(5, download=False), TypeError, "data_dir must be a str, an os.PathLike or None; got 5 (int)"),
        (lambda: load_tiny_shakespeare(b"/tmp", download=False), TypeError, "data_dir must be a str, an os.PathLike or None; got b'/tmp' (bytes)"),
        (lambda: load_tiny_shakespeare(None, download="no"), TypeError, "download must be a bool; got 'no' (str)"),
        (lambda: load_char_corpus(3.0), TypeError, "data_dir must be a str, an os.PathLike or None; got 3.0 (float)"),
        (lambda: load_char_corpus("/nonexistent", 2.0), ValueError, "train_fraction=2.0 must be in (0, 1)"),  # before any download
        (lambda: train_val_split(IDS, "0.9"), TypeError, "train_fraction must be a float in (0, 1); got '0.9' (str)"),
        (lambda: train_val_split(IDS, None), TypeError, "train_fraction must be a float in (0, 1); got None (NoneType)"),
        (lambda: train_val_split(IDS, True), TypeError, "train_fraction must be a float in (0, 1); got True (bool)"),
        (lambda: train_val_split(IDS, 0.0), ValueError, "train_fraction=0.0 must be in (0, 1)"),
        (lambda: train_val_split(IDS, float("nan")), ValueError, "train_fraction=nan must be in (0, 1)"),
        (lambda: train_val_split([1, 2, 3]), TypeError, "data must be a 1-D torch.Tensor of token ids; got list"),
        (lambda: train_val_split(None), TypeError, "data must be a 1-D torch.Tensor of token ids; got NoneType"),
        (lambda: train_val_split(IDS.float()), TypeError, "data must hold integer token ids (e.g. torch.long); got dtype torch.float32"),
        (lambda: get_batch(IDS.tolist(), 2, 8), TypeError, "data must be a 1-D torch.Tensor of token ids; got list"),
        (lambda: get_batch("abc" * 10, 2, 8), TypeError, "data must be a 1-D torch.Tensor of token ids; got str"),
        (lambda: get_batch(IDS > 3, 2, 8), TypeError, "data must hold integer token ids (e.g. torch.long); got dtype torch.bool"),
        (lambda: get_batch(IDS, True, 8), TypeError, "batch_size must be an int; got True (bool)"),
        (lambda: get_batch(IDS, 2, 8.0), TypeError, "block_size must be an int; got 8.0 (float)"),
        (lambda: get_batch(IDS, "2", 8), TypeError, "batch_size must be an int; got '2' (str)"),
        (lambda: get_batch(IDS, 2, -1), ValueError, "block_size=-1 must be a positive integer"),
        (lambda: get_batch(IDS, 2, 8, generator=5), TypeError, "generator must be a torch.Generator or None; got int"),
        (lambda: get_batch(IDS, 2, 8, device="gpu"), ValueError, "device='gpu' is not a torch device (expected cpu, cuda, cuda:N or mps)"),
        (lambda: get_batch(IDS, 2, 8, device=0), TypeError, "device must be a str or a torch.device (cpu, cuda, cuda:N or mps); got 0 (int)"),
        pytest.param(lambda: get_batch(IDS, 2, 8, device="cuda"), ValueError, "device='cuda': this machine has no CUDA device",
                     marks=NO_CUDA),
    ],
)
def test_data_helpers_refuse_bad_arguments(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_a_data_file_that_is_not_the_text_is_refused(tmp_path):
    (tmp_path / FILENAME).write_bytes(b"\x80\x81\xff\x00 not text")
    with pytest.raises(ChecksumError, match=re.escape(f"{tmp_path / FILENAME} has sha256 ")):
        load_tiny_shakespeare(tmp_path, download=False)


# ---------------------------------------------------------------- tokenizers: arguments
CHAR = CharTokenizer("hello world")
WORD = WordTokenizer.from_corpus("hello world foo")
BPE = BPETokenizer().train("aaabbbaaabbb hello hello", 260)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: CHAR.encode(None), TypeError, "text must be a str; got NoneType"),
        (lambda: CHAR.encode(5), TypeError, "text must be a str; got int"),
        (lambda: CHAR.encode(b"he"), TypeError, "text must be a str; got bytes"),
        (lambda: CHAR.encode(["h", "e"]), TypeError, "text must be a str; got list"),
        (lambda: CHAR.decode(torch.tensor([0.0])), TypeError, "ids must hold integer token ids (e.g. torch.long); got dtype torch.float32"),
        (lambda: CHAR.decode([99]), ValueError, "ids holds token id 99, outside the vocabulary [0, 8) (at index 0)"),
        (lambda: WordTokenizer(None), TypeError, "words must be an iterable of str (e.g. a list); got NoneType"),
        (lambda: WordTokenizer(5), TypeError, "words must be an iterable of str (e.g. a list); got int"),
        (lambda: WordTokenizer("abc"), TypeError, "words must be an iterable of str (e.g. a list); got str"),
        (lambda: WordTokenizer(b"abc"), TypeError, "words must be an iterable of str (e.g. a list); got bytes"),
        (lambda: WordTokenizer.from_corpus(None), TypeError, "texts must be an iterable of str (e.g. a list); got NoneType"),
        (lambda: WordTokenizer.from_corpus(b"a b"), TypeError, "texts must be an iterable of str (e.g. a list); got bytes"),
        (lambda: WordTokenizer.from_corpus(["a b", 3]), TypeError, "texts[1] must be a str; got 3 (int)"),
        (lambda: WordTokenizer.from_corpus("a b", min_freq="2"), TypeError, "min_freq must be an int; got '2' (str)"),
        (lambda: WordTokenizer.from_corpus("a b", min_freq=True), TypeError, "min_freq must be an int; got True (bool)"),
        (lambda: WordTokenizer.from_corpus("a b", max_size=10.0), TypeError, "max_size must be an int or None; got 10.0 (float)"),
        (lambda: WORD.encode("hello", add_special_tokens="no"), TypeError, "add_special_tokens must be a bool; got 'no' (str)"),
        (lambda: WORD.encode("hello", add_special_tokens=None), TypeError, "add_special_tokens must be a bool; got None (NoneType)"),
        (lambda: WORD.decode([4], skip_special_tokens=0), TypeError, "skip_special_tokens must be a bool; got 0 (int)"),
        (lambda: WORD.decode(torch.tensor([1.0])), TypeError, "ids must hold integer token ids (e.g. torch.long); got dtype torch.float32"),
        (lambda: WORD.decode([7]), ValueError, "ids holds token id 7, outside the vocabulary [0, 7) (at index 0)"),
        (lambda: WORD.pad_batch(None), TypeError, "batch must be a sequence of sequences of token ids (e.g. a list of lists); got NoneType"),
        (lambda: WORD.pad_batch(5), TypeError, "batch must be a sequence of sequences of token ids (e.g. a list of lists); got int"),
        (lambda: WORD.pad_batch("ab"), TypeError, "batch must be a sequence of sequences of token ids (e.g. a list of lists); got str"),
        (lambda: BPETokenizer().train(["a", 5], 260), TypeError, "text must be a str or a list of str, got text[1]=5 (int)"),
        (lambda: BPETokenizer().train("abab", "300"), TypeError, "vocab_size must be an int, got str"),
        (lambda: BPETokenizer().train("abab", 257, verbose="x"), TypeError, "verbose must be a bool, got 'x' (str)"),
        (lambda: BPE.decode(torch.tensor([0.0])), TypeError, "ids must hold integer token ids (e.g. torch.long); got dtype torch.float32"),
        (lambda: BPE.decode([999]), ValueError, "ids holds token id 999, not in the vocabulary of 260 tokens (at index 0)"),
        (lambda: BPE.save(None), TypeError, "path must be a str or os.PathLike; got None (NoneType)"),
        (lambda: BPETokenizer.load(5), TypeError, "path must be a str or os.PathLike; got 5 (int)"),
        (lambda: BPETokenizer.from_hf(5), TypeError, "hf_tokenizer must be a tokenizers.Tokenizer or the dict of its JSON; got int"),
        (lambda: BPETokenizer.from_hf({"model": [1]}), ValueError, "expected a Hugging Face BPE model, got [1]"),
        (lambda: BPETokenizer.from_hf({"model": {"type": "BPE", "merges": []}}), ValueError, "the Hugging Face BPE model has no 'vocab'"),
    ],
)
def test_tokenizers_refuse_bad_arguments(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


# ---------------------------------------------------------------- tokenizers: saved files
def _bpe_file(tmp_path, name, edit):
    data = BPE.to_dict()
    path = tmp_path / f"{name}.json"
    content = edit(data)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def _set(data, key, value):
    return {**data, key: value}


def _merge0(value):
    return lambda d: _set(d, "merges", [value, *d["merges"][1:]])


def _vocab(key, value):
    return lambda d: _set(d, "vocab", {**d["vocab"], key: value})


@pytest.mark.parametrize(
    "name, edit, message",
    [
        ("invalid-json", lambda d: '{"format": "attnlib-bpe",\n "vocab": }',
         "not a saved tokenizer: invalid JSON (Expecting value: line 2 column 11 (char 36))"),
        ("empty", lambda d: "", "not a saved tokenizer: invalid JSON (Expecting value: line 1 column 1 (char 0))"),
        ("binary", lambda d: b"\x80\x81\xff", "not a saved tokenizer: not UTF-8 text (invalid start byte at byte 0)"),
        ("a-list", lambda d: [1, 2], "not an attnlib-bpe description (missing 'format': 'attnlib-bpe')"),
        ("no-vocab", lambda d: {k: v for k, v in d.items() if k != "vocab"}, "the attnlib-bpe description has no 'vocab'"),
        ("no-merges", lambda d: {k: v for k, v in d.items() if k != "merges"}, "the attnlib-bpe description has no 'merges'"),
        ("vocab-a-list", lambda d: _set(d, "vocab", [1, 2]), "'vocab' must be a JSON object; got list"),
        ("merges-an-object", lambda d: _set(d, "merges", {"a": 1}), "'merges' must be a JSON array; got dict"),
        ("merge-of-2", _merge0([97, 97]), "merge 0 is [97, 97]; expected [a, b, new_id], three int token ids"),
        ("merge-of-4", _merge0([97, 97, 256, 1]), "merge 0 is [97, 97, 256, 1]; expected [a, b, new_id]"),
        ("merge-of-str", _merge0(["a", "a", "aa"]), "merge 0 is ['a', 'a', 'aa']; expected [a, b, new_id]"),
        ("merge-of-float", _merge0([97.5, 97, 256]), "merge 0 is [97.5, 97, 256]; expected [a, b, new_id]"),
        ("merge-a-string", _merge0("97 97"), "merge 0 is '97 97'; expected [a, b, new_id]"),
        ("id-not-an-int", _vocab("x", "61"), "vocab key 'x' is not a token id (a decimal int >= 0)"),
        ("id-negative", _vocab("-5", "6161"), "vocab key '-5' is not a token id (a decimal int >= 0)"),
        ("id-float", _vocab("1.5", "61"), "vocab key '1.5' is not a token id (a decimal int >= 0)"),
        ("id-padded", _vocab("07", "6161"), "vocab key '07' is not a token id (a decimal int >= 0)"),
        ("bytes-not-hex", _vocab("300", "zz"), "vocab['300'] = 'zz' is not the hex string of one or more bytes"),
        ("bytes-an-int", _vocab("300", 5), "vocab['300'] = 5 is not the hex string of one or more bytes"),
        ("bytes-empty", _vocab("300", ""), "vocab['300'] = '' is not the hex string of one or more bytes"),
        ("merge-unknown-id", _merge0([97, 97, 999]), "merge 0 (((97, 97) -> 999)) uses id 999, which is not in the vocabulary"),
        ("wrong-version", lambda d: _set(d, "version", 2), "unsupported attnlib-bpe version 2; this is version 1"),
    ],
)
def test_bpe_load_refuses_a_malformed_file(tmp_path, name, edit, message):
    path = _bpe_file(tmp_path, name, edit)
    with pytest.raises(ValueError, match=re.escape(f"{path}: {message}")):
        BPETokenizer.load(path)


def test_bpe_load_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nope.json"))):
        BPETokenizer.load(tmp_path / "nope.json")


def test_a_saved_bpe_tokenizer_still_loads(tmp_path):
    BPE.save(tmp_path / "bpe.json")
    loaded = BPETokenizer.load(tmp_path / "bpe.json")
    assert loaded.merges == BPE.merges and loaded.vocab == BPE.vocab
