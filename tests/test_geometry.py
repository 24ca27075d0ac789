"""Geometry math against numbers worked out by hand, plus registry-wide checks."""
import math

import pytest
import torch

from fewclip.backbones import geometry as G
from fewclip.backbones.geometry import GEOMETRIES, make_geometry

f64 = torch.float64


def t(*rows):
    return torch.tensor(rows, dtype=f64)


def assert_close(actual, expected, tol=1e-6):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def finite_grad(fn, x):
    x = x.clone().requires_grad_(True)
    out = fn(x)
    out.sum().backward()
    return torch.isfinite(out).all() and torch.isfinite(x.grad).all()


# -- pure functions -------------------------------------------------------


def test_l2_normalize_and_cosine():
    x = G.l2_normalize(t([3.0, 4.0], [0.0, 2.0]))
    assert_close(x, [[0.6, 0.8], [0.0, 1.0]])
    assert_close(G.cosine_matrix(x, t([1.0, 0.0])), [[0.6], [0.0]])


def test_euclidean_distance_by_hand():
    x, y = t([0.0, 0.0], [1.0, 1.0]), t([3.0, 4.0], [1.0, 1.0])
    assert_close(G.euclidean_distance(x, y), [[5.0, math.sqrt(2)], [math.sqrt(13), 0.0]])
    assert_close(G.euclidean_distance(x, y, squared=True), [[25.0, 2.0], [13.0, 0.0]])


def test_euclidean_distance_matches_broadcast_difference_float32():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 16, generator=g), torch.randn(5, 16, generator=g)
    ref = (x.double()[:, None] - y.double()[None]).pow(2).sum(-1)
    assert_close(G.euclidean_distance(x, y, squared=True).double(), ref, tol=1e-5)


@pytest.mark.parametrize("squared", [False, True])
def test_euclidean_distance_zero_has_finite_grad(squared):
    y = t([1.0, 2.0])
    assert finite_grad(lambda x: G.euclidean_distance(x, y, squared=squared), t([1.0, 2.0]))


def test_lorentz_inner_and_distance_by_hand():
    x, y = t([1.0, 0.0]), t([0.0, 1.0])
    # c = 1: t_x = t_y = sqrt(2), <x, y>_L = 0 - 2
    assert_close(G.lorentz_time(x, 1.0), [math.sqrt(2)])
    assert_close(G.lorentz_inner(x, y, 1.0), [[-2.0]])
    assert_close(G.lorentz_distance(x, y, 1.0), [[math.acosh(2.0)]])
    # c = 0.5: t = sqrt(2 + 1), <x, y>_L = -3, -c <x, y>_L = 1.5
    assert_close(G.lorentz_inner(x, y, 0.5), [[-3.0]])
    assert_close(G.lorentz_distance(x, y, 0.5), [[math.acosh(1.5) / math.sqrt(0.5)]])


@pytest.mark.parametrize("curv", [0.1, 1.0, 4.0])
def test_exp_map_lands_on_hyperboloid_and_log_map_inverts_it(curv):
    g = torch.Generator().manual_seed(1)
    # sqrt(c) |v| from 1e-6 to 8, below the sinh clamp at asinh(2^15) ~ 11.1
    radius = torch.tensor([1e-6, 1e-3, 0.1, 1.0, 3.0, 8.0], dtype=f64)[:, None]
    v = G.l2_normalize(torch.randn(6, 5, generator=g, dtype=f64)) * radius / math.sqrt(curv)
    x = G.exp_map0(v, curv)
    # <x, x>_L = |x|^2 - t^2 = -1/c, up to rounding relative to t^2
    gap = torch.diagonal(G.lorentz_inner(x, x, curv)) + 1 / curv
    assert (gap.abs() / G.lorentz_time(x, curv).pow(2) < 1e-12).all()
    assert_close(G.log_map0(x, curv), v, tol=1e-9)


def test_exp_map_by_hand():
    v = t([1.5, 2.0])  # |v| = 2.5
    assert_close(G.exp_map0(v, 1.0), math.sinh(2.5) * t([0.6, 0.8]))
    assert_close(G.exp_map0(v, 4.0), math.sinh(5.0) / 5.0 * v)  # r = sqrt(4) * 2.5


def test_exp_map_of_huge_vector_is_finite():
    x = G.exp_map0(torch.full((1, 8), 1e4), 1.0)
    assert torch.isfinite(x).all()
    assert_close(x.norm(), torch.tensor(2.0**15), tol=1e-3)


@pytest.mark.parametrize("fn", [G.l2_normalize, lambda x: G.exp_map0(x, 1.0), lambda x: G.log_map0(x, 1.0)])
def test_zero_vector_maps_to_zero_with_finite_grad(fn):
    z = torch.zeros(2, 3)
    assert torch.equal(fn(z), z)
    assert finite_grad(fn, z)


@pytest.mark.parametrize("dtype", [torch.float32, f64])
@pytest.mark.parametrize("curv", [0.5, 1.0, 2.0])
def test_lorentz_distance_to_self_is_small_finite_with_finite_grad(dtype, curv):
    g = torch.Generator().manual_seed(2)
    v = torch.randn(4, 8, generator=g, dtype=dtype) * torch.tensor([0.0, 0.1, 1.0, 3.0], dtype=dtype)[:, None]
    x = G.exp_map0(v, curv)  # norms from 0 up to ~sinh(10)
    d = torch.diagonal(G.lorentz_distance(x, x, curv))
    assert torch.isfinite(d).all() and (d < 1e-3).all()
    assert finite_grad(lambda p: torch.diagonal(G.lorentz_distance(p, p.detach(), curv)), x)


def test_lorentz_distance_equals_direct_formula_and_is_accurate_in_float32():
    g = torch.Generator().manual_seed(5)
    x = G.exp_map0(torch.randn(5, 6, generator=g, dtype=f64), 0.7)
    y = torch.cat([x[:2] + 1e-3 * torch.randn(2, 6, generator=g, dtype=f64), G.exp_map0(torch.randn(3, 6, generator=g, dtype=f64), 0.7)])
    direct = torch.acosh(-0.7 * G.lorentz_inner(x, y, 0.7)) / math.sqrt(0.7)
    assert_close(G.lorentz_distance(x, y, 0.7), direct, tol=1e-7)
    assert_close(G.lorentz_distance(x.float(), y.float(), 0.7).double(), direct, tol=1e-4)


def test_lorentz_distance_is_symmetric():
    g = torch.Generator().manual_seed(3)
    x = G.exp_map0(torch.randn(3, 4, generator=g, dtype=f64), 0.7)
    y = G.exp_map0(torch.randn(5, 4, generator=g, dtype=f64), 0.7)
    assert_close(G.lorentz_distance(x, y, 0.7), G.lorentz_distance(y, x, 0.7).T, tol=1e-9)


# -- geometries: similarity and logits by hand ------------------------------

IMG = t([3.0, 4.0])  # unit: [0.6, 0.8]
PROTO = t([1.0, 0.0], [0.0, 2.0])  # unit: [1, 0], [0, 1]


@pytest.mark.parametrize(
    "name, scale, expected_sim",
    [
        ("clip", 100.0, [0.6, 0.8]),
        ("elliptic", 100.0, [-math.acos(0.6), -math.acos(0.8)]),
        ("sigmoid", 10.0, [0.6, 0.8]),
    ],
)
def test_spherical_similarity_and_default_logits(name, scale, expected_sim):
    geo = make_geometry(name)
    img, proto = geo.embed_image(IMG), geo.embed_text(PROTO)
    assert_close(geo.similarity(img, proto), [expected_sim])
    bias = -10.0 if name == "sigmoid" else 0.0
    assert_close(geo.logits(img, proto), [[scale * s + bias for s in expected_sim]], tol=1e-5)


def test_sigmoid_logits_include_bias():
    geo = make_geometry("sigmoid", logit_scale=2.0, logit_bias=-3.0)
    img, proto = geo.embed_image(IMG), geo.embed_text(PROTO)
    assert_close(geo.logits(img, proto), [[2 * 0.6 - 3, 2 * 0.8 - 3]])
    assert geo.params() == pytest.approx({"logit_scale": 2.0, "logit_bias": -3.0})


def test_euclidean_embed_similarity_and_logits():
    geo, geo_sq = make_geometry("euclidean"), make_geometry("euclidean_sq", logit_scale=2.0)
    assert_close(geo.embed_image(IMG), [[3 / math.sqrt(2), 4 / math.sqrt(2)]])
    assert_close(geo.embed_text(t([1.0, 2.0, 2.0])), [[1 / math.sqrt(3), 2 / math.sqrt(3), 2 / math.sqrt(3)]])
    x, y = t([1.0, 2.0]), t([4.0, 6.0], [1.0, 2.0])
    assert_close(geo.similarity(x, y), [[-5.0, 0.0]])
    assert_close(geo.logits(x, y), [[-50.0, 0.0]], tol=1e-5)
    assert_close(geo_sq.similarity(x, y), [[-25.0, 0.0]])
    assert_close(geo_sq.logits(x, y), [[-50.0, 0.0]], tol=1e-5)


def test_hyperbolic_similarity_and_logits_by_hand():
    x, y = t([1.0, 0.0]), t([0.0, 1.0], [1.0, 0.0])
    d = math.acosh(1.5) / math.sqrt(0.5)  # c = 0.5, see test_lorentz_inner_and_distance_by_hand
    geo = make_geometry("hyperbolic", curvature=0.5)
    sim = geo.similarity(x, y)
    assert_close(sim[0, 0], -d)
    assert abs(sim[0, 1].item()) < 1e-3  # distance to itself, ~sqrt(2 eps / c)
    assert_close(geo.logits(x, y)[0, 0], -10 * d, tol=1e-5)
    geo_sq = make_geometry("hyperbolic_sq", curvature=0.5, logit_scale=3.0)
    assert_close(geo_sq.similarity(x, y)[0, 0], -d * d)
    assert_close(geo_sq.logits(x, y)[0, 0], -3 * d * d, tol=1e-5)


def test_hyperbolic_embed_uses_per_modality_alpha():
    geo = make_geometry("hyperbolic", alpha_image=0.5, alpha_text=2.0)
    assert_close(geo.embed_image(IMG), [[math.sinh(2.5) * 0.6, math.sinh(2.5) * 0.8]])  # |0.5 * [3, 4]| = 2.5
    assert_close(geo.embed_text(IMG), [[math.sinh(10) * 0.6, math.sinh(10) * 0.8]], tol=1e-5)  # |2 * [3, 4]| = 10
    geo4 = make_geometry("hyperbolic", curvature=4.0, alpha_image=0.5)
    assert_close(geo4.embed_image(IMG), [[math.sinh(5) / 5 * 1.5, math.sinh(5) / 5 * 2.0]])  # r = 2 * 2.5


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_elliptic_grad_finite_at_cos_plus_minus_one(sign):
    geo = make_geometry("elliptic")
    proto = geo.embed_text(t([0.6, 0.8]))
    for dtype in (torch.float32, f64):
        assert finite_grad(lambda x: geo.logits(geo.embed_image(x), proto.to(dtype)), sign * t([3.0, 4.0]).to(dtype))


# -- prototypes -------------------------------------------------------------


def test_spherical_prototype_is_normalised_mean_of_normalised():
    emb = torch.tensor([[[2.0, 0.0], [0.0, 3.0]]], dtype=f64)  # C=1, T=2
    for name in ("clip", "elliptic", "sigmoid"):
        assert_close(make_geometry(name).prototype(emb), [[1 / math.sqrt(2), 1 / math.sqrt(2)]])


def test_euclidean_prototype_is_mean():
    emb = torch.tensor([[[1.0, 0.0], [0.0, 3.0]], [[2.0, 2.0], [4.0, 2.0]]], dtype=f64)
    for name in ("euclidean", "euclidean_sq"):
        assert_close(make_geometry(name).prototype(emb), [[0.5, 1.5], [3.0, 2.0]])


def test_hyperbolic_prototype_is_exp_of_mean_log():
    geo = make_geometry("hyperbolic")
    # tangent vectors [1, 0] and [0, 1] average to [0.5, 0.5], |.| = sqrt(0.5)
    emb = G.exp_map0(torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], dtype=f64), 1.0)
    r = math.sqrt(0.5)
    assert_close(geo.prototype(emb), [[math.sinh(r) / r * 0.5, math.sinh(r) / r * 0.5]])
    # one template: the prototype is the embedding itself
    one = geo.embed_text(t([0.3, -1.2], [2.0, 0.5]))[:, None]  # [C=2, T=1, D=2]
    assert_close(geo.prototype(one), one[:, 0], tol=1e-9)
    # opposite templates average to the origin
    assert_close(geo.prototype(torch.stack([one[:, 0], -one[:, 0]], dim=1)), torch.zeros(2, 2), tol=1e-9)


# -- the linear space and image logits ----------------------------------------


def test_linear_space_by_hand():
    v = t([3.0, 4.0], [0.0, -2.0])
    for name in ("clip", "elliptic", "sigmoid"):  # the sphere's ambient R^D: from_linear normalises
        geo = make_geometry(name)
        assert_close(geo.from_linear(v), [[0.6, 0.8], [0.0, -1.0]])
        unit = geo.from_linear(v)
        assert torch.equal(geo.to_linear(unit), unit)
    for name in ("euclidean", "euclidean_sq"):  # R^D itself
        geo = make_geometry(name)
        assert torch.equal(geo.to_linear(v), v) and torch.equal(geo.from_linear(v), v)
    for name in ("hyperbolic", "hyperbolic_sq"):  # tangent space at the origin: log and exp maps
        geo = make_geometry(name, curvature=0.5)
        assert_close(geo.from_linear(v), G.exp_map0(v, 0.5), tol=1e-12)
        assert_close(geo.to_linear(geo.from_linear(v)), v, tol=1e-9)
        # the space part of exp_map0(v) has norm sinh(sqrt(c) |v|) / sqrt(c); |v| = 5 for the first row
        r = math.sqrt(0.5) * 5.0
        assert_close(geo.from_linear(v)[0].norm(), math.sinh(r) / math.sqrt(0.5), tol=1e-9)


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_every_geometry_owns_its_linear_space(name):
    geo = make_geometry(name)
    points = geo.embed_text(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)))
    assert_close(geo.from_linear(geo.to_linear(points)), points, tol=1e-5)
    half = geo.to_linear(points.half())
    assert half.dtype == torch.float32  # like the other public methods: full precision


def test_a_geometry_without_a_linear_space_says_so():
    class Flat(G.EuclideanGeometry):
        name = "flat-test"

        def _to_linear(self, points):
            return G.Geometry._to_linear(self, points)

    with pytest.raises(NotImplementedError, match="'flat-test' does not define its linear space"):
        Flat().to_linear(t([1.0, 2.0]))


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_image_logits_embed_then_compare(name):
    geo = make_geometry(name)
    g = torch.Generator().manual_seed(1)
    raw, protos = torch.randn(3, 5, generator=g), geo.embed_text(torch.randn(2, 5, generator=g))
    torch.testing.assert_close(geo.image_logits(raw, protos), geo.logits(geo.embed_image(raw), protos))


# -- contrastive losses -----------------------------------------------------


def test_infonce_by_hand_2x2():
    geo = make_geometry("clip", logit_scale=10.0)
    e = t([1.0, 0.0], [0.0, 1.0])  # logits = 10 * I, each row: -log(e^10 / (e^10 + 1))
    assert_close(geo.contrastive_loss(e, e), math.log1p(math.exp(-10)))


def test_sigmoid_loss_by_hand_2x2():
    geo = make_geometry("sigmoid", logit_scale=10.0, logit_bias=-10.0)
    e = t([1.0, 0.0], [0.0, 1.0])  # diagonal logit 0, off-diagonal -10
    # -(2 logsigmoid(0) + 2 logsigmoid(10)) / B with B = 2
    assert_close(geo.contrastive_loss(e, e), math.log(2) + math.log1p(math.exp(-10)))


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_every_geometry_shapes_grads_and_loss(name):
    g = torch.Generator().manual_seed(4)
    geo = make_geometry(name, learnable=True)
    img = torch.randn(4, 8, generator=g, requires_grad=True)
    txt = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    proto = geo.prototype(geo.embed_text(txt))
    logits = geo.logits(geo.embed_image(img), proto)
    assert proto.shape == (3, 8) and logits.shape == (4, 3)
    logits.sum().backward()
    grads = [img.grad, txt.grad] + [p.grad for p in geo.parameters()]
    assert all(gr is not None and torch.isfinite(gr).all() for gr in grads)

    # the loss is lower when matched pairs are closer
    base = torch.randn(4, 8, generator=g)
    noise = torch.randn(4, 8, generator=g)
    near = geo.contrastive_loss(geo.embed_image(base), geo.embed_text(base + 0.1 * noise))
    far = geo.contrastive_loss(geo.embed_image(base), geo.embed_text(base + 1.0 * noise))
    assert torch.isfinite(near) and near < far


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_half_precision_inputs_run_in_float32(name):
    geo = make_geometry(name)
    x = torch.randn(2, 4).bfloat16()
    assert geo.logits(geo.embed_image(x), geo.embed_text(x)).dtype == torch.float32


# -- parameters -------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_learnable_flag_and_params_round_trip(name):
    frozen, learned = make_geometry(name), make_geometry(name, learnable=True)
    assert not any(p.requires_grad for p in frozen.parameters())
    assert all(p.requires_grad for p in learned.parameters())
    assert frozen.state_dict().keys() == learned.state_dict().keys()
    rebuilt = make_geometry(name, **frozen.params())
    assert rebuilt.params() == pytest.approx(frozen.params())


def test_default_params():
    assert make_geometry("clip").params() == pytest.approx({"logit_scale": 100.0})
    assert make_geometry("sigmoid").params() == pytest.approx({"logit_scale": 10.0, "logit_bias": -10.0})
    assert make_geometry("hyperbolic_sq", curvature=0.1, alpha_text=0.5).params() == pytest.approx(
        {"logit_scale": 10.0, "curvature": 0.1, "alpha_image": 1.0, "alpha_text": 0.5}
    )


def test_clamp_bounds_scale_and_curvature():
    geo = make_geometry("hyperbolic", curvature=2.0, learnable=True)
    with torch.no_grad():
        geo.log_scale.fill_(math.log(1000.0))
        geo.log_curvature.fill_(math.log(50.0))
    geo.clamp_()
    assert geo.scale.item() == pytest.approx(100.0, rel=1e-4)
    assert geo.curvature.item() == pytest.approx(20.0, rel=1e-5)
    with torch.no_grad():
        geo.log_curvature.fill_(math.log(0.01))
    geo.clamp_()
    assert geo.curvature.item() == pytest.approx(0.2, rel=1e-5)

    clip = make_geometry("clip", logit_scale=30.0)
    clip.clamp_()
    assert clip.scale.item() == pytest.approx(30.0, rel=1e-6)


# -- factory ----------------------------------------------------------------


def test_make_geometry_rejects_unknown_name():
    with pytest.raises(ValueError, match="spherical") as err:
        make_geometry("spherical")
    assert "clip" in str(err.value) and "hyperbolic_sq" in str(err.value)


@pytest.mark.parametrize(
    "name, bad",
    [("clip", "curvature"), ("euclidean", "logit_bias"), ("hyperbolic", "logit_bias"), ("sigmoid", "alpha_text"), ("clip", "temperature")],
)
def test_make_geometry_rejects_inapplicable_params(name, bad):
    with pytest.raises(ValueError, match=bad):
        make_geometry(name, **{bad: 1.0})


@pytest.mark.parametrize("key", ["logit_scale", "curvature", "alpha_image"])
def test_make_geometry_rejects_non_positive_values(key):
    with pytest.raises(ValueError, match=key):
        make_geometry("hyperbolic", **{key: 0.0})
