"""GDA on class names it was not trained on (base-to-novel's new classes): equal to the authors' base-to-new code
on the same cached features, zero-shot where alpha is 0 in every geometry, the trained rows for a domain-shift
target's classes, and the training points carried by the saved state.

Fixture: tests/fixtures/cache_ref/gda_b2n.* (numbers from running the authors' ``main_base2new.run``; the README
there says how). ``FeatureBackbone`` (tests/helpers/cache_parity.py) stands in for the backbone: the clip geometry at
scale 100 and a text tower that is a table of the fixture's class text features.
"""
import pytest
import torch

from fewclip.adapters.gda import GDA, GDAConfig, knn_gaussians
from fewclip.features.encode import Features, text_prototypes
from fewclip.training.engine import FitData, TrainConfig
from helpers.cache import EVERY, NAMES, TEMPLATES, two_view_fit_data
from helpers.cache_parity import FeatureBackbone, authors_config, fit_data, fixture, reldiff
from helpers.cards import backbone, cards, image_features  # noqa: F401  (cards: fixture)

NEW = ["triangle", "dog", "red circle", "blue square"]  # names GDA is not trained on


def fitted_on_base(t, m):
    """The fixture's base classes, GDA under preset=base2new in float64, fitted; and the new class names."""
    bb = FeatureBackbone(t["text"])
    base, new = bb.names[: m["base_classes"]], bb.names[m["base_classes"]:]
    assert (base + new, [*m["templates"]]) == (m["classnames"], ["{}"])
    gda = GDA(authors_config("gda", preset="base2new", views=m["views"]), bb, base, m["templates"]).double()
    info = gda.fit(fit_data([v.double() for v in t["train_views"]], t["train_labels"], t["val_x"].double(),
                            t["val_y"], shots=m["shots"]))
    return gda, info, new


def test_gda_scores_new_classes_as_the_authors_base_to_new_code():
    t, m = fixture("gda_b2n")
    ref = m["float64_shim"]
    gda, info, new = fitted_on_base(t, m)
    # the base classes: their covariance (the mean of the per-class ones), the search and its choice
    assert reldiff(gda.weight, t["W"]) < 1e-5 and reldiff(gda.bias, t["b"]) < 1e-5
    assert info["val_accs"] == pytest.approx(ref["val_accs"], abs=1e-6)
    assert info["alpha"] == ref["best_alpha"] == m["as_is_float32"]["best_alpha"]
    assert gda.train_points.shape == (m["views"] * len(t["train_labels"]), m["dim"])
    with torch.no_grad():
        for alpha, want in zip(m["alphas"], t["val_logits"]):
            gda.alpha.fill_(alpha)
            assert reldiff(gda(t["val_x"].double()), want) < 1e-5
        gda.alpha.fill_(info["alpha"])
        assert reldiff(gda(t["test_x"].double()), t["test_logits"]) < 1e-5
        # the new classes: each one's 64 neighbours, synthetic means, discriminant, logits at the base alpha
        other = gda.for_classnames(new, m["templates"])
        assert other is not gda and not other.training and float(other.alpha) == info["alpha"]
        g = gda.backbone.geometry
        near = g.similarity(gda.train_points, other.prototypes).T.topk(m["k"], dim=-1).indices
        assert [set(n.tolist()) for n in near] == [set(n.tolist()) for n in t["near"]]
        means, _ = knn_gaussians(gda.train_points, other.prototypes, t["near"], m["text_copies"])
        assert reldiff(means, t["mu_new"]) < 1e-5
        assert reldiff(other.weight, t["W_new"]) < 1e-5 and reldiff(other.bias, t["b_new"]) < 1e-5
        logits = other(t["test_new_x"].double())
        assert reldiff(logits, t["test_new_logits"]) < 1e-5
        acc = 100 * float((logits.argmax(-1) == t["test_new_y"]).double().mean())
    assert acc == pytest.approx(ref["new_acc"]) and m["as_is_float32"]["new_acc"] == ref["new_acc"]
    assert gda.for_classnames(gda.classnames, m["templates"]) is gda


@pytest.mark.parametrize("name", EVERY)
def test_gda_new_classes_are_zero_shot_at_alpha_0_in_every_geometry(name, cards):  # noqa: F811
    bb = backbone(name, cards)
    feats = image_features(bb, n=5)
    zs_new = bb.geometry.image_logits(feats, text_prototypes(bb, NEW, TEMPLATES))

    def check(logits):
        torch.testing.assert_close(logits, zs_new, rtol=1e-5, atol=1e-5)

    data = two_view_fit_data(bb)
    gda = GDA(GDAConfig(views=2, neighbours=5, search=False, init_alpha=1.0), bb, NAMES, TEMPLATES)
    with torch.no_grad():
        check(gda.for_classnames(NEW, TEMPLATES)(feats))  # before fit: nothing to synthesise from
        gda.fit(data)
        assert gda.train_points.shape[0] == 12 and float(gda.alpha) == 1.0
        other = gda.for_classnames(NEW, TEMPLATES)
        assert torch.isfinite(other.weight).all() and other.weight.abs().sum() > 0
        assert not torch.allclose(other(feats), zs_new, atol=1e-3)  # alpha 1: the synthesised discriminant counts
        gda.alpha.fill_(0.0)  # the blend weight 0: the new names' zero-shot logits
        check(gda.for_classnames(NEW, TEMPLATES)(feats))


def test_gda_neighbours_are_all_training_points_when_fewer_than_k():
    t, m = fixture("gda_b2n")
    gda, _, new = fitted_on_base(t, m)
    N = len(gda.train_points)
    everything = GDA(authors_config("gda", preset="base2new", views=m["views"], neighbours=N), gda.backbone,
                     gda.classnames, m["templates"]).double()
    everything.load_adapter_state_dict(gda.adapter_state_dict())
    beyond = GDA(authors_config("gda", preset="base2new", views=m["views"], neighbours=N + 50), gda.backbone,
                 gda.classnames, m["templates"]).double()
    beyond.load_adapter_state_dict(gda.adapter_state_dict())
    with torch.no_grad():
        a, b = everything.for_classnames(new, m["templates"]), beyond.for_classnames(new, m["templates"])
        torch.testing.assert_close(b.weight, a.weight, rtol=1e-12, atol=0)  # k is clamped to the N points
        assert not torch.allclose(a.weight, gda.for_classnames(new, m["templates"]).weight)  # k = 64 of 96 differs


def test_gda_domain_shift_targets_keep_the_trained_rows():
    # the authors' main_robustness.py maps the trained logits to the target's classes (test_logits @ label_mapping)
    t, m = fixture("gda_b2n")
    gda, info, _ = fitted_on_base(t, m)
    x = t["test_x"].double()
    names = gda.classnames
    with torch.no_grad():
        assert gda.for_target(names, m["templates"], list(range(len(names)))) is gda
        rows = [4, 0, 2]
        sub = gda.for_target([names[r] for r in rows], m["templates"], rows)
        # the same rows, to float64's rounding: a 3-column product may take another BLAS kernel than the 5-column
        # one (on one CPU they differed by 3e-14), so not bit for bit
        torch.testing.assert_close(sub(x), gda(x)[:, rows], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gda.for_target(["c7", "c9"], m["templates"])(x),
                                   gda.for_classnames(["c7", "c9"], m["templates"])(x), rtol=0, atol=0)


def test_gda_saved_state_keeps_the_training_points_for_new_names():
    t, m = fixture("gda_b2n")
    gda, _, new = fitted_on_base(t, m)
    sd = gda.adapter_state_dict()
    assert sd["train_points"].shape == gda.train_points.shape  # persistent: runs and exports carry it
    fresh = GDA(authors_config("gda", preset="base2new"), gda.backbone, gda.classnames, m["templates"]).double()
    assert fresh.train_points.shape[0] == 0
    fresh.load_adapter_state_dict(sd)
    with torch.no_grad():
        want = gda.for_classnames(new, m["templates"])(t["test_new_x"].double())
        torch.testing.assert_close(fresh.for_classnames(new, m["templates"])(t["test_new_x"].double()), want,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("field, value, message", [
    ("covariance", "pooled", "adapter.covariance must be one of shrinkage, class_mean"),
    ("neighbours", 1, "adapter.neighbours must be >= 2"),
    ("text_copies", -1, "adapter.text_copies must be >= 0"),
])
def test_gda_config_names_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        GDAConfig(**{field: value})


def test_gda_class_mean_covariance_needs_two_features_of_every_class():
    t, m = fixture("gda_b2n")
    bb = FeatureBackbone(t["text"])
    gda = GDA(GDAConfig(views=0, covariance="class_mean"), bb, bb.names[:6], ["{}"])
    x, y = t["train_views"][0][::4], torch.arange(6)  # one image of each class, no views
    with pytest.raises(ValueError, match="class_mean needs 2 training features of every class"):
        gda.fit(FitData(Features(x, y), [], Features(x[:0], y[:0]), TrainConfig(), 1, torch.Generator()))
