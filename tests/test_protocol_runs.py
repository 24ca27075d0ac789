"""The generalisation protocols as runs, sweeps and report tables: each protocol end to end on a small toy run,
what a run directory holds, scoring new classes (for_classnames) or a class subset (restrict_logits) or
refusing to (n/a), run identity over the protocol and every test set, and the report's tables."""
import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fewclip.adapters import AdapterError, build_adapter
from fewclip.adapters.coop import CoOp, CoOpConfig
from fewclip.adapters.lora import LoRA, LoRAConfig
from fewclip.adapters.zeroshot import ZeroShot, ZeroShotConfig
from fewclip.cli.main import main
from fewclip.config.compose import ConfigError
from fewclip.data.protocols import base_new_classes, harmonic_mean, make_plan, read_protocol_split
from fewclip.datasets import DataConfig, build_dataset
from fewclip.features.encode import FeatureCache, text_prototypes
from fewclip.report import build_report
from fewclip.runs.run import RunResources, load_train_config, run_identity_of, run_train
from fewclip.runs.sweep import load_sweep_config, plan_sweep
from fewclip.training.evals import describe_evals, scorer_for
from helpers.cards import CARD_GEOMETRIES, SIGLIP_TEXT, backbone, cards, image_features  # noqa: F401  (cards: fixture)

TOY = ["toy-clip", "toy-euclip", "toy-meru", "toy-siglip"]
FAST = ["shots=2", "seed=1", "train.epochs=2", "train.augment_views=1", "data.templates=single",
        "backbone.device=cpu"]


def read(path):
    return json.loads(Path(path).read_text())


@pytest.fixture(scope="module")
def objects():
    return build_dataset(DataConfig(name="toy-objects"))


@pytest.fixture(scope="module")
def resources():
    """Datasets and plans built once for the module (toy-objects renders 10k images per build)."""
    return RunResources()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, resources):
    """One small run per protocol (and n/a ones): {name: (out dir, what `fewclip train` printed or None)}. The
    first goes through the CLI, the others through run_train with shared datasets."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("protocol_runs")
    commands = {
        "base2new_cli": ["protocol=base2new", "data=toy-shapes", "adapter=coop", "data.max_test=40"],
        "base2new": ["protocol=base2new", "data=toy-objects", "adapter=coop", "data.max_test=64"],
        "base2new_probe": ["protocol=base2new", "data=toy-objects", "adapter=linear_probe", "data.max_test=64"],
        "base2new_gda": ["protocol=base2new", "data=toy-objects", "adapter=gda", "data.max_test=64"],
        "cross": ["protocol=cross_dataset", "data=toy-objects", "adapter=coop", "targets=[toy-shapes,toy-colours]",
                  "data.max_test=40"],
        "shift": ["protocol=domain_shift", "data=toy-shapes", "adapter=coop", "data.max_test=40"],
        "shift_probe": ["protocol=domain_shift", "data=toy-shapes", "adapter=linear_probe", "data.max_test=40"],
        "fewshot": ["data=toy-shapes", "adapter=coop", "data.max_test=40"],
    }
    out = {}
    cache = FeatureCache()
    for name, args in commands.items():
        if name == "base2new_cli":
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert main(["train", *args, *FAST, f"out={root / name}"]) == 0, name
            out[name] = (root / name, buf.getvalue())
            continue
        cfg = load_train_config([*args, *FAST])
        bb, plan = resources(cfg)
        run_train(cfg, root / name, backbone=bb, plan=plan, cache=cache)
        out[name] = (root / name, None)
    return out


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("args, message", [
    (["protocol=bogus"], "protocol must be one of fewshot, base2new, cross_dataset, domain_shift"),
    (["targets=[toy-sketch]"], "apply to protocol=cross_dataset or domain_shift only"),
    (["protocol=base2new", "targets=[toy-sketch]"], "apply to protocol=cross_dataset or domain_shift only"),
    (["protocol=cross_dataset", "data=toy-patterns"], "no default cross_dataset targets for 'toy-patterns'"),
    (["protocol=domain_shift", "data=toy-shapes", "targets=[toy-shapes]"], "must be distinct and differ"),
])
def test_protocol_config_errors_name_the_key(args, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(["adapter=coop", *args])


def test_targets_default_to_the_protocols_and_are_written_in_the_config():
    cfg = load_train_config(["adapter=coop", "protocol=domain_shift", "data=toy-shapes"])
    assert cfg.targets == ["toy-sketch", "toy-shapes-outline", "toy-shapes-faded"]
    cfg = load_train_config(["adapter=coop", "protocol=cross_dataset", "data=toy-objects", "targets=[toy-colours]"])
    assert cfg.targets == ["toy-colours"]


def test_a_target_without_the_sources_classes_is_one_message(tmp_path, capsys):
    assert main(["train", "protocol=domain_shift", "data=toy-shapes", "targets=[toy-colours]", "adapter=coop",
                 *FAST, f"out={tmp_path / 'bad'}"]) == 2
    err = capsys.readouterr().err
    assert "'toy-colours' has 8 class name(s) that 'toy-shapes' lacks" in err and "Traceback" not in err


# ---------------------------------------------------------------- runs end to end


def test_base2new_run_trains_on_base_and_scores_both_halves(runs, objects):
    out, _ = runs["base2new"]
    m = read(out / "metrics.json")
    assert m["protocol"] == "base2new" and m["dataset"] == "toy-objects" and m["shots"] == 2
    base, new = m["evals"]["base"], m["evals"]["new"]
    assert (base["view"], new["view"]) == ("toy-objects[base]", "toy-objects[new]")
    assert (base["scored_by"], new["scored_by"]) == ("adapter", "for_classnames")
    assert base["n_classes"] == new["n_classes"] == 32 and base["n_test"] == new["n_test"] == 64
    assert m["top1"] == base["top1"] and m["n_test"] == 64  # top1: the training classes
    assert m["hm"] == pytest.approx(harmonic_mean(base["top1"], new["top1"]), abs=1e-4)
    b, n = base_new_classes(64)
    assert set(new["per_class"]) == {objects.classnames[c] for c in n}
    # the split is of the base classes only, and protocol.json holds the plan with it
    split = read(out / "split.json")
    assert split["classnames"] == [objects.classnames[c] for c in b] and split["dataset"] == "toy-objects[base]"
    assert {label for _, label in split["train"]} == set(range(32))
    record = read_protocol_split(out / "protocol.json")
    assert record["base2new"]["base"] == b and record["base2new"]["new"] == n
    assert record["train"]["split"] == split
    assert [e["name"] for e in record["evals"]] == ["base", "new"] and record["evals"][1]["class_map"] is None
    assert "protocol.json" in m["run_record"]["files"]  # vouched for by the finished-run record


def test_fewclip_train_prints_base_new_and_h(runs):
    out, printed = runs["base2new_cli"]
    m = read(out / "metrics.json")
    b, n = m["evals"]["base"]["top1"], m["evals"]["new"]["top1"]
    assert m["evals"]["base"]["n_classes"] == m["evals"]["new"]["n_classes"] == 4  # toy-shapes: 8 classes
    assert (f"coop 2-shot seed 1, base2new on toy-shapes: base {b:.2f}%, new {n:.2f}%, "
            f"H {harmonic_mean(b, n):.2f}% (40 + 40 test images)") in printed


def test_cross_dataset_run_scores_each_target_with_its_own_names(runs):
    out, _ = runs["cross"]
    m = read(out / "metrics.json")
    assert list(m["evals"]) == ["source", "toy-shapes", "toy-colours"]
    assert m["evals"]["source"]["n_classes"] == 64 and m["evals"]["toy-colours"]["n_classes"] == 8
    assert m["evals"]["toy-shapes"]["scored_by"] == "for_classnames"
    assert "toy-colours" in m["evals"]["toy-colours"]["view"]
    assert describe_evals("cross_dataset", m["evals"]).endswith(
        f"average over targets {(m['evals']['toy-shapes']['top1'] + m['evals']['toy-colours']['top1']) / 2:.2f}%")
    assert read(out / "protocol.json")["protocol"] == "cross_dataset"


def test_domain_shift_run_with_a_subset_target(runs):
    out, _ = runs["shift"]
    m = read(out / "metrics.json")
    assert list(m["evals"]) == ["source", "toy-sketch", "toy-shapes-outline", "toy-shapes-faded"]
    # same class names and templates as the source: the adapter itself; the 4-class subset: rebuilt on its names
    assert m["evals"]["toy-sketch"]["scored_by"] == "adapter"
    assert m["evals"]["toy-shapes-outline"]["scored_by"] == "for_classnames"
    assert m["evals"]["toy-shapes-outline"]["n_classes"] == 4
    record = read(out / "protocol.json")
    outline = next(e for e in record["evals"] if e["name"] == "toy-shapes-outline")
    assert outline["class_map"] == [0, 2, 4, 6]  # circle, triangle, cross, ring among the 8 shapes


def test_restrict_logits_scores_a_subset_target_with_a_per_class_classifier(runs, shapes):
    """linear_probe has one weight per trained class: the outline target is scored by its logits restricted to
    the target's 4 classes with the class map, which is what this test recomputes from the saved weights."""
    from safetensors.torch import load_file

    from fewclip.backbones.backbone import load_backbone
    from fewclip.data.splits import test_items
    from fewclip.datasets import read_split

    out, _ = runs["shift_probe"]
    m = read(out / "metrics.json")
    assert m["evals"]["toy-shapes-outline"]["scored_by"] == "restrict_logits"
    assert m["evals"]["toy-sketch"]["scored_by"] == "adapter"  # same classes: no restriction needed
    cfg = load_train_config([str(out / "config.yaml")])
    bb = load_backbone(cfg.backbone)
    probe = build_adapter(cfg.adapter, bb, read_split(out / "split.json").classnames, m["templates"])
    probe.load_adapter_state_dict(load_file(str(out / "adapter.safetensors")))
    outline = build_dataset(DataConfig(name="toy-shapes-outline"))
    items = test_items(outline, 40)
    from fewclip.features.encode import extract_features

    feats, labels = extract_features(bb, outline, items)
    with torch.no_grad():
        logits = probe(feats)  # [N, 8]
    assert logits.shape[1] == 8
    pred = logits[:, [0, 2, 4, 6]].argmax(1)
    assert m["evals"]["toy-shapes-outline"]["top1"] == pytest.approx(100.0 * float((pred == labels).float().mean()),
                                                                      abs=1e-3)


def test_a_per_class_classifier_gives_na_for_new_classes_not_a_number(runs):
    out, _ = runs["base2new_probe"]
    m = read(out / "metrics.json")
    new = m["evals"]["new"]
    assert new["top1"] is None and new["scored_by"] is None and "one weight per trained class" in new["reason"]
    assert new["n_test"] == 64 and m["evals"]["base"]["top1"] is not None and "hm" not in m
    assert describe_evals("base2new", m["evals"]).endswith("new n/a, H n/a")


def test_gda_scores_new_classes_from_its_training_points(runs):
    # a training-free per-class classifier that synthesises new classes (the authors' main_base2new.py)
    out, _ = runs["base2new_gda"]
    m = read(out / "metrics.json")
    base, new = m["evals"]["base"], m["evals"]["new"]
    assert (base["scored_by"], new["scored_by"]) == ("adapter", "for_classnames")
    assert 0 <= new["top1"] <= 100 and new["n_test"] == 64 and len(new["per_class"]) == 32
    assert m["hm"] == pytest.approx(harmonic_mean(base["top1"], new["top1"]), abs=1e-4)
    saved = load_file(str(out / "adapter.safetensors"))
    assert saved["train_points"].shape[0] == 32 * 2 * 10  # 32 base classes x 2 shots x GDA's 10 views


def test_csc_coop_refuses_new_names_and_its_new_classes_are_na(tmp_path, objects, resources):
    bb = backbone("toy-clip")
    names = objects.classnames[:4]
    csc = CoOp(CoOpConfig(csc=True, n_ctx=2), bb, names)
    assert not csc.supports_new_classes and CoOp.supports_new_classes
    assert csc.for_classnames(names) is csc
    with pytest.raises(AdapterError, match="class-specific context.*cannot score other class names"):
        csc.for_classnames(objects.classnames[4:8])
    cfg = load_train_config(["protocol=base2new", "data=toy-objects", "adapter=coop", "adapter.csc=true",
                             "adapter.n_ctx=2", "data.max_test=32", *FAST])
    bb, plan = resources(cfg)
    m = run_train(cfg, tmp_path / "csc", backbone=bb, plan=plan)
    assert m["evals"]["new"]["top1"] is None and m["evals"]["base"]["scored_by"] == "adapter"


def test_fewshot_runs_are_what_they_were(runs):
    out, _ = runs["fewshot"]
    m = read(out / "metrics.json")
    assert m["protocol"] == "fewshot" and "evals" not in m and not (out / "protocol.json").exists()
    assert m["n_test"] == 40 and m["dataset"] == "toy-shapes" and read(out / "split.json")["dataset"] == "toy-shapes"


def test_zeroshot_command_takes_a_protocol(tmp_path, capsys):
    out = tmp_path / "zs"
    assert main(["zeroshot", "protocol=domain_shift", "data=toy-shapes", "data.max_test=32", "data.templates=single",
                 f"out={out}"]) == 0
    printed = capsys.readouterr().out
    assert "zero-shot, domain_shift from toy-shapes: source" in printed and "toy-shapes-outline" in printed
    m = read(out / "metrics.json")
    assert m["evals"]["toy-shapes-outline"]["scored_by"] == "for_classnames"
    assert read(out / "protocol.json")["train"]["split"] is None and not (out / "split.json").exists()


# ---------------------------------------------------------------- identity


def test_identity_covers_the_protocol_and_every_test_set(resources):
    bb = backbone("toy-clip")
    res = resources

    def ident(*args):
        cfg = load_train_config(["adapter=zeroshot", "shots=0", "data.max_test=32", *args])
        return run_identity_of(cfg, bb, res.plan(cfg)).digest

    plain = ident("data=toy-objects")
    b2n = ident("data=toy-objects", "protocol=base2new")
    xd = ident("data=toy-objects", "protocol=cross_dataset")
    xd2 = ident("data=toy-objects", "protocol=cross_dataset", "targets=[toy-shapes,toy-sketch]")
    xd3 = ident("data=toy-objects", "protocol=cross_dataset", "targets=[toy-shapes,toy-colours]")
    assert len({plain, b2n, xd, xd2, xd3}) == 5
    assert ident("data=toy-objects", "protocol=cross_dataset", "targets=[toy-shapes,toy-colours]") == xd3
    # a test set's images are part of it: a target's test subset changes with max_test
    cfg = load_train_config(["adapter=zeroshot", "shots=0", "data=toy-objects", "protocol=base2new"])
    a = run_identity_of(cfg, bb, res.plan(cfg))
    cfg.data.max_test = 10
    assert run_identity_of(cfg, bb, res.plan(cfg)).parts["data"] != a.parts["data"]
    # a few-shot run's identity is what it was before protocols existed: no protocol keys in its config part
    cfg = load_train_config(["adapter=zeroshot", "shots=0", "data=toy-shapes"])
    assert "protocol" not in run_identity_of(cfg, bb, res.plan(cfg)).config
    cfg = load_train_config(["adapter=zeroshot", "shots=0", "data=toy-objects", "protocol=base2new"])
    assert run_identity_of(cfg, bb, res.plan(cfg)).config["protocol"] == "base2new"


def test_a_changed_protocol_never_reuses_stale_numbers(runs, tmp_path, capsys):
    out, _ = runs["shift"]
    args = ["train", "protocol=domain_shift", "data=toy-shapes", "adapter=coop", "data.max_test=40", *FAST,
            f"out={out}"]
    assert main(args) == 0  # the same run: kept
    assert "already finished" in capsys.readouterr().err
    # other targets, or another protocol: another identity in a finished directory, refused without overwrite=true
    assert main([*args, "targets=[toy-sketch]"]) == 2
    err = capsys.readouterr().err
    assert "holds the results of another run" in err and "targets: [" in err
    assert main([a for a in args if not a.startswith("protocol=")]) == 2
    assert "protocol: domain_shift -> (unset)" in capsys.readouterr().err


# ---------------------------------------------------------------- for_classnames


@pytest.mark.parametrize("name", TOY + list(CARD_GEOMETRIES) + [SIGLIP_TEXT])
def test_coop_word_init_on_new_names_is_zero_shot_on_those_names(name, cards, objects):
    """Exactness: CoOp built on the base classes from "a photo of a", asked for the new classes, gives the zero-shot
    logits of "a photo of a {}." on the new classes, in every geometry and on the SigLIP-style tower."""
    bb = backbone(name, cards)
    b, n = base_new_classes(len(objects.classnames))
    base_names, new_names = [objects.classnames[c] for c in b[:6]], [objects.classnames[c] for c in n[:5]]
    coop = CoOp(CoOpConfig(ctx_init="a photo of a"), bb, base_names)
    view = coop.for_classnames(new_names, ["ignored {}"])
    assert view is not coop and view.classnames == new_names and not view.training
    feats = image_features(bb)
    expected = bb.geometry.image_logits(feats, text_prototypes(bb, new_names, ["a photo of a {}."]))
    with torch.no_grad():
        torch.testing.assert_close(view(feats), expected, rtol=1e-5, atol=1e-5)


def test_coop_for_classnames_carries_the_learned_context(objects):
    bb = backbone("toy-clip")
    coop = CoOp(CoOpConfig(n_ctx=3), bb, objects.classnames[:4], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        coop.ctx.add_(0.3 * torch.randn(coop.ctx.shape, generator=torch.Generator().manual_seed(2)))
    new = objects.classnames[40:45]
    view = coop.for_classnames(new)
    torch.testing.assert_close(view.ctx, coop.ctx)
    assert view.ctx.data_ptr() != coop.ctx.data_ptr()  # a copy: scoring never changes the trained adapter
    direct = CoOp(CoOpConfig(n_ctx=3), bb, new)
    direct.load_adapter_state_dict(coop.adapter_state_dict())
    feats = image_features(bb)
    with torch.no_grad():
        torch.testing.assert_close(view(feats), direct(feats), rtol=0, atol=0)
        zs = bb.geometry.image_logits(feats, text_prototypes(bb, new, ["a photo of a {}."]))
        assert not torch.allclose(view(feats), zs, atol=1e-3)
    assert coop.for_classnames(objects.classnames[:4]) is coop


def test_lora_for_classnames_is_the_adapted_towers_on_new_names(objects):
    bb = backbone("toy-clip")
    names, new, templates = objects.classnames[:4], objects.classnames[40:43], ["a photo of a {}.", "a {}."]
    lora = LoRA(LoRAConfig(towers="text"), bb, names, templates)
    feats = image_features(bb)
    with torch.no_grad():  # at init (B = 0): zero-shot on the new names
        torch.testing.assert_close(lora.for_classnames(new, templates)(feats),
                                   bb.geometry.image_logits(feats, text_prototypes(bb, new, templates)),
                                   rtol=1e-5, atol=1e-5)
        g = torch.Generator().manual_seed(0)
        for pname, p in lora.named_parameters():
            if pname.endswith("B.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        view = lora.for_classnames(new, templates)
        direct = LoRA(LoRAConfig(towers="text"), bb, new, templates).eval()  # eval: no dropout
        direct.load_adapter_state_dict(lora.adapter_state_dict())
        assert not view.training
        torch.testing.assert_close(view(feats), direct(feats))
        assert not torch.allclose(view(feats), bb.geometry.image_logits(feats, text_prototypes(bb, new, templates)),
                                  atol=1e-3)
    assert lora.for_classnames(names, templates) is lora


def test_zeroshot_for_classnames_uses_the_test_sets_templates(objects):
    bb = backbone("toy-clip")
    zs = ZeroShot(ZeroShotConfig(), bb, objects.classnames[:3], ["a photo of a {}."])
    assert zs.for_classnames(objects.classnames[:3], ["a photo of a {}."]) is zs
    other = zs.for_classnames(objects.classnames[:3], ["a {}."])
    torch.testing.assert_close(other.prototypes, text_prototypes(bb, objects.classnames[:3], ["a {}."]))


def test_scorer_choice_per_test_set(objects):
    """for_classnames where the adapter can score names; the adapter itself for its own classes; restricted logits
    for a subset of its classes; nothing (n/a) for new classes of a per-class classifier."""
    bb = backbone("toy-clip")
    shapes = build_dataset(DataConfig(name="toy-shapes"))
    plan = make_plan("domain_shift", shapes, [build_dataset(DataConfig(name=n)) for n in
                                              ("toy-sketch", "toy-shapes-outline")])
    tpl = ["a photo of a {}."]
    probe = build_adapter(load_train_config(["adapter=zs_probe"]).adapter, bb, shapes.classnames, tpl)
    how = {e.name: scorer_for(probe, e, tpl)[1] for e in plan.evals}
    assert how == {"source": "adapter", "toy-sketch": "adapter", "toy-shapes-outline": "restrict_logits"}
    b2n = make_plan("base2new", objects)
    probe = build_adapter(load_train_config(["adapter=zs_probe"]).adapter, bb, b2n.train.classnames, tpl)
    scorer, scored_by, reason = scorer_for(probe, b2n.eval_set("new"), tpl)
    assert scorer is None and scored_by is None and "cannot score the classes" in reason


# ---------------------------------------------------------------- sweeps


def test_sweep_plans_protocols_under_their_own_folder(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("sweep:\n  protocol: domain_shift\n  backbones: [toy-clip]\n  datasets: [toy-shapes]\n"
                    "  targets:\n    toy-shapes: [toy-sketch, toy-shapes-faded]\n  methods: [zeroshot, coop]\n"
                    "  shots: [2]\n  seeds: [1]\n")
    plan = plan_sweep(load_sweep_config([str(spec)]).sweep)
    assert [r["dir"].as_posix() for r in plan] == ["domain_shift/toy-clip/toy-shapes/zeroshot",
                                                   "domain_shift/toy-clip/toy-shapes/coop/2shot/seed1"]
    cfg = load_train_config(plan[1]["args"])
    assert (cfg.protocol, cfg.targets) == ("domain_shift", ["toy-sketch", "toy-shapes-faded"])
    with pytest.raises(ConfigError, match="not in sweep.datasets"):
        load_sweep_config([str(spec), "sweep.datasets=[toy-objects]"])
    with pytest.raises(ConfigError, match="sweep.targets apply to protocol cross_dataset or domain_shift only"):
        load_sweep_config([str(spec), "sweep.protocol=base2new"])
    with pytest.raises(ConfigError, match="sweep.protocol must be one of"):
        load_sweep_config([str(spec), "sweep.protocol=b2n"])
    spec.write_text(spec.read_text().replace("domain_shift", "fewshot").replace(
        "  targets:\n    toy-shapes: [toy-sketch, toy-shapes-faded]\n", ""))
    plain = plan_sweep(load_sweep_config([str(spec)]).sweep)
    assert plain[1]["dir"].as_posix() == "toy-clip/toy-shapes/coop/2shot/seed1"
    assert not any(a.startswith(("protocol=", "targets=")) for a in plain[1]["args"])


@pytest.mark.parametrize("name", ["base2new", "cross-dataset", "domain-shift"])
def test_shipped_protocol_sweeps_parse(name):
    cfg = load_sweep_config([f"sweep/{name}.yaml"])
    assert cfg.sweep.protocol == name.replace("-", "_")
    assert cfg.sweep.backbones == TOY and cfg.sweep.seeds == [1, 2, 3] and cfg.sweep.shots == [16]
    plan = plan_sweep(cfg.sweep)
    assert {a for r in plan for a in r["args"] if a.startswith("seed=")} == {"seed=1", "seed=2", "seed=3"}
    # every run's config parses: of the runs that differ in their seed only, the first (seed= is any whole number)
    first = {}
    for r in plan:
        first.setdefault(tuple(a for a in r["args"] if not a.startswith("seed=")), r["args"])
    for args in first.values():
        load_train_config(args)


def test_one_out_directory_holds_several_protocols_and_reports_each(tmp_path, capsys):
    out = tmp_path / "sweep"
    common = ["sweep.backbones=[toy-clip]", "sweep.seeds=[1,2]", "sweep.shots=[2]", "report=false",
              "sweep.args=[data.templates=single,train.epochs=2,train.augment_views=1,data.max_test=32]"]
    assert main(["sweep", "sweep/domain-shift.yaml", *common, f"out={out}"]) == 0
    assert main(["sweep", "sweep/base2new.yaml", *common, "sweep.methods=[zeroshot,coop,linear_probe]",
                 "sweep.datasets=[toy-shapes]", f"out={out}"]) == 0
    assert main(["sweep", "sweep/domain-shift.yaml", *common, f"out={out}"]) == 0  # resumes: nothing to run
    assert "sweep: 3 runs, 3 already done, 0 ran" in capsys.readouterr().out
    assert main(["report", str(out)]) == 0
    md = capsys.readouterr().out
    assert "## Base-to-novel generalisation (`base2new`)" in md and "## Domain generalisation (`domain_shift`)" in md
    rows_md = [[c.strip() for c in line.strip().strip("|").split("|")] for line in md.splitlines()
               if line.startswith("| ")]
    assert ["Dataset", "Method", "Shots", "Base", "New", "H"] in rows_md
    assert ["Method", "Shots", "Source: toy-shapes", "toy-sketch", "toy-shapes-outline", "toy-shapes-faded",
            "Average"] in rows_md
    probe_row = next(r for r in rows_md if r[:2] == ["toy-shapes", "linear_probe"])
    assert probe_row[4:] == ["n/a", "n/a"]  # new and H
    rows = list(csv.DictReader((out / "report.csv").open()))
    assert {r["protocol"] for r in rows} == {"base2new", "domain_shift"}
    b2n = {(r["method"], r["eval"]): r for r in rows if r["protocol"] == "base2new"}
    assert set(b2n) == {(m, e) for m in ("zeroshot", "coop", "linear_probe") for e in ("base", "new", "hm")}
    assert b2n[("linear_probe", "new")]["mean"] == "" and b2n[("coop", "new")]["n"] == "2"
    base, new = float(b2n[("coop", "base")]["mean"]), float(b2n[("coop", "new")]["mean"])
    assert float(b2n[("coop", "hm")]["mean"]) == pytest.approx(harmonic_mean(base, new), abs=1e-5)
    assert float(b2n[("coop", "new")]["delta_zeroshot"]) == pytest.approx(
        new - float(b2n[("zeroshot", "new")]["mean"]), abs=1e-5)
    data = read(out / "report.json")["protocols"]
    assert data["base2new"]["toy-clip"]["toy-shapes"]["linear_probe"]["2"]["new"]["na"]
    assert set(data["domain_shift"]["toy-clip"]["toy-shapes"]["coop"]["2"]) == {
        "source", "toy-sketch", "toy-shapes-outline", "toy-shapes-faded", "average"}


# ---------------------------------------------------------------- report tables from metrics


def add(root, protocol, method, dataset, seed, evals, shots=16, backbone="toy-clip"):
    d = root / protocol / backbone / dataset / method / (f"{shots}shot/seed{seed}" if shots else "")
    d.mkdir(parents=True)
    first = next(iter(evals.values()))
    (d / "metrics.json").write_text(json.dumps({
        "protocol": protocol, "method": method, "dataset": dataset, "backbone": backbone, "shots": shots,
        "seed": seed, "top1": first, "evals": {k: {"top1": v} for k, v in evals.items()}}))


def test_base2new_table_h_of_seed_means_average_first(tmp_path):
    for seed, (b, n) in zip((1, 2, 3), ((80.0, 60.0), (90.0, 40.0), (70.0, 50.0))):
        add(tmp_path, "base2new", "coop", "objects", seed, {"base": b, "new": n})
        add(tmp_path, "base2new", "coop", "pets", seed, {"base": 60.0, "new": 70.0 + seed})
    add(tmp_path, "base2new", "zeroshot", "objects", 1, {"base": 70.0, "new": 72.0}, shots=0)
    add(tmp_path, "base2new", "zeroshot", "pets", 1, {"base": 50.0, "new": 60.0}, shots=0)
    report = build_report(tmp_path)
    cell = lambda ds, m, e, k=16: report.protocol_cell("base2new", "toy-clip", ds, m, k, e)  # noqa: E731
    assert cell("objects", "coop", "base").mean == 80.0 and cell("objects", "coop", "new").mean == 50.0
    assert cell("objects", "coop", "hm").mean == pytest.approx(harmonic_mean(80.0, 50.0))  # not the mean of HMs
    assert cell("objects", "coop", "new").delta_zeroshot == pytest.approx(-22.0)
    assert cell("objects", "coop", "base").ci95 == pytest.approx(4.302653 * 10 / 3 ** 0.5, rel=1e-4)
    avg_b, avg_n = (80.0 + 60.0) / 2, (50.0 + 72.0) / 2
    assert cell("average", "coop", "base").mean == pytest.approx(avg_b)
    assert cell("average", "coop", "hm").mean == pytest.approx(harmonic_mean(avg_b, avg_n))
    lines = report.markdown.splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert table[1].startswith("| **average** | zeroshot") and table[2].startswith("| **average** | coop")
    assert f"| {harmonic_mean(80.0, 50.0):.2f} |" in next(line for line in table if "| objects" in line
                                                          and "coop" in line)


def test_transfer_tables_average_over_targets_and_na(tmp_path):
    for seed in (1, 2):
        add(tmp_path, "cross_dataset", "coop", "objects", seed, {"source": 70.0, "shapes": 90.0 + seed,
                                                                 "colours": 50.0})
        add(tmp_path, "cross_dataset", "linear_probe", "objects", seed, {"source": 72.0, "shapes": None,
                                                                         "colours": None})
    report = build_report(tmp_path)
    avg = report.protocol_cell("cross_dataset", "toy-clip", "objects", "coop", 16, "average")
    assert avg.mean == pytest.approx((91.5 + 50.0) / 2) and avg.datasets == ("shapes", "colours")
    na = report.protocol_cell("cross_dataset", "toy-clip", "objects", "linear_probe", 16, "shapes")
    assert na.mean is None and "cannot score" in na.reason
    row = next(line for line in report.markdown.splitlines() if line.startswith("| linear_probe"))
    assert row.split("|")[3].strip().startswith("72.00") and row.count("n/a") == 3
    header = next(line for line in report.markdown.splitlines() if line.startswith("| Method"))
    assert [c.strip() for c in header.strip("|").split("|")] == ["Method", "Shots", "Source: objects", "shapes",
                                                                 "colours", "Average"]
