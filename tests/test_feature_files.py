"""Methods on your own features: feature files as a dataset, the round trip dataset -> file -> train, the Python
API, the error for a method that needs the towers, sweep / report / export on a file."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import fewclip
from fewclip.cli.main import main
from fewclip.datasets import DataConfig, build_dataset
from fewclip.features.feature_file import read_feature_file, write_feature_file
from fewclip.training.on_features import fit_features, read_features


@pytest.fixture(autouse=True)
def no_store(monkeypatch):
    monkeypatch.setenv("FEWCLIP_CACHE", "off")


@pytest.fixture(scope="module")
def colours(tmp_path_factory):
    """toy-colours with toy-clip as a feature file: 200 test images, 20 views drawn for seed 1."""
    path = tmp_path_factory.mktemp("features") / "colours.safetensors"
    assert main(["features", "backbone=toy-clip", "data=toy-colours", "data.max_test=200", "views=20",
                 f"out={path}"]) == 0
    return path


def run(tmp_path, name, *args):
    out = tmp_path / name
    assert main(["train", *args, f"out={out}"]) == 0
    return out, json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("method", ["tip_adapter_f", "lpp"])
def test_the_round_trip_dataset_file_train_gives_the_runs_numbers(colours, tmp_path, method):
    """The same method, shots and seed on the dataset and on its feature file: the same split, the same
    accuracy, the same learned tensors up to the last bits (an image's features change in the last bits with
    the batch it is encoded in: the run encodes its split, the file the whole pool)."""
    common = [f"adapter={method}", "shots=4", "seed=1", "data.max_test=200"]
    d_out, direct = run(tmp_path, "direct", "data=toy-colours", *common)
    f_out, onfile = run(tmp_path, "file", "data=features", f"data.path={colours}", *common)
    assert onfile["dataset"] == "toy-colours" and onfile["backbone"] == "features:colours.safetensors"
    assert onfile["top1"] == direct["top1"] and onfile["per_class"] == direct["per_class"]
    assert onfile["n_test"] == direct["n_test"] == 200
    assert onfile["images_encoded_shared"] == onfile["images_encoded"]  # nothing encoded: all from the file
    a, b = load_file(str(d_out / "adapter.safetensors")), load_file(str(f_out / "adapter.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert float((a[k].double() - b[k].double()).abs().max()) < 1e-4, k
    d_split = json.loads((d_out / "split.json").read_text())
    f_split = json.loads((f_out / "split.json").read_text())
    train_ids = [it.id for it in build_dataset(DataConfig(name="toy-colours")).items("train")]
    assert [[f"train/{train_ids.index(i)}", lab] for i, lab in d_split["train"]] == f_split["train"]


def test_zeroshot_on_a_file_equals_zeroshot_on_the_dataset(colours, tmp_path):
    out = tmp_path / "zs-file"
    assert main(["zeroshot", "data=features", f"data.path={colours}", f"out={out}"]) == 0
    direct = tmp_path / "zs-direct"
    assert main(["zeroshot", "data=toy-colours", "data.max_test=200", f"out={direct}"]) == 0
    a, b = (json.loads((p / "metrics.json").read_text()) for p in (out, direct))
    assert a["top1"] == b["top1"] and a["per_class"] == b["per_class"]


def test_a_method_that_needs_the_towers_is_a_one_line_error_naming_it(colours, tmp_path, capsys):
    for method in ("coop", "lora", "maple"):
        code = main(["train", f"adapter={method}", "data=features", f"data.path={colours}", "shots=1",
                     f"out={tmp_path / method}"])
        err = capsys.readouterr().err.strip()
        errors = [line for line in err.splitlines() if " INFO " not in line]  # progress lines aside: one line
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
        assert f"method {method!r} cannot run on image features alone" in err and "tip_adapter_f" in err
        assert not (tmp_path / method / "metrics.json").exists()


def test_bad_feature_files_are_one_line_errors(tmp_path, capsys):
    save_file({"x": torch.zeros(2, 2)}, str(tmp_path / "plain.safetensors"))
    for path, words in ((tmp_path / "missing.safetensors", "is not a file"),
                        (tmp_path / "plain.safetensors", "not a fewclip feature file")):
        assert main(["zeroshot", "data=features", f"data.path={path}", f"out={tmp_path / 'o'}"]) == 2
        err = capsys.readouterr().err.strip()
        errors = [line for line in err.splitlines() if " INFO " not in line]  # progress lines aside: one line
        assert len(errors) == 1 and words in err, err
    assert main(["zeroshot", "data=features", f"out={tmp_path / 'o'}"]) == 2
    assert "data.path" in capsys.readouterr().err
    x = torch.randn(6, 4)
    with pytest.raises(ValueError, match="labels in"):
        write_feature_file(tmp_path / "bad.safetensors", train=(x, torch.tensor([0, 1, 2, 0, 1, 5])),
                           test=(x, torch.zeros(6, dtype=torch.long)), classnames=["a", "b", "c"],
                           text=torch.randn(3, 4), geometry={"name": "clip", "params": {}})


def test_fit_features_equals_the_run_and_exports(colours, tmp_path):
    """fit_features on the rows of a run's split (and the file's views of them) learns what the run learned,
    scores new features, and exports a file that load_prompts reads back with the same logits."""
    f_out, onfile = run(tmp_path, "file", "adapter=tip_adapter_f", "data=features", f"data.path={colours}",
                        "shots=4", "seed=1")
    d = read_features(colours)
    split = json.loads((f_out / "split.json").read_text())
    rows = torch.tensor([int(i.split("/")[1]) for i, _ in split["train"]])
    vrows = torch.tensor([int(i.split("/")[1]) for i, _ in split["val"]])
    (tx, ty), (vx, vy), (sx, sy) = d["train"], d["val"], d["test"]
    clf = fit_features("tip_adapter_f", tx[rows], ty[rows], d["classnames"], d["text"], d["geometry"],
                       val=(vx[vrows], vy[vrows]), templates=d["templates"], views=d["views"][:, rows], seed=1)
    assert 100 * float((clf.logits(sx).argmax(1) == sy).double().mean()) == pytest.approx(onfile["top1"], abs=1e-6)
    saved = load_file(str(f_out / "adapter.safetensors"))
    for k, v in clf.adapter.adapter_state_dict().items():
        assert float((v - saved[k]).abs().max()) < 1e-6, k
    assert clf.predict(sx[:3]) == [d["classnames"][i] for i in clf.logits(sx[:3]).argmax(1).tolist()]
    clf.export(tmp_path / "tipf.safetensors")
    back = fewclip.load_prompts(tmp_path / "tipf.safetensors", device="cpu", backbone=clf.backbone)
    assert float((back.logits_from_features(sx) - clf.logits(sx)).abs().max()) < 1e-5


def test_fit_features_on_plain_tensors_in_another_geometry():
    """No file, no backbone: features, labels, names and prototypes in the euclidean geometry."""
    g = torch.Generator().manual_seed(0)
    C, D, n = 4, 16, 12
    centres = 3 * torch.randn(C, D, generator=g)
    y = torch.arange(C).repeat_interleave(n)
    x = centres[y] + torch.randn(len(y), D, generator=g)
    text = centres + 2 * torch.randn(C, D, generator=g)
    names = ["w", "x", "y", "z"]
    zs = fit_features("zeroshot", x[:0], y[:0], names, text, {"name": "euclidean", "params": {"logit_scale": 1.0}})
    lpp = fit_features("lpp", x[::2], y[::2], names, text, "euclidean", val=(x[1::4], y[1::4]))
    test_x, test_y = x[1::2], y[1::2]
    acc = {k: float((c.logits(test_x).argmax(1) == test_y).double().mean()) for k, c in (("zs", zs), ("lpp", lpp))}
    assert acc["lpp"] >= acc["zs"] and acc["lpp"] > 0.9
    with pytest.raises(fewclip.adapters.AdapterError, match="cannot run on image features alone"):
        fit_features("coop", x, y, names, text, "clip")


def test_sweep_report_and_export_on_a_feature_file(colours, tmp_path):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"""sweep:
  datasets: [features]
  methods: [zeroshot, tip_adapter, clip_adapter]
  shots: [2]
  seeds: [1, 2]
  args: [data.path={colours}, train.epochs=2, transductive=transclip]
""")
    out = tmp_path / "runs"
    assert main(["sweep", str(sweep), f"out={out}"]) == 0
    report = (out / "report.md").read_text()
    for m in ("zeroshot", "tip_adapter", "clip_adapter", "tip_adapter+transclip"):
        assert f"| {m} " in report
    run_dir = out / "toy-clip" / "toy-colours" / "tip_adapter" / "2shot" / "seed1"
    assert main(["export", str(run_dir)]) == 0
    clf = fewclip.load_prompts(run_dir / "adapter_export.safetensors", device="cpu")  # the file it names
    (x, y) = read_feature_file(colours).splits["test"]
    top1 = json.loads((run_dir / "metrics.json").read_text())["top1"]
    assert 100 * float((clf.logits_from_features(x).argmax(1) == y).double().mean()) == pytest.approx(top1, abs=1e-6)


FEATURE_METHODS = ["clap", "clip_adapter", "gda", "linear_probe", "lpp", "proker", "taskres", "tip_adapter",
                   "tip_adapter_f", "zs_probe"]


def test_the_methods_that_run_on_features_are_the_cached_feature_methods(colours):
    from fewclip.features.feature_file import dataset_backbone
    from fewclip.training.on_features import feature_methods

    bb = dataset_backbone(build_dataset(DataConfig(name="features", path=str(colours))))
    assert feature_methods(bb) == sorted(FEATURE_METHODS + ["zeroshot"])


@pytest.mark.parametrize("method", FEATURE_METHODS)
def test_every_feature_method_trains_on_a_file_and_its_export_scores_the_file(colours, tmp_path, method):
    out, m = run(tmp_path, method, f"adapter={method}", "data=features", f"data.path={colours}", "shots=1",
                 "train.epochs=2")
    assert main(["export", str(out)]) == 0
    clf = fewclip.load_prompts(out / "adapter_export.safetensors", device="cpu")
    x, y = read_feature_file(colours).splits["test"]
    assert 100 * float((clf.logits_from_features(x).argmax(1) == y).double().mean()) == pytest.approx(m["top1"],
                                                                                                        abs=1e-6)


def test_a_file_without_text_features_builds_them_with_the_backbone_it_names(colours, tmp_path):
    """Only image features, labels and names: the metadata's backbone builds the text features and geometry."""
    ff = read_feature_file(colours)
    bare = write_feature_file(tmp_path / "bare.safetensors", train=ff.splits["train"], val=ff.splits["val"],
                              test=ff.splits["test"], classnames=ff.classnames, templates=ff.templates, text=None,
                              geometry=None, dataset="toy-colours", backbone={"name": "toy-clip"})
    out = {}
    for name, path in (("full", colours), ("bare", bare)):
        assert main(["zeroshot", "data=features", f"data.path={path}", f"out={tmp_path / name}"]) == 0
        out[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    assert out["bare"]["top1"] == out["full"]["top1"] and out["bare"]["geometry"] == "clip"
