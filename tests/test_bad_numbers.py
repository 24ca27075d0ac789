"""No bad number ends with exit code 0: non-finite training, negative seeds, clipped 16-bit images,
one-class and duplicate-name tasks are refused or fixed."""
import json
import random

import numpy as np
import pytest
import torch
from PIL import Image

import fewclip.training.evals
from fewclip.adapter.base import Adapter
from fewclip.adapter.exports import load_image
from fewclip.cli.main import main
from fewclip.config.compose import ConfigError, load_config
from fewclip.data.base import to_rgb
from fewclip.datasets import DataConfig, Dataset, DatasetError, build_dataset, check_classnames, sample_few_shot
from fewclip.training.engine import TrainConfig

TRAIN = ["train", "data=toy-shapes", "shots=1", "seed=1", "train.epochs=1", "train.augment_views=1",
         "data.max_test=8", "backbone.device=cpu"]


# ---------------------------------------------------------------- non-finite training


def test_non_finite_hyperparameters_are_refused():
    for key in ("lr", "momentum", "weight_decay", "warmup_lr"):
        with pytest.raises(ValueError, match=f"train.{key} must be a finite number"):
            TrainConfig(**{key: float("nan")})
    with pytest.raises(ValueError, match="train.lr must be a finite number, got inf"):
        TrainConfig(lr=float("inf"))


def test_diverged_training_stops_and_records_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TRAIN, "adapter=coop", "adapter.n_ctx=2", "train.epochs=3", "train.lr=1e30", f"out={out}"]) == 1
    err = capsys.readouterr().err
    assert "the training loss became nan at step 3 (epoch 3) of coop" in err  # step 1-2: the warm-up lr
    assert not (out / "metrics.json").exists() and not (out / "adapter.safetensors").exists()


def test_non_finite_metrics_or_adapter_tensors_are_never_recorded(tmp_path, capsys, monkeypatch):
    real_evaluate = fewclip.training.evals.evaluate

    def nan_top1(*args, **kwargs):
        return {**real_evaluate(*args, **kwargs), "top1": float("nan")}

    monkeypatch.setattr(fewclip.training.evals, "evaluate", nan_top1)
    out = tmp_path / "metric"
    assert main([*TRAIN, "adapter=linear_probe", f"out={out}"]) == 1
    assert "metric top1 = nan is not a finite number" in capsys.readouterr().err
    assert not (out / "metrics.json").exists()
    monkeypatch.setattr(fewclip.training.evals, "evaluate", real_evaluate)

    real_sd = Adapter.adapter_state_dict

    def nan_weights(self):
        return {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in real_sd(self).items()}

    monkeypatch.setattr(Adapter, "adapter_state_dict", nan_weights)
    out = tmp_path / "tensor"
    assert main([*TRAIN, "adapter=linear_probe", f"out={out}"]) == 1
    assert "non-finite value(s); the run is not recorded as finished" in capsys.readouterr().err
    assert not (out / "metrics.json").exists()


# ---------------------------------------------------------------- seeds


def test_negative_seeds_are_refused():
    with pytest.raises(ConfigError, match=r"seed must be >= 0, got -1 \(Python's random.Random would silently use "
                                          r"seed 1\)"):
        load_config(["seed=-1"])
    assert random.Random(-1).random() == random.Random(1).random()  # why: Python's Random takes abs()
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        sample_few_shot([0, 0, 1, 1], 1, -1)
    assert sample_few_shot([0, 0, 1, 1], 1, 0) == sample_few_shot([0, 0, 1, 1], 1, 0)  # 0 is a seed like any other


# ---------------------------------------------------------------- 16-bit images


def test_16_bit_png_is_scaled_not_clipped(tmp_path):
    ramp = (np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)  # 0 .. 65520
    path = tmp_path / "ramp16.png"
    Image.fromarray(ramp).save(path)
    with Image.open(path) as im:
        assert im.mode.startswith("I")
        assert np.asarray(im.convert("RGB")).mean() > 250  # what PIL alone does: nearly all white
    want = np.rint(ramp / 257.0).astype(np.uint8)
    ds = Dataset("sixteen", ["a", "b"], ["{}"], root=tmp_path)
    from fewclip.datasets import Item

    for rgb in (ds.load_image(Item("ramp16.png", 0)), load_image(path)):
        a = np.asarray(rgb)
        assert rgb.mode == "RGB" and (a[..., 0] == want).all() and (a[..., 0] == a[..., 2]).all()
    # 8-bit images are untouched
    Image.fromarray((ramp // 257).astype(np.uint8)).save(tmp_path / "ramp8.png")
    with Image.open(tmp_path / "ramp8.png") as im:
        assert np.array_equal(np.asarray(to_rgb(im)), np.asarray(im.convert("RGB")))


# ---------------------------------------------------------------- class names


@pytest.mark.parametrize("names, message", [
    ("abc", "got the string 'abc' \\(it would be split into characters\\); pass \\['abc'\\]"),
    (["cat"], "1 class \\('cat'\\); classifying needs at least 2 classes"),
    ([], "0 class"),
    (["cat", ""], "non-empty strings"),
    (["cat", 3], "non-empty strings"),
])
def test_class_names_are_checked(names, message):
    with pytest.raises(DatasetError, match=message):
        check_classnames(names, "test")
    with pytest.raises(DatasetError, match=message):
        Dataset("test", names, ["a photo of a {}."])


def test_folder_dataset_with_one_class_or_twin_folders(tmp_path):
    for c in ("circle", "big_square", "big square"):
        (tmp_path / "two" / c).mkdir(parents=True)
    (tmp_path / "one" / "circle").mkdir(parents=True)
    for d in ("two", "one"):
        for c in (tmp_path / d).iterdir():
            for i in range(3):
                Image.new("RGB", (8, 8)).save(c / f"{i}.png")
    twins = build_dataset(DataConfig(name="folder", root=str(tmp_path / "two")))  # one prompt, two classes
    assert twins.classnames == ["big square", "big square", "circle"]
    with pytest.raises(DatasetError, match="at least 2 classes"):
        build_dataset(DataConfig(name="folder", root=str(tmp_path / "one")))


def test_split_files_record_a_checked_task(tmp_path):
    ds = build_dataset(DataConfig(name="toy-shapes"))
    assert ds.classnames == check_classnames(ds.classnames) and len(ds.classnames) == 8
    bad = {"train": [["a/1.png", 0, "a"]], "val": [], "test": [["a/2.png", 0, "a"]]}
    (tmp_path / "a").mkdir()
    for n in ("1", "2"):
        Image.new("RGB", (8, 8)).save(tmp_path / "a" / f"{n}.png")
    (tmp_path / "split.json").write_text(json.dumps(bad))
    with pytest.raises(DatasetError, match="at least 2 classes"):
        build_dataset(DataConfig(name="folder", root=str(tmp_path), split_file=str(tmp_path / "split.json")))
