"""The feature store never serves features of other pixels: a folder dataset's images changed in place, touched,
added; a damaged entry; a toy task whose generator changed; `fewclip cache` listing and clearing by root or name."""
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fewclip.cli.main import main

CLASSES = ["circle", "square", "triangle"]


@pytest.fixture(scope="module")
def renders():
    """Toy-shapes test images of three classes (what toy-clip recognises), 6 per class, as uint8 arrays."""
    from fewclip.datasets import DataConfig, build_dataset

    ds = build_dataset(DataConfig(name="toy-shapes"))
    out = {}
    for it in ds.items("test"):
        name = ds.classnames[it.label]
        if name in CLASSES and len(out.setdefault(name, [])) < 6:
            out[name].append(np.asarray(ds.load_image(it)))
    return out


def write_folder(root: Path, renders, shift: int = 0) -> Path:
    """A folder dataset of BMP files (a fixed size for a fixed shape: replacing pixels keeps the size); with
    ``shift``, each class folder holds the images of another class (the same names, other pixels)."""
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True, exist_ok=True)
        source = CLASSES[(c + shift) % len(CLASSES)]
        for i, a in enumerate(renders[source]):
            Image.fromarray(a).save(root / name / f"{i}.bmp")
    return root


def zeroshot(root: Path, out: Path, **env) -> dict:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        assert main(["zeroshot", "backbone=toy-clip", "backbone.device=cpu", "data=folder", f"data.root={root}",
                     f"out={out}", "overwrite=true"]) == 0
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return json.loads((out / "metrics.json").read_text())


def messages(capsys, text):
    """The log lines of the commands run since the last call that contain ``text``, each as often as it was
    logged (a message said twice counts twice), without their time of day."""
    return [re.sub(r"^\d\d:\d\d:\d\d ", "", line) for line in capsys.readouterr().err.splitlines()
            if text in line]


def test_pixels_replaced_in_place_are_encoded_again(renders, tmp_path, capsys):
    root = write_folder(tmp_path / "pets", renders)
    first = zeroshot(root, tmp_path / "a")
    assert first["images_from_store"] == 0 and first["top1"] > 50
    again = zeroshot(root, tmp_path / "b")
    assert again["images_from_store"] == again["n_test"] and again["top1"] == first["top1"]

    write_folder(root, renders, shift=1)  # same file names and sizes, other pixels
    capsys.readouterr()
    changed = zeroshot(root, tmp_path / "c")
    lines = messages(capsys, "changed since their features were stored")
    off = zeroshot(root, tmp_path / "d", FEWCLIP_CACHE="off")
    assert changed["top1"] == off["top1"] != first["top1"]  # as without a store: nothing stale served
    assert changed["images_from_store"] == 0
    assert len(lines) == 1 and f"{changed['n_test']} of {changed['n_test']} image(s)" in lines[0], lines


def test_a_touched_image_is_checked_by_content_and_an_added_one_changes_the_request(renders, tmp_path,
                                                                                    feature_store):
    from safetensors import safe_open

    from fewclip.datasets import DataConfig, build_dataset

    root = write_folder(tmp_path / "pets", renders)
    first = zeroshot(root, tmp_path / "a")
    test_ids = [it.id for it in build_dataset(DataConfig(name="folder", root=str(root))).items("test")]
    victim = root / test_ids[0]
    st = victim.stat()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # touched: new time, same pixels
    touched = zeroshot(root, tmp_path / "b")
    assert touched["images_from_store"] == touched["n_test"] and touched["top1"] == first["top1"]
    with safe_open(str(next(feature_store.rglob("*.safetensors"))), framework="pt") as f:
        meta = f.metadata()
    record = json.loads(meta["source"])["files"][json.loads(meta["ids"]).index(test_ids[0])]
    assert record[:2] == [st.st_size, st.st_mtime_ns + 5_000_000_000]  # the entry now holds the new time

    for i in range(6, 12):  # images added to a class: the test split's ids change, so does its entry
        Image.fromarray(renders["square"][i - 6]).save(root / "circle" / f"{i}.bmp")
    added = zeroshot(root, tmp_path / "c")
    off = zeroshot(root, tmp_path / "d", FEWCLIP_CACHE="off")
    assert added["n_test"] > first["n_test"] and added["images_from_store"] == 0
    assert added["top1"] == off["top1"] and added["per_class"] == off["per_class"]


def test_an_edit_that_keeps_size_and_time_is_caught_by_verify_hash(renders, tmp_path):
    root = write_folder(tmp_path / "pets", renders)
    first = zeroshot(root, tmp_path / "a")
    times = {p: p.stat() for p in root.rglob("*.bmp")}
    write_folder(root, renders, shift=1)
    for p, st in times.items():  # a tool that restores the times (the size of a BMP is fixed by its shape)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert p.stat().st_size == st.st_size
    stale = zeroshot(root, tmp_path / "b")  # the default check trusts an unchanged size and time
    assert stale["images_from_store"] == stale["n_test"] and stale["top1"] == first["top1"]
    checked = zeroshot(root, tmp_path / "c", FEWCLIP_CACHE_VERIFY="hash")
    off = zeroshot(root, tmp_path / "d", FEWCLIP_CACHE="off")
    assert checked["images_from_store"] == 0 and checked["top1"] == off["top1"] != first["top1"]


@pytest.mark.parametrize("where", ["data", "header", "truncated", "nan-checksummed"])
def test_a_damaged_entry_is_reported_dropped_and_encoded_again(where, renders, tmp_path, capsys, feature_store):
    root = write_folder(tmp_path / "pets", renders)
    first = zeroshot(root, tmp_path / "a")
    shard = next(feature_store.rglob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    if where == "nan-checksummed":  # NaN features under a checksum that matches them (a NaN encoder, a forger)
        from safetensors import safe_open
        from safetensors.torch import save_file

        from fewclip.features.store import entry_checksum

        with safe_open(str(shard), "pt") as f:
            meta, x = f.metadata(), f.get_tensor("x")
        x[0, 0] = float("nan")
        save_file({"x": x}, str(shard), metadata={**meta, "checksum": entry_checksum(x, meta["ids"], meta["source"])})
        raw = bytearray(shard.read_bytes())
    elif where == "data":
        raw[8 + header + 13] ^= 0x01  # one bit of one feature
    elif where == "header":
        at = raw.index(b'"ids"', 8) + 10
        raw[at] ^= 0x01  # one character of an image id
    else:
        raw = raw[: len(raw) // 2]
    shard.write_bytes(bytes(raw))
    capsys.readouterr()
    again = zeroshot(root, tmp_path / "b")
    damaged = messages(capsys, "damaged entry")
    assert again["images_from_store"] == 0 and again["top1"] == first["top1"]
    assert again["per_class"] == first["per_class"]
    assert len(damaged) == 1 and str(shard) in damaged[0], damaged
    third = zeroshot(root, tmp_path / "c")  # replaced by a good entry
    assert third["images_from_store"] == third["n_test"]


def test_a_toy_task_is_checked_against_its_generator(tmp_path, shapes, caplog):
    from fewclip.backbones.backbone import BackboneConfig, load_backbone
    from fewclip.datasets import DataConfig, build_dataset
    from fewclip.features.encode import FeatureCache
    from fewclip.features.store import FeatureStore

    store = FeatureStore(tmp_path / "store")
    bb = load_backbone(BackboneConfig(name="toy-clip", device="cpu"))
    ds = build_dataset(DataConfig(name="toy-shapes"))
    items = ds.items("test")[:8]
    assert ds.generator and ds.generator == shapes.generator  # a function of the code and the task's settings
    assert ds.generator != build_dataset(DataConfig(name="toy-sketch")).generator
    assert FeatureCache(store).features(bb, ds, items).encoded == 8
    assert FeatureCache(store).features(bb, ds, items).from_store == 8
    ds.generator = "toyworld:another-renderer"  # what an edit of the renderer does
    assert FeatureCache(store).features(bb, ds, items).encoded == 8
    assert any("8 of 8 image(s) of toy-shapes changed" in r.getMessage() for r in caplog.records)


def test_the_generator_digest_follows_the_code_not_its_docstrings_or_comments(tmp_path):
    from fewclip.utils.checksums import code_sha256

    def digest(text):
        path = tmp_path / "renderer.py"
        path.write_text(text)
        return code_sha256(path)

    base = digest('"""Renders."""\nimport numpy as np\n\n\ndef render(i):\n    """Pixels."""\n    return np.full(3, i)\n')
    assert digest('"""Renders the pixels."""\nimport numpy as np  # arrays\n\ndef render(i):\n'
                  '    """Other words."""\n    # a comment\n    return np.full(3, i)\n') == base
    assert digest('import numpy as np\n\n\ndef render(i):\n    return np.full(3, i)\n') == base  # none at all
    assert digest('"""Renders."""\nimport numpy as np\n\n\ndef render(i):\n    """Pixels."""\n'
                  '    return np.full(3, i + 1)\n') != base
    assert digest('"""Renders."""\nimport numpy as np\n\n\ndef render(i):\n    """Pixels."""\n'
                  '    return np.full(3, "i")\n') != base  # a string that is code, not a docstring


def test_cache_lists_roots_and_clears_by_root_or_name(renders, tmp_path, capsys, feature_store):
    a = write_folder(tmp_path / "pets", renders)
    b = write_folder(tmp_path / "cars", renders)
    zeroshot(a, tmp_path / "ra")
    zeroshot(b, tmp_path / "rb")
    capsys.readouterr()
    assert main(["cache"]) == 0
    listing = capsys.readouterr().out
    rows = [line for line in listing.splitlines() if line.startswith("toy-clip")]
    assert len(rows) == 2 and any(str(a.resolve()) in r for r in rows) and any(str(b.resolve()) in r for r in rows)
    assert {r.split()[1] for r in rows} == {"pets", "cars"}  # each folder dataset by its name
    assert main(["cache", "clear", str(a)]) == 0  # a root
    assert "removed 1 feature group(s)" in capsys.readouterr().out
    assert main(["cache"]) == 0
    rest = capsys.readouterr().out
    assert str(b.resolve()) in rest and str(a.resolve()) not in rest
    zeroshot(a, tmp_path / "ra2")
    assert main(["cache", "clear", "cars"]) == 0  # a dataset name
    assert "removed 1 feature group(s)" in capsys.readouterr().out
    assert main(["cache", "clear", "root=" + str(tmp_path)]) == 0  # a folder above the roots
    assert "removed 1 feature group(s)" in capsys.readouterr().out
    (feature_store / "v1" / "abc").mkdir(parents=True)  # a store of the previous format
    assert main(["cache"]) == 0 and "v1: features in an older store format" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0 and not (feature_store / "v1").exists()
