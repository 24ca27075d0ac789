"""The shipped reference backbones: their files, their recorded zero-shot accuracy, and the recipe that makes them."""
import json
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from fewclip.backbones.backbone import REFERENCE_DIR, BackboneConfig, load_backbone, sha256_file, shipped_cards
from fewclip.data.protocols import plan_base2new
from fewclip.data.splits import TEST_SUBSET_SEED
from fewclip.datasets import DataConfig, build_dataset
from fewclip.datasets.toypretrain import RECIPES, TOY_MEAN, TOY_STD, PretrainConfig, batch_tensors, pretrain, save_reference, save_weights
from fewclip.datasets.toytasks import TASKS
from fewclip.runs.run import score_zeroshot

RECORD = REFERENCE_DIR / "zeroshot.json"
RERUN = "rerun `python scripts/record_reference_zeroshot.py` if the change is intended"
GEOMETRIES = {"toy-clip": "clip", "toy-euclip": "euclidean_sq", "toy-meru": "hyperbolic", "toy-siglip": "sigmoid"}


def toy_cards():
    """The shipped cards of the first toy world (world 2's w2-* cards are checked by tests/test_world2.py)."""
    return {name: path for name, path in shipped_cards().items() if name.startswith("toy-")}


@pytest.fixture(scope="module")
def record():
    return json.loads(RECORD.read_text())


@pytest.fixture(scope="module")
def toy_datasets(record):
    max_test = record["subset"]["max_test"]
    return {task: build_dataset(DataConfig(name=task, max_test=max_test)) for task in TASKS}


# ---------------------------------------------------------------- the shipped files


def test_every_recipe_is_shipped_in_its_geometry():
    cards = toy_cards()
    assert set(cards) == set(RECIPES) == set(GEOMETRIES)
    for name, path in cards.items():
        card = OmegaConf.load(path)
        assert card.geometry.name == GEOMETRIES[name] == RECIPES[name]["geometry"]
        assert card.final_ln == RECIPES[name]["final_ln"]


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_shipped_weights_match_their_card_and_are_small(name):
    card = OmegaConf.load(shipped_cards()[name])
    weights = REFERENCE_DIR / card.weights
    assert sha256_file(weights) == card.sha256
    assert weights.stat().st_size <= 2 * 1024 * 1024
    assert (REFERENCE_DIR / card.tokenizer.file).is_file()


# ---------------------------------------------------------------- recorded zero-shot accuracy


def test_record_covers_every_card_and_task(record):
    assert record["format"] == "fewclip.reference-zeroshot/1"
    assert set(record["top1"]) == set(toy_cards()), RERUN
    for card, row in record["top1"].items():
        assert set(row) == set(TASKS), f"{card}: recorded tasks differ from the toy tasks; {RERUN}"
    assert record["subset"]["max_test"] == 200 and record["subset"]["seed"] == TEST_SUBSET_SEED
    assert "scripts/record_reference_zeroshot.py" in record["command"]
    b2n = record["base2new"]
    assert b2n["task"] in TASKS and set(b2n["top1"]) == set(toy_cards()), RERUN
    assert all(set(row) == {"base", "new"} for row in b2n["top1"].values())


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_zeroshot_accuracy_is_as_recorded(name, record, toy_datasets):
    subset = record["subset"]
    bb = load_backbone(BackboneConfig(name=name, device="cpu"))
    assert bb.geometry.name == GEOMETRIES[name]
    assert bb.weights_sha256 == record["weights_sha256"][name], f"{name}: weights changed since recording; {RERUN}"
    got, want = {}, {}
    for task, ds in toy_datasets.items():
        m = score_zeroshot(bb, ds, templates=subset["templates"], max_test=subset["max_test"])
        assert m["n_test"] == subset["n_test"][task]
        got[task], want[task] = round(m["top1"], 2), record["top1"][name][task]
    assert got == want, f"{name}: zero-shot top-1 moved; {RERUN}"
    # every reference model does better than chance on the task its captions name most
    assert got["toy-shapes"] > 3 * 100 / len(TASKS["toy-shapes"].classnames)

    # the base and new halves of the base-to-novel task, each among its own classes
    b2n = record["base2new"]
    halves = {e.name: e.dataset for e in plan_base2new(toy_datasets[b2n["task"]]).evals}
    got = {}
    for half, ds in halves.items():
        m = score_zeroshot(bb, ds, templates=subset["templates"], max_test=subset["max_test"])
        assert m["n_test"] == b2n["n_test"][half]
        got[half] = round(m["top1"], 2)
    assert got == b2n["top1"][name], f"{name}: base-to-novel zero-shot moved; {RERUN}"
    # imperfect on both halves: far above chance (32 classes each), far below 100%
    assert all(10 * 100 / len(ds.classnames) < got[h] < 85 for h, ds in halves.items()), got


# ---------------------------------------------------------------- the pretraining recipe


def tiny_pretrain(recipe: str, steps: int = 20, seed: int = 0) -> PretrainConfig:
    return PretrainConfig(recipe=recipe, seed=seed, steps=steps, batch_size=32, embed_dim=32, width=32,
                          vision_layers=1, text_layers=1, head_width=16, patch_size=8, warmup_steps=2,
                          device="cpu", workers=0, log_every=1)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_short_pretraining_lowers_the_loss_and_saves_a_loadable_card(recipe, tmp_path):
    cfg = tiny_pretrain(recipe)
    model, geometry, tokenizer, mcfg, history = pretrain(cfg)
    losses = [h["loss"] for h in history]
    assert [h["step"] for h in history] == list(range(cfg.steps))  # log_every=1: every step
    assert all(math.isfinite(v) for v in losses)
    # In 20 steps the loss mostly falls from a badly scaled start towards
    # chance level; learning proper is what the recorded accuracies above pin.
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses

    card_path = save_reference(cfg, model, geometry, tokenizer, mcfg, history, tmp_path, 1.0, "test CPU")
    assert card_path == tmp_path / f"{recipe}.yaml"
    bb = load_backbone(BackboneConfig(name=str(card_path), device="cpu"))
    assert bb.geometry.name == RECIPES[recipe]["geometry"]
    trained = geometry.params()
    assert set(bb.geometry.params()) == set(trained)
    assert bb.geometry.params() == pytest.approx(trained, rel=1e-6)
    assert bb.mean == TOY_MEAN and bb.std == TOY_STD
    # open_clip's own logit scale (and bias) were set to the learned values (stored in fp16)
    assert bb.model.logit_scale.exp().item() == pytest.approx(trained["logit_scale"], rel=1e-2)
    if recipe == "toy-siglip":
        assert bb.model.logit_bias.item() == pytest.approx(trained["logit_bias"], rel=1e-2)
    final_ln = RECIPES[recipe]["final_ln"]
    for module in (bb.model.visual.ln_post, bb.model.ln_final):
        assert isinstance(module, nn.Identity) is (not final_ln)
        assert isinstance(module, nn.LayerNorm) is final_ln

    # the loaded model computes what the trained one did, up to its fp16 weights file
    pixels, tokens = batch_tensors(10_000, 8, cfg.data_seed, tokenizer)
    with torch.no_grad():
        want_img, want_txt = model.encode_image(pixels), model.encode_text(tokens)
    texts = [tokenizer.decode(t.tolist()) for t in tokens]
    assert torch.equal(bb.tokenize(texts), tokens)  # the card's vocabulary file is the training tokenizer
    got_img, got_txt = bb.encode_images(pixels), bb.encode_text(texts)
    torch.testing.assert_close(got_img, want_img, rtol=0, atol=2e-2 * want_img.abs().max().item())
    torch.testing.assert_close(got_txt, want_txt, rtol=0, atol=2e-2 * want_txt.abs().max().item())


def test_pretraining_is_a_function_of_its_config():
    a = pretrain(tiny_pretrain("toy-meru", steps=3))[-1]
    b = pretrain(tiny_pretrain("toy-meru", steps=3))[-1]
    c = pretrain(tiny_pretrain("toy-meru", steps=3, seed=1))[-1]
    assert [h["loss"] for h in a] == [h["loss"] for h in b]
    assert [h["loss"] for h in a] != [h["loss"] for h in c]


def test_the_same_weights_are_saved_as_the_same_bytes(tmp_path):
    # safetensors orders its header's metadata from a hash map, differently from call to call; save_weights
    # sorts it, so a reference file's SHA-256 (its card's) is a function of the weights alone
    gen = torch.Generator().manual_seed(0)
    sd = {f"layer{i}.weight": torch.randn(3, 4, generator=gen).half() for i in range(5)}
    files = [save_weights(tmp_path / f"w{i}.safetensors", sd, "w2-test") for i in range(8)]
    assert len({f.read_bytes() for f in files}) == 1
    raw = files[0].read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0 and list(json.loads(raw[8:8 + n])["__metadata__"]) == ["fewclip", "format"]
    from safetensors import safe_open
    with safe_open(str(files[0]), "pt") as f:
        assert f.metadata() == {"fewclip": "w2-test", "format": "pt"}
        assert all(torch.equal(f.get_tensor(k), v) for k, v in sd.items())


def test_pretrain_config_rejects_bad_values():
    from fewclip.datasets.toypretrain import PretrainConfig

    with pytest.raises(ValueError, match="amp"):
        PretrainConfig(amp="fp8")
    with pytest.raises(ValueError, match="recipe"):
        PretrainConfig(recipe="toy-nope")
