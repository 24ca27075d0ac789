"""CoOp pinned down: word init reproduces zero-shot on every geometry and tower, truncation is exact,
only the context trains, and a saved context is the whole adapter."""

import open_clip
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from fewclip.adapters import ADAPTERS, build_adapter
from fewclip.adapters.coop import CoOp, CoOpConfig
from fewclip.features.encode import text_prototypes
from helpers.cards import (  # noqa: F401
    CARD_GEOMETRIES,
    CLASSNAMES,
    CONTEXT,
    POSITIONS,
    SHAPES,
    SIGLIP_TEXT,
    TOY_BACKBONES,
    backbone,
    cards,
    classes_for,
    image_features,
)


def assert_reproduces_zero_shot(adapter: CoOp, bb, classnames, feats):
    template = adapter.equivalent_template()
    assert template is not None and template.count("{}") == 1
    expected = bb.geometry.image_logits(feats, text_prototypes(bb, classnames, [template]))  # [B, C]
    with torch.no_grad():
        got = adapter(feats)
    assert got.shape == expected.shape == (len(feats), len(classnames))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- word init is the zero-shot prompt


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("name", TOY_BACKBONES + list(CARD_GEOMETRIES) + [SIGLIP_TEXT])
def test_word_init_reproduces_zero_shot(name, position, cards):
    bb = backbone(name, cards)
    classnames = classes_for(name)
    adapter = CoOp(CoOpConfig(ctx_init="a photo of a", class_token_position=position), bb, classnames)
    assert adapter.n_ctx == 4
    assert_reproduces_zero_shot(adapter, bb, classnames, image_features(bb))
    L = adapter.tokens.shape[1]
    if name == SIGLIP_TEXT:  # no causal mask, last-position pooling: cutting would change the result
        assert not adapter.tower.can_truncate and L == bb.model_context_length == CONTEXT
    else:  # causal mask, pooling at the end-of-text token: cut right after the longest prompt
        assert adapter.tower.can_truncate and L < bb.model_context_length
        assert L == int((adapter.tokens != 0).sum(1).max())


def test_word_init_reproduces_zero_shot_on_vit_b_32():
    bb = backbone("ViT-B-32")
    adapter = CoOp(CoOpConfig(ctx_init="a photo of a"), bb, CLASSNAMES)
    assert adapter.equivalent_template() == "a photo of a {}."
    assert adapter.tokens.shape[1] < bb.model_context_length == 77
    assert_reproduces_zero_shot(adapter, bb, CLASSNAMES, image_features(bb, n=2))


@pytest.mark.parametrize("position", POSITIONS)
def test_multi_token_init_word(position, cards):
    bb = backbone("elliptic", cards)
    tok = open_clip.tokenizer.SimpleTokenizer()
    assert len(tok.encode("itap")) == 2  # BPE splits the word: "it" + "ap</w>"
    adapter = CoOp(CoOpConfig(ctx_init="itap of a", class_token_position=position, n_ctx=16), bb, CLASSNAMES)
    assert adapter.n_ctx == len(tok.encode("itap of a")) == 4  # tokens, not words; n_ctx ignored
    assert adapter.ctx.shape == (4, adapter.tower.width)
    assert_reproduces_zero_shot(adapter, bb, CLASSNAMES, image_features(bb))


def test_middle_split_inside_a_word_has_no_equivalent_template(cards):
    """Five tokens "an it|ap of a": the middle split cuts "itap", which no zero-shot template can write."""
    bb = backbone("elliptic", cards)
    adapter = CoOp(CoOpConfig(ctx_init="an itap of a", class_token_position="middle"), bb, CLASSNAMES)
    assert adapter.n_ctx == 5
    assert adapter.equivalent_template() is None
    for position in ("end", "front"):  # the word stays whole there
        whole = CoOp(CoOpConfig(ctx_init="an itap of a", class_token_position=position), bb, CLASSNAMES)
        assert_reproduces_zero_shot(whole, bb, CLASSNAMES, image_features(bb))


def test_random_init_has_no_equivalent_template():
    assert CoOp(CoOpConfig(n_ctx=2), backbone("toy-clip"), SHAPES).equivalent_template() is None


# ---------------------------------------------------------------- truncation


@pytest.mark.parametrize("csc", [False, True], ids=["unified", "csc"])
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("name", ["toy-clip", "hyperbolic_sq"])
def test_truncation_is_exact(name, position, csc, cards):
    """Every way CoOp runs the text tower gives what the tower gives on full-length prompts."""
    bb = backbone(name, cards)
    classnames = classes_for(name)
    torch.manual_seed(0)
    adapter = CoOp(CoOpConfig(n_ctx=3, csc=csc, class_token_position=position, init_std=0.5), bb, classnames)
    tower = adapter.tower
    C, L = adapter.tokens.shape
    full = tower.context_length
    assert L < full
    pad = torch.full((C, full - L), tower.pad_id, dtype=torch.long)
    tokens_full = torch.cat([adapter.tokens, pad], dim=1)  # [C, full]
    g = bb.geometry
    feats = image_features(bb)
    with torch.no_grad():
        emb_full = torch.cat([adapter.prompt_embeddings(), tower.embed(pad).float()], dim=1)  # [C, full, W]
        expected = tower.forward(emb_full, tokens_full)  # [C, D]
        logits_full = g.logits(g.embed_image(feats), g.prototype(g.embed_text(expected).unsqueeze(1)))
        torch.testing.assert_close(adapter.text_features(), expected, rtol=1e-5, atol=1e-5)  # the default mode
        for mode in ("truncate", "shared", "faithful"):
            try:
                adapter.set_text_mode(mode)
            except ValueError:  # "shared" needs a prefix common to all classes (not CSC, not front)
                assert mode == "shared" and (csc or position == "front")
                continue
            named = lambda m: f"text mode {mode}: {m}"  # noqa: E731
            torch.testing.assert_close(adapter.text_features(), expected, rtol=1e-5, atol=1e-5, msg=named)
            torch.testing.assert_close(adapter(feats), logits_full, rtol=1e-5, atol=1e-5, msg=named)


# ---------------------------------------------------------------- context tensors


def test_context_shapes_init_std_and_seed():
    bb = backbone("toy-clip")
    W, C = bb.model.token_embedding.weight.shape[1], len(SHAPES)
    gen = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731
    unified = CoOp(CoOpConfig(n_ctx=8), bb, SHAPES, generator=gen(3))
    csc = CoOp(CoOpConfig(n_ctx=8, csc=True, init_std=0.1), bb, SHAPES, generator=gen(3))
    assert unified.ctx.shape == (8, W)
    assert csc.ctx.shape == (C, 8, W)
    assert float(unified.ctx.detach().std()) == pytest.approx(0.02, rel=0.1)  # 512 draws
    assert float(csc.ctx.detach().std()) == pytest.approx(0.1, rel=0.05)  # 4096 draws
    assert abs(float(csc.ctx.detach().mean())) < 0.01
    state = torch.random.get_rng_state()
    again = CoOp(CoOpConfig(n_ctx=8), bb, SHAPES, generator=gen(3))
    other = CoOp(CoOpConfig(n_ctx=8), bb, SHAPES, generator=gen(4))
    assert torch.equal(again.ctx, unified.ctx)
    assert not torch.allclose(other.ctx, unified.ctx)
    assert torch.equal(torch.random.get_rng_state(), state)  # the init never touches torch's global RNG
    # without a generator: one seeded with 0, so building is deterministic
    assert torch.equal(CoOp(CoOpConfig(n_ctx=8), bb, SHAPES).ctx, CoOp(CoOpConfig(n_ctx=8), bb, SHAPES).ctx)
    # CSC from words: every class starts from the same words.
    words = CoOp(CoOpConfig(ctx_init="a photo of a", csc=True), bb, SHAPES)
    assert words.ctx.shape == (C, 4, W)
    assert all(torch.equal(words.ctx[c], words.ctx[0]) for c in range(C))
    assert_reproduces_zero_shot(words, bb, SHAPES, image_features(bb))


def test_csc_classes_have_their_own_context():
    """Changing class 0's context changes class 0's prototype only."""
    bb = backbone("toy-clip")
    torch.manual_seed(0)
    adapter = CoOp(CoOpConfig(n_ctx=2, csc=True), bb, SHAPES)
    with torch.no_grad():
        before = adapter.text_features()
        adapter.ctx[0] += torch.randn(adapter.ctx[0].shape)  # not a constant: LayerNorm would remove that
        after = adapter.text_features()
    assert not torch.allclose(before[0], after[0])
    assert torch.equal(before[1:], after[1:])


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("csc", [False, True], ids=["unified", "csc"])
def test_only_the_context_gets_gradients(csc):
    bb = backbone("toy-meru")
    torch.manual_seed(0)
    adapter = CoOp(CoOpConfig(n_ctx=4, csc=csc), bb, SHAPES)
    feats = image_features(bb, n=4)
    loss = F.cross_entropy(adapter(feats), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert [n for n, p in adapter.named_parameters()] == ["ctx"]
    assert adapter.ctx.grad is not None and adapter.ctx.grad.abs().sum() > 0
    assert adapter.trainable_parameters() == [adapter.ctx]
    assert all(not p.requires_grad and p.grad is None for p in bb.parameters())  # model and geometry
    assert all(not b.requires_grad for b in adapter.buffers())


# ---------------------------------------------------------------- interpretation


def test_nearest_words_of_word_init_are_the_words():
    bb = backbone("toy-clip")
    adapter = CoOp(CoOpConfig(ctx_init="a photo of a"), bb, SHAPES)
    near = adapter.nearest_words(k=3)
    assert len(near) == 1 and len(near[0]) == 4 and all(len(row) == 3 for row in near[0])
    assert all(isinstance(w, str) for row in near[0] for w in row)
    assert [row[0] for row in near[0]] == ["a", "photo", "of", "a"]
    table = bb.model.token_embedding.weight  # [V, W]
    dist = (adapter.ctx.detach()[:, None, :] - table[None]).norm(dim=-1)  # [n_ctx, V], exact (no matmul trick)
    assert float(dist.min(dim=1).values.max()) == 0.0  # each vector is its word's embedding
    # CSC: one group per class.
    csc = CoOp(CoOpConfig(ctx_init="a photo of a", csc=True), bb, SHAPES)
    groups = csc.nearest_words(k=2)
    assert len(groups) == len(SHAPES) and all(len(g) == 4 and len(g[0]) == 2 for g in groups)


def test_nearest_words_with_bpe_strip_word_ends(cards):
    adapter = CoOp(CoOpConfig(ctx_init="itap of a"), backbone("elliptic", cards), CLASSNAMES)
    assert [row[0] for row in adapter.nearest_words(k=1)[0]] == ["it", "ap", "of", "a"]


# ---------------------------------------------------------------- save / load


def test_state_is_the_context_only_and_loads_strictly(tmp_path):
    bb = backbone("toy-euclip")
    trained = CoOp(CoOpConfig(n_ctx=4, class_token_position="middle"), bb, SHAPES,
                   generator=torch.Generator().manual_seed(1))
    sd = trained.adapter_state_dict()
    assert list(sd) == ["ctx"] and list(trained.state_dict()) == ["ctx"]  # buffers are non-persistent
    save_file(sd, str(tmp_path / "ctx.safetensors"))
    fresh = CoOp(CoOpConfig(n_ctx=4, class_token_position="middle"), bb, SHAPES,
                 generator=torch.Generator().manual_seed(2))
    feats = image_features(bb)
    with torch.no_grad():
        assert not torch.allclose(fresh(feats), trained(feats))
        from safetensors.torch import load_file

        fresh.load_adapter_state_dict(load_file(str(tmp_path / "ctx.safetensors")))
        assert torch.equal(fresh(feats), trained(feats))
        fresh.load_state_dict(sd, strict=True)  # no strict=False needed anywhere
    with pytest.raises(RuntimeError, match="ctx"):
        fresh.load_state_dict({"ctx": torch.zeros(5, 3)})  # wrong shape


# ---------------------------------------------------------------- bad config


@pytest.mark.parametrize("kwargs, field", [
    (dict(class_token_position="start"), "class_token_position"),
    (dict(n_ctx=0), "n_ctx"),
    (dict(ctx_init=""), "ctx_init"),
    (dict(ctx_init="   "), "ctx_init"),
    (dict(init_std=0.0), "init_std"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"adapter.{field}"):
        CoOpConfig(**kwargs)


def test_prompt_longer_than_the_context_names_the_class(cards):
    bb = backbone("toy-clip")  # context length 20
    long_name = " ".join(["circle"] * 7)  # 1 + 12 + 7 + 1 = 21 tokens (the word tokenizer drops the dot)
    with pytest.raises(ValueError, match=f"class {long_name!r}.*context length 20"):
        CoOp(CoOpConfig(n_ctx=12), bb, ["star", long_name, "ring"])
    CoOp(CoOpConfig(n_ctx=12), bb, ["star", " ".join(["circle"] * 6), "ring"])  # 20 tokens: fits exactly
    with pytest.raises(ValueError, match="class 'golden retriever'"):
        CoOp(CoOpConfig(n_ctx=12), backbone("elliptic", cards), CLASSNAMES)  # 1 + 12 + 2 + 1 + 1 > 16


def test_coop_is_registered():
    assert ADAPTERS["coop"].config_cls is CoOpConfig and ADAPTERS["coop"].adapter_cls is CoOp
    adapter = build_adapter(CoOpConfig(n_ctx=2), backbone("toy-clip"), SHAPES, ["a photo of a {}."])
    assert isinstance(adapter, CoOp) and adapter.uses_text_tower and adapter.trained_by == "loop"
