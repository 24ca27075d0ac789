"""Class names are prompts, labels are indices (issue 32 item 1, issue 37 defect 14, issue 36 item 3).

Repeated class names load; classes whose prompts tokenize identically run with every method and are reported
once per command, before any run (a sweep: once for the sweep), and recorded in each run's metrics.json;
nothing keys a class by its name (per-class accuracy, shots per class, base/new halves). ImageNet's 1000 names
(CLIP's list, which open_clip ships as IMAGENET_CLASSNAMES: 'missile' at 657 and 744, 'sunglasses' at 836 and
837) go through zero-shot, CoOp, Tip-Adapter, LP++ and base-to-novel end to end on generated images."""
import copy
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES
from PIL import Image
from safetensors.torch import save_file

from fewclip.backbones.backbone import build_open_clip_model
from fewclip.cli.main import main
from fewclip.data.class_names import class_keys, identical_prompt_groups
from fewclip.data.protocols import class_map
from fewclip.datasets import DataConfig, Dataset, build_dataset

# A tiny open_clip model with CLIP's BPE tokenizer (so ImageNet's names are real words to it), random weights.
TINY = {"embed_dim": 16,
        "vision_cfg": {"image_size": 32, "patch_size": 16, "width": 32, "layers": 1, "head_width": 16},
        "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
FAST = ["backbone.device=cpu"]
T = ["train.epochs=1", "train.augment_views=1"]  # a short training


@pytest.fixture(autouse=True)
def no_store(monkeypatch):
    monkeypatch.setenv("FEWCLIP_CACHE", "off")


def warnings_in(text: str):
    return [line for line in text.splitlines() if "identical prompts" in line and "WARNING" in line]


def image_folder(root: Path, classes, n=4):
    for k, c in enumerate(classes):
        (root / c).mkdir(parents=True)
        for i in range(n):
            Image.new("RGB", (32, 32), (40 * i, 60 * k % 256, 0)).save(root / c / f"{i}.png")
    return root


# ---------------------------------------------------------------- the pieces


def test_class_keys_give_every_class_its_own_key():
    assert class_keys(["cat", "dog"]) == ["cat", "dog"]
    assert class_keys(["cat", "dog", "Cat"]) == ["cat [0]", "dog", "Cat [2]"]
    keys = class_keys(IMAGENET_CLASSNAMES)
    assert len(set(keys)) == 1000 and keys[657] == "missile [657]" and keys[744] == "missile [744]"
    assert keys[836:838] == ["sunglasses [836]", "sunglasses [837]"] and keys[0] == IMAGENET_CLASSNAMES[0]


def test_identical_prompt_groups_by_text_and_by_tokens():
    assert identical_prompt_groups(["cat", "dog", "Cat ", "big  dog", "big dog"]) == [[0, 2], [3, 4]]
    assert identical_prompt_groups(IMAGENET_CLASSNAMES, ["a photo of a {}."]) == [[657, 744], [836, 837]]
    unk = identical_prompt_groups(["cat", "yak", "zebra"], tokenizer=lambda texts: [
        [1 if t == "cat" else 0] for t in texts])  # a tokenizer that knows one word
    assert unk == [[1, 2]]


def test_repeated_names_load_in_a_dataset_a_folder_and_a_split_file(tmp_path):
    assert Dataset("t", ["cat", "dog", "cat"], ["{}"]).classnames == ["cat", "dog", "cat"]
    image_folder(tmp_path / "f", ["big_dog", "big dog", "cat"], n=3)
    assert build_dataset(DataConfig(name="folder", root=str(tmp_path / "f"))).classnames == [
        "big dog", "big dog", "cat"]
    split = {"train": [["f/cat/0.png", 0, "cat"], ["f/big_dog/0.png", 1, "dog"], ["f/big dog/0.png", 2, "dog"]],
             "val": [], "test": [["f/cat/1.png", 0, "cat"], ["f/big_dog/1.png", 1, "dog"],
                                 ["f/big dog/1.png", 2, "dog"]]}
    (tmp_path / "split.json").write_text(json.dumps(split))
    ds = build_dataset(DataConfig(name="folder", root=str(tmp_path), split_file=str(tmp_path / "split.json")))
    assert ds.classnames == ["cat", "dog", "dog"] and [it.label for it in ds.items("test")] == [0, 1, 2]


# ---------------------------------------------------------------- one warning per command, every method


@pytest.fixture(scope="module")
def unknown(tmp_path_factory):
    """Three classes for toy-clip's word tokenizer, two of them unknown to it: the same <unk> prompt."""
    return image_folder(tmp_path_factory.mktemp("unk") / "animals", ["circle", "yak", "zebra"])


@pytest.mark.parametrize("command", [["zeroshot"], ["train", "adapter=tip_adapter", "shots=1", *T],
                                     ["train", "adapter=coop", "shots=1", "adapter.n_ctx=2", *T]])
def test_every_method_runs_identical_prompts_and_says_so_once(unknown, tmp_path, capsys, command):
    out = tmp_path / "run"
    code = main([*command, "data=folder", f"data.root={unknown}", "data.max_test=6", *FAST, f"out={out}"])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    lines = warnings_in(err)
    assert len(lines) == 1, err
    assert "2 classes share their prompt" in lines[0] and "'yak' = 'zebra' (labels 1, 2)" in lines[0]
    m = json.loads((out / "metrics.json").read_text())
    assert m["identical_prompts"] == [{"dataset": "animals", "labels": [1, 2], "classnames": ["yak", "zebra"]}]
    assert sorted(m["per_class"]) == ["circle", "yak", "zebra"]


def test_a_sweep_says_it_once_for_all_its_runs(unknown, tmp_path, capsys):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(OmegaConf.to_yaml(OmegaConf.create({"sweep": {
        "datasets": [{"name": "folder", "root": str(unknown)}], "methods": ["zeroshot", "tip_adapter", "coop_n2"],
        "shots": [1], "seeds": [1, 2], "args": ["data.max_test=6", *FAST],
        "variants": {"coop_n2": ["adapter=coop", "adapter.n_ctx=2", *T]}}})))
    code = main(["sweep", str(spec), f"out={tmp_path / 'out'}", "report=false"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert len(warnings_in(err)) == 1, err
    runs = sorted((tmp_path / "out").rglob("metrics.json"))
    assert len(runs) == 5  # zero-shot once, the others per seed
    for p in runs:
        assert json.loads(p.read_text())["identical_prompts"][0]["labels"] == [1, 2], p


# ---------------------------------------------------------------- ImageNet's 1000 names


def _tiny_card(folder: Path) -> str:
    torch.manual_seed(0)
    sd = build_open_clip_model(copy.deepcopy(TINY)).state_dict()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "tiny.safetensors"))
    card = {"name": "tiny-bpe", "model_config": TINY, "weights": "tiny.safetensors",
            "geometry": {"name": "clip", "logit_scale": float(sd["logit_scale"].exp())}}
    (folder / "tiny.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(card)))
    return str(folder / "tiny.yaml")


WNIDS = [f"n{i:08d}" for i in range(1000)]  # sorted as ImageNet's wnids: label i is folder i


def _png(path: Path, i: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), ((37 * i) % 256, (91 * i) % 256, (13 * i) % 256)).save(path)


@pytest.fixture(scope="module")
def imagenet_root(tmp_path_factory):
    """CoOp's DATASETS.md layout for ImageNet, ImageNet-V2 and ImageNet-Sketch, one tiny image per class and
    split; a ``with_names`` root has classnames.txt (CoOp's route, here with CLIP's names), ``plain`` none
    (fewclip falls back to open_clip's IMAGENET_CLASSNAMES)."""
    base = tmp_path_factory.mktemp("imagenet")
    roots = {}
    for kind in ("with_names", "plain"):
        root = roots[kind] = base / kind
        for i, w in enumerate(WNIDS):
            _png(root / "imagenet" / "images" / "train" / w / "a.png", i)
            _png(root / "imagenet" / "images" / "val" / w / "b.png", i + 1)
            _png(root / "imagenetv2" / "imagenetv2-matched-frequency-format-val" / str(i) / "c.png", i + 2)
            _png(root / "imagenet-sketch" / "images" / w / "d.png", i + 3)
        if kind == "with_names":
            lines = "".join(f"{w} {n}\n" for w, n in zip(WNIDS, IMAGENET_CLASSNAMES))
            for d in ("imagenet", "imagenetv2", "imagenet-sketch"):
                (root / d / "classnames.txt").write_text(lines)
    return roots


@pytest.mark.parametrize("kind", ["with_names", "plain"])
def test_imagenet_v2_and_sketch_build_with_clips_and_open_clips_names(imagenet_root, kind):
    for name in ("imagenet", "imagenet_v2", "imagenet_sketch"):
        ds = build_dataset(DataConfig(name=name, root=str(imagenet_root[kind])))
        assert ds.classnames == list(IMAGENET_CLASSNAMES), name
        assert ds.classnames[657] == ds.classnames[744] == "missile" and len(ds.items("test")) == 1000
        if kind == "with_names" or name != "imagenet_v2":  # V2's folders are 0..999: wnids from classnames.txt
            assert ds.class_ids == WNIDS, name
    # a domain-shift target maps class for class onto ImageNet (by wnid, or by the identical list of names where
    # V2 has no wnids), the repeated names included
    source = build_dataset(DataConfig(name="imagenet", root=str(imagenet_root["with_names"])))
    for name in ("imagenet_v2", "imagenet_sketch"):
        target = build_dataset(DataConfig(name=name, root=str(imagenet_root[kind])))
        assert class_map(source, target) == list(range(1000)), name


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    return _tiny_card(tmp_path_factory.mktemp("card"))


@pytest.mark.parametrize("command", [
    ["zeroshot"],
    ["train", "adapter=coop", "adapter.n_ctx=2", "train.batch_size=256", *T],
    ["train", "adapter=tip_adapter", "adapter.views=1", *T],
    ["train", "adapter=lpp", "adapter.views=1", "adapter.epochs=10", *T],  # its 300 full-batch epochs: not the point
    ["zeroshot", "protocol=base2new"],
])
def test_imagenets_1000_names_end_to_end(imagenet_root, card, tmp_path, capsys, command):
    out = tmp_path / "run"
    code = main([*command, f"backbone={card}", "data=imagenet", f"data.root={imagenet_root['with_names']}",
                 *(["shots=1", "seed=1"] if command[0] == "train" else []), *FAST, f"out={out}"])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    lines = warnings_in(err)
    assert len(lines) == 1, err
    assert "'missile' (labels 657, 744), 'sunglasses' (labels 836, 837)" in lines[0] or (
        "imagenet[new]: 'missile' (labels 157, 244), 'sunglasses' (labels 336, 337)" in lines[0]), lines[0]
    m = json.loads((out / "metrics.json").read_text())
    if "protocol=base2new" in command:  # the halves: 0..499 and 500..999, relabelled 0..499 each
        assert m["identical_prompts"] == [
            {"dataset": "imagenet[new]", "labels": [157, 244], "classnames": ["missile", "missile"]},
            {"dataset": "imagenet[new]", "labels": [336, 337], "classnames": ["sunglasses", "sunglasses"]}]
        new = m["evals"]["new"]["per_class"]
        assert len(new) == 500 and {"missile [157]", "missile [244]", "sunglasses [336]"} <= set(new)
        return
    assert m["identical_prompts"] == [
        {"dataset": "imagenet", "labels": [657, 744], "classnames": ["missile", "missile"]},
        {"dataset": "imagenet", "labels": [836, 837], "classnames": ["sunglasses", "sunglasses"]}]
    assert len(m["per_class"]) == 1000 and m["n_test"] == 1000
    assert {"missile [657]", "missile [744]", "sunglasses [836]", "sunglasses [837]"} <= set(m["per_class"])
    if "shots_per_class" in m:
        assert len(m["shots_per_class"]) == 1000 and set(m["shots_per_class"].values()) == {1}


def test_a_feature_files_classes_keep_their_own_text_rows_when_names_repeat():
    """A feature backbone looks prompts up by their text; asked for its own classes it gives each class its own
    row, by label, so two classes named alike keep different text features where the file has them."""
    from fewclip.backbones.feature_backbone import FeatureBackbone
    from fewclip.backbones.geometry import make_geometry
    from fewclip.features.encode import text_prototypes

    text = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(0))
    fb = FeatureBackbone(make_geometry("clip"), ["missile", "missile", "kite"], ["{}"], text)
    protos = text_prototypes(fb, ["missile", "missile", "kite"], ["{}"])
    close = torch.testing.assert_close
    close(protos, torch.nn.functional.normalize(text[:, 0], dim=-1), rtol=1e-6, atol=1e-6)
