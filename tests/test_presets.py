"""Presets (fewclip.config.presets): every method's named settings, how a run takes them, and where they show.

The parity tests take the authors' settings from ``preset=authors`` where it sets any field (Tip-Adapter,
Tip-Adapter-F, LP++ and CLAP's ZS-LP (preset=zslp) in test_cache_parity.py; GDA, ProKeR and ProLIP in test_gda_proker_prolip.py); for
every other method with an ``authors`` preset, the test below shows the preset leaves fewclip's defaults as
they are, which are the configs the parity tests run against the authors' numbers.
"""
import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch

from fewclip.adapter.base import ADAPTERS, adapter_info
from fewclip.adapters.clap import Clap, PooledViews
from fewclip.cli.main import main
from fewclip.config.compose import ConfigError
from fewclip.config.presets import (
    FEWCLIP,
    PRESETS,
    Preset,
    PresetError,
    Setting,
    describe_presets,
    get_preset,
    markdown_rows,
    parse_label,
    presets_of,
    register_presets,
)
from fewclip.features.encode import Features
from fewclip.report import write_report
from fewclip.runs.run import load_train_config, preset_defaults, run_train
from fewclip.runs.sweep import SweepSpec, plan_sweep
from fewclip.training.engine import FitData, TrainConfig
from helpers.cache_parity import FeatureBackbone, fixture

PRESETS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "concepts" / "presets.md"
# Methods with the authors' settings in their parity tests, and where those tests are.
PARITY_BY_PRESET = {"tip_adapter": "test_cache_parity", "tip_adapter_f": "test_cache_parity", "clap": "test_cache_parity",
                    "lpp": "test_cache_parity", "gda": "test_gda_proker_prolip", "proker": "test_gda_proker_prolip",
                    "prolip": "test_gda_proker_prolip"}
OWN_METHODS = {"zs_probe"}  # fewclip's own: no authors' code, so no authors preset


def with_preset(name, preset, *args):
    return load_train_config([f"adapter={name}", f"preset={preset}", *args])


@pytest.mark.parametrize("name", ADAPTERS.names())
def test_every_preset_sets_real_fields_to_values_that_differ(name):
    """Each preset's keys are fields of the method's config (or the train section), each value differs from
    fewclip's default and is what a run gets; every method with authors' code has an ``authors`` preset."""
    presets = presets_of(name)
    assert list(presets)[0] == FEWCLIP
    assert ("authors" in presets) == (name not in OWN_METHODS)
    defaults = preset_defaults(adapter_info(name))
    for pname, preset in presets.items():
        cfg = with_preset(name, pname)
        assert cfg.preset == pname
        assert cfg.preset_set == preset.values()
        for s in preset.settings:
            assert s.key in defaults, f"{name} preset {pname}: {s.key} is not a field"
            assert defaults[s.key] != s.value, f"{name} preset {pname}: {s.key} is fewclip's default already"
            section, leaf = s.key.split(".")
            assert getattr(getattr(cfg, section), leaf) == s.value
            assert re.search(r"(@[0-9a-f]{7}|Appendix|Section|§)", s.source), s.source  # a commit or a section
        untouched = {k: v for k, v in defaults.items() if k not in preset.values()}
        got = preset_defaults(adapter_info(name))
        got.update({f"adapter.{f.name}": getattr(cfg.adapter, f.name) for f in dataclasses.fields(cfg.adapter)})
        got.update({f"train.{f.name}": getattr(cfg.train, f.name) for f in dataclasses.fields(cfg.train)})
        assert {k: got[k] for k in untouched} == untouched  # nothing else moves


@pytest.mark.parametrize("name", [n for n in ADAPTERS.names() if n not in OWN_METHODS])
def test_authors_preset_is_what_the_parity_tests_run(name):
    """``preset=authors`` gives the config the method's parity test compares with the authors' numbers: for the
    methods in PARITY_BY_PRESET the parity test builds its config through the preset; for the others the preset
    sets no field, and their parity tests run fewclip's defaults."""
    preset = get_preset(name, "authors")
    plain, authors = load_train_config([f"adapter={name}"]), with_preset(name, "authors")
    if name in PARITY_BY_PRESET:
        assert preset.settings
        source = (Path(__file__).parent / "parity" / f"{PARITY_BY_PRESET[name]}.py").read_text()
        assert f'authors_config("{name}"' in source
    else:
        assert not preset.settings, f"{name}: move its parity test onto the preset (authors_config)"
        assert (authors.adapter, authors.train) == (plain.adapter, plain.train)
    if name == "clap":  # the authors' ZS-LP baseline: CLAP's parity test runs it through preset=zslp
        assert '"zslp"' in (Path(__file__).parent / "parity" / "test_cache_parity.py").read_text()
        assert with_preset("clap", "zslp").adapter.constraint == "none"


def test_explicit_arguments_win_over_the_preset(tmp_path):
    cfg = with_preset("tip_adapter", "authors", "adapter.tie_break=loss")
    assert cfg.adapter.tie_break == "loss" and cfg.preset == "authors" and cfg.preset_set == {}
    cfg = with_preset("taskres", "clap", "train.lr=0.05")  # the other settings of the preset stay
    assert cfg.train.lr == 0.05 and cfg.train.optimizer == "sgd" and cfg.train.epochs == 300
    assert cfg.preset_set == {"train.optimizer": "sgd", "train.weight_decay": 0.0, "train.epochs": 300}
    piece = tmp_path / "piece.yaml"  # a YAML piece is explicit too, and may name the preset itself
    piece.write_text("preset: authors\nadapter:\n  alpha_grad: last\n")
    cfg = load_train_config(["adapter=lpp", str(piece)])
    assert cfg.preset == "authors" and cfg.adapter.alpha_grad == "last" and cfg.adapter.bias_init == "linear"
    assert load_train_config(["adapter=lpp", str(piece), "preset=fewclip"]).adapter.bias_init == "zero"


def test_unknown_preset_is_one_line_listing_the_available(capsys):
    with pytest.raises(PresetError, match=r"unknown preset 'autors' for adapter 'ivlp'; its presets: fewclip, "
                                          r"authors, maple \(`fewclip adapters ivlp`"):
        with_preset("ivlp", "autors")
    assert main(["train", "adapter=zs_probe", "preset=authors"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "its presets: fewclip" in err


def test_choosing_on_test_is_refused_naming_what_the_authors_did(capsys):
    with pytest.raises(PresetError, match=r"train.select=test is refused.*best test accuracy.*main.py:114-141"):
        with_preset("tip_adapter_f", "authors", "train.select=test")
    with pytest.raises(PresetError, match=r"ImageNet's test set.*main_imagenet.py:43"):
        load_train_config(["adapter=tip_adapter", "train.select=test"])  # with or without the preset
    assert main(["train", "adapter=coop", "train.select=test"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "never chooses anything on the test set" in err and "val" in err
    assert "refused (chosen on test by the authors)" in "\n".join(describe_presets("gda", {}))


def test_adapters_name_lists_each_presets_differences_with_sources(capsys):
    assert main(["adapters", "ivlp"]) == 0
    out = capsys.readouterr().out
    assert "preset=authors:" in out and "(no field differs from fewclip's)" in out
    assert re.search(r"adapter\.depth_text: 9 -> 12 +\[muzairkhattak/multimodal-prompt-learning@69bce21 "
                     r"configs/trainers/IVLP/vit_b16_c2_ep5_batch4_2\+2ctx\.yaml:39\]", out)
    assert "train.lr: 0.0025 -> 0.0035" in out
    assert main(["adapters", "taskres"]) == 0
    assert "not expressed: CLAP's epoch of pooled augmented views" in capsys.readouterr().out
    assert main(["adapters"]) == 0
    assert "presets: fewclip, authors, clap (`fewclip adapters taskres`" in capsys.readouterr().out


def test_config_yaml_metrics_and_report_name_the_preset(tmp_path):
    cfg = with_preset("tip_adapter", "authors", "backbone=toy-clip", "backbone.device=cpu", "data=toy-shapes",
                      "data.max_test=40", "shots=1", "adapter.beta_steps=3", "adapter.alpha_steps=3")
    out = tmp_path / "run"
    m = run_train(cfg, out)
    assert m["method"] == "tip_adapter[authors]" and m["preset"] == "authors"
    text = (out / "config.yaml").read_text()
    assert "preset: authors" in text and "adapter.tie_break: first" in text
    assert load_train_config([str(out / "config.yaml")]) == cfg  # the file loads back to the same config
    rep = write_report(out)
    assert "tip_adapter[authors]" in rep.markdown
    assert json.loads((out / "metrics.json").read_text())["method"] == "tip_adapter[authors]"


def test_sweep_cells_carry_presets():
    spec = SweepSpec(datasets=["toy-shapes"], methods=["tip_adapter[authors]", "coop", "ivlp_m"], shots=[1],
                     seeds=[1], variants={"ivlp_m": ["adapter=ivlp", "preset=maple"]})
    runs = {r["method"]: r for r in plan_sweep(spec)}
    assert set(runs) == {"tip_adapter[authors]", "coop", "ivlp_m[maple]"}
    assert "preset=authors" in runs["tip_adapter[authors]"]["args"]
    assert runs["tip_adapter[authors]"]["dir"].parts[2] == "tip_adapter-authors"
    assert load_train_config(runs["ivlp_m[maple]"]["args"]).adapter.depth_text == 12
    every = plan_sweep(SweepSpec(datasets=["toy-shapes"], methods=["zeroshot", "coop", "lpp"], shots=[1], seeds=[1],
                                 args=["preset=authors"]))
    # zero-shot trains nothing: it keeps its name, the baseline the report's gains are measured from
    assert [r["method"] for r in every] == ["zeroshot", "coop[authors]", "lpp[authors]"]
    assert parse_label("lpp[authors]") == ("lpp", "authors") and parse_label("lpp") == ("lpp", FEWCLIP)


def test_lpp_bias_init_linear_draws_the_code_default_from_the_run_generator():
    t, _ = fixture("lpp")
    bb = FeatureBackbone(t["clip_weights"].T)
    train = Features(t["train_feats_raw"].double(), t["train_labels"])
    biases = []
    for seed in (0, 0, 1):
        ad = adapter_info("lpp").adapter_cls(with_preset("lpp", "authors", "adapter.epochs=0").adapter, bb, bb.names,
                                             ["{}"]).double()
        ad.fit(FitData(train, [train], Features(train.x[:0], train.y[:0]), TrainConfig(), 4,
                       torch.Generator().manual_seed(seed)))
        biases.append(ad.bias.detach().clone())
    D = train.x.shape[1]
    assert torch.equal(biases[0], biases[1]) and not torch.equal(biases[0], biases[2])
    assert float(biases[0].abs().max()) <= D ** -0.5 and float(biases[0].std()) > 0


def test_clap_pooled_views_batch_as_the_authors_trainer():
    """preset=authors pools the 20 views: an epoch is ceil(N/256) batches of 256 drawn from all 20 N features (the
    authors' batch for their shuffle is the same rows of the same view-major pool), where fewclip's default trains
    epoch e on view e mod 20 alone."""
    t, m = fixture("clap")
    V, N, D = t["train_views_raw"].shape
    views = [Features(t["train_views_raw"][v], t["train_labels"]) for v in range(V)]
    pooled = PooledViews(views, Features(views[0].x[:0], views[0].y[:0]))
    X, Y = t["train_views_raw"].reshape(V * N, D), t["train_labels"].repeat(V)
    idx = t["batch_idx"][0]  # the authors' first batch: rows of their pool
    assert torch.equal(pooled.batch(0, idx), X[idx]) and torch.equal(pooled.labels[idx], Y[idx])
    bb = FeatureBackbone(t["text_raw"])
    sizes = {}
    for preset in ("fewclip", "authors"):
        cfg = with_preset("clap", preset, "train.epochs=3")
        ad = Clap(cfg.adapter, bb, bb.names, ["{}"]).float()
        seen = []
        loss = ad.training_loss
        ad.training_loss = lambda x, y: (seen.append(len(y)), loss(x, y))[1]
        info = ad.fit(FitData(views[0], views, Features(views[0].x[:0], views[0].y[:0]), cfg.train, 4,
                              torch.Generator().manual_seed(0)))
        assert info["steps"] == 3 * math.ceil(N / 256)  # as many steps either way
        sizes[preset] = seen
    assert sizes == {"fewclip": [N] * 3, "authors": [min(256, V * N)] * 3}


def test_a_plugin_registers_presets_and_bad_ones_fail_early():
    register_presets("coop_plugin_test", Preset("mine", "a plugin's preset", settings=(
        Setting("adapter.n_ctx", 4, "Someone/Repo@0123456 run.sh:3", "their context length"),)))
    try:
        assert list(presets_of("coop_plugin_test")) == [FEWCLIP, "mine"]
    finally:
        PRESETS.pop("coop_plugin_test")
    with pytest.raises(ValueError, match="adapter.FIELD or train.FIELD"):
        Setting("data.templates", "single", "x@0123456 a:1", "why")
    with pytest.raises(ValueError, match="fewclip's own default"):
        register_presets("x_test", Preset(FEWCLIP, "no"))
    with pytest.raises(ValueError, match="sets a field twice"):
        Preset("twice", "x", settings=(Setting("train.lr", 1.0, "s", "r"), Setting("train.lr", 2.0, "s", "r")))


def test_the_manuals_table_lists_every_preset_difference():
    """The manual's Presets table (docs/concepts/presets.md) is ``markdown_rows`` of the registered presets
    (regenerate it with ``python scripts/presets_table.py``)."""
    defaults = {n: preset_defaults(adapter_info(n)) for n in ADAPTERS.names()}
    page = PRESETS_PAGE.read_text()
    missing = [row for row in markdown_rows(ADAPTERS.names(), defaults) if row not in page]
    assert not missing, "docs/concepts/presets.md's table is out of date; first missing row:\n" + missing[0]


def test_a_preset_that_does_not_fit_the_config_is_a_config_error():
    register_presets("tip_adapter_plugin_test", Preset("bad", "a typo", settings=(
        Setting("adapter.tie_brake", "first", "x@0123456 a:1", "typo"),)))
    info = adapter_info("tip_adapter")
    ADAPTERS.register("tip_adapter_plugin_test", dataclasses.replace(info, name="tip_adapter_plugin_test"))
    try:
        with pytest.raises(ConfigError, match="preset 'bad' of adapter 'tip_adapter_plugin_test' does not fit"):
            with_preset("tip_adapter_plugin_test", "bad")
    finally:
        PRESETS.pop("tip_adapter_plugin_test")
        ADAPTERS.pop("tip_adapter_plugin_test")
