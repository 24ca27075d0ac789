"""World 2 (issue 31): deterministic generation, class counts, base/new splits of genuinely new concepts, and the
domain-shift family's targets."""
import subprocess
import sys

import numpy as np
import pytest

import fewclip.datasets.world2 as w2
from fewclip.backbones.tokenizer import WordTokenizer
from fewclip.data.base import DataConfig, build_dataset
from fewclip.data.protocols import base_new_classes, class_map
from fewclip.datasets.world2tasks import CROSS_DATASET_TARGETS, DOMAIN_SHIFT_TARGETS, FEWSHOT_TASKS, TASKS, World2Task
from helpers.scripts import SCRIPTS, load_script


def test_catalogue_has_hundreds_of_uniquely_named_concepts_in_every_family():
    cat = w2.catalogue()
    assert len(cat) == sum(f.n for f in w2.FAMILIES) >= 500
    assert len({c.name for c in cat}) == len(cat)
    assert [c.id for c in cat] == list(range(len(cat)))
    vocab = set(w2.vocabulary())
    assert all(c.name in vocab for c in cat)
    p = w2.pretrain_concept_p()
    assert p.min() > 0 and abs(p.sum() - 1) < 1e-9  # every concept, hence every class name, is pretrained on
    # fine-grained families sit closer to their prototype than the generic one
    spread = {f.name: np.std([c.params for c in w2.concepts_of(f.name)], axis=0)[:8].mean() for f in w2.FAMILIES}
    assert spread["plane"] < spread["car"] < spread["thing"]


def test_rendering_and_captions_are_pure_functions_of_seed_and_index():
    idx = np.arange(100, 164)
    a_img, a_cap = w2.render_pretrain(7, idx)
    b_img, b_cap = w2.render_pretrain(7, idx)
    assert a_img.dtype == np.uint8 and a_img.shape == (64, 32, 32, 3)
    assert np.array_equal(a_img, b_img) and a_cap == b_cap
    c_img, _ = w2.render_pretrain(8, idx)
    assert not np.array_equal(a_img, c_img)
    # a batch's images do not depend on the batch they are rendered in
    part, _ = w2.render_pretrain(7, idx[10:20])
    assert np.array_equal(part, a_img[10:20])
    tok = WordTokenizer(w2.vocabulary(), context_length=24)
    ids = tok(w2.captions(*w2.sample_pretrain(7, np.arange(500)), 7, np.arange(500)))
    assert not (ids == tok.unk_token_id).any()
    assert (ids[:, -1] == 0).all()  # every caption fits the context whole: nothing truncated


def test_captions_read_a_name_where_coop_puts_it_and_caption_families_their_own_way():
    idx = np.arange(20_000)
    concepts, styles = w2.sample_pretrain(11, idx)
    caps = w2.captions(concepts, styles, 11, idx)
    names = {c.name for c in w2.catalogue()}
    pos = [next((j for j, w in enumerate(c.replace(",", " ,").split()) if w in names), None) for c in caps]
    seen = {p for p in pos if p is not None}
    # CoOp's 16 context vectors put the name at word 16 (0-based, after the start token): pretraining reads names
    # there and around it, not only after a short opener
    assert {14, 15, 16, 17} <= seen and max(seen) <= w2.MAX_CAPTION_WORDS - 1
    # land photos are mostly captioned as the web captions satellite images, rarely "a photo of"
    land = [c for c, k, s in zip(caps, concepts, styles)
            if w2.catalogue()[k].family == "land" and w2.STYLES[s] == "photo"]
    own = sum(any(o in c for o in w2.FAMILIES[w2.FAMILY_INDEX["land"]].openers) for c in land)
    assert len(land) > 100 and own / len(land) > 0.8
    # a caption that does not name its concept often describes it: the words of describe() appear
    unnamed = [c for c, k in zip(caps, concepts) if w2.catalogue()[k].name not in c.split()]
    described = sum(any(w in c.split() for w in w2.SHAPE_WORDS + ("knob", "fin", "horizon", "roads"))
                    for c in unnamed)
    assert described / len(unnamed) > 0.3


def test_some_captions_name_a_concept_by_its_fixed_confuser():
    cat = w2.catalogue()
    conf = w2.confusers()
    # a fixed other concept of the same family, and not always the same one across a family
    assert all(cat[conf[c.id]].family == c.family and conf[c.id] != c.id for c in cat)
    assert len({conf[c.id] for c in w2.concepts_of("car")}) > 40
    idx = np.arange(20_000)
    concepts, styles = w2.sample_pretrain(11, idx)
    caps = w2.captions(concepts, styles, 11, idx)
    own = wrong = other = 0
    rates = []  # the family's confuse_p of each caption that names a concept
    for cap, k in zip(caps, concepts):
        words = cap.replace(",", " ,").split()
        if cat[k].name in words:
            own += 1
        elif cat[conf[k]].name in words:
            wrong += 1
        elif any(c.name in words for c in cat):
            other += 1
            continue
        else:
            continue
        rates.append(w2.FAMILIES[w2.FAMILY_INDEX[cat[k].family]].confuse_p)
    assert other == 0  # a caption names its concept, its confuser or nothing
    assert wrong / (own + wrong) == pytest.approx(np.mean(rates), abs=0.01) and wrong > 500


def test_half_the_world_is_mirrored():
    # the same concept, pose and colours drawn for two indices differ only by the mirror; over many images
    # the part (and the silhouette's phase) sits on each side about equally often
    c = np.full(400, w2.concepts_of("car")[0].id)
    imgs = w2.render(c, np.zeros(400, np.int64), 5, np.arange(400)).astype(float)
    lum = np.abs(imgs - imgs.mean(axis=(1, 2), keepdims=True)).mean(-1)
    left, right = lum[:, :, :16].sum((1, 2)), lum[:, :, 16:].sum((1, 2))
    mirror = w2.uniform(5, np.arange(400), 90) < 0.5
    assert 0.4 < mirror.mean() < 0.6
    # mirrored images weigh the other side: the mean left-right balance flips sign between the two groups
    bal = (left - right) / (left + right)
    assert np.sign(bal[mirror].mean()) != np.sign(bal[~mirror].mean())


def test_each_style_renders_differently():
    n = 8
    c = np.full(n, 5)
    imgs = [w2.render(c, np.full(n, s), 3, np.arange(n)) for s in range(len(w2.STYLES))]
    for i in range(len(imgs)):
        for j in range(i + 1, len(imgs)):
            assert np.abs(imgs[i].astype(int) - imgs[j].astype(int)).mean() > 10, (w2.STYLES[i], w2.STYLES[j])


def test_tasks_have_benchmark_like_class_counts():
    counts = {n: len(TASKS[n].concepts) for n in FEWSHOT_TASKS}
    assert len(FEWSHOT_TASKS) == 10 and counts["w2-net"] == 200
    assert min(counts.values()) >= 10 and np.mean(list(counts.values())) >= 50
    for name in FEWSHOT_TASKS:
        spec = TASKS[name]
        assert len(set(spec.concepts)) == len(spec.concepts)
        assert spec.templates[0] == "a photo of a {}."
    ds = build_dataset(DataConfig(name="w2-land"))
    assert isinstance(ds, World2Task) and sorted(ds.splits) == ["test", "train", "val"]
    assert len(ds.items("train")) == 10 * TASKS["w2-land"].per_class[0]
    img = ds.load_image(ds.items("test")[3])
    assert img.size == (32, 32)
    again = World2Task(TASKS["w2-land"]).load_image(ds.items("test")[3])
    assert np.array_equal(np.asarray(img), np.asarray(again))


@pytest.mark.parametrize("name", FEWSHOT_TASKS)
def test_base_and_new_classes_are_different_concepts(name):
    spec = TASKS[name]
    base, new = base_new_classes(len(spec.concepts))
    b = {spec.concepts[i] for i in base}
    n = {spec.concepts[i] for i in new}
    assert b and n and not (b & n)
    bnames = {spec.classnames[i] for i in base}
    # genuinely new: no new class name contains a base class name or one of its words (toy-objects' failure)
    for i in new:
        assert not any(w in bnames for w in spec.classnames[i].split())
    # base and new both mix frequent and rare concepts (the class order is a permutation)
    rank = {c.id: c.rank for c in w2.catalogue()}
    if len(spec.concepts) >= 40:
        assert np.mean([rank[c] for c in b]) / np.mean([rank[c] for c in n]) == pytest.approx(1, abs=0.35)


def test_domain_shift_targets_share_the_source_classes_and_shift_style():
    src = build_dataset(DataConfig(name="w2-net"))
    styles = set()
    for target in DOMAIN_SHIFT_TARGETS["w2-net"]:
        spec = TASKS[target]
        ds = build_dataset(DataConfig(name=target))
        assert list(ds.splits) == ["test"]
        m = class_map(src, ds)
        assert [src.classnames[i] for i in m] == ds.classnames
        assert spec.seed != TASKS["w2-net"].seed
        styles.add((spec.style, spec.difficulty))
    assert len(styles) == 4 and ("photo", 0.0) not in styles
    a, r = set(TASKS["w2-net-a"].concepts), set(TASKS["w2-net-r"].concepts)
    assert len(a) == len(r) == 100 and not (a & r)
    assert set(CROSS_DATASET_TARGETS["w2-net"]) == set(FEWSHOT_TASKS) - {"w2-net"}


def test_shipped_world2_cards_match_their_weights_and_recipe():
    from omegaconf import OmegaConf

    from fewclip.backbones.backbone import REFERENCE_DIR, sha256_file, shipped_cards
    from fewclip.config.compose import load_config
    from fewclip.datasets.world2pretrain import RECIPES, VOCAB_FILE, World2PretrainConfig, model_config, tokenizer

    cards = {n: p for n, p in shipped_cards().items() if n.startswith("w2-")}
    assert cards, "no w2-* card shipped"
    assert set(cards) <= set(RECIPES)
    for name, path in cards.items():
        card = OmegaConf.load(path)
        weights = REFERENCE_DIR / card.weights
        assert sha256_file(weights) == card.sha256
        assert weights.stat().st_size <= 10 * 1024 * 1024
        assert card.geometry.name == RECIPES[name]["geometry"] and card.tokenizer.file == VOCAB_FILE
        assert card.trained_with.command.startswith(f"python scripts/pretrain_world2.py recipe={name} ")
        assert WordTokenizer.load(REFERENCE_DIR / VOCAB_FILE).words == w2.vocabulary()
        # the script's defaults are the shipped recipe: `recipe=<name> threads=1` alone remakes the shipped weights
        made_with = load_config(card.trained_with.command.split()[2:], World2PretrainConfig)
        assert made_with == World2PretrainConfig(recipe=name, threads=made_with.threads)
        assert model_config(made_with, tokenizer(made_with.context_length).vocab_size) == OmegaConf.to_container(
            card.model_config)


def test_the_exported_projection_is_rescaled_without_changing_a_feature():
    import torch

    from fewclip.backbones.backbone import BackboneConfig, load_backbone
    from fewclip.datasets.world2pretrain import PROJECTION_SCALE, rescale_projection

    pixels = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    bb = load_backbone(BackboneConfig(name="w2-clip", device="cpu"))
    shipped = {k: v.clone() for k, v in bb.model.state_dict().items()}
    features, preproj = bb.encode_images(pixels), bb.encode_images_preproj(pixels)
    assert shipped["visual.proj"].std() < 0.01  # a sixteenth of the trained scale (about 128 ** -0.5 = 0.088)
    # the weights as trained (fp16, as save_reference has them before the export), rescaled again: the shipped ones
    trained = {k: v.half() for k, v in shipped.items()}
    trained["visual.proj"] = (shipped["visual.proj"] / PROJECTION_SCALE).half()
    for k in ("visual.ln_post.weight", "visual.ln_post.bias"):
        trained[k] = (shipped[k] * PROJECTION_SCALE).half()
    assert (trained["visual.proj"].float() * PROJECTION_SCALE == shipped["visual.proj"]).all()  # fp16 held it
    bb.model.load_state_dict(trained)
    assert torch.equal(bb.encode_images(pixels), features)  # the same function, to the last bit
    assert torch.equal(bb.encode_images_preproj(pixels) / PROJECTION_SCALE, preproj)
    assert rescale_projection(trained) and all(torch.equal(trained[k].float(), shipped[k]) for k in shipped)
    no_ln = {"visual.proj": torch.ones(2, 2, dtype=torch.float16)}  # EuCLIP's tower: nothing to absorb the scale
    assert not rescale_projection(no_ln) and no_ln["visual.proj"].dtype == torch.float16
    with pytest.raises(ValueError, match="power of two"):
        rescale_projection(dict(trained), scale=0.3)


@pytest.mark.parametrize("recipe, rescaled", [("w2-clip", True), ("w2-euclip", False)])
def test_a_saved_backbone_computes_what_was_trained_with_its_projection_rescaled(recipe, rescaled, tmp_path):
    import torch
    from safetensors.torch import load_file

    from fewclip.backbones.backbone import BackboneConfig, load_backbone
    from fewclip.config.compose import load_config
    from fewclip.datasets.world2pretrain import World2PretrainConfig, pretrain, save_reference

    cfg = load_config([f"recipe={recipe}", "steps=2", "batch_size=8", "warmup_steps=1", f"out={tmp_path}"],
                      World2PretrainConfig)
    model, geometry, tok, mcfg, history = pretrain(cfg)
    card = save_reference(cfg, model, geometry, tok, mcfg, history, tmp_path, 1.0, "cpu")
    proj = load_file(tmp_path / f"{recipe}.safetensors")["visual.proj"]
    assert proj.dtype == (torch.float32 if rescaled else torch.float16)
    assert ("the same function" if rescaled else "as trained") in card.read_text()
    pixels = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = model.half().float().eval().encode_image(pixels)  # the weights as stored, before any rescale
    assert torch.equal(load_backbone(BackboneConfig(name=str(card), device="cpu")).encode_images(pixels), trained)


@pytest.mark.parametrize("name, arg, words", [
    ("pretrain_world2.py", "recipe=w2-foo", "recipe must be one of"),
    ("pretrain_world2.py", "stepz=3", "Did you mean: 'steps'"),
    ("world2_pixel_ceiling.py", "tsk=w2-cars", "Did you mean: 'task'"),
    ("world2_check.py", "max_test=abc", "max_test"),
    ("world2_check.py", "probes=true", "Did you mean: 'probe'"),
])
def test_world2_scripts_answer_a_bad_argument_in_one_line(name, arg, words, capsys):
    assert load_script(name).main([arg]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_a_bad_argument_exits_2_from_the_command_line():
    p = subprocess.run([sys.executable, str(SCRIPTS / "world2_check.py"), "max_test=abc"], capture_output=True,
                       text=True, timeout=300, cwd=SCRIPTS.parent)
    assert p.returncode == 2 and "max_test" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("value", ["w2-euclip", "/somewhere/w2-clip.yaml"])
def test_the_check_takes_a_backbone_name_or_card_as_fewclip_commands_do(value):
    check = load_script("world2_check.py")
    assert check.load_config([f"backbone={value}"], check.CheckConfig).backbone.name == value


@pytest.mark.parametrize("args", [["recipe=w2-meru", "threads=1"], ["text_width=128", "text_layers=4", "lr=0.001"],
                                  ["data_seed=5", "steps=20", "out=/tmp/x", "workers=2"]])
def test_a_cards_command_remakes_its_config(args):
    from fewclip.config.compose import load_config
    from fewclip.datasets.world2pretrain import World2PretrainConfig, command

    cfg = load_config(args, World2PretrainConfig)
    line = command(cfg)
    assert line.startswith(f"python scripts/pretrain_world2.py recipe={cfg.recipe} seed=0 steps={cfg.steps} ")
    again = load_config(line.split()[2:], World2PretrainConfig)
    for name in ("out", "workers"):  # where the files go and how the batches are made: not the weights
        setattr(again, name, getattr(cfg, name))
    assert again == cfg
