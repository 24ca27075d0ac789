"""TransCLIP (fewclip.training.transductive) against its authors' code, in every geometry, its caveat, and the run key.

Fixtures: tests/fixtures/cache_ref/transclip.* (numbers only; README there). The authors' ``TransCLIP_solver`` ran
on small synthetic unit-norm features (5 classes, D = 32, 60 test images, 4 shots, 20 validation images) in
three modes: zero-shot (pseudo-labels from the text prototypes at scale 100), on top of another method's
probabilities, and few-shot with the gamma search. fewclip's function is compared in float64 and float32 with
the arguments that reproduce the authors' choices where fewclip's defaults differ (``prior``, ``row_order``).
"""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from fewclip.backbones.geometry import GEOMETRIES, make_geometry
from fewclip.training.transductive import transclip

FIXTURES = Path(__file__).parent / "fixtures" / "cache_ref"
TOL = 1e-5  # probabilities after 11 x 5 z-updates, 10 mean and variance updates


def fixture():
    return (load_file(str(FIXTURES / "transclip.safetensors")),
            json.loads((FIXTURES / "transclip.json").read_text()))


def maxdiff(a, b):
    d = float((a.double() - b.double()).abs().max())
    print(f"\nparity max|diff| = {d:.2e}", end="")
    return d


CLIP = make_geometry("clip", logit_scale=100.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_zero_shot_mode_equals_the_authors(dtype):
    t, m = fixture()
    x = t["test_x"].to(dtype)
    zs = CLIP.image_logits(x, t["text"].to(dtype))  # the authors' 100 * x @ text
    r = transclip(x, zs, CLIP)
    assert maxdiff(r.probs, t["zs_z"]) < TOL
    assert 100 * float((r.probs.argmax(1) == t["test_y"]).double().mean()) == pytest.approx(m["zs_test_acc"])
    assert r.gamma == 0.0 and r.val_acc is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_on_top_of_another_methods_probabilities_equals_the_authors_with_their_prior(dtype):
    """The authors' on-top path (initial_predictions, no support set) overwrites its prior with z in place:
    ``prior="current"``. fewclip's default keeps the method's prediction as the prior, which differs."""
    t, m = fixture()
    x, probs = t["test_x"].to(dtype), torch.softmax(t["method_logits"].to(dtype), 1)
    r = transclip(x, None, CLIP, probs=probs, prior="current")
    assert maxdiff(r.probs, t["ontop_z"]) < TOL
    assert 100 * float((r.probs.argmax(1) == t["test_y"]).double().mean()) == pytest.approx(m["ontop_test_acc"])
    fixed = transclip(x, t["method_logits"].to(dtype), CLIP)  # logits are softmaxed: the same start
    assert float((fixed.probs - t["ontop_z"]).abs().max()) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_few_shot_mode_every_gamma_and_the_choice_equal_the_authors(dtype):
    t, m = fixture()
    x = t["test_x"].to(dtype)
    zs = CLIP.image_logits(x, t["text"].to(dtype))
    kw = dict(support=t["support_x"].to(dtype), support_labels=t["support_y"], val=t["val_x"].to(dtype),
              val_labels=t["val_y"])
    r = transclip(x, zs, CLIP, row_order="authors", **kw)
    assert len(r.per_gamma) == 4
    for mine, theirs in zip(r.per_gamma, t["fs_z_per_gamma"]):
        assert maxdiff(mine, theirs) < TOL
    assert maxdiff(r.per_gamma[-1], t["fs_z_last"]) < TOL  # what their solver returns
    assert r.gamma == m["gammas"][m["fs_best_gamma_index"]] and r.val_acc == m["fs_val_accs"][m["fs_best_gamma_index"]]
    acc = 100 * float((r.probs.argmax(1) == t["test_y"]).double().mean())
    assert acc == pytest.approx(m["fs_test_acc_at_best_val"])
    aligned = transclip(x, zs, CLIP, **kw)  # fewclip's default: graph rows in the assignments' order
    assert float((aligned.per_gamma[0] - t["fs_z_per_gamma"][0]).abs().max()) > 1e-4


def clustered(geometry_scale: float, seed: int, K: int = 10, d: int = 64, n: int = 40, spread: float = 0.3,
              noise: float = 0.4, text_noise: float = 0.6):
    """Unit-norm image features in K clusters (near one another) and noisy class directions: a weak zero-shot
    classifier whose test images still cluster by class. Raw features are scaled by ``geometry_scale``."""
    g = torch.Generator().manual_seed(seed)
    u = F.normalize(torch.randn(d, generator=g), dim=0)
    c = F.normalize(u + spread * F.normalize(torch.randn(K, d, generator=g), dim=-1), dim=-1)
    y = torch.arange(K).repeat_interleave(n)
    x = F.normalize(c[y] + noise * torch.randn(len(y), d, generator=g) / d ** 0.5, dim=-1)
    text = F.normalize(c + text_noise * torch.randn(K, d, generator=g) / d ** 0.5, dim=-1)
    return geometry_scale * x, geometry_scale * text, y


def acc(p, y):
    return 100.0 * float((p.argmax(1) == y).double().mean())


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_every_geometry_gives_probabilities_and_gains_on_clustered_test_features(name):
    g = make_geometry(name)
    x, text, y = clustered(1.0, 0)
    protos = g.prototype(g.embed_text(text)[:, None, :])
    logits = g.image_logits(x, protos)
    r = transclip(x, logits, g)
    assert torch.isfinite(r.probs).all() and torch.allclose(r.probs.sum(1), torch.ones(len(y), dtype=r.probs.dtype))
    assert acc(r.probs, y) > acc(logits, y)


def test_the_caveat_one_class_at_a_time_ends_below_the_method_it_started_from():
    """TransCLIP uses the whole test set: on all of it (10 classes) it gains over zero-shot on every seed; on
    the same images as a stream of batches of 8 in class order (one class per batch), each batch transduced on
    its own, it ends below zero-shot on every seed: each batch's 9 absent classes still get a mean, started
    from the batch's own images, and take images from the one present class."""
    for seed in range(4):
        x, text, y = clustered(1.0, seed)
        logits = CLIP.image_logits(x, text)
        whole = transclip(x, logits, CLIP).probs
        stream = torch.cat([transclip(x[i:i + 8], logits[i:i + 8], CLIP).probs for i in range(0, len(y), 8)])
        print(f"\nseed {seed}: zero-shot {acc(logits, y):.2f}, whole test set {acc(whole, y):.2f}, "
              f"batches of one class {acc(stream, y):.2f}", end="")
        assert acc(whole, y) > acc(logits, y) > acc(stream, y)


def test_fewer_test_images_than_neighbours_is_an_error_naming_it():
    x, text, y = clustered(1.0, 0)
    with pytest.raises(ValueError, match="more test images than neighbours"):
        transclip(x[:3], CLIP.image_logits(x[:3], text), CLIP)


def test_run_key_scores_the_test_set_again_and_the_report_shows_it_as_a_method(tmp_path, monkeypatch):
    from fewclip.backbones.backbone import BackboneConfig, load_backbone
    from fewclip.cli.main import main
    from fewclip.data.splits import test_items
    from fewclip.datasets import DataConfig, build_dataset
    from fewclip.features.encode import FeatureCache, text_prototypes
    from fewclip.report import build_report

    monkeypatch.setenv("FEWCLIP_CACHE", "off")
    out = tmp_path / "toy-clip" / "toy-colours" / "zeroshot"
    assert main(["zeroshot", "data=toy-colours", "data.max_test=80", "transductive=transclip", f"out={out}"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["transductive"] == "transclip" and m["transductive_time_s"] >= 0
    # the same number from the pure function on the run's test features and zero-shot logits
    bb = load_backbone(BackboneConfig(name="toy-clip", device="cpu"))
    ds = build_dataset(DataConfig(name="toy-colours"))
    x, y = FeatureCache().features(bb, ds, test_items(ds, 80)).features
    logits = bb.geometry.image_logits(x, text_prototypes(bb, ds.classnames, ds.prompts("single")))
    assert m["top1"] == pytest.approx(acc(logits, y), abs=1e-3)
    assert m["top1_transclip"] == pytest.approx(acc(transclip(x, logits, bb.geometry).probs, y), abs=1e-3)
    assert m["n_test"] == 80 and m["images_encoded"] == 80  # the second scoring encodes nothing
    report = build_report(tmp_path)
    rows = {r.method: r.top1 for r in report.runs}
    assert rows == {"zeroshot": m["top1"], "zeroshot+transclip": m["top1_transclip"]}
    assert "zeroshot+transclip" in report.markdown


def test_an_unknown_transductive_mode_is_a_one_line_error():
    from fewclip.cli.main import main

    assert main(["zeroshot", "transductive=transclipp"]) == 2
