"""ProLIP on a ResNet image tower (the authors' ``VisProjRN``): the attention pool's output projection trained,
its bias frozen, equal to the authors' code; its pre-projection features equal to theirs; zero-shot at its start.

Fixture: tests/fixtures/cache_ref/prolip_rn.* (README there): astra-vision/ProLIP @ b43e795 ran on a tiny open_clip
ModifiedResNet (width 4, attention width 128, output 16) whose image-tower weights the fixture holds: their
``clip/model.py`` tower gave the pre-projection features of class-structured random images, their
``ProLIP.forward`` (backbone RN50, the ``few_shot_few_val`` search, 6 views, 30 epochs) the rest.
"""
import copy
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

import fewclip
from fewclip.adapter.base import AdapterError
from fewclip.adapters import build_adapter
from fewclip.adapters.prolip import ProLIP, ProLIPConfig
from fewclip.backbones.backbone import BackboneConfig, build_open_clip_model, load_backbone
from fewclip.features.encode import FeatureCache
from fewclip.features.store import FeatureStore
from fewclip.runs.export import export_run
from fewclip.runs.run import load_train_config, run_train
from helpers.cache import NAMES, PARAMS, TEMPLATES, zero_shot
from helpers.cache_parity import FeatureBackbone, authors_config, fit_data, reldiff
from helpers.parity import FIXTURE_ROOT

FIXTURES = FIXTURE_ROOT / "cache_ref"
T = load_file(str(FIXTURES / "prolip_rn.safetensors"))
M = json.loads((FIXTURES / "prolip_rn.json").read_text())
GEOMETRIES = {"clip": {}, "euclidean": {}, "sigmoid": PARAMS["sigmoid"], "hyperbolic": PARAMS["hyperbolic"]}


def resnet_card(folder: Path, geometry: str) -> str:
    """A card for the fixture's tiny ModifiedResNet: its image tower's weights, a random text tower."""
    torch.manual_seed(0)
    model = build_open_clip_model(copy.deepcopy(M["model_config"]))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    visual = {k: v for k, v in T.items() if k.startswith("visual.")}
    assert set(visual) == {k for k in state if k.startswith("visual.")}
    state.update(visual)
    save_file(state, str(folder / f"rn-{geometry}.safetensors"))
    geo = {"name": geometry, "logit_scale": float(model.logit_scale.detach().exp()), **GEOMETRIES[geometry]}
    card = {"name": f"tiny-rn-{geometry}", "model_config": M["model_config"], "weights": f"rn-{geometry}.safetensors",
            "tokenizer": {"type": "open_clip"}, "geometry": geo}
    path = folder / f"rn-{geometry}.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(card)))
    return str(path)


_LOADED = {}  # geometry -> (card, backbone)


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rn_cards")

    def load(geometry: str = "clip", card: bool = False):
        if geometry not in _LOADED:
            path = resnet_card(folder, geometry)
            _LOADED[geometry] = path, load_backbone(BackboneConfig(name=path, device="cpu"))
        return _LOADED[geometry][0 if card else 1]

    return load


class HeadBackbone(FeatureBackbone):
    """The fixture's text features and the tower's last projection: c_proj's weight [D, W] and bias [D]."""

    def image_head(self):
        return T["W0"].t(), T["b0"]


# ---------------------------------------------------------------- parity with the authors' code


def test_resnet_preprojection_features_are_the_authors(resnet):
    bb = resnet()
    pool = bb.model.visual.attnpool
    c_proj, weight = pool.c_proj, pool.c_proj.weight.detach().clone()
    rng = torch.get_rng_state()
    z = bb.tower_variant("preproj").encode_images(T["check_px"])  # [4, 128]: the attention output before c_proj
    assert torch.equal(torch.get_rng_state(), rng)  # (encoding draws nothing from the global generator)
    assert z.shape == (4, M["width"])
    assert reldiff(z, T["check_pre"]) < 1e-5  # their AttentionPool2d (out_proj the identity, bias zero)
    assert pool.c_proj is c_proj and torch.equal(c_proj.weight, weight)  # set back after encoding
    out = bb.encode_images(T["check_px"])
    assert reldiff(out, T["check_out"]) < 1e-5  # the plain tower: open_clip's, c_proj inside the attention call
    P, b = bb.image_head()
    assert torch.equal(P, T["W0"].t()) and torch.equal(b, T["b0"])
    assert reldiff(torch.addmm(b, z, P), out) < 1e-5
    # the store keeps a ResNet's plain features as they are; ProLIP's pre-projection ones are a variant apart
    assert bb.image_projection() is None and bb.stored_variant() is None


def test_prolip_resnet_equals_the_authors():
    bb = HeadBackbone(T["text"])
    cfg = authors_config("prolip", views=M["aug_views"], epochs=M["train_epoch"])
    pl = ProLIP(cfg, bb, bb.names, ["{}"])
    info = pl.fit(fit_data(list(T["train_views_pre"]), T["train_labels"], T["val_pre"], T["val_y"],
                           shots=M["shots"]))
    assert (info["lr"], info["lambda"]) == (M["lr_v"], M["lambda_v"])
    search = M["search"]  # [lr, lambda, validation accuracy] of each pair, in their order
    assert [(lr, lm) for lr, lm, _ in search] == [(a, b) for a in cfg.lrs for b in cfg.lambdas]
    assert info["val_accs"] == pytest.approx([acc for _, _, acc in search], abs=1e-6)
    assert reldiff(pl.projection.t(), T["W"]) < 1e-4  # c_proj's weight after 30 Adam steps
    assert (pl.projection.t() - T["W0"]).abs().max() > 1e-2  # (it moved)
    assert torch.equal(pl.bias, T["b0"])  # the bias frozen at the pretrained one
    with torch.no_grad():
        logits = pl(T["test_pre"])
    assert reldiff(logits, T["test_logits"]) < 1e-4
    assert 100 * float((logits.argmax(-1) == T["test_y"]).double().mean()) == pytest.approx(M["test_acc"])


def test_prolip_resnet_regulariser_pulls_the_weight_and_leaves_the_bias():
    """lambda * ||W - W0||^2 on the weight alone: a huge lambda holds W near W0, lambda 0 lets it go."""
    bb = HeadBackbone(T["text"])
    data = fit_data(list(T["train_views_pre"]), T["train_labels"], T["val_pre"], T["val_y"], shots=M["shots"])
    moved = {}
    for lmbda in (0.0, 1e6):
        pl = ProLIP(ProLIPConfig(views=6, epochs=30, search=False, lr=1e-2, lmbda=lmbda), bb, bb.names, ["{}"])
        pl.fit(data)
        moved[lmbda] = float((pl.projection.detach() - pl.initial).abs().max())
        assert torch.equal(pl.bias, T["b0"]) and "bias" not in pl.state_dict()  # rebuilt from the backbone
    assert moved[1e6] < 0.05 * moved[0.0]  # (Adam: steps of about lr whatever the gradient, so not 0)


# ---------------------------------------------------------------- zero-shot at the start


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_prolip_resnet_starts_at_zero_shot(geometry, resnet):
    bb = resnet(geometry)
    px = torch.randn(5, 3, bb.image_size, bb.image_size, generator=torch.Generator().manual_seed(0))
    want = zero_shot(bb, bb.encode_images(px))
    pl = ProLIP(ProLIPConfig(views=1, epochs=0, search=False), bb, NAMES, TEMPLATES)
    z = bb.tower_variant("preproj").encode_images(px)
    with torch.no_grad():
        torch.testing.assert_close(pl(z), want, rtol=1e-5, atol=1e-5)  # at the pretrained c_proj
        torch.testing.assert_close(pl(pl.encode_images(px)), want, rtol=1e-5, atol=1e-5)  # an export's path
        pl.projection.add_(0.05 * torch.randn(pl.projection.shape, generator=torch.Generator().manual_seed(1)))
        assert not torch.allclose(pl(z), want, atol=1e-3)  # (the logits do depend on the projection)


def test_the_resnet_preprojection_features_are_stored_apart(resnet, shapes, tmp_path):
    bb = resnet()
    items = shapes.items("test")[:6]
    store = FeatureStore(tmp_path / "store")
    plain = FeatureCache(store).features(bb, shapes, items)
    pre = FeatureCache(store).features(bb.tower_variant("preproj"), shapes, items)
    assert (plain.encoded, pre.encoded) == (6, 6)  # two entries: the ResNet's projection is inside its pool
    assert sorted(g.address["variant"] for g in store.groups()) == ["", "|preproj"]
    assert pre.features.x.shape[1] == M["width"] and plain.features.x.shape[1] == M["dim"]
    P, b = bb.image_head()
    torch.testing.assert_close(torch.addmm(b, pre.features.x, P), plain.features.x, rtol=1e-5, atol=1e-5)
    again = FeatureCache(store).features(bb.tower_variant("preproj"), shapes, items)
    assert (again.encoded, again.from_store) == (0, 6) and torch.equal(again.features.x, pre.features.x)


def test_prolip_trains_scores_and_exports_on_a_resnet(resnet, shapes, tmp_path):
    """Through the engine: views, validation and test images encoded before c_proj, the export the same."""
    bb = resnet()
    cfg = load_train_config(["adapter=prolip", "data=toy-shapes", "shots=2", "seed=1", "data.max_test=16",
                             "data.templates=single", f"backbone.name={resnet(card=True)}", "backbone.device=cpu",
                             "adapter.views=2", "adapter.epochs=5", "adapter.lrs=[0.01,0.001]",
                             "adapter.lambdas=[0.1,0]"])
    m = run_train(cfg, tmp_path / "run", backbone=bb, dataset=shapes)
    assert 0 <= m["top1"] <= 100 and m["lr"] in (0.01, 0.001) and m["searched"]
    state = load_file(str(tmp_path / "run" / "adapter.safetensors"))
    assert list(state) == ["projection"] and state["projection"].shape == (M["width"], M["dim"])
    adapter = build_adapter(cfg.adapter, bb, shapes.classnames, m["templates"])
    adapter.load_adapter_state_dict(state)
    images = [shapes.load_image(it) for it in shapes.items("test")[:4]]
    clf = fewclip.load_prompts(export_run(tmp_path / "run", tmp_path / "prolip.safetensors").path, device="cpu")
    with torch.no_grad():
        want = adapter(bb.tower_variant("preproj").encode_images(clf.pixels(images)))
    torch.testing.assert_close(clf.logits(images), want, rtol=1e-6, atol=1e-6)


def test_a_tower_without_a_linear_projection_is_refused():
    class NoHead(FeatureBackbone):
        name = "headless"

        def image_head(self):
            return None

    with pytest.raises(AdapterError, match="ViT's visual.proj, a ModifiedResNet's attnpool.c_proj.*use a ViT or "
                                           "ResNet backbone"):
        ProLIP(ProLIPConfig(), NoHead(T["text"]), [f"c{i}" for i in range(5)], ["{}"])
