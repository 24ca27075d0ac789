"""SkipTuning (adapters/skiptuning.py): zero-shot at the start in every geometry, class-wise skipping as a few
numbers, only the upper blocks train and the lower ones keep no activations, a run trains, and both exports
predict what the run scored. Its authors' numbers: tests/parity/test_skiptuning_parity.py."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from fewclip.adapter.base import AdapterError
from fewclip.adapter.exports import load_prompts, read_metadata
from fewclip.adapters.skiptuning import SkipTuning, SkipTuningConfig, always_run, reserve_ratios, run_ranks, skip_classes
from fewclip.backbones.backbone import _card_model_config, build_open_clip_model, read_card, shipped_cards
from fewclip.config.compose import ConfigError
from fewclip.data.splits import test_items as run_test_items
from fewclip.features.encode import text_prototypes
from fewclip.runs.export import export_run
from fewclip.runs.run import load_train_config, run_train
from helpers.cards import CARD_GEOMETRIES, SIGLIP_TEXT, backbone, cards  # noqa: F401  (cards is a fixture)

TOY = ["toy-clip", "toy-euclip", "toy-meru", "toy-siglip"]
NAMES = ["circle", "square", "triangle", "star", "cross", "ring"]
TEMPLATES = ["a photo of a {}.", "a sketch of the {}"]


def pixels(bb, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, bb.image_size, bb.image_size, generator=g)


@pytest.mark.parametrize("start", [None, 0, 1])
@pytest.mark.parametrize("name", TOY + list(CARD_GEOMETRIES) + [SIGLIP_TEXT])
def test_starts_at_zero_shot_in_every_geometry(name, start, cards):  # noqa: F811
    bb = backbone(name, cards)
    ad = SkipTuning(SkipTuningConfig(start_layer=start), bb, NAMES, TEMPLATES)
    assert ad.trains_image_tower and SkipTuning.will_train_image_tower(ad.cfg)
    px = pixels(bb)
    with torch.no_grad():
        feats = ad.encode_images(px)
        torch.testing.assert_close(feats, bb.encode_images(px), rtol=1e-4, atol=1e-5)
        expected = bb.geometry.image_logits(bb.encode_images(px), text_prototypes(bb, NAMES, TEMPLATES))
        torch.testing.assert_close(ad(feats), expected, rtol=1e-4, atol=1e-4)
        # the step's loss at the start: cross-entropy of the zero-shot logits over the classes it runs
        labels = torch.tensor([0, 3, 3])
        classes, target = skip_classes(bb.geometry.image_logits(feats, ad.class_protos), labels,
                                       run_ranks(ad.keep, len(labels)))
        assert len(classes) < len(NAMES)
        want = F.cross_entropy(expected[:, classes], target)
        torch.testing.assert_close(ad.training_loss(feats, labels)["loss"], want, rtol=1e-4, atol=1e-4)


def test_class_skipping_in_numbers():
    assert always_run(10, 0.5, 50) == 5 and always_run(10, 0.5, 3) == 3 and always_run(10, 4.0, 50) == 4
    assert always_run(1000, 0.5, 50) == 50  # their defaults on ImageNet
    r = reserve_ratios(6, 2, 1.0)  # 1, 1, then exp(-x) on x = 0, 5/3, 10/3, 5, min-max normalised
    e = torch.exp(-torch.tensor([0.0, 5 / 3, 10 / 3, 5.0], dtype=torch.float64))
    torch.testing.assert_close(r, torch.cat([torch.ones(2), ((e - e[-1]) / (1 - e[-1])).float()]))
    assert torch.isnan(reserve_ratios(3, 2, 0.3)[2])  # one rank after the top: 0/0 as theirs, never kept
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.3, 0.0],
                           [0.2, 0.0, 0.8, 0.1, 0.7]])
    keep = torch.tensor([True, False, False, True, False])  # ranks 0 and 3, and the batch's first 2
    assert run_ranks(keep, 2).tolist() == [0, 1, 3]
    # labels 1 and 3 rank first; then by the best score over the batch: class 0 (0.9), 2 (0.8), 4 (0.7)
    classes, target = skip_classes(scores, torch.tensor([1, 3]), run_ranks(keep, 2))
    assert classes.tolist() == [1, 2, 3] and target.tolist() == [0, 2]
    # more labels than kept ranks: every label is still run (their code would relabel a dropped one as 0)
    keep = torch.tensor([True, False, False, False, False])
    classes, target = skip_classes(scores[[0, 1, 1]], torch.tensor([1, 3, 4]), run_ranks(keep, 3))
    assert classes.tolist() == [1, 3, 4] and target.tolist() == [0, 1, 2]


def test_only_the_upper_blocks_train_and_the_lower_ones_keep_no_activations():
    bb = backbone("toy-clip")  # 3 text blocks, 4 image blocks: start_layer null freezes 1 and 2
    before = {k: v.clone() for k, v in bb.model.state_dict().items()}
    ad = SkipTuning(SkipTuningConfig(), bb, NAMES, TEMPLATES)
    assert ad.start == {"text": 1, "vision": 2}
    tuned = {n.split(".")[1] for n, _ in ad.named_parameters()}
    assert tuned == {"transformer__resblocks__1", "transformer__resblocks__2", "ln_final", "text_projection",
                     "visual__transformer__resblocks__2", "visual__transformer__resblocks__3", "visual__ln_post",
                     "visual__proj"}
    ad.train()
    ad.training_loss(ad.encode_images(pixels(bb, 4)), torch.tensor([0, 1, 2, 0]))["loss"].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ad.trainable_parameters())
    assert all(p.grad is None and not p.requires_grad for p in bb.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in bb.model.state_dict().items())
    groups = ad.param_groups()
    assert [g["lr_scale"] for g in groups] == [1.0, 0.25]
    assert {id(p) for p in groups[1]["params"]} == {id(p) for n, p in ad.named_parameters() if ".visual__" in n}

    def saved_bytes(start):
        a = SkipTuning(SkipTuningConfig(start_layer=start, top_ratio=1.0), bb, NAMES, TEMPLATES).train()
        total = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            a.training_loss(a.encode_images(pixels(bb, 4)), torch.tensor([0, 1, 2, 0]))
        return sum(total)

    # the frozen blocks run without gradients: what backward keeps shrinks with start_layer (un-skipped: 0)
    assert saved_bytes(0) > saved_bytes(1) > saved_bytes(2)


def test_dropped_tokens_only_in_training():
    bb = backbone("toy-clip")
    ad = SkipTuning(SkipTuningConfig(drop_ratio=0.9), bb, NAMES, TEMPLATES).eval()
    px = pixels(bb)
    with torch.no_grad():
        torch.testing.assert_close(ad.encode_images(px), bb.encode_images(px), rtol=1e-4, atol=1e-5)
        ad.train()
        torch.manual_seed(0)  # the loop forks torch's global generator from the run's; here, seeded directly
        assert not torch.allclose(ad.encode_images(px), bb.encode_images(px), atol=1e-3)


def test_start_layer_past_the_towers_and_bad_config_name_the_field():
    bb = backbone("toy-clip")
    with pytest.raises(AdapterError, match=r"adapter\.start_layer=4 is past the 3 blocks"):
        SkipTuning(SkipTuningConfig(start_layer=4), bb, NAMES, TEMPLATES)
    for key, value in [("start_layer", -1), ("top_ratio", 0), ("reserve_lambda", 0), ("drop_ratio", 1),
                       ("image_lr_scale", 0), ("max_top", 0)]:
        with pytest.raises(ConfigError, match=rf"adapter\.{key}"):
            load_train_config(["adapter=skiptuning", f"adapter.{key}={value}"])


def test_an_image_tower_that_is_no_vit_is_refused_with_the_fix():
    model = build_open_clip_model({"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1],
                                                                   "width": 8},
                                   "text_cfg": {"context_length": 8, "vocab_size": 100, "width": 16, "heads": 2,
                                                "layers": 1}})
    with pytest.raises(AdapterError, match="image tower is a ModifiedResNet: use a ViT backbone"):
        SkipTuning(SkipTuningConfig(), SimpleNamespace(model=model), NAMES, TEMPLATES)


def test_train_defaults_are_their_base_to_novel_recipe():
    t = load_train_config(["adapter=skiptuning"]).train
    assert (t.optimizer, t.lr, t.momentum, t.weight_decay, t.batch_size, t.epochs, t.warmup_epochs, t.warmup_lr) \
        == ("sgd", 2e-5, 0.9, 5e-4, 4, 20, 1, 1e-6)
    cfg = load_train_config(["adapter=skiptuning", "train.lr=1e-5", "train.epochs=40", "train.warmup_epochs=0",
                             "adapter.image_lr_scale=1"])
    assert (cfg.train.lr, cfg.train.epochs, cfg.adapter.image_lr_scale) == (1e-5, 40, 1.0)


def test_new_class_names_go_through_the_tuned_text_tower():
    bb = backbone("toy-clip")
    ad = SkipTuning(SkipTuningConfig(), bb, NAMES, TEMPLATES)
    with torch.no_grad():
        for p in ad.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    other = ad.for_classnames(["ring", "circle"], TEMPLATES)
    px = pixels(bb)
    with torch.no_grad():
        feats = ad.encode_images(px)
        torch.testing.assert_close(other(feats), ad(feats)[:, [5, 0]], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- a run, export, predict


@pytest.fixture(scope="module")
def skip_run(tmp_path_factory, shapes):
    out = tmp_path_factory.mktemp("skip_run") / "run"
    cfg = load_train_config(["adapter=skiptuning", "backbone=toy-clip", "data=toy-shapes", "shots=1", "seed=1",
                             "train.iterations=4", "train.lr=0.01", "data.max_test=24", "backbone.device=cpu",
                             "data.templates=single"])
    return out, run_train(cfg, out, dataset=shapes)


def test_a_run_trains_and_both_exports_predict_what_it_scored(skip_run, tmp_path, shapes):
    out, m = skip_run
    assert m["method"] == "skiptuning" and m["steps"] == 4 and m["n_test"] == 24
    sd = load_file(str(out / "adapter.safetensors"))
    assert sd and all(k.startswith(("blocks.", "projections.")) for k in sd)
    assert m["trainable_parameters"] == sum(v.numel() for v in sd.values())
    path = export_run(out, tmp_path / "skip.safetensors", merge=True).path
    merged_file = tmp_path / "skip.merged.safetensors"
    assert read_metadata(path)["format"] == "fewclip.adapter"
    assert read_metadata(merged_file)["format"] == "fewclip.tower"
    plain = build_open_clip_model(_card_model_config(read_card(shipped_cards()["toy-clip"]))).eval()
    plain.load_state_dict(load_file(str(merged_file)), strict=True)
    items = run_test_items(shapes, 24)  # the run's own test images
    a, b = load_prompts(path, device="cpu"), load_prompts(merged_file, device="cpu")
    px = torch.stack([a.backbone.preprocess()(shapes.load_image(it)) for it in items])
    la = a.logits(px)
    torch.testing.assert_close(la, b.logits(px), rtol=1e-4, atol=1e-4)
    labels = torch.tensor([it.label for it in items])
    assert abs(100.0 * int((la.argmax(1) == labels).sum()) / len(labels) - m["top1"]) < 1e-4
