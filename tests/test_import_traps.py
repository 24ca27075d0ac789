"""No silent traps: each way a checkpoint could load with wrong numbers is an error naming the problem and the fix.

Every test here fails if its trap becomes silent again (the load succeeding, or a default taking the place of a
value the checkpoint holds or the user must give).
"""
import copy
import math
import pickle
import zipfile

import open_clip
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from fewclip.backbones.backbone import BackboneConfig, BackboneError, build_open_clip_model, load_backbone, load_weights_file, shipped_cards
from fewclip.backbones.importer import import_checkpoint
from helpers.checkpoints import meru_checkpoint, open_clip_train_checkpoint, tiny_euclip_state_dict, tiny_meru_state_dict

TINY = {"embed_dim": 16,
        "vision_cfg": {"image_size": 32, "patch_size": 16, "width": 32, "layers": 1, "head_width": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}


def card(folder, geometry: dict, *, model_cfg=None, weights=None, name="c") -> str:
    """A tiny open_clip card; the weights hold logit_scale = log(1/0.07) unless ``weights`` are given."""
    model_cfg = model_cfg or TINY
    if weights is None:
        torch.manual_seed(0)
        weights = build_open_clip_model(copy.deepcopy(model_cfg)).state_dict()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / f"{name}.safetensors"))
    c = {"name": name, "model_config": model_cfg, "weights": f"{name}.safetensors", "geometry": geometry}
    (folder / f"{name}.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(c)))
    return str(folder / f"{name}.yaml")


# ---------------------------------------------------------------- geometry parameters


@pytest.mark.parametrize("geometry, missing", [
    ({"name": "hyperbolic", "logit_scale": 1 / 0.07}, "['curvature', 'alpha_image', 'alpha_text']"),
    ({"name": "hyperbolic_sq", "logit_scale": 1 / 0.07, "curvature": 0.5}, "['alpha_image', 'alpha_text']"),
    ({"name": "euclidean_sq"}, "['logit_scale']"),
    ({"name": "clip"}, "['logit_scale']"),
    ({"name": "sigmoid", "logit_scale": 1 / 0.07}, "['logit_bias']"),
])
def test_geometry_parameters_are_never_defaulted(tmp_path, geometry, missing):
    with pytest.raises(BackboneError, match=rf"does not give {missing.replace('[', '.').replace(']', '.')}.*no default"):
        load_backbone(BackboneConfig(name=card(tmp_path, geometry), device="cpu"))


def test_missing_logit_scale_names_the_weights_value(tmp_path):
    with pytest.raises(BackboneError, match=r"weights hold logit_scale = 14\.28"):
        load_backbone(BackboneConfig(name=card(tmp_path, {"name": "euclidean"}), device="cpu"))


def test_logit_scale_must_agree_with_the_weights(tmp_path):
    # EuCLIP's case: the weights hold 1.35, a card says 10
    torch.manual_seed(0)
    sd = build_open_clip_model(copy.deepcopy(TINY)).state_dict()
    sd["logit_scale"] = torch.tensor(math.log(1.35))
    with pytest.raises(BackboneError, match=r"logit_scale is 10.0 but the weights hold logit_scale = 1\.35.*set "
                                            r"geometry.logit_scale: 1\.35"):
        load_backbone(BackboneConfig(name=card(tmp_path, {"name": "euclidean_sq", "logit_scale": 10.0}, weights=sd),
                                     device="cpu"))
    # agreeing to the weights' precision loads (float16 weights round the log: the shipped cards do this)
    sd["logit_scale"] = torch.tensor(math.log(1.35)).half()
    bb = load_backbone(BackboneConfig(name=card(tmp_path, {"name": "euclidean_sq", "logit_scale": 1.35}, weights=sd,
                                                name="ok"), device="cpu"))
    assert bb.geometry.params()["logit_scale"] == pytest.approx(1.35)


def test_logit_bias_must_agree_with_the_weights(tmp_path):
    cfg = {**TINY, "init_logit_bias": -7.0}
    with pytest.raises(BackboneError, match=r"logit_bias is -10.0 but the weights hold logit_bias = -7"):
        load_backbone(BackboneConfig(name=card(tmp_path, {"name": "sigmoid", "logit_scale": 1 / 0.07,
                                                          "logit_bias": -10.0}, model_cfg=cfg), device="cpu"))


def test_shipped_cards_agree_with_their_weights():
    for name in shipped_cards():
        load_backbone(BackboneConfig(name=name, device="cpu"))


def test_open_clip_route_hyperbolic_is_an_error(monkeypatch):
    import open_clip.factory as factory

    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-trap-tiny", TINY)
    with pytest.raises(BackboneError, match="curvature 1 and alpha 1"):
        load_backbone(BackboneConfig(name="fewclip-trap-tiny", pretrained="none", geometry="hyperbolic"))


# ---------------------------------------------------------------- files of other layouts on the open_clip route


@pytest.fixture
def arch(monkeypatch):
    import open_clip.factory as factory

    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-trap", TINY)
    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-trap-quickgelu", {**TINY, "quick_gelu": True})
    return "fewclip-trap"


def test_openai_file_under_a_gelu_architecture(tmp_path, arch):
    torch.manual_seed(0)
    sd = open_clip.create_model(arch + "-quickgelu").state_dict()
    sd.update(input_resolution=torch.tensor(32), context_length=torch.tensor(16), vocab_size=torch.tensor(49408))
    torch.save(sd, tmp_path / "openai.pt")
    with pytest.raises(BackboneError, match=r"OpenAI CLIP checkpoint.*QuickGELU.*backbone=fewclip-trap-quickgelu.*"
                                            r"fewclip import openai"):
        load_backbone(BackboneConfig(name=arch, pretrained=str(tmp_path / "openai.pt"), device="cpu"))
    # under the QuickGELU architecture OpenAI's extra keys are accepted and dropped
    bb = load_backbone(BackboneConfig(name=arch + "-quickgelu", pretrained=str(tmp_path / "openai.pt"), device="cpu"))
    assert type(bb.model.transformer.resblocks[0].mlp.gelu).__name__ == "QuickGELU"


def test_other_layouts_on_the_open_clip_route_point_to_import(tmp_path, arch):
    torch.save(open_clip_train_checkpoint(tiny_euclip_state_dict("hyperbolic")), tmp_path / "euclip.pt")
    with pytest.raises(BackboneError, match="EuCLIP's hyperbolic geometry parameters.*fewclip import euclip"):
        load_backbone(BackboneConfig(name=arch, pretrained=str(tmp_path / "euclip.pt")))
    torch.save(meru_checkpoint(tiny_meru_state_dict(0)), tmp_path / "meru.pth")
    with pytest.raises(BackboneError, match="MERU/HyCoCLIP training checkpoint.*fewclip import meru"):
        load_backbone(BackboneConfig(name=arch, pretrained=str(tmp_path / "meru.pth")))


def test_pretrained_with_a_card_is_an_error(tmp_path):
    c = card(tmp_path, {"name": "clip", "logit_scale": 1 / 0.07})
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "card.yaml").write_text((tmp_path / "c.yaml").read_text().replace(
        "weights: c.safetensors", "weights: ../c.safetensors"))
    for name in ("toy-clip", c, str(tmp_path / "folder")):
        with pytest.raises(BackboneError, match=r"backbone.pretrained=x.pt applies to open_clip architectures.*is a "
                                                r"card, which names its own weights"):
            load_backbone(BackboneConfig(name=name, pretrained="x.pt"))
    assert load_backbone(BackboneConfig(name=str(tmp_path / "folder"), device="cpu")).name == "c"  # a card folder
    with pytest.raises(BackboneError, match="backbone.geometry applies to open_clip architectures"):
        load_backbone(BackboneConfig(name="toy-clip", geometry="euclidean"))


# ---------------------------------------------------------------- the weights themselves


@pytest.mark.parametrize("damage, message", [
    (lambda sd: sd.update({"token_embedding.weight": sd["token_embedding.weight"].to(torch.int8)}),
     r"not floating point.*token_embedding.weight \(torch.int8\).*dequantized"),
    (lambda sd: sd["visual.proj"].fill_(float("nan")), r"NaN or infinite values in 1 tensors.*visual.proj"),
    (lambda sd: sd["ln_final.weight"].__setitem__(0, float("inf")), r"NaN or infinite.*ln_final.weight"),
])
def test_non_float_or_non_finite_weights_are_refused(tmp_path, damage, message):
    torch.manual_seed(0)
    sd = build_open_clip_model(copy.deepcopy(TINY)).state_dict()
    damage(sd)
    with pytest.raises(BackboneError, match=message):
        load_backbone(BackboneConfig(name=card(tmp_path, {"name": "clip", "logit_scale": 1 / 0.07}, weights=sd),
                                     device="cpu"))


def test_an_import_refuses_nan_weights_too(tmp_path):
    sd = tiny_meru_state_dict(0)
    sd["visual.norm.weight"][3] = float("nan")
    torch.save(meru_checkpoint(sd), tmp_path / "m.pth")
    with pytest.raises(BackboneError, match="NaN or infinite.*visual.trunk.norm.weight"):
        import_checkpoint("meru", tmp_path / "m.pth", tmp_path / "card", {"arch": "vit_small_patch16_224",
                                                                         "vit.patch_size": "8", "vit.embed_dim": "64",
                                                                         "vit.depth": "2", "vit.num_heads": "4"})
    assert not (tmp_path / "card").exists()


_EXECUTED = []


def _record(*args):  # what unpickling a malicious file would call
    _EXECUTED.append(args)


class _Payload:
    def __reduce__(self):
        return (_record, ("ran",))


def test_pickled_objects_are_refused_with_a_conversion_the_user_runs_knowingly(tmp_path):
    torch.save({"model": {"w": torch.ones(2)}, "args": _Payload()}, tmp_path / "ckpt.pt")
    with pytest.raises(BackboneError) as e:
        load_weights_file(tmp_path / "ckpt.pt")
    msg = str(e.value)
    assert "_record" in msg and "would run code from the file" in msg and "refusing to load" in msg
    assert "add_safe_globals([test_import_traps._record])" in msg and "weights.safetensors" in msg
    # fewclip's own words, not torch's advice (nor its terminal colour codes)
    assert "weights_only=False" not in msg and "Re-running" not in msg and "\x1b" not in msg
    assert _EXECUTED == []


def test_an_unreadable_torchscript_archive_names_the_conversion(tmp_path):
    """A TorchScript archive whose data.pkl holds an object the tensor-only reader does not rebuild."""
    with zipfile.ZipFile(tmp_path / "evil.pt", "w") as z:
        z.writestr("evil/code/__torch__.py", "class M(Module):\n  __parameters__ = []\n  __buffers__ = []\n")
        z.writestr("evil/data.pkl", pickle.dumps(_Payload(), protocol=2))
        z.writestr("evil/constants.pkl", pickle.dumps((), protocol=2))
    with pytest.raises(BackboneError) as e:
        load_weights_file(tmp_path / "evil.pt")
    msg = str(e.value)
    assert "cannot read TorchScript archive" in msg and "_record" in msg and "torch.jit.load" in msg
    assert _EXECUTED == []
