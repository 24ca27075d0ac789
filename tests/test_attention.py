"""Local-window attention pinned down: windows as sets of allowed pairs, full windows equal the
unmodified towers, a text window of 0 sees only itself, receptive fields end where they should,
the class token is global or local, and the flex path equals the mask path."""
import pytest
import torch
from omegaconf import OmegaConf

from fewclip.adapters.coop import CoOp, CoOpConfig
from fewclip.backbones.attention import (
    LocalAttention,
    LocalAttentionConfig,
    SplitAttention,
    Window,
    apply_local_attention,
    attend,
    pack_split_state,
    parse_layers,
    split_attention,
)
from fewclip.backbones.backbone import BackboneConfig, BackboneError, backbone_config_from_dict, build_open_clip_model, load_backbone
from fewclip.config.compose import ConfigError, load_config
from fewclip.features.encode import text_prototypes
from helpers.cards import SHAPES, tiny_model_config, write_card

PROMPTS = ["a photo of a circle.", "a red square on grass", "star"]


def load(name="toy-clip", **la):
    la.setdefault("flex_compile", False)  # impl=flex eagerly: the same mask_mod, no compile time in tests
    return load_backbone(backbone_config_from_dict({"name": name, "device": "cpu", "local_attention": la}))


@pytest.fixture(scope="module")
def plain():
    return load("toy-clip")


def pixels(n=3, seed=0, size=32):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- windows as pure functions


def test_parse_layers():
    assert parse_layers("all", 4) == [0, 1, 2, 3]
    assert parse_layers("first:2", 4) == [0, 1]
    assert parse_layers("last:1", 4) == [3]
    assert parse_layers("last:9", 4) == [0, 1, 2, 3]
    assert parse_layers("2,0,-1", 4) == [0, 2, 3]
    for bad in ("some", "first:0", "last:x", ""):
        with pytest.raises(ValueError, match="'all', 'first:N', 'last:N'"):
            parse_layers(bad, 4)
    with pytest.raises(ValueError, match="layer 7 does not exist; this tower has layers 0..3"):
        parse_layers("1,7", 4)


def test_text_window_is_a_band_and_zero_is_the_diagonal():
    a = Window(2).allowed(6)
    want = torch.tensor([[abs(i - j) <= 2 for j in range(6)] for i in range(6)])
    assert torch.equal(a, want)
    assert torch.equal(Window(0).allowed(5), torch.eye(5, dtype=torch.bool))
    # with the tower's causal mask (flex rebuilds it): j in [i-k, i]
    w = Window(2, causal=True).mask_mod()
    i = torch.arange(6)
    got = w(None, None, i[:, None], i[None, :])
    assert torch.equal(got, torch.tensor([[0 <= i - j <= 2 for j in range(6)] for i in range(6)]))


def test_vision_band_and_grid_with_global_and_local_class_token():
    # 1 class token + a 3x4 grid of patches
    L, gw = 13, 4
    cell = lambda t: divmod(t - 1, gw)  # noqa: E731
    grid_g = Window(1, "grid", prefix=1, cls="global", grid=(3, 4)).allowed(L)
    grid_l = Window(1, "grid", prefix=1, cls="local", grid=(3, 4)).allowed(L)
    band_g = Window(1, "band", prefix=1, cls="global").allowed(L)
    band_l = Window(1, "band", prefix=1, cls="local").allowed(L)
    for i in range(1, L):
        for j in range(1, L):
            (ri, ci), (rj, cj) = cell(i), cell(j)
            near = abs(ri - rj) <= 1 and abs(ci - cj) <= 1
            assert grid_g[i, j] == grid_l[i, j] == near
            assert band_g[i, j] == band_l[i, j] == (abs(i - j) <= 1)
    assert grid_g[0].all() and grid_g[:, 0].all() and band_g[0].all() and band_g[:, 0].all()
    # local class token: on the top-left cell in a grid, position 0 in a band
    assert grid_l[0].tolist() == [True] + [abs(r) <= 1 and abs(c) <= 1 for r, c in map(cell, range(1, L))]
    assert torch.equal(grid_l[:, 0], grid_l[0])
    assert band_l[0].tolist() == [True, True] + [False] * (L - 2)


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="window must be >= 0"):
        load_config(["backbone.local_attention.text.window=-1"])
    with pytest.raises(ConfigError, match="shape must be one of"):
        load_config(["backbone.local_attention.vision.shape=square"])
    with pytest.raises(ConfigError, match="cls must be one of"):
        load_config(["backbone.local_attention.vision.cls=both"])
    with pytest.raises(ConfigError, match="impl must be one of"):
        load_config(["backbone.local_attention.impl=fast"])
    with pytest.raises(ConfigError, match="layers is set but window is null"):
        load_config(["backbone.local_attention.vision.layers=0,1"])
    with pytest.raises(BackboneError, match="layer 9 does not exist"):
        load("toy-clip", text={"window": 2, "layers": "0,9"})
    cfg = load_config(["backbone.local_attention.text.window=4", "backbone.local_attention.vision.layers=last:2",
                       "backbone.local_attention.vision.window=1", "backbone.local_attention.vision.shape=grid"])
    assert cfg.backbone.local_attention.active and cfg.backbone.local_attention.vision.shape == "grid"
    assert not LocalAttentionConfig().active


# ---------------------------------------------------------------- exactness on real towers


@pytest.mark.parametrize("impl", ["mask", "flex"])
def test_window_covering_the_sequence_equals_the_unmodified_towers(plain, impl):
    # toy-clip: 65 image tokens (class + 8x8 patches), 20 text tokens
    x = pixels()
    for shape in ("band", "grid"):
        bb = load("toy-clip", impl=impl, text={"window": 20}, vision={"window": 65 if shape == "band" else 8,
                                                                       "shape": shape, "cls": "local"})
        assert all(isinstance(b.attn, LocalAttention) for b in bb.model.visual.transformer.resblocks)
        close(bb.encode_images(x), plain.encode_images(x))
        close(bb.encode_text(PROMPTS), plain.encode_text(PROMPTS))


def test_text_window_zero_sees_only_itself(plain):
    bb = load("toy-clip", text={"window": 0})
    # Same length, same end token position, different words: the pooled (end-of-text) feature is the same.
    a, b = bb.encode_text(["a photo of a circle.", "the sketch of some star."])
    assert bb.tokenize(["a photo of a circle."]).argmax() == bb.tokenize(["the sketch of some star."]).argmax()
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    a0, b0 = plain.encode_text(["a photo of a circle.", "the sketch of some star."])
    assert (a0 - b0).abs().max() > 1e-2  # global attention does see the words


def test_text_receptive_field_is_window_times_layers(plain):
    # 3 causal layers, window 1: the end token (position e) sees positions e-3..e and no further.
    bb = load("toy-clip", text={"window": 1})
    base = "a photo of a big red circle."   # [SOT] a photo of a big red circle [EOT]: e = 8
    at_4 = "a photo of the big red circle."  # changes position 4 (e - 4)
    at_3 = "a photo of a small red circle."  # changes position 5 (e - 3)
    tok = bb.tokenize([base, at_4, at_3])
    assert tok.argmax(dim=1).tolist() == [8, 8, 8]
    assert (tok[0] != tok[1]).nonzero().flatten().tolist() == [4]
    assert (tok[0] != tok[2]).nonzero().flatten().tolist() == [5]
    f_base, f_4, f_3 = bb.encode_text([base, at_4, at_3])
    torch.testing.assert_close(f_base, f_4, rtol=0, atol=1e-6)
    assert (f_base - f_3).abs().max() > 1e-3
    g_base, g_4 = plain.encode_text([base, at_4])
    assert (g_base - g_4).abs().max() > 1e-3  # global attention sees position 4


@pytest.mark.parametrize("cls_mode", ["global", "local"])
def test_class_token_global_or_local(plain, cls_mode):
    # grid window 1 in the 4 layers of toy-clip's 8x8 grid: a local class token on cell (0, 0) sees cells
    # with row, col <= 4 at most; a global one sees everything.
    bb = load("toy-clip", vision={"window": 1, "shape": "grid", "cls": cls_mode})
    x = pixels(2)
    y = x.clone()
    y[:, :, 28:, 28:] += 1.0  # only the bottom-right patch (cell (7, 7)) changes
    fx, fy = bb.encode_images(x), bb.encode_images(y)
    if cls_mode == "local":
        torch.testing.assert_close(fx, fy, rtol=0, atol=1e-6)
    else:
        assert (fx - fy).abs().max() > 1e-3


def test_layer_selection_touches_only_those_layers():
    bb = load("toy-clip", text={"window": 2, "layers": "last:1"}, vision={"window": 1, "layers": "0,2"})
    kinds = [type(b.attn).__name__ for b in bb.model.visual.transformer.resblocks]
    assert kinds == ["LocalAttention", "MultiheadAttention", "LocalAttention", "MultiheadAttention"]
    kinds = [type(b.attn).__name__ for b in bb.model.transformer.resblocks]
    assert kinds == ["MultiheadAttention", "MultiheadAttention", "LocalAttention"]
    assert bb.describe()["local_attention"]["vision"]["layers"] == [0, 2]


def test_state_dict_names_do_not_change(plain):
    bb = load("toy-clip", text={"window": 2}, vision={"window": 2})
    assert list(bb.model.state_dict()) == list(plain.model.state_dict())
    assert bb.variant and not plain.variant


@pytest.mark.parametrize("shape", ["band", "grid"])
@pytest.mark.parametrize("cls_mode", ["global", "local"])
def test_flex_path_equals_mask_path(shape, cls_mode):
    la = {"text": {"window": 2}, "vision": {"window": 2, "shape": shape, "cls": cls_mode}}
    m, f = load("toy-clip", impl="mask", **la), load("toy-clip", impl="flex", **la)
    x = pixels()
    torch.testing.assert_close(m.encode_images(x), f.encode_images(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.encode_text(PROMPTS), f.encode_text(PROMPTS), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- other towers


def test_custom_attention_blocks_and_bidirectional_text(tmp_path):
    """open_clip's own Attention (qk-norm) gets the window through a hook; a tower without a causal mask
    (SigLIP style, padding masked) gets a two-sided band."""
    cfg = tiny_model_config(custom_text=True, no_causal_mask=True, pool_type="last")
    cfg["vision_cfg"].update({"qk_norm": True, "patch_size": 8})
    card = write_card(tmp_path, "tiny-qknorm", cfg, {"name": "sigmoid", "logit_scale": 10.0, "logit_bias": -5.0})
    plain_bb = load_backbone(BackboneConfig(name=card, device="cpu"))
    wide = load(card, text={"window": 16}, vision={"window": 17})
    # one layer: with a global class token the pooled output could not change, so make it local
    narrow = load(card, text={"window": 1}, vision={"window": 1, "shape": "grid", "cls": "local"})
    x = pixels(2)
    close(wide.encode_images(x), plain_bb.encode_images(x))
    close(wide.encode_text(["cat", "golden retriever"]), plain_bb.encode_text(["cat", "golden retriever"]))
    assert (narrow.encode_images(x) - plain_bb.encode_images(x)).abs().max() > 1e-4
    t_narrow = narrow.encode_text(["cat", "golden retriever"])
    assert torch.isfinite(t_narrow).all()
    assert (t_narrow - plain_bb.encode_text(["cat", "golden retriever"])).abs().max() > 1e-4
    with pytest.raises(BackboneError, match="only the mask path"):
        load(card, impl="flex", vision={"window": 1})


def test_a_resnet_image_tower_is_refused_with_the_fix():
    model = build_open_clip_model({"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1],
                                                                   "width": 8},
                                   "text_cfg": {"context_length": 8, "vocab_size": 100, "width": 16, "heads": 2,
                                                "layers": 1}})
    cfg = backbone_config_from_dict({"local_attention": {"vision": {"window": 2}}}).local_attention
    with pytest.raises(ValueError, match="ModifiedResNet, not an open_clip VisionTransformer.*window=null"):
        apply_local_attention(model, cfg)
    cfg.vision.window = None
    cfg.text.window = 2
    assert apply_local_attention(model, cfg)["text"]["window"] == 2


# ---------------------------------------------------------------- with adapters


def test_coop_word_init_reproduces_windowed_zero_shot():
    bb = load("toy-clip", text={"window": 2}, vision={"window": 2, "shape": "grid"})
    ad = CoOp(CoOpConfig(ctx_init="a photo of a"), bb, SHAPES)
    assert ad.text_mode == "truncate"  # the packed shared-prefix path has no window: cut prompts instead
    feats = bb.encode_images(pixels())
    expected = bb.geometry.image_logits(feats, text_prototypes(bb, SHAPES, ["a photo of a {}."]))
    with torch.no_grad():
        torch.testing.assert_close(ad(feats), expected, rtol=1e-5, atol=1e-5)
        ad.set_text_mode("faithful")
        torch.testing.assert_close(ad(feats), expected, rtol=1e-5, atol=1e-5)


def test_split_attention_equals_packed_and_packs_back(plain):
    import copy

    model = copy.deepcopy(plain.model)
    split_attention(model.transformer.resblocks)
    assert all(isinstance(b.attn, SplitAttention) for b in model.transformer.resblocks)
    tokens = plain.tokenize(PROMPTS)
    close(model.encode_text(tokens), plain.model.encode_text(tokens))
    packed = pack_split_state(model.state_dict())
    assert list(packed) != list(plain.model.state_dict()) and set(packed) == set(plain.model.state_dict())
    assert all(torch.equal(packed[k], v) for k, v in plain.model.state_dict().items())


def test_backbone_config_round_trips_through_yaml():
    cfg = backbone_config_from_dict({"name": "toy-clip", "local_attention": {"text": {"window": 3}}})
    again = backbone_config_from_dict(OmegaConf.to_container(OmegaConf.structured(cfg)))
    assert again == cfg and again.local_attention.text.window == 3


def test_sweep_variants_with_windows_do_not_share_cached_features(tmp_path, shapes):
    from fewclip.runs.sweep import load_sweep_config, run_sweep

    cfg = load_sweep_config([
        "sweep.backbones=[toy-clip]", "sweep.datasets=[toy-shapes]",
        "sweep.methods=[zeroshot,zs_w0,coop_w1,lp_w2]",
        "sweep.shots=[1]", "sweep.seeds=[1]",
        "sweep.args=[data.max_test=40,train.epochs=2,backbone.device=cpu,data.templates=single]",
        "sweep.variants.zs_w0=[adapter=zeroshot,backbone.local_attention.vision.window=0,"
        "backbone.local_attention.vision.cls=local]",
        "sweep.variants.coop_w1=[adapter=coop,backbone.local_attention.text.window=1]",
        "sweep.variants.lp_w2=[adapter=linear_probe,backbone.local_attention.vision.window=2]",
    ])
    counts = run_sweep(cfg, tmp_path)
    assert counts["ran"] == 4
    import json

    lp = json.loads((tmp_path / "toy-clip/toy-shapes/lp_w2/1shot/seed1/metrics.json").read_text())
    assert lp["method"] == "lp_w2" and 0 <= lp["top1"] <= 100

    zs = json.loads((tmp_path / "toy-clip/toy-shapes/zeroshot/metrics.json").read_text())
    w0 = json.loads((tmp_path / "toy-clip/toy-shapes/zs_w0/metrics.json").read_text())
    coop = json.loads((tmp_path / "toy-clip/toy-shapes/coop_w1/1shot/seed1/metrics.json").read_text())
    # every patch sees only itself and a local class token sees only itself: the image is ignored
    assert w0["backbone_info"]["local_attention"]["vision"]["window"] == 0
    assert w0["top1"] == pytest.approx(100 / 8, abs=0.01) and zs["top1"] > 50
    assert zs["backbone_info"]["local_attention"] is None and coop["n_test"] == 40


def test_flex_refuses_a_padding_mask():
    from fewclip.backbones.attention import _MaskCache, attend

    q = torch.randn(2, 2, 5, 8)
    pad = torch.zeros(4, 5, 5)
    pad[..., 4] = float("-inf")  # [B*H, L, L]: the last token is padding
    with pytest.raises(ValueError, match="impl=flex cannot apply this tower's attention mask"):
        attend(q, q, q, pad, _MaskCache(Window(1)), "flex")
    # the mask path takes it, and auto falls back to it
    a = attend(q, q, q, pad, _MaskCache(Window(1)), "mask")
    torch.testing.assert_close(attend(q, q, q, pad, _MaskCache(Window(1)), "auto"), a)
    # a 2-D mask the window does not know as causal is refused too
    with pytest.raises(ValueError, match="impl=flex"):
        attend(q, q, q, torch.zeros(5, 5), _MaskCache(Window(1)), "flex")


def test_auto_picks_compiled_flex_only_where_it_skips_blocks(monkeypatch):
    import fewclip.backbones.attention as A

    calls = []

    def fake_flex(q, k, v, block_mask, compiled):
        calls.append((q.shape[2], compiled))
        return A.flex_attention_eager(q, k, v, block_mask)

    monkeypatch.setattr(A, "_flex", fake_flex)
    monkeypatch.setattr(A, "flex_available", lambda device: True)
    band4 = A._MaskCache(Window(4, prefix=1))
    assert not band4.flex_skips_enough(65, "cpu")      # the toy backbones: too short
    assert band4.flex_skips_enough(577, "cpu")         # ViT-L-14-336: 75% of 32x32 blocks skipped
    q = torch.randn(1, 2, 577, 16)
    with torch.no_grad():
        out = attend(q, q, q, None, band4, "auto")
    assert calls == [(577, True)]
    torch.testing.assert_close(out, attend(q, q, q, None, band4, "mask"), rtol=1e-5, atol=1e-5)
    # training on the CPU (a gradient through q): FlexAttention has no CPU backward, so the mask path
    qg = q.clone().requires_grad_(True)
    attend(qg, qg, qg, None, band4, "auto").sum().backward()
    attend(qg, qg, qg, None, band4, "flex").sum().backward()
    assert calls == [(577, True)] and qg.grad is not None


def test_compiled_flex_on_the_cpu_equals_the_mask_path():
    """torch.compile of FlexAttention on the CPU (about 10 s of compiling): the kernels that skip blocks."""
    import fewclip.backbones.attention as A

    if not A.flex_available(torch.device("cpu")):
        pytest.skip("no C++ compiler for inductor's CPU kernels")
    for w in (Window(2, "grid", prefix=1, grid=(24, 24)), Window(4, prefix=1, cls="local")):
        masks = A._MaskCache(w)
        q, k, v = torch.randn(3, 1, 4, 577, 32).unbind(0)
        with torch.no_grad():
            torch.testing.assert_close(attend(q, k, v, None, masks, "flex"), attend(q, k, v, None, masks, "mask"),
                                       rtol=1e-5, atol=1e-5)


def test_exported_prompts_rebuild_the_windowed_backbone(tmp_path):
    from fewclip.adapter.exports import load_prompts
    from fewclip.adapters.coop_export import export_prompts

    cfg = backbone_config_from_dict({"name": "toy-clip", "device": "cpu", "local_attention": {
        "text": {"window": 2}, "vision": {"window": 1, "shape": "grid"}}})
    bb = load_backbone(cfg)
    ad = CoOp(CoOpConfig(ctx_init="a photo of a"), bb, SHAPES)
    export_prompts(ad, tmp_path / "p.safetensors", backbone_cfg=cfg)
    clf = load_prompts(tmp_path / "p.safetensors", device="cpu")
    assert clf.backbone.local_attention == bb.local_attention
    x = pixels()
    with torch.no_grad():
        torch.testing.assert_close(clf.logits(x), ad(bb.encode_images(x)), rtol=1e-5, atol=1e-5)
