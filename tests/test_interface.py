"""The adapter interface seen from a new method: a method written in this file, with its own export format,
trains, exports, predicts and reloads with no edit to the core; a fit-style method gets the augmented views
it asks for, shared with the other runs of a sweep; exports written before the interface changed still load."""
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors import safe_open

import fewclip
from fewclip.adapter.exports import METADATA_KEY, ExportError, PrototypeClassifier
from fewclip.adapters import ADAPTERS, EXPORT_FORMATS, Adapter, AdapterConfig, ExportFormat, register_adapter
from fewclip.cli.main import main
from fewclip.features.encode import FeatureCache, text_prototypes
from fewclip.runs.export import export_run
from fewclip.training.engine import CachedFeatures, train_loop

FIXTURES = Path(__file__).parent / "fixtures"
RUN = ["data=toy-shapes", "shots=1", "seed=1", "data.max_test=16", "backbone.device=cpu"]


# ---------------------------------------------------------------- a method written here, with its own export


@pytest.fixture
def registered():
    """Register adapters for one test, and take them out of the registry afterwards."""
    names = []

    def register(name, config_cls, adapter_cls, export=None):
        register_adapter(name, config_cls, adapter_cls, export=export)
        names.append((name, export))

    yield register
    for name, export in names:
        ADAPTERS.pop(name)
        if export is not None:
            EXPORT_FORMATS.pop(export.name)


@dataclass
class BiasConfig(AdapterConfig):
    name: str = "test_bias"
    init: float = 0.0


class Bias(Adapter):
    """Zero-shot prototypes and a learnable logit bias per class."""

    name = "test_bias"

    def __init__(self, cfg, backbone, classnames: Sequence[str], templates: Sequence[str], *,
                 generator: Optional[torch.Generator] = None):
        super().__init__(cfg, backbone, classnames, templates)
        self.register_buffer("protos", text_prototypes(backbone, self.classnames, self.templates), persistent=False)
        self.bias = torch.nn.Parameter(torch.full((len(self.classnames),), cfg.init))

    def forward(self, features):
        return self.backbone.geometry.image_logits(features, self.protos) + self.bias


class BiasClassifier(PrototypeClassifier):
    def __init__(self, backbone, meta, tensors, path):
        super().__init__(backbone, meta, tensors["prototypes"], path)
        self.bias = tensors["bias"].to(backbone.device)

    def logits_from_features(self, raw):
        return super().logits_from_features(raw) + self.bias


def write_bias(adapter, path, meta, *, scale=1.0):
    from safetensors.torch import save_file

    meta = {**meta, "scale": scale}
    tensors = {"prototypes": adapter.protos.float().contiguous(), "bias": scale * adapter.bias.detach().float()}
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(meta)})
    return meta


def load_bias(path, meta, backbone):
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return BiasClassifier(backbone, meta, tensors, path)


BIAS_EXPORT = ExportFormat(name="test.bias", version=1, default_path="bias.safetensors", write=write_bias,
                           load=load_bias, summary=lambda path, meta: f"a bias export at {path}: scale {meta['scale']}",
                           options={"scale": 1.0})


def test_a_new_method_with_its_own_export_needs_no_edit_to_the_core(registered, tmp_path, shapes, capsys):
    registered("test_bias", BiasConfig, Bias, export=BIAS_EXPORT)
    run = tmp_path / "run"
    assert main(["train", "adapter=test_bias", "adapter.init=0.5", "train.epochs=3", "train.augment_views=2",
                 *RUN, f"out={run}"]) == 0
    m = json.loads((run / "metrics.json").read_text())
    assert m["method"] == "test_bias" and m["trainable_parameters"] == 8 and len(m["loss_curve"]) == 3

    out = tmp_path / "bias.safetensors"
    assert main(["export", str(run), "-o", str(out), "scale=2"]) == 0  # its own option, typed by its default
    assert f"a bias export at {out}: scale 2.0" in capsys.readouterr().out
    with safe_open(str(out), "pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
    assert meta["format"] == "test.bias" and meta["classnames"] == shapes.classnames
    assert meta["run"]["top1"] == m["top1"] and meta["backbone"]["config"]["name"] == "toy-clip"
    assert export_run(run).path == run / "bias.safetensors"  # the format's default path
    with pytest.raises(ExportError, match="merge do not apply to test_bias runs; their export takes scale=1.0"):
        export_run(run, merge="true")

    clf = fewclip.load_prompts(out, device="cpu")
    assert isinstance(clf, BiasClassifier) and clf.classnames == shapes.classnames
    from safetensors.torch import load_file

    adapter = Bias(BiasConfig(), clf.backbone, shapes.classnames, m["templates"])
    adapter.load_adapter_state_dict(load_file(str(run / "adapter.safetensors")))
    images = [shapes.load_image(it) for it in shapes.items("test")[:4]]
    with torch.no_grad():
        want = adapter(clf.backbone.encode_images(clf.pixels(images)))
    torch.testing.assert_close(clf.logits(images), want + adapter.bias.detach(), atol=1e-5, rtol=1e-5)  # scale 2
    with pytest.raises(ExportError, match="test.bias export classifies its own classes only"):
        clf.with_classnames(["moon"])

    image = tmp_path / "img.png"
    images[0].save(image)
    assert main(["predict", f"prompts={out}", str(image), "top_k=2", "backbone.device=cpu"]) == 0
    assert "BiasClassifier" in capsys.readouterr().out


def test_an_adapter_without_an_export_format_is_refused_by_name(tmp_path, capsys):
    run = tmp_path / "zs"
    assert main(["train", "adapter=zeroshot", *RUN[:1], *RUN[3:], f"out={run}"]) == 0
    assert main(["export", str(run)]) == 2
    assert "adapter 'zeroshot', which has no export format" in capsys.readouterr().err


# ---------------------------------------------------------------- a fit-style method asking for K views


@dataclass
class ViewsConfig(BiasConfig):
    name: str = "test_views"
    views: int = 3


class Views(Bias):
    """Fit-style: asks for K augmented views and runs the engine's loop on them itself."""

    name = "test_views"
    trained_by = "fit"
    seen = []

    def fit_views(self):
        return self.cfg.views

    def fit(self, data):
        Views.seen.append(data)
        return train_loop(self, CachedFeatures(data.views, data.val), data.cfg, data.shots, data.generator)


def test_fit_style_methods_get_the_views_they_ask_for_shared_across_runs(registered, tmp_path, shapes):
    from fewclip.backbones.backbone import BackboneConfig, load_backbone
    from fewclip.runs.run import load_train_config, run_train

    registered("test_views", ViewsConfig, Views)
    bb = load_backbone(BackboneConfig(name="toy-clip", device="cpu"))
    cache = FeatureCache()
    Views.seen.clear()

    def run(name, *args):
        cfg = load_train_config([f"adapter={name}", *RUN, "train.epochs=2", *args])
        return run_train(cfg, tmp_path / name / str(len(Views.seen)), backbone=bb, dataset=shapes, cache=cache)

    first = run("test_views")
    data = Views.seen[0]
    n, d = data.train.x.shape
    assert (n, len(data.views), data.val.x.shape) == (8, 3, (8, d))  # 1 shot and 1 validation image per class
    for v in data.views:
        assert torch.equal(v.y, data.train.y) and v.x.shape == (n, d)
        assert not torch.allclose(v.x, data.train.x)  # augmented
    assert not torch.allclose(data.views[0].x, data.views[1].x)
    assert first["epochs"] == 2 and first["train_time_s"] > 0
    # charged in full: plain training images, 3 views, validation, 16 test images; all encoded by this run
    assert first["images_encoded"] == 8 + 3 * 8 + 8 + 16 and first["images_encoded_shared"] == 0

    again = run("test_views", "adapter.views=5")  # views 0-2 come from the cache, 3-4 are new
    assert Views.seen[1].views[2].x.equal(data.views[2].x) and len(Views.seen[1].views) == 5
    assert again["images_encoded"] == 8 + 5 * 8 + 8 + 16 and again["images_encoded_shared"] == 8 + 3 * 8 + 8 + 16

    coop = run("coop", "train.augment_views=2", "adapter.n_ctx=2")  # CoOp's loop uses the same first two views
    assert coop["images_encoded"] == 2 * 8 + 16 == coop["images_encoded_shared"]


# ---------------------------------------------------------------- the loop's hooks: loss terms, backward, epochs


class Hooked(Bias):
    """A bias that also pays for its size (a logged regulariser), halves its gradient and counts its epochs."""

    name = "test_hooked"
    epochs_seen: list = []

    def training_loss(self, features, labels):
        terms = super().training_loss(features, labels)
        terms["ce"] = terms["loss"]
        terms["size"] = self.bias.pow(2).sum()
        terms["loss"] = terms["ce"] + terms["size"]
        return terms

    def backward(self, terms):
        terms["loss"].backward()
        self.bias.grad.mul_(0.5)

    def on_epoch_end(self, epoch, epochs):
        Hooked.epochs_seen.append((epoch, epochs))


def test_the_loop_calls_the_adapters_loss_backward_and_epoch_hooks(shapes):
    from fewclip.backbones.backbone import BackboneConfig, load_backbone
    from fewclip.features.encode import Features
    from fewclip.training.engine import TrainConfig

    bb = load_backbone(BackboneConfig(name="toy-clip", device="cpu"))
    names = shapes.classnames
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 64, generator=g), torch.arange(16) % len(names)
    cfg = TrainConfig(optimizer="sgd", lr=0.1, momentum=0.0, weight_decay=0.0, epochs=3, warmup_epochs=0, batch_size=16)

    def trained(cls):
        a = cls(BiasConfig(), bb, names, ["a photo of a {}."])
        info = train_loop(a, CachedFeatures([Features(x, y)], Features(x[:0], y[:0])), cfg, 1, torch.Generator())
        return a, info

    Hooked.epochs_seen = []
    hooked, info = trained(Hooked)
    plain, _ = trained(Bias)
    assert Hooked.epochs_seen == [(0, 3), (1, 3), (2, 3)]
    # one full-batch step per epoch: the first step's gradient is the cross-entropy's alone (the bias starts at
    # 0), halved; so after it the hooked bias is half the plain one
    assert info["epochs"] == 3 and len(info["loss_curve"]) == 3
    assert not torch.allclose(hooked.bias, plain.bias)
    cfg.epochs = 1
    h1, _ = trained(Hooked)
    p1, _ = trained(Bias)
    torch.testing.assert_close(h1.bias, 0.5 * p1.bias)


def test_for_classnames_default_is_the_adapter_itself_or_an_error(shapes):
    from fewclip.adapters import AdapterError
    from fewclip.backbones.backbone import BackboneConfig, load_backbone

    bb = load_backbone(BackboneConfig(name="toy-clip", device="cpu"))
    a = Bias(BiasConfig(), bb, shapes.classnames, ["a photo of a {}."])
    assert not a.supports_new_classes
    assert a.for_classnames(list(shapes.classnames), ["a {}."]) is a
    with pytest.raises(AdapterError, match="cannot score other class names"):
        a.for_classnames(["lynx", "ocelot"], ["a {}."])


# ---------------------------------------------------------------- exports written before the interface change


def test_prompt_file_v1_still_loads(shapes):
    """tests/fixtures/coop_prompts_v1.safetensors was written by fewclip at main 066acef (`fewclip train
    adapter=coop data=toy-shapes shots=1 seed=1 train.epochs=2 adapter.n_ctx=4 train.augment_views=1`, then
    `export_run(run, path, nearest_k=2)`), with the logits its classifier gave then."""
    want = json.loads((FIXTURES / "coop_prompts_v1_logits.json").read_text())
    clf = fewclip.load_prompts(FIXTURES / "coop_prompts_v1.safetensors", device="cpu")
    assert type(clf).__name__ == "PromptClassifier" and clf.meta["format_version"] == 1
    images = [shapes.load_image(it) for it in shapes.items("test")[:4]]
    assert [it.id for it in shapes.items("test")[:4]] == want["images"]
    torch.testing.assert_close(clf.logits(images), torch.tensor(want["logits"]), atol=1e-5, rtol=1e-5)
    new = clf.with_classnames(["star", "moon"])
    torch.testing.assert_close(new.logits(images), torch.tensor(want["star_moon_logits"]), atol=1e-5, rtol=1e-5)


def test_lora_export_v1_still_loads(shapes):
    """tests/fixtures/lora_export_v1/ was written by fewclip at main 066acef (`fewclip train adapter=lora
    data=toy-shapes shots=1 seed=1 train.iterations=4 train.lr=0.01 data.templates=single`, then `export_run`)."""
    want = json.loads((FIXTURES / "lora_export_v1_logits.json").read_text())
    clf = fewclip.load_prompts(FIXTURES / "lora_export_v1", device="cpu")
    assert type(clf).__name__ == "LoRAClassifier"
    images = [shapes.load_image(it) for it in shapes.items("test")[:4]]
    torch.testing.assert_close(clf.logits(images), torch.tensor(want["logits"]), atol=1e-5, rtol=1e-5)
