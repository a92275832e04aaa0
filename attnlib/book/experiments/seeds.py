"""Several seeds of chapter 13's comparison: their summary, and merging runs of other seeds into a file.

Used by :mod:`attnlib.book.experiments.compare_attention` (``--seeds``, ``--merge-with``).
"""
from __future__ import annotations

import json

__all__ = ["add_seed_runs", "merge_seeds", "seed_summary"]


def seed_summary(results: dict, step: int | None = None) -> dict[str, dict[str, float]]:
    """Validation loss per variant over its seeds: ``{name: {n, mean, min, max, std, losses}}``.

    ``step=None`` takes each seed's final loss (all of a variant's runs must end at the same
    step); an int takes each seed's estimate at that step. ``std`` is the sample standard
    deviation (0.0 for one seed); ``losses`` maps each seed (a string) to its loss. A file
    written before ``by_seed`` existed counts as one seed (its top-level run).

    Raises:
        ValueError: runs that end at different steps (with ``step=None``), or a run that has
            no estimate at ``step``.
    """
    summary = {}
    for name, run in results["variants"].items():
        by_seed = run.get("by_seed") or {str(results.get("training", {}).get("seed", "")): run}
        if step is None:
            ends = {r["steps"][-1] for r in by_seed.values()}
            if len(ends) > 1:
                raise ValueError(f"variant={name!r}: its runs end at steps {sorted(ends)}; pass step=")
            losses = {seed: r["val_loss"][-1] for seed, r in by_seed.items()}
        else:
            missing = [seed for seed, r in by_seed.items() if step not in r["steps"]]
            if missing:
                raise ValueError(f"variant={name!r}: seed(s) {missing} have no estimate at step={step}")
            losses = {seed: r["val_loss"][r["steps"].index(step)] for seed, r in by_seed.items()}
        values = list(losses.values())
        mean = sum(values) / len(values)
        var = sum((x - mean) ** 2 for x in values) / (len(values) - 1) if len(values) > 1 else 0.0
        summary[name] = {"n": len(values), "mean": mean, "min": min(values), "max": max(values),
                         "std": var**0.5, "losses": losses}
    return summary


#: Training settings that may differ between merged runs (extra seeds may train for fewer steps).
_SEED_FREE = ("seed", "eval_interval", "device", "max_iters")


def merge_seeds(first: dict, more: dict, model_keys=()) -> dict:
    """``first`` with the runs of ``more`` (other seeds, same settings) added to its ``by_seed`` entries.

    Used to add seeds to a finished run without training its first seed again
    (``--merge-with``). The model settings and the training settings other than the
    seed, the number of steps, the evaluation interval and the device must agree (extra
    seeds may train for fewer steps: compare them at a step every run evaluated, with
    :func:`seed_summary`'s ``step``), and so must each variant's
    parameter count; a variant of ``more`` must be in ``first``. A file written before
    ``by_seed`` existed counts as one run with its training seed. ``first``'s top-level
    entries (its own seed's curves) are kept; ``meta["merged"]`` lists ``more``'s meta.

    Raises:
        ValueError: settings that differ, a variant ``first`` lacks, or a seed both have.
    """
    shared = sorted(set(first["model"]) & set(more["model"]) | set(model_keys))  # older files store more keys
    a, b = ({k: r["model"].get(k) for k in shared} for r in (first, more))
    if a != b:
        raise ValueError(f"model settings differ: {a} vs {b}")
    a, b = ({k: v for k, v in r["training"].items() if k not in _SEED_FREE} for r in (first, more))
    if a != b:
        raise ValueError(f"training settings differ beyond {_SEED_FREE}: {a} vs {b}")
    merged = json.loads(json.dumps(first))  # a deep copy
    seed0 = str(first["training"]["seed"])
    for run in merged["variants"].values():
        if "by_seed" not in run:
            keep = ("steps", "train_loss", "val_loss", "tokens_per_s", "elapsed_s", "final_train_loss",
                    "final_val_loss")
            run["by_seed"] = {seed0: {k: run[k] for k in keep if k in run}}
    for name, run in more["variants"].items():
        if name not in merged["variants"]:
            raise ValueError(f"variant={name!r} is not in the run it should be merged into")
        if run["parameters"] != merged["variants"][name]["parameters"]:
            raise ValueError(f"variant={name!r}: {run['parameters']} parameters, but "
                             f"{merged['variants'][name]['parameters']} in the run it should be merged into")
        for seed, seed_run in run["by_seed"].items():
            if seed in merged["variants"][name]["by_seed"]:
                raise ValueError(f"variant={name!r}: seed {seed} is in both runs")
            merged["variants"][name]["by_seed"][seed] = seed_run
    merged["seeds"] = list(dict.fromkeys([*first.get("seeds", [first["training"]["seed"]]), *more["seeds"]]))
    merged["meta"]["merged"] = [*first["meta"].get("merged", []), more["meta"]]
    return merged


def add_seed_runs(first: dict, more: dict, group: str, label: str) -> dict:
    """A deep copy of ``first`` with the ``by_seed`` runs of ``more[group]``'s entries added (an entry ``first``
    lacks comes whole) and ``more``'s meta listed in ``meta["merged"]``; the callers check the settings first
    and set ``seeds``. Used by the experiments of chapters 20 and 21 (``--merge-with``).

    Raises:
        ValueError: a (``label``, seed) run that both hold.
    """
    merged = json.loads(json.dumps(first))  # a deep copy
    for name, entry in more[group].items():
        into = merged[group].setdefault(name, {**entry, "by_seed": {}})
        for seed, run in entry["by_seed"].items():
            if seed in into["by_seed"]:
                raise ValueError(f"{label}={name!r}: seed {seed} is in both runs")
            into["by_seed"][seed] = run
    merged["meta"].setdefault("merged", []).append(more["meta"])
    return merged
