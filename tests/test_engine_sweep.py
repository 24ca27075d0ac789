"""The training engine and the run/sweep machinery: schedule, config checks, run directories,
determinism, resumable sweeps, and no half-written results."""
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fewclip.runs.sweep
import fewclip.training.evals
from fewclip.cli.main import main
from fewclip.config.compose import ConfigError
from fewclip.runs.run import load_train_config
from fewclip.runs.sweep import load_sweep_config, plan_sweep
from fewclip.training.engine import COOP_EPOCHS, TrainConfig, cosine_lr, epochs_for

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
    (dict(optimizer="lion"), "train.optimizer"),
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

    monkeypatch.setattr(fewclip.training.evals, "evaluate", broken)
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

    monkeypatch.setattr(fewclip.training.evals, "evaluate", interrupt)
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


def test_sweep_config_takes_variant_labels_and_zeroshot_runs_once_at_zero_shots(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(SWEEP + "  backbone_args:\n    toy-clip: [backbone.device=cpu]\n")
    cfg = load_sweep_config([str(spec), "sweep.seeds=[3]"])
    assert cfg.sweep.variants == {"coop": ["adapter=coop", "adapter.n_ctx=4"]} and cfg.sweep.seeds == [3]
    plan = plan_sweep(cfg.sweep)
    runs = {r["dir"].as_posix(): r["args"] for r in plan}
    # zeroshot is an adapter that trains on nothing: one run per backbone and dataset, at 0 shots; the
    # sweep's training keys parse for it too (it ignores them)
    assert [r["dir"].as_posix() for r in plan if r["method"] == "zeroshot"] == ["toy-clip/toy-shapes/zeroshot"]
    zs = runs["toy-clip/toy-shapes/zeroshot"]
    assert zs == ["backbone=toy-clip", "data=toy-shapes", "backbone.device=cpu", "train.epochs=2", "data.max_test=40",
                  "adapter=zeroshot", "shots=0"]
    zs_cfg = load_train_config(zs)
    assert (zs_cfg.adapter.name, zs_cfg.shots, zs_cfg.data.max_test) == ("zeroshot", 0, 40)
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


# ---------------------------------------------------------------- the feature pipeline


def test_crop_box_draws_what_torchvision_draws():
    """Our RandomResizedCrop box from a generator equals torchvision's from the global RNG with the same seed."""
    from PIL import Image
    from torchvision.transforms import RandomResizedCrop

    from fewclip.features.encode import crop_box

    image = Image.new("RGB", (40, 30))
    for seed in range(20):
        for scale in ((0.08, 1.0), (0.9, 1.0)):
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                want = RandomResizedCrop.get_params(image, list(scale), [3 / 4, 4 / 3])
            assert crop_box(30, 40, scale, (3 / 4, 4 / 3), torch.Generator().manual_seed(seed)) == want


def test_a_view_is_a_function_of_seed_index_and_image(shapes):
    from fewclip.backbones.backbone import BackboneConfig, load_backbone
    from fewclip.features.encode import Augment, View

    bb = load_backbone(BackboneConfig(name="toy-clip", device="cpu"))
    aug = Augment.for_run(bb, shapes)
    assert (aug.scale_min, aug.hflip, aug.size) == (shapes.min_crop_scale, shapes.hflip_ok, bb.image_size)
    a, b = shapes.items("train")[:2]
    img_a, img_b = shapes.load_image(a), shapes.load_image(b)
    state = torch.random.get_rng_state()
    first = View(aug, 1, 0)(img_a, a)
    View(aug, 1, 0)(img_b, b)  # asking for another image in between changes nothing
    assert torch.equal(View(aug, 1, 0)(img_a, a), first)
    assert not torch.equal(View(aug, 1, 1)(img_a, a), first)  # another view
    assert not torch.equal(View(aug, 2, 0)(img_a, a), first)  # another run seed
    assert torch.equal(torch.random.get_rng_state(), state)  # torch's global RNG untouched


def test_faithful_mode_sees_the_pixels_of_the_cached_views(tmp_path):
    """Fresh augmentation every step (augment_views=0) and K >= epochs cached views train on the same pixels:
    the same loss curve and context, up to the rounding of encoding images in other batches."""
    outs = {}
    for views in (0, 3):
        out = tmp_path / f"views{views}"
        assert main([*TRAIN, "train.epochs=3", f"train.augment_views={views}", f"out={out}"]) == 0
        outs[views] = (read(out / "metrics.json"), load_file(str(out / "adapter.safetensors"))["ctx"])
    (fresh, ctx_fresh), (cached, ctx_cached) = outs[0], outs[3]
    assert fresh["loss_curve"] == pytest.approx(cached["loss_curve"], rel=1e-5, abs=1e-6)
    torch.testing.assert_close(ctx_fresh, ctx_cached, rtol=1e-4, atol=1e-6)
    # faithful: every step encodes its batch (3 epochs of the 8 images); cached: 3 views once; and the test
    # images (no validation images: train.select=last does not look at them)
    assert fresh["images_encoded"] == cached["images_encoded"] == 3 * 8 + 40


def test_unaugmented_training_and_cost_record(tmp_path):
    out = tmp_path / "plain"
    assert main([*TRAIN, "train.augment=false", f"out={out}"]) == 0
    m = read(out / "metrics.json")
    assert m["images_encoded"] == 8 + 40 and m["images_encoded_shared"] == 0  # plain train images, test
    for key in ("wall_time_s", "train_time_s", "peak_rss_mib", "trainable_parameters"):
        assert isinstance(m[key], (int, float)) and m[key] > 0, key
    assert m["peak_cuda_mib"] is None and m["wall_time_s"] >= m["train_time_s"]
    assert isinstance(m["peak_rss_reset"], bool)


def test_a_run_leaves_the_global_rng_alone(tmp_path, shapes):
    """Library code never reseeds torch's global RNG: CoOp's init and LoRA's init and dropout draw from the run's
    generator (LoRA's through a fork of the global RNG), and the run is still deterministic."""
    from fewclip.backbones.backbone import load_backbone
    from fewclip.runs.run import run_train

    backbone = None
    metrics = []
    for i, args in enumerate([TRAIN[1:], TRAIN[1:],
                              ["adapter=lora", "data=toy-shapes", "shots=1", "train.iterations=2", "data.max_test=8",
                               "adapter.towers=vision", "train.select=val"]]):
        cfg = load_train_config([*args, "backbone.device=cpu"])
        backbone = backbone or load_backbone(cfg.backbone)  # (open_clip draws its init from the global RNG)
        torch.manual_seed(1234)
        state = torch.random.get_rng_state()
        metrics.append(run_train(cfg, tmp_path / str(i), backbone=backbone, dataset=shapes))
        assert torch.equal(torch.random.get_rng_state(), state)
    assert metrics[0]["loss_curve"] == metrics[1]["loss_curve"]
    lora = metrics[2]
    assert lora["steps"] == 2 and 0 <= lora["selected_val_top1"] <= 100
    # the adapted image tower re-encodes: 2 steps of 8 images, validation after each of the 2 epochs, the test
    assert lora["images_encoded"] == 2 * 8 + 2 * 8 + 8 and lora["images_encoded_shared"] == 0


def test_make_optimizer():
    from fewclip.training.engine import make_optimizer

    p = [torch.nn.Parameter(torch.zeros(2))]
    sgd = make_optimizer(p, TrainConfig(lr=0.1, momentum=0.8, weight_decay=0.01))
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.8 and sgd.defaults["lr"] == 0.1
    adamw = make_optimizer(p, TrainConfig(optimizer="adamw", lr=1e-3, eps=1e-4, weight_decay=0.0))
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["eps"] == 1e-4  # Tip-Adapter-F's setting
    with pytest.raises(ValueError, match="train.eps"):
        TrainConfig(eps=0.0)


def test_zeroshot_is_an_adapter_and_every_run_scores_the_same_test_subset(tmp_path, shapes):
    """`fewclip zeroshot` is a run of the zeroshot adapter (no split, no tensors); whatever the seed, it scores
    the test subset every run scores (TEST_SUBSET_SEED), with score_zeroshot's numbers."""
    from fewclip.backbones.backbone import BackboneConfig, load_backbone
    from fewclip.data.splits import TEST_SUBSET_SEED, test_items
    from fewclip.runs.run import score_zeroshot

    got = {}
    for seed in (1, 5):
        out = tmp_path / f"zs{seed}"
        assert main(["zeroshot", "data=toy-shapes", "data.max_test=40", f"seed={seed}", "backbone.device=cpu",
                     f"out={out}"]) == 0
        got[seed] = read(out / "metrics.json")
        assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "metrics.json"]
        assert (got[seed]["method"], got[seed]["shots"], got[seed]["trainable_parameters"]) == ("zeroshot", 0, 0)
        assert got[seed]["images_encoded"] == 40 and got[seed]["train_time_s"] == 0
    assert (got[1]["top1"], got[1]["per_class"]) == (got[5]["top1"], got[5]["per_class"])
    bb = load_backbone(BackboneConfig(name="toy-clip", device="cpu"))
    ref = score_zeroshot(bb, shapes, templates="single", max_test=40)  # the default of both
    assert (ref["top1"], ref["per_class"], ref["n_test"]) == (got[1]["top1"], got[1]["per_class"], 40)
    from fewclip.datasets import subsample_test

    assert test_items(shapes, 40) == subsample_test(shapes.items("test"), 40, TEST_SUBSET_SEED)
    assert test_items(shapes, 40) != subsample_test(shapes.items("test"), 40, 5)  # the seed would matter
