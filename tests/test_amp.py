"""bf16 and fp16 on the CPU: ``train.amp=bf16`` is the CPU's autocast, so the GPU's mixed-precision path runs here.

Every registered method trains two steps under bf16 autocast in every geometry without a non-finite number;
the geometry's maps, distances, time component and bias stay in float32 under any autocast; the feature store
keys the backbone's precision, so bf16 and fp32 features never mix.
"""
import pytest
import torch
from conftest import method_geometry_params

from fewclip.adapters import ADAPTERS, adapter_info, build_adapter
from fewclip.backbones.backbone import BackboneConfig, load_backbone
from fewclip.backbones.geometry import exp_map0, make_geometry
from fewclip.features.encode import FeatureCache, Features
from fewclip.features.store import FeatureStore
from fewclip.training.engine import AMP_MODES, CachedFeatures, FeatureSource, FitData, TrainConfig, amp_autocast, amp_dtype, train_loop
from helpers.audit import CLASSNAMES, GEOMETRY_NAMES, TEMPLATES, backbones  # noqa: F401  (fixture)
from helpers.configs import small_config

CPU = torch.device("cpu")


def test_amp_modes():
    assert AMP_MODES == ("auto", "bf16", "fp16", "none")
    assert amp_dtype(CPU, "auto") is None and amp_dtype(torch.device("cuda"), "auto") is torch.bfloat16
    assert amp_dtype(CPU, "bf16") is torch.bfloat16 and amp_dtype(CPU, "fp16") is torch.float16
    assert amp_dtype(CPU, "none") is None and TrainConfig().amp == "auto"
    x = torch.randn(4, 8)
    with amp_autocast(CPU, "bf16"):
        assert (x @ x.T).dtype == torch.bfloat16
    with amp_autocast(CPU, "fp16"):
        assert (x @ x.T).dtype == torch.float16
    with amp_autocast(CPU, "auto"):
        assert (x @ x.T).dtype == torch.float32


class Pixels(FeatureSource):
    """Fresh pixels through the adapter's own image tower (what the engine's FreshImages gives such methods)."""

    def __init__(self, adapter, px, y):
        self.adapter, self.px, self.labels = adapter, px, y

    def batch(self, epoch, idx):
        return self.adapter.encode_images(self.px[idx])

    def frozen(self, epoch, idx):
        with torch.no_grad():
            return self.adapter.backbone.encode_images(self.px[idx])

    def validation(self):
        return Features.empty(1)


def _train_two_steps(name, bb, amp):
    info = adapter_info(name)
    gen = torch.Generator().manual_seed(0)
    px = torch.randn(6, 3, bb.image_size, bb.image_size, generator=gen)
    adapter = build_adapter(small_config(name), bb, CLASSNAMES, TEMPLATES, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the features the method takes (ProLIP: the image tower's before its projection)
        x = adapter.feature_tower().encode_images(px)
    y = torch.arange(6) % len(CLASSNAMES)
    cfg = TrainConfig(amp=amp, iterations=2, batch_size=3, warmup_epochs=0, lr=0.01)
    if adapter.trained_by == "loop":
        source = Pixels(adapter, px, y) if adapter.trains_image_tower else CachedFeatures([Features(x, y)],
                                                                                         Features.empty(x.shape[1]))
        info = train_loop(adapter, source, cfg, 2, torch.Generator().manual_seed(0))  # stops on a non-finite loss
        assert info["steps"] == 2
    elif adapter.trained_by == "fit":
        views = [Features(x, y)] * adapter.fit_views()
        adapter.fit(FitData(Features(x, y), views, Features(x, y), cfg, 2, torch.Generator().manual_seed(0)))
    adapter.eval()
    assert all(torch.isfinite(p).all() for p in adapter.parameters())
    with torch.no_grad(), amp_autocast(CPU, amp):
        logits = adapter(x)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    return logits


@pytest.mark.parametrize("name, geometry", method_geometry_params(sorted(ADAPTERS), GEOMETRY_NAMES))
def test_every_method_trains_in_bf16_on_the_cpu(name, geometry, backbones):  # noqa: F811
    _train_two_steps(name, backbones[geometry], "bf16")


@pytest.mark.parametrize("name", ["coop", "cocoop", "maple", "clip_adapter", "lora"])
def test_fp16_autocast_trains_too(name, backbones):  # noqa: F811
    _train_two_steps(name, backbones["hyperbolic"], "fp16")


# ---------------------------------------------------------------- the geometry stays in float32


def test_hyperbolic_logits_under_bf16_autocast_match_fp32():
    """MERU-like raw features, far from the origin (sinh grows fast, the distance takes acosh near 1 for close
    points): under bf16 autocast the geometry still computes in float32, within 1e-5 of the fp32 logits,
    where the same exp map and distance computed naively in bf16 are off by far more."""
    g = make_geometry("hyperbolic", logit_scale=10.0, curvature=0.1, alpha_image=0.5, alpha_text=0.5)
    gen = torch.Generator().manual_seed(0)
    img_raw = torch.randn(16, 64, generator=gen) * 1.5
    txt_raw = img_raw[:8] + 0.01 * torch.randn(8, 64, generator=gen)  # near some images: distances near 0
    protos = g.embed_text(txt_raw)
    want = g.logits(g.embed_image(img_raw), protos)  # float32, no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = g.logits(g.embed_image(img_raw), g.embed_text(txt_raw))
    # the naive path: the same exp map and distance on bf16 tensors
    c, a = g.curvature.detach().bfloat16(), g.log_alpha_image.exp().detach().bfloat16()
    naive_img = exp_map0(a * img_raw.bfloat16(), c)
    naive_txt = exp_map0(a * txt_raw.bfloat16(), c)
    t_img, t_txt = torch.sqrt(1 / c + naive_img.pow(2).sum(-1)), torch.sqrt(1 / c + naive_txt.pow(2).sum(-1))
    inner = naive_img @ naive_txt.T - t_img[:, None] * t_txt[None, :]  # MERU's distance, in bf16
    naive = -10.0 * torch.acosh((-c * inner).clamp_min(1 + 1e-8)) / torch.sqrt(c)
    assert got.dtype == torch.float32 and naive.dtype == torch.bfloat16
    err = (got - want).abs().max().item()
    naive_err = (naive.float() - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item()
    assert naive_err > 1e3 * max(err, 1e-7) and naive_err > 0.05, (err, naive_err)


@pytest.mark.parametrize("geometry", GEOMETRY_NAMES)
def test_every_geometry_computes_in_float32_under_autocast(geometry, backbones):  # noqa: F811
    g = backbones[geometry].geometry
    gen = torch.Generator().manual_seed(1)
    raw = torch.randn(5, 16, generator=gen)
    want = g.logits(g.embed_image(raw), g.embed_text(raw[:3]))
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            img, txt = g.embed_image(raw.to(dtype)), g.embed_text(raw[:3].to(dtype))
            got = g.logits(img, txt)
            lin = g.to_linear(img)
        assert img.dtype == txt.dtype == got.dtype == lin.dtype == torch.float32
        # the input rounded to the half type is the only difference from float32
        ref = g.logits(g.embed_image(raw.to(dtype).float()), g.embed_text(raw[:3].to(dtype).float()))
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(want).all()


# ---------------------------------------------------------------- the feature store keys the precision


def test_feature_store_never_mixes_bf16_and_fp32(shapes, tmp_path):
    store = FeatureStore(tmp_path / "store")
    items = shapes.items("test")[:4]
    fp32 = load_backbone(BackboneConfig(name="toy-clip", device="cpu"))
    bf16 = load_backbone(BackboneConfig(name="toy-clip", device="cpu", precision="bf16"))
    a = FeatureCache(store).features(fp32, shapes, items).features.x
    b = FeatureCache(store).features(bf16, shapes, items)
    assert b.encoded == len(items) and b.from_store == 0  # not the fp32 features: its own address
    assert not torch.equal(a, b.features.x)
    assert len({g.address["precision"] for g in store.groups()}) == 2
    # An ambient autocast changes nothing: the frozen tower encodes in the backbone's precision, so the fp32
    # address holds fp32 features whoever asks.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fresh = FeatureCache().features(fp32, shapes, items).features.x
        again = FeatureCache(store).features(fp32, shapes, items)
    assert torch.equal(fresh, a) and again.from_store == len(items) and torch.equal(again.features.x, a)
