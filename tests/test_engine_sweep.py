"""The training engine and the run/sweep machinery: schedule, config checks, run directories,
determinism, resumable sweeps, and no half-written results."""
import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fewclip.runs
from fewclip.cli import main
from fewclip.config import ConfigError
from fewclip.engine import COOP_EPOCHS, TrainConfig, cosine_lr, epochs_for
from fewclip.runs import load_sweep_config, plan_sweep

TRAIN = ["train", "adapter=coop", "data=toy-shapes", "shots=1", "seed=1", "train.epochs=3", "adapter.n_ctx=4",
         "data.max_test=40"]


def read(path):
    return json.loads(Path(path).read_text())


def leftovers(folder: Path):
    """Temporary files of interrupted atomic writes (hidden ``.name.XXXX.tmp`` files included)."""
    return [p for p in folder.rglob("*") if p.name.endswith(".tmp")]


# ---------------------------------------------------------------- schedule


def test_cosine_lr_by_hand():
    lr = [cosine_lr(step, total=10, warmup=2, base=0.002, warmup_lr=1e-5) for step in range(11)]
    assert lr[0] == lr[1] == 1e-5  # constant warm-up
    assert lr[2] == pytest.approx(0.002)  # cosine starts at the base lr right after warm-up
    assert lr[4] == pytest.approx(0.001 * (1 + math.cos(math.pi / 4)))  # 2 of 8 steps: 0.0017071
    assert lr[6] == pytest.approx(0.001)  # half-way
    assert lr[8] == pytest.approx(0.001 * (1 - math.cos(math.pi / 4)))  # 0.0002929
    assert lr[10] == pytest.approx(0.0, abs=1e-12)  # ends at 0
    assert all(a >= b for a, b in zip(lr[2:], lr[3:]))  # decreasing after warm-up
    assert cosine_lr(0, total=4, warmup=0, base=0.1, warmup_lr=1e-5) == pytest.approx(0.1)  # no warm-up
    last = cosine_lr(3, total=4, warmup=0, base=0.1, warmup_lr=1e-5)
    assert last == pytest.approx(0.05 * (1 - math.cos(math.pi / 4)))  # the last step of 4: 0.0146


def test_epochs_follow_coop():
    cfg = TrainConfig()
    assert COOP_EPOCHS == {1: 50, 2: 100, 4: 100, 8: 200, 16: 200}
    assert [epochs_for(cfg, k) for k in (1, 2, 4, 8, 16)] == [50, 100, 100, 200, 200]
    assert [epochs_for(cfg, k) for k in (3, 5, 32)] == [100, 200, 200]  # between and beyond: the next setting up
    assert epochs_for(TrainConfig(epochs=7), 16) == 7  # an explicit value wins


@pytest.mark.parametrize("kwargs, field", [
    (dict(optimizer="adam"), "train.optimizer"),
    (dict(select="best"), "train.select"),
    (dict(amp="fp8"), "train.amp"),
    (dict(augment_views=-1), "train.augment_views"),
    (dict(batch_size=0), "train.batch_size"),
    (dict(epochs=0), "train.epochs"),
    (dict(lr=0.0), "train.lr"),
    (dict(crop_scale_min=1.5), "train.crop_scale_min"),
])
def test_train_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**kwargs)


@pytest.mark.parametrize("arg, key", [
    ("train.select=best", "train.select"),
    ("train.epoch=3", "train.epoch"),
    ("train.epochs=three", "train.epochs"),
    ("adapter.n_ctxx=4", "adapter.n_ctxx"),
])
def test_cli_train_config_errors_exit_2_naming_the_key(arg, key, tmp_path, capsys):
    assert main([*TRAIN, arg, f"out={tmp_path / 'run'}"]) == 2
    assert key in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- one run


def test_train_writes_a_complete_run_directory_deterministically(tmp_path):
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert main([*TRAIN, f"out={out}"]) == 0
        runs.append(out)
    a, b = runs
    assert sorted(p.name for p in a.iterdir()) == ["adapter.safetensors", "config.yaml", "metrics.json", "split.json"]
    assert not leftovers(a)
    m = read(a / "metrics.json")
    for key in ("top1", "per_class", "n_test", "train_time_s", "method", "shots", "seed"):
        assert key in m, key
    assert (m["method"], m["shots"], m["seed"], m["n_test"], m["epochs"]) == ("coop", 1, 1, 40, 3)
    assert 0 <= m["top1"] <= 100 and len(m["per_class"]) == 8
    assert len(m["loss_curve"]) == 3 and all(math.isfinite(x) for x in m["loss_curve"])
    assert m["trainable_parameters"] == 4 * 64  # n_ctx x width of toy-clip
    split = read(a / "split.json")
    assert len(split["train"]) == 8  # one image per class
    cfg = (a / "config.yaml").read_text()
    assert "n_ctx: 4" in cfg and "epochs: 3" in cfg and "max_test: 40" in cfg
    ctx_a, ctx_b = load_file(str(a / "adapter.safetensors")), load_file(str(b / "adapter.safetensors"))
    assert list(ctx_a) == ["ctx"] and ctx_a["ctx"].shape == (4, 64)
    # CPU determinism: the same command gives the same context, curve and accuracy.
    assert torch.equal(ctx_a["ctx"], ctx_b["ctx"])
    mb = read(b / "metrics.json")
    assert (mb["top1"], mb["loss_curve"], mb["per_class"]) == (m["top1"], m["loss_curve"], m["per_class"])
    assert read(b / "split.json") == split


def test_faithful_mode_and_validation_selection(tmp_path):
    out = tmp_path / "faithful"
    assert main([*TRAIN, "train.epochs=2", "train.augment_views=0", f"out={out}"]) == 0
    m = read(out / "metrics.json")
    assert 0 <= m["top1"] <= 100 and m["n_test"] == 40 and len(m["loss_curve"]) == 2
    out = tmp_path / "select"
    assert main([*TRAIN, "train.select=val", f"out={out}"]) == 0
    m = read(out / "metrics.json")
    assert 1 <= m["selected_epoch"] <= 3 and 0 <= m["selected_val_top1"] <= 100


def test_interrupted_run_leaves_no_metrics(tmp_path, monkeypatch, capsys):
    calls = []

    def broken(*args, **kwargs):  # the test evaluation, after training has finished
        calls.append(1)
        raise RuntimeError("power cut")

    monkeypatch.setattr(fewclip.runs, "evaluate", broken)
    out = tmp_path / "run"
    assert main([*TRAIN, f"out={out}"]) == 1  # an unexpected error: one message, no trace
    err = capsys.readouterr().err
    assert "unexpected RuntimeError: power cut" in err and "Traceback" not in err
    assert calls and not (out / "metrics.json").exists() and not (out / "adapter.safetensors").exists()
    assert not leftovers(out)
    assert main([*TRAIN, f"out={out}", "--debug"]) == 1  # --debug shows where
    assert "Traceback" in capsys.readouterr().err

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(fewclip.runs, "evaluate", interrupt)
    assert main([*TRAIN, f"out={out}"]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert not (out / "metrics.json").exists() and not leftovers(out)


# ---------------------------------------------------------------- sweeps


SWEEP = """\
sweep:
  backbones: [toy-clip]
  datasets: [toy-shapes]
  methods: [zeroshot, coop, linear_probe]
  shots: [1]
  seeds: [1, 2]
  args: [train.epochs=2, data.max_test=40]
  variants:
    coop: [adapter=coop, adapter.n_ctx=4]
"""


def test_sweep_config_takes_variant_labels_and_zeroshot_skips_training_keys(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(SWEEP + "  backbone_args:\n    toy-clip: [backbone.device=cpu]\n")
    cfg = load_sweep_config([str(spec), "sweep.seeds=[3]"])
    assert cfg.sweep.variants == {"coop": ["adapter=coop", "adapter.n_ctx=4"]} and cfg.sweep.seeds == [3]
    runs = {r["dir"].as_posix(): r["args"] for r in plan_sweep(cfg.sweep)}
    assert runs["toy-clip/toy-shapes/zeroshot"] == ["backbone=toy-clip", "data=toy-shapes", "backbone.device=cpu",
                                                    "data.max_test=40"]
    assert runs["toy-clip/toy-shapes/coop/1shot/seed3"] == [
        "backbone=toy-clip", "data=toy-shapes", "backbone.device=cpu", "train.epochs=2", "data.max_test=40",
        "adapter=coop", "adapter.n_ctx=4", "shots=1", "seed=3"]
    assert runs["toy-clip/toy-shapes/linear_probe/1shot/seed3"][-3:] == ["adapter=linear_probe", "shots=1", "seed=3"]
    spec.write_text(SWEEP.replace("  shots:", "  shot:"))
    with pytest.raises(ConfigError, match="sweep.shot"):  # the rest of the sweep section stays strict
        load_sweep_config([str(spec)])
    spec.write_text(SWEEP.replace("[adapter=coop, adapter.n_ctx=4]", "4"))
    with pytest.raises(ConfigError, match="sweep.variants.coop"):  # and variant values stay typed
        load_sweep_config([str(spec)])


def finished(out: Path):
    return {p.parent.relative_to(out).as_posix(): p.stat().st_mtime_ns for p in out.rglob("metrics.json")}


def test_sweep_runs_reports_skips_finished_runs_and_resumes(tmp_path, capsys):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(SWEEP)
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), f"out={out}"]) == 0
    assert "sweep: 5 runs, 0 already done, 5 ran" in capsys.readouterr().out
    runs = finished(out)
    expected = {"toy-clip/toy-shapes/zeroshot"} | {f"toy-clip/toy-shapes/{m}/1shot/seed{s}"
                                                   for m in ("coop", "linear_probe") for s in (1, 2)}
    assert set(runs) == expected
    for run in expected:
        m = read(out / run / "metrics.json")
        assert m["n_test"] == 40  # every method is tested on the same images
        if "coop" in run:
            assert m["epochs"] == 2 and load_file(str(out / run / "adapter.safetensors"))["ctx"].shape[0] == 4
    for name in ("report.md", "report.csv", "report.json", "accuracy_vs_shots.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    report = read(out / "report.json")
    assert "coop" in json.dumps(report) and "linear_probe" in json.dumps(report)
    assert not leftovers(out)

    # Again: nothing re-runs.
    assert main(["sweep", str(spec), f"out={out}"]) == 0
    assert "sweep: 5 runs, 5 already done, 0 ran" in capsys.readouterr().out
    assert finished(out) == runs

    # One result lost: only that run runs again.
    lost = "toy-clip/toy-shapes/coop/1shot/seed2"
    (out / lost / "metrics.json").unlink()
    assert main(["sweep", str(spec), f"out={out}"]) == 0
    assert "sweep: 5 runs, 4 already done, 1 ran" in capsys.readouterr().out
    again = finished(out)
    assert set(again) == expected and again[lost] != runs[lost]
    assert {k: v for k, v in again.items() if k != lost} == {k: v for k, v in runs.items() if k != lost}


@pytest.mark.parametrize("edit, key", [
    (lambda s: s.replace("train.epochs=2", "train.epochz=2"), "train.epochz"),
    (lambda s: s.replace("adapter.n_ctx=4]", "adapter.n_ctxx=4]"), "adapter.n_ctxx"),
    # adapter.n_ctx for every method: linear_probe has no such key
    (lambda s: s.replace("data.max_test=40]", "data.max_test=40, adapter.n_ctx=4]"), "adapter.n_ctx"),
], ids=["args", "variant", "key-of-another-adapter"])
def test_sweep_typo_fails_before_any_run(edit, key, tmp_path, capsys):
    spec = tmp_path / "typo.yaml"
    spec.write_text(edit(SWEEP))
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), f"out={out}"]) == 2
    err = capsys.readouterr().err
    assert key in err and "sweep run" in err
    assert not finished(out) and not (out / "toy-clip").exists()  # no run started
