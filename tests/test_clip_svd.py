"""Methods that tune the towers' weights (CLIP-SVD): zero-shot at the start in every geometry, only their
own tensors train, the backbone is never touched, a run trains, and both exports (the generic adapter file
and the plain open_clip state dict of merge=true) predict what the run scored."""
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from fewclip.adapter.exports import load_prompts
from fewclip.adapters import build_adapter
from fewclip.adapters.clip_svd import ClipSVD, ClipSVDConfig, SVDLinear
from fewclip.backbones.backbone import build_open_clip_model
from fewclip.config.compose import ConfigError
from fewclip.data.splits import test_items as run_test_items
from fewclip.features.encode import text_prototypes
from fewclip.runs.run import load_train_config, run_train
from helpers.cards import CARD_GEOMETRIES, SIGLIP_TEXT, backbone, cards  # noqa: F401  (cards is a fixture)

TOY = ["toy-clip", "toy-euclip", "toy-meru", "toy-siglip"]
NAMES = ["circle", "square", "golden retriever"]
TEMPLATES = ["a photo of a {}.", "a sketch of the {}"]


def pixels(bb, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, bb.image_size, bb.image_size, generator=g)


@pytest.mark.parametrize("towers", ["both", "text", "vision"])
@pytest.mark.parametrize("name", TOY + list(CARD_GEOMETRIES) + [SIGLIP_TEXT])
def test_clip_svd_starts_at_zero_shot_in_every_geometry(name, towers, cards):  # noqa: F811
    bb = backbone(name, cards)
    ad = ClipSVD(ClipSVDConfig(towers=towers), bb, NAMES, TEMPLATES)
    assert ad.trains_image_tower == (towers != "text") == ClipSVD.will_train_image_tower(ad.cfg)
    px = pixels(bb)
    with torch.no_grad():
        feats = ad.encode_images(px)
        torch.testing.assert_close(feats, bb.encode_images(px), rtol=1e-4, atol=1e-5)
        expected = bb.geometry.image_logits(bb.encode_images(px), text_prototypes(bb, NAMES, TEMPLATES))
        torch.testing.assert_close(ad(feats), expected, rtol=1e-4, atol=1e-4)


def test_svd_linear_is_the_linear_and_its_singular_values_scale_it():
    lin = torch.nn.Linear(6, 4)
    layer = SVDLinear(lin)
    x = torch.randn(5, 6)
    torch.testing.assert_close(layer(x), lin(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.s, torch.linalg.svdvals(lin.weight.detach()))
    with torch.no_grad():
        layer.s.mul_(2)
    torch.testing.assert_close(layer(x) - lin.bias, 2 * (lin(x) - lin.bias), rtol=1e-5, atol=1e-5)
    assert [n for n, _ in layer.named_parameters()] == ["s"] and list(layer.state_dict()) == ["s"]


def test_only_singular_values_get_gradients_and_the_backbone_is_untouched():
    bb = backbone("toy-clip")
    before = {k: v.clone() for k, v in bb.model.state_dict().items()}
    ad = ClipSVD(ClipSVDConfig(), bb, NAMES, TEMPLATES)
    ad.train()
    F.cross_entropy(ad(ad.encode_images(pixels(bb, 4))), torch.tensor([0, 1, 2, 0])).backward()
    trainable = ad.trainable_parameters()
    assert trainable and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
    assert {id(p) for p in trainable} == {id(p) for p in ad.parameters()}
    assert all(n.startswith("svd.") and n.endswith(".s") for n in ad.adapter_state_dict())
    assert all(p.grad is None and not p.requires_grad for p in bb.model.parameters())
    assert all(type(b.attn) is torch.nn.MultiheadAttention for b in bb.model.transformer.resblocks)
    assert all(torch.equal(before[k], v) for k, v in bb.model.state_dict().items())
    # q, k, v, o (64 each) and both MLP layers (64 each, min of 64 x 256) of 3 text + 4 vision blocks
    assert ad.trainable_parameter_count() == 6 * 64 * 7


def test_targets_towers_and_layers_choose_the_matrices():
    bb = backbone("toy-clip")
    ad = ClipSVD(ClipSVDConfig(targets="v,mlp", towers="vision", layers="last:2"), bb, NAMES, TEMPLATES)
    assert sorted(ad.svd) == sorted(f"visual__transformer__resblocks__{i}__{m}" for i in (2, 3)
                                    for m in ("attn__v_proj", "mlp__c_fc", "mlp__c_proj"))
    assert not ad.adapts_text and ad.trains_image_tower


@pytest.mark.parametrize("kwargs,field", [({"targets": "q,x"}, "adapter.targets"),
                                          ({"towers": "image"}, "adapter.towers"),
                                          ({"layers": "middle"}, "adapter.layers")])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_train_config(["adapter=clip_svd", *(f"adapter.{k}={v}" for k, v in kwargs.items())])


def test_train_defaults_are_clip_svd_and_can_be_overridden():
    t = load_train_config(["adapter=clip_svd"]).train
    assert (t.optimizer, t.lr, t.weight_decay, t.batch_size, t.iterations_per_shot, t.warmup_epochs) == \
        ("adamw", 5e-4, 1e-2, 32, 200, 0)
    assert load_train_config(["adapter=clip_svd", "train.lr=0.0004"]).train.lr == 4e-4


# ---------------------------------------------------------------- runs, export, predict


@pytest.fixture(scope="module")
def svd_run(tmp_path_factory, shapes):
    out = tmp_path_factory.mktemp("svd_run") / "run"
    cfg = load_train_config(["adapter=clip_svd", "backbone=toy-clip", "data=toy-shapes", "shots=1", "seed=1",
                             "train.iterations=6", "train.lr=0.01", "data.max_test=40", "backbone.device=cpu",
                             "data.templates=single"])
    return out, run_train(cfg, out, dataset=shapes)


def test_a_run_trains_the_singular_values(svd_run):
    out, m = svd_run
    assert m["method"] == "clip_svd" and m["steps"] == 6 and m["n_test"] == 40
    assert m["trainable_parameters"] == 6 * 64 * 7
    sd = load_file(str(out / "adapter.safetensors"))
    assert sd and all(k.startswith("svd.") and k.endswith(".s") for k in sd)


def test_export_merge_and_predict(svd_run, tmp_path, shapes):
    from fewclip.adapter.exports import read_metadata
    from fewclip.backbones.backbone import _card_model_config, read_card, shipped_cards
    from fewclip.cli.main import main
    from fewclip.runs.export import export_run

    out, m = svd_run
    path = export_run(out, tmp_path / "svd.safetensors", merge=True).path
    merged_file = tmp_path / "svd.merged.safetensors"
    assert read_metadata(path)["format"] == "fewclip.adapter"
    assert read_metadata(merged_file)["format"] == "fewclip.tower"
    # the merged file is a plain open_clip state dict: strict load into a freshly built open_clip model
    merged = load_file(str(merged_file))
    plain = build_open_clip_model(_card_model_config(read_card(shipped_cards()["toy-clip"]))).eval()
    plain.load_state_dict(merged, strict=True)

    items = run_test_items(shapes, 40)  # the run's own test images
    a = load_prompts(path, device="cpu")
    b = load_prompts(merged_file, device="cpu")
    px = torch.stack([a.backbone.preprocess()(shapes.load_image(it)) for it in items])
    la, lb = a.logits(px), b.logits(px)
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
    cfg = load_train_config([str(out / "config.yaml")])
    ad = build_adapter(cfg.adapter, a.backbone, shapes.classnames, ["a photo of a {}."])
    ad.load_adapter_state_dict(load_file(str(out / "adapter.safetensors")))
    ad.eval()
    with torch.no_grad():
        torch.testing.assert_close(la, ad(ad.encode_images(px)), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ad.encode_images(px), plain.encode_image(px).float(), rtol=1e-4, atol=1e-4)
    # predict gives what the run scored: the run's top-1 on the same 40 test images
    labels = torch.tensor([it.label for it in items])
    top1 = 100.0 * int((la.argmax(1) == labels).sum()) / len(labels)
    assert abs(top1 - m["top1"]) < 1e-4
    assert a.with_classnames(shapes.classnames[:2]).logits(px[:3]).shape == (3, 2)
    assert b.with_classnames(shapes.classnames[:2]).logits(px[:3]).shape == (3, 2)
    img = tmp_path / "img.png"
    shapes.load_image(items[0]).save(img)
    assert main(["predict", f"prompts={path}", str(img), "top_k=2", "backbone.device=cpu"]) == 0
    assert main(["predict", f"prompts={merged_file}", str(img), "backbone.device=cpu"]) == 0
    assert main(["export", str(out), "-o", str(tmp_path / "plain.safetensors")]) == 0
    assert not (tmp_path / "plain.merged.safetensors").exists()


# ---------------------------------------------------------------- 2SFS


def make_2sfs(name, cards=None, **kw):  # noqa: F811
    from fewclip.adapters.twosfs import TwoSFS, TwoSFSConfig

    bb = backbone(name, cards)
    return bb, TwoSFS(TwoSFSConfig(**kw), bb, NAMES, TEMPLATES)


@pytest.mark.parametrize("name", TOY + list(CARD_GEOMETRIES) + [SIGLIP_TEXT])
def test_2sfs_starts_at_zero_shot_in_both_stages_in_every_geometry(name, cards):  # noqa: F811
    bb, ad = make_2sfs(name, cards)
    px = pixels(bb)
    with torch.no_grad():
        expected = bb.geometry.image_logits(bb.encode_images(px), text_prototypes(bb, NAMES, TEMPLATES))
        torch.testing.assert_close(ad(ad.encode_images(px)), expected, rtol=1e-4, atol=1e-4)
        ad.set_stage(2)  # the classifier starts at the (stage-1) towers' prototypes
        torch.testing.assert_close(ad(ad.encode_images(px)), expected, rtol=1e-4, atol=1e-4)


def test_2sfs_stages_schedule_and_trainable_tensors():
    from fewclip.adapters.twosfs import stage_lr

    bb, ad = make_2sfs("toy-clip")
    before = {k: v.clone() for k, v in bb.model.state_dict().items()}
    # ln_1 and ln_2 of 3 text + 4 vision blocks of width 64 (weight and bias) + the classifier [3, 64]
    assert len(ad.ln) == 14 and ad.classifier.shape == (3, 64) and ad.trainable_parameter_count() == 14 * 128 + 3 * 64
    total = 10
    lrs = [ad.learning_rate(s, total, 2e-4) for s in range(3)]
    assert int(ad.stage) == 1 and lrs == [stage_lr(s, 6, 2e-4) for s in range(3)]
    ad.train()
    F.cross_entropy(ad(ad.encode_images(pixels(bb, 4))), torch.tensor([0, 1, 2, 0])).backward()
    assert all(p.grad is not None for p in ad.ln.parameters()) and ad.classifier.grad is None
    ad.zero_grad(set_to_none=True)
    assert ad.learning_rate(6, total, 2e-4) == 2e-4 and int(ad.stage) == 2  # a fresh cosine over the last 4
    assert abs(ad.learning_rate(9, total, 2e-4) - stage_lr(3, 4, 2e-4)) < 1e-15
    F.cross_entropy(ad(ad.encode_images(pixels(bb, 4))), torch.tensor([0, 1, 2, 0])).backward()
    assert all(p.grad is None for p in ad.ln.parameters()) and ad.classifier.grad is not None
    assert all(torch.equal(before[k], v) for k, v in bb.model.state_dict().items())
    assert all(p.grad is None and not p.requires_grad for p in bb.model.parameters())


def test_2sfs_new_class_names_get_the_text_tower_and_trained_ones_keep_their_row():
    bb, ad = make_2sfs("toy-clip")
    ad.set_stage(2)
    with torch.no_grad():
        ad.classifier.mul_(-1.0).add_(0.3)
    other = ad.for_classnames(["square", "triangle"], TEMPLATES)
    assert int(other.stage) == 2
    torch.testing.assert_close(other.classifier[0], ad.classifier[1])
    new = bb.geometry.to_linear(text_prototypes(bb, ["triangle"], TEMPLATES))[0]
    torch.testing.assert_close(other.classifier[1], new, rtol=1e-5, atol=1e-5)


def test_2sfs_train_defaults():
    cfg = load_train_config(["adapter=2sfs"])
    t = cfg.train
    assert (t.optimizer, t.lr, t.weight_decay, t.batch_size, t.iterations_per_shot, t.warmup_epochs) == \
        ("adamw", 2e-4, 1e-2, 32, 300, 0)
    assert (cfg.adapter.towers, cfg.adapter.layers, cfg.adapter.stage1_fraction) == ("both", "all", 0.6)
    with pytest.raises(ConfigError, match=r"adapter\.stage1_fraction"):
        load_train_config(["adapter=2sfs", "adapter.stage1_fraction=1.0"])


@pytest.fixture(scope="module")
def twosfs_run(tmp_path_factory, shapes):
    out = tmp_path_factory.mktemp("twosfs_run") / "run"
    cfg = load_train_config(["adapter=2sfs", "backbone=toy-clip", "data=toy-shapes", "shots=1", "seed=1",
                             "train.iterations=6", "train.lr=0.01", "data.max_test=40", "backbone.device=cpu",
                             "data.templates=single"])
    return out, run_train(cfg, out, dataset=shapes)


def test_2sfs_run_ends_in_stage_two_and_exports(twosfs_run, tmp_path, shapes):
    from fewclip.backbones.backbone import _card_model_config, read_card, shipped_cards
    from fewclip.runs.export import export_run

    out, m = twosfs_run
    assert m["method"] == "2sfs" and m["steps"] == 6
    sd = load_file(str(out / "adapter.safetensors"))
    assert int(sd["stage"]) == 2 and "classifier" in sd
    path = export_run(out, tmp_path / "t.safetensors", merge=True).path
    plain = build_open_clip_model(_card_model_config(read_card(shipped_cards()["toy-clip"]))).eval()
    plain.load_state_dict(load_file(str(tmp_path / "t.merged.safetensors")), strict=True)
    items = run_test_items(shapes, 40)
    a = load_prompts(path, device="cpu")
    px = torch.stack([a.backbone.preprocess()(shapes.load_image(it)) for it in items])
    la = a.logits(px)
    labels = torch.tensor([it.label for it in items])
    assert abs(100.0 * int((la.argmax(1) == labels).sum()) / len(labels) - m["top1"]) < 1e-4  # what the run scored
    # the merged towers (stage-1 LayerNorms) are the adapter's image tower
    with torch.no_grad():
        torch.testing.assert_close(a.adapter.encode_images(px), plain.encode_image(px).float(), rtol=1e-4, atol=1e-4)
    merged = load_prompts(tmp_path / "t.merged.safetensors", device="cpu")
    assert merged.logits(px[:2]).shape == (2, len(shapes.classnames))


@pytest.mark.parametrize("method", ["clip_svd", "2sfs"])
def test_text_tower_only_runs_train_on_the_feature_store(method, shapes, tmp_path):
    """The image tower stays frozen: its features are encoded once per image and view (the run's feature cache),
    not at every step as with the image tower tuned."""
    args = [f"adapter={method}", "adapter.towers=text", "backbone=toy-clip", "data=toy-shapes", "shots=1", "seed=1",
            "train.iterations=20", "train.batch_size=4", "train.augment_views=2", "data.max_test=16",
            "backbone.device=cpu", "data.templates=single"]
    m = run_train(load_train_config(args), tmp_path / "run", dataset=shapes)
    n_train = len(shapes.classnames)  # 1 shot per class
    # 2 cached views of the training images + the test images (with the image tower tuned: 20 steps x 4 + 16)
    assert m["steps"] == 20 and m["images_encoded"] == 2 * n_train + 16
