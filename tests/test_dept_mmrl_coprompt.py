"""DePT, MMRL and CoPrompt (issue 23) in fewclip: every geometry and SigLIP-style towers, the zero-shot start
where the method has one, only the method's tensors learn and the backbone is untouched, new class names as
the authors score them, the engine's parameter groups, export and predict. Parity with the authors' code is
tests/parity/test_dept_mmrl_coprompt_parity.py."""
import copy
import json
import logging

import pytest
import torch

import fewclip
from fewclip.adapters import build_adapter
from fewclip.adapters.coprompt import CoPrompt, CoPromptConfig, class_descriptions, shipped_descriptions
from fewclip.adapters.dept import DePT, DePTConfig
from fewclip.adapters.maple import MaPLe
from fewclip.adapters.mmrl import MMRL, MMRLConfig
from fewclip.cli.main import main
from fewclip.features.encode import Features, text_prototypes
from fewclip.runs.export import export_run
from fewclip.training.engine import CachedFeatures, TrainConfig, train_loop
from helpers.cards import CARD_GEOMETRIES, SHAPES
from helpers.deep import CLASSNAMES, TOY, cards, load, pixels, snapshot, unchanged  # noqa: F401 (fixture)

TEMPLATE = ["a photo of a {}."]
EVERY = TOY + list(CARD_GEOMETRIES) + ["siglip-text", "custom-blocks"]


def classes(name):
    return SHAPES if name.startswith("toy") else CLASSNAMES


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ---------------------------------------------------------------- DePT


@pytest.mark.parametrize("learner", ["coop", "maple"])
@pytest.mark.parametrize("name", EVERY)
def test_dept_new_classes_start_at_zero_shot_and_base_classes_fuse_the_head(name, learner, cards):
    """With a word-initialised learner, new class names (scored by the prompts alone, as the authors do) get
    zero-shot CLIP's logits at initialisation in every geometry; the base classes get the fused logits."""
    bb = load(name, cards)
    names = classes(name)
    cfg = DePTConfig(learner=learner, n_ctx=4, ctx_init="a photo of a", depth=1)
    a = build_adapter(cfg, bb, names[:2], TEMPLATE)
    assert a.trains_image_tower == DePT.will_train_image_tower(cfg) == (learner == "maple")
    new = a.for_classnames(names, TEMPLATE)
    assert not new.has_head and not new.training
    px = pixels(bb)
    with torch.no_grad():
        feats = bb.encode_images(px)
        want = bb.geometry.image_logits(feats, text_prototypes(bb, names, TEMPLATE))
        if learner == "coop":  # MaPLe always prompts the image tower: its start is not the frozen tower
            close(new(new.encode_images(px)), want)
        else:
            close(new(feats), want)  # the text side with image features of the frozen tower is zero-shot
        f = a.encode_images(px)
        sim = a.similarity_logits(f, a.learner.text_features())
        close(a(f), 0.3 * sim + 0.7 * a.head(a.cwt_image(f)))


@pytest.mark.parametrize("learner", ["coop", "maple"])
@pytest.mark.parametrize("name", ["toy-clip", "toy-siglip", "toy-meru", "siglip-text"])
def test_dept_only_its_tensors_learn_and_the_backbone_is_untouched(name, learner, cards):
    bb = load(name, cards)
    snap = snapshot(bb)
    names = classes(name)[:4]
    a = build_adapter(DePTConfig(learner=learner, n_ctx=2, ctx_init="a photo of a"), bb, names, TEMPLATE).train()
    groups = a.param_groups()
    assert [g["lr_scale"] for g in groups] == [1.0, 6.5]
    assert {id(p) for g in groups for p in g["params"]} == {id(p) for p in a.trainable_parameters()}
    opt = torch.optim.SGD(groups, lr=0.1)
    px, y = pixels(bb, n=4), torch.arange(4) % len(names)
    for _ in range(2):
        terms = a.training_loss(a.encode_images(px), y)
        assert set(terms) == {"loss", "ce", "ce_head"}
        close(terms["loss"].detach(), 0.3 * terms["ce"] + 0.7 * terms["ce_head"])
        opt.zero_grad()
        terms["loss"].backward()
        opt.step()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in a.trainable_parameters())
    assert sorted(n for n, _ in a.named_parameters()) == sorted(a.adapter_state_dict())
    unchanged(bb, snap)



def test_the_engines_loop_gives_the_head_its_learning_rate():
    """fewclip's loop takes an adapter's parameter groups: one step of train_loop equals SGD with the prompts at
    the run's lr and DePT's head and cwT at 6.5 times it (the engine's cosine at step 0 is the base rate)."""
    bb = load("toy-clip")
    feats = bb.encode_images(pixels(bb, n=4))
    y = torch.tensor([0, 1, 2, 3])
    a = build_adapter(DePTConfig(n_ctx=4), bb, SHAPES[:4], TEMPLATE)
    b = copy.deepcopy(a)
    cfg = TrainConfig(lr=0.1, epochs=1, batch_size=4, warmup_epochs=0)
    train_loop(a, CachedFeatures([Features(feats, y)], Features(feats, y)), cfg, 1, torch.Generator().manual_seed(0))
    b.train()
    opt = torch.optim.SGD([{"params": g["params"], "lr": 0.1 * g["lr_scale"]} for g in b.param_groups()],
                          lr=0.1, momentum=0.9, weight_decay=5e-4)
    b.training_loss(feats, y)["loss"].backward()
    opt.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        close(p.detach(), q.detach(), 1e-6)


def test_dept_fusion_off_scores_base_classes_by_the_head(cards):
    bb = load("toy-euclip")
    a = build_adapter(DePTConfig(fusion=False, cwt=False), bb, SHAPES, TEMPLATE)
    assert not hasattr(a, "cwt_image")
    f = bb.encode_images(pixels(bb))
    with torch.no_grad():
        close(a(f), a.head(f))


@pytest.mark.parametrize("kwargs, match", [
    ({"learner": "cocoop"}, "adapter.learner"), ({"n_ctx": 0}, "adapter.n_ctx"),
    ({"head_weight": 1.5}, "adapter.head_weight"), ({"head_lr_scale": 0}, "adapter.head_lr_scale"),
    ({"depth": 0}, "adapter.depth"), ({"ctx_init": " "}, "adapter.ctx_init"),
])
def test_dept_bad_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DePTConfig(**kwargs)


def test_dept_new_classes_have_no_head_to_train():
    bb = load("toy-clip")
    a = build_adapter(DePTConfig(), bb, SHAPES[:3], TEMPLATE).for_classnames(SHAPES, TEMPLATE)
    with pytest.raises(ValueError, match="no head to train"):
        a.training_loss(bb.encode_images(pixels(bb)), torch.tensor([0, 1, 2]))


def test_dept_trains_exports_and_predicts_what_the_run_scored(tmp_path, shapes):
    """``fewclip train`` with the head at 6.5 x the prompts' learning rate, then export and predict: the
    export's logits are the adapter's (fused for its classes, the prompts alone for new names)."""
    run = tmp_path / "run"
    assert main(["train", "adapter=dept", "adapter.n_ctx=4", "data=toy-shapes", "shots=1", "seed=1",
                 "train.epochs=2", "data.max_test=16", "data.templates=single", "backbone.device=cpu",
                 f"out={run}"]) == 0
    clf = fewclip.load_prompts(export_run(run).path, device="cpu")
    a = clf.adapter
    assert isinstance(a, DePT) and a.has_head and a.head.weight.shape[0] == len(shapes.classnames)
    images = [shapes.load_image(it) for it in shapes.items("test")[:4]]
    with torch.no_grad():
        f = clf.backbone.encode_images(clf.pixels(images))
        close(clf.logits(images), a(f), 1e-6)
        new = clf.with_classnames(["moon", "sun"])
        close(new.logits(images), a.for_classnames(["moon", "sun"], a.templates)(f), 1e-6)
    assert not new.adapter.has_head


# ---------------------------------------------------------------- MMRL


@pytest.mark.parametrize("name", EVERY)
def test_mmrl_runs_in_every_geometry_and_only_its_tensors_learn(name, cards):
    bb = load(name, cards)
    snap = snapshot(bb)
    names = classes(name)
    a = build_adapter(MMRLConfig(rep_depth=2, n_rep_tokens=3, rep_dim=16), bb, names, TEMPLATE).train()
    assert a.trains_image_tower and MMRL.will_train_image_tower(MMRLConfig()) and a.wants_frozen_features
    px, y = pixels(bb, n=4), torch.arange(4) % len(names)
    opt = torch.optim.AdamW(a.trainable_parameters(), lr=1e-2)
    for _ in range(2):
        f = a.encode_images(px)
        assert f.shape == (4, 2 * a.proj_rep.shape[1])
        terms = a.training_loss(f, y, frozen=bb.encode_images(px))
        assert set(terms) == {"loss", "ce", "ce_rep", "reg_image", "reg_text"}
        assert all(torch.isfinite(v) for v in terms.values())
        close(terms["loss"].detach(), 0.7 * terms["ce"] + 0.3 * terms["ce_rep"] + terms["reg_image"] + terms["reg_text"])
        opt.zero_grad()
        terms["loss"].backward()
        opt.step()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in a.trainable_parameters())
    assert sorted(n for n, _ in a.named_parameters()) == sorted(a.adapter_state_dict())
    unchanged(bb, snap)
    a.eval()
    with torch.no_grad():  # the trained classes: fused; other names: the class token's logits alone
        f = a.encode_images(px)
        logits, rep, _ = a._logits(f)
        close(a(f), 0.7 * logits + 0.3 * rep)
        other = a.for_classnames(list(reversed(names)), TEMPLATE)
        assert not other.fused and a.for_classnames(names, TEMPLATE) is a
        close(other(f), logits.flip(1))


@pytest.mark.parametrize("name", ["toy-clip", "toy-siglip", "siglip-text", "custom-blocks"])
def test_mmrl_lower_blocks_once_equals_the_full_tower_every_step(name, cards):
    """The text layers below the first representation layer are computed once; the authors' way (full context
    length, every block each step) gives the same features and gradients."""
    bb = load(name, cards)
    a = build_adapter(MMRLConfig(rep_depth=1), bb, classes(name), TEMPLATE, generator=torch.Generator().manual_seed(3))
    assert a.first_text == len(a.tower.transformer.resblocks) - 1
    got = []
    for mode in ("truncate", "faithful"):
        a.set_text_mode(mode).zero_grad()
        t = a.text_features()
        (t ** 2).sum().backward()
        got.append((t.detach(), a.rep_tokens.grad.clone()))
    close(got[0][0], got[1][0])
    close(got[0][1], got[1][1], 1e-4)


def test_mmrl_layers_are_counted_from_the_end_and_start_as_their_clones():
    bb = load("toy-clip")  # text: 3 layers, vision: 4
    a = build_adapter(MMRLConfig(), bb, SHAPES, TEMPLATE)
    assert (a.depth_text, a.depth_vision, a.first_text, a.first_vision) == (3, 4, 0, 0)
    assert a.to_text_weight.shape == (3, 64, 512) and a.to_vision_weight.shape == (4, 64, 512)
    w = a.to_vision_weight.detach()
    assert all(torch.equal(w[k], w[0]) for k in range(4))  # their clones: one Linear copied per layer
    b = build_adapter(MMRLConfig(rep_depth=2), bb, SHAPES, TEMPLATE)
    assert (b.first_text, b.first_vision) == (1, 2)
    assert float(a.proj_rep.detach().std()) == pytest.approx(64 ** -0.5, rel=0.1)


@pytest.mark.parametrize("kwargs, match", [
    ({"n_rep_tokens": 0}, "adapter.n_rep_tokens"), ({"rep_depth": 0}, "adapter.rep_depth"),
    ({"alpha": 2}, "adapter.alpha"), ({"reg_weight": -1}, "adapter.reg_weight"),
])
def test_mmrl_bad_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MMRLConfig(**kwargs)


def test_mmrl_needs_the_template():
    with pytest.raises(ValueError, match="data.templates=single"):
        build_adapter(MMRLConfig(), load("toy-clip"), SHAPES, [])


def test_mmrl_trains_exports_and_predicts_what_the_run_scored(tmp_path, shapes):
    run = tmp_path / "run"
    assert main(["train", "adapter=mmrl", "adapter.rep_dim=32", "data=toy-shapes", "shots=1", "seed=1",
                 "train.epochs=2", "data.max_test=16", "data.templates=single", "backbone.device=cpu",
                 f"out={run}"]) == 0
    metrics = json.loads((run / "metrics.json").read_text())
    assert set(metrics["loss_terms"]) == {"ce", "ce_rep", "reg_image", "reg_text"}
    clf = fewclip.load_prompts(export_run(run).path, device="cpu")
    a = clf.adapter
    assert isinstance(a, MMRL) and a.fused
    images = [shapes.load_image(it) for it in shapes.items("test")[:4]]
    with torch.no_grad():
        px = clf.pixels(images)
        close(clf.logits(images), a(a.encode_images(px)), 1e-6)
        new = clf.with_classnames(["moon", "sun"])
        assert not new.adapter.fused
        close(new.logits(images), new.adapter._logits(new.adapter.encode_images(px))[0], 1e-6)


# ---------------------------------------------------------------- CoPrompt


@pytest.mark.parametrize("name", EVERY)
def test_coprompt_runs_in_every_geometry_and_only_its_tensors_learn(name, cards):
    bb = load(name, cards)
    snap = snapshot(bb)
    names = classes(name)
    a = build_adapter(CoPromptConfig(depth=2), bb, names, TEMPLATE).train()
    assert a.trains_image_tower and CoPrompt.will_train_image_tower(CoPromptConfig()) and a.wants_frozen_features
    px, y = pixels(bb, n=4), torch.arange(4) % len(names)
    opt = torch.optim.SGD(a.trainable_parameters(), lr=0.1)
    for step in range(2):
        terms = a.training_loss(a.encode_images(px), y, frozen=bb.encode_images(px))
        assert set(terms) == {"loss", "ce", "distill_text", "distill_image"}
        close(terms["loss"].detach(), terms["ce"] + terms["distill_text"] + terms["distill_image"])
        opt.zero_grad()
        terms["loss"].backward()
        opt.step()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in a.trainable_parameters())
    assert sorted(n for n, _ in a.named_parameters()) == sorted(a.adapter_state_dict())
    unchanged(bb, snap)
    a.eval()
    with torch.no_grad():  # nothing per class: other names are scored by the same prompts and adapters
        f = a.encode_images(px)
        other = a.for_classnames(list(reversed(names)), TEMPLATE)
        close(other(f), a(f).flip(1))


def test_coprompt_adapters_mix_as_theirs():
    bb = load("toy-euclip")
    a = build_adapter(CoPromptConfig(depth=1), bb, SHAPES, TEMPLATE)
    f = bb.encode_images(pixels(bb))
    with torch.no_grad():
        close(a.adapted_images(f), 0.1 * torch.relu(torch.relu(f @ a.adapter_image.down.T) @ a.adapter_image.up.T)
              + 0.9 * f)
        t = MaPLe.text_features(a)
        close(a.text_features(), 0.2 * a.adapter_text(t) + 0.8 * t)
    assert a.adapter_image.down.shape == (16, 64) and a.adapter_image.up.shape == (64, 16)  # D / 4


def test_coprompt_uses_the_authors_descriptions_where_they_cover_the_classes(cards, caplog):
    """OxfordPets' class names (any case, underscores) find the authors' 10 GPT-3 descriptions each; the toy
    shapes find none and fall back to the templates, with a warning line naming the change."""
    bb = load("elliptic", cards)  # open_clip's BPE tokenizer
    pets = ["Abyssinian", "american_bulldog", "Beagle"]
    table = shipped_descriptions()
    texts = class_descriptions(CoPromptConfig(), pets, TEMPLATE)
    assert [len(t) for t in texts] == [10, 10, 10] and texts[0] == table["abyssinian"]
    assert texts[0][0].startswith("A photo of a pet abyssinian")
    a = build_adapter(CoPromptConfig(depth=1), bb, pets, TEMPLATE)
    caplog.clear()  # only what description_points logs (a backbone loaded above for the first time logs a line)
    with caplog.at_level(logging.WARNING, logger="fewclip.adapters.coprompt"):
        points = a.description_points()
    assert points.shape == (10, 3, 16) and not caplog.records
    g = bb.geometry
    close(points[3, 1], g.to_linear(g.embed_text(bb.encode_text([table["american bulldog"][3]])))[0])
    toy = build_adapter(CoPromptConfig(depth=1), bb, pets[:2] + ["zzyzx thing"], ["a photo of a {}.", "a {}."])
    with caplog.at_level(logging.WARNING, logger="fewclip.adapters.coprompt"):
        assert toy.description_points().shape[0] == 2  # the two templates stand in
    assert "no LLM descriptions of 1 of 3 classes" in caplog.text and "adapter.descriptions=FILE.json" in caplog.text


def test_coprompt_takes_a_users_descriptions_file(tmp_path, cards):
    bb = load("elliptic", cards)
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"Cat": ["a small cat.", "a cat asleep."], "dog": ["a loud dog."]}))
    a = build_adapter(CoPromptConfig(depth=1, descriptions=str(path)), bb, ["cat", "dog"], TEMPLATE)
    points = a.description_points()
    g = bb.geometry
    want = g.to_linear(g.embed_text(bb.encode_text(["a small cat.", "a cat asleep.", "a loud dog."])))
    assert points.shape == (2, 2, 16)
    close(points[:, 0], want[:2])  # cat: its two descriptions
    close(points[:, 1], want[2:].expand(2, -1))  # dog: its one description, reused
    terms = a.training_loss(a.encode_images(pixels(bb, 2)), torch.tensor([0, 1]),
                            frozen=bb.encode_images(pixels(bb, 2)), description=1)
    assert torch.isfinite(terms["loss"])
    with pytest.raises(ValueError, match="no descriptions of 1 class"):
        build_adapter(CoPromptConfig(descriptions=str(path)), bb, ["cat", "bird"], TEMPLATE).description_points()
    with pytest.raises(ValueError, match="no such file"):
        build_adapter(CoPromptConfig(descriptions=str(tmp_path / "x.json")), bb, ["cat"], TEMPLATE).description_points()
    (tmp_path / "bad.json").write_text('{"cat": "one string"}')
    with pytest.raises(ValueError, match="non-empty list"):
        build_adapter(CoPromptConfig(descriptions=str(tmp_path / "bad.json")), bb, ["cat"], TEMPLATE).description_points()


@pytest.mark.parametrize("kwargs, match", [
    ({"distill": "kl"}, "adapter.distill"), ({"adapter_reduction": 0}, "adapter.adapter_reduction"),
    ({"image_adapter_ratio": 2}, "adapter.image_adapter_ratio"), ({"distill_weight": -1}, "adapter.distill_weight"),
    ({"descriptions": " "}, "adapter.descriptions"), ({"depth": 0}, "adapter.depth"),
])
def test_coprompt_bad_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CoPromptConfig(**kwargs)


def test_coprompt_trains_exports_and_predicts_what_the_run_scored(tmp_path, shapes, capfd):
    run = tmp_path / "run"
    assert main(["train", "adapter=coprompt", "adapter.depth=2", "data=toy-shapes", "shots=1", "seed=1",
                 "train.epochs=2", "data.max_test=16", "data.templates=single", "backbone.device=cpu",
                 f"out={run}"]) == 0
    assert "uses the run's 1 template(s) instead" in capfd.readouterr().err  # the log line of the fallback
    metrics = json.loads((run / "metrics.json").read_text())
    assert set(metrics["loss_terms"]) == {"ce", "distill_text", "distill_image"}
    clf = fewclip.load_prompts(export_run(run).path, device="cpu")
    a = clf.adapter
    assert isinstance(a, CoPrompt)
    images = [shapes.load_image(it) for it in shapes.items("test")[:4]]
    with torch.no_grad():
        px = clf.pixels(images)
        close(clf.logits(images), a(a.encode_images(px)), 1e-6)
        new = clf.with_classnames(["moon", "sun"])
        close(new.logits(images), a.for_classnames(["moon", "sun"], a.templates)(a.encode_images(px)), 1e-6)
