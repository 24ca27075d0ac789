"""The one door to CLIP: parity with open_clip, freezing, cards and their errors, safe weight loading."""
import copy
import math
from pathlib import Path

import open_clip
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from open_clip.zero_shot_classifier import build_zero_shot_classifier
from safetensors.torch import load_file, save_file

from fewclip.backbones.backbone import (
    BackboneConfig,
    BackboneError,
    load_backbone,
    load_weights_file,
    sha256_file,
    shipped_cards,
)
from fewclip.backbones.tokenizer import WordTokenizer
from fewclip.config.compose import load_config
from fewclip.features.encode import text_prototypes

CLASSNAMES = ["cat", "dog", "golden retriever"]
TEMPLATES = ["a photo of a {}.", "a drawing of the {}.", "itap of a {}."]
WORDS = sorted({w for t in TEMPLATES for c in CLASSNAMES for w in t.format(c).replace(".", "").split()})


def tiny_config(width: int = 32, vocab_size: int = 49408, context_length: int = 16, **extra) -> dict:
    """An open_clip CLIP config small enough to build in milliseconds."""
    return {
        **extra,
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "patch_size": 8, "width": width, "layers": 1, "head_width": 16,
                       "mlp_ratio": 2.0},
        "text_cfg": {"context_length": context_length, "vocab_size": vocab_size, "width": width, "heads": width // 16,
                     "layers": 1, "mlp_ratio": 2.0},
    }


def random_clip(model_cfg: dict, seed: int) -> nn.Module:
    """A random-init open_clip CLIP built by open_clip itself (not through fewclip)."""
    torch.manual_seed(seed)
    return open_clip.model.CLIP(**copy.deepcopy(model_cfg)).eval()


def write_card(folder, name: str, model_cfg: dict, weights: str, *, tokenizer=None, geometry=None,
               sha256: bool = True, **extra) -> str:
    card = {"name": name, "model_config": model_cfg, "weights": weights,
            "tokenizer": tokenizer or {"type": "open_clip"},
            "geometry": geometry or {"name": "clip", "logit_scale": 1 / 0.07}, **extra}
    if sha256 and (folder / weights).is_file():
        card["sha256"] = sha256_file(folder / weights)
    path = folder / f"{name}.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(card)))
    return str(path)


def word_card(folder, name="word", width=32, weights_from_width=None, weights_name=None, seed=0, **kw) -> str:
    """A tiny card with a word tokenizer (like the reference backbones) and weights saved as safetensors."""
    tok = WordTokenizer(WORDS, context_length=12)
    tok.save(folder / "vocab.json")
    cfg = tiny_config(width, tok.vocab_size, 12)
    weights_name = weights_name or f"{name}.safetensors"
    src = random_clip(tiny_config(weights_from_width or width, tok.vocab_size, 12), seed)
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(folder / weights_name))
    return write_card(folder, name, cfg, weights_name, tokenizer={"type": "word", "file": "vocab.json"}, **kw)


@pytest.fixture(scope="module")
def bpe_card(tmp_path_factory):
    """A tiny random-init open_clip model with CLIP's BPE tokenizer, saved as card + safetensors."""
    folder = tmp_path_factory.mktemp("bpe_card")
    cfg = tiny_config()
    model = random_clip(cfg, seed=3)
    save_file(model.state_dict(), str(folder / "tiny.safetensors"))
    return write_card(folder, "tiny-bpe", cfg, "tiny.safetensors")


def _drop_final_ln(model: nn.Module) -> nn.Module:
    """The EuCLIP recipe, done by hand: no final LayerNorm in either tower."""
    model.ln_final = nn.Identity()
    model.visual.ln_post = nn.Identity()
    return model


@pytest.fixture(scope="module")
def no_ln_card(tmp_path_factory):
    """Like ``bpe_card`` without final LayerNorms, so text embeddings differ in norm.

    With a final LayerNorm all raw text embeddings have nearly the same norm,
    and averaging templates before or after normalising agrees to ~1e-5;
    here the order matters, so the parity test sees it.
    """
    folder = tmp_path_factory.mktemp("no_ln_card")
    cfg = tiny_config()
    model = _drop_final_ln(random_clip(cfg, seed=4))
    save_file(model.state_dict(), str(folder / "noln.safetensors"))
    return write_card(folder, "tiny-no-ln", cfg, "noln.safetensors", final_ln=False)


@pytest.fixture
def word_backbone(tmp_path):
    return load_backbone(BackboneConfig(name=word_card(tmp_path), device="cpu"))


# ---------------------------------------------------------------- parity with open_clip


def _open_clip_reference(bb_name):
    """(open_clip model, tokenizer, image size) built by open_clip alone, not through fewclip's loader."""
    if bb_name == "ViT-B-32":
        torch.manual_seed(0)
        model = open_clip.create_model("ViT-B-32", pretrained=None).eval()
        return model, open_clip.get_tokenizer("ViT-B-32"), 224
    folder = Path(bb_name).parent
    card = OmegaConf.to_container(OmegaConf.load(bb_name))
    mcfg = card["model_config"]
    model = open_clip.model.CLIP(**mcfg).eval()
    if card.get("final_ln", True) is False:
        _drop_final_ln(model)
    model.load_state_dict(load_file(str(folder / card["weights"])))  # strict; fp16 files fill fp32 parameters
    ctx = mcfg["text_cfg"]["context_length"]
    if card["tokenizer"]["type"] == "word":
        tok = WordTokenizer.load(folder / card["tokenizer"]["file"])
        tok.context_length = ctx
    else:
        tok = open_clip.tokenizer.SimpleTokenizer(context_length=ctx)
    return model, tok, mcfg["vision_cfg"]["image_size"]


@pytest.mark.parametrize("which", ["tiny-bpe-card", "tiny-no-final-ln", "toy-clip", "ViT-B-32"])
def test_zeroshot_logits_match_open_clip(which, bpe_card, no_ln_card):
    if which.startswith("tiny"):
        name, classnames, templates = bpe_card if which == "tiny-bpe-card" else no_ln_card, CLASSNAMES, TEMPLATES
        bb = load_backbone(BackboneConfig(name=name, device="cpu"))
    elif which == "toy-clip":  # a shipped card: trained weights, word tokenizer
        name, classnames, templates = str(shipped_cards()["toy-clip"]), ["circle", "star", "ring"], [
            "a photo of a {}.", "a {} on a background."]
        bb = load_backbone(BackboneConfig(name=name, device="cpu"))
    else:  # an open_clip architecture with random weights, as `backbone=ViT-B-32 backbone.pretrained=none`
        name, classnames, templates = "ViT-B-32", CLASSNAMES, TEMPLATES
        cfg = load_config(["backbone=ViT-B-32", "backbone.pretrained=none", "backbone.device=cpu"]).backbone
        torch.manual_seed(0)
        bb = load_backbone(cfg)
    model, tokenizer, size = _open_clip_reference(name)
    own, theirs = bb.model.state_dict(), model.state_dict()
    assert own.keys() == theirs.keys() and all(torch.equal(own[k], v) for k, v in theirs.items())  # same weights
    torch.manual_seed(1)
    images = torch.randn(3, 3, size, size)

    # open_clip's own zero-shot path. Templates as callables (str.format bound
    # to each template), the other form build_zero_shot_classifier accepts;
    # two classes per batch, so its class batching is exercised too.
    classifier = build_zero_shot_classifier(model, tokenizer, classnames, [t.format for t in templates],
                                            num_classes_per_batch=2, device="cpu", use_tqdm=False)  # [D, C]
    with torch.no_grad():
        cos_open_clip = F.normalize(model.encode_image(images), dim=-1) @ classifier  # [N, C]

    # fewclip's path: geometry-space prototypes and the clip geometry's logits.
    assert bb.geometry.name == "clip"
    protos = text_prototypes(bb, classnames, templates)  # [C, D], unit rows
    logits = bb.geometry.image_logits(bb.encode_images(images), protos)  # [N, C]

    # Scales: open_clip's zero_shot_eval reports a fixed 100 * cosine (only
    # its argmax matters there); fewclip multiplies the cosine by the model's
    # own logit_scale.exp() (1/0.07 for a random init, the learned value for
    # toy-clip, whose card states it in full precision and whose fp16 weights
    # file to ~1e-3). So compare cosines, then logits at the model's scale.
    scale = bb.geometry.scale.item()
    assert scale == pytest.approx(model.logit_scale.detach().exp().item(), rel=1e-3 if which == "toy-clip" else 1e-6)
    torch.testing.assert_close(logits / scale, cos_open_clip, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits, scale * cos_open_clip, rtol=1e-5, atol=scale * 1e-5)
    assert torch.equal(logits.argmax(-1), cos_open_clip.argmax(-1))
    assert logits.dtype == torch.float32 and logits.shape == (3, len(classnames))


# ---------------------------------------------------------------- frozen


def test_backbone_is_frozen_and_stays_in_eval_mode(word_backbone):
    bb = word_backbone
    assert sum(p.numel() for p in bb.parameters()) > 0
    assert not any(p.requires_grad for p in bb.parameters())
    assert not any(m.training for m in bb.modules())
    bb.train()
    assert not any(m.training for m in bb.modules())
    # An adapter holding the backbone: .train() on the parent reaches the
    # backbone through nn.Module.train, which must not switch it to training.
    adapter = nn.ModuleDict({"backbone": bb, "head": nn.Linear(16, 3)})
    adapter.train()
    assert adapter["head"].training
    assert not any(m.training for m in bb.modules())
    assert not any(p.requires_grad for p in bb.parameters())
    # Encoding records no graph.
    feats = bb.encode_images(torch.randn(2, 3, 32, 32))
    assert not feats.requires_grad and feats.grad_fn is None


def test_describe_names_weights_and_geometry(word_backbone, tmp_path):
    d = word_backbone.describe()
    assert d["geometry"] == "clip" and d["geometry_params"]["logit_scale"] == pytest.approx(1 / 0.07, rel=1e-6)
    assert d["weights_sha256"] == sha256_file(tmp_path / "word.safetensors")
    assert d["tokenizer"]["type"] == "word" and d["tokenizer"]["vocab"] == WORDS


# ---------------------------------------------------------------- card errors


def test_missing_weights_file_is_named(tmp_path):
    card = write_card(tmp_path, "nofile", tiny_config(), "missing_weights.safetensors")
    with pytest.raises(BackboneError, match="weights file not found.*missing_weights.safetensors"):
        load_backbone(BackboneConfig(name=card))


def test_weights_of_another_architecture_do_not_match(tmp_path):
    card = word_card(tmp_path, "w32", width=32, weights_from_width=48)
    with pytest.raises(BackboneError) as e:
        load_backbone(BackboneConfig(name=card, device="cpu"))
    msg = str(e.value)
    assert "do not match" in msg and str(tmp_path / "w32.safetensors") in msg
    assert "wrong shape" in msg and "(48," in msg  # says what is wrong, e.g. a 48-wide tensor


def test_sha256_mismatch_is_refused(tmp_path):
    card = word_card(tmp_path, "sha")
    load_backbone(BackboneConfig(name=card, device="cpu"))  # the declared digest is right
    weights = tmp_path / "sha.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte in the last tensor
    weights.write_bytes(bytes(data))
    with pytest.raises(BackboneError, match="sha256.*damaged"):
        load_backbone(BackboneConfig(name=card, device="cpu"))


def test_card_without_sha256_still_records_the_digest(tmp_path):
    card = word_card(tmp_path, "nosha", sha256=False)
    bb = load_backbone(BackboneConfig(name=card, device="cpu"))
    assert bb.weights_sha256 == sha256_file(tmp_path / "nosha.safetensors")


def _other_vocab(card, folder):
    WordTokenizer(WORDS + ["zebra"]).save(folder / "vocab2.json")
    card["tokenizer"]["file"] = "vocab2.json"


@pytest.mark.parametrize("edit, message", [
    (lambda c, _: c.update(weigths="x.safetensors"), r"unknown keys \['weigths'\]"),
    (lambda c, _: c.pop("geometry"), "missing the 'geometry' key"),
    (lambda c, _: c.update(architecture="ViT-B-32"), "exactly one of 'architecture'"),
    (lambda c, _: c["geometry"].update(curvature=1.0), r"does not take \['curvature'\]"),
    (lambda c, _: c["geometry"].update(name="flat"), "unknown geometry 'flat'"),
    (lambda c, _: c["tokenizer"].update(type="sentencepiece"), "tokenizer type must be 'word', 'open_clip' or 'hf'"),
    (lambda c, _: c["tokenizer"].update(file="gone.json"), "tokenizer file not found"),
    (_other_vocab, "vocab2.json has 15 tokens but the model's text_cfg.vocab_size is 14"),
], ids=["unknown-key", "no-geometry", "two-architectures", "geometry-param", "geometry-name", "tokenizer-type",
        "tokenizer-file", "vocab-size"])
def test_bad_cards_are_refused_with_a_reason(tmp_path, edit, message):
    path = word_card(tmp_path, "bad")
    card = OmegaConf.to_container(OmegaConf.load(path))
    edit(card, tmp_path)
    card.pop("sha256", None)
    (tmp_path / "bad.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(card)))
    with pytest.raises(BackboneError, match=message):
        load_backbone(BackboneConfig(name=path, device="cpu"))


def test_card_not_found_and_card_with_pretrained(tmp_path):
    with pytest.raises(BackboneError, match="backbone card not found"):
        load_backbone(BackboneConfig(name=str(tmp_path / "nope.yaml")))
    card = word_card(tmp_path)
    with pytest.raises(BackboneError, match="is a card, which names its own weights"):
        load_backbone(BackboneConfig(name=card, pretrained="openai"))


def test_open_clip_architecture_without_pretrained_lists_tags():
    with pytest.raises(BackboneError) as e:
        load_backbone(BackboneConfig(name="ViT-B-32"))
    msg = str(e.value)
    assert "backbone.pretrained" in msg
    for tag in ("openai", "laion2b_s34b_b79k"):
        assert tag in msg
    with pytest.raises(BackboneError, match="neither a local file nor a known open_clip tag.*openai"):
        load_backbone(BackboneConfig(name="ViT-B-32", pretrained="no_such_tag"))


def test_unknown_backbone_points_to_the_listing():
    with pytest.raises(BackboneError) as e:
        load_backbone(BackboneConfig(name="ViT-Q-99"))
    msg = str(e.value)
    assert "'ViT-Q-99'" in msg and "`fewclip backbones`" in msg and "toy-clip" in msg


# ---------------------------------------------------------------- weights files: .pt with weights_only


def _features(bb):
    torch.manual_seed(5)
    return bb.encode_images(torch.randn(2, 3, 32, 32)), bb.encode_text(["a photo of a cat.", "itap of a dog."])


@pytest.mark.parametrize("wrap", ["plain", "state_dict", "module_prefix"])
def test_pt_weights_load_like_safetensors(tmp_path, wrap):
    ref_card = word_card(tmp_path, "ref")
    ref = load_backbone(BackboneConfig(name=ref_card, device="cpu"))
    sd = load_file(str(tmp_path / "ref.safetensors"))
    if wrap == "state_dict":  # a training checkpoint holding the weights under "state_dict"
        obj = {"state_dict": sd}
    elif wrap == "module_prefix":  # saved from DistributedDataParallel
        obj = {f"module.{k}": v for k, v in sd.items()}
    else:
        obj = sd
    torch.save(obj, tmp_path / "ref.pt")
    pt_card = write_card(tmp_path, "pt", tiny_config(32, len(WORDS) + 4, 12), "ref.pt",
                         tokenizer={"type": "word", "file": "vocab.json"})
    bb = load_backbone(BackboneConfig(name=pt_card, device="cpu"))
    for a, b in zip(_features(bb), _features(ref)):
        assert torch.equal(a, b)


_EXECUTED = []


def _record(*args):  # what unpickling a malicious file would call
    _EXECUTED.append(args)
    return args


class _Payload:
    def __reduce__(self):
        return (_record, ("unpickled!",))


def test_pickled_objects_are_refused(tmp_path):
    word_card(tmp_path, "evil")
    sd = load_file(str(tmp_path / "evil.safetensors"))
    torch.save({**sd, "payload": _Payload()}, tmp_path / "evil.pt")
    card_pt = write_card(tmp_path, "evil-pt", tiny_config(32, len(WORDS) + 4, 12), "evil.pt",
                         tokenizer={"type": "word", "file": "vocab.json"})
    with pytest.raises(BackboneError, match=r"evil.pt: it holds pickled Python objects.*_record.*weights_only=True"):
        load_backbone(BackboneConfig(name=card_pt, device="cpu"))
    with pytest.raises(BackboneError) as e:
        load_weights_file(tmp_path / "evil.pt")
    # fewclip's own advice, not torch's "set weights_only=False" (nor its terminal colour codes)
    assert "weights_only=False" not in str(e.value) and "\x1b" not in str(e.value)
    assert _EXECUTED == []  # the payload never ran


def test_non_tensor_values_are_refused(tmp_path):
    torch.save({"w": torch.zeros(2), "step": 3}, tmp_path / "ckpt.pt")
    with pytest.raises(BackboneError, match="flat state dict of tensors"):
        load_weights_file(tmp_path / "ckpt.pt")


@pytest.fixture
def tiny_arch(monkeypatch):
    """Register tiny open_clip architectures for the duration of one test."""
    import open_clip.factory as factory

    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-test-tiny", tiny_config())
    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-test-tiny-bias", tiny_config(init_logit_bias=-7.0))
    return "fewclip-test-tiny"


def test_open_clip_arch_with_local_pt_checkpoint(tmp_path, tiny_arch):
    src = random_clip(tiny_config(), seed=11)
    torch.save(src.state_dict(), tmp_path / "tiny.pt")
    bb = load_backbone(BackboneConfig(name=tiny_arch, pretrained=str(tmp_path / "tiny.pt"), device="cpu"))
    assert all(torch.equal(bb.model.state_dict()[k], v) for k, v in src.state_dict().items())
    assert bb.weights_sha256 == sha256_file(tmp_path / "tiny.pt")
    assert bb.geometry.name == "clip" and bb.context_length == 16
    # weights of another width: a clear error naming the file
    torch.save(random_clip(tiny_config(width=48), seed=0).state_dict(), tmp_path / "wide.pt")
    with pytest.raises(BackboneError, match="wide.pt do not match"):
        load_backbone(BackboneConfig(name=tiny_arch, pretrained=str(tmp_path / "wide.pt"), device="cpu"))


def test_open_clip_geometry_follows_the_model(tiny_arch):
    siglip = load_backbone(BackboneConfig(name="fewclip-test-tiny-bias", pretrained="none", device="cpu"))
    assert siglip.geometry.name == "sigmoid"
    assert siglip.geometry.params() == pytest.approx({"logit_scale": 1 / 0.07, "logit_bias": -7.0}, rel=1e-6)
    # EuCLIP's names for its geometries are accepted
    euc = load_backbone(BackboneConfig(name=tiny_arch, pretrained="none", geometry="euclidean-squared", device="cpu"))
    assert euc.geometry.name == "euclidean_sq" and euc.geometry.params() == pytest.approx({"logit_scale": 1 / 0.07})
    # a hyperbolic geometry needs a curvature and alphas that an open_clip architecture does not carry: an
    # error naming the fix, never curvature 1 and alpha 1
    for name in ("hyperbolic", "hyperbolic-squared"):
        with pytest.raises(BackboneError, match=r"needs a curvature.*curvature 1 and alpha 1.*fewclip import euclip"):
            load_backbone(BackboneConfig(name=tiny_arch, pretrained="none", geometry=name, device="cpu"))
    with pytest.raises(BackboneError, match="sigmoid needs a logit bias"):
        load_backbone(BackboneConfig(name=tiny_arch, pretrained="none", geometry="sigmoid", device="cpu"))
    with pytest.raises(BackboneError, match="euclidean-inner.*has no fewclip geometry"):
        load_backbone(BackboneConfig(name=tiny_arch, pretrained="none", geometry="euclidean-inner", device="cpu"))
    with pytest.raises(BackboneError, match="backbone.geometry.*unknown geometry 'flat'"):
        load_backbone(BackboneConfig(name=tiny_arch, pretrained="none", geometry="flat", device="cpu"))


# ---------------------------------------------------------------- precision


def test_bf16_on_cpu_returns_float32_features(tmp_path):
    card = word_card(tmp_path)
    fp32 = load_backbone(BackboneConfig(name=card, device="cpu"))
    bf16 = load_backbone(BackboneConfig(name=card, device="cpu", precision="bf16"))
    assert bf16.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    img16, txt16 = _features(bf16)
    img32, txt32 = _features(fp32)
    assert img16.dtype == txt16.dtype == torch.float32
    assert F.cosine_similarity(img16, img32).min() > 0.98
    assert F.cosine_similarity(txt16, txt32).min() > 0.98
    protos = text_prototypes(bf16, CLASSNAMES, TEMPLATES)
    logits = bf16.geometry.image_logits(img16, protos)
    assert protos.dtype == logits.dtype == torch.float32 and torch.isfinite(logits).all()
    # the geometry itself stays float32
    assert all(p.dtype == torch.float32 for p in bf16.geometry.parameters())
    assert math.isclose(bf16.geometry.scale.item(), fp32.geometry.scale.item())


def test_precision_must_be_known():
    with pytest.raises(ValueError, match="backbone.precision must be one of"):
        BackboneConfig(precision="fp8")
