"""The linear probes: the logistic-regression solver and C search, and both adapters on every geometry."""
import math

import pytest
import torch

import fewclip.adapters.linear_probe  # noqa: F401  (registration)
from fewclip.adapter.base import ADAPTERS, build_adapter
from fewclip.adapters.linear_probe import LinearProbe, LinearProbeConfig, fit_logistic, logistic_objective, probe_features, search_log_grid
from fewclip.adapters.zs_probe import ZSProbe, ZSProbeConfig
from fewclip.backbones.backbone import REFERENCE_DIR, Backbone, BackboneConfig, build_open_clip_model, load_backbone
from fewclip.backbones.geometry import GEOMETRIES, make_geometry
from fewclip.backbones.tokenizer import WordTokenizer
from fewclip.datasets import make_few_shot_split
from fewclip.features.encode import Features, extract_features, text_prototypes
from fewclip.training.engine import FitData, TrainConfig

f64 = torch.float64
TOY_BACKBONES = ["toy-clip", "toy-euclip", "toy-meru", "toy-siglip"]
N_TEST = 400  # toy-shapes test images used (50 per class)


def top1(logits, y):
    return 100.0 * float((logits.argmax(-1) == y).double().mean())


def fit_data(train, val=None):
    """What the engine hands a fit-style adapter; no validation images without ``val``."""
    val = Features(*val) if val is not None else Features.empty(train[0].shape[1])
    return FitData(Features(*train), [], val, TrainConfig(), 16, torch.Generator().manual_seed(0))


# -- fixtures: toy backbones and cached toy-shapes features ------------------


@pytest.fixture(scope="module")
def toy(shapes):
    """name -> (backbone, train, val, test) with 16-shot toy-shapes features (seed 1)."""
    split = make_few_shot_split(shapes, 16, seed=1)
    out = {}
    for name in TOY_BACKBONES:
        bb = load_backbone(BackboneConfig(name=name, device="cpu"))
        feats = [extract_features(bb, shapes, items) for items in
                 (split.train, split.val, shapes.items("test")[:N_TEST])]
        out[name] = (bb, *feats)
    return out


def random_backbone(geometry: str) -> Backbone:
    """A tiny open_clip model with random weights and the toy word tokenizer, in ``geometry``."""
    tok = WordTokenizer.load(REFERENCE_DIR / "toy-vocab.json")
    tok.context_length = 12
    cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 16, "patch_size": 8, "width": 32, "layers": 1, "head_width": 16},
        "text_cfg": {"context_length": 12, "vocab_size": tok.vocab_size, "width": 32, "heads": 2, "layers": 1,
                     "pool_type": "argmax"},
    }
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_open_clip_model(cfg)
    params = {"hyperbolic": dict(curvature=0.5, alpha_image=0.2, alpha_text=0.2),
              "hyperbolic_sq": dict(curvature=0.5, alpha_image=0.2, alpha_text=0.2)}.get(geometry, {})
    return Backbone(model, tok, make_geometry(geometry, **params), name=f"random-{geometry}", image_size=16,
                    mean=(0.5,) * 3, std=(0.25,) * 3)


# -- logistic regression ------------------------------------------------------


def test_fit_logistic_two_points_by_hand():
    # Points -1 (class 0) and +1 (class 1). By symmetry W = [[-w], [w]], b = 0, and the objective
    # log(1 + exp(-2w)) + w^2 / (2C) is stationary where w = 2C / (1 + exp(2w)).
    x, y = torch.tensor([[-1.0], [1.0]], dtype=f64), torch.tensor([0, 1])
    W, b, n_iter = fit_logistic(x, y, 2, c=1.0, tol=1e-10)
    lo, hi = 0.0, 2.0
    for _ in range(80):  # bisection on the stationarity condition
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid < 2 / (1 + math.exp(2 * mid)) else (lo, mid)
    torch.testing.assert_close(W, torch.tensor([[-lo], [lo]], dtype=f64), atol=1e-7, rtol=0)
    torch.testing.assert_close(b, torch.zeros(2, dtype=f64), atol=1e-7, rtol=0)
    assert 0 < n_iter < 100


def test_fit_logistic_separable_2d_meets_kkt():
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[2.0, 0.0], [-1.0, 2.0], [-1.0, -2.0]], dtype=f64)
    y = torch.arange(60) % 3
    x = centres[y] + 0.3 * torch.randn(60, 2, generator=g, dtype=f64)
    W, b, _ = fit_logistic(x, y, 3, c=10.0, tol=1e-10)
    assert top1(x @ W.T + b, y) == 100.0
    # KKT: the gradient of the regularised objective vanishes at the solution.
    W, b = W.clone().requires_grad_(True), b.clone().requires_grad_(True)
    logistic_objective(W, b, x, y, 10.0).backward()
    assert W.grad.abs().max() < 1e-6 and b.grad.abs().max() < 1e-6  # it starts near 1


def test_search_log_grid_finds_the_peak_and_breaks_ties_to_small_c():
    best, history = search_log_grid(lambda c: -abs(math.log10(c) - 2.3), 1e-6, 1e6, 13, 3)
    assert abs(math.log10(best) - 2.3) <= 0.0625 + 1e-9  # final resolution: 1/8 decade
    assert len(history) <= 13 + 2 * 3
    assert len({c for c, _ in history}) == len(history)  # no C is fitted twice
    best, _ = search_log_grid(lambda c: 1.0, 1e-6, 1e6, 13, 3)
    assert best == pytest.approx(1e-6)  # a tie: the strongest regularisation
    best, history = search_log_grid(lambda c: 0.0, 0.5, 0.5, 1, 3)
    assert best == pytest.approx(0.5) and len(history) == 1


def _best_c(xt, yt, xv, yv):
    def val_acc(c):
        W, b, _ = fit_logistic(xt, yt, 2, c, max_iter=500)
        return top1(xv @ W.T + b, yv)

    return search_log_grid(val_acc, 1e-4, 1e4, 9, 2)[0]


def test_search_follows_validation_accuracy():
    g = torch.Generator().manual_seed(0)

    def correlated(n):  # the label is in x0 - x1; a large shared component hides it from the class means
        y = torch.arange(n) % 2
        t = 3 * torch.randn(n, generator=g, dtype=f64)
        x = torch.randn(n, 20, generator=g, dtype=f64)
        x[:, 0], x[:, 1] = 0.5 * (2.0 * y - 1) + t, t
        return x, y

    def isotropic(n, flip):  # the class means carry the label; a share of training labels flipped
        y = torch.arange(n) % 2
        x = torch.randn(n, 20, generator=g, dtype=f64)
        x[:, 0] += 2.0 * y - 1
        flipped = torch.rand(n, generator=g) < flip
        return x, torch.where(flipped, 1 - y, y)

    # Clean data that only a weakly regularised fit separates: the search goes to large C.
    c_clean = _best_c(*correlated(40), *correlated(300))
    # Noisy labels: strong regularisation (close to the class-mean direction) generalises best.
    c_noisy = _best_c(*isotropic(40, 0.3), *isotropic(300, 0.0))
    assert c_clean >= 100.0 and c_noisy <= 1.0


# -- features by geometry -------------------------------------------------------


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_probe_features_by_geometry(geometry):
    g = random_backbone(geometry).geometry
    raw = 3 * torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    feats = probe_features(g, raw)
    if geometry in ("clip", "elliptic", "sigmoid"):
        torch.testing.assert_close(feats, raw / raw.norm(dim=-1, keepdim=True))
    elif geometry.startswith("euclidean"):
        torch.testing.assert_close(feats, raw / 4.0)
    else:  # tangent coordinates at the origin: alpha_image * raw
        torch.testing.assert_close(feats, 0.2 * raw, rtol=1e-5, atol=1e-5)


# -- linear_probe on a toy backbone ---------------------------------------------


def test_linear_probe_on_toy_shapes(toy, shapes):
    bb, train, val, test = toy["toy-clip"]
    probe = build_adapter(LinearProbeConfig(), bb, shapes.classnames, shapes.templates)
    assert probe.trained_by == "fit" and isinstance(probe, LinearProbe)
    info = probe.fit(fit_data(train, val))
    assert set(info) >= {"C", "val_acc", "iterations"}
    assert 1e-6 <= info["C"] <= 1e6 and info["val_acc"] >= max(a for _, a in info["search"])
    with torch.no_grad():
        acc = top1(probe(test[0]), test[1])
    assert acc > 50.0  # chance is 12.5%


def test_linear_probe_refit_on_train_and_val(toy, shapes):
    bb, train, val, _ = toy["toy-euclip"]
    cfg = LinearProbeConfig(c_min=1.0, c_max=1.0, refit="train+val")
    probe = build_adapter(cfg, bb, shapes.classnames, shapes.templates)
    info = probe.fit(fit_data(train, val))
    W, b, _ = fit_logistic(probe_features(bb.geometry, torch.cat([train[0], val[0]])).double(),
                           torch.cat([train[1], val[1]]), len(shapes.classnames), 1.0)
    assert info["C"] == 1.0 and info["refit"] == "train+val"
    torch.testing.assert_close(probe.weight, W.float(), atol=1e-5, rtol=1e-5)


def test_linear_probe_needs_validation_images(toy, shapes):
    bb, train, _, _ = toy["toy-clip"]
    probe = build_adapter(LinearProbeConfig(), bb, shapes.classnames, shapes.templates)
    with pytest.raises(ValueError, match="validation"):
        probe.fit(fit_data(train))
    fixed = build_adapter(LinearProbeConfig(c_min=0.1, c_max=0.1), bb, shapes.classnames, shapes.templates)
    info = fixed.fit(fit_data(train))  # a fixed C needs no validation
    assert info["C"] == pytest.approx(0.1) and info["val_acc"] is None


# -- zs_probe ---------------------------------------------------------------------


@pytest.mark.parametrize("name", TOY_BACKBONES)
def test_zs_probe_starts_at_zero_shot_on_toy_backbones(name, toy, shapes):
    bb, _, _, test = toy[name]
    probe = build_adapter(ZSProbeConfig(), bb, shapes.classnames, shapes.templates)
    protos = text_prototypes(bb, shapes.classnames, shapes.templates)
    with torch.no_grad():
        torch.testing.assert_close(probe(test[0]), bb.geometry.image_logits(test[0], protos), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_zs_probe_starts_at_zero_shot_on_random_weights(geometry, shapes):
    bb = random_backbone(geometry)
    probe = ZSProbe(ZSProbeConfig(), bb, shapes.classnames, shapes.templates)
    raw = 3 * torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    protos = text_prototypes(bb, shapes.classnames, shapes.templates)
    with torch.no_grad():
        torch.testing.assert_close(probe(raw), bb.geometry.image_logits(raw, protos), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", TOY_BACKBONES)
def test_zs_probe_fit_never_below_zero_shot_on_val(name, toy, shapes):
    bb, train, val, _ = toy[name]
    before = {k: v.clone() for k, v in bb.state_dict().items()}
    probe = build_adapter(ZSProbeConfig(epochs=50), bb, shapes.classnames, shapes.templates)
    assert [n for n, p in probe.named_parameters() if p.requires_grad] == ["weight"]
    assert not any(p.requires_grad for p in bb.parameters())
    with torch.no_grad():
        zs_val = top1(probe(val[0]), val[1])
    info = probe.fit(fit_data(train, val))
    with torch.no_grad():
        val_acc = top1(probe(val[0]), val[1])
    assert info["zeroshot_val_acc"] == pytest.approx(zs_val)
    assert val_acc == pytest.approx(info["val_acc"]) and val_acc >= zs_val
    assert 0 <= info["best_epoch"] <= 50
    after = bb.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_zs_probe_without_validation_keeps_the_last_step(toy, shapes):
    bb, train, _, _ = toy["toy-clip"]
    probe = build_adapter(ZSProbeConfig(epochs=5), bb, shapes.classnames, shapes.templates)
    info = probe.fit(fit_data(train))
    assert info["best_epoch"] == 5 and info["val_acc"] is None
    assert not torch.equal(probe.weight, probe.init)


# -- save / load ---------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [LinearProbeConfig(grid_points=5, refine_steps=1), ZSProbeConfig(epochs=20)],
                         ids=["linear_probe", "zs_probe"])
@pytest.mark.parametrize("name", ["toy-clip", "toy-meru"])
def test_state_dict_round_trip(cfg, name, toy, shapes):
    bb, train, val, test = toy[name]
    probe = build_adapter(cfg, bb, shapes.classnames, shapes.templates)
    probe.fit(fit_data(train, val))
    sd = probe.adapter_state_dict()
    assert set(sd) == ({"weight", "bias"} if cfg.name == "linear_probe" else {"weight"})
    fresh = build_adapter(cfg, bb, shapes.classnames, shapes.templates)
    fresh.load_adapter_state_dict(sd)  # strict
    with torch.no_grad():
        assert torch.equal(fresh(test[0]), probe(test[0]))


def test_both_adapters_are_registered():
    assert ADAPTERS["linear_probe"].config_cls is LinearProbeConfig
    assert ADAPTERS["zs_probe"].adapter_cls is ZSProbe


# -- config validation -------------------------------------------------------------


@pytest.mark.parametrize("cls, kwargs, field", [
    (LinearProbeConfig, {"c_min": 0.0}, "c_min"),
    (LinearProbeConfig, {"c_max": float("inf")}, "c_max"),
    (LinearProbeConfig, {"c_min": 10.0, "c_max": 1.0}, "c_min"),
    (LinearProbeConfig, {"grid_points": 1}, "grid_points"),
    (LinearProbeConfig, {"refine_steps": -1}, "refine_steps"),
    (LinearProbeConfig, {"max_iter": 0}, "max_iter"),
    (LinearProbeConfig, {"tol": -1e-6}, "tol"),
    (LinearProbeConfig, {"refit": "val"}, "refit"),
    (ZSProbeConfig, {"lr": 0.0}, "lr"),
    (ZSProbeConfig, {"epochs": -1}, "epochs"),
    (ZSProbeConfig, {"anchor": -0.1}, "anchor"),
])
def test_bad_config_names_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=f"adapter.{field}"):
        cls(**kwargs)
