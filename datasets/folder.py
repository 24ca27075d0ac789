"""Any folder of class sub-folders: ``data.name=folder data.root=PATH``, a dataset named after the folder
(``data.name=NAME data.reader=folder data.root=PATH`` names it yourself).

    PATH/
    |-- cat/          one sub-folder per class; the folder name is the class name
    |   |-- 001.jpg
    |   `-- ...
    `-- dog/
        `-- ...

Class names are the folder names, sorted, with underscores turned into spaces
for the prompts (``golden_retriever`` -> ``golden retriever``). Images are the
files directly inside each class folder whose extension is one of
``IMAGE_EXTENSIONS`` (any case); hidden files are skipped.

Without ``data.split_file`` every class is split on its own, 50% train / 20%
val / 30% test (rounded half up; test gets at least one image, val may get
none), by ordering its files on the SHA-1 of their relative path. The split
depends only on the file names: it is the same on every machine and for every
seed, and adding an image never moves the others between splits.

With ``data.split_file`` the split comes from a JSON file in CoOp's
``split_zhou_*.json`` format, ``{"train": [[relpath, label, classname], ...],
"val": [...], "test": [...]}``, with paths relative to the root.
``read_split_file`` parses that format for the benchmark readers too.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Optional

from fewclip.data.base import SPLITS, DataConfig, Dataset, DatasetError, Item, folder_dataset_name, register_dataset

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")

# Fractions of each class for the default split; test takes the rest.
TRAIN_FRACTION = 0.5
VAL_FRACTION = 0.2

TEMPLATES = [
    "a photo of a {}.",
    "a photo of the {}.",
    "a close-up photo of a {}.",
    "a cropped photo of a {}.",
    "a good photo of a {}.",
    "an image of a {}.",
]

LAYOUT = """\
data.root=PATH, one sub-folder per class (folder name = class name); the dataset is named after PATH's
folder, or data.name=NAME data.reader=folder names it:
  PATH/
  |-- cat/
  |   |-- 001.jpg        .jpg .jpeg .png .bmp .webp .tif .tiff (any case)
  |   `-- ...
  `-- dog/
      `-- ...
Split: 50% train / 20% val / 30% test per class, by file-name hash; or
data.split_file=FILE in CoOp's split_zhou format with paths relative to PATH:
  {"train": [["cat/001.jpg", 0, "cat"], ...], "val": [...], "test": [...]}"""


def clean_classname(name: str) -> str:
    """A folder or split-file class name as it goes into a prompt: underscores become spaces."""
    return " ".join(name.replace("_", " ").split())


def is_image_file(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def _entries(folder: Path, keep) -> list[str]:
    """Sorted names of the entries of ``folder`` for which ``keep(entry)``; a broken entry (a symbolic link
    loop) is a DatasetError naming it."""
    names = []
    with os.scandir(folder) as it:
        for e in it:
            try:
                if keep(e):
                    names.append(e.name)
            except OSError as err:
                raise DatasetError(f"cannot read {e.path}: {err.strerror} (a symbolic link loop or a broken link?); "
                                   f"remove or fix it, or move it out of data.root") from None
    return sorted(names)


def list_class_folders(root: Path) -> list[str]:
    """Sorted names of the non-hidden sub-folders of ``root``."""
    return _entries(root, lambda e: not e.name.startswith(".") and e.is_dir())


def list_images(folder: Path) -> list[str]:
    """Sorted names of the image files directly inside ``folder``."""
    return _entries(folder, lambda e: is_image_file(e.name) and e.is_file())


def hash_order(ids: Iterable[str]) -> list[str]:
    """``ids`` ordered by the SHA-1 of each id: a shuffle that depends only on the names."""
    return sorted(ids, key=lambda s: (hashlib.sha1(s.encode("utf-8")).hexdigest(), s))


def split_counts(n: int) -> tuple[int, int, int]:
    """(train, val, test) sizes for a class of ``n >= 1`` images; test gets at least one."""
    n_test = max(1, int((1.0 - TRAIN_FRACTION - VAL_FRACTION) * n + 0.5))
    n_val = min(int(VAL_FRACTION * n + 0.5), n - n_test)
    return n - n_val - n_test, n_val, n_test


def read_split_file(
    path: Path,
    *,
    rename: Optional[Mapping[str, str]] = None,
    ignored: Collection[str] = (),
) -> tuple[list[str], dict[str, list[Item]]]:
    """Parse a CoOp ``split_zhou`` JSON into (class names, {split: items}).

    Entries whose first path component is in ``ignored`` are dropped. Class
    names go through ``rename`` (raw name -> new name) and then
    ``clean_classname``. Labels are renumbered 0..C-1 in the order of the
    file's labels, so dropping classes leaves no gaps. A label must be a
    non-negative integer naming one class throughout; anything else is a
    ``DatasetError`` naming the file and the entry. Files are not checked here.
    """
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise DatasetError(f"split file not found: {path}") from None
    except (OSError, ValueError) as e:
        raise DatasetError(f"cannot read split file {path}: {e}") from None
    if not isinstance(raw, dict) or "train" not in raw or "test" not in raw:
        raise DatasetError(
            f"split file {path} must be a JSON object with 'train', 'val' and 'test' lists of "
            f"[relpath, label, classname] entries"
        )
    unknown = sorted(set(raw) - set(SPLITS))
    if unknown:
        raise DatasetError(f"split file {path} has unknown keys {unknown}; allowed: {list(SPLITS)}")

    rename = rename or {}
    names: dict[int, str] = {}  # file label -> raw class name
    entries: dict[str, list[tuple[str, int]]] = {}
    for split in SPLITS:
        rows = raw.get(split, [])
        if not isinstance(rows, list):
            raise DatasetError(f"split file {path}: {split!r} must be a list, got {type(rows).__name__}")
        out = entries[split] = []
        for i, row in enumerate(rows):
            where = f"split file {path}, {split}[{i}] = {row!r}"
            if not (isinstance(row, (list, tuple)) and len(row) == 3):
                raise DatasetError(f"{where}: expected [relpath, label, classname]")
            relpath, label, name = row
            if not isinstance(relpath, str) or not relpath or relpath.startswith("/") or "\\" in relpath:
                raise DatasetError(f"{where}: the path must be a relative posix path")
            if isinstance(label, bool) or not isinstance(label, int) or label < 0:
                raise DatasetError(f"{where}: bad label {label!r} (labels are integers >= 0)")
            if not isinstance(name, str) or not name.strip():
                raise DatasetError(f"{where}: bad class name {name!r}")
            if relpath.split("/", 1)[0] in ignored:
                continue
            if names.setdefault(label, name) != name:
                raise DatasetError(
                    f"{where}: bad label {label}: it names class {names[label]!r} elsewhere in the file"
                )
            out.append((relpath, label))

    if not names:
        raise DatasetError(f"split file {path} lists no images")
    old_labels = sorted(names)
    classnames = [clean_classname(rename.get(names[y], names[y])) for y in old_labels]  # labels may share a name
    new_label = {y: i for i, y in enumerate(old_labels)}
    splits = {s: [Item(rel, new_label[y]) for rel, y in rows] for s, rows in entries.items()}
    return classnames, splits


def check_files(root: Path, items: Sequence[Item], *, source: str, layout: str, every: bool = True) -> None:
    """Fail on the first listed image that is not a file under ``root``.

    ``every=False`` checks only the first item of each class, which catches a
    wrong root or image folder without a stat per image on large benchmarks.
    """
    seen = set()
    for item in items:
        if not every:
            if item.label in seen:
                continue
            seen.add(item.label)
        if not (root / item.id).is_file():
            raise DatasetError(
                f"{source} lists {item.id!r}, but {root / item.id} is not a file; expected layout:\n{layout}"
            )


def resolve_split_file(split_file: str, root: Path) -> Path:
    """``data.split_file`` as given, or relative to the root when it is not found as given."""
    path = Path(split_file).expanduser()
    if not path.is_file() and not path.is_absolute() and (root / path).is_file():
        return root / path
    return path


def _folder_error(message: str) -> DatasetError:
    return DatasetError(f"{message}; expected layout:\n{LAYOUT}")


def _scan_folder(root: Path) -> tuple[list[str], dict[str, list[Item]]]:
    folders = list_class_folders(root)
    if not folders:
        raise _folder_error(f"data.root={str(root)!r} has no class sub-folders")
    splits: dict[str, list[Item]] = {s: [] for s in SPLITS}
    for label, folder in enumerate(folders):
        files = list_images(root / folder)
        if not files:
            raise _folder_error(
                f"class folder {str(root / folder)!r} holds no images ({' '.join(IMAGE_EXTENSIONS)})"
            )
        ids = hash_order(f"{folder}/{name}" for name in files)
        n_train, n_val, _ = split_counts(len(ids))
        parts = {"train": ids[:n_train], "val": ids[n_train : n_train + n_val], "test": ids[n_train + n_val :]}
        for split, part in parts.items():
            splits[split].extend(Item(i, label) for i in sorted(part))
    # Folders `a_b` and `a b` give one class name: two classes with the same prompt, which a run reports
    # (fewclip.data.class_names); each folder stays its own class.
    return [clean_classname(f) for f in folders], splits


def build_folder(cfg: DataConfig) -> Dataset:
    if not cfg.root:
        raise _folder_error("dataset 'folder' needs data.root=PATH")
    root = Path(cfg.root).expanduser()
    if not root.is_dir():
        raise _folder_error(f"data.root={cfg.root!r} is not a folder")
    if cfg.split_file:
        path = resolve_split_file(cfg.split_file, root)
        classnames, splits = read_split_file(path)
        for split in SPLITS:
            check_files(root, splits[split], source=f"split file {path}", layout=LAYOUT)
        source = f"split file {path}"
    else:
        classnames, splits = _scan_folder(root)
        source = f"data.root={str(root)!r}"
    has_test = {item.label for item in splits["test"]}
    missing = [c for y, c in enumerate(classnames) if y not in has_test]
    if missing:
        raise DatasetError(
            f"{source}: every class needs at least one test image; none for {', '.join(map(repr, missing))}"
        )
    return Dataset(cfg.name, classnames, list(TEMPLATES), splits, root)


register_dataset(
    "folder",
    build_folder,
    description="Any folder with one sub-folder of images per class (optional CoOp-format split file)",
    layout=LAYOUT,
    default_name=lambda cfg: folder_dataset_name(cfg.root),
)
