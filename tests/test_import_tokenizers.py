"""Hugging Face tokenizers (SigLIP and other open_clip models that name one): from a local folder, before the
model, a clear error in seconds when missing; prompt learning on such towers (no start token, no causal mask,
last-token pooling).

The tokenizer is a tiny word-level one that the test builds with ``tokenizers`` and saves with transformers'
``PreTrainedTokenizerFast.save_pretrained``, laid out like SigLIP's: no start token, ``</s>`` appended, padding
with ``<pad>``; the model config names a hub id that is on no machine.
"""
import copy
import math
import time

import open_clip
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from fewclip.adapters.coop import CoOp, CoOpConfig
from fewclip.backbones.backbone import BackboneConfig, BackboneError, build_open_clip_model, load_backbone
from fewclip.backbones.importer import CheckpointImportError, import_checkpoint
from fewclip.cli.main import main
from fewclip.features.encode import text_prototypes
from helpers.checkpoints import CLASSNAMES, TEMPLATES, open_clip_train_checkpoint

HUB_ID = "fewclip-test/tokenizer-on-no-machine"
WORDS = sorted({w for t in TEMPLATES for c in CLASSNAMES for w in t.format(c).replace(".", "").split()})
SPECIAL = ["<pad>", "</s>", "<unk>"]  # ids 0, 1, 2 as in T5/SigLIP's sentencepiece vocabulary
CONTEXT = 12


def model_config() -> dict:
    return {
        "embed_dim": 16, "custom_text": True, "init_logit_bias": -5.0,
        "vision_cfg": {"image_size": 32, "patch_size": 16, "width": 32, "layers": 1, "head_width": 16},
        "text_cfg": {"context_length": CONTEXT, "vocab_size": len(SPECIAL) + len(WORDS), "width": 32, "heads": 2,
                     "layers": 1, "hf_tokenizer_name": HUB_ID, "tokenizer_kwargs": {"clean": "canonicalize"},
                     "no_causal_mask": True, "pool_type": "last", "proj_bias": True},
    }


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_card")
    torch.manual_seed(0)
    model = build_open_clip_model(copy.deepcopy(model_config()))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "w.safetensors"))
    card = {"name": "tiny-siglip", "model_config": model_config(), "weights": "w.safetensors",
            "tokenizer": {"type": "open_clip"},
            "geometry": {"name": "sigmoid", "logit_scale": float(model.logit_scale.detach().exp()), "logit_bias": -5.0}}
    (folder / "card.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(card)))
    return folder


def test_a_missing_tokenizer_is_a_clear_error_in_seconds_before_the_model(card, monkeypatch, capsys):
    def no_model(*a, **k):
        raise AssertionError("the model was built before the tokenizer was found")

    monkeypatch.setattr("fewclip.backbones.backbone.build_open_clip_model", no_model)
    start = time.monotonic()
    with pytest.raises(BackboneError) as e:
        load_backbone(BackboneConfig(name=str(card), device="cpu"))
    assert time.monotonic() - start < 10  # no download retries
    msg = str(e.value)
    assert HUB_ID in msg and "backbone.tokenizer=" in msg and "save_pretrained" in msg
    # the command line: exit status 2 and the message, no traceback
    assert main(["zeroshot", f"backbone={card}", "data=toy-shapes", "data.max_test=4",
                 f"out={card / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert HUB_ID in err and "Traceback" not in err


def test_open_clip_architecture_tokenizer_first(monkeypatch, tokenizer_dir):
    import open_clip.factory as factory

    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-test-hf", model_config())

    def no_model(*a, **k):
        raise AssertionError("the model was built before the tokenizer was found")

    with monkeypatch.context() as m:
        m.setattr(open_clip, "create_model", no_model)
        with pytest.raises(BackboneError, match=f"backbone=fewclip-test-hf.*{HUB_ID}.*backbone.tokenizer="):
            load_backbone(BackboneConfig(name="fewclip-test-hf", pretrained="none", device="cpu"))
    bb = load_backbone(BackboneConfig(name="fewclip-test-hf", pretrained="none", tokenizer=str(tokenizer_dir),
                                      device="cpu"))
    assert bb.geometry.name == "sigmoid" and bb.tokenizer_spec == {"type": "hf", "name": HUB_ID,
                                                                    "context_length": CONTEXT}
    with pytest.raises(BackboneError, match="does not exist"):
        load_backbone(BackboneConfig(name="fewclip-test-hf", pretrained="none", tokenizer="/no/such/dir"))
    # a model with open_clip's own tokenizer refuses a tokenizer folder rather than ignoring it
    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-test-bpe", {**model_config(), "text_cfg": {
        "context_length": CONTEXT, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}})
    with pytest.raises(BackboneError, match="unset backbone.tokenizer"):
        load_backbone(BackboneConfig(name="fewclip-test-bpe", pretrained="none", tokenizer=str(tokenizer_dir)))


@pytest.fixture(scope="module")
def backbone(card, tokenizer_dir):
    return load_backbone(BackboneConfig(name=str(card), tokenizer=str(tokenizer_dir), device="cpu"))


def test_tokens_follow_the_hf_tokenizer(backbone):
    tok = backbone.tokenizer
    assert tok.start_ids == [] and tok.end_ids == [1] and tok.pad_token_id == 0
    ids = backbone.tokenize(["A photo of a Cat."])[0].tolist()
    words = [len(SPECIAL) + WORDS.index(w) for w in ("a", "photo", "of", "a", "cat")]
    assert ids == words + [1] + [0] * (CONTEXT - len(words) - 1)  # canonicalised, no start token, </s>, padding


@pytest.mark.parametrize("position", ["end", "front", "middle"])
def test_coop_from_words_reproduces_zero_shot_on_an_hf_tower(backbone, position):
    ad = CoOp(CoOpConfig(ctx_init="a photo of a", class_token_position=position), backbone, CLASSNAMES)
    template = ad.equivalent_template()
    assert template is not None
    assert ad.tokens.shape[1] == CONTEXT  # no causal mask: the tower runs at full length
    assert (ad.tokens[:, 0] != 1).all()  # no start token: the first token is a word
    feats = backbone.encode_images(torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    expected = backbone.geometry.image_logits(feats, text_prototypes(backbone, CLASSNAMES, [template]))
    with torch.no_grad():
        torch.testing.assert_close(ad(feats), expected, rtol=1e-5, atol=1e-5)


def test_coop_trains_on_an_hf_tower(backbone):
    torch.manual_seed(0)
    ad = CoOp(CoOpConfig(n_ctx=3), backbone, CLASSNAMES)
    assert ad.tower.placeholder_id not in (0, 1)  # never the padding or end token
    feats = backbone.encode_images(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)))
    ad(feats).logsumexp(dim=1).sum().backward()
    assert ad.ctx.grad is not None and ad.ctx.grad.abs().sum() > 0
    assert all(p.grad is None for p in backbone.parameters())


def test_import_saves_the_tokenizer_in_the_card_folder(tmp_path, monkeypatch, tokenizer_dir):
    import open_clip.factory as factory

    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-test-hf", model_config())
    torch.manual_seed(1)
    model = open_clip.create_model("fewclip-test-hf", pretrained=None)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(11.0))
    torch.save(open_clip_train_checkpoint(model.state_dict()), tmp_path / "siglip.pt")
    with pytest.raises(CheckpointImportError, match=f"{HUB_ID}.*tokenizer="):
        import_checkpoint("open_clip", tmp_path / "siglip.pt", tmp_path / "card", {"model": "fewclip-test-hf"})
    card, bb = import_checkpoint("open_clip", tmp_path / "siglip.pt", tmp_path / "card",
                                 {"model": "fewclip-test-hf", "tokenizer": str(tokenizer_dir)})
    assert (tmp_path / "card" / "tokenizer" / "tokenizer.json").is_file()
    assert bb.geometry.params() == pytest.approx({"logit_scale": 11.0, "logit_bias": -5.0}, rel=1e-6)
    again = load_backbone(BackboneConfig(name=str(tmp_path / "card"), device="cpu"))  # no backbone.tokenizer needed
    assert torch.equal(again.tokenize(["a red car"]), bb.tokenize(["a red car"]))


def test_siglip_weights_from_a_file_need_their_preprocessing(tmp_path, tokenizer_dir):
    """open_clip's SigLIP weights squash the image and use mean/std 0.5, its config says nothing: a local file that
    no fingerprint recognises is ambiguous (refused before the large model is built)."""
    save_file({"token_embedding.weight": torch.zeros(4, 4), "visual.conv1.weight": torch.zeros(4, 3, 2, 2)},
              str(tmp_path / "open_clip_model.safetensors"))
    with pytest.raises(BackboneError, match=r"ViT-B-16-SigLIP are preprocessed otherwise than its default \(webli: "
                                            r"resize_mode squash.*fewclip import open_clip .* pretrained=TAG"):
        load_backbone(BackboneConfig(name="ViT-B-16-SigLIP", pretrained=str(tmp_path / "open_clip_model.safetensors"),
                                     tokenizer=str(tokenizer_dir), device="cpu"))


def test_lora_starts_at_zero_shot_on_an_hf_tower(backbone):
    from fewclip.adapters.lora import LoRA, LoRAConfig

    ad = LoRA(LoRAConfig(towers="both"), backbone, CLASSNAMES, TEMPLATES)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        feats = ad.encode_images(pixels)
        expected = backbone.geometry.image_logits(backbone.encode_images(pixels),
                                   text_prototypes(backbone, CLASSNAMES, TEMPLATES))
        torch.testing.assert_close(ad(feats), expected, rtol=1e-5, atol=1e-5)
