"""LoRA through peft pinned down: zero-shot logits at init in every geometry, q/k/v each on its own,
only LoRA parameters train, the backbone is never touched, and both export formats classify alike."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from fewclip.adapter.exports import load_prompts
from fewclip.adapters import build_adapter
from fewclip.adapters.lora import LoRA, LoRAConfig
from fewclip.backbones.attention import SplitAttention
from fewclip.backbones.backbone import backbone_config_from_dict, build_open_clip_model, load_backbone
from fewclip.config.compose import ConfigError
from fewclip.features.encode import text_prototypes
from fewclip.runs.run import load_train_config, run_train
from fewclip.training.engine import TrainConfig, total_steps
from helpers.cards import CARD_GEOMETRIES, SIGLIP_TEXT, backbone, cards  # noqa: F401  (cards is a fixture)

TOY = ["toy-clip", "toy-euclip", "toy-meru", "toy-siglip"]
NAMES = ["circle", "square", "golden retriever"]
TEMPLATES = ["a photo of a {}.", "a sketch of the {}"]


def pixels(bb, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, bb.image_size, bb.image_size, generator=g)


def randomise_b(adapter, seed=0, scale=0.5):
    """Give every LoRA B a random value (peft starts it at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapter.named_parameters():
            if name.endswith("B.weight"):
                p.copy_(scale * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("name", TOY + list(CARD_GEOMETRIES) + [SIGLIP_TEXT])
def test_init_logits_are_zero_shot_logits_in_every_geometry(name, cards):  # noqa: F811
    bb = backbone(name, cards)
    ad = LoRA(LoRAConfig(), bb, NAMES, TEMPLATES)
    px = pixels(bb)
    with torch.no_grad():
        feats = ad.encode_images(px)
        torch.testing.assert_close(feats, bb.encode_images(px), rtol=1e-5, atol=1e-5)
        expected = bb.geometry.image_logits(bb.encode_images(px), text_prototypes(bb, NAMES, TEMPLATES))
        torch.testing.assert_close(ad(feats), expected, rtol=1e-5, atol=1e-5)


def test_only_lora_parameters_get_gradients_and_the_backbone_is_untouched():
    bb = backbone("toy-clip")
    before = {k: v.clone() for k, v in bb.model.state_dict().items()}
    ad = LoRA(LoRAConfig(), bb, NAMES, TEMPLATES)
    ad.train()
    randomise_b(ad, scale=0.1)  # with B = 0 the gradient of A is exactly zero
    loss = F.cross_entropy(ad(ad.encode_images(pixels(bb, 4))), torch.tensor([0, 1, 2, 0]))
    loss.backward()
    trainable = ad.trainable_parameters()
    assert trainable and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
    assert {id(p) for p in trainable} == {id(p) for p in ad.parameters()}
    assert all("lora" in n for n, _ in ad.named_parameters())
    assert all(p.grad is None and not p.requires_grad for p in bb.model.parameters())
    for n, p in ad.model.named_parameters():  # the injected copy: LoRA tensors only are trainable
        assert p.requires_grad == ("lora_" in n), n
    # the backbone's own modules are not replaced or wrapped, and its weights did not move
    assert all(type(b.attn) is torch.nn.MultiheadAttention for b in bb.model.transformer.resblocks)
    assert all(torch.equal(before[k], v) for k, v in bb.model.state_dict().items())
    # rank 2 on q, k, v of 3 text + 4 vision layers of width 64: 2 * (64 + 64) * 3 * 7
    assert ad.trainable_parameter_count() == 2 * 128 * 3 * 7


@pytest.mark.parametrize("target", ["q", "k", "v"])
def test_each_of_q_k_v_can_be_adapted_on_its_own(target):
    bb = backbone("toy-clip")
    ad = LoRA(LoRAConfig(targets=target, towers="text"), bb, NAMES, TEMPLATES)
    names = [n for n in ad.lora]
    assert names and all(n.endswith(f"attn__{target}_proj") for n in names)
    randomise_b(ad)
    merged = ad.merged_state_dict()
    own = bb.model.state_dict()
    W = 64
    rows = {"q": slice(0, W), "k": slice(W, 2 * W), "v": slice(2 * W, 3 * W)}
    for i in range(3):
        key = f"transformer.resblocks.{i}.attn.in_proj_weight"
        for t, sl in rows.items():
            same = torch.equal(merged[key][sl], own[key][sl])
            assert same == (t != target), (key, t)
        assert torch.equal(merged[key.replace("weight", "bias")], own[key.replace("weight", "bias")])
    assert all(torch.equal(merged[k], own[k]) for k in own if k.startswith("visual."))


def test_towers_layers_and_other_targets():
    bb = backbone("toy-clip")
    text = LoRA(LoRAConfig(towers="text"), bb, NAMES, TEMPLATES)
    assert not text.trains_image_tower and all(n.startswith("transformer__") for n in text.lora)
    vision = LoRA(LoRAConfig(towers="vision", layers="last:1"), bb, NAMES, TEMPLATES)
    assert vision.trains_image_tower and sorted(vision.lora) == [
        f"visual__transformer__resblocks__3__attn__{t}_proj" for t in "kqv"]
    assert isinstance(vision.model.visual.transformer.resblocks[3].attn, SplitAttention)
    assert type(vision.model.visual.transformer.resblocks[0].attn) is torch.nn.MultiheadAttention
    # fixed prototypes when the text tower is not adapted: no graph through the text tower
    assert not vision.prototypes().requires_grad
    mlp = LoRA(LoRAConfig(targets="o,mlp", layers="0"), bb, NAMES, TEMPLATES)
    assert sorted(mlp.lora) == sorted(f"{p}__0__{m}" for p in ("transformer__resblocks", "visual__transformer__resblocks")
                                      for m in ("attn__out_proj", "mlp__c_fc", "mlp__c_proj"))
    randomise_b(mlp)
    merged = mlp.merged_state_dict()
    own = bb.model.state_dict()
    for key in ("transformer.resblocks.0.mlp.c_fc.weight", "transformer.resblocks.0.attn.out_proj.weight",
                "visual.transformer.resblocks.0.attn.out_proj.weight"):
        assert not torch.equal(merged[key], own[key]), key
    assert torch.equal(merged["transformer.resblocks.0.attn.in_proj_weight"],
                       own["transformer.resblocks.0.attn.in_proj_weight"])


@pytest.mark.parametrize("targets", ["o", "mlp", "o,mlp"])
def test_targets_without_q_k_v_change_the_outputs_and_train(targets):
    """nn.MultiheadAttention reads out_proj.weight directly, so an `o` LoRA needs the split attention."""
    bb = backbone("toy-clip")
    ad = LoRA(LoRAConfig(targets=targets), bb, NAMES, TEMPLATES)
    px = pixels(bb)
    with torch.no_grad():
        before = ad(ad.encode_images(px))
    randomise_b(ad, scale=0.1)
    logits = ad(ad.encode_images(px))
    assert (logits - before).abs().max() > 1e-3
    F.cross_entropy(logits, torch.tensor([0, 1, 2])).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ad.trainable_parameters())


@pytest.mark.parametrize("kwargs, field", [({"rank": 0}, "adapter.rank"), ({"alpha": 0}, "adapter.alpha"),
                                           ({"dropout": 1.0}, "adapter.dropout"), ({"targets": "q,x"}, "adapter.targets"),
                                           ({"towers": "audio"}, "adapter.towers"), ({"layers": "top"}, "adapter.layers")])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        LoRAConfig(**kwargs)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_train_config(["adapter=lora", *(f"adapter.{k}={v}" for k, v in kwargs.items())])


def test_train_defaults_are_clip_lora_and_can_be_overridden():
    cfg = load_train_config(["adapter=lora"])
    t = cfg.train
    assert (t.optimizer, t.lr, t.weight_decay, t.batch_size, t.iterations_per_shot, t.warmup_epochs) == \
        ("adamw", 2e-4, 1e-2, 32, 500, 0)
    assert (cfg.adapter.rank, cfg.adapter.alpha, cfg.adapter.dropout, cfg.adapter.targets, cfg.adapter.towers) == \
        (2, 1.0, 0.25, "q,k,v", "both")
    assert load_train_config(["adapter=lora", "train.lr=0.001"]).train.lr == 0.001
    assert load_train_config(["adapter=coop"]).train.optimizer == "sgd"  # other adapters keep CoOp's
    assert total_steps(t, 16, 3) == 8000
    assert total_steps(TrainConfig(iterations=7, iterations_per_shot=500), 16, 3) == 7
    assert total_steps(TrainConfig(epochs=2), 16, 3) == 6


def test_lora_keeps_local_windows():
    bb = load_backbone(backbone_config_from_dict({"name": "toy-clip", "device": "cpu", "local_attention": {
        "text": {"window": 2}, "vision": {"window": 1, "shape": "grid"}}}))
    ad = LoRA(LoRAConfig(), bb, NAMES, TEMPLATES)
    assert ad.model.visual.transformer.resblocks[0].attn.window.k == 1
    px = pixels(bb)
    with torch.no_grad():
        expected = bb.geometry.image_logits(bb.encode_images(px), text_prototypes(bb, NAMES, TEMPLATES))
        torch.testing.assert_close(ad(ad.encode_images(px)), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- runs, export, predict


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, shapes):
    out = tmp_path_factory.mktemp("lora_run") / "run"
    cfg = load_train_config(["adapter=lora", "backbone=toy-clip", "data=toy-shapes", "shots=1", "seed=1",
                             "train.iterations=6", "train.lr=0.01", "data.max_test=40", "backbone.device=cpu",
                             "data.templates=single"])
    metrics = run_train(cfg, out, dataset=shapes)
    return out, metrics


def test_a_run_trains_and_tests_through_the_adapted_image_tower(lora_run):
    out, m = lora_run
    assert m["method"] == "lora" and m["steps"] == 6 and m["n_test"] == 40
    assert m["trainable_parameters"] == 2 * 128 * 3 * 7 and m["templates"] == ["a photo of a {}."]
    sd = load_file(str(out / "adapter.safetensors"))
    assert all(".lora" not in k and k.startswith("lora.") for k in sd)
    assert any(v.abs().sum() > 0 for k, v in sd.items() if k.endswith("B.weight"))  # it moved


def test_export_both_formats_and_predict(lora_run, tmp_path, shapes):
    from fewclip.cli.main import main
    from fewclip.runs.export import export_run

    out, m = lora_run
    exported = export_run(out, tmp_path / "export", merge=True)
    folder = exported.path
    assert {p.name for p in folder.iterdir()} >= {"adapter_model.safetensors", "adapter_config.json", "fewclip.json",
                                                 "merged.safetensors"}
    peft_cfg = json.loads((folder / "adapter_config.json").read_text())
    assert peft_cfg["r"] == 2 and peft_cfg["lora_alpha"] == 1 and peft_cfg["peft_type"] == "LORA"
    # peft stores the shortest names that pick out exactly the adapted Linears of the split module tree
    assert any(t.endswith("q_proj") for t in peft_cfg["target_modules"])
    peft_sd = load_file(str(folder / "adapter_model.safetensors"))
    assert peft_sd and all("lora_A" in k or "lora_B" in k for k in peft_sd)

    # the merged file is a plain open_clip state dict: strict load into a freshly built open_clip model
    from fewclip.backbones.backbone import _card_model_config, read_card, shipped_cards

    merged = load_file(str(folder / "merged.safetensors"))
    plain = build_open_clip_model(_card_model_config(read_card(shipped_cards()["toy-clip"]))).eval()
    plain.load_state_dict(merged, strict=True)

    images = shapes.items("test")[:6]
    a = load_prompts(folder, device="cpu")
    b = load_prompts(folder / "merged.safetensors", device="cpu")
    px = torch.stack([a.backbone.preprocess()(shapes.load_image(it)) for it in images])
    la, lb = a.logits(px), b.logits(px)
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    # the same numbers as the trained adapter itself
    cfg = load_train_config([str(out / "config.yaml")])
    bb = load_backbone(cfg.backbone)
    ad = build_adapter(cfg.adapter, bb, shapes.classnames, ["a photo of a {}."])
    ad.load_adapter_state_dict(load_file(str(out / "adapter.safetensors")))
    ad.eval()
    with torch.no_grad():
        torch.testing.assert_close(la, ad(ad.encode_images(px)), rtol=1e-5, atol=1e-5)
        feats = plain.encode_image(px).float()
        torch.testing.assert_close(ad.encode_images(px), feats, rtol=1e-5, atol=1e-5)
    # accuracy of the export on these images agrees with the run's own test features path
    assert a.with_classnames(shapes.classnames[:2]).logits(px).shape == (6, 2)

    img = tmp_path / "img.png"
    shapes.load_image(images[0]).save(img)
    assert main(["predict", f"prompts={folder}", str(img), "top_k=2", "backbone.device=cpu"]) == 0
    assert main(["predict", f"prompts={folder / 'merged.safetensors'}", str(img), "backbone.device=cpu"]) == 0
    assert main(["export", str(out), "-o", str(tmp_path / "e2")]) == 0
    assert (tmp_path / "e2" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "e2" / "merged.safetensors").exists()


def test_export_refuses_another_backbone(lora_run, tmp_path):
    from fewclip.adapter.exports import ExportError
    from fewclip.runs.export import export_run

    out, _ = lora_run
    with pytest.raises(ExportError, match="a LoRA export is a folder"):
        export_run(out, tmp_path / "lora.safetensors")
    folder = export_run(out, tmp_path / "x").path
    with pytest.raises(ExportError, match="another backbone"):
        load_prompts(folder, device="cpu", backbone_overrides={"name": "toy-meru"})


def test_init_draws_from_the_generator_not_the_global_rng():
    """peft draws LoRA's A matrices from torch's global RNG: the adapter runs it on a fork seeded from its
    generator, so the same generator gives the same A, another gives another, and the caller's RNG never moves."""
    bb = backbone("toy-clip")
    state = torch.random.get_rng_state()
    a1, a2, b = (LoRA(LoRAConfig(towers="text"), bb, NAMES, TEMPLATES, generator=torch.Generator().manual_seed(s))
                 for s in (1, 1, 2))
    assert torch.equal(torch.random.get_rng_state(), state)
    sd1, sd2, sdb = a1.adapter_state_dict(), a2.adapter_state_dict(), b.adapter_state_dict()
    a_keys = [k for k in sd1 if k.endswith("A.weight")]
    assert a_keys and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert all(not torch.equal(sd1[k], sdb[k]) for k in a_keys)


def test_an_image_tower_lora_cannot_adapt_is_refused_with_the_fix():
    from fewclip.adapters import AdapterError
    from fewclip.adapters.lora import lora_target_modules

    model = build_open_clip_model({"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1],
                                                                   "width": 8},
                                   "text_cfg": {"context_length": 8, "vocab_size": 100, "width": 16, "heads": 2,
                                                "layers": 1}})
    with pytest.raises(AdapterError, match="ModifiedResNet.*adapter.towers=text"):
        lora_target_modules(model, LoRAConfig(towers="both"))
    assert lora_target_modules(model, LoRAConfig(towers="text"))  # the text tower alone is fine
