"""The dataset interface and registry.

A dataset is a classification task: class names, prompt templates, and lists of
labelled items for the ``train``, ``val`` and ``test`` splits. An item is an id
(a path relative to the dataset root for file datasets, a procedural key for the
toy world) and an integer label; ``Dataset.load_image(item)`` turns it into an
RGB PIL image. Building a dataset reads only index files (split JSONs, folder
listings), never the images themselves.

The registry is a plain dict filled by ``register_dataset`` next to each reader;
``build_dataset(cfg)`` looks a name up and calls its builder with the
``DataConfig`` section.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
from PIL import Image

from fewclip.data.image_check import drop_bad_images
from fewclip.data.name_files import read_classnames, read_templates
from fewclip.utils.errors import InputError
from fewclip.utils.registry import Registry

SPLITS = ("train", "val", "test")


class DatasetError(InputError):
    """Bad dataset input: a missing root, a wrong layout, an unreadable image."""


@dataclass
class DataConfig:
    """The ``data`` section of a run config."""

    name: str = field(default="toy-shapes", metadata={"help": (
        'The dataset: a registered name (`fewclip datasets`), or your own name for a dataset that `reader` '
        'builds. Runs, tables, run folders and the feature store know a dataset by its name; a `folder` dataset '
        'without a reader is named after its root folder (data=folder data.root=/data/pets: "pets").')})
    reader: Optional[str] = field(default=None, metadata={"help": (
        'The registered dataset that reads this one when `name` is your own (data.name=pets data.reader=folder '
        'data.root=/data/pets/images); null: `name` is a registered dataset.')})
    root: Optional[str] = field(default=None, metadata={"help": (
        'Folder holding the dataset (for file datasets). For the CoOp benchmark layouts this is the parent folder'
        ' that holds e.g. ``oxford_pets/``.')})
    split_file: Optional[str] = field(default=None, metadata={"help": (
        "Optional split file (CoOp's ``split_zhou_*.json`` format) overriding the dataset's train/val/test split; "
        "a few-shot split (the images a run trains on) is data.fewshot_file.")})
    fewshot_file: Optional[str] = field(default=None, metadata={"help": (
        "A few-shot split file to train on instead of fewclip's seeded draw: CoOp's split_zhou JSON or "
        "split_fewshot pickle, 2SFS's JSON lines, a manifest of image ids or a run's split.json (`fewclip split "
        "import FILE` checks one); {shots}, {seed} and {dataset} in it are filled in per run. The run records the "
        "file and its sha256.")})
    sampler: str = field(default="fewclip", metadata={"help": (
        'How the few-shot images are drawn: "fewclip" (the default: classes in label order, each class its draw) '
        'or "coop" (CoOp\'s own images: Dassl\'s generate_fewshot_dataset, train then val from one generator '
        'seeded with the run\'s seed; fewclip.data.coop_sampler).')})
    templates: str = field(default="single", metadata={"help": (
        '"single": the dataset\'s first prompt template, the one hand-made template per dataset of CoOp\'s protocol'
        ' (the default of every command and every shipped sweep); "ensemble": all of them, averaged per class.')})
    prompts: list[str] = field(default_factory=list, metadata={"help": (
        'Your own prompt templates ("{}" stands for the class name), replacing the dataset\'s; `templates` then '
        'picks all of them or the first.')})
    classnames: Optional[str] = field(default=None, metadata={"help": (
        'A file of class names replacing the dataset\'s (fewclip.data.name_files): a JSON/YAML/CSV mapping from folder '
        'name to class name ({"nominal": "a woven textile without defects"}), or a list, one name a line in label '
        'order, or CLIP_benchmark\'s JSON of lists per dataset.')})
    prompts_file: Optional[str] = field(default=None, metadata={"help": (
        'A file of prompt templates replacing the dataset\'s: one a line, or a JSON/YAML list (or CLIP_benchmark\'s'
        ' JSON of lists per dataset); {} or {c} stands for the class name. Not with data.prompts.')})
    skip_bad_images: bool = field(default=False, metadata={"help": (
        'Leave out the image files that cannot be read (fewclip.data.image_check; `fewclip datasets check` lists them); '
        'the run records their ids in metrics.json (skipped_images). Off: such a file stops a run or a sweep.')})
    allow_fewer_shots: bool = field(default=False, metadata={"help": (
        'A class with fewer than ``shots`` training images is an error unless this is set, in which case that '
        'class uses all the images it has.')})
    batch_size: int = field(default=256, metadata={"help": 'Images per batch for feature extraction.'})
    workers: int = field(default=0, metadata={"help": (
        'DataLoader worker processes for image decoding (0 = in the main process).')})
    max_test: Optional[int] = field(default=None, metadata={"help": (
        'Use at most this many test images (a seeded, class-stratified subset); null = all.')})
    path: Optional[str] = field(default=None, metadata={"help": (
        "data=features: the feature file (fewclip.features.feature_file)")})

    def __post_init__(self) -> None:
        if self.reader is not None:
            check_dataset_name(self.name, "data.name")
        bad = [t for t in self.prompts if not isinstance(t, str) or t.count("{}") != 1]
        if bad:
            raise ValueError(f"data.prompts: each template needs exactly one '{{}}' for the class name; bad: {bad[:3]}")
        if self.sampler not in ("fewclip", "coop"):
            raise ValueError(f"data.sampler must be 'fewclip' or 'coop', got {self.sampler!r}")
        if self.prompts and self.prompts_file:
            raise ValueError("data.prompts and data.prompts_file both give the templates: keep one")
        if self.templates not in ("ensemble", "single"):
            raise ValueError(f"data.templates must be 'ensemble' or 'single', got {self.templates!r}")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {self.batch_size}")
        if self.workers < 0:
            raise ValueError(f"data.workers must be >= 0, got {self.workers}")
        if self.max_test is not None and self.max_test < 1:
            raise ValueError(f"data.max_test must be >= 1 or null (all test images), got {self.max_test}")


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
RESERVED_NAMES = ("average",)  # the report's average row


def check_dataset_name(name: str, key: str = "data.name") -> str:
    """A dataset name that can be a folder name and a table entry, or a ValueError naming ``key``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.lower() in RESERVED_NAMES:
        raise ValueError(f"{key}={name!r} cannot name a dataset: use letters, digits and . _ + - (not starting "
                         f"with one of those), and not {', '.join(RESERVED_NAMES)}")
    return name


def folder_dataset_name(root: Optional[str]) -> str:
    """The default name of a dataset read from ``root``: the folder's name, made safe for folder names."""
    base = Path(root).expanduser().resolve().name if root else ""
    safe = re.sub(r"[^A-Za-z0-9._+-]", "_", base).lstrip("._+-")
    return safe if safe and safe.lower() not in RESERVED_NAMES else "folder"


def check_classnames(classnames: Sequence[str], what: str = "class names", warn: bool = False) -> list[str]:
    """The class names as a list, refusing what cannot be a classification task: a bare string (which
    would be split into characters), fewer than two classes (a one-class task scores 100%) and empty
    names. A name may repeat (CLIP's ImageNet names hold 'missile' and 'sunglasses' twice): a class is its
    label, its name only a prompt (``fewclip.data.class_names``; a run says once which classes share a prompt).
    ``warn``: a warning naming repeated names (up to case and spacing), for a caller that is not a run."""
    if isinstance(classnames, (str, bytes)):
        raise DatasetError(f"{what}: expected a list of class names, got the string {classnames!r} (it would be split "
                           f"into characters); pass [{classnames!r}] or a list of names")
    names = list(classnames)
    bad = [n for n in names if not isinstance(n, str) or not n.strip()]
    if bad:
        raise DatasetError(f"{what}: class names must be non-empty strings, got {bad[:3]!r}")
    if len(names) < 2:
        raise DatasetError(f"{what}: {len(names)} class ({', '.join(map(repr, names)) or 'none'}); classifying "
                           f"needs at least 2 classes (with one, every prediction is right)")
    if warn:
        import logging

        from fewclip.data.class_names import describe_groups, identical_prompt_groups
        groups = identical_prompt_groups(names)
        if groups:
            logging.getLogger(__name__).warning("%s: classes with the same name (so the same prompt): %s", what,
                                                describe_groups(names, groups))
    return names


def to_rgb(im: Image.Image) -> Image.Image:
    """An RGB image. 16-bit grayscale (PIL mode ``I;16*``, or ``I`` for a PNG, as older Pillow opens
    16-bit PNGs) is scaled to 8 bits (v / 257) where PIL's own conversion would clip it, turning most
    images white."""
    if im.mode.startswith("I;16") or (im.mode == "I" and im.format == "PNG"):
        a = np.asarray(im).astype(np.float64)
        a = np.clip(np.rint(a / 257.0), 0, 255).astype(np.uint8)
        return Image.fromarray(a, mode="L").convert("RGB")
    return im.convert("RGB")


@dataclass(frozen=True)
class Item:
    """One labelled image: ``id`` is stable across runs and is what split JSONs record."""

    id: str
    label: int


@dataclass
class Dataset:
    """A classification task. Subclasses override ``load_image``.

    Two class attributes guide training-time augmentation: ``hflip_ok`` (a
    horizontal flip keeps the label; False for left/right tasks) and
    ``min_crop_scale`` (RandomResizedCrop's smallest area, 0.08 as in CoOp).
    """

    hflip_ok = True
    min_crop_scale = 0.08
    # What a procedural dataset's images are a function of (a digest of the code and settings that render
    # them); None for a dataset of files. The feature store checks it, or the files, before it serves
    # features (``fewclip.data.image_fingerprint``).
    generator = None  # Optional[str]; not a dataclass field
    # Raw class names of the dataset's published split files and the name it gives each (CoOp's renames:
    # Caltech's ``Faces`` is ``face``), for checking a split file's names; empty: none. Set by the reader.
    split_renames = {}  # Dict[str, str]; not a dataclass field (a class default, never mutated: readers assign)

    name: str
    classnames: list[str]
    templates: list[str]
    splits: dict[str, list[Item]] = field(default_factory=dict)
    root: Optional[Path] = None
    class_ids: list[str] = field(default_factory=list, metadata={"help": (
        "Stable identifiers of the classes, in label order, where the dataset has them (ImageNet's wnids): what "
        'matches classes across datasets (an ImageNet-A class to its ImageNet label). Empty: the class names '
        'serve.')})

    def __post_init__(self) -> None:
        self.classnames = check_classnames(self.classnames, f"dataset {self.name!r}")
        if self.class_ids and len(self.class_ids) != len(self.classnames):
            raise DatasetError(f"dataset {self.name!r}: {len(self.class_ids)} class ids for "
                               f"{len(self.classnames)} classes")

    def items(self, split: str) -> list[Item]:
        if split not in self.splits:
            hint = ""
            if list(self.splits) == ["test"]:
                hint = "; it is a test set only (a domain-shift target): train on its source and test here"
            raise DatasetError(f"dataset {self.name!r} has no {split!r} split (has: {sorted(self.splits)}){hint}")
        return self.splits[split]

    def image_path(self, item: Item) -> Optional[Path]:
        """The file ``load_image`` reads for ``item`` (``root / item.id``), or None where there is none."""
        return None if self.root is None else Path(self.root) / item.id

    def load_image(self, item: Item) -> Image.Image:
        """Open ``root / item.id`` as RGB; an unreadable file is an error naming it."""
        if self.root is None:
            raise DatasetError(f"dataset {self.name!r} has no root folder to load {item.id!r} from")
        path = self.image_path(item)
        try:
            with Image.open(path) as im:
                return to_rgb(im)
        except FileNotFoundError:
            raise DatasetError(f"image file not found: {path} (dataset {self.name!r})") from None
        except Exception as e:  # PIL raises several types for damaged files
            raise DatasetError(f"cannot read image {path} (dataset {self.name!r}): {e}") from None

    def prompts(self, mode: str = "single") -> list[str]:
        """The templates in use: all of them, or only the first for ``mode='single'``."""
        return list(self.templates) if mode == "ensemble" else list(self.templates[:1])


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    builder: Callable[[DataConfig], Dataset]
    description: str
    # Where the reader expects its files, shown by `fewclip datasets` and in errors.
    layout: str
    needs_root: bool = True
    default_name: Optional[Callable[[DataConfig], str]] = field(default=None, metadata={"help": (
        "The dataset's name when it is used under its registered name (``folder``: the root folder's name); None:"
        ' the registered name.')})


DATASETS: Registry[DatasetInfo] = Registry("dataset", "fewclip.datasets", key="data.name",
                                           listing="fewclip datasets")


def register_dataset(
    name: str,
    builder: Callable[[DataConfig], Dataset],
    *,
    description: str,
    layout: str,
    needs_root: bool = True,
    default_name: Optional[Callable[[DataConfig], str]] = None,
) -> None:
    """Register a dataset reader: ``builder(cfg) -> Dataset``, with the layout it expects (shown in errors)."""
    DATASETS.register(name, DatasetInfo(name, builder, description, layout, needs_root, default_name),
                      source=getattr(builder, "__module__", None))


def dataset_name(cfg: DataConfig) -> str:
    """The name a dataset config gives its dataset: ``data.name`` with a reader; else the registered reader's
    default (``folder``: the root folder's name), else ``data.name``."""
    if cfg.reader or cfg.name not in DATASETS:
        return cfg.name
    info = DATASETS.get(cfg.name)
    return info.default_name(cfg) if info.default_name is not None else cfg.name


def build_dataset(cfg: DataConfig) -> Dataset:
    """The dataset ``cfg`` describes, named by ``dataset_name``, with ``data.prompts`` as its templates if given."""
    reader = cfg.reader or cfg.name
    if reader not in DATASETS:
        hint = ("; for a dataset of your own give its reader too (data.name=pets data.reader=folder "
                "data.root=PATH)" if not cfg.reader else "")
        message = DATASETS.unknown(reader)
        if cfg.reader:
            message = message.replace("(data.name)", "(data.reader)")
        raise DatasetError(message + hint)
    info = DATASETS.get(reader)
    if info.needs_root and not cfg.root:
        raise DatasetError(
            f"dataset {cfg.name!r} needs data.root=PATH; expected layout:\n{info.layout}"
        )
    if info.needs_root and not Path(cfg.root).is_dir():
        raise DatasetError(
            f"data.root={cfg.root!r} is not a folder; dataset {cfg.name!r} expects:\n{info.layout}"
        )
    dataset = info.builder(cfg)
    dataset.name = dataset_name(cfg)
    if cfg.prompts:
        dataset.templates = list(cfg.prompts)
    if cfg.prompts_file:
        dataset.templates = read_templates(cfg.prompts_file, dataset.name)
    if cfg.classnames:
        dataset.classnames = check_classnames(read_classnames(cfg.classnames, dataset.classnames, dataset.name),
                                              f"data.classnames={cfg.classnames}")
    if cfg.skip_bad_images:
        drop_bad_images(dataset)
    return dataset
