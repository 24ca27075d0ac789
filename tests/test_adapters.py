"""Every registered adapter, on two geometries: build, forward, train, save, load (timm's test_models)."""
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from fewclip.adapters import ADAPTERS, AdapterConfig, adapter_info, build_adapter, register_adapter
from fewclip.backbones.backbone import BackboneConfig, load_backbone
from fewclip.config.compose import ConfigError
from fewclip.datasets import make_few_shot_split
from fewclip.features.encode import Features, extract_features, text_prototypes
from fewclip.runs.run import load_train_config
from fewclip.training.engine import FitData, TrainConfig
from helpers.configs import small_config

BACKBONES = ["toy-clip", "toy-meru"]  # clip and hyperbolic geometry


@pytest.fixture(scope="module")
def toy(shapes):
    """name -> (backbone, train, val, test): 2-shot toy-shapes features (seed 1) and 16 test images."""
    split = make_few_shot_split(shapes, 2, seed=1)
    test = shapes.items("test")[::50][:16]
    out = {}
    for name in BACKBONES:
        bb = load_backbone(BackboneConfig(name=name, device="cpu"))
        out[name] = (bb, *(extract_features(bb, shapes, items) for items in (split.train, split.val, test)))
    return out


def snapshot(module: torch.nn.Module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("backbone_name", BACKBONES)
@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_every_adapter(name, backbone_name, toy, shapes, tmp_path):
    bb, (tx, ty), (vx, vy), (test_x, _) = toy[backbone_name]
    before = snapshot(bb)
    info = adapter_info(name)
    templates = shapes.prompts("ensemble")
    C = len(shapes.classnames)

    adapter = build_adapter(small_config(name), bb, shapes.classnames, templates,
                            generator=torch.Generator().manual_seed(0))
    assert isinstance(adapter, info.adapter_cls) and adapter.name == name
    logits = adapter(test_x)
    assert logits.shape == (len(test_x), C) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()

    if adapter.trained_by is None:  # nothing to train: no parameters, no saved state, zero-shot logits
        assert not list(adapter.parameters()) and adapter.adapter_state_dict() == {}
        protos = text_prototypes(bb, shapes.classnames, templates)
        torch.testing.assert_close(logits, bb.geometry.image_logits(test_x, protos))
        return
    if adapter.trained_by == "fit":
        views = [Features(tx, ty)] * adapter.fit_views()
        result = adapter.fit(FitData(Features(tx, ty), views, Features(vx, vy), TrainConfig(), 2,
                                     torch.Generator().manual_seed(0)))
        assert isinstance(result, dict)
    else:
        if adapter.trains_image_tower:  # the image tower itself is adapted: features come through it
            split = make_few_shot_split(shapes, 2, seed=1)
            px = torch.stack([bb.preprocess()(shapes.load_image(it)) for it in split.train])
            x = adapter.encode_images(px)
        else:
            x = tx
        # the method's own loss where it has one without the frozen view (DePT's head learns from text too)
        loss = F.cross_entropy(adapter(x), ty) if adapter.wants_frozen_features else \
            adapter.training_loss(x, ty)["loss"]
        loss.backward()
        own = {id(p) for p in adapter.parameters()}
        # A staged method's later-stage tensors (2SFS's classifier) are handed to the optimiser but frozen (no
        # gradient) until their stage; every tensor that requires a gradient gets one.
        live = [p for p in adapter.trainable_parameters() if p.requires_grad]
        assert live and all(p.grad is not None for p in live)
        assert all(p.grad is None for p in adapter.trainable_parameters() if not p.requires_grad)
        assert all(id(p) in own for p in adapter.trainable_parameters())
        with torch.no_grad():  # one step
            for p in live:
                p -= 0.1 * p.grad
    assert all(not p.requires_grad and p.grad is None for p in bb.parameters())
    with torch.no_grad():
        assert torch.isfinite(adapter(test_x)).all()
        # A fit may keep its starting point (zs_probe keeps zero-shot when validation says so):
        # nudge every parameter so the loaded state is told apart from a fresh adapter's.
        gen = torch.Generator().manual_seed(9)
        for p in adapter.parameters():
            p += 0.01 * p.abs().mean().clamp_min(1e-3) * torch.randn(p.shape, generator=gen)
        trained = adapter(test_x)
    assert torch.isfinite(trained).all()

    # Saved state: adapter tensors only, nothing of the backbone.
    sd = adapter.adapter_state_dict()
    assert sd and all(v.device.type == "cpu" and not v.requires_grad for v in sd.values())
    backbone_keys = set(bb.state_dict()) | {f"backbone.{k}" for k in bb.state_dict()}
    assert not set(sd) & backbone_keys
    assert not any(k.startswith(("backbone.", "model.", "tower.")) for k in sd)
    assert sum(v.numel() for v in sd.values()) < sum(v.numel() for v in bb.parameters())
    path = tmp_path / "adapter.safetensors"
    save_file(sd, str(path))

    fresh = build_adapter(small_config(name), bb, shapes.classnames, templates,  # another init, where there is one
                          generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert not torch.equal(fresh(test_x), trained)
        fresh.load_adapter_state_dict(load_file(str(path)))
        assert torch.equal(fresh(test_x), trained)
    after = bb.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------- the registry


def test_registry_is_a_dict_of_names_configs_and_classes():
    assert {"coop", "linear_probe", "zs_probe", "lora", "zeroshot"} <= set(ADAPTERS)
    for name, info in ADAPTERS.items():
        assert name == name.lower() == info.name
        assert issubclass(info.config_cls, AdapterConfig) and info.config_cls().name == name
        assert info.adapter_cls.name == name
        assert info.adapter_cls.trained_by in ("loop", "fit", None)
    assert {n: i.adapter_cls.trained_by for n, i in ADAPTERS.items() if n in ("coop", "lora", "linear_probe",
                                                                             "zs_probe", "zeroshot")} == {
        "coop": "loop", "lora": "loop", "linear_probe": "fit", "zs_probe": "fit", "zeroshot": None}


def test_duplicate_registration_is_an_error():
    existing = dict(ADAPTERS.items())
    info = ADAPTERS["coop"]
    with pytest.raises(ValueError, match="'coop' is registered twice"):
        register_adapter("coop", info.config_cls, info.adapter_cls)
    with pytest.raises(ValueError, match="lowercase"):
        register_adapter("CoOp2", info.config_cls, info.adapter_cls)
    assert dict(ADAPTERS.items()) == existing


def test_unknown_adapter_lists_the_registered_names(toy, shapes):
    bb = toy["toy-clip"][0]
    with pytest.raises(ValueError) as e:
        build_adapter(AdapterConfig(name="cooop"), bb, shapes.classnames, ["a {}."])
    for name in ["'cooop'", *ADAPTERS]:
        assert name in str(e.value)
    with pytest.raises(ConfigError) as e:  # the same from the command line's config
        load_train_config(["adapter=cooop"])
    assert "cooop" in str(e.value) and all(name in str(e.value) for name in ADAPTERS)


def test_wrong_config_class_is_an_error(toy, shapes):
    bb = toy["toy-clip"][0]
    cfg = ADAPTERS["linear_probe"].config_cls()
    cfg.name = "coop"
    with pytest.raises(TypeError, match="CoOpConfig"):
        build_adapter(cfg, bb, shapes.classnames, ["a {}."])
