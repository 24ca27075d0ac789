"""The generic ``fewclip.adapter`` export: any adapter that opts in exports, predicts and reloads; a throwaway
adapter written here shows it needs nothing else; every cache-based method and both probes go through
``fewclip sweep``, ``fewclip report``, ``fewclip export`` and ``fewclip predict``."""
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import fewclip
from fewclip.adapter.exports import METADATA_KEY, ExportError
from fewclip.adapter.state_export import FORMAT, STATE, AdapterClassifier
from fewclip.adapters import ADAPTERS, Adapter, AdapterConfig, adapter_info, build_adapter, register_adapter
from fewclip.cli.main import main
from fewclip.features.encode import text_prototypes
from fewclip.runs.export import export_run

RUN = ["data=toy-shapes", "shots=1", "seed=1", "data.max_test=16", "backbone.device=cpu", "data.templates=single"]


@pytest.fixture
def registered():
    """Register adapters for one test and take them out again (the shared format stays registered)."""
    names = []

    def register(name, config_cls, adapter_cls):
        register_adapter(name, config_cls, adapter_cls, export=STATE)
        names.append(name)

    yield register
    for name in names:
        ADAPTERS.pop(name)


@dataclass
class TempConfig(AdapterConfig):
    name: str = "test_temp"
    offset: float = 0.0


class Temp(Adapter):
    """Zero-shot logits times a learned temperature plus a configured offset: works for any class names."""

    name = "test_temp"
    supports_new_classes = True

    def __init__(self, cfg, backbone, classnames: Sequence[str], templates: Sequence[str], *,
                 generator: Optional[torch.Generator] = None):
        super().__init__(cfg, backbone, classnames, templates)
        self.register_buffer("protos", text_prototypes(backbone, self.classnames, self.templates), persistent=False)
        self.log_temp = torch.nn.Parameter(torch.zeros(()))
        self.register_buffer("calls", torch.zeros(()))  # a persistent buffer travels with the parameters

    def forward(self, features):
        return self.backbone.geometry.image_logits(features, self.protos) * self.log_temp.exp() + self.cfg.offset

    def for_classnames(self, classnames, templates):
        other = Temp(self.cfg, self.backbone, classnames, templates)
        other.load_adapter_state_dict(self.adapter_state_dict())
        return other.eval()


@dataclass
class PerClassConfig(AdapterConfig):
    name: str = "test_per_class"


class PerClass(Temp):
    """A learned bias per class: its own classes only."""

    name = "test_per_class"
    supports_new_classes = False

    def __init__(self, cfg, backbone, classnames, templates, *, generator=None):
        super().__init__(TempConfig(), backbone, classnames, templates)
        self.cfg = cfg
        self.bias = torch.nn.Parameter(torch.zeros(len(self.classnames)))

    def forward(self, features):
        return self.backbone.geometry.image_logits(features, self.protos) + self.bias


def test_a_new_adapter_opts_into_the_generic_export_with_one_argument(registered, tmp_path, shapes, capsys):
    registered("test_temp", TempConfig, Temp)
    run = tmp_path / "run"
    assert main(["train", "adapter=test_temp", "adapter.offset=0.25", "train.epochs=3", "train.lr=0.5",
                 "train.augment_views=2", *RUN, f"out={run}"]) == 0
    sd = load_file(str(run / "adapter.safetensors"))
    assert set(sd) == {"log_temp", "calls"} and float(sd["log_temp"]) != 0.0  # trained

    out = tmp_path / "temp.safetensors"
    assert main(["export", str(run), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"test_temp export: {out}" in printed and "offset=0.25" in printed
    with safe_open(str(out), "pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
        assert set(f.keys()) == {"log_temp", "calls"}
    assert meta["format"] == FORMAT and meta["adapter"] == {"name": "test_temp", "config": {"name": "test_temp",
                                                                                           "offset": 0.25}}
    assert meta["templates"] == ["a photo of a {}."] and meta["classnames"] == shapes.classnames
    assert meta["backbone"]["config"]["name"] == "toy-clip" and meta["run"]["shots"] == 1
    assert export_run(run).path == run / "adapter_export.safetensors"  # the format's default path

    clf = fewclip.load_prompts(out, device="cpu")
    assert isinstance(clf, AdapterClassifier) and clf.adapter.cfg.offset == 0.25
    images = [shapes.load_image(it) for it in shapes.items("test")[:3]]
    want = Temp(TempConfig(offset=0.25), clf.backbone, shapes.classnames, ["a photo of a {}."])
    want.load_adapter_state_dict(sd)
    with torch.no_grad():
        expected = want(clf.backbone.encode_images(clf.pixels(images)))
    torch.testing.assert_close(clf.logits(images), expected, rtol=1e-6, atol=1e-6)
    new = clf.with_classnames(["moon", "sun"])  # supports_new_classes: the adapter's for_classnames
    with torch.no_grad():
        other = want.for_classnames(["moon", "sun"], ["a photo of a {}."])
        expected = other(clf.backbone.encode_images(clf.pixels(images)))
    assert new.classnames == ["moon", "sun"] and new.meta["classnames"] == ["moon", "sun"]
    torch.testing.assert_close(new.logits(images), expected, rtol=1e-6, atol=1e-6)

    image = tmp_path / "img.png"
    images[0].save(image)
    assert main(["predict", f"prompts={out}", str(image), "top_k=2", "backbone.device=cpu"]) == 0
    assert "AdapterClassifier" in capsys.readouterr().out


def test_an_adapter_of_its_own_classes_refuses_new_names(registered, tmp_path, shapes):
    registered("test_per_class", PerClassConfig, PerClass)
    run = tmp_path / "run"
    assert main(["train", "adapter=test_per_class", "train.epochs=2", *RUN, f"out={run}"]) == 0
    clf = fewclip.load_prompts(export_run(run).path, device="cpu")
    with pytest.raises(ExportError, match="test_per_class export classifies its own classes only"):
        clf.with_classnames(["moon", "sun"])


def test_bad_exports_are_refused_with_the_problem_named(registered, tmp_path):
    registered("test_temp", TempConfig, Temp)
    run = tmp_path / "run"
    assert main(["train", "adapter=test_temp", "train.epochs=1", *RUN, f"out={run}"]) == 0
    with pytest.raises(ExportError, match="one .safetensors file"):
        export_run(run, tmp_path / "x.pt")
    good = export_run(run, tmp_path / "good.safetensors").path
    with safe_open(str(good), "pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}

    def variant(name, **changes):
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors if "tensors" not in changes else changes.pop("tensors"), str(path),
                  metadata={METADATA_KEY: json.dumps({**meta, **changes})})
        return path

    with pytest.raises(ExportError, match="adapter 'gone', which this fewclip does not have"):
        fewclip.load_prompts(variant("gone", adapter={"name": "gone", "config": {}}), device="cpu")
    with pytest.raises(ExportError, match="stored test_temp config does not fit"):
        fewclip.load_prompts(variant("key", adapter={"name": "test_temp", "config": {"nope": 1}}), device="cpu")
    with pytest.raises(ExportError, match="'templates' is missing"):
        fewclip.load_prompts(variant("tpl", templates=None), device="cpu")
    with pytest.raises(ExportError, match="do not fit a test_temp adapter"):
        fewclip.load_prompts(variant("tensors", tensors={"log_temp": torch.zeros(())}), device="cpu")


# ---------------------------------------------------------------- every method through sweep, report, export

QUICK = {  # variants of a small sweep: each method with quick settings
    "tip_adapter": ["adapter=tip_adapter", "adapter.beta_steps=10", "adapter.alpha_steps=5"],
    "tip_adapter_f": ["adapter=tip_adapter_f", "adapter.beta_steps=10", "adapter.alpha_steps=5", "train.epochs=2"],
    "clip_adapter": ["adapter=clip_adapter", "train.epochs=2"],
    "taskres": ["adapter=taskres", "train.epochs=2"],
    "lpp": ["adapter=lpp", "adapter.epochs=20"],
    "clap": ["adapter=clap", "train.epochs=3"],
    "linear_probe": ["adapter=linear_probe", "adapter.grid_points=3", "adapter.refine_steps=0"],
    "zs_probe": ["adapter=zs_probe", "adapter.epochs=5"],
    "gda": ["adapter=gda", "adapter.views=2"],
    "proker": ["adapter=proker", "adapter.views=2", "adapter.beta_grid=[0.5,3,3]", "adapter.lmbda_grid=[0.01,1,3]"],
    "prolip": ["adapter=prolip", "adapter.views=2", "adapter.epochs=5", "adapter.lrs=[0.01,0.001]",
               "adapter.lambdas=[0.1,0]"],
}
TEXT = {  # the text-prompt family, one epoch each: they export through the same generic format
    "cocoop": ["adapter=cocoop", "train.epochs=1"],
    "kgcoop": ["adapter=kgcoop", "train.epochs=1"],
    "prograd": ["adapter=prograd", "train.epochs=1"],
    "tcp": ["adapter=tcp", "train.epochs=1"],
    "ivlp": ["adapter=ivlp", "train.epochs=1"],  # and the deep prompts, which adapt the image tower too
    "maple": ["adapter=maple", "train.epochs=1"],
    "promptsrc": ["adapter=promptsrc", "train.epochs=1"],
    "dept": ["adapter=dept", "train.epochs=1"],  # and issue 23's: a base-class head, representation tokens,
    "mmrl": ["adapter=mmrl", "adapter.rep_dim=32", "train.epochs=1"],  # adapters with LLM descriptions
    "coprompt": ["adapter=coprompt", "adapter.depth=2", "train.epochs=1"],
}


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cache_sweep")
    spec = out / "sweep.yaml"
    spec.write_text(json.dumps({"sweep": {
        "backbones": ["toy-meru"], "datasets": ["toy-shapes"], "methods": ["zeroshot", *QUICK, *TEXT], "shots": [1],
        "seeds": [1], "args": ["data.max_test=16", "data.templates=single", "backbone.device=cpu"],
        "variants": {**QUICK, **TEXT}}}))
    assert main(["sweep", str(spec), f"out={out / 'runs'}", "report=false"]) == 0
    return out / "runs"


def test_every_cache_method_runs_in_a_sweep_and_reports_its_cost(sweep_dir, capsys):
    assert main(["report", str(sweep_dir)]) == 0
    text = capsys.readouterr().out
    for name in QUICK:
        m = json.loads((sweep_dir / "toy-meru" / "toy-shapes" / name / "1shot" / "seed1" / "metrics.json").read_text())
        assert m["method"] == name and m["geometry"] == "hyperbolic" and 0 <= m["top1"] <= 100
        assert m["train_time_s"] >= 0 and m["images_encoded"] > 0
        assert f"| {name} |" in text or f" {name} " in text, name
    metrics = {n: json.loads((sweep_dir / "toy-meru" / "toy-shapes" / n / "1shot" / "seed1" / "metrics.json")
                             .read_text()) for n in QUICK}
    # the shared views: Tip-Adapter's 10 are views 0-9, CLAP's 20 and Tip-Adapter-F's 20 are views 0-19 (8 images)
    assert metrics["tip_adapter"]["images_encoded"] == 8 + 10 * 8 + 8 + 16
    assert metrics["clap"]["images_encoded"] == metrics["tip_adapter_f"]["images_encoded"] == 8 + 20 * 8 + 8 + 16
    assert metrics["tip_adapter_f"]["trainable_parameters"] == 8 * 64  # the keys
    assert metrics["tip_adapter"]["trainable_parameters"] == 0
    assert "Train time" in text  # the cost table


@pytest.mark.parametrize("name", sorted(QUICK) + sorted(TEXT))
def test_every_cache_and_prompt_method_exports_and_predicts_what_it_scored(name, sweep_dir, shapes, tmp_path):
    run = sweep_dir / "toy-meru" / "toy-shapes" / name / "1shot" / "seed1"
    assert adapter_info(name).export is STATE
    done = export_run(run, tmp_path / f"{name}.safetensors")
    assert f"{name} export" in done.summary()
    clf = fewclip.load_prompts(done.path, device="cpu")
    metrics = json.loads((run / "metrics.json").read_text())
    from fewclip.runs.run import load_train_config

    cfg = load_train_config([str(run / "config.yaml")])
    adapter = build_adapter(cfg.adapter, clf.backbone, shapes.classnames, metrics["templates"])
    adapter.load_adapter_state_dict(load_file(str(run / "adapter.safetensors")))
    images = [shapes.load_image(it) for it in shapes.items("test")[:4]]
    with torch.no_grad():
        want = adapter(adapter.encode_images(clf.pixels(images).to(clf.backbone.device)))
    torch.testing.assert_close(clf.logits(images), want, rtol=1e-6, atol=1e-6)
    if adapter.supports_new_classes:
        assert clf.with_classnames(["moon", "sun"]).logits(images).shape == (4, 2)
    else:
        with pytest.raises(ExportError, match="its own classes only"):
            clf.with_classnames(["moon", "sun"])
