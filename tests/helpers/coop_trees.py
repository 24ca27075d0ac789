"""The small benchmark trees of tests/fixtures/coop_fewshot/draws.json (all 11 of CoOp's datasets, split files
listing classes out of label order, classes of exactly k and fewer than k images), rebuilt for a test."""
import json
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "coop_fewshot"
REF = json.loads((FIXTURE / "draws.json").read_text())
DATASETS = sorted(REF["datasets"])


def touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")


def make_tree(root: Path, name: str) -> None:
    """The tree the fixture's draws were made on, in CoOp's DATASETS.md layout (empty image files: nothing opens
    them)."""
    ref = REF["datasets"][name]
    base, tree = root / ref["folder"], ref["tree"]
    if name == "imagenet":
        base.mkdir(parents=True)
        (base / "classnames.txt").write_text("".join(f"{w} {n}\n" for w, n in tree["classnames"].items()))
        for wnid, files in tree["listing"].items():
            for f in files:
                touch(base / "images" / "train" / wnid / f)
            touch(base / "images" / "val" / wnid / f"{wnid}_val.JPEG")
    elif name == "fgvc_aircraft":
        base.mkdir(parents=True)
        (base / "variants.txt").write_text("".join(v + "\n" for v in tree["variants"]))
        for split in ("train", "val", "test"):
            (base / f"images_variant_{split}.txt").write_text("".join(f"{a} {v}\n" for a, v in tree[split]))
            for a, _ in tree[split]:
                touch(base / "images" / f"{a}.jpg")
    else:
        split_json = {"caltech101": "split_zhou_Caltech101.json", "oxford_pets": "split_zhou_OxfordPets.json",
                      "stanford_cars": "split_zhou_StanfordCars.json", "oxford_flowers": "split_zhou_OxfordFlowers.json",
                      "food101": "split_zhou_Food101.json", "sun397": "split_zhou_SUN397.json",
                      "dtd": "split_zhou_DescribableTextures.json", "eurosat": "split_zhou_EuroSAT.json",
                      "ucf101": "split_zhou_UCF101.json"}[name]
        base.mkdir(parents=True)
        (base / split_json).write_text(json.dumps(tree["split"]))
        for rows in tree["split"].values():
            for relpath, _, _ in rows:
                touch(base / ref["image_dir"] / relpath)
