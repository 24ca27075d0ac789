"""SkipTuning against its authors' code on the tiny CLIP of tests/helpers/tiny_clip.py (tests/fixtures/skiptuning_ref,
README there): image and text features, logits, the classes a step runs, the loss, one step's gradients of every
learnable tensor and the parameters after it. The largest difference is printed by
``python -m pytest -q tests/parity/test_skiptuning_parity.py -s``."""
import json

import pytest
import torch
from safetensors.torch import load_file

from fewclip.adapters.skiptuning import SkipTuning, SkipTuningConfig, run_ranks, skip_classes
from helpers.parity import FIXTURE_ROOT, Parity
from helpers.tiny_clip import tiny_images
from helpers.towers import one_step, tiny  # noqa: F401  (tiny is a fixture)

FIXTURES = FIXTURE_ROOT / "skiptuning_ref"
TOL = 1e-4  # the tolerance after a training step
PARITY = Parity(TOL)
check = PARITY.check


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    PARITY.print_worst()


def their_name(mine: str) -> str:
    """``blocks.visual__transformer__resblocks__1.attn.in_proj_weight`` -> their
    ``image_encoder.transformer.resblocks.1.attn.in_proj_weight`` (and the text tower's as ``text_encoder.``)."""
    path = mine.split(".", 1)[1].replace("__", ".")
    return "image_encoder." + path[len("visual."):] if path.startswith("visual.") else "text_encoder." + path


def test_skiptuning(tiny):  # noqa: F811
    bb, sha = tiny
    images = tiny_images(n=4, seed=1)
    ref = load_file(str(FIXTURES / "skiptuning.safetensors"))
    meta = json.loads((FIXTURES / "skiptuning.json").read_text())
    assert sha == meta["state_sha256"], "tests/helpers/tiny_clip.py no longer gives the fixtures' weights"
    cfg = SkipTuningConfig(start_layer=meta["start_layer"], top_ratio=meta["top_ratio"],
                           reserve_lambda=meta["lambda"], image_lr_scale=meta["new_lr"] / meta["lr"])
    a = SkipTuning(cfg, bb, meta["classnames"], ["a photo of a {}."])
    params = dict(a.named_parameters())
    assert sorted(their_name(n) for n in params) == meta["learnable"]
    labels = torch.tensor(meta["labels"])
    with torch.no_grad():
        feats = a.encode_images(images)
        check("image features", feats, ref["image_features"])
        check("text features", a.text_features(), ref["text_features"])
        check("logits", a(feats), ref["logits_eval"])
    # the rank positions their step kept (drawn once with torch's global RNG; fewclip draws them from the
    # adapter's generator), and the classes and labels that follow from them
    a.set_keep(torch.tensor(meta["reserve_mask"]))
    with torch.no_grad():
        scores = bb.geometry.image_logits(feats, a.class_protos)
    classes, target = skip_classes(scores, labels, run_ranks(a.keep, len(labels)))
    assert classes.tolist() == meta["classes_run"] and target.tolist() == meta["remapped_labels"]
    a.train()
    terms, grads = one_step(a, a.encode_images(images), labels, meta["lr"])
    assert float(terms["loss"].detach()) == pytest.approx(meta["loss_terms"]["ce"], abs=TOL)
    assert float(terms["loss"].detach()) == pytest.approx(meta["loss"], abs=TOL)
    for n, p in params.items():
        check(f"grad {n}", grads[n], ref[f"grad/{their_name(n)}"])
        check(f"after step {n}", p, ref[f"after/{their_name(n)}"])
    assert [g["lr_scale"] * meta["lr"] for g in a.param_groups()] == pytest.approx(meta["lr_per_group"])
