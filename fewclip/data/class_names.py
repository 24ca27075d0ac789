"""Class names are prompts, labels are indices.

A class is its label (its index in ``Dataset.classnames``); its name is only what goes into the prompts. Two
classes may have the same name, or names a tokenizer cannot tell apart: CLIP's (and open_clip's) 1000 ImageNet
names hold ``missile`` twice (labels 657 and 744) and ``sunglasses`` twice (836 and 837), and the authors'
CoOp trains on ImageNet with them as they are. Such classes get identical prompts, so a prompt-only classifier
scores them alike; fewclip runs them all the same, says so once per command before any run (one warning line
naming the classes), and records the groups in each run's metrics.json (``identical_prompts``).

Nothing keys a class by its name: per-class tables use :func:`class_keys` (the name, with the label added
where a name repeats), so no class is dropped or merged.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

log = logging.getLogger(__name__)


def _norm(name: str) -> str:
    return " ".join(str(name).lower().split())


def class_keys(classnames: Sequence[str]) -> list[str]:
    """One distinct key per class, in label order: the class name, or ``"name [label]"`` for every class whose
    name (up to case and spacing) another class also has (``missile [657]``, ``missile [744]``)."""
    counts: dict[str, int] = {}
    for n in classnames:
        counts[_norm(n)] = counts.get(_norm(n), 0) + 1
    keys = [f"{n} [{y}]" if counts[_norm(n)] > 1 else n for y, n in enumerate(classnames)]
    seen = set()
    for y, k in enumerate(keys):  # a name that is literally another class's "name [label]": label it too
        if k in seen:
            keys[y] = f"{k} [{y}]"
        seen.add(keys[y])
    return keys


def _token_key(tokenizer, texts: Sequence[str]):
    out = tokenizer(list(texts))
    try:  # open_clip's tokenizers give a LongTensor [N, L]; a word tokenizer may give lists
        return [tuple(map(int, row)) for row in out.tolist()]
    except AttributeError:
        return [tuple(map(int, row)) for row in out]


def identical_prompt_groups(classnames: Sequence[str], templates: Sequence[str] = ("{}",),
                            tokenizer=None) -> list[list[int]]:
    """The groups (each two or more labels, ascending) of classes whose prompts are identical: their names give
    the same tokens with ``tokenizer`` (a callable on a list of strings, as ``Backbone.tokenize``), or, without
    one, every template filled with them gives the same text up to case and spacing (what CLIP's tokenizer
    ignores). Groups are ordered by their first label."""
    names = list(classnames)
    templates = list(templates) or ["{}"]
    keys: list[Any]
    if tokenizer is not None:
        # The bare names: every method puts the same tokens (a template's words, learned context) around each
        # name, so names with the same tokens give the same prompts whatever the template or method.
        keys = _token_key(tokenizer, names)
    else:
        keys = [tuple(_norm(t.format(n)) for t in templates) for n in names]
    groups: dict[Any, list[int]] = {}
    for y, k in enumerate(keys):
        groups.setdefault(k, []).append(y)
    return sorted((g for g in groups.values() if len(g) > 1), key=lambda g: g[0])


def describe_groups(classnames: Sequence[str], groups: Sequence[Sequence[int]], limit: int = 8) -> str:
    """``'missile' (labels 657, 744), 'sunglasses' (labels 836, 837)``; names that differ are all shown."""
    parts = []
    for g in groups[:limit]:
        shown = list(dict.fromkeys(classnames[y] for y in g))
        parts.append(" = ".join(map(repr, shown)) + f" (labels {', '.join(map(str, g))})")
    more = f" and {len(groups) - limit} more group(s)" if len(groups) > limit else ""
    return ", ".join(parts) + more


def identical_prompts_record(classnames: Sequence[str], groups: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    """What metrics.json keeps of the groups: ``[{"labels": [657, 744], "classnames": ["missile", "missile"]}]``."""
    return [{"labels": list(g), "classnames": [classnames[y] for y in g]} for g in groups]


def backbone_tokenizer(backbone) -> Optional[Any]:
    """The callable that tokenizes prompts as the backbone's text tower reads them, or None for a backbone with
    no tokenizer (a feature file's: its text features are looked up by the prompt's text)."""
    try:
        return backbone.tokenize if getattr(backbone, "tokenizer", None) is not None else None
    except Exception:  # noqa: BLE001  a feature backbone raises TowerMissing for any tower attribute
        return None


def plan_identical_prompts(backbone, plan, templates: str = "single") -> list[dict[str, Any]]:
    """The identical-prompt groups of every class list a protocol plan builds classifiers from (its training
    dataset and each test set), as metrics.json records them: ``[{"dataset", "labels", "classnames"}]``, labels
    being that dataset's own."""
    tokenizer = backbone_tokenizer(backbone)
    out: list[dict[str, Any]] = []
    seen = set()
    for ds in [plan.train] + [e.dataset for e in plan.evals]:
        if ds.name in seen:
            continue
        seen.add(ds.name)
        groups = identical_prompt_groups(ds.classnames, ds.prompts(templates), tokenizer)
        out.extend({"dataset": ds.name, **r} for r in identical_prompts_record(ds.classnames, groups))
    return out


def warn_records(records: Sequence[dict[str, Any]], *, backbone: str = "", where: str = "") -> None:
    """One warning line for a plan's records (``plan_identical_prompts``), naming each dataset's groups."""
    if not records:
        return
    by_ds: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_ds.setdefault(r["dataset"], []).append(r)
    parts = []
    for ds, rs in by_ds.items():
        names = {y: n for r in rs for y, n in zip(r["labels"], r["classnames"])}
        groups = [r["labels"] for r in rs]
        parts.append(f"{ds}: {describe_groups([names.get(y, '') for y in range(max(names) + 1)], groups)}")
    n = sum(len(r["labels"]) for r in records)
    log.warning("%sidentical prompts: %d classes share their prompt with another class%s (%s); they run as they "
                "are, as the authors' CoOp runs ImageNet, and a classifier that reads only the prompts scores such "
                "classes alike", f"{where}: " if where else "", n,
                f" with backbone {backbone!r}" if backbone else "", "; ".join(parts))
