"""Named datasets: a folder dataset is known by its folder's name or by `data.name` with `data.reader`, in run
folders, tables, records and the feature store; a sweep takes dataset entries with their own arguments."""
import csv
import json

import numpy as np
import pytest
from PIL import Image

from fewclip.cli.main import main

SHAPES = ["circle", "square", "triangle", "star"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two folder datasets of toy-shapes images: `.../pets` (3 classes) and `.../shop/images` (4 classes)."""
    from fewclip.datasets import DataConfig, build_dataset

    ds = build_dataset(DataConfig(name="toy-shapes"))
    arrays = {}
    for it in ds.items("test"):
        name = ds.classnames[it.label]
        if name in SHAPES and len(arrays.setdefault(name, [])) < 6:
            arrays[name].append(np.asarray(ds.load_image(it)))
    base = tmp_path_factory.mktemp("data")
    roots = {"pets": base / "pets", "shop": base / "shop" / "images"}
    for key, classes in (("pets", SHAPES[:3]), ("shop", SHAPES)):
        for c in classes:
            (roots[key] / c).mkdir(parents=True)
            for i, a in enumerate(arrays[c]):
                Image.fromarray(a).save(roots[key] / c / f"{i}.png")
    return roots


def test_a_folder_dataset_is_named_after_its_folder_or_its_data_name(folders, tmp_path, capsys):
    from fewclip.datasets import DataConfig, build_dataset, dataset_name

    assert build_dataset(DataConfig(name="folder", root=str(folders["pets"]))).name == "pets"
    named = DataConfig(name="toys", reader="folder", root=str(folders["shop"]), prompts=["a drawing of a {}."])
    ds = build_dataset(named)
    assert (ds.name, dataset_name(named), ds.prompts("ensemble")) == ("toys", "toys", ["a drawing of a {}."])
    assert dataset_name(DataConfig(name="toy-shapes")) == "toy-shapes"
    for bad in ("average", "my pets", "../x"):
        with pytest.raises(ValueError, match="data.name"):
            DataConfig(name=bad, reader="folder")
    with pytest.raises(ValueError, match="data.prompts"):
        DataConfig(prompts=["no slot"])
    assert main(["zeroshot", "data.prompts=[a photo of a {}.]"]) == 2  # YAML reads {} as a mapping: say to quote
    err = capsys.readouterr().err
    assert "quote text" in err and len(err.strip().splitlines()) == 1
    assert main(["zeroshot", "backbone=toy-clip", "data=folder", f"data.root={folders['pets']}",
                 f"out={tmp_path / 'zs'}"]) == 0
    assert "on pets (" in capsys.readouterr().out
    m = json.loads((tmp_path / "zs" / "metrics.json").read_text())
    assert m["dataset"] == "pets"
    assert main(["zeroshot", "backbone=toy-clip", "data=pets", f"data.root={folders['pets']}"]) == 2
    assert "data.reader=folder" in capsys.readouterr().err  # an unknown name says how to name your own


def test_two_folder_datasets_in_one_sweep_and_one_report(folders, tmp_path, capsys, feature_store):
    piece = tmp_path / "toys.yaml"
    piece.write_text(f"data:\n  name: toys\n  reader: folder\n  root: {folders['shop']}\n  templates: single\n"
                     f"  prompts: ['a drawing of a {{}}.', 'a {{}}']\n")
    spec = tmp_path / "sweep.yaml"
    spec.write_text(f"""\
sweep:
  backbones: [toy-clip]
  datasets:
    - {{name: folder, root: {folders['pets']}}}
    - {piece}
    - toy-shapes
  methods: [zeroshot, linear_probe]
  shots: [1]
  seeds: [1]
  args: [data.max_test=16, backbone.device=cpu]
""")
    out = tmp_path / "out"
    assert main(["sweep", str(spec), f"out={out}"]) == 0
    capsys.readouterr()
    for name in ("pets", "toys", "toy-shapes"):
        assert (out / "toy-clip" / name / "zeroshot" / "metrics.json").is_file(), name
        assert (out / "toy-clip" / name / "linear_probe" / "1shot" / "seed1" / "metrics.json").is_file(), name
    toys = json.loads((out / "toy-clip/toys/zeroshot/metrics.json").read_text())
    pets = json.loads((out / "toy-clip/pets/zeroshot/metrics.json").read_text())
    assert toys["dataset"] == "toys" and toys["templates"] == ["a drawing of a {}."]  # its own, single
    assert pets["dataset"] == "pets" and pets["templates"][0] == "a photo of a {}."  # the folder reader's
    assert len(toys["per_class"]) == 4 and len(pets["per_class"]) == 3
    with open(out / "report.csv") as f:
        datasets = {row["dataset"] for row in csv.DictReader(f)}
    assert {"pets", "toys", "toy-shapes"} <= datasets
    assert main(["cache"]) == 0
    listing = capsys.readouterr().out
    assert "toy-clip  pets " in listing and "toy-clip  toys " in listing
    assert main(["cache", "clear", "toys"]) == 0 and "removed 1 " in capsys.readouterr().out
    assert main(["sweep", str(spec), f"out={out}"]) == 0  # resumes: the names are stable
    assert "6 runs, 6 already done, 0 ran" in capsys.readouterr().out


def test_two_entries_of_one_name_are_an_error(folders, tmp_path, capsys):
    other = tmp_path / "elsewhere" / "pets"
    other.parent.mkdir()
    other.symlink_to(folders["pets"])
    spec = tmp_path / "sweep.yaml"
    spec.write_text(f"sweep:\n  datasets:\n    - {{name: folder, root: {folders['pets']}}}\n"
                    f"    - {{name: folder, root: {other}}}\n  methods: [zeroshot]\n")
    assert main(["sweep", str(spec), f"out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert "two entries are the dataset 'pets'" in err and "reader: folder" in err and len(err.splitlines()) == 1
    spec.write_text("sweep:\n  datasets:\n    - {name: folder, rooot: /x}\n  methods: [zeroshot]\n")
    assert main(["sweep", str(spec), f"out={tmp_path / 'out'}"]) == 2
    assert "unknown data key(s) rooot" in capsys.readouterr().err


def test_the_new_data_keys_at_their_defaults_leave_a_run_identity_unchanged():
    from fewclip.runs.records import config_dict
    from fewclip.runs.run import load_train_config

    conf = config_dict(load_train_config(["data=toy-shapes"]))
    assert "reader" not in conf["data"] and "prompts" not in conf["data"]  # as a run recorded before they existed
    named = config_dict(load_train_config(["data.name=pets", "data.reader=folder", 'data.prompts=["a {}"]']))
    assert (named["data"]["reader"], named["data"]["prompts"]) == ("folder", ["a {}"])
