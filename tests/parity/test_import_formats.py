"""`fewclip import`: each format's checkpoints, in the authors' own file layouts, give the authors' logits.

The reference logits in tests/fixtures/import_*.json were computed by the authors' own code
(MERU, HyCoCLIP, the EuCLIP fork of open_clip, OpenAI's CLIP; each file names the repository
and commit) on the very checkpoints that tests/checkpoint_layouts.py regenerates from a
seed, with the same images (PIL, through each side's own preprocessing) and the same class
names and templates. CI needs none of their code. open_clip's own checkpoints are checked
against open_clip itself, which is installed.
"""
import json
import math

import open_clip
import pytest
import torch
from safetensors.torch import load_file

from fewclip.backbones.backbone import BackboneError
from fewclip.backbones.formats.open_clip import resolve_model
from fewclip.backbones.importer import FORMATS, CheckpointImportError, import_checkpoint
from fewclip.cli.main import main
from fewclip.features.encode import text_prototypes
from helpers.checkpoints import (
    CLASSNAMES,
    MERU_IMPORT_OPTIONS,
    TEMPLATES,
    euclip_model_config,
    meru_checkpoint,
    open_clip_train_checkpoint,
    openai_archive,
    tiny_euclip_state_dict,
    tiny_images,
    tiny_meru_state_dict,
    tiny_openai_fp16,
)
from helpers.parity import FIXTURE_ROOT
from helpers.tiny_clip import state_sha256

FIXTURES = FIXTURE_ROOT
TOL = 1e-4


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"import_{name}.json").read_text())


def zeroshot(bb) -> torch.Tensor:
    """fewclip's zero-shot logits [4, 5] on the fixture images, through the card's own preprocessing."""
    pre = bb.preprocess()
    pixels = torch.stack([pre(im) for im in tiny_images()])
    return bb.geometry.image_logits(bb.encode_images(pixels), text_prototypes(bb, CLASSNAMES, TEMPLATES))


def assert_matches(logits: torch.Tensor, reference, tol: float = TOL) -> float:
    ref = torch.tensor(reference, dtype=torch.float32)
    diff = float((logits - ref).abs().max())
    assert diff <= tol, f"largest logit difference {diff:.3g} > {tol}"
    assert torch.equal(logits.argsort(dim=1), ref.argsort(dim=1)), "rankings differ"
    return diff


def test_every_format_is_registered():
    assert {"meru", "hycoclip", "euclip", "openai", "open_clip"} <= set(FORMATS)
    assert FORMATS["hycoclip"].read is FORMATS["meru"].read  # the same files (see fewclip/backbones/formats/meru.py)


# ---------------------------------------------------------------- MERU and HyCoCLIP


@pytest.fixture(scope="module")
def meru_cards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("meru")
    cards = {}
    for variant, hyperbolic in (("hyperbolic", True), ("clip_baseline", False)):
        sd = tiny_meru_state_dict(0, hyperbolic=hyperbolic)
        torch.save(meru_checkpoint(sd), folder / f"{variant}.pth")
        cards[variant] = (sd, *import_checkpoint("meru", folder / f"{variant}.pth", folder / variant,
                                                 MERU_IMPORT_OPTIONS))
    return cards


@pytest.mark.parametrize("authors", ["meru", "hycoclip"])
@pytest.mark.parametrize("variant", ["hyperbolic", "clip_baseline"])
def test_meru_logits_equal_the_authors(meru_cards, authors, variant):
    ref = fixture(authors)["variants"][variant]
    sd, card, bb = meru_cards[variant]
    assert state_sha256(sd) == ref["state_sha256"]  # the same weights the authors' code ran on
    assert bb.geometry.name == ("hyperbolic" if variant == "hyperbolic" else "clip")
    assert bb.geometry.params() == pytest.approx(ref["geometry"], rel=1e-6)
    for prompt, ids in ref["tokens"].items():  # MERU's tokenizer and fewclip's give the same ids
        assert bb.tokenize([prompt])[0, : len(ids)].tolist() == ids
    assert_matches(zeroshot(bb), ref["logits"])


def test_meru_clamps_and_stored_logs(meru_cards):
    """The stored logs are exponentiated and clamped as MERU.forward does (the checkpoint exceeds two clamps)."""
    _, card, bb = meru_cards["hyperbolic"]
    p = bb.geometry.params()
    assert p["logit_scale"] == pytest.approx(math.exp(4.6052), rel=1e-6)  # stored 4.7, MERU clamps at 4.6052
    assert p["alpha_text"] == pytest.approx(1.0)  # stored log 0.02 > 0, clamped to 0
    assert p["curvature"] == pytest.approx(0.5, rel=1e-6) and p["alpha_image"] == pytest.approx(0.4, rel=1e-6)
    weights = load_file(str(card.parent / "weights.safetensors"))
    assert float(weights["logit_scale"]) == pytest.approx(4.6052, abs=1e-6)  # the weights agree with the card
    # MERU normalises pixels inside the model with its stored ImageNet statistics: the card's preprocessing
    assert bb.mean == pytest.approx((0.485, 0.456, 0.406)) and bb.std == pytest.approx((0.229, 0.224, 0.225))


def test_meru_towers_are_the_authors(meru_cards):
    _, _, bb = meru_cards["hyperbolic"]
    trunk = bb.model.visual.trunk
    assert [b.attn.num_heads for b in trunk.blocks] == [4, 4]
    norms = [m for m in trunk.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms and all(m.eps == 1e-5 for m in norms)  # MERU's nn.LayerNorm, not timm's 1e-6
    text = bb.model.text
    assert text.transformer.resblocks[0].attn.num_heads == 2  # width 128 // 64, MERU's rule
    assert type(text.transformer.resblocks[0].mlp.gelu) is torch.nn.GELU  # GELU, not QuickGELU
    assert text.pool_type == "argmax" and text.attn_mask is not None and not isinstance(text.ln_final, torch.nn.Identity)


def test_a_wrong_head_count_changes_the_logits(tmp_path):
    """What the strict load cannot see: the same tensors with other heads give other numbers."""
    torch.save(meru_checkpoint(tiny_meru_state_dict(0)), tmp_path / "m.pth")
    _, bb = import_checkpoint("meru", tmp_path / "m.pth", tmp_path / "card", {**MERU_IMPORT_OPTIONS, "vit.num_heads": "2"})
    diff = (zeroshot(bb) - torch.tensor(fixture("meru")["variants"]["hyperbolic"]["logits"])).abs().max()
    assert diff > 100 * TOL


def test_meru_vit_s_is_mocov3_with_12_heads_and_eps_1e5():
    """MERU's vit_small_mocov3_patch16_224 (12 heads), not timm's vit_small_patch16_224 (6 heads)."""
    from fewclip.backbones.formats.meru import _timm_vit
    from fewclip.backbones.towers import TimmImageTower

    name, kwargs = _timm_vit("vit_small_mocov3_patch16_224", {})
    tower = TimmImageTower({"timm_model": name, "timm_kwargs": kwargs, "norm_eps": 1e-5, "image_size": 224}, 512)
    assert tower.trunk.blocks[0].attn.num_heads == 12 and tower.trunk.embed_dim == 384 and len(tower.trunk.blocks) == 12
    assert tower.trunk.norm.eps == 1e-5 and tower.trunk.blocks[0].norm1.eps == 1e-5


def test_meru_needs_its_arch(tmp_path):
    torch.save(meru_checkpoint(tiny_meru_state_dict(0)), tmp_path / "m.pth")
    with pytest.raises(CheckpointImportError, match=r"needs arch=.*vit_small_mocov3_patch16_224"):
        import_checkpoint("meru", tmp_path / "m.pth", tmp_path / "card", {})
    with pytest.raises(CheckpointImportError, match="not a timm ViT name"):
        import_checkpoint("meru", tmp_path / "m.pth", tmp_path / "card", {"arch": "resnet50"})
    # the image tower MERU builds for a published arch, on tiny weights: a shape mismatch, named
    with pytest.raises(BackboneError, match="do not match the declared architecture"):
        import_checkpoint("meru", tmp_path / "m.pth", tmp_path / "card", {"arch": "vit_base_patch16_224"})
    assert not (tmp_path / "card").exists()  # nothing half-written is left behind


# ---------------------------------------------------------------- EuCLIP


@pytest.fixture(scope="module")
def euclip_cards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("euclip")
    (folder / "tiny-no-final-ln.json").write_text(json.dumps(euclip_model_config()))  # the fork's JSON format
    cards = {}
    for geometry, ref in fixture("euclip")["geometries"].items():
        sd = tiny_euclip_state_dict(geometry)
        torch.save(open_clip_train_checkpoint(sd, name=f"euclip-{geometry}"), folder / f"{geometry}.pt")
        cards[geometry] = (sd, *import_checkpoint(
            "euclip", folder / f"{geometry}.pt", folder / geometry,
            {"geometry": ref["fork_name"], "model_config": str(folder / "tiny-no-final-ln.json")}))
    return cards


@pytest.mark.parametrize("geometry", ["euclidean_sq", "hyperbolic", "elliptic"])
def test_euclip_logits_equal_the_authors(euclip_cards, geometry):
    ref = fixture("euclip")["geometries"][geometry]
    sd, card, bb = euclip_cards[geometry]
    assert state_sha256(sd) == ref["state_sha256"]
    assert bb.geometry.name == geometry
    params = {k: v for k, v in bb.geometry.params().items() if k != "exp_map_clamp"}
    assert params == pytest.approx(ref["geometry"], rel=1e-6)
    assert isinstance(bb.model.ln_final, torch.nn.Identity) and isinstance(bb.model.visual.ln_post, torch.nn.Identity)
    assert_matches(zeroshot(bb), ref["logits"])


def test_euclip_reads_and_clamps_the_stored_logs(euclip_cards):
    p = euclip_cards["hyperbolic"][2].geometry.params()
    assert p["curvature"] == 10.0  # stored log 2.5 (exp 12.2), clamped to [0.1, 10] as the fork's forward does
    assert p["alpha_image"] == pytest.approx(0.2, rel=1e-6) and p["alpha_text"] == pytest.approx(0.3, rel=1e-6)
    assert p["exp_map_clamp"] is False  # the fork's exponential map has no cap on sinh's input
    assert euclip_cards["euclidean_sq"][2].geometry.params()["logit_scale"] == pytest.approx(1.35, rel=1e-6)


def test_euclip_geometry_is_required_and_checked(tmp_path):
    sd = tiny_euclip_state_dict("hyperbolic")
    torch.save(open_clip_train_checkpoint(sd), tmp_path / "h.pt")
    (tmp_path / "cfg.json").write_text(json.dumps(euclip_model_config()))
    opts = {"model_config": str(tmp_path / "cfg.json")}
    with pytest.raises(CheckpointImportError, match=r"needs geometry=.*not stored in the checkpoint"):
        import_checkpoint("euclip", tmp_path / "h.pt", tmp_path / "c", opts)
    with pytest.raises(CheckpointImportError, match="only the fork's hyperbolic models have"):
        import_checkpoint("euclip", tmp_path / "h.pt", tmp_path / "c", {**opts, "geometry": "euclidean-squared"})
    with pytest.raises(CheckpointImportError, match="hyperbolic-inner.*has no fewclip geometry"):
        import_checkpoint("euclip", tmp_path / "h.pt", tmp_path / "c", {**opts, "geometry": "hyperbolic-inner"})
    torch.save(open_clip_train_checkpoint(tiny_euclip_state_dict("euclidean_sq")), tmp_path / "e.pt")
    with pytest.raises(CheckpointImportError, match=r"store alpha_img, alpha_txt, curvature.*holds none"):
        import_checkpoint("euclip", tmp_path / "e.pt", tmp_path / "c", {**opts, "geometry": "hyperbolic-squared"})
    # fewclip's own names are accepted too
    _, bb = import_checkpoint("euclip", tmp_path / "h.pt", tmp_path / "c", {**opts, "geometry": "hyperbolic_sq"})
    assert bb.geometry.name == "hyperbolic_sq"


def test_euclip_model_names():
    entry, cfg, final_ln, _ = resolve_model({"model": "ViT-B-16-no-final-ln"})
    assert entry == {"architecture": "ViT-B-16"} and final_ln is False
    assert cfg["vision_cfg"]["width"] == 768
    entry, _, final_ln, _ = resolve_model({"model": "ViT-B-16"})
    assert entry == {"architecture": "ViT-B-16"} and final_ln is True
    with pytest.raises(CheckpointImportError, match="not an open_clip architecture"):
        resolve_model({"model": "ViT-Q-99"})


# ---------------------------------------------------------------- OpenAI


@pytest.mark.parametrize("kind", ["torchscript", "state_dict"])
def test_openai_logits_equal_the_authors(tmp_path, kind):
    ref = fixture("openai")
    sd = tiny_openai_fp16(0)
    assert state_sha256(sd) == ref["state_sha256"]
    if kind == "torchscript":
        openai_archive(tmp_path / "ViT-tiny.pt")
    else:
        torch.save(dict(sd), tmp_path / "ViT-tiny.pt")
    card, bb = import_checkpoint("openai", tmp_path / "ViT-tiny.pt", tmp_path / "card")
    assert bb.geometry.params()["logit_scale"] == pytest.approx(ref["logit_scale"], rel=1e-6)
    blocks = bb.model.visual.transformer.resblocks
    assert type(blocks[0].mlp.gelu).__name__ == "QuickGELU" and blocks[0].attn.num_heads == 2
    assert_matches(zeroshot(bb), ref["logits"])


# ---------------------------------------------------------------- open_clip


def test_open_clip_train_checkpoint_equals_open_clip(tmp_path, monkeypatch):
    import open_clip.factory as factory

    cfg = {"embed_dim": 32, "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2,
                                           "head_width": 16},
           "text_cfg": {"context_length": 20, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 2}}
    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-test-oc", cfg)
    torch.manual_seed(5)
    model = open_clip.create_model("fewclip-test-oc", pretrained=None).eval()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(42.0))
    torch.save(open_clip_train_checkpoint(model.state_dict(), name="my-run"), tmp_path / "epoch_3.pt")
    with pytest.raises(CheckpointImportError, match="give the architecture"):
        import_checkpoint("open_clip", tmp_path / "epoch_3.pt", tmp_path / "card")
    card, bb = import_checkpoint("open_clip", tmp_path / "epoch_3.pt", tmp_path / "card", {"model": "fewclip-test-oc"})
    assert bb.geometry.name == "clip" and bb.geometry.params()["logit_scale"] == pytest.approx(42.0, rel=1e-6)
    # open_clip's own zero-shot classifier and logits on the same weights
    tok = open_clip.get_tokenizer("fewclip-test-oc")
    pre = open_clip.image_transform(32, is_train=False)
    with torch.no_grad():
        classifier = open_clip.build_zero_shot_classifier(model, tok, CLASSNAMES, TEMPLATES, device="cpu",
                                                          use_tqdm=False)
        img = model.encode_image(torch.stack([pre(im) for im in tiny_images()]), normalize=True)
        expected = model.logit_scale.exp() * img @ classifier
    assert_matches(zeroshot(bb), expected.tolist(), tol=1e-5)


# ---------------------------------------------------------------- the command


def test_import_command_writes_a_card_folder_that_every_command_takes(tmp_path, capsys):
    torch.save(meru_checkpoint(tiny_meru_state_dict(0)), tmp_path / "meru_vit_tiny.pth")
    args = ["import", "hycoclip", str(tmp_path / "meru_vit_tiny.pth"), f"out={tmp_path / 'card'}"]
    assert main(args + [f"{k}={v}" for k, v in MERU_IMPORT_OPTIONS.items()]) == 0
    out = capsys.readouterr().out
    assert "geometry hyperbolic" in out and f"backbone={tmp_path / 'card'}" in out
    assert sorted(p.name for p in (tmp_path / "card").iterdir()) == ["card.yaml", "weights.safetensors"]
    # backbone=DIR in a zero-shot run
    assert main(["zeroshot", f"backbone={tmp_path / 'card'}", "data=toy-shapes", "data.max_test=8",
                 f"out={tmp_path / 'zs'}"]) == 0
    metrics = json.loads((tmp_path / "zs" / "metrics.json").read_text())
    assert metrics["backbone_info"]["geometry"] == "hyperbolic" and metrics["n_test"] == 8
    # the folder is taken; an unknown option and a missing out= are errors naming them
    assert main(args + [f"{k}={v}" for k, v in MERU_IMPORT_OPTIONS.items()]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert main(args[:3] + [f"out={tmp_path / 'c2'}", "arch=vit_base_patch16_224", "heads=4"]) == 2
    assert "does not take ['heads']" in capsys.readouterr().err
    assert main(args[:3]) == 2 and "out=DIR is required" in capsys.readouterr().err
    assert main(["import"]) == 0 and "euclip" in capsys.readouterr().out


def test_open_clip_preprocessing_is_asked_for_where_published_weights_differ():
    """SigLIP's webli weights squash the image and use mean/std 0.5; a file does not say it holds them."""
    from fewclip.backbones.formats.open_clip import preprocess
    from fewclip.backbones.preprocess import PreprocessConfig

    with pytest.raises(CheckpointImportError, match=r"ViT-B-16-SigLIP are preprocessed otherwise \(webli: resize_mode "
                                                    r"squash, mean \[0.5, 0.5, 0.5\].*pretrained=TAG"):
        preprocess({}, {}, "ViT-B-16-SigLIP")
    # mean and std alone leave the resize mode open: still an error, naming what is missing
    with pytest.raises(CheckpointImportError, match=r"webli: resize_mode squash\)"):
        preprocess({}, {"mean": "0.5,0.5,0.5", "std": "0.5,0.5,0.5"}, "ViT-B-16-SigLIP")
    pre, note = preprocess({}, {"pretrained": "webli"}, "ViT-B-16-SigLIP")
    assert pre == PreprocessConfig(224, "squash", "bicubic", (0.5,) * 3, (0.5,) * 3) and "webli" in note
    given = {"mean": "0.5,0.5,0.5", "std": "0.5,0.5,0.5", "resize_mode": "squash"}
    assert preprocess({}, given, "ViT-B-16-SigLIP")[0] == pre  # every differing field given: weights of one's own
    with pytest.raises(CheckpointImportError, match="drop mean="):
        preprocess({}, {"pretrained": "webli", "mean": "0.5,0.5,0.5"}, "ViT-B-16-SigLIP")
    with pytest.raises(CheckpointImportError, match="not a published open_clip tag of ViT-B-16-SigLIP.*webli"):
        preprocess({}, {"pretrained": "laion2b"}, "ViT-B-16-SigLIP")
    with pytest.raises(CheckpointImportError, match="three comma-separated numbers"):
        preprocess({}, {"mean": "0.5,0.5", "std": "a,b,c"}, "ViT-B-16-SigLIP")
    with pytest.raises(CheckpointImportError, match="resize_mode must be one of"):
        preprocess({}, {"resize_mode": "crop"}, "ViT-B-32")
    assert preprocess({}, {}, "ViT-B-32")[0] == PreprocessConfig(224)  # every tag uses open_clip's default
