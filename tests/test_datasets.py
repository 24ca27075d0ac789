"""The folder reader and the CoOp benchmark readers, on tiny trees of 4x4 PNGs."""
import json
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

import fewclip.datasets.benchmarks as benchmarks
from fewclip.data.base import DATASETS, DataConfig, DatasetError, Item, build_dataset
from fewclip.datasets.folder import LAYOUT, split_counts

BENCHMARK_NAMES = [
    "imagenet", "caltech101", "oxford_pets", "stanford_cars", "oxford_flowers", "food101",
    "fgvc_aircraft", "sun397", "dtd", "eurosat", "ucf101",
    "imagenet_v2", "imagenet_sketch", "imagenet_a", "imagenet_r",
]


def _png(path: Path, color=(200, 10, 10)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), color).save(path, format="PNG")


def _build(name: str, root: Path, **kw):
    return build_dataset(DataConfig(name=name, root=str(root), **kw))


def _label_counts(items):
    return Counter(it.label for it in items)


# ---------------------------------------------------------------- folder reader


@pytest.fixture
def class_tree(tmp_path):
    root = tmp_path / "pics"
    for i in range(10):
        _png(root / "cat" / f"c{i:02d}.png")
    for i in range(5):
        _png(root / "dog" / f"d{i}.JPG")  # upper-case extension counts
    for i in range(3):
        _png(root / "golden_retriever" / f"g{i}.jpeg")
    (root / "dog" / "notes.txt").write_text("not an image")
    (root / "dog" / ".hidden.png").write_bytes(b"")
    return root


def test_folder_reads_classes_and_splits(class_tree):
    ds = _build("folder", class_tree)
    assert ds.classnames == ["cat", "dog", "golden retriever"]
    assert ds.templates[0] == "a photo of a {}." and len(ds.templates) > 1
    assert ds.prompts("single") == ["a photo of a {}."]
    every = [it for s in ("train", "val", "test") for it in ds.items(s)]
    assert len(every) == len({it.id for it in every}) == 18  # disjoint, nothing lost
    assert "dog/d0.JPG" in {it.id for it in every}
    assert not any(it.id.endswith((".txt", "hidden.png")) for it in every)
    for label, n in enumerate((10, 5, 3)):
        got = tuple(_label_counts(ds.items(s))[label] for s in ("train", "val", "test"))
        assert got == split_counts(n)
    assert split_counts(10) == (5, 2, 3)
    assert all(it.id.split("/")[0] == ["cat", "dog", "golden_retriever"][it.label] for it in every)
    im = ds.load_image(ds.items("test")[0])
    assert im.mode == "RGB" and im.size == (4, 4)
    assert _build("folder", class_tree).splits == ds.splits  # same files, same split


def test_folder_split_does_not_move_when_a_file_is_added(class_tree):
    before = _build("folder", class_tree)
    _png(class_tree / "cat" / "new.png")
    after = _build("folder", class_tree)
    moved = {it.id: s for s in after.splits for it in after.splits[s]}
    kept = sum(moved[it.id] == s for s in before.splits for it in before.splits[s])
    assert kept >= 17  # at most one old image changes split (the class's counts shift by one)


def test_folder_with_split_file(class_tree):
    split = {
        "train": [["cat/c00.png", 0, "cat"], ["golden_retriever/g0.jpeg", 1, "golden_retriever"]],
        "val": [["cat/c01.png", 0, "cat"]],
        "test": [["cat/c02.png", 0, "cat"], ["golden_retriever/g1.jpeg", 1, "golden_retriever"]],
    }
    (class_tree / "split.json").write_text(json.dumps(split))
    ds = _build("folder", class_tree, split_file="split.json")  # found relative to the root
    assert ds.classnames == ["cat", "golden retriever"]
    assert ds.items("train") == [Item("cat/c00.png", 0), Item("golden_retriever/g0.jpeg", 1)]
    assert len(ds.items("val")) == 1 and len(ds.items("test")) == 2


def test_folder_missing_root_shows_layout(tmp_path):
    with pytest.raises(DatasetError, match="expects") as e:
        _build("folder", tmp_path / "nope")
    assert "PATH/" in str(e.value) and "dog/" in str(e.value)
    with pytest.raises(DatasetError, match="needs data.root") as e:
        build_dataset(DataConfig(name="folder"))
    assert "PATH/" in str(e.value)


def test_folder_without_class_folders_shows_layout(tmp_path):
    _png(tmp_path / "loose.png")
    with pytest.raises(DatasetError, match="no class sub-folders") as e:
        _build("folder", tmp_path)
    assert LAYOUT in str(e.value)


def test_folder_empty_class_is_named(class_tree):
    (class_tree / "zebra").mkdir()
    (class_tree / "zebra" / "readme.md").write_text("x")
    with pytest.raises(DatasetError, match="zebra") as e:
        _build("folder", class_tree)
    assert "holds no images" in str(e.value) and LAYOUT in str(e.value)


def test_folder_unreadable_image_is_named(class_tree):
    (class_tree / "cat" / "c03.png").write_bytes(b"definitely not a png")
    ds = _build("folder", class_tree)  # building opens no image
    bad = next(it for s in ds.splits for it in ds.splits[s] if it.id == "cat/c03.png")
    with pytest.raises(DatasetError, match="c03.png"):
        ds.load_image(bad)


def test_folder_split_file_naming_a_missing_file(class_tree):
    split = {"train": [["cat/c00.png", 0, "cat"]], "val": [], "test": [["cat/gone.png", 0, "cat"]]}
    (class_tree / "split.json").write_text(json.dumps(split))
    with pytest.raises(DatasetError, match="cat/gone.png"):
        _build("folder", class_tree, split_file=str(class_tree / "split.json"))


@pytest.mark.parametrize(
    "row, message",
    [
        (["cat/c00.png", -1, "cat"], "bad label -1"),
        (["cat/c00.png", "0", "cat"], "bad label '0'"),
        (["cat/c00.png", 0, "dog"], "bad label 0"),  # label 0 is 'cat' elsewhere
        (["cat/c00.png", 0], "expected \\[relpath, label, classname\\]"),
    ],
)
def test_folder_split_file_bad_entries(class_tree, row, message):
    split = {"train": [row], "val": [], "test": [["cat/c01.png", 0, "cat"]]}
    (class_tree / "split.json").write_text(json.dumps(split))
    with pytest.raises(DatasetError, match=message) as e:
        _build("folder", class_tree, split_file="split.json")
    assert "split.json" in str(e.value)


def test_folder_split_file_class_without_test_image(class_tree):
    split = {"train": [["dog/d0.JPG", 1, "dog"]], "val": [], "test": [["cat/c01.png", 0, "cat"]]}
    (class_tree / "split.json").write_text(json.dumps(split))
    with pytest.raises(DatasetError, match="at least one test image.*'dog'"):
        _build("folder", class_tree, split_file="split.json")


# ---------------------------------------------------------------- benchmarks


def test_every_benchmark_is_registered_with_a_layout():
    for name in BENCHMARK_NAMES:
        info = DATASETS[name]
        assert info.needs_root and info.description
        assert "DATA/" in info.layout and benchmarks.BENCHMARKS[name].folder + "/" in info.layout
    assert set(benchmarks.BENCHMARKS) == set(BENCHMARK_NAMES)


def _zhou_tree(data: Path, folder: str, image_dir: str, json_name: str, split: dict) -> Path:
    """A benchmark folder holding one PNG per split entry and the split JSON."""
    image_root = data / folder / image_dir
    for rows in split.values():
        for relpath, _, _ in rows:
            _png(image_root / relpath)
    (data / folder / json_name).write_text(json.dumps(split))
    return image_root


def _rows(entries, n=3):
    """n images per (folder, label, classname) entry: [[folder/i.jpg, label, classname], ...]."""
    return [[f"{f}/{f}_{i}.jpg", y, c] for f, y, c in entries for i in range(n)]


def test_caltech101_drops_ignored_folders_and_renames(tmp_path):
    entries = [("BACKGROUND_Google", 0, "BACKGROUND_Google"), ("airplanes", 1, "airplanes"),
               ("Faces", 2, "Faces"), ("dollar_bill", 3, "dollar_bill"), ("Faces_easy", 4, "Faces_easy")]
    split = {"train": _rows(entries, 4), "val": _rows(entries, 1), "test": _rows(entries, 2)}
    image_root = _zhou_tree(tmp_path, "caltech-101", "101_ObjectCategories", "split_zhou_Caltech101.json", split)
    ds = _build("caltech101", tmp_path)
    assert ds.classnames == ["airplane", "face", "dollar bill"]
    assert ds.root == image_root
    assert [len(ds.items(s)) for s in ("train", "val", "test")] == [12, 3, 6]
    assert _label_counts(ds.items("train")) == {0: 4, 1: 4, 2: 4}
    assert ds.items("test")[0] == Item("airplanes/airplanes_0.jpg", 0)
    assert ds.load_image(ds.items("test")[0]).size == (4, 4)
    assert ds.templates[0] == "a photo of a {}."


def test_eurosat_renames_raw_and_keeps_clean_names(tmp_path):
    entries = [("AnnualCrop", 0, "AnnualCrop"), ("Forest", 1, "Forest"), ("SeaLake", 2, "Sea or Lake")]
    split = {"train": _rows(entries), "val": _rows(entries, 1), "test": _rows(entries, 1)}
    _zhou_tree(tmp_path, "eurosat", "2750", "split_zhou_EuroSAT.json", split)
    ds = _build("eurosat", tmp_path)
    assert ds.classnames == ["Annual Crop Land", "Forest", "Sea or Lake"]
    assert ds.templates[0] == "a centered satellite photo of {}."
    assert ds.prompts("single") == ["a centered satellite photo of {}."]


def test_dtd_and_oxford_pets(tmp_path):
    split = {"train": _rows([("banded", 0, "banded"), ("zigzagged", 1, "zigzagged")], 5),
             "val": _rows([("banded", 0, "banded"), ("zigzagged", 1, "zigzagged")], 2),
             "test": _rows([("banded", 0, "banded"), ("zigzagged", 1, "zigzagged")], 3)}
    _zhou_tree(tmp_path, "dtd", "images", "split_zhou_DescribableTextures.json", split)
    dtd = _build("dtd", tmp_path)
    assert dtd.classnames == ["banded", "zigzagged"] and dtd.templates[0] == "{} texture."
    assert [len(dtd.items(s)) for s in ("train", "val", "test")] == [10, 4, 6]

    pets = {"train": [["american_bulldog_1.jpg", 0, "american_bulldog"], ["Abyssinian_1.jpg", 1, "abyssinian"]],
            "val": [["american_bulldog_2.jpg", 0, "american_bulldog"]],
            "test": [["Abyssinian_3.jpg", 1, "abyssinian"], ["american_bulldog_3.jpg", 0, "american_bulldog"]]}
    _zhou_tree(tmp_path, "oxford_pets", "images", "split_zhou_OxfordPets.json", pets)
    ds = _build("oxford_pets", tmp_path)
    assert ds.classnames == ["american bulldog", "abyssinian"]
    assert ds.templates[0] == "a photo of a {}, a type of pet."
    assert ds.root == tmp_path / "oxford_pets" / "images"
    assert ds.load_image(ds.items("val")[0]).mode == "RGB"


def test_benchmark_missing_split_json_shows_layout(tmp_path):
    (tmp_path / "dtd" / "images").mkdir(parents=True)
    with pytest.raises(DatasetError, match="split_zhou_DescribableTextures.json not found") as e:
        _build("dtd", tmp_path)
    assert DATASETS["dtd"].layout in str(e.value)


def test_benchmark_missing_folder_shows_layout_and_hint(tmp_path):
    with pytest.raises(DatasetError, match="ucf101 not found") as e:
        _build("ucf101", tmp_path)
    assert "UCF-101-midframes/" in str(e.value)
    (tmp_path / "ucf101" / "UCF-101-midframes").mkdir(parents=True)
    with pytest.raises(DatasetError, match="the folder that holds ucf101/, not ucf101/ itself"):
        _build("ucf101", tmp_path / "ucf101")  # root pointed at the dataset folder


def test_benchmark_split_naming_a_missing_image(tmp_path):
    split = {"train": _rows([("River", 0, "River")]), "val": [], "test": _rows([("River", 0, "River")])}
    _zhou_tree(tmp_path, "eurosat", "2750", "split_zhou_EuroSAT.json", split)
    (tmp_path / "eurosat" / "2750" / "River" / "River_0.jpg").unlink()
    with pytest.raises(DatasetError, match="River/River_0.jpg"):
        _build("eurosat", tmp_path)


def test_benchmark_split_file_override(tmp_path):
    split = {"train": _rows([("a", 0, "apple_pie"), ("b", 1, "bibimbap")]), "val": [],
             "test": _rows([("a", 0, "apple_pie"), ("b", 1, "bibimbap")])}
    _zhou_tree(tmp_path, "food-101", "images", "split_zhou_Food101.json", split)
    mine = {"train": split["train"][:1], "val": [], "test": split["test"][-1:]}
    (tmp_path / "mine.json").write_text(json.dumps(mine))
    ds = _build("food101", tmp_path, split_file=str(tmp_path / "mine.json"))
    assert ds.classnames == ["apple pie", "bibimbap"] and len(ds.items("train")) == 1
    assert ds.templates[0] == "a photo of {}, a type of food."


def test_fgvc_aircraft_reads_variant_lists(tmp_path):
    base = tmp_path / "fgvc_aircraft"
    base.mkdir()
    (base / "variants.txt").write_text("707-320\nA300B4\nF/A-18\n")
    lines = {"train": ["1000001 707-320", "1000002 A300B4", "1000003 F/A-18", "1000004 F/A-18"],
             "val": ["1000005 707-320"],
             "test": ["1000006 A300B4", "1000007 F/A-18"]}
    for split, rows in lines.items():
        (base / f"images_variant_{split}.txt").write_text("\n".join(rows) + "\n")
        for row in rows:
            _png(base / "images" / f"{row.split()[0]}.jpg")
    ds = _build("fgvc_aircraft", tmp_path)
    assert ds.classnames == ["707-320", "A300B4", "F/A-18"]
    assert ds.items("train")[2] == Item("images/1000003.jpg", 2)
    assert [len(ds.items(s)) for s in ("train", "val", "test")] == [4, 1, 2]
    assert ds.templates[0] == "a photo of a {}, a type of aircraft."
    assert ds.load_image(ds.items("test")[1]).size == (4, 4)

    (base / "images_variant_val.txt").write_text("1000005 747-400\n")
    with pytest.raises(DatasetError, match="images_variant_val.txt, line 1.*747-400"):
        _build("fgvc_aircraft", tmp_path)


def test_imagenet_reads_classnames_and_holds_out_val(tmp_path):
    images = tmp_path / "imagenet" / "images"
    counts = {"n01440764": 12, "n01443537": 6, "n09999999": 3}
    for wnid, n in counts.items():
        for i in range(n):
            _png(images / "train" / wnid / f"{wnid}_{i}.JPEG")
        for i in range(2):
            _png(images / "val" / wnid / f"ILSVRC2012_val_{wnid}_{i}.JPEG")
    (tmp_path / "imagenet" / "classnames.txt").write_text(
        "n01440764 tench\nn01443537 goldfish\nn09999999 great white shark\n"
    )
    ds = _build("imagenet", tmp_path)
    assert ds.classnames == ["tench", "goldfish", "great white shark"]
    assert ds.root == images
    val, train = _label_counts(ds.items("val")), _label_counts(ds.items("train"))
    assert dict(val) == {0: 2, 1: 1}  # min(10, n // 5) per class
    assert dict(train) == {0: 10, 1: 5, 2: 3}
    assert not {it.id for it in ds.items("val")} & {it.id for it in ds.items("train")}
    assert _label_counts(ds.items("test")) == {0: 2, 1: 2, 2: 2}
    assert all(it.id.startswith("val/") for it in ds.items("test"))
    assert ds.templates[0] == "a photo of a {}." and len(ds.templates) == len(set(ds.templates)) > 50
    assert all(t.count("{}") == 1 for t in ds.templates)
    assert ds.load_image(ds.items("train")[0]).size == (4, 4)

    (tmp_path / "imagenet" / "classnames.txt").write_text("n01440764 tench\n")
    with pytest.raises(DatasetError, match="n01443537"):
        _build("imagenet", tmp_path)
    (tmp_path / "imagenet" / "classnames.txt").unlink()
    with pytest.raises(DatasetError, match="classnames.txt not found") as e:
        _build("imagenet", tmp_path)
    assert DATASETS["imagenet"].layout in str(e.value)


# ---------------------------------------------------------------- ImageNet's shifted test sets

# A five-class "ImageNet": classnames.txt lines in the sorted wnid order (ImageNet's index order).
WNIDS = {"n01440764": "tench", "n01443537": "goldfish", "n01484850": "great white shark",
         "n01491361": "tiger shark", "n01494475": "hammerhead shark"}


def _classnames_txt(folder: Path, wnids=WNIDS, order=None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    order = order or list(wnids)
    (folder / "classnames.txt").write_text("".join(f"{w} {wnids[w]}\n" for w in order))


def _imagenet_tree(data: Path) -> None:
    for wnid in WNIDS:
        for split, n in (("train", 5), ("val", 2)):
            for i in range(n):
                _png(data / "imagenet" / "images" / split / wnid / f"{wnid}_{i}.JPEG")
    _classnames_txt(data / "imagenet")


def test_imagenet_has_wnids_as_class_ids(tmp_path):
    _imagenet_tree(tmp_path)
    ds = _build("imagenet", tmp_path)
    assert ds.class_ids == sorted(WNIDS) and ds.classnames == [WNIDS[w] for w in sorted(WNIDS)]


def test_imagenet_v2_reads_numbered_folders_in_imagenet_order(tmp_path):
    base = tmp_path / "imagenetv2"
    # classnames.txt in another order than the index order: folder i is still the i-th wnid in sorted order
    _classnames_txt(base, order=sorted(WNIDS, reverse=True))
    image_dir = base / "imagenetv2-matched-frequency-format-val"
    for i in range(5):
        for j in range(i + 1):
            _png(image_dir / str(i) / f"{j:040x}.jpeg")
    ds = _build("imagenet_v2", tmp_path)
    assert ds.classnames == ["tench", "goldfish", "great white shark", "tiger shark", "hammerhead shark"]
    assert ds.class_ids == sorted(WNIDS)
    assert list(ds.splits) == ["test"] and _label_counts(ds.items("test")) == {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}
    assert ds.items("test")[0] == Item(f"0/{0:040x}.jpeg", 0) and ds.root == image_dir
    assert ds.load_image(ds.items("test")[-1]).size == (4, 4)
    assert ds.templates[0] == "a photo of a {}." and len(ds.templates) > 50  # ImageNet's prompts
    with pytest.raises(DatasetError, match="test set only"):
        ds.items("train")

    (image_dir / "7").mkdir()
    with pytest.raises(DatasetError, match="unexpected folder.*7") as e:
        _build("imagenet_v2", tmp_path)
    assert DATASETS["imagenet_v2"].layout in str(e.value)
    (image_dir / "7").rmdir()
    for f in (image_dir / "3").iterdir():
        f.unlink()
    (image_dir / "3").rmdir()
    with pytest.raises(DatasetError, match="folder.* 3 missing"):
        _build("imagenet_v2", tmp_path)
    (base / "classnames.txt").unlink()
    with pytest.raises(DatasetError, match="classnames.txt not found") as e:
        _build("imagenet_v2", tmp_path)
    assert "imagenetv2-matched-frequency-format-val/" in str(e.value)


def test_imagenet_sketch_reads_wnid_folders(tmp_path):
    base = tmp_path / "imagenet-sketch"
    _classnames_txt(base)
    for wnid in WNIDS:
        for i in range(3):
            _png(base / "images" / wnid / f"sketch_{i}.JPEG")
    ds = _build("imagenet_sketch", tmp_path)
    assert ds.classnames == [WNIDS[w] for w in sorted(WNIDS)] and ds.class_ids == sorted(WNIDS)
    assert list(ds.splits) == ["test"] and _label_counts(ds.items("test")) == {y: 3 for y in range(5)}
    assert ds.items("test")[0] == Item("n01440764/sketch_0.JPEG", 0)
    assert ds.templates == _build("imagenet_sketch", tmp_path).templates and ds.templates[0] == "a photo of a {}."

    _png(base / "images" / "n09999999" / "x.JPEG")  # a folder classnames.txt does not name
    with pytest.raises(DatasetError, match="n09999999"):
        _build("imagenet_sketch", tmp_path)
    with pytest.raises(DatasetError, match="takes no data.split_file"):
        _build("imagenet_sketch", tmp_path, split_file="split.json")
    (base / "images").rename(base / "sketch")  # the download's folder name, not CoOp's
    with pytest.raises(DatasetError, match="images not found") as e:
        _build("imagenet_sketch", tmp_path)
    assert "sketch/ folder, renamed" in str(e.value)


@pytest.mark.parametrize("name,dataset_dir,image_dir", [("imagenet_a", "imagenet-adversarial", "imagenet-a"),
                                                        ("imagenet_r", "imagenet-rendition", "imagenet-r")])
def test_imagenet_a_and_r_map_their_subset_onto_imagenet(tmp_path, name, dataset_dir, image_dir):
    _imagenet_tree(tmp_path)
    base = tmp_path / dataset_dir
    _classnames_txt(base)  # all of ImageNet's classes, as CoOp's layout copies the file
    subset = ["n01443537", "n01491361"]  # 2 of the 5, as A and R hold 200 of the 1000
    for wnid in subset:
        for i in range(2):
            _png(base / image_dir / wnid / f"{i}.jpg")
    (base / image_dir / "README.txt").write_text("not a class")
    ds = _build(name, tmp_path)
    assert ds.classnames == ["goldfish", "tiger shark"] and ds.class_ids == subset
    assert _label_counts(ds.items("test")) == {0: 2, 1: 2}
    assert ds.items("test")[2] == Item("n01491361/0.jpg", 1)
    # its classes are ImageNet's labels 1 and 3 (the index among ImageNet's sorted wnids)
    from fewclip.data.protocols import class_map

    imagenet = _build("imagenet", tmp_path)
    assert class_map(imagenet, ds) == [1, 3]
    assert [imagenet.classnames[y] for y in class_map(imagenet, ds)] == ds.classnames

    (base / "classnames.txt").unlink()
    with pytest.raises(DatasetError, match="classnames.txt not found.*copy ImageNet's classnames.txt") as e:
        _build(name, tmp_path)
    assert DATASETS[name].layout in str(e.value) and f"{image_dir}/" in str(e.value)


def test_imagenet_shift_sets_without_images_are_errors(tmp_path):
    _classnames_txt(tmp_path / "imagenet-rendition")
    (tmp_path / "imagenet-rendition" / "imagenet-r" / "n01443537").mkdir(parents=True)
    with pytest.raises(DatasetError, match="no test images"):
        _build("imagenet_r", tmp_path)
    with pytest.raises(DatasetError, match="imagenet-adversarial not found"):
        _build("imagenet_a", tmp_path)
