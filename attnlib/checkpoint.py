"""Saving and loading a decoder with its configuration (chapter 12): ``save_checkpoint`` / ``load_checkpoint``.

A checkpoint is one ``torch.save`` file: ``{"config": the config's given fields, "state_dict": the weights, ...}``
plus any JSON-able extras (a step count, a loss). Loading reads it with ``weights_only=True`` (no code runs from the
file) and refuses, naming the path, anything that is not such a file or does not fit the model its config builds.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from torch import nn

from attnlib._checks import file_path
from attnlib._device import check_device

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(path: str | Path, model: nn.Module, **extra) -> None:
    """Save the model's config and weights (and any JSON-able ``extra``) to ``path``.

    Raises:
        TypeError: ``path`` is not a str / PathLike, or ``model`` has no ``config.to_dict`` (as :class:`attnlib.GPT` has).
        ValueError: ``extra`` uses the reserved key ``"config"`` or ``"state_dict"``, or holds a value
            that is not JSON-able (it could not be loaded back with ``weights_only=True``).
    """
    path = file_path("path", path)
    if not isinstance(model, nn.Module) or not callable(getattr(getattr(model, "config", None), "to_dict", None)):
        raise TypeError(f"model must be an nn.Module with a config.to_dict() (as attnlib.GPT has); got {type(model).__name__}")
    reserved = sorted({"config", "state_dict"} & extra.keys())
    if reserved:
        raise ValueError(f"extra key {reserved[0]!r} is reserved: the checkpoint stores the model's own {reserved[0]} there")
    for key, value in extra.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise ValueError(f"extra {key}={value!r} is not JSON-able (a str, number, bool, None, or a list or dict "
                             f"of these)") from None
    torch.save({"config": model.config.to_dict(derived=False), "state_dict": model.state_dict(), **extra}, path)


def _check_state_dict(path: Path, state: dict, model: nn.Module) -> None:
    """Raise ValueError naming the first parameter of ``state`` that ``model`` lacks, misses or shapes otherwise."""
    expected = model.state_dict()
    for key, value in state.items():
        if key not in expected:
            raise ValueError(f"{path}: the checkpoint has a parameter {key!r} that the model of its config lacks")
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{path}: parameter {key!r} is a {type(value).__name__}, not a tensor")
        if expected[key].is_floating_point() and not value.is_floating_point():
            raise ValueError(f"{path}: parameter {key!r} has dtype {value.dtype}; the model's is floating point "
                             f"({expected[key].dtype}): a quantised checkpoint must be dequantised first")
        if value.shape != expected[key].shape:
            raise ValueError(f"{path}: parameter {key!r} has shape {tuple(value.shape)}, but the model of its config "
                             f"expects {tuple(expected[key].shape)}")
    missing = [key for key in expected if key not in state]
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks the parameter {missing[0]!r} ({len(missing)} missing in all)")


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu"):
    """Rebuild the :class:`attnlib.GPT` saved by :func:`save_checkpoint`; returns ``(model, extra)``.

    Raises:
        TypeError: ``path`` is not a str / PathLike; ``map_location`` is not a str / ``torch.device``
            (or a dict / callable, passed to ``torch.load``).
        FileNotFoundError: no file at ``path``.
        ValueError: ``map_location`` names a device this machine lacks; or the file is not a checkpoint of
            :func:`save_checkpoint`: not a torch file, not a dict with ``"config"`` and ``"state_dict"``,
            a config :class:`attnlib.GPTConfig` refuses, or a parameter missing, extra or of another shape
            than the config's model (the message names the path and the parameter).
    """
    from attnlib.models.config import GPTConfig
    from attnlib.models.decoder import GPT

    path = file_path("path", path)
    if isinstance(map_location, (str, torch.device)):
        check_device("map_location", map_location)
    elif not (isinstance(map_location, dict) or callable(map_location)):
        raise TypeError(f"map_location must be a str or a torch.device; got {map_location!r} ({type(map_location).__name__})")
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except OSError:
        raise  # a directory, no permission: the OS's own message names the path
    except (RuntimeError, EOFError, KeyError, IndexError, AttributeError, ValueError, pickle.UnpicklingError) as e:
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}" if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} is not a checkpoint written by save_checkpoint: torch.load failed ({reason})") from None
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path} is not a checkpoint written by save_checkpoint: it holds a {type(ckpt).__name__}, "
                         f"not a dict with 'config' and 'state_dict'")
    for key in ("config", "state_dict"):
        if key not in ckpt:
            raise ValueError(f"{path} is not a checkpoint written by save_checkpoint: it has no {key!r} "
                             f"(its keys: {sorted(map(str, ckpt))[:5]}{' ...' if len(ckpt) > 5 else ''})")
        if not isinstance(ckpt[key], dict):
            raise ValueError(f"{path}: {key!r} is a {type(ckpt[key]).__name__}, expected a dict")
    try:
        model = GPT(GPTConfig(**ckpt.pop("config")))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: its 'config' is not a valid GPTConfig: {e}") from None
    state = ckpt.pop("state_dict")
    _check_state_dict(path, state, model)
    model.load_state_dict(state)
    return model, ckpt
