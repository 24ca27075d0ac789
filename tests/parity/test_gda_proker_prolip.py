"""GDA, ProKeR and ProLIP: equal to their authors' code on the same cached features, zero-shot at their start in
every geometry, ProKeR's kernel-free solve equal to the direct one, ProLIP's pre-projection features.

Fixtures: tests/fixtures/cache_ref/{gda,proker,prolip}.* (numbers from running the authors' functions; the README
there says how). ``FeatureBackbone`` (tests/parity/test_cache_parity.py) stands in for the backbone: the clip geometry
at scale 100 and a text tower that is a table of the fixture's class text features.
"""

import pytest
import torch

from fewclip.adapters._cache import self_similarity
from fewclip.adapters.gda import GDA, GDAConfig
from fewclip.adapters.proker import ProKeR, ProKeRConfig, grid, kernel, solve_cg, solve_direct, tile_dtype
from fewclip.adapters.prolip import ProLIP, ProLIPConfig
from fewclip.backbones.backbone import BackboneError
from fewclip.backbones.geometry import make_geometry
from fewclip.features.encode import FeatureCache, Features, text_prototypes
from fewclip.features.store import FeatureStore
from fewclip.training.engine import FitData, TrainConfig
from fewclip.utils.errors import NonFiniteError
from helpers.cache import EVERY, NAMES, PARAMS, TEMPLATES, TableBackbone, two_view_fit_data, zero_shot
from helpers.cache_parity import FeatureBackbone, authors_config, fit_data, reldiff
from helpers.cards import backbone, cards, image_features  # noqa: F401  (cards: fixture)
from helpers.parity import FIXTURE_ROOT, fixture_loader

FIXTURES = FIXTURE_ROOT / "cache_ref"
f64 = torch.float64


fixture = fixture_loader(FIXTURES)


# ---------------------------------------------------------------- parity with the authors' code


def test_gda_equals_the_authors():
    t, m = fixture("gda")
    bb = FeatureBackbone(t["text"])
    gda = GDA(authors_config("gda"), bb, bb.names, ["{}"]).double()
    views = list(t["train_views"])
    info = gda.fit(fit_data(views, t["train_labels"], t["val_x"], t["val_y"]))
    assert reldiff(gda.weight, t["W"]) < 1e-5 and reldiff(gda.bias, t["b"]) < 1e-5
    assert info["val_accs"] == pytest.approx(m["float64_shim"]["val_accs"], abs=1e-6)
    assert info["alpha"] == m["float64_shim"]["best_alpha"] == m["as_is_float32"]["best_alpha"]
    with torch.no_grad():
        for alpha, want in zip(m["alphas"], t["val_logits"]):
            gda.alpha.fill_(alpha)
            assert reldiff(gda(t["val_x"]), want) < 1e-5
        gda.alpha.fill_(info["alpha"])
        assert reldiff(gda(t["test_x"]), t["test_logits"]) < 1e-5
        gda.alpha.fill_(0.0)
        assert torch.allclose(gda(t["test_x"]), 100 * torch.nn.functional.normalize(t["test_x"], dim=-1) @ t["text"].T)


def test_proker_equals_the_authors():
    t, m = fixture("proker")
    bb = FeatureBackbone(t["text"])
    pk = ProKeR(authors_config("proker"), bb, bb.names, ["{}"]).double()
    info = pk.fit(fit_data(list(t["train_views"]), t["train_labels"], t["val_x"], t["val_y"]))
    ref = m["float64_shim"]
    assert (info["beta"], info["lmbda"]) == (ref["best_beta"], ref["best_lmbda"])
    assert (info["beta"], info["lmbda"]) == (m["as_is_float32"]["best_beta"], m["as_is_float32"]["best_lmbda"])
    assert info["val_accs"] == pytest.approx(ref["val_accs"], abs=1e-6)  # all 200 grid points
    assert info["solver"] == "direct"
    assert reldiff(pk.coef, t["alpha_i"]) < 1e-5  # the closed-form solution
    with torch.no_grad():
        assert reldiff(pk(t["test_x"]), 100 * t["test_logits"]) < 1e-5  # fewclip's logits: scale x theirs
    assert grid(m["grid"]["beta"])[:2] == [0.5, pytest.approx(0.5 + 2.5 / 19, abs=1e-7)]


def test_prolip_equals_the_authors():
    t, m = fixture("prolip")

    class ProjectionBackbone(FeatureBackbone):
        def image_projection(self):
            return t["P0"]

    bb = ProjectionBackbone(t["text"])
    cfg = authors_config("prolip", views=m["aug_views"], epochs=m["train_epoch"])
    pl = ProLIP(cfg, bb, bb.names, ["{}"])
    info = pl.fit(fit_data(list(t["train_views_pre"]), t["train_labels"], t["val_pre"], t["val_y"]))
    assert (info["lr"], info["lambda"]) == (m["lr_v"], m["lambda_v"])
    search = m["search"]  # [lr, lambda, validation accuracy] of each pair, in their order
    assert [(lr, lm) for lr, lm, _ in search] == [(a, b) for a in cfg.lrs for b in cfg.lambdas]
    assert info["val_accs"] == pytest.approx([acc for _, _, acc in search], abs=1e-6)
    assert reldiff(pl.projection, t["proj"]) < 1e-4  # 30 Adam steps
    with torch.no_grad():
        theirs = 100 * torch.nn.functional.normalize(t["test_pre"] @ t["proj"], dim=-1) @ t["text"].T
        assert reldiff(pl(t["test_pre"]), theirs) < 1e-4
        acc = 100 * float((pl(t["test_pre"]).argmax(-1) == t["test_y"]).double().mean())
    assert acc == pytest.approx(m["test_acc"])


# ---------------------------------------------------------------- ProKeR's solve without the kernel


def test_proker_conjugate_gradients_equal_the_direct_solve():
    t, _ = fixture("proker")
    g = make_geometry("clip", logit_scale=100.0)
    keys = g.embed_image(t["train_views"].reshape(-1, t["train_views"].shape[-1]))  # [200, 64]
    R = torch.randn(len(keys), 5, generator=torch.Generator().manual_seed(0), dtype=f64)
    for beta, lmbda in ((0.5, 0.001), (3.0, 1.0), (1.7, 0.1)):
        direct = solve_direct(kernel(g, keys, keys, beta, 1.0), R, lmbda)
        cg, iterations = solve_cg(g, keys, R, beta, lmbda, 1.0, block=37, tol=1e-12)  # float64 tiles, no preconditioner
        assert 0 < iterations < len(keys)
        assert reldiff(cg, direct) < 1e-8
        stats = {}  # a Nystrom preconditioner of rank 40 (of 200 points): fewer iterations, the same A
        pcg, fewer = solve_cg(g, keys, R, beta, lmbda, 1.0, block=37, tol=1e-12, rank=40, stats=stats)
        assert fewer < iterations and stats["rank"] == 40 and stats["products"] == fewer
        assert reldiff(pcg, direct) < 1e-8
        warm, _ = solve_cg(g, keys, R, beta, lmbda, 1.0, block=37, tol=1e-12, x0=direct * 1.5)  # any start
        assert reldiff(warm, direct) < 1e-8
        # float32 tiles summed in float64 (the default): A to the closed forms' 1e-5, stopping at 1e-6
        f32, _ = solve_cg(g, keys, R, beta, lmbda, 1.0, block=37, tol=1e-6, dtype=torch.float32, rank=40)
        assert reldiff(f32, direct) < 1e-5
        Kq = kernel(g, keys[:50], keys, beta, 1.0)  # what predictions use: k(x, S) A
        assert reldiff(Kq @ f32, Kq @ direct) < 1e-5


@pytest.mark.parametrize("name, dtype", [("clip", torch.float32), ("hyperbolic", torch.float32),
                                         ("elliptic", torch.float64)])
def test_proker_cg_tiles_in_float32_only_where_the_kernel_is_exact_in_it(name, dtype):
    g = make_geometry(name, **PARAMS.get(name, {}))
    gen = torch.Generator().manual_seed(0)
    keys = g.embed_image(torch.randn(120, 16, generator=gen, dtype=f64) + 2 * torch.randn(4, 16, generator=gen,
                                                                                      dtype=f64).repeat(30, 1))
    s_max = self_similarity(g, 16)
    assert tile_dtype(g, keys, 1.7, s_max) == dtype  # the elliptic geometry's arccos near 1 loses ~1e-3 in float32
    R = torch.randn(120, 4, generator=gen, dtype=f64)
    direct = solve_direct(kernel(g, keys, keys, 1.7, s_max), R, 0.1)
    cg, _ = solve_cg(g, keys, R, 1.7, 0.1, s_max, block=50, tol=1e-6, dtype=dtype, rank=30)
    assert reldiff(cg, direct) < 1e-5


def test_proker_solver_choice_gives_the_same_fit():
    t, _ = fixture("proker")
    bb = FeatureBackbone(t["text"])
    data = fit_data(list(t["train_views"]), t["train_labels"], t["val_x"], t["val_y"])
    a = ProKeR(ProKeRConfig(solver="direct", beta_grid=[0.5, 3, 3], lmbda_grid=[0.01, 1, 3]), bb, bb.names, ["{}"])
    b = ProKeR(ProKeRConfig(solver="auto", direct_max=50, cg_block=64, cg_dtype="float64", cg_tol=1e-8, cg_rank=20,
                            beta_grid=[0.5, 3, 3], lmbda_grid=[0.01, 1, 3]), bb, bb.names, ["{}"])
    c = ProKeR(ProKeRConfig(solver="cg", cg_block=64, beta_grid=[0.5, 3, 3], lmbda_grid=[0.01, 1, 3]),
               bb, bb.names, ["{}"])  # the defaults: float32 tiles (the cosine), rank-1000 Nystrom, tol 1e-6
    ia, ib, ic = a.double().fit(data), b.double().fit(data), c.double().fit(data)
    assert ib["solver"] == ic["solver"] == "cg" and ia["solver"] == "direct"
    assert (ia["beta"], ia["lmbda"]) == (ib["beta"], ib["lmbda"]) == (ic["beta"], ic["lmbda"])
    assert ia["val_accs"] == ib["val_accs"] == ic["val_accs"]
    assert reldiff(b.coef, a.coef) < 1e-6  # cg to a relative residual of 1e-8, warm-started along the lambdas
    assert reldiff(c.coef, a.coef) < 1e-5
    q = t["val_x"].double()
    with torch.no_grad():
        assert reldiff(c(q), a(q)) < 1e-5 and reldiff(b(q), a(q)) < 1e-8


# ---------------------------------------------------------------- zero-shot at the start, in every geometry


@pytest.mark.parametrize("name", EVERY)
def test_gda_proker_prolip_start_at_zero_shot_in_every_geometry(name, cards):  # noqa: F811
    bb = backbone(name, cards)
    feats = image_features(bb, n=5)
    want = zero_shot(bb, feats)

    def check(logits):
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)

    data = two_view_fit_data(bb)
    gda = GDA(GDAConfig(views=2), bb, NAMES, TEMPLATES)
    with torch.no_grad():
        check(gda(feats))  # before fit
        gda.fit(data)
        assert gda.weight.abs().sum() > 0 and not torch.allclose(gda(feats), want, atol=1e-3)
        gda.alpha.fill_(0.0)  # the blend weight 0
        check(gda(feats))
    pk = ProKeR(ProKeRConfig(views=2, search=False, init_lmbda=1e-12), bb, NAMES, TEMPLATES)
    with torch.no_grad():
        check(pk(feats))  # before fit
        pk.fit(data)  # lambda -> 0: the regression vanishes
        assert pk.keys.shape[0] == 12
        check(pk(feats))
    pl = ProLIP(ProLIPConfig(views=1, epochs=0, search=False), bb, NAMES, TEMPLATES)
    px = torch.randn(5, 3, bb.image_size, bb.image_size, generator=torch.Generator().manual_seed(0))
    z = bb.tower_variant("preproj").encode_images(px)  # [5, W]
    with torch.no_grad():
        torch.testing.assert_close(z @ bb.image_projection(), feats, rtol=1e-5, atol=1e-5)
        check(pl(z))  # at the pretrained projection
        check(pl(pl.encode_images(px)))  # what an export does: its own tower, then forward


@pytest.mark.parametrize("name", ["toy-clip", "toy-meru"])
def test_prolip_scores_other_class_names_through_its_trained_projection(name, cards):  # noqa: F811
    # base-to-novel's new classes: the trained projection, the new names' zero-shot prototypes (the authors'
    # ProLIP_eval); an untrained ProLIP on new names is zero-shot on them
    bb = backbone(name, cards)
    gen = torch.Generator().manual_seed(3)
    px = torch.randn(6, 3, bb.image_size, bb.image_size, generator=gen)
    pl = ProLIP(ProLIPConfig(views=1, epochs=20, search=False, lr=1e-2, lmbda=0.0), bb, NAMES, TEMPLATES)
    z = pl.encode_images(px)
    y = torch.arange(6) % len(NAMES)
    pl.fit(FitData(Features(z, y), [Features(z, y)], Features(z[:0], y[:0]), TrainConfig(), 2, torch.Generator()))
    assert not torch.allclose(pl.projection, pl.initial)
    new = ["triangle", "dog", "red circle", "blue square"]
    other = pl.for_classnames(new, TEMPLATES)
    assert other is not pl and pl.for_classnames(NAMES, TEMPLATES) is pl and not other.training
    with torch.no_grad():
        want = bb.geometry.image_logits(z @ pl.projection, text_prototypes(bb, new, TEMPLATES))
        torch.testing.assert_close(other(z), want, rtol=1e-5, atol=1e-5)
        zs = bb.geometry.image_logits(z @ pl.initial, text_prototypes(bb, new, TEMPLATES))
        assert not torch.allclose(other(z), zs, atol=1e-3)  # the training carried over to the new names
        fresh = ProLIP(ProLIPConfig(views=1, search=False), bb, NAMES, TEMPLATES).for_classnames(new, TEMPLATES)
        torch.testing.assert_close(fresh(z), zs, rtol=1e-5, atol=1e-5)


def test_the_preprojection_variant_is_keyed_apart_and_refused_without_a_projection(cards):  # noqa: F811
    bb = backbone("toy-clip")
    pre = bb.tower_variant("preproj")
    assert pre is bb.tower_variant("preproj") and pre.variant != bb.variant and pre.name == bb.name
    assert bb.model.visual.proj is not None  # set back after encoding
    with pytest.raises(BackboneError, match="unknown tower variant"):
        bb.tower_variant("tokens")


# ---------------------------------------------------------------- geometry of each method


@pytest.mark.parametrize("geometry", ["clip", "euclidean_sq", "hyperbolic"])
def test_proker_logits_are_the_geometrys_logits_of_the_regression(geometry):
    bb = TableBackbone(geometry)
    g = bb.geometry
    gen = torch.Generator().manual_seed(5)
    x, y = 2 * torch.randn(9, 8, generator=gen), torch.arange(9) % 3
    pk = ProKeR(ProKeRConfig(views=1, search=False, init_beta=0.7, init_lmbda=0.3), bb, NAMES, TEMPLATES)
    pk.fit(FitData(Features(x, y), [Features(x, y)], Features(x, y), TrainConfig(), 3, torch.Generator()))
    S = g.embed_image(x).double()
    protos = pk.prototypes.double()
    s_max = pk.s_max
    K = torch.exp(0.7 * (g.similarity(S, S) - s_max))
    Y = torch.nn.functional.one_hot(y, 3)
    A = torch.linalg.solve(K / 0.3 + torch.eye(9, dtype=f64), Y - g.similarity(S, protos))
    q = 2 * torch.randn(4, 8, generator=gen)
    Q = g.embed_image(q).double()
    f = g.similarity(Q, protos) + torch.exp(0.7 * (g.similarity(Q, S) - s_max)) @ A
    with torch.no_grad():
        torch.testing.assert_close(pk(q).double(), g.logits(Q, protos) - g.scale * g.similarity(Q, protos) +
                                   g.scale * f, rtol=1e-4, atol=1e-4)


def test_prolip_search_passes_over_a_diverging_learning_rate():
    t, m = fixture("prolip")

    class ProjectionBackbone(FeatureBackbone):
        def image_projection(self):
            return t["P0"]

    bb = ProjectionBackbone(t["text"])
    data = fit_data(list(t["train_views_pre"]), t["train_labels"], t["val_pre"], t["val_y"])
    pl = ProLIP(ProLIPConfig(views=6, epochs=30, lrs=[1e30, 1e-2], lambdas=[0.01]), bb, bb.names, ["{}"])
    info = pl.fit(data)
    assert info["lr"] == 1e-2 and info["val_accs"][0] == -1.0 and torch.isfinite(pl.projection).all()
    with pytest.raises(NonFiniteError, match="Lower adapter.lr"):
        ProLIP(ProLIPConfig(views=6, epochs=30, search=False, lr=1e30), bb, bb.names, ["{}"]).fit(data)


def test_the_store_keeps_preprojection_features_once_for_prolip_and_the_others(shapes, tmp_path):
    """(More in tests/test_store_preproj.py: every reference geometry, a run sequence, the older layout.)"""
    bb = backbone("toy-clip")
    pre = bb.tower_variant("preproj")
    items = shapes.items("test")[:6]
    store = FeatureStore(tmp_path / "store")
    cache = FeatureCache(store)
    plain, first = cache.features(bb, shapes, items), cache.features(pre, shapes, items)
    assert (plain.encoded, first.encoded) == (6, 0)  # one entry: the features before the projection
    assert len(store.groups()) == 1
    again = FeatureCache(store).features(pre, shapes, items)  # another process or sweep: read, not encoded
    assert (again.encoded, again.from_store) == (0, 6)
    assert torch.equal(again.features.x, first.features.x)
    assert again.features.x.shape[1] == bb.image_projection().shape[0]  # the tower's width
    torch.testing.assert_close(again.features.x @ bb.image_projection(), plain.features.x, rtol=1e-6, atol=1e-6)
