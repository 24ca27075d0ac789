"""Run configuration (defaults, YAML pieces, dotlist) and the `fewclip` command line."""
import json

import pytest
from omegaconf import OmegaConf

from fewclip.backbones.backbone import shipped_cards
from fewclip.cli.main import main
from fewclip.config.compose import ConfigError, RunConfig, load_config, split_args
from fewclip.runs.run import load_train_config

# ---------------------------------------------------------------- config


def test_defaults_come_from_the_dataclasses():
    cfg = load_config([])
    assert isinstance(cfg, RunConfig)
    assert cfg == RunConfig()
    assert (cfg.backbone.name, cfg.data.name, cfg.seed, cfg.out) == ("toy-clip", "toy-shapes", 1, None)


@pytest.mark.parametrize("arg, key", [
    ("foo=1", "foo"),
    ("backbone.nme=toy-meru", "nme"),
    ("data.shots=4", "shots"),
])
def test_unknown_key_is_an_error_naming_it(arg, key):
    with pytest.raises(ConfigError, match=rf"\b{key}\b"):
        load_config([arg])


@pytest.mark.parametrize("arg, key", [
    ("seed=abc", "seed"),
    ("data.max_test=many", "data.max_test"),
    ("data.batch_size=1.5", "data.batch_size"),
])
def test_wrong_type_is_an_error_naming_the_key(arg, key):
    with pytest.raises(ConfigError, match=rf"{key}\b"):
        load_config([arg])


@pytest.mark.parametrize("arg, key, value", [
    ("data.templates=all", "data.templates", "all"),
    ("backbone.precision=fp8", "backbone.precision", "fp8"),
    ("log_level=loud", "log_level", "loud"),
    ("data.batch_size=0", "data.batch_size", "0"),
])
def test_bad_values_are_errors_naming_key_and_value(arg, key, value):
    with pytest.raises(ConfigError) as e:
        load_config([arg])
    assert key in str(e.value) and value in str(e.value)


def test_shorthands_set_the_section_name():
    cfg = load_config(["backbone=toy-meru", "data=toy-sketch", "backbone.precision=bf16"])
    assert cfg.backbone.name == "toy-meru" and cfg.backbone.precision == "bf16"
    assert cfg.data.name == "toy-sketch"
    assert split_args(["backbone=ViT-B-32", "backbone.pretrained=none"])[1] == [
        "backbone.name=ViT-B-32", "backbone.pretrained=none"]


def test_yaml_pieces_merge_in_order_then_dotlist(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("seed: 3\nbackbone: toy-meru\ndata:\n  name: toy-patterns\n  max_test: 50\n")
    b = tmp_path / "b.yaml"
    b.write_text("seed: 4\ndata:\n  templates: single\n")
    cfg = load_config([str(a), str(b)])
    assert cfg.seed == 4  # the later file wins
    assert cfg.backbone.name == "toy-meru"  # `backbone: NAME` shorthand in YAML
    assert (cfg.data.name, cfg.data.max_test, cfg.data.templates) == ("toy-patterns", 50, "single")  # partial merges
    assert cfg.data.batch_size == 256  # untouched keys keep their defaults
    # the dotlist comes last, wherever it stands among the arguments
    cfg = load_config(["seed=9", str(a), "data.max_test=7", str(b)])
    assert (cfg.seed, cfg.data.max_test, cfg.data.name) == (9, 7, "toy-patterns")


def test_yaml_pieces_are_checked_like_the_dotlist(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  nme: toy-shapes\n")
    with pytest.raises(ConfigError, match="nme"):
        load_config([str(bad)])
    with pytest.raises(ConfigError, match="config file not found: nowhere.yaml"):
        load_config(["nowhere.yaml"])
    with pytest.raises(ConfigError, match="'toy-clip' is neither a YAML file nor key=value"):
        load_config(["toy-clip"])


# ---------------------------------------------------------------- the command line


def test_zeroshot_writes_config_and_metrics(tmp_path, capsys):
    out = tmp_path / "zs"
    rc = main(["zeroshot", "backbone=toy-clip", "data=toy-shapes", "data.max_test=80", "backbone.device=cpu",
               f"out={out}"])
    assert rc == 0
    # config.yaml is the resolved config of the run (the zeroshot adapter, 0 shots), and loads back to the same run
    saved = OmegaConf.load(out / "config.yaml")
    assert saved.backbone.name == "toy-clip" and saved.data.max_test == 80 and saved.seed == 1
    assert saved.adapter.name == "zeroshot" and saved.shots == 0
    assert load_train_config([str(out / "config.yaml")]) == load_train_config(
        ["adapter=zeroshot", "backbone=toy-clip", "data=toy-shapes", "data.max_test=80", "backbone.device=cpu",
         f"out={out}"])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n_test"] == 80
    assert set(metrics["per_class"]) == {"circle", "square", "triangle", "diamond", "cross", "star", "ring", "crescent"}
    # a class-stratified subset: 10 images per class, so top-1 is the mean of the per-class accuracies
    assert metrics["top1"] == pytest.approx(sum(metrics["per_class"].values()) / 8)
    assert 50 < metrics["top1"] <= 100  # toy-clip names shapes well above chance (12.5%)
    assert metrics["geometry"] == "clip" and metrics["backbone_info"]["weights_sha256"]
    assert f"{metrics['top1']:.2f}%" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["zeroshot", "seed=abc"], "seed"),
    (["zeroshot", "backbone=no-such-model"], "`fewclip backbones`"),
    (["zeroshot", "data=no-such-data"], "`fewclip datasets`"),
    (["zeroshot", "data=caltech101"], "needs data.root=PATH"),
])
def test_errors_exit_2_with_a_message(args, message, capsys, tmp_path):
    rc = main(args + [f"out={tmp_path / 'run'}", "backbone.device=cpu"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "fewclip zeroshot: error:" in err and message in err
    assert "Traceback" not in err


def test_unknown_command_exits_2(capsys):
    assert main(["zeroshoot"]) == 2
    assert "unknown command 'zeroshoot'" in capsys.readouterr().err


def test_help_prints_the_config_defaults(capsys):
    assert main(["zeroshot", "--help"]) == 0
    out = capsys.readouterr().out
    assert "backbone:" in out and "name: toy-clip" in out and "max_test:" in out
    assert main([]) == 0 and "usage: fewclip" in capsys.readouterr().out


def test_backbones_lists_reference_cards_with_geometry(capsys):
    assert main(["backbones"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = {"toy-clip": "clip", "toy-euclip": "euclidean_sq", "toy-meru": "hyperbolic", "toy-siglip": "sigmoid"}
    assert set(expected) <= set(shipped_cards())
    for name, geometry in expected.items():
        row = [line.split() for line in lines if line.split()[:1] == [name]]
        assert row and row[0][1] == geometry, (name, row)
    assert any("--all" in line for line in lines)  # the open_clip list is cut short by default
    # `--all`: every open_clip architecture, with its geometry and pretrained tags
    assert main(["backbones", "--all"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["ViT-B-32"][1] == "clip" and "openai," in rows["ViT-B-32"]
    assert rows["ViT-B-16-SigLIP"][1] == "sigmoid" and "webli" in rows["ViT-B-16-SigLIP"]


def _blocks(out):
    """`fewclip datasets` output as {name: its indented lines}."""
    blocks, name = {}, None
    for line in out.splitlines():
        if line and not line.startswith(" "):
            name = line.strip()
            blocks[name] = []
        elif name is not None:
            blocks[name].append(line.strip())
    return blocks


def test_datasets_lists_toy_tasks_and_benchmark_layouts(capsys):
    assert main(["datasets"]) == 0
    blocks = _blocks(capsys.readouterr().out)
    for toy in ("toy-shapes", "toy-patterns", "toy-positions", "toy-sketch"):
        assert blocks[toy][0].startswith("toy world:") and blocks[toy][1] == "no files needed"
    for name, layout in (("caltech101", "split_zhou_Caltech101.json"), ("oxford_pets", "`-- oxford_pets/"),
                         ("imagenet", "`-- imagenet/"), ("folder", None)):
        assert "data.root=PATH, expected layout:" in blocks[name]
        if layout:
            assert any(layout in line for line in blocks[name]), (name, blocks[name])
