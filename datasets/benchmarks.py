"""The eleven few-shot benchmarks of CoOp (Zhou et al.) and ImageNet's four shifted test sets, in the
layouts of CoOp's DATASETS.md.

``data.root`` is the parent folder that holds the dataset folders (CoOp's
``$DATA``), so a tree prepared for CoOp or its successors works unchanged::

    data.name=oxford_pets data.root=$DATA   ->  $DATA/oxford_pets/images/...
                                                $DATA/oxford_pets/split_zhou_OxfordPets.json

Nine benchmarks read CoOp's fixed ``split_zhou_*.json`` splits (see
``folder.read_split_file``); FGVC-Aircraft reads the dataset's own
``images_variant_*.txt`` lists and ImageNet lists its ``train/`` and ``val/``
folders. ``data.split_file`` replaces the default split with any file in the
split_zhou format, its paths relative to the same image folder.

Item ids are paths relative to ``Dataset.root``, which is the benchmark's
image folder (``caltech-101/101_ObjectCategories``, ``oxford_pets/images``,
...), except for Stanford Cars, whose split paths start at ``stanford_cars/``
(``cars_train/00001.jpg``), and FGVC-Aircraft, whose ids are
``images/<image id>.jpg`` under ``fgvc_aircraft/``.

Class names: those of the split file, through CoOp's renames where a split
built from raw folder names still has them (Caltech-101's ``airplanes`` ->
``airplane``, EuroSAT's ``AnnualCrop`` -> ``Annual Crop Land``, ...), with
underscores turned into spaces as CoOp does before building prompts.
Caltech-101's ``BACKGROUND_Google`` and ``Faces_easy`` folders are never
classes.

ImageNet: labels follow the sorted wnid folders of ``images/train`` (the
standard index order). The test split is ``images/val`` (as in CoOp). CoOp
also uses that set as its validation set; here validation is held out of
``train`` instead, so that no test image picks a model: per class, the first
``min(10, n // 5)`` files in SHA-1 order of their ids (see ``folder.hash_order``)
form ``val`` and are not in ``train``.

ImageNet's shifted test sets, the domain-generalisation targets of CoCoOp
(test split only; read as CoOp's ``datasets/imagenetv2.py``,
``imagenet_sketch.py``, ``imagenet_a.py`` and ``imagenet_r.py`` read them):
``imagenet_v2`` (``imagenetv2/imagenetv2-matched-frequency-format-val/0..999``:
folder i is ImageNet class i), ``imagenet_sketch`` (``imagenet-sketch/images/<wnid>``),
``imagenet_a`` (``imagenet-adversarial/imagenet-a/<wnid>``) and ``imagenet_r``
(``imagenet-rendition/imagenet-r/<wnid>``); each folder holds a copy of
ImageNet's ``classnames.txt``. A and R have 200 wnid folders: their labels run
0..199 over those folders sorted, their class names are ImageNet's for those
wnids, and ``Dataset.class_ids`` holds the wnids, so that
``protocols.class_map(imagenet, imagenet_a)`` gives each class's ImageNet label
(its index among ImageNet's sorted wnids). Evaluating among those 200 classes,
as CoOp and CoCoOp do, is building the classifier from these 200 names (or
keeping those 200 columns of a 1000-class classifier). Every ImageNet-family
dataset carries the wnids as ``class_ids``.

Prompt templates: CoOp's hand-made template for the dataset first (what
``data.templates=single`` uses), then a short ensemble in the same spirit; for
ImageNet and its shifted sets, "a photo of a {}." (CoOp's ``trainers/zsclip.py``
uses it for all five) and OpenAI's 80 ImageNet templates from
``open_clip.zero_shot_metadata``.

Building a benchmark reads its index files and checks that the first image of
every class in every split exists; it opens no image.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Optional

from fewclip.data.base import SPLITS, DataConfig, Dataset, DatasetError, Item, register_dataset
from fewclip.datasets.folder import (
    check_files,
    clean_classname,
    hash_order,
    list_class_folders,
    list_images,
    read_split_file,
    resolve_split_file,
)

COOP_DOCS = "KaiyangZhou/CoOp, DATASETS.md"

CALTECH_IGNORED = ("BACKGROUND_Google", "Faces_easy")
CALTECH_RENAMES = {"airplanes": "airplane", "Faces": "face", "Leopards": "leopard", "Motorbikes": "motorbike"}
EUROSAT_RENAMES = {
    "AnnualCrop": "Annual Crop Land",
    "Forest": "Forest",
    "HerbaceousVegetation": "Herbaceous Vegetation Land",
    "Highway": "Highway or Road",
    "Industrial": "Industrial Buildings",
    "Pasture": "Pasture Land",
    "PermanentCrop": "Permanent Crop Land",
    "Residential": "Residential Buildings",
    "River": "River",
    "SeaLake": "Sea or Lake",
}

# ImageNet validation images held out of train per class: min(this, n // 5).
IMAGENET_VAL_PER_CLASS = 10

# ImageNet and its shifted test sets: ImageNet's prompts (CoOp's single template, OpenAI's 80) and wnids as class ids.
IMAGENET_FAMILY = ("imagenet", "imagenet_v2", "imagenet_sketch", "imagenet_a", "imagenet_r")
_CLASSNAMES_TXT = "`-- classnames.txt      a copy of imagenet/classnames.txt (lines '<wnid> <class name>')"


@dataclass(frozen=True)
class Benchmark:
    name: str
    folder: str  # under data.root
    image_dir: str  # under folder; ids are relative to it ("" = the folder itself)
    split_json: Optional[str]  # CoOp's split file under folder, for reader "zhou"
    templates: tuple[str, ...]  # CoOp's single template first
    description: str
    tree: tuple[str, ...]  # the lines under folder/ in the layout
    reader: str = "zhou"  # "zhou" | "aircraft" | "imagenet" | "imagenet_v2" | "wnid_folders"
    rename: Mapping[str, str] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    test_only: bool = False  # a domain-shift target: only a test split

    @property
    def layout(self) -> str:
        lines = [
            f"data.root=DATA, the folder that holds {self.folder}/ (as in {COOP_DOCS}):",
            "  DATA/",
            f"  `-- {self.folder}/",
        ]
        lines += [f"      {line}" for line in self.tree]
        return "\n".join(lines)


def _zhou(name, folder, image_dir, split_json, templates, description, images_note, **kw) -> Benchmark:
    tree = (
        f"|-- {image_dir + '/':<22} {images_note}" if image_dir else f"|-- {images_note}",
        f"`-- {split_json}",
    )
    return Benchmark(name, folder, image_dir, split_json, tuple(templates), description, tree, **kw)


BENCHMARKS: dict[str, Benchmark] = {}


def _add(b: Benchmark) -> None:
    BENCHMARKS[b.name] = b


_add(Benchmark(
    "imagenet", "imagenet", "images", None,
    ("a photo of a {}.",),  # + OpenAI's 80 ImageNet templates, loaded when built
    "ImageNet-1k (1000 classes); test = the official val set, val held out of train",
    (
        "|-- images/",
        "|   |-- train/          <wnid>/<file>.JPEG, 1000 folders like n01440764/",
        "|   `-- val/            <wnid>/<file>.JPEG, the same folders (the test split)",
        "`-- classnames.txt      lines '<wnid> <class name>' (if absent and there are",
        "                        1000 folders, open_clip's IMAGENET_CLASSNAMES are used)",
    ),
    reader="imagenet",
))
_add(Benchmark(
    "imagenet_v2", "imagenetv2", "imagenetv2-matched-frequency-format-val", None,
    ("a photo of a {}.",),
    "ImageNet-V2 matched-frequency (1000 classes, test only): a domain-shift target of imagenet",
    (
        "|-- imagenetv2-matched-frequency-format-val/",
        "|                       0/ ... 999/: folder i holds class i of ImageNet's index order",
        "|                       (the sorted wnids), <hash>.jpeg files",
        "`-- classnames.txt      a copy of imagenet/classnames.txt (if absent and there are",
        "                        1000 folders, open_clip's IMAGENET_CLASSNAMES are used)",
    ),
    reader="imagenet_v2", test_only=True,
))
_add(Benchmark(
    "imagenet_sketch", "imagenet-sketch", "images", None,
    ("a photo of a {}.",),
    "ImageNet-Sketch (1000 classes, test only): a domain-shift target of imagenet",
    (
        "|-- images/             <wnid>/<file>.JPEG, 1000 folders like n01440764/ (the download's",
        "|                       sketch/ folder, renamed)",
        "`-- classnames.txt      a copy of imagenet/classnames.txt (if absent and there are",
        "                        1000 folders, open_clip's IMAGENET_CLASSNAMES are used)",
    ),
    reader="wnid_folders", test_only=True,
))
_add(Benchmark(
    "imagenet_a", "imagenet-adversarial", "imagenet-a", None,
    ("a photo of a {}.",),
    "ImageNet-A natural adversarial examples (200 of ImageNet's classes, test only): a domain-shift "
    "target of imagenet, evaluated among its 200 classes",
    (
        "|-- imagenet-a/         200 folders like n01498041/<file>.jpg (README.txt is ignored)",
        _CLASSNAMES_TXT,
    ),
    reader="wnid_folders", test_only=True,
))
_add(Benchmark(
    "imagenet_r", "imagenet-rendition", "imagenet-r", None,
    ("a photo of a {}.",),
    "ImageNet-R renditions: art, cartoons, sculptures... (200 of ImageNet's classes, test only): a "
    "domain-shift target of imagenet, evaluated among its 200 classes",
    (
        "|-- imagenet-r/         200 folders like n01443537/<file>.jpg (README.txt is ignored)",
        _CLASSNAMES_TXT,
    ),
    reader="wnid_folders", test_only=True,
))
_add(_zhou(
    "caltech101", "caltech-101", "101_ObjectCategories", "split_zhou_Caltech101.json",
    ["a photo of a {}.", "a photo of the {}.", "a close-up photo of a {}.",
     "a cropped photo of a {}.", "a drawing of a {}.", "a low resolution photo of a {}."],
    "Caltech-101 objects (100 classes, CoOp split)", "<class>/image_0001.jpg, ...",
    rename=CALTECH_RENAMES, ignored=CALTECH_IGNORED,
))
_add(_zhou(
    "oxford_pets", "oxford_pets", "images", "split_zhou_OxfordPets.json",
    ["a photo of a {}, a type of pet.", "a photo of the {}, a type of pet.",
     "a close-up photo of a {}, a type of pet.", "a photo of my {}, a type of pet.",
     "a photo of a {}, a breed of cat or dog."],
    "Oxford-IIIT Pets, cat and dog breeds (37 classes, CoOp split)", "Abyssinian_1.jpg, ...",
))
_add(_zhou(
    "stanford_cars", "stanford_cars", "", "split_zhou_StanfordCars.json",
    ["a photo of a {}.", "a photo of a {}, a type of car.", "a photo of the {}, a type of car.",
     "a photo of my {}.", "a close-up photo of a {}, a car."],
    "Stanford Cars, make/model/year (196 classes, CoOp split)",
    "cars_train/, cars_test/   the split's paths start here (cars_train/00001.jpg)",
))
_add(_zhou(
    "oxford_flowers", "oxford_flowers", "jpg", "split_zhou_OxfordFlowers.json",
    ["a photo of a {}, a type of flower.", "a close-up photo of a {}, a type of flower.",
     "a photo of the {}, a type of flower.", "a bright photo of a {}, a type of flower.",
     "a cropped photo of a {}, a type of flower."],
    "Oxford Flowers-102 (102 classes, CoOp split)",
    "image_00001.jpg, ... (cat_to_name.json not needed: the split names the classes)",
))
_add(_zhou(
    "food101", "food-101", "images", "split_zhou_Food101.json",
    ["a photo of {}, a type of food.", "a close-up photo of {}, a type of food.",
     "a photo of a plate of {}, a type of food.", "a photo of {}, a dish.",
     "a cropped photo of {}, a type of food."],
    "Food-101 dishes (101 classes, CoOp split)", "<class>/<id>.jpg",
))
_add(Benchmark(
    "fgvc_aircraft", "fgvc_aircraft", "", None,
    ("a photo of a {}, a type of aircraft.", "a photo of the {}, a type of aircraft.",
     "a photo of a {}, a type of airplane.", "a close-up photo of a {}, a type of aircraft.",
     "a photo of a {} aircraft in the sky."),
    "FGVC-Aircraft variants (100 classes, the dataset's own train/val/test lists)",
    (
        "|-- images/                   <image id>.jpg (item id: images/<image id>.jpg)",
        "|-- variants.txt              one class name per line, in label order",
        "|-- images_variant_train.txt  lines '<image id> <variant>'",
        "|-- images_variant_val.txt",
        "`-- images_variant_test.txt   (the data/ folder of fgvc-aircraft-2013b, renamed)",
    ),
    reader="aircraft",
))
_add(_zhou(
    "sun397", "sun397", "SUN397", "split_zhou_SUN397.json",
    ["a photo of a {}.", "a photo of the {}.", "a photo of a {}, a type of scene.",
     "a wide-angle photo of a {}.", "a photo taken at a {}."],
    "SUN397 scenes (397 classes, CoOp split)", "a/abbey/sun_*.jpg, ...",
))
_add(_zhou(
    "dtd", "dtd", "images", "split_zhou_DescribableTextures.json",
    ["{} texture.", "a photo of a {} texture.", "a close-up photo of a {} texture.",
     "a {} pattern.", "a photo of a {} surface."],
    "Describable Textures (47 classes, CoOp split)", "<class>/<class>_0001.jpg, ...",
))
_add(_zhou(
    "eurosat", "eurosat", "2750", "split_zhou_EuroSAT.json",
    ["a centered satellite photo of {}.", "a satellite photo of {}.", "an aerial photo of {}.",
     "a satellite image showing {}.", "a low resolution satellite photo of {}."],
    "EuroSAT land use from Sentinel-2 (10 classes, CoOp split)", "<class>/<class>_1.jpg, ...",
    rename=EUROSAT_RENAMES,
))
_add(_zhou(
    "ucf101", "ucf101", "UCF-101-midframes", "split_zhou_UCF101.json",
    ["a photo of a person doing {}.", "a video frame of a person doing {}.",
     "a photo of a person performing {}.", "a blurry photo of a person doing {}.",
     "an example of a person doing {}."],
    "UCF101 actions, middle video frames (101 classes, CoOp split)", "<Action_Name>/v_*.jpg",
))


def _layout_error(b: Benchmark, message: str, root: Optional[Path] = None) -> DatasetError:
    hint = ""
    if root is not None and (root.name == b.folder or (b.image_dir and (root / b.image_dir).is_dir())):
        hint = f" (data.root is the folder that holds {b.folder}/, not {b.folder}/ itself)"
    return DatasetError(f"dataset {b.name!r}: {message}{hint}; expected layout:\n{b.layout}")


# What a reader returns: class names, {split: items} and the class ids (ImageNet wnids; [] = none).
Read = tuple[list[str], dict[str, list[Item]], list[str]]


def _read_zhou(b: Benchmark, base: Path, image_root: Path, root: Path) -> Read:
    path = base / b.split_json
    if not path.is_file():
        raise _layout_error(b, f"split file {path} not found", root)
    return (*read_split_file(path, rename=b.rename, ignored=b.ignored), [])


def _read_lines(b: Benchmark, path: Path) -> list[str]:
    if not path.is_file():
        raise _layout_error(b, f"{path} not found")
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f]


def _read_aircraft(b: Benchmark, base: Path, image_root: Path, root: Path) -> Read:
    variants = [v for v in _read_lines(b, base / "variants.txt") if v]
    label_of = {v: i for i, v in enumerate(variants)}
    if not variants or len(label_of) != len(variants):
        raise _layout_error(b, f"{base / 'variants.txt'} must list distinct class names, one per line")
    splits: dict[str, list[Item]] = {}
    for split in SPLITS:
        path = base / f"images_variant_{split}.txt"
        items = splits[split] = []
        for lineno, line in enumerate(_read_lines(b, path), 1):
            if not line:
                continue
            image_id, _, variant = line.partition(" ")
            if variant not in label_of:
                raise DatasetError(
                    f"{path}, line {lineno}: {line!r}: variant {variant!r} is not in {base / 'variants.txt'}"
                )
            items.append(Item(f"images/{image_id}.jpg", label_of[variant]))
    return [clean_classname(v) for v in variants], splits, []


def _read_wnid_names(b: Benchmark, path: Path) -> dict[str, str]:
    """CoOp's ``classnames.txt``: lines '<wnid> <class name>', in file order."""
    names: dict[str, str] = {}
    for lineno, line in enumerate(_read_lines(b, path), 1):
        if not line:
            continue
        wnid, _, name = line.partition(" ")
        if not name.strip():
            raise DatasetError(f"{path}, line {lineno}: {line!r}: expected '<wnid> <class name>'")
        if wnid in names:
            raise DatasetError(f"{path}, line {lineno}: wnid {wnid} is listed twice")
        names[wnid] = name.strip()
    if not names:
        raise _layout_error(b, f"{path} lists no classes")
    return names


def _imagenet_metadata():
    """open_clip's ImageNet class names and templates (``open_clip.zero_shot_metadata``)."""
    # Imported here: open_clip's package import costs seconds (torch, torchvision, transformers), and only an
    # ImageNet-family dataset needs it; `fewclip datasets` and the report stay light.
    import open_clip.zero_shot_metadata as meta

    return meta


def _read_imagenet_classnames(b: Benchmark, path: Path, wnids: list[str], root: Path) -> list[str]:
    if not path.is_file():
        if len(wnids) != 1000:
            raise _layout_error(
                b, f"{path} not found (only a full 1000-class tree can use open_clip's class names)", root
            )

        return list(_imagenet_metadata().IMAGENET_CLASSNAMES)
    names = _read_wnid_names(b, path)
    missing = [w for w in wnids if w not in names]
    if missing:
        raise DatasetError(f"{path} has no class name for the folder(s) {', '.join(missing[:5])}")
    return [names[w] for w in wnids]


def _read_imagenet(b: Benchmark, base: Path, image_root: Path, root: Path) -> Read:
    train_dir, val_dir = image_root / "train", image_root / "val"
    for d in (train_dir, val_dir):
        if not d.is_dir():
            raise _layout_error(b, f"folder {d} not found", root)
    wnids = list_class_folders(train_dir)
    if not wnids:
        raise _layout_error(b, f"{train_dir} has no class folders")
    classnames = _read_imagenet_classnames(b, base / "classnames.txt", wnids, root)
    label_of = {w: i for i, w in enumerate(wnids)}
    splits: dict[str, list[Item]] = {s: [] for s in SPLITS}
    for wnid in wnids:
        ids = [f"train/{wnid}/{name}" for name in list_images(train_dir / wnid)]
        held_out = set(hash_order(ids)[: min(IMAGENET_VAL_PER_CLASS, len(ids) // 5)])
        for i in ids:
            splits["val" if i in held_out else "train"].append(Item(i, label_of[wnid]))
    val_wnids = list_class_folders(val_dir)
    if not val_wnids:
        raise _layout_error(b, f"{val_dir} has no class folders (CoOp expects val/<wnid>/<file>.JPEG)")
    for wnid in val_wnids:
        if wnid not in label_of:
            raise _layout_error(b, f"{val_dir / wnid} has no matching folder in {train_dir}")
        splits["test"].extend(Item(f"val/{wnid}/{n}", label_of[wnid]) for n in list_images(val_dir / wnid))
    return classnames, splits, wnids


def _read_imagenet_v2(b: Benchmark, base: Path, image_root: Path, root: Path) -> Read:
    """Folders ``0`` .. ``C-1``: folder i is class i of ImageNet's index order, the sorted wnids."""
    path = base / "classnames.txt"
    folders = list_class_folders(image_root)
    if path.is_file():
        names = _read_wnid_names(b, path)
        wnids = sorted(names)
        classnames = [names[w] for w in wnids]
    elif len(folders) == 1000:

        wnids, classnames = [], list(_imagenet_metadata().IMAGENET_CLASSNAMES)
    else:
        raise _layout_error(b, f"{path} not found (only a full 1000-class tree can use open_clip's class names)",
                            root)
    expected = [str(i) for i in range(len(classnames))]
    missing = [f for f in expected if f not in set(folders)]
    extra = sorted(set(folders) - set(expected))
    if missing or extra:
        what = (f"class folder(s) {', '.join(missing[:5])} missing" if missing
                else f"unexpected folder(s) {', '.join(extra[:5])}")
        raise _layout_error(b, f"{image_root}: {what}; ImageNet-V2's folders are 0..{len(classnames) - 1}, "
                               f"one per class of {path.name}", root)
    items = [Item(f"{i}/{n}", i) for i in range(len(classnames)) for n in list_images(image_root / str(i))]
    return classnames, {"test": items}, wnids


def _read_wnid_folders(b: Benchmark, base: Path, image_root: Path, root: Path) -> Read:
    """Sorted wnid folders (ImageNet-Sketch: all 1000; ImageNet-A and -R: 200 of them), test only."""
    wnids = list_class_folders(image_root)
    if not wnids:
        raise _layout_error(b, f"{image_root} has no class folders", root)
    path = base / "classnames.txt"
    if not path.is_file() and len(wnids) != 1000:
        raise _layout_error(b, f"{path} not found (it names the {len(wnids)} wnid folders: copy ImageNet's "
                               f"classnames.txt here)", root)
    classnames = _read_imagenet_classnames(b, path, wnids, root)
    items = [Item(f"{w}/{n}", y) for y, w in enumerate(wnids) for n in list_images(image_root / w)]
    return classnames, {"test": items}, wnids


def coop_imagenet_pool(dataset: Dataset) -> list[Item]:
    """ImageNet's training images as CoOp lists them (``datasets/imagenet.py`` ``read_data``): the sorted class
    folders of ``images/train``, each in ``os.listdir`` order without hidden files; fewclip's training and
    held-out validation images together (``fewclip.data.coop_sampler``)."""
    by_id = {it.id: it for split in ("train", "val") for it in dataset.splits.get(split, [])}
    train_dir = Path(dataset.root) / "train"
    pool: list[Item] = []
    for wnid in dataset.class_ids:
        for name in os.listdir(train_dir / wnid):
            if name.startswith("."):
                continue
            item = by_id.get(f"train/{wnid}/{name}")
            if item is None:
                raise DatasetError(f"{train_dir / wnid / name} is not an image fewclip reads, but CoOp's ImageNet "
                                   f"reader samples it; move it out of {train_dir} to draw CoOp's images "
                                   f"(data.sampler=coop)")
            pool.append(item)
    return pool


_READERS = {"zhou": _read_zhou, "aircraft": _read_aircraft, "imagenet": _read_imagenet,
            "imagenet_v2": _read_imagenet_v2, "wnid_folders": _read_wnid_folders}


def _templates(b: Benchmark) -> list[str]:
    templates = list(b.templates)
    if b.name in IMAGENET_FAMILY:

        templates += [t("{}") for t in _imagenet_metadata().OPENAI_IMAGENET_TEMPLATES]
    return list(dict.fromkeys(templates))  # drop repeats, keep order


def build_benchmark(b: Benchmark, cfg: DataConfig) -> Dataset:
    if not cfg.root:
        raise _layout_error(b, "needs data.root=DATA")
    root = Path(cfg.root).expanduser()
    base = root / b.folder
    if not base.is_dir():
        raise _layout_error(b, f"folder {base} not found", root)
    image_root = base / b.image_dir if b.image_dir else base
    if not image_root.is_dir():
        raise _layout_error(b, f"image folder {image_root} not found", root)
    if cfg.split_file:
        if b.test_only:
            raise DatasetError(f"dataset {b.name!r} is a test set only; it takes no data.split_file")
        split_path = resolve_split_file(cfg.split_file, base)
        classnames, splits = read_split_file(split_path, rename=b.rename, ignored=b.ignored)
        class_ids: list[str] = []
        source = f"split file {split_path}"
    else:
        classnames, splits, class_ids = _READERS[b.reader](b, base, image_root, root)
        source = f"split file {base / b.split_json}" if b.split_json else f"dataset {b.name!r}"
    for items in splits.values():
        check_files(image_root, items, source=source, layout=b.layout, every=False)
    if b.test_only and not splits["test"]:
        raise _layout_error(b, f"no test images found under {image_root}", root)
    dataset = Dataset(b.name, classnames, _templates(b), splits, image_root, class_ids=class_ids)
    dataset.split_renames = dict(b.rename)  # a split file's raw names, for fewclip.data.split_files
    if b.reader == "imagenet" and not cfg.split_file:  # CoOp's pool differs (data.sampler=coop)
        dataset.coop_pool = partial(coop_imagenet_pool, dataset)
    return dataset


for _b in BENCHMARKS.values():
    register_dataset(_b.name, partial(build_benchmark, _b), description=_b.description, layout=_b.layout)
del _b
