"""The cache-based methods in every geometry: they start at zero-shot where they can, each geometry's version
is the documented formula, and every choice they make is made on validation images, never on test images."""
import copy
import math

import pytest
import torch
from safetensors.torch import load_file

from fewclip.adapters._cache import affinity, max_similarity, raw_preimage, text_classifier
from fewclip.adapters.clap import Clap, ClapConfig
from fewclip.adapters.clip_adapter import ClipAdapter, ClipAdapterConfig
from fewclip.adapters.lpp import LPP, LPPConfig
from fewclip.adapters.taskres import TaskRes, TaskResConfig
from fewclip.adapters.tip_adapter import TipAdapter, TipAdapterConfig
from fewclip.adapters.tip_adapter_f import TipAdapterF, TipAdapterFConfig
from fewclip.backbones.geometry import GEOMETRIES, exp_map0, l2_normalize, lorentz_time, make_geometry
from fewclip.datasets import Item
from fewclip.features.encode import Features, text_prototypes
from fewclip.training.engine import FitData, TrainConfig
from helpers.cache import EVERY, NAMES, PARAMS, TEMPLATES, TableBackbone, zero_shot  # noqa: F401
from helpers.cards import CARD_GEOMETRIES, SIGLIP_TEXT, backbone, cards, image_features  # noqa: F401  (cards: fixture)


def fitted_cache(cls, cfg, bb, feats):
    """A Tip-Adapter(-F) with a cache of ``feats`` (labels 0, 1, 2, ...)."""
    ad = cls(cfg, bb, NAMES, TEMPLATES)
    ad.build_cache([feats, feats * 1.1], torch.arange(len(feats)) % len(NAMES))
    return ad


# ---------------------------------------------------------------- zero-shot where a method can start there


@pytest.mark.parametrize("name", EVERY)
def test_every_method_that_can_start_at_zero_shot_does_in_every_geometry(name, cards):  # noqa: F811
    bb = backbone(name, cards)
    feats = image_features(bb, n=5)
    want = zero_shot(bb, feats)

    def check(adapter):
        with torch.no_grad():
            torch.testing.assert_close(adapter(feats), want, rtol=1e-5, atol=1e-5)

    check(TipAdapter(TipAdapterConfig(), bb, NAMES, TEMPLATES))  # no cache yet
    for cls, cfg in ((TipAdapter, TipAdapterConfig()), (TipAdapterF, TipAdapterFConfig())):
        ad = fitted_cache(cls, cfg, bb, image_features(bb, n=6, seed=1))
        with torch.no_grad():
            assert not torch.allclose(ad(feats), want, atol=1e-3)  # the cache moves the logits at alpha 1.17 ...
            ad.alpha.fill_(0.0)
        check(ad)  # ... and not at alpha 0
    clip_adapter = ClipAdapter(ClipAdapterConfig(ratio=0.0), bb, NAMES, TEMPLATES)
    with torch.no_grad():
        assert clip_adapter.fc1.abs().sum() > 0 and clip_adapter.fc2.abs().sum() > 0  # a random MLP, unused at 0
    check(clip_adapter)
    check(TaskRes(TaskResConfig(), bb, NAMES, TEMPLATES))
    check(Clap(ClapConfig(), bb, NAMES, TEMPLATES))
    lpp = LPP(LPPConfig(init="zeroshot", epochs=0), bb, NAMES, TEMPLATES)
    check(lpp)
    x = image_features(bb, n=6, seed=2)
    y = torch.arange(6) % 3
    lpp.fit(FitData(Features(x, y), [Features(x, y)], Features(x, y), TrainConfig(), 2, torch.Generator()))
    check(lpp)  # fit from the zero-shot init, 0 epochs: still zero-shot


# ---------------------------------------------------------------- each geometry's formulas


def lorentz_distance_by_hand(x, y, c):
    """acosh(-c <x, y>_L) / sqrt(c), in float64, for space components x [B, D], y [N, D]."""
    x, y = x.double(), y.double()
    inner = x @ y.T - lorentz_time(x, c)[:, None] * lorentz_time(y, c)[None, :]
    return torch.acosh((-c * inner).clamp_min(1.0)) / math.sqrt(c)


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_cache_affinity_is_exp_of_minus_beta_times_the_geometrys_gap(geometry):
    g = make_geometry(geometry, **PARAMS.get(geometry, {}))
    gen = torch.Generator().manual_seed(0)
    x, k = g.embed_image(torch.randn(4, 8, generator=gen)), g.embed_image(torch.randn(6, 8, generator=gen))
    s_max = max_similarity(g, 8)
    cos = (l2_normalize(x) @ l2_normalize(k).T).double()
    # A point's similarity to itself: 1 for the cosine, 0 for minus a distance or an angle, up to the clamps that
    # keep gradients finite (arccos is kept 1e-7 off 1, in float32 1.2e-7; the Lorentz distance's acosh argument
    # 1e-8 above 1).
    self_gap = {"elliptic": math.acos(float(torch.tensor(1 - 1e-7))),
                "hyperbolic": math.acosh(1 + 1e-8) / math.sqrt(0.7),
                "hyperbolic_sq": (math.acosh(1 + 1e-8) / math.sqrt(1.3)) ** 2}.get(geometry, 0.0)
    assert s_max == pytest.approx({"clip": 1.0, "sigmoid": 1.0}.get(geometry, 0.0) - self_gap, abs=1e-6)
    gap = {  # s_max - s(x, k), written out for each geometry
        "clip": 1 - cos, "sigmoid": 1 - cos, "elliptic": torch.arccos(cos),
        "euclidean": torch.cdist(x.double(), k.double()), "euclidean_sq": torch.cdist(x.double(), k.double()) ** 2,
        "hyperbolic": lorentz_distance_by_hand(x, k, 0.7), "hyperbolic_sq": lorentz_distance_by_hand(x, k, 1.3) ** 2,
    }[geometry] - self_gap
    A = affinity(g, x, k, 2.5, s_max)
    torch.testing.assert_close(A.double(), torch.exp(-2.5 * gap), rtol=1e-4, atol=1e-5)
    self_affinity = affinity(g, k, k, 2.5, s_max).diagonal()
    torch.testing.assert_close(self_affinity, torch.ones(6), rtol=0, atol=1e-5)  # a key's affinity to itself is 1
    assert float(A.max()) <= 1.0 + 1e-6




@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_the_text_side_lives_in_the_text_towers_output_space(geometry):
    """TaskRes's and CLAP's base embeds to the zero-shot prototypes; it is the template mean of the raw text
    features where the geometry's embedding is linear (Euclidean, hyperbolic), the prototype's direction at the
    raw mean's norm on the sphere; TaskRes adds its residual there."""
    bb = TableBackbone(geometry)
    g = bb.geometry
    protos, base = text_classifier(bb, NAMES, TEMPLATES)
    torch.testing.assert_close(protos, text_prototypes(bb, NAMES, TEMPLATES), rtol=0, atol=0)
    torch.testing.assert_close(g.embed_text(base), protos, rtol=1e-5, atol=1e-6)
    mean = bb.raw.mean(1)
    if geometry in ("euclidean", "euclidean_sq", "hyperbolic", "hyperbolic_sq"):
        torch.testing.assert_close(base, mean, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(base.norm(dim=-1), mean.norm(dim=-1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(l2_normalize(base), protos, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(raw_preimage(g, protos, bb.raw), base)

    ad = TaskRes(TaskResConfig(scale=0.5), bb, NAMES, TEMPLATES)
    with torch.no_grad():
        ad.residual.copy_(torch.randn(ad.residual.shape, generator=torch.Generator().manual_seed(2)))
    moved = base + 0.5 * ad.residual.detach()
    by_hand = {"euclidean": moved / math.sqrt(8), "euclidean_sq": moved / math.sqrt(8)}.get(geometry)
    if geometry.startswith("hyperbolic"):
        by_hand = exp_map0(PARAMS[geometry]["alpha_text"] * moved, PARAMS[geometry]["curvature"])
    if by_hand is None:
        by_hand = l2_normalize(moved)
    torch.testing.assert_close(ad.class_points(), by_hand, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_clip_adapter_blends_in_the_geometrys_linear_space(geometry):
    bb = TableBackbone(geometry)
    ad = ClipAdapter(ClipAdapterConfig(ratio=0.3, reduction=2), bb, NAMES, TEMPLATES,
                     generator=torch.Generator().manual_seed(0))
    raw = 2 * torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    p = PARAMS.get(geometry, {})
    if geometry.startswith("hyperbolic"):
        v = p["alpha_image"] * raw  # the tangent vector at the origin: log_map0(exp_map0(alpha raw))
    elif geometry.startswith("euclidean"):
        v = raw / math.sqrt(8)
    else:
        v = l2_normalize(raw)
    with torch.no_grad():
        mlp = torch.relu(torch.relu(v @ ad.fc1.T) @ ad.fc2.T)
        blend = 0.3 * mlp + 0.7 * v
        point = exp_map0(blend, p["curvature"]) if geometry.startswith("hyperbolic") else \
            blend if geometry.startswith("euclidean") else l2_normalize(blend)
        torch.testing.assert_close(ad(raw), bb.geometry.logits(point, ad.prototypes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_lpp_uses_the_linear_space_and_the_geometrys_similarity(geometry):
    """LP++'s logits are f W^T + b + alpha s with f the linear-space features and s the similarity; alpha starts at
    250 x the mean own-class similarity where that is positive (a cosine), else at the logit scale."""
    bb = TableBackbone(geometry)
    g = bb.geometry
    ad = LPP(LPPConfig(epochs=0), bb, NAMES, TEMPLATES)
    gen = torch.Generator().manual_seed(4)
    x, y = 2 * torch.randn(9, 8, generator=gen), torch.arange(9) % 3
    ad.fit(FitData(Features(x, y), [Features(x, y)], Features(x, y), TrainConfig(), 3, torch.Generator()))
    f = g.to_linear(g.embed_image(x))
    s = g.similarity(g.embed_image(x), text_prototypes(bb, NAMES, TEMPLATES))
    torch.testing.assert_close(ad.weight, torch.stack([f[y == c].sum(0) for c in range(3)]), rtol=1e-5, atol=1e-5)
    own = torch.stack([s[y == c, c].mean() for c in range(3)]).mean()
    want = 250 * float(own) if own > 0 else float(g.scale)
    if geometry in ("euclidean", "euclidean_sq", "hyperbolic", "hyperbolic_sq", "elliptic"):
        assert own < 0 and want == pytest.approx(float(g.scale))
    torch.testing.assert_close(ad.alpha.detach(), torch.full((3,), want), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(ad(x), f @ ad.weight.T + ad.bias + ad.alpha * s, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- choices are made on validation, never on test


def relabelled(dataset):
    """The same dataset with every test label moved to the next class (the images are the same)."""
    other = copy.copy(dataset)
    C = len(dataset.classnames)
    other.splits = {**dataset.splits, "test": [Item(it.id, (it.label + 1) % C) for it in dataset.splits["test"]]}
    return other


CHOICES = {  # method -> (quick settings, what it chooses)
    "tip_adapter": (["adapter.beta_steps=20", "adapter.alpha_steps=10"], ["beta", "alpha", "val_acc"]),
    "tip_adapter_f": (["adapter.beta_steps=20", "adapter.alpha_steps=10", "train.epochs=4"],
                      ["beta", "alpha", "selected_epoch"]),
    "lpp": (["adapter.epochs=40"], ["best_epoch", "val_acc", "alpha_init"]),
    "linear_probe": (["adapter.grid_points=4", "adapter.refine_steps=1"], ["C", "val_acc"]),
    "zs_probe": (["adapter.epochs=20"], ["best_epoch", "val_acc"]),
    "gda": (["adapter.views=2"], ["alpha", "val_acc", "val_accs"]),
    "proker": (["adapter.views=2", "adapter.beta_grid=[0.5,3,4]", "adapter.lmbda_grid=[0.01,1,4]"],
               ["beta", "lmbda", "val_acc", "val_accs"]),
    "prolip": (["adapter.views=2", "adapter.epochs=10", "adapter.lrs=[0.01,0.001]", "adapter.lambdas=[0.1,0]"],
               ["lr", "lambda", "val_acc", "val_accs"]),
}


@pytest.mark.parametrize("name", sorted(CHOICES))
def test_every_choice_stays_the_same_when_the_test_labels_change(name, shapes, tmp_path):
    from fewclip.backbones.backbone import BackboneConfig, load_backbone
    from fewclip.runs.run import load_train_config, run_train

    bb = load_backbone(BackboneConfig(name="toy-clip", device="cpu"))
    settings, chosen = CHOICES[name]
    cfg = load_train_config([f"adapter={name}", "data=toy-shapes", "shots=2", "seed=3", "data.max_test=40",
                             "data.templates=single", *settings])
    runs = {}
    for tag, ds in (("real", shapes), ("relabelled", relabelled(shapes))):
        runs[tag] = run_train(cfg, tmp_path / tag, backbone=bb, dataset=ds)
    real, moved = runs["real"], runs["relabelled"]
    assert real["top1"] != moved["top1"]  # the test labels did change what is scored ...
    for key in chosen:  # ... and nothing the method chose
        assert key in real and real[key] == moved[key], key
    a, b = (load_file(str(tmp_path / tag / "adapter.safetensors")) for tag in ("real", "relabelled"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
