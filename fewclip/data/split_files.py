"""Few-shot split files in the formats others publish: read, check against a dataset, write.

A published split says which images a few-shot number came from. fewclip reads
five formats and writes four:

* ``zhou``: CoOp's ``split_zhou_*.json`` (KaiyangZhou/CoOp, ``datasets/oxford_pets.py``
  ``OxfordPets.save_split``/``read_split``): one JSON object with ``train``, ``val`` and
  ``test`` lists of ``[relative path, label, class name]``. CoOp uses it for a
  dataset's full split; as a few-shot split its ``train`` and ``val`` are the
  few-shot images and ``test`` the dataset's test images (so CoOp's own
  ``read_split`` reads fewclip's export as a dataset).
* ``2sfs``: the JSON-lines files of 2SFS (FarinaMatteo/rethinking_fewshot_vlms,
  ``datasets/utils.py`` ``load_jsonl``/``dict2datum``, ``datasets/oxford_pets.py``):
  ``<dataset>/split_fewshot/shot_{K}-seed_{S}_train.jsonl`` and ``..._val.jsonl``,
  one object per line, ``{"_impath": ..., "_label": ..., "_domain": -1, "_classname": ...}``,
  the paths relative to the datasets' root (``$DATA``, their ``--root_path``).
* ``manifest``: image ids, one per line (the training images; labels from the
  dataset), or CSV ``id,label,split`` (``split`` train or val).
* ``fewclip``: the ``split.json`` a run writes (``fewclip.data.splits``).
* ``coop_pickle`` (read only): CoOp's own few-shot pickles
  (``<dataset>/split_fewshot/shot_{K}-seed_{S}.pkl``), through an unpickler that
  builds Dassl's ``Datum`` records and plain containers only and refuses
  anything else unrun (``fewclip.data.coop_pickle``).

A file's class names (zhou, 2sfs, fewclip) must be the dataset's names of
the same images' labels (case and underscores aside, and CoOp's renames of
raw names such as Caltech's ``Faces``); its label numbers may differ.

A file's paths are matched to a dataset's image ids exactly, or by their
longest trailing part that names one image (``$DATA/oxford_pets/images/a.jpg``,
``oxford_pets/images/a.jpg`` and ``images/a.jpg`` all find the id
``images/a.jpg``). The images are ordered as fewclip's own draw orders them (by
class, then by the dataset's order), so a file gives the same run whatever the
order of its lines. A file without validation images (CoOp's ImageNet pickles)
leaves them to fewclip's seeded draw (``make_few_shot_split``'s) from the
held-out images that are not the file's training images. Torch-free.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fewclip.data.base import DataConfig, Dataset, DatasetError, Item
from fewclip.data.coop_pickle import CoopPickleError, load_coop_pickle
from fewclip.data.coop_pickle import stated as coop_stated
from fewclip.data.coop_sampler import draw_split
from fewclip.data.splits import VAL_SHOTS_MAX, FewShotSplit, derive_seed, sample_few_shot
from fewclip.utils.io import atomic_write_text

FORMATS = ("zhou", "2sfs", "manifest", "fewclip", "coop_pickle")
WRITTEN = ("zhou", "2sfs", "manifest", "fewclip")
PICKLE_SUFFIXES = (".pkl", ".pickle")
TWOSFS_KEYS = ("_impath", "_label", "_domain", "_classname")
MANIFEST_HEADER = ["id", "label", "split"]
SHOWN = 5  # images named in an error


class SplitFileError(DatasetError):
    """A split file that cannot be read, or that does not fit the dataset it is used with."""


EXPECTED = {
    "zhou": ('CoOp\'s split_zhou JSON: {"train": [[relpath, label, classname], ...], "val": [...], '
             '"test": [...]}'),
    "2sfs": ('2SFS JSON lines, shot_K-seed_S_train.jsonl (and _val.jsonl): one object a line, '
             '{"_impath": path, "_label": int, "_domain": int, "_classname": name}'),
    "manifest": "a manifest: one image id a line, or CSV with the header id,label,split",
    "fewclip": 'the split.json of a fewclip run ({"format": "fewclip.fewshot/1", ...})',
    "coop_pickle": "CoOp's split_fewshot/shot_K-seed_S.pkl: a dict of 'train' (and 'val') lists of Dassl Datum",
}


@dataclass
class SplitOptions:
    """``fewclip split export|import``: a dataset (as a run's ``data`` section) and the split to write or check."""

    data: DataConfig = field(default_factory=DataConfig, metadata={"help": (
        "The dataset the split file belongs to (its class names and images are checked against it).")})
    shots: Optional[int] = field(default=None, metadata={"help": (
        "training images per class; export: to draw (default 16); import: the shots the file must hold")})
    seed: Optional[int] = field(default=None, metadata={"help": (
        "export: the draw's seed (default 1); import: also compare the file with fewclip's draw of this seed "
        "(and draw the validation images of a file without them)")})
    format: Optional[str] = field(default=None, metadata={"help": (
        "zhou (CoOp's split_zhou JSON), 2sfs (2SFS JSON lines, writes _train.jsonl and _val.jsonl), manifest "
        "(CSV id,label,split; a .txt out: one training id a line), fewclip (a run's split.json) or, to import, "
        "coop_pickle (CoOp's split_fewshot/shot_K-seed_S.pkl, read without running it); import: read from the "
        "file when not given")})
    out: Optional[str] = field(default=None, metadata={"help": (
        "export: the file to write (2sfs: a folder, or a path ending _train.jsonl)")})

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.shots is not None and self.shots < 1:
            raise ValueError(f"shots must be >= 1, got {self.shots}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


# ---------------------------------------------------------------------------
# what a file holds, before it meets a dataset
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One image of a file: its path as written, and its label and class name where the format has them."""

    path: str
    label: Optional[int] = None
    classname: Optional[str] = None


@dataclass
class SplitFile:
    """A split file as read: its format, its training and validation entries (``val`` None: the file has none),
    and each file read with its sha256 (``files``: path -> checksum)."""

    format: str
    path: Path
    train: list[Entry]
    val: Optional[list[Entry]]
    files: dict[str, str] = field(default_factory=dict)
    shots: Optional[int] = None  # where the file states them (fewclip's, 2SFS's file name)
    seed: Optional[int] = None

    def source(self) -> dict[str, object]:
        """What a run records about the file: its absolute path, format and every file's sha256."""
        out: dict[str, object] = {"path": str(self.path.resolve()), "format": self.format,
                                  "sha256": self.files[str(self.path)]}
        others = {str(Path(p).resolve()): h for p, h in self.files.items() if p != str(self.path)}
        if others:
            out["other_files"] = others
        return out


def _sha256(data: bytes) -> str:
    # fewclip.utils.checksums holds the same, but imports torch; this module stays torch-free
    return hashlib.sha256(data).hexdigest()


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise SplitFileError(f"split file not found: {path}") from None
    except IsADirectoryError:
        raise SplitFileError(f"split file {path} is a folder; give the file (2SFS: the ..._train.jsonl)") from None
    except OSError as e:
        raise SplitFileError(f"cannot read split file {path}: {e}") from None


def _wrong(path: Path, fmt: str, problem: str) -> SplitFileError:
    return SplitFileError(f"{path} is not a {fmt} split file ({problem}); expected {EXPECTED[fmt]}")


def _is_pickle(path: Path, data: bytes) -> bool:
    return path.suffix.lower() in PICKLE_SUFFIXES or data[:1] == b"\x80"  # every pickle protocol >= 2 opens so


def detect_format(path: Path, data: bytes) -> str:
    """The format of a file from its name and first bytes (a pickle: CoOp's, read by the restricted unpickler)."""
    if _is_pickle(path, data):
        return "coop_pickle"
    if path.suffix.lower() == ".jsonl":
        return "2sfs"
    if path.suffix.lower() == ".json":
        try:
            obj = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return "zhou"  # read_file reports the JSON error against the format
        return "fewclip" if isinstance(obj, dict) and "format" in obj else "zhou"
    return "manifest"


def _text(path: Path, data: bytes, fmt: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _wrong(path, fmt, f"not UTF-8 text: {e}") from None


def _label(value, path: Path, fmt: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _wrong(path, fmt, f"{where}: label {value!r} is not an integer >= 0")
    return value


def _relpath(value, path: Path, fmt: str, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _wrong(path, fmt, f"{where}: image path {value!r} is not a non-empty string")
    return value.strip()


def _parse_zhou(path: Path, data: bytes) -> tuple[list[Entry], Optional[list[Entry]]]:
    try:
        obj = json.loads(_text(path, data, "zhou"))
    except ValueError as e:
        raise _wrong(path, "zhou", f"not JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("train"), list):
        raise _wrong(path, "zhou", "no 'train' list")
    out: dict[str, list[Entry]] = {}
    for split in ("train", "val"):
        if split not in obj:
            continue
        rows = obj[split]
        if not isinstance(rows, list):
            raise _wrong(path, "zhou", f"{split!r} is a {type(rows).__name__}, not a list")
        out[split] = []
        for i, row in enumerate(rows):
            where = f"{split}[{i}] = {row!r}"
            if not (isinstance(row, list) and len(row) == 3):
                raise _wrong(path, "zhou", f"{where} is not [relpath, label, classname]")
            name = row[2]
            if not isinstance(name, str):
                raise _wrong(path, "zhou", f"{where}: class name is not a string")
            out[split].append(Entry(_relpath(row[0], path, "zhou", where),
                                    _label(row[1], path, "zhou", where), name))
    return out["train"], out.get("val")


def _parse_jsonl(path: Path, data: bytes) -> list[Entry]:
    entries = []
    for n, line in enumerate(_text(path, data, "2sfs").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise _wrong(path, "2sfs", f"line {n} is not JSON: {e}") from None
        if not isinstance(obj, dict) or any(k not in obj for k in ("_impath", "_label", "_classname")):
            raise _wrong(path, "2sfs", f"line {n} is not an object with _impath, _label and _classname")
        where = f"line {n}"
        if not isinstance(obj["_classname"], str):
            raise _wrong(path, "2sfs", f"{where}: _classname is not a string")
        entries.append(Entry(_relpath(obj["_impath"], path, "2sfs", where),
                             _label(obj["_label"], path, "2sfs", where), obj["_classname"]))
    return entries


def twosfs_names(shots: int, seed: int) -> tuple[str, str]:
    """2SFS's file names of a (shots, seed) split: ``shot_16-seed_1_train.jsonl`` and ``..._val.jsonl``."""
    return f"shot_{shots}-seed_{seed}_train.jsonl", f"shot_{shots}-seed_{seed}_val.jsonl"


def _twosfs_pair(path: Path) -> tuple[Path, Optional[Path]]:
    """(train file, val file) of a 2SFS split given either of them."""
    name = path.name
    if name.endswith("_val.jsonl"):
        return path.with_name(name[: -len("_val.jsonl")] + "_train.jsonl"), path
    if name.endswith("_train.jsonl"):
        return path, path.with_name(name[: -len("_train.jsonl")] + "_val.jsonl")
    return path, None


def _twosfs_stated(path: Path) -> tuple[Optional[int], Optional[int]]:
    stem = path.name.split("_train.jsonl")[0].split("_val.jsonl")[0]
    try:
        shot, seed = stem.split("-")
        return int(shot.removeprefix("shot_")), int(seed.removeprefix("seed_"))
    except ValueError:
        return None, None


def _parse_manifest(path: Path, data: bytes) -> tuple[list[Entry], Optional[list[Entry]]]:
    text = _text(path, data, "manifest")
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise _wrong(path, "manifest", "no image ids")
    first = next(csv.reader([lines[0]]))
    if [c.strip().lower() for c in first] != MANIFEST_HEADER:  # one id a line: the training images
        if path.suffix.lower() == ".csv":
            raise _wrong(path, "manifest", f"a .csv file whose first line is {lines[0]!r}, not the header "
                                           f"{','.join(MANIFEST_HEADER)}")
        return [Entry(ln.strip()) for ln in lines], None
    train: list[Entry] = []
    val: list[Entry] = []
    for n, row in enumerate(csv.reader(io.StringIO("\n".join(lines[1:]))), 2):
        where = f"row {n} = {','.join(row)!r}"
        if len(row) != 3:
            raise _wrong(path, "manifest", f"{where} has {len(row)} fields, not id,label,split")
        rid, label, split = (c.strip() for c in row)
        split = split.lower()
        if split not in ("train", "val"):
            raise _wrong(path, "manifest", f"{where}: split {split!r} is neither train nor val")
        lab = None
        if label:
            if not label.isdigit():
                raise _wrong(path, "manifest", f"{where}: label {label!r} is not an integer >= 0 (or empty)")
            lab = int(label)
        (train if split == "train" else val).append(Entry(_relpath(rid, path, "manifest", where), lab))
    return train, (val if val else None)


def read_file(path: str | os.PathLike, fmt: Optional[str] = None) -> SplitFile:
    """Read a split file of any format (``fmt`` None: from its name and content); errors name the file and the
    expected format. Nothing here looks at a dataset."""
    path = Path(path).expanduser()
    data = _read_bytes(path)
    if fmt is None:
        fmt = detect_format(path, data)
    elif _is_pickle(path, data) and fmt != "coop_pickle":
        raise _wrong(path, fmt, "it is a pickle; CoOp's few-shot pickles are format=coop_pickle")
    if fmt not in FORMATS:
        raise SplitFileError(f"unknown split file format {fmt!r}; formats: {', '.join(FORMATS)}")
    files = {str(path): _sha256(data)}
    shots = seed = None
    if fmt == "zhou":
        train, val = _parse_zhou(path, data)
    elif fmt == "manifest":
        train, val = _parse_manifest(path, data)
    elif fmt == "coop_pickle":
        try:
            records = load_coop_pickle(path, data)
        except CoopPickleError as e:
            raise SplitFileError(str(e)) from None
        train, val = ([Entry(_relpath(d.impath, path, fmt, f"{d.impath!r}"), _label(d.label, path, fmt, d.impath),
                             d.classname) for d in rs] if rs is not None else None for rs in records)
        shots, seed = coop_stated(path)
    elif fmt == "2sfs":
        train_path, val_path = _twosfs_pair(path)
        if train_path != path:
            data = _read_bytes(train_path)
            files = {str(train_path): _sha256(data)}
            path = train_path
        train = _parse_jsonl(path, data)
        val = None
        if val_path is not None and val_path.is_file():
            vdata = _read_bytes(val_path)
            files[str(val_path)] = _sha256(vdata)
            val = _parse_jsonl(val_path, vdata)
        shots, seed = _twosfs_stated(path)
    else:
        try:
            split = FewShotSplit.from_json(json.loads(_text(path, data, "fewclip")), source=str(path))
        except ValueError as e:
            raise _wrong(path, "fewclip", f"not JSON: {e}") from None
        except DatasetError as e:
            raise _wrong(path, "fewclip", str(e)) from None
        names = split.classnames

        def entries(items: Sequence[Item]) -> list[Entry]:
            return [Entry(it.id, it.label, names[it.label] if it.label < len(names) else None) for it in items]

        train, val = entries(split.train), entries(split.val)
        shots, seed = split.shots, split.seed
    if not train:
        raise _wrong(path, fmt, "no training images")
    return SplitFile(fmt, path, train, val, files, shots, seed)


# ---------------------------------------------------------------------------
# a file against a dataset
# ---------------------------------------------------------------------------


class _Index:
    """A dataset's images by id, and by each trailing part of an id that names one image only."""

    AMBIGUOUS = ""

    def __init__(self, dataset: Dataset):
        self.where: dict[str, tuple[str, int, Item]] = {}
        for split in ("train", "val", "test"):
            for i, it in enumerate(dataset.splits.get(split, [])):
                self.where.setdefault(it.id, (split, i, it))
        self._suffixes: Optional[dict[str, str]] = None

    def _suffix_index(self) -> dict[str, str]:
        if self._suffixes is None:
            self._suffixes = {}
            for id_ in self.where:
                parts = id_.split("/")
                for i in range(1, len(parts)):
                    tail = "/".join(parts[i:])
                    self._suffixes[tail] = id_ if self._suffixes.get(tail, id_) == id_ else self.AMBIGUOUS
        return self._suffixes

    def find(self, path: str) -> Optional[tuple[str, int, Item]]:
        if path in self.where:
            return self.where[path]
        parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
        tails = ["/".join(parts[i:]) for i in range(len(parts))]
        for tail in tails:  # the file's path is longer than the id: a root in front
            if tail in self.where:
                return self.where[tail]
        suffixes = self._suffix_index()
        for tail in tails:  # the id is longer than the file's path: a folder the file leaves out
            hit = suffixes.get(tail)
            if hit:
                return self.where[hit]
        return None


def _listing(things: Sequence[str], quote: bool = True) -> str:
    """The first few of ``things`` (paths: quoted) and how many more."""
    more = f" and {len(things) - SHOWN} more" if len(things) > SHOWN else ""
    return ", ".join(repr(t) if quote else t for t in things[:SHOWN]) + more


def _check_labels(sf: SplitFile, pairs: Sequence[tuple[Entry, Item]], dataset: Dataset) -> None:
    """A file's labels may number the classes otherwise than the dataset, but each must name one class."""
    to_dataset: dict[int, int] = {}
    bad: list[str] = []
    for e, it in pairs:
        if e.label is None:
            continue
        if to_dataset.setdefault(e.label, it.label) != it.label:
            bad.append(f"{e.path!r} (label {e.label}: {dataset.classnames[it.label]!r}, elsewhere "
                       f"{dataset.classnames[to_dataset[e.label]]!r})")
    if bad:
        raise SplitFileError(f"{sf.path}: {len(bad)} image(s) carry a label that names another class elsewhere in "
                             f"the file, by dataset {dataset.name!r}: {_listing(bad, False)}; the file was written for "
                             f"another dataset or class order")
    if len(set(to_dataset.values())) != len(to_dataset):
        raise SplitFileError(f"{sf.path}: two of the file's labels name one class of dataset {dataset.name!r}; the "
                             f"file was written for another dataset")


def _name_key(name: str) -> str:
    """A class name as compared with a file's: case, underscores and runs of spaces aside."""
    return " ".join(name.replace("_", " ").split()).casefold()


def _check_names(sf: SplitFile, pairs: Sequence[tuple[Entry, Item]], dataset: Dataset) -> None:
    """Each image's class name in the file (where the format has one) against the dataset's name of its label,
    label by label: the file's label numbers may differ, its names may not (wrong names, one name for every
    class, or another dataset's split whose image ids happen to be this one's)."""
    for e, it in pairs:
        if e.classname is None:
            continue
        want = dataset.classnames[it.label]
        if _name_key(e.classname) == _name_key(want):
            continue
        alias = dataset.split_renames.get(e.classname)
        if alias is not None and _name_key(alias) == _name_key(want):
            continue
        raise SplitFileError(f"{sf.path}: image {e.path!r} is class {e.classname!r} in the file but "
                             f"{want!r} (label {it.label}) in dataset {dataset.name!r}; the file was written for "
                             f"another dataset or class list: use the split file of {dataset.name!r}")


def resolve(sf: SplitFile, dataset: Dataset, *, seed: Optional[int] = None, shots: Optional[int] = None,
            allow_fewer: bool = False) -> FewShotSplit:
    """The file's split as fewclip's ``FewShotSplit`` of ``dataset``: each path matched to an image of the
    dataset's train or val split, labels checked, the images ordered as fewclip's draw orders them.

    Images the dataset lacks are one error listing the first few (and how many); so are test images, images
    listed twice, and (given ``shots``) classes with more than ``shots`` images or, unless ``allow_fewer``,
    fewer. A file without validation images gets fewclip's draw of them with ``seed`` (none without a seed)."""
    index = _Index(dataset)
    sections = [("train", sf.train)] + ([("val", sf.val)] if sf.val is not None else [])
    missing: list[str] = []
    leaked: list[str] = []
    pairs: list[tuple[Entry, Item]] = []
    found: dict[str, list[tuple[int, int, Item]]] = {"train": [], "val": []}
    seen: dict[str, str] = {}
    twice: list[str] = []
    for section, entries in sections:
        for e in entries:
            hit = index.find(e.path)
            if hit is None:
                missing.append(e.path)
                continue
            split, i, it = hit
            if split == "test":
                leaked.append(e.path)
                continue
            if it.id in seen:
                twice.append(f"{e.path!r} ({seen[it.id]} and {section})" if seen[it.id] != section else repr(e.path))
                continue
            seen[it.id] = section
            pairs.append((e, it))
            found[section].append((0 if split == "train" else 1, i, it))
    n = len(sf.train) + len(sf.val or [])
    if missing:
        raise SplitFileError(
            f"{sf.path} names {len(missing)} of its {n} image(s) that dataset {dataset.name!r} does not have: "
            f"{_listing(missing)}; check data.root and that the file was written for this dataset")
    if leaked:
        raise SplitFileError(f"{sf.path} lists {len(leaked)} test image(s) of dataset {dataset.name!r} for training "
                             f"or validation: {_listing(leaked)}; a run is scored on them")
    if twice:
        raise SplitFileError(f"{sf.path} lists {len(twice)} image(s) twice: {_listing(twice, False)}; a few-shot split "
                             f"holds each image once")
    _check_labels(sf, pairs, dataset)
    _check_names(sf, pairs, dataset)

    def ordered(rows: list[tuple[int, int, Item]]) -> list[Item]:  # as make_few_shot_split: by class, then index
        return [it for _, _, it in sorted(rows, key=lambda r: (r[2].label, r[0], r[1]))]

    train = ordered(found["train"])
    counts = [0] * len(dataset.classnames)
    for it in train:
        counts[it.label] += 1
    stated = max(counts)
    if shots is not None:
        over = [f"{dataset.classnames[y]!r} ({c})" for y, c in enumerate(counts) if c > shots]
        if over:
            whole = ("; a dataset's whole split, as CoOp's own split_zhou_*.json files are, goes to data.split_file"
                     if sf.format == "zhou" else "")
            raise SplitFileError(f"{sf.path} holds more than shots={shots} training images for {len(over)} class(es):"
                                 f" {_listing(over, False)}; set shots={stated} (or use a file of {shots} shots)"
                                 + whole)
        under = [f"{dataset.classnames[y]!r} ({c})" for y, c in enumerate(counts) if c < shots]
        if under and not allow_fewer:
            raise SplitFileError(f"{sf.path} holds fewer than shots={shots} training images for {len(under)} "
                                 f"class(es): {_listing(under, False)}; set data.allow_fewer_shots=true to train on "
                                 f"what it holds")
    if sf.val is not None:
        val = ordered(found["val"])
    elif seed is None:  # nothing to draw them with: `fewclip split import` without seed=
        val = []
    else:  # the held-out images that are not the file's training images (CoOp's ImageNet files draw from all)
        taken = {it.id for it in train}
        pool = [it for it in dataset.splits.get("val", []) if it.id not in taken]
        k = min(shots if shots is not None else stated, VAL_SHOTS_MAX)
        picked = sample_few_shot([it.label for it in pool], k, derive_seed(seed, "val"), allow_fewer=True) \
            if pool else []
        val = [pool[i] for i in picked]
    return FewShotSplit(
        shots=shots if shots is not None else stated,
        seed=seed if seed is not None else (sf.seed if sf.seed is not None else -1),
        train=train, val=val, dataset=dataset.name, classnames=list(dataset.classnames), allow_fewer=allow_fewer,
        source=sf.source(),
    )


def expand_path(template: str, *, shots: int, seed: int, dataset: str) -> str:
    """``data.fewshot_file`` with ``{shots}``, ``{seed}`` and ``{dataset}`` filled in (one pattern serves a sweep:
    ``splits/shot_{shots}-seed_{seed}_train.jsonl``)."""
    return template.replace("{shots}", str(shots)).replace("{seed}", str(seed)).replace("{dataset}", dataset)


def split_from_file(template: str, source: Dataset, train: Dataset, *, shots: int, seed: int,
                    allow_fewer: bool = False) -> FewShotSplit:
    """A run's few-shot split read from ``data.fewshot_file``: checked against the protocol's ``source`` dataset
    (every image must be one of its images), then kept to the training dataset ``train`` (under base2new, the
    base classes: as in CoOp, a split of all classes keeps its base images)."""
    sf = read_file(expand_path(template, shots=shots, seed=seed, dataset=source.name))
    if train is source:
        return resolve(sf, source, seed=seed, shots=shots, allow_fewer=allow_fewer)
    whole = resolve(sf, source, seed=seed, shots=None)
    mine = {it.id: it for s in ("train", "val") for it in train.splits.get(s, [])}
    sub = FewShotSplit(shots=shots, seed=seed, train=[mine[it.id] for it in whole.train if it.id in mine],
                       val=[mine[it.id] for it in whole.val if it.id in mine], dataset=train.name,
                       classnames=list(train.classnames), allow_fewer=allow_fewer, source=whole.source)
    counts = [0] * len(train.classnames)
    for it in sub.train:
        counts[it.label] += 1
    wrong = [f"{train.classnames[y]!r} ({c})" for y, c in enumerate(counts) if c > shots or (c < shots and not
                                                                                               allow_fewer)]
    if wrong:
        raise SplitFileError(f"{sf.path} does not hold shots={shots} training images for {len(wrong)} class(es) of "
                             f"{train.name}: {_listing(wrong, False)}; set shots= to the file's, or "
                             f"data.allow_fewer_shots=true")
    return sub


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------


def _image_path(dataset: Dataset, item: Item, root: Optional[str]) -> str:
    """An image's path as 2SFS writes it: relative to the datasets' root (``data.root``) where it has files."""
    path = dataset.image_path(item)
    if path is None or not root:
        return item.id
    try:
        return Path(path).resolve().relative_to(Path(root).expanduser().resolve()).as_posix()
    except ValueError:
        return item.id


def write_file(split: FewShotSplit, dataset: Dataset, fmt: str, out: str | os.PathLike,
               root: Optional[str] = None) -> list[Path]:
    """Write ``split`` (of ``dataset``) in format ``fmt``; returns the files written (2SFS: train and val)."""
    folder = str(out).endswith(("/", os.sep))  # Path() drops the slash that says "a folder"
    out = Path(out).expanduser()
    names = dataset.classnames
    if fmt == "zhou":
        def rows(items: Sequence[Item]) -> list[list]:
            return [[it.id, it.label, names[it.label]] for it in items]

        obj = {"train": rows(split.train), "val": rows(split.val), "test": rows(dataset.splits.get("test", []))}
        return [atomic_write_text(out, json.dumps(obj, indent=4, separators=(",", ": ")) + "\n")]
    if fmt == "2sfs":
        train_name, val_name = twosfs_names(split.shots, split.seed)
        if folder or out.is_dir():
            train_path, val_path = out / train_name, out / val_name
        elif out.name.endswith("_train.jsonl"):
            train_path, val_path = out, out.with_name(out.name[: -len("_train.jsonl")] + "_val.jsonl")
        else:
            raise SplitFileError(f"format=2sfs writes two files, {train_name} and {val_name}: give out=FOLDER or a "
                                 f"path ending _train.jsonl, not {out}")

        def lines(items: Sequence[Item]) -> str:
            return "".join(json.dumps({"_impath": _image_path(dataset, it, root), "_label": it.label, "_domain": -1,
                                       "_classname": names[it.label]}) + "\n" for it in items)

        return [atomic_write_text(train_path, lines(split.train)), atomic_write_text(val_path, lines(split.val))]
    if fmt == "manifest":
        if out.suffix.lower() == ".txt":
            return [atomic_write_text(out, "".join(it.id + "\n" for it in split.train))]
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(MANIFEST_HEADER)
        w.writerows([it.id, it.label, s] for s, items in (("train", split.train), ("val", split.val))
                    for it in items)
        return [atomic_write_text(out, buf.getvalue())]
    if fmt == "fewclip":
        plain = FewShotSplit(split.shots, split.seed, split.train, split.val, split.dataset, split.classnames,
                             split.allow_fewer)
        return [atomic_write_text(out, json.dumps(plain.to_json(), indent=2) + "\n")]
    if fmt in FORMATS:
        raise SplitFileError(f"format={fmt} is read only; fewclip writes {', '.join(WRITTEN)}")
    raise SplitFileError(f"unknown split file format {fmt!r}; formats: {', '.join(WRITTEN)}")


# ---------------------------------------------------------------------------
# fewclip split export | import
# ---------------------------------------------------------------------------


def export_split(opts: SplitOptions, dataset: Dataset) -> str:
    """``fewclip split export``: write the split fewclip draws for (dataset, shots, seed); returns the summary."""
    if not opts.out:
        raise SplitFileError("fewclip split export needs out=FILE (2sfs: out=FOLDER)")
    fmt = opts.format or "zhou"
    seed = 1 if opts.seed is None else opts.seed
    shots = 16 if opts.shots is None else opts.shots
    split = draw_split(dataset, shots, seed, allow_fewer=opts.data.allow_fewer_shots, sampler=opts.data.sampler)
    paths = write_file(split, dataset, fmt, opts.out, root=opts.data.root)
    return (f"{dataset.name}: {shots}-shot split of seed {seed}, {len(split.train)} training and "
            f"{len(split.val)} validation images of {len(dataset.classnames)} classes, as {fmt} -> "
            + ", ".join(str(p) for p in paths))


def _per_class(items: Sequence[Item], n_classes: int) -> str:
    counts = [0] * n_classes
    for it in items:
        counts[it.label] += 1
    lo, hi = min(counts), max(counts)
    return f"{lo} per class" if lo == hi else f"{lo} to {hi} per class"


def import_split(opts: SplitOptions, path: str, dataset: Dataset) -> str:
    """``fewclip split import FILE``: check the file against the dataset and say what it holds."""
    sf = read_file(path, opts.format)
    split = resolve(sf, dataset, seed=opts.seed, shots=opts.shots, allow_fewer=opts.data.allow_fewer_shots)
    n = len(dataset.classnames)
    val_note = "" if sf.val is not None else (f" (none in the file: fewclip's draw of seed {opts.seed})"
                                              if opts.seed is not None else
                                              " (none in the file: a run draws them with its seed)")
    lines = [f"{sf.path}: {sf.format} split file" + (f" (+ {', '.join(list(sf.files)[1:])})"
                                                     if len(sf.files) > 1 else ""),
             f"  sha256 {sf.files[str(sf.path)]}",
             f"  dataset {dataset.name}: {n} classes, all images found",
             f"  train: {len(split.train)} images, {_per_class(split.train, n)}",
             "  val: " + (f"{len(split.val)} images, {_per_class(split.val, n)}" if split.val else "none") + val_note]
    if opts.seed is not None:
        sampler = opts.data.sampler
        own = draw_split(dataset, split.shots, opts.seed, allow_fewer=True, sampler=sampler)
        lines.append(f"  {'fewclip' if sampler == 'fewclip' else 'CoOp'}'s {split.shots}-shot draw of seed {opts.seed}"
                     f" (data.sampler={sampler}): " + compare(split, own))
    return "\n".join(lines)


def _differ(mine: Sequence[Item], other: Sequence[Item]) -> tuple[int, int]:
    """(images of ``mine`` that ``other`` lacks, images of ``other`` that ``mine`` lacks)."""
    a, b = {it.id for it in mine}, {it.id for it in other}
    return len(a - b), len(b - a)


def compare(split: FewShotSplit, own: FewShotSplit) -> str:
    """What differs between a file's split and a draw: the training images, the validation images, both or
    neither, with counts."""
    diffs: dict[str, str] = {}
    for what, mine, other in (("training", split.train, own.train), ("validation", split.val, own.val)):
        only_file, only_draw = _differ(mine, other)
        if only_file or only_draw:
            diffs[what] = (f"{only_file} of the file's {len(mine)} {what} images are not in the draw, "
                           f"{only_draw} of the draw's {len(other)} not in the file")
    if not diffs:
        return "the same training and validation images"
    if len(diffs) == 2:
        return f"other training and validation images ({diffs['training']}; {diffs['validation']})"
    (what, text), = diffs.items()
    return f"other {what} images ({text}); the same {'validation' if what == 'training' else 'training'} images"
