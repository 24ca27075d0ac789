"""Deep prompts (IVLP, MaPLe, PromptSRC) pinned down: depth 0 is the unmodified tower in every kind of
block, with and without local windows; prompts sit where the authors put them; every text path gives the
same features; the backbone is never touched; the zero-shot start in every geometry; MaPLe's couplings;
PromptSRC's teacher, losses and aggregation; the engine feeds the frozen features of the same view; new
class names. The parity with the authors' code is tests/parity/test_deep_parity.py."""
import copy

import pytest
import torch
import torch.nn.functional as F

from fewclip.adapters import build_adapter
from fewclip.adapters._deep import encode_image_deep, encode_text_deep, gaussian_weights
from fewclip.adapters._text import TextTower
from fewclip.adapters.ivlp import IVLP, IVLPConfig
from fewclip.adapters.maple import MaPLe, MaPLeConfig
from fewclip.adapters.promptsrc import PromptSRC, PromptSRCConfig, imagenet60_templates
from fewclip.backbones.attention import Window
from fewclip.features.encode import text_prototypes
from helpers.cards import CARD_GEOMETRIES, SHAPES
from helpers.deep import CLASSNAMES, TOY, cards, load, pixels, snapshot, unchanged  # noqa: F401


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)






# ---------------------------------------------------------------- depth 0 is the unmodified tower


WINDOWS = [{}, {"vision": {"window": 1, "shape": "grid"}, "text": {"window": 2}},
           {"vision": {"window": 2, "shape": "band", "cls": "local"}, "text": {"window": 0}}]


@pytest.mark.parametrize("window", WINDOWS, ids=["global", "grid1-text2", "band2-text0"])
@pytest.mark.parametrize("name", TOY + ["custom-blocks", "avg-pool", "avg-pool-ln-after", "siglip-text"])
def test_depth_zero_equals_the_unmodified_towers(name, window, cards):
    bb = load(name, cards, **window)
    snap = snapshot(bb)
    px = pixels(bb)
    visual = bb.model.visual
    with torch.no_grad():
        want = bb.model.encode_image(px)
        close(encode_image_deep(visual, px, None), want)
        close(encode_image_deep(visual, px, torch.zeros(0, 2, visual.class_embedding.shape[0])), want)
        tower = TextTower(bb.model, bb.tokenizer)
        tokens = bb.tokenize(["a photo of a cat.", "star", "a red square on grass"])
        want_t = bb.model.encode_text(tokens)
        close(encode_text_deep(tower, tower.embed(tokens), tokens, None, 1), want_t)
        close(encode_text_deep(tower, tower.embed(tokens), tokens, torch.zeros(0, 2, tower.width), 1), want_t)
        close(tower.forward(tower.embed(tokens), tokens), want_t)
    unchanged(bb, snap)


def test_depth_one_prompts_go_in_at_layer_zero_only():
    """Depth 1 puts the prompts after the patches before ln_pre and never replaces them; depth 2 replaces the
    last n tokens before block 1 (checked against an explicit run of the blocks)."""
    bb = load("toy-clip")
    v = bb.model.visual
    px = pixels(bb, n=2)
    g = torch.Generator().manual_seed(1)
    P = torch.randn(2, 3, v.class_embedding.shape[0], generator=g)
    with torch.no_grad():
        patches = v.conv1(px).flatten(2).transpose(1, 2)  # 2, 64, W
        x0 = torch.cat([v.class_embedding.expand(2, 1, -1), patches], 1) + v.positional_embedding
        T = x0.shape[1]
        x = v.ln_pre(torch.cat([x0, P[0].expand(2, -1, -1)], 1))
        blocks = v.transformer.resblocks
        shallow = x
        for blk in blocks:
            shallow = blk(shallow)
        deep = blocks[0](x)
        deep = torch.cat([deep[:, :T], P[1].expand(2, -1, -1)], 1)
        for blk in blocks[1:]:
            deep = blk(deep)
        close(encode_image_deep(v, px, P[:1]), v.ln_post(shallow[:, 0]) @ v.proj)
        close(encode_image_deep(v, px, P), v.ln_post(deep[:, 0]) @ v.proj)


def test_vision_prompts_are_global_tokens_under_a_local_window():
    """Tokens after the patch grid see every token and every token sees them; patches keep their window."""
    w = Window(1, "grid", prefix=1, cls="local", grid=(3, 3))
    a = w.allowed(1 + 9 + 2)
    assert a[10:].all() and a[:, 10:].all()
    assert torch.equal(a[:10, :10], w.allowed(10))  # without prompts: as before
    assert not a[1, 9]  # far corners of the grid still do not see each other
    band = Window(2, "band", prefix=1, cls="global", grid=(3, 3)).allowed(12)
    assert band[10:].all() and band[:, 10:].all()


def test_a_window_covering_everything_equals_global_attention_with_prompts():
    glob = load("toy-clip")
    wide = load("toy-clip", vision={"window": 100, "shape": "grid"}, text={"window": 100})
    a_glob = IVLP(IVLPConfig(init_std=0.5), glob, SHAPES, generator=torch.Generator().manual_seed(3))
    a_wide = IVLP(IVLPConfig(init_std=0.5), wide, SHAPES, generator=torch.Generator().manual_seed(3))
    px = pixels(glob)
    with torch.no_grad():
        close(a_wide(a_wide.encode_images(px)), a_glob(a_glob.encode_images(px)), 1e-5)
    narrow = load("toy-clip", vision={"window": 1, "shape": "grid"})
    a_narrow = IVLP(IVLPConfig(init_std=0.5), narrow, SHAPES, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert not torch.allclose(a_narrow.encode_images(px), a_glob.encode_images(px), atol=1e-3)


def test_flex_path_equals_mask_path_with_prompts():
    mask = load("toy-clip", vision={"window": 1, "shape": "grid"}, impl="mask")
    flex = load("toy-clip", vision={"window": 1, "shape": "grid"}, impl="flex")
    a_mask = IVLP(IVLPConfig(init_std=0.5), mask, SHAPES, generator=torch.Generator().manual_seed(4))
    a_flex = IVLP(IVLPConfig(init_std=0.5), flex, SHAPES, generator=torch.Generator().manual_seed(4))
    px = pixels(mask)
    with torch.no_grad():
        close(a_flex.encode_images(px), a_mask.encode_images(px), 1e-5)


# ---------------------------------------------------------------- zero-shot start, every geometry


@pytest.mark.parametrize("name", TOY + list(CARD_GEOMETRIES) + ["siglip-text", "custom-blocks"])
def test_text_only_ivlp_of_depth_one_starts_at_zero_shot(name, cards):
    """The MaPLe repository's language-only IVLP (4 tokens, depth 1, word init) is zero-shot CLIP with
    "a photo of a {}." at initialisation, in every geometry."""
    bb = load(name, cards)
    classnames = SHAPES if name.startswith("toy") else CLASSNAMES
    adapter = build_adapter(IVLPConfig(depth_vision=0, depth_text=1), bb, classnames, ["a photo of a {}."])
    assert not adapter.trains_image_tower
    feats = bb.encode_images(pixels(bb))
    want = bb.geometry.image_logits(feats, text_prototypes(bb, classnames, ["a photo of a {}."]))
    with torch.no_grad():
        close(adapter(feats), want, 1e-5)
    # A deeper text prompt of zeros is not the unmodified tower (the tokens are replaced), so only depth 1
    # starts at zero-shot; with no text prompts at all the text features are computed once.
    vision_only = IVLP(IVLPConfig(depth_text=0, depth_vision=1), bb, classnames)
    assert vision_only.text_prompt_layers() is None and vision_only.trains_image_tower
    with torch.no_grad():
        first = vision_only.text_features()
        assert vision_only.text_features() is first
        close(first, bb.encode_text([f"a photo of a {c}." for c in classnames]), 1e-5)


# ---------------------------------------------------------------- the text tower's paths


@pytest.mark.parametrize("method", ["ivlp", "maple"])
@pytest.mark.parametrize("name", ["toy-clip", "toy-siglip", "custom-blocks", "siglip-text"])
def test_every_text_path_gives_the_same_features_and_gradients(method, name, cards):
    bb = load(name, cards)
    classnames = SHAPES if name.startswith("toy") else CLASSNAMES
    cfg = IVLPConfig(init_std=0.5, ctx_init=None) if method == "ivlp" else MaPLeConfig(init_std=0.5)
    adapter = build_adapter(cfg, bb, classnames, [], generator=torch.Generator().manual_seed(5))
    modes = ["truncate", "faithful"] + (["shared"] if adapter.tower.can_share_prefix else [])
    assert ("shared" in modes) == (name in ("toy-clip", "toy-siglip"))  # standard causal blocks only
    if "shared" in modes:
        assert adapter.text_mode == "shared"  # the CPU default
    got = {}
    for mode in modes:
        adapter.set_text_mode(mode).zero_grad()
        t = adapter.text_features()
        (t ** 2).sum().backward()
        got[mode] = (t.detach(), adapter.text_prompts.grad.clone())
    for mode in modes[1:]:
        close(got[mode][0], got["truncate"][0], 1e-5)
        close(got[mode][1], got["truncate"][1], 1e-4)
    with pytest.raises(ValueError, match="text mode"):
        adapter.set_text_mode("fast")


def test_checkpointing_gives_the_same_loss_and_gradients():
    bb = load("toy-meru")
    px, y = pixels(bb, n=4), torch.tensor([0, 1, 2, 3])
    grads = []
    for ckpt in (False, True):
        a = MaPLe(MaPLeConfig(checkpointing=ckpt, init_std=0.5), bb, SHAPES, generator=torch.Generator().manual_seed(6))
        assert a.text_mode == ("truncate" if ckpt else "shared")
        loss = F.cross_entropy(a(a.encode_images(px)), y)
        loss.backward()
        grads.append([loss.detach()] + [p.grad for p in a.trainable_parameters()])
    for u, v in zip(*grads):
        close(u, v, 1e-5)


# ---------------------------------------------------------------- parameters, gradients, the backbone


@pytest.mark.parametrize("name", ["toy-clip", "toy-siglip"])
def test_only_prompts_get_gradients_and_the_backbone_is_untouched(name):
    bb = load(name)
    snap = snapshot(bb)
    px, y = pixels(bb, n=4), torch.tensor([0, 1, 2, 3])
    for cfg in (IVLPConfig(), MaPLeConfig(), PromptSRCConfig()):
        a = build_adapter(cfg, bb, SHAPES, ["a photo of a {}."]).train()
        opt = torch.optim.SGD(a.trainable_parameters(), lr=0.1)
        for _ in range(2):
            extra = {"frozen": bb.encode_images(px)} if a.wants_frozen_features else {}
            loss = a.training_loss(a.encode_images(px), y, **extra)["loss"]
            opt.zero_grad()
            loss.backward()
            opt.step()
        names = sorted(n for n, _ in a.named_parameters())
        assert names == sorted(a.state_dict()) == sorted(a.adapter_state_dict())
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in a.trainable_parameters()), cfg.name
        unchanged(bb, snap)


def test_shapes_depth_clipped_to_the_layers_and_init():
    bb = load("toy-clip")  # text: 3 layers, width 64; vision: 4 layers, width 64
    a = IVLP(IVLPConfig(), bb, SHAPES)
    assert a.text_prompts.shape == (3, 4, 64) and a.vision_prompts.shape == (4, 4, 64)
    words = bb.model.token_embedding(torch.tensor(a.tower.encode_words("a photo of a")))
    assert torch.equal(a.text_prompts[0].detach(), words)  # the words' embeddings
    assert float(a.text_prompts[1:].detach().std()) == pytest.approx(0.02, rel=0.2)
    a2 = IVLP(IVLPConfig(n_ctx_text=2), bb, SHAPES)  # "a photo" learnable, "of a" fixed tokens
    assert a2.text_prompts.shape == (3, 2, 64)
    assert a2.tokens[0, :6].tolist() == a.tokens[0, :6].tolist()
    m = MaPLe(MaPLeConfig(), bb, SHAPES)
    assert m.text_prompts.shape == (4, 2, 64)  # max(text layers, vision layers)
    assert m.depth_text == 3 and m.depth_vision == 4 and m.vision_prompt_layers().shape == (4, 2, 64)
    w, b = m.coupling_weight.detach(), m.coupling_bias.detach()
    assert all(torch.equal(w[i], w[1]) and torch.equal(b[i], b[1]) for i in range(2, 4))  # deeper: copies
    assert not torch.equal(w[0], w[1])  # layer 0: its own Linear
    assert float(w.abs().max()) <= 64 ** -0.5
    with torch.no_grad():
        close(m.vision_prompt_layers()[2], m.text_prompts[2] @ w[2].T + b[2])
    state = torch.random.get_rng_state()
    same = MaPLe(MaPLeConfig(), bb, SHAPES, generator=torch.Generator().manual_seed(0))
    assert torch.equal(same.coupling_weight, m.coupling_weight)  # no generator: seeded with 0
    assert torch.equal(torch.random.get_rng_state(), state)  # the init never touches torch's global RNG


@pytest.mark.parametrize("make, match", [
    (lambda: IVLPConfig(depth_text=0, depth_vision=0), "nothing to learn"),
    (lambda: IVLPConfig(depth_text=0, ctx_init=None), "adapter.ctx_init"),
    (lambda: IVLPConfig(n_ctx_vision=0), "adapter.n_ctx_vision"),
    (lambda: IVLPConfig(depth_text=-1), "adapter.depth_text"),
    (lambda: MaPLeConfig(depth=0), "adapter.depth"),
    (lambda: MaPLeConfig(n_ctx=0), "adapter.n_ctx"),
    (lambda: PromptSRCConfig(gpa_std=0), "adapter.gpa_std"),
    (lambda: PromptSRCConfig(teacher_templates="all"), "adapter.teacher_templates"),
])
def test_bad_config_names_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_more_context_than_init_words_names_both_keys():
    with pytest.raises(ValueError, match=r"adapter.n_ctx_text=5 is more than the 4 tokens of adapter.ctx_init"):
        IVLP(IVLPConfig(n_ctx_text=5), load("toy-clip"), SHAPES)


# ---------------------------------------------------------------- new class names


@pytest.mark.parametrize("make", [lambda: IVLPConfig(init_std=0.3), lambda: MaPLeConfig(init_std=0.3),
                                  lambda: PromptSRCConfig(init_std=0.3)])
def test_for_classnames_scores_other_names_with_the_same_prompts(make):
    bb = load("toy-meru")
    a = build_adapter(make(), bb, SHAPES[:4], ["a photo of a {}."], generator=torch.Generator().manual_seed(7))
    assert a.supports_new_classes and a.for_classnames(SHAPES[:4], []) is a
    other = a.for_classnames(list(reversed(SHAPES)), ["a photo of a {}."])
    assert not other.training and other.classnames == list(reversed(SHAPES))
    px = pixels(bb)
    with torch.no_grad():
        mine, theirs = a(a.encode_images(px)), other(other.encode_images(px))
    close(theirs[:, [7, 6, 5, 4]], mine, 1e-5)  # the same classes, in the other order


# ---------------------------------------------------------------- PromptSRC


def test_gaussian_weights_are_the_authors():
    import json
    from pathlib import Path

    ref = json.loads((Path(__file__).parent / "fixtures" / "deep_ref" / "promptsrc.json").read_text())
    close(torch.tensor(gaussian_weights(4, 3, 1), dtype=torch.float64),
          torch.tensor(ref["gpa_simulation"]["gauss_weights_per_epoch(1..N)"], dtype=torch.float64), 1e-12)
    for label, (n, mean, std) in {"base2novel": (20, 15, 1), "cross-dataset": (20, 6, 10),
                                  "few-shot ep50 (": (50, 30, 30), "few-shot ep50 alt": (50, 45, 5)}.items():
        key = next(k for k in ref["gauss_weights_for_configs"] if k.startswith(label))
        close(torch.tensor(gaussian_weights(n, mean, std), dtype=torch.float64),
              torch.tensor(ref["gauss_weights_for_configs"][key], dtype=torch.float64), 1e-12)
    with pytest.raises(ValueError, match="gpa_mean"):
        gaussian_weights(3, 1000, 0.1)


def test_teacher_templates(cards):
    t60 = imagenet60_templates()
    assert len(t60) == 60 == len(set(t60)) and t60[0] == "a photo of a {}." and t60[1] == "a bad photo of a {}."
    toy = load("toy-clip")  # a word vocabulary without most of the ImageNet templates' words
    assert PromptSRC(PromptSRCConfig(), toy, SHAPES, ["a {}.", "the {}."]).teacher_template_list == ["a {}.", "the {}."]
    with pytest.raises(ValueError, match="teacher_templates=dataset"):
        PromptSRC(PromptSRCConfig(teacher_templates="imagenet60"), toy, SHAPES)
    bpe = load("euclidean", cards)
    assert PromptSRC(PromptSRCConfig(), bpe, CLASSNAMES, ["a {}."]).teacher_template_list == t60
    assert PromptSRC(PromptSRCConfig(teacher_templates="dataset"), bpe, CLASSNAMES,
                     ["a {}."]).teacher_template_list == ["a {}."]


@pytest.mark.parametrize("name", TOY + list(CARD_GEOMETRIES))
def test_promptsrc_losses_in_every_geometry(name, cards):
    """At a text-only start the image term is 0 and the logits are the single template's; the text teacher is
    the embedding of the mean raw feature over the teacher templates; every term is finite and >= 0."""
    bb = load(name, cards)
    classnames = SHAPES if name.startswith("toy") else CLASSNAMES
    templates = ["a photo of a {}.", "a drawing of a {}."] if name.startswith("toy") else ["a photo of a {}.", "a {}."]
    a = PromptSRC(PromptSRCConfig(depth_vision=0, depth_text=1, teacher_templates="dataset"), bb, classnames, templates)
    feats = bb.encode_images(pixels(bb, n=4))
    y = torch.tensor([0, 1, 2, 0])
    terms = a.training_loss(feats, y)  # no image prompts: the features are the frozen ones
    g = bb.geometry
    raw = bb.encode_text([t.format(c) for c in classnames for t in templates]).reshape(len(classnames), 2, -1)
    close(a.teacher_text_points(), g.embed_text(raw.mean(1)), 1e-6)
    assert float(terms["l1_image"]) == 0.0
    assert all(torch.isfinite(v) and v >= 0 for v in terms.values())
    want = (terms["ce"] + 25 * terms["l1_text"] + 10 * terms["l1_image"] + terms["kl"])
    close(terms["loss"].detach(), want, 1e-6)
    terms["loss"].backward()
    assert a.text_prompts.grad.abs().sum() > 0


def test_gpa_loads_the_weighted_sum_after_the_last_epoch():
    bb = load("toy-clip")
    a = PromptSRC(PromptSRCConfig(gpa_mean=2, gpa_std=1), bb, SHAPES, ["a {}."])
    w = gaussian_weights(3, 2, 1)
    seen = []
    for e in range(3):
        with torch.no_grad():
            for p in a.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(e)))
        seen.append({k: v.clone() for k, v in a.adapter_state_dict().items()})
        a.on_epoch_end(e, 3)
        if e < 2:  # training goes on with the un-averaged prompts
            assert all(torch.equal(a.adapter_state_dict()[k], seen[-1][k]) for k in seen[-1])
    for k, v in a.adapter_state_dict().items():
        close(v, sum(w[e] * seen[e][k] for e in range(3)), 1e-6)
    off = PromptSRC(PromptSRCConfig(gpa=False), bb, SHAPES, ["a {}."])
    before = copy.deepcopy(off.adapter_state_dict())
    off.on_epoch_end(0, 1)
    assert all(torch.equal(before[k], v) for k, v in off.adapter_state_dict().items())


# ---------------------------------------------------------------- through the engine


def test_engine_gives_promptsrc_the_frozen_features_of_the_same_view(shapes, tmp_path):
    from fewclip.datasets import make_few_shot_split
    from fewclip.features.encode import FeatureCache
    from fewclip.training.engine import FreshImages, RunFeatures, TrainConfig

    bb = load("toy-clip")
    split = make_few_shot_split(shapes, 1, seed=2)
    a = build_adapter(PromptSRCConfig(), bb, shapes.classnames, shapes.prompts("single"))
    cache = FeatureCache()
    run = RunFeatures(a, shapes, split, TrainConfig(), seed=2, cache=cache)
    source = run.loop_source(3)
    assert isinstance(source, FreshImages)
    idx = torch.tensor([3, 0, 5])
    items = [split.train[int(i)] for i in idx]
    for epoch in (0, 2):
        view = run.view(epoch)
        px = torch.stack([view(shapes.load_image(it), it) for it in items])
        close(source.frozen(epoch, idx), bb.encode_images(px), 1e-6)
        with torch.no_grad():
            close(source.batch(epoch, idx), a.encode_images(px), 1e-6)  # the same pixels, prompted
    # the views are in the sweep's cache now: another run asking for view 0 encodes nothing
    again = RunFeatures(a, shapes, split, TrainConfig(), seed=2, cache=cache)
    assert torch.equal(again.frozen_train(run.view(0)).x, run.frozen_train(run.view(0)).x)
    assert again.cost.images_encoded_shared == len(split.train)


@pytest.mark.parametrize("method", ["ivlp", "maple", "promptsrc"])
def test_train_command_runs_each_method(method, tmp_path):
    from fewclip.runs.run import load_train_config, run_train

    select = "val" if method == "maple" else "last"  # validation through the prompted tower, every epoch
    cfg = load_train_config([f"adapter={method}", "data=toy-colours", "shots=1", "seed=1", "train.epochs=2",
                             "data.max_test=40", f"train.select={select}", f"out={tmp_path}"])
    assert cfg.train.batch_size == 4 and cfg.train.lr == {"maple": 0.0035}.get(method, 0.0025)
    m = run_train(cfg, tmp_path)
    assert m["epochs"] == 2 and len(m["loss_curve"]) == 2 and 0 <= m["top1"] <= 100
    assert ("selected_epoch" in m) == (select == "val")
    # every training step encodes its 4 images through the prompted tower (and PromptSRC's frozen view
    # of all 8 images per epoch comes from the cache); the 40 test images go through the prompted tower,
    # and with select=val the 8 validation images (1 per class) after every epoch
    per_epoch = 8 + (8 if method == "promptsrc" else 0) + (8 if select == "val" else 0)
    assert m["images_encoded"] == 2 * per_epoch + 40
