"""CoOp's few-shot pickles (``<dataset>/split_fewshot/shot_{K}-seed_{S}.pkl``), read without running them.

CoOp (KaiyangZhou/CoOp @ff61507, ``datasets/oxford_pets.py`` and the other
readers) saves its draw with ``pickle.dump({"train": [...], "val": [...]})``;
ImageNet's file has ``train`` only. Each element is a Dassl ``Datum``
(KaiyangZhou/Dassl.pytorch, ``dassl/data/datasets/base_dataset.py``) whose
state is ``{"_impath", "_label", "_domain", "_classname"}``.

Loading a pickle can run any callable the file names. Here the unpickler's
``find_class`` hands out one thing only, a stand-in for ``Datum`` that stores
four checked fields; every other global (``os.system``, ``builtins.eval``,
Dassl's own modules ...) is refused before it is looked up, so nothing in the
file is called. Lists, dicts, strings and numbers need no global. Torch-free.
"""
from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any, Optional

from fewclip.data.base import DatasetError

# Where Dassl's Datum lives, as a pickle names it (the class's module, and the packages that re-export it).
DATUM_GLOBALS = {("dassl.data.datasets.base_dataset", "Datum"), ("dassl.data.datasets", "Datum"),
                 ("dassl.data", "Datum")}
FIELDS = {"_impath": str, "_label": int, "_domain": int, "_classname": str}


class CoopPickleError(DatasetError):
    """A file that is not one of CoOp's few-shot pickles, or one that asks for anything besides Datum records."""


class Refused(pickle.UnpicklingError):
    """The file asks for something besides Datum records and plain values."""


class Datum:
    """What a Dassl ``Datum`` holds: image path, label, domain and class name; nothing else can be set."""

    __slots__ = ("impath", "label", "domain", "classname")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise Refused("it calls a Datum record with arguments (a record is rebuilt from its fields, never called)")

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:  # (None, slots): never written so
            state = state[1]
        if not isinstance(state, dict) or set(state) - set(FIELDS) or "_impath" not in state:
            raise Refused(f"a Datum record with fields {sorted(state) if isinstance(state, dict) else state!r}, "
                                         f"not {sorted(FIELDS)}")
        for key, typ in FIELDS.items():
            value = state.get(key, "" if typ is str else 0)
            if not isinstance(value, typ) or isinstance(value, bool):
                raise Refused(f"a Datum record whose {key} is {value!r}, not a {typ.__name__}")
            setattr(self, key[1:], value)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DATUM_GLOBALS:
            return Datum
        raise Refused(f"it asks for {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise Refused("it holds a persistent reference")


def _records(value: Any, path: Path, key: str) -> list[Datum]:
    if not isinstance(value, list) or not all(isinstance(d, Datum) and hasattr(d, "impath") for d in value):
        raise CoopPickleError(f"{path}: {key!r} is not a list of Dassl Datum records; expected CoOp's "
                              f"split_fewshot/shot_K-seed_S.pkl, a dict of 'train' (and 'val') Datum lists")
    return value


def load_coop_pickle(path: Path, data: bytes) -> tuple[list[Datum], Optional[list[Datum]]]:
    """(train, val) records of CoOp's pickle ``path`` whose bytes are ``data`` (val None: the file has none,
    as ImageNet's). Anything but Datum records, lists, dicts and plain values is refused unrun."""
    try:
        obj = _Unpickler(io.BytesIO(data)).load()
    except Refused as e:
        raise CoopPickleError(f"{path} was refused, unrun: {e}; fewclip reads only Dassl's Datum records, lists and "
                              f"dicts from a pickle (CoOp's split_fewshot/shot_K-seed_S.pkl)") from None
    except Exception as e:  # a truncated or damaged file: EOFError, ValueError, ...
        raise CoopPickleError(f"{path} is not a readable pickle ({type(e).__name__}: {e}); expected CoOp's "
                              f"split_fewshot/shot_K-seed_S.pkl") from None
    if not isinstance(obj, dict) or "train" not in obj or set(obj) - {"train", "val"}:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise CoopPickleError(f"{path} holds {keys}, not CoOp's few-shot split (a dict of 'train' and 'val' Datum "
                              f"lists)")
    return _records(obj["train"], path, "train"), (_records(obj["val"], path, "val") if "val" in obj else None)


def stated(path: Path) -> tuple[Optional[int], Optional[int]]:
    """(shots, seed) from CoOp's file name ``shot_16-seed_1.pkl``, or (None, None)."""
    m = re.fullmatch(r"shot_(\d+)-seed_(\d+)\.pkl", path.name)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)
