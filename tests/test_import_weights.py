"""Published weights preprocessed and loaded as their authors do (issue 26).

Each test fails if its point becomes silent again: the preprocessing of every resize mode and of every published
open_clip tag, known-weight fingerprints (a ``clip.load(jit=False)`` file under a GELU architecture), the authors'
MERU/HyCoCLIP head counts, errors naming the user's file and the ``-no-final-ln`` architecture, tokenizer folders
that need ``sentencepiece``, no misleading open_clip log line, and MERU's saturated-template rule.
"""
import copy
import json
import logging
import math
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from safetensors.torch import save_file

from fewclip.backbones import fingerprints
from fewclip.backbones.backbone import BackboneConfig, BackboneError, build_open_clip_model, load_backbone, load_weights_file
from fewclip.backbones.formats.openai import openai_model_config
from fewclip.backbones.importer import CheckpointImportError, import_checkpoint
from fewclip.backbones.preprocess import PreprocessConfig
from fewclip.backbones.tokenizer import TokenizerNotFound, load_hf_tokenizer
from fewclip.cli.main import main
from helpers import checkpoints as checkpoint_layouts
from helpers.checkpoints import (
    MERU_IMPORT_OPTIONS,
    meru_checkpoint,
    open_clip_train_checkpoint,
    openai_archive,
    tiny_euclip_state_dict,
    tiny_meru_state_dict,
    tiny_openai_fp16,
)

TINY = {"embed_dim": 16,
        "vision_cfg": {"image_size": 32, "patch_size": 16, "width": 32, "layers": 1, "head_width": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}


def images():
    """Images of other aspect ratios than the model's (wide, tall, tiny, square), so every resize mode matters."""
    rng = np.random.RandomState(3)
    return [Image.fromarray(rng.randint(0, 256, size=(h, w, 3)).astype(np.uint8), "RGB")
            for h, w in ((40, 71), (57, 30), (20, 13), (48, 48))]


def tiny_card(folder: Path, preprocess=None, name="c") -> str:
    torch.manual_seed(0)
    sd = build_open_clip_model(copy.deepcopy(TINY)).state_dict()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / f"{name}.safetensors"))
    card = {"name": name, "model_config": TINY, "weights": f"{name}.safetensors",
            "geometry": {"name": "clip", "logit_scale": float(sd["logit_scale"].exp())}}
    if preprocess is not None:
        card["preprocess"] = preprocess
    (folder / f"{name}.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(card)))
    return str(folder / f"{name}.yaml")


# ---------------------------------------------------------------- 1. preprocessing as data


@pytest.mark.parametrize("section", [
    {"resize_mode": "shortest"},
    {"resize_mode": "squash", "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]},
    {"resize_mode": "longest", "fill_color": 128},
    {"resize_mode": "squash", "interpolation": "bilinear"},
    {"resize_mode": "longest", "interpolation": "bilinear"},
])
def test_each_resize_mode_equals_open_clips_image_transform(tmp_path, section):
    bb = load_backbone(BackboneConfig(name=tiny_card(tmp_path, section), device="cpu"))
    ref = open_clip.image_transform(32, is_train=False, mean=section.get("mean"), std=section.get("std"),
                                    resize_mode=section["resize_mode"], interpolation=section.get("interpolation"),
                                    fill_color=section.get("fill_color", 0))
    ours = bb.preprocess()
    for im in images():
        assert torch.equal(ours(im), ref(im))
    # and the modes are not the same pixels: the wide image differs from the default pipeline's
    if section.get("resize_mode") != "shortest":
        assert not torch.equal(ours(images()[0]), open_clip.image_transform(32, is_train=False)(images()[0]))
    assert bb.describe()["preprocess"] == PreprocessConfig.from_mapping(section, 32).to_dict()


def test_a_card_preprocess_section_is_checked(tmp_path):
    for section, message in (({"resize_mode": "crop"}, "resize_mode must be one of"),
                             ({"size": 64}, "size is 64 but the image tower takes 32px"),
                             ({"mean": [0.5, 0.5]}, "mean must be three numbers"),
                             ({"fill": 3}, "unknown keys \\['fill'\\]")):
        with pytest.raises(BackboneError, match=f"card .*: .*{message}"):
            load_backbone(BackboneConfig(name=tiny_card(tmp_path, section), device="cpu"))


def test_every_published_open_clip_tag_gets_its_own_preprocessing():
    """fewclip's configuration of each (architecture, tag) is open_clip's own (its defaults merged with the tag's
    pretrained configuration, as create_model does), and the pixels of each distinct one are image_transform's."""
    from open_clip.transform import PreprocessCfg, image_transform_v2, merge_preprocess_dict

    seen = {}
    tags = open_clip.list_pretrained()
    for arch, tag in tags:
        ours = PreprocessConfig.for_open_clip_tag(arch, tag, 224)
        theirs = merge_preprocess_dict(PreprocessCfg(), open_clip.get_pretrained_cfg(arch, tag))
        assert ours.to_dict() == {**{k: theirs[k] for k in ("resize_mode", "interpolation", "fill_color")},
                                  "size": 224, "mean": list(theirs["mean"]), "std": list(theirs["std"])}, (arch, tag)
        seen.setdefault(ours, theirs)
    assert len(tags) > 100 and {c.resize_mode for c in seen} >= {"shortest", "squash"}
    assert {c.interpolation for c in seen} == {"bicubic", "bilinear"}
    im = images()[0].resize((300, 170))
    for ours, theirs in seen.items():
        assert torch.equal(ours.transform()(im), image_transform_v2(PreprocessCfg(**{**theirs, "size": 224}),
                                                                    is_train=False)(im))
    # the example of issue 26: SigLIP's webli weights squash the image and use 0.5
    siglip = PreprocessConfig.for_open_clip_tag("ViT-B-16-SigLIP", "webli", 224)
    assert siglip.resize_mode == "squash" and siglip.mean == (0.5, 0.5, 0.5)


@pytest.fixture
def arch(monkeypatch):
    """Tiny open_clip architectures, GELU and QuickGELU, with tags preprocessed otherwise (and one QuickGELU tag)."""
    import open_clip.factory as factory
    import open_clip.pretrained as pretrained

    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-w", TINY)
    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-w-quickgelu", {**TINY, "quick_gelu": True})
    monkeypatch.setitem(pretrained._PRETRAINED, "fewclip-w", {
        "squashed": {"url": "", "hf_hub": "nowhere/", "resize_mode": "squash", "interpolation": "bilinear",
                     "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)},
        "oai": {"url": "", "hf_hub": "nowhere/", "quick_gelu": True}})
    monkeypatch.setitem(pretrained._PRETRAINED, "fewclip-w-quickgelu", {"oai": {"url": "", "hf_hub": "nowhere/",
                                                                                "quick_gelu": True}})
    return "fewclip-w"


def test_a_tag_is_loaded_with_its_preprocessing_and_its_activation(arch, monkeypatch):
    made = []

    def create_model(name, pretrained=None, **kwargs):  # open_clip's, without the download
        made.append((name, pretrained))
        return build_open_clip_model(copy.deepcopy(open_clip.factory.get_model_config(name)))

    monkeypatch.setattr(open_clip, "create_model", create_model)
    bb = load_backbone(BackboneConfig(name=arch, pretrained="squashed", device="cpu"))
    assert bb.preprocess_cfg == PreprocessConfig(32, "squash", "bilinear", (0.5,) * 3, (0.5,) * 3)
    # a QuickGELU tag under the GELU name: open_clip only warns; fewclip refuses before building, naming the fix
    with pytest.raises(BackboneError, match="trained with QuickGELU and fewclip-w uses GELU.*backbone=fewclip-w-quickgelu "
                                            "backbone.pretrained=oai"):
        load_backbone(BackboneConfig(name=arch, pretrained="oai", device="cpu"))
    assert made == [(arch, "squashed")]
    bb = load_backbone(BackboneConfig(name=arch + "-quickgelu", pretrained="oai", device="cpu"))
    assert bb.preprocess_cfg == PreprocessConfig(32)


def test_the_preprocessing_is_part_of_the_feature_store_address(tmp_path):
    from fewclip.datasets import DataConfig, build_dataset
    from fewclip.features.store import FeatureStore, address

    data = build_dataset(DataConfig(name="toy-shapes"))
    store = FeatureStore(tmp_path / "store")
    groups = set()
    for i, section in enumerate(({}, {"resize_mode": "longest"}, {"resize_mode": "longest", "fill_color": 255})):
        bb = load_backbone(BackboneConfig(name=tiny_card(tmp_path, section, name=f"c{i}"), device="cpu"))
        addr = address(bb, data, None, 8)
        assert addr["transform"]["preprocess"] == bb.preprocess_cfg.to_dict()
        groups.add(store.group({**addr, "weights": "same", "backbone": "same"}).digest)
    assert len(groups) == 3  # the fill colour alone is not in open_clip's transform repr, and still counts


def test_fewclip_backbones_name_shows_the_preprocessing(tmp_path, capsys):
    assert main(["backbones", "ViT-B-16-SigLIP"]) == 0
    out = capsys.readouterr().out
    assert "backbone.pretrained=webli: squashed to 224x224 (bicubic); mean [0.5, 0.5, 0.5]" in out
    assert "pretrained=FILE: refused unless the file is recognised" in out
    assert main(["backbones", "ViT-B-32"]) == 0
    assert "pretrained=openai: shorter side to 224, centre crop 224x224 (bicubic)" in capsys.readouterr().out
    assert main(["backbones", tiny_card(tmp_path, {"resize_mode": "longest", "fill_color": 7})]) == 0
    assert "images: longer side to 32, padded to 32x32 with 7 (bicubic)" in capsys.readouterr().out


# ---------------------------------------------------------------- 2. known-weight fingerprints


def test_fingerprints_ignore_file_format_dtype_and_key_prefixes(tmp_path):
    openai_archive(tmp_path / "published.pt")  # OpenAI's layout: a TorchScript archive in float16
    published = load_weights_file(tmp_path / "published.pt")
    fp = fingerprints.fingerprint(published)
    assert fp is not None and len(fp) == 32
    sd = {k: v.float() for k, v in published.items()}
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "w.safetensors"))
    torch.save({"state_dict": {f"module.{k}": v.to(torch.bfloat16) for k, v in sd.items()}}, tmp_path / "w.pt")
    for path in (tmp_path / "w.safetensors", tmp_path / "w.pt"):
        assert fingerprints.fingerprint(load_weights_file(path)) == fp
    assert fingerprints.fingerprint({f"_orig_mod.model.{k}": v for k, v in sd.items()}) == fp
    assert fingerprints.fingerprint(tiny_openai_fp16(seed=1)) != fp  # other weights
    assert fingerprints.fingerprint({"w": torch.ones(2)}) is None  # nothing named: no fingerprint


def test_the_table_lists_what_needs_a_fingerprint():
    entries = fingerprints.known_weights()
    oai = [e for e in entries if e.name == "open_clip ViT-B-32/openai"]
    assert oai and oai[0].architecture == "ViT-B-32-quickgelu" and oai[0].quick_gelu is True
    assert any(e.architecture == "vit_small_mocov3_patch16_224" and e.num_heads == 12 for e in entries)
    assert fingerprints.identify(tiny_openai_fp16()) is None  # an empty fingerprint matches nothing
    assert all(len(e.fingerprint) in (0, 32) for e in entries)


@pytest.fixture
def published_openai(tmp_path, monkeypatch):
    """OpenAI-style published weights (an archive in float16 with the integer entries), the table knowing them, and
    a user's file of them as clip.load(jit=False) gives it: build_model's float32 state dict, integer entries gone."""
    import open_clip.factory as factory

    openai_archive(tmp_path / "ViT-tiny.pt")
    archive = load_weights_file(tmp_path / "ViT-tiny.pt")
    assert {"input_resolution", "context_length", "vocab_size"} <= set(archive)
    entry = fingerprints.KnownWeights("OpenAI CLIP ViT-tiny", "fewclip-oai-quickgelu", "", quick_gelu=True,
                                      fingerprint=fingerprints.fingerprint(archive))
    monkeypatch.setattr(fingerprints, "known_weights", lambda: (entry,))
    cfg = openai_model_config(archive)
    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-oai", {**cfg, "quick_gelu": False})
    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-oai-quickgelu", cfg)
    # (the archive is traced from an open_clip model, which keeps the causal mask as a buffer; OpenAI's does not)
    model = open_clip.model.build_model_from_openai_state_dict(
        {k: v.clone() for k, v in archive.items() if k != "attn_mask"}).float()
    user = model.state_dict()
    assert not {"input_resolution", "context_length", "vocab_size"} & set(user)
    torch.save(user, tmp_path / "clip_vit_tiny.pt")
    return tmp_path / "clip_vit_tiny.pt"


def test_a_clip_load_state_dict_under_a_gelu_architecture_is_refused(published_openai, tmp_path):
    with pytest.raises(BackboneError, match=r"clip_vit_tiny.pt holds the published weights OpenAI CLIP ViT-tiny "
                                            r"\(recognised by their fingerprint\), trained with QuickGELU; fewclip-oai "
                                            r"uses GELU.*backbone=fewclip-oai-quickgelu"):
        load_backbone(BackboneConfig(name="fewclip-oai", pretrained=str(published_openai), device="cpu"))
    with pytest.raises(CheckpointImportError, match=r"trained with QuickGELU.*Import it with model=fewclip-oai-quickgelu"):
        import_checkpoint("open_clip", published_openai, tmp_path / "card", {"model": "fewclip-oai"})
    bb = load_backbone(BackboneConfig(name="fewclip-oai-quickgelu", pretrained=str(published_openai), device="cpu"))
    assert type(bb.model.transformer.resblocks[0].mlp.gelu).__name__ == "QuickGELU"


def test_a_recognised_file_gets_its_tags_preprocessing(arch, tmp_path, monkeypatch):
    """A local file of fewclip-w's "squashed" weights: ambiguous by itself, its tag's preprocessing once recognised."""
    torch.manual_seed(0)
    sd = open_clip.create_model(arch).state_dict()
    torch.save(sd, tmp_path / "w.pt")
    with pytest.raises(BackboneError, match=r"preprocessed otherwise than its default \(squashed: resize_mode squash"):
        load_backbone(BackboneConfig(name=arch, pretrained=str(tmp_path / "w.pt"), device="cpu"))
    entry = fingerprints.KnownWeights("fewclip-w squashed", arch, "squashed", quick_gelu=False,
                                      fingerprint=fingerprints.fingerprint(sd))
    monkeypatch.setattr(fingerprints, "known_weights", lambda: (entry,))
    bb = load_backbone(BackboneConfig(name=arch, pretrained=str(tmp_path / "w.pt"), device="cpu"))
    assert bb.preprocess_cfg == PreprocessConfig.for_open_clip_tag(arch, "squashed", 32)
    assert bb.preprocess_cfg.resize_mode == "squash" and bb.preprocess_cfg.interpolation == "bilinear"


def test_without_the_fingerprint_the_same_file_would_load_silently(published_openai, monkeypatch):
    """What the table prevents: the shapes agree, so nothing else stops it."""
    monkeypatch.setattr(fingerprints, "known_weights", lambda: ())
    bb = load_backbone(BackboneConfig(name="fewclip-oai", pretrained=str(published_openai), device="cpu"))
    assert type(bb.model.transformer.resblocks[0].mlp.gelu) is torch.nn.GELU


# ---------------------------------------------------------------- 3. MERU / HyCoCLIP architectures


@pytest.fixture
def meru_vit_s(tmp_path, monkeypatch):
    """A MERU file whose image tower has ViT-S's width (384) and 12-head layout, in 2 layers."""
    monkeypatch.setattr(checkpoint_layouts, "MERU_VIT", dict(patch_size=16, embed_dim=384, depth=2, num_heads=12))
    torch.save(meru_checkpoint(tiny_meru_state_dict(0)), tmp_path / "meru_vit_s.pth")
    return tmp_path / "meru_vit_s.pth"


@pytest.mark.parametrize("fmt", ["meru", "hycoclip"])
def test_timms_vit_s_for_a_meru_file_names_the_authors_arch(meru_vit_s, tmp_path, fmt):
    with pytest.raises(CheckpointImportError, match=r"arch=vit_small_patch16_224 builds a ViT with 6 heads.*width 384.*"
                                                    r"use arch=vit_small_mocov3_patch16_224"):
        import_checkpoint(fmt, meru_vit_s, tmp_path / "card", {"arch": "vit_small_patch16_224", "vit.depth": "2"})
    _, bb = import_checkpoint(fmt, meru_vit_s, tmp_path / "card", {"arch": "vit_small_mocov3_patch16_224",
                                                                   "vit.depth": "2"})
    trunk = bb.model.visual.trunk
    assert trunk.blocks[0].attn.num_heads == 12 and trunk.norm.eps == 1e-5


def test_the_authors_vit_table():
    from fewclip.backbones.formats.meru import AUTHORS_VITS, _timm_heads, _timm_vit

    for width, (arch, heads, eps) in AUTHORS_VITS.items():
        name, kwargs = _timm_vit(arch, {})
        assert _timm_heads(name, kwargs) == heads and eps == 1e-5
    assert _timm_heads(*_timm_vit("vit_small_patch16_224", {})) == 6  # timm's ViT-S, the trap


def test_a_known_meru_fingerprint_holds_the_heads_too(meru_vit_s, tmp_path, monkeypatch):
    from fewclip.backbones.formats.meru import _state_dict

    entry = fingerprints.KnownWeights("MERU ViT-S", "vit_small_mocov3_patch16_224", num_heads=12,
                                      fingerprint=fingerprints.fingerprint(_state_dict(meru_vit_s)))
    monkeypatch.setattr(fingerprints, "known_weights", lambda: (entry,))
    with pytest.raises(CheckpointImportError, match=r"holds the published weights MERU ViT-S.*12 heads.*builds 6.*"
                                                    r"arch=vit_small_mocov3_patch16_224"):  # even with heads given
        import_checkpoint("meru", meru_vit_s, tmp_path / "card", {"arch": "vit_small_patch16_224", "vit.depth": "2",
                                                                  "vit.num_heads": "6"})


# ---------------------------------------------------------------- 4. errors name the user's file


def _nan(sd, key):
    sd[key] = sd[key].clone()
    sd[key].view(-1)[0] = float("nan")


@pytest.mark.parametrize("damage, options, message", [
    (lambda sd: _nan(sd, "visual.norm.weight"), {}, "NaN or infinite values"),
    (lambda sd: sd.update({"visual.norm.weight": sd["visual.norm.weight"].to(torch.int8)}), {}, "not floating point"),
    (lambda sd: sd.update({"curv": torch.tensor(float("nan"))}), {}, "curvature"),
    (lambda sd: None, {"arch": "vit_base_patch16_224"}, "do not match the declared architecture"),
])
def test_import_errors_name_the_users_file_not_a_temporary_folder(tmp_path, damage, options, message):
    sd = tiny_meru_state_dict(0)
    damage(sd)
    torch.save(meru_checkpoint(sd), tmp_path / "m.pth")
    with pytest.raises(BackboneError) as e:
        import_checkpoint("meru", tmp_path / "m.pth", tmp_path / "card", {**MERU_IMPORT_OPTIONS, **options}
                          if not options else options)
    msg = str(e.value)
    assert message in msg and str(tmp_path / "m.pth") in msg, msg
    assert ".card." not in msg and not (tmp_path / "card").exists()  # no trace of the temporary card folder


@pytest.fixture
def no_final_ln(tmp_path, monkeypatch):
    import open_clip.factory as factory

    cfg = {k: v for k, v in checkpoint_layouts.euclip_model_config().items()}
    cfg = {**cfg, "vision_cfg": {k: v for k, v in cfg["vision_cfg"].items() if k != "final_layernorm"},
           "text_cfg": {k: v for k, v in cfg["text_cfg"].items() if k != "final_layernorm"}}
    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-ln", cfg)
    torch.save(open_clip_train_checkpoint(tiny_euclip_state_dict("euclidean_sq")), tmp_path / "euclip.pt")
    return tmp_path / "euclip.pt"


def test_a_final_layernorm_mismatch_names_the_no_final_ln_architecture(no_final_ln, tmp_path):
    with pytest.raises(CheckpointImportError, match=r"euclip.pt has no final LayerNorms.*fewclip import euclip .* "
                                                    r"model=fewclip-ln-no-final-ln"):
        import_checkpoint("open_clip", no_final_ln, tmp_path / "c", {"model": "fewclip-ln"})
    with pytest.raises(CheckpointImportError, match=r"model=fewclip-ln-no-final-ln"):
        import_checkpoint("euclip", no_final_ln, tmp_path / "c", {"model": "fewclip-ln", "geometry": "euclidean-squared"})
    with pytest.raises(BackboneError, match=r"euclip.pt do not match.*no final LayerNorms.*model=fewclip-ln-no-final-ln"):
        load_backbone(BackboneConfig(name="fewclip-ln", pretrained=str(no_final_ln), device="cpu"))
    # the other way round: a file with final LayerNorms under the -no-final-ln architecture
    torch.manual_seed(0)
    full = open_clip.create_model("fewclip-ln").state_dict()
    full["logit_scale"] = torch.tensor(math.log(1.35))
    torch.save(open_clip_train_checkpoint(full), tmp_path / "full.pt")
    with pytest.raises(CheckpointImportError, match=r"full.pt has final LayerNorms.*use model=fewclip-ln\b"):
        import_checkpoint("euclip", tmp_path / "full.pt", tmp_path / "c", {"model": "fewclip-ln-no-final-ln",
                                                                           "geometry": "euclidean-squared"})
    _, bb = import_checkpoint("euclip", no_final_ln, tmp_path / "c", {"model": "fewclip-ln-no-final-ln",
                                                                      "geometry": "euclidean-squared"})
    assert isinstance(bb.model.ln_final, torch.nn.Identity)


# ---------------------------------------------------------------- 5. tokenizers


HUB_ID = "fewclip-test/spm-tokenizer"


def test_a_sentencepiece_folder_without_sentencepiece_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setattr("fewclip.backbones.tokenizer._has_sentencepiece", lambda: False)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "spiece.model").write_bytes(b"\x00" * 16)
    with pytest.raises(TokenizerNotFound, match=r"spiece.model\) and no tokenizer.json.*pip install sentencepiece"):
        load_hf_tokenizer(HUB_ID, tmp_path / "tok", 16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerNotFound, match=r"holds no tokenizer files"):
        load_hf_tokenizer(HUB_ID, tmp_path / "empty", 16)


def _cache_snapshot(root: Path, hub_id: str, files) -> Path:
    """A Hugging Face cache entry of ``hub_id`` holding ``files``, laid out as huggingface_hub writes it."""
    repo = root / f"models--{hub_id.replace('/', '--')}"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for name in files:
        (snap / name).write_bytes(b"\x00" * 16)
    return snap


def test_the_cache_route_checks_the_files_the_tokenizer_needs(tmp_path, monkeypatch):
    monkeypatch.setattr("fewclip.backbones.tokenizer._has_sentencepiece", lambda: False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    _cache_snapshot(tmp_path / "hub", HUB_ID, ["spiece.model", "tokenizer_config.json"])
    with pytest.raises(TokenizerNotFound) as e:
        load_hf_tokenizer(HUB_ID, None, 16)
    assert "is in the local cache" in str(e.value) and "pip install sentencepiece" in str(e.value)
    assert "not on this machine" not in str(e.value)
    _cache_snapshot(tmp_path / "hub", "fewclip-test/weights-only", ["open_clip_model.safetensors"])
    with pytest.raises(TokenizerNotFound, match=r"not on this machine \(the local cache holds fewclip-test/weights-only, "
                                                r"but not its tokenizer files\)"):
        load_hf_tokenizer("fewclip-test/weights-only", None, 16)


def test_a_sentencepiece_folder_loads_in_a_folder_and_from_the_cache(tmp_path, monkeypatch):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["a photo of a cat.", "a drawing of the dog.", "itap of a red car."] * 40))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "spiece"), vocab_size=20, pad_id=0,
                                   eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    config = json.dumps({"tokenizer_class": "T5Tokenizer"})
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "spiece.model").write_bytes((tmp_path / "spiece.model").read_bytes())
    with pytest.raises(TokenizerNotFound, match="no tokenizer_config.json"):
        load_hf_tokenizer(HUB_ID, tmp_path / "tok", 16)
    (tmp_path / "tok" / "tokenizer_config.json").write_text(config)
    tok = load_hf_tokenizer(HUB_ID, tmp_path / "tok", 16)
    ids = tok(["a photo of a cat"])[0].tolist()
    assert tok.end_ids == [1] and 1 in ids and ids[ids.index(1) + 1:] == [0] * (15 - ids.index(1))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = _cache_snapshot(tmp_path / "hub", HUB_ID, [])
    (snap / "spiece.model").write_bytes((tmp_path / "spiece.model").read_bytes())
    (snap / "tokenizer_config.json").write_text(config)
    assert torch.equal(load_hf_tokenizer(HUB_ID, None, 16)(["a photo of a cat"]), tok(["a photo of a cat"]))


def test_sentencepiece_is_an_extra_of_fewclip():
    import tomllib

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("sentencepiece") for d in extras["sentencepiece"])
    assert any(d.startswith("sentencepiece") for d in extras["test"])  # CI reads a SentencePiece folder


# ---------------------------------------------------------------- 6. quiet and exact


def test_fewclip_logs_its_own_line_not_open_clips_random_init_warning(arch, tmp_path, caplog):
    torch.manual_seed(0)
    torch.save(open_clip.create_model(arch).state_dict(), tmp_path / "w.pt")
    caplog.clear()  # open_clip's own words about the model made just above
    with caplog.at_level(logging.INFO):
        load_backbone(BackboneConfig(name=arch, pretrained="none", device="cpu"))
        with pytest.raises(BackboneError):  # a tag preprocessed otherwise: a file of this arch is ambiguous
            load_backbone(BackboneConfig(name=arch, pretrained=str(tmp_path / "w.pt"), device="cpu"))
        load_backbone(BackboneConfig(name=arch + "-quickgelu", pretrained=str(tmp_path / "w.pt"), device="cpu"))
    text = [r.getMessage() for r in caplog.records]
    assert not [t for t in text if "No pretrained weights loaded" in t or "initialized randomly" in t]
    assert not [r for r in caplog.records if "open_clip" in r.pathname and r.levelno < logging.ERROR]
    assert any("fewclip-w: random weights (backbone.pretrained=none)" in t for t in text)
    assert any(f"fewclip-w-quickgelu: weights {tmp_path / 'w.pt'} (sha256" in t for t in text)
    # the filter is gone after the call: nothing process-wide was changed
    assert not logging.getLogger().filters


def test_third_party_info_lines_stay_out_of_the_terminal(tmp_path, capsys):
    torch.save(meru_checkpoint(tiny_meru_state_dict(0)), tmp_path / "m.pth")
    assert main(["import", "meru", str(tmp_path / "m.pth"), f"out={tmp_path / 'card'}"]
                + [f"{k}={v}" for k, v in MERU_IMPORT_OPTIONS.items()]) == 0
    assert main(["zeroshot", f"backbone={tmp_path / 'card'}", "data=toy-shapes", "data.max_test=4",
                 f"out={tmp_path / 'zs'}"]) == 0
    err = capsys.readouterr().err
    assert "INFO fewclip" in err  # fewclip's own lines at the default level
    assert ".card." not in err  # the import's load-back of its temporary folder says nothing of it
    assert not [line for line in err.splitlines() if " INFO " in line and " INFO fewclip" not in line]
    logging.getLogger("some.library").info("chatter")
    assert "chatter" not in capsys.readouterr().err


def test_saturated_templates():
    """MERU's zero-shot evaluator: exp_map0(alpha * mean_t(raw_t)); fewclip: exp_map0(mean_t(log_map0(exp_map0(
    alpha * raw_t)))). Equal below the cap of MERU's exp_map0 (sqrt(c) alpha |x| <= asinh(2^15)); beyond it fewclip
    averages the points the model puts the templates at (docs/backbones.md, "Bring your own checkpoint")."""
    from fewclip.backbones.geometry import make_geometry

    c, alpha = 0.5, 0.4
    geo = make_geometry("hyperbolic", logit_scale=10.0, curvature=c, alpha_image=1.0, alpha_text=alpha)

    def meru(raw):  # meru/evaluation/classification.py and meru/lorentz.py's exp_map0, as formulas
        x = alpha * raw.mean(dim=1)
        rc = math.sqrt(c) * x.norm(dim=-1, keepdim=True)
        return torch.sinh(rc.clamp(min=1e-8, max=math.asinh(2 ** 15))) * x / rc.clamp(min=1e-8)

    g = torch.Generator().manual_seed(0)
    raw = torch.randn(3, 4, 8, generator=g, dtype=torch.float64)
    raw = raw / raw.norm(dim=-1, keepdim=True)
    cap = math.asinh(2 ** 15) / (math.sqrt(c) * alpha)  # the raw norm where MERU's cap starts
    below = raw * 0.9 * cap
    ours = geo.prototype(geo.embed_text(below.float().reshape(12, 8)).reshape(3, 4, -1))
    torch.testing.assert_close(ours.double(), meru(below), rtol=1e-4, atol=1e-3)  # points of norm up to ~2e4
    above = raw * 1.5 * cap
    ours = geo.prototype(geo.embed_text(above.float().reshape(12, 8)).reshape(3, 4, -1)).double()
    capped = raw * cap  # each template lands on the cap's point: fewclip averages those
    torch.testing.assert_close(ours, meru(capped), rtol=1e-4, atol=1e-3)
    assert ((ours - meru(above)).norm(dim=-1) / meru(above).norm(dim=-1)).min() > 0.1  # MERU's differs there
