"""CoCoOp, KgCoOp, ProGrad and TCP in every geometry and on SigLIP-style towers: where each starts (zero-shot
or CoOp, exactly), that every text path gives the same logits, that only their own tensors train, new class
names, and runs through the command line. Parity with the authors' code is tests/parity/test_prompt_parity.py."""
import json

import pytest
import test_import_tokenizers as hf
import torch
import torch.nn.functional as F

from fewclip.adapters import ADAPTERS, AdapterError, build_adapter
from fewclip.adapters._family import default_linear, distance_to_teacher
from fewclip.adapters._prompts import packed_suffix_rows
from fewclip.adapters.cocoop import CoCoOp, CoCoOpConfig
from fewclip.adapters.coop import CoOp, CoOpConfig
from fewclip.adapters.kgcoop import KgCoOp, KgCoOpConfig
from fewclip.adapters.prograd import ProGrad, ProGradConfig
from fewclip.adapters.tcp import TCP, TCPConfig
from fewclip.backbones.backbone import BackboneConfig, load_backbone
from fewclip.cli.main import main
from fewclip.features.encode import Features, text_prototypes
from fewclip.training.engine import CachedFeatures, TrainConfig, train_loop
from helpers.cards import CARD_GEOMETRIES, CLASSNAMES, SHAPES, image_features, tiny_model_config, write_card
from helpers.checkpoints import CLASSNAMES as HF_CLASSNAMES

TOY = ["toy-clip", "toy-euclip", "toy-meru", "toy-siglip"]  # clip, euclidean_sq, hyperbolic, sigmoid
SIGLIP_TEXT = "siglip-text"  # bidirectional attention, pooled at the last position, BPE tokenizer
HF = "hf-siglip"  # the same with a Hugging Face tokenizer that has no start token
EVERY = TOY + list(CARD_GEOMETRIES) + [SIGLIP_TEXT, HF]
TEMPLATE = "a photo of a {}."
METHODS = ["cocoop", "kgcoop", "prograd", "tcp"]


@pytest.fixture(scope="module")
def backbones(tmp_path_factory):
    """name -> loader of a backbone (loaded once): the four toy backbones, tiny random cards of the other
    geometries and SigLIP-style towers, all with 2 text blocks (TCP injects at block 1)."""
    folder = tmp_path_factory.mktemp("textprompt_cards")
    cards = {g: write_card(folder, f"tiny2-{g}", tiny_model_config(layers=2), geom)
             for g, geom in CARD_GEOMETRIES.items()}
    cards[SIGLIP_TEXT] = write_card(
        folder, "tiny2-siglip-text", tiny_model_config(custom_text=True, no_causal_mask=True, pool_type="last",
                                                       layers=2),
        {"name": "sigmoid", "logit_scale": 10.0, "logit_bias": -5.0})
    loaded = {}

    def get(name):
        if name not in loaded:
            if name == HF:
                loaded[name] = hf_backbone(tmp_path_factory)
            else:
                loaded[name] = load_backbone(BackboneConfig(name=cards.get(name, name), device="cpu"))
        return loaded[name]

    return get


def hf_backbone(tmp_path_factory):
    """test_import_tokenizers' SigLIP-style card (Hugging Face tokenizer: no start token, "</s>" at the end,
    "<pad>" padding), with 2 text blocks."""
    import copy

    from omegaconf import OmegaConf
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from fewclip.backbones.backbone import build_open_clip_model

    vocab = {w: i for i, w in enumerate(hf.SPECIAL + hf.WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok_dir = tmp_path_factory.mktemp("hf2_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(tok_dir))
    cfg = hf.model_config()
    cfg["text_cfg"]["layers"] = 2
    folder = tmp_path_factory.mktemp("hf2_card")
    torch.manual_seed(0)
    model = build_open_clip_model(copy.deepcopy(cfg))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "w.safetensors"))
    card = {"name": "tiny2-hf-siglip", "model_config": cfg, "weights": "w.safetensors",
            "tokenizer": {"type": "open_clip"},
            "geometry": {"name": "sigmoid", "logit_scale": float(model.logit_scale.detach().exp()), "logit_bias": -5.0}}
    (folder / "card.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(card)))
    return load_backbone(BackboneConfig(name=str(folder), tokenizer=str(tok_dir), device="cpu"))


def classes_for(name):
    return SHAPES if name.startswith("toy-") else HF_CLASSNAMES if name == HF else CLASSNAMES


def zero_shot(bb, classnames, feats, template=TEMPLATE):
    return bb.geometry.image_logits(feats, text_prototypes(bb, classnames, [template]))


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def modes(adapter):
    """The text modes this adapter can run in (all give the same logits)."""
    out = []
    for mode in ("shared", "truncate", "faithful"):
        try:
            adapter.set_text_mode(mode)
            out.append(mode)
        except ValueError:
            pass
    return out


def nudge(adapter, scale=0.05, seed=3):
    """Move every trainable tensor off its start, so that comparisons are not made at a special point."""
    g = gen(seed)
    with torch.no_grad():
        for p in adapter.trainable_parameters():
            p += scale * p.abs().mean().clamp_min(0.1) * torch.randn(p.shape, generator=g)


# ---------------------------------------------------------------- CoCoOp: zero meta-net output + words = zero-shot


@pytest.mark.parametrize("position", ["end", "middle", "front"])
@pytest.mark.parametrize("name", EVERY)
def test_cocoop_with_a_zero_meta_net_and_word_init_is_zero_shot(backbones, name, position):
    bb = backbones(name)
    classnames = classes_for(name)
    ad = CoCoOp(CoCoOpConfig(meta_init="zero", class_token_position=position), bb, classnames, [TEMPLATE],
                generator=gen())
    template = ad.equivalent_template()
    assert template is not None
    feats = image_features(bb, n=3)
    with torch.no_grad():
        assert ad.meta_net(torch.randn(2, feats.shape[1])).abs().max() == 0
        expected = zero_shot(bb, classnames, feats, template)
        for mode in modes(ad):
            torch.testing.assert_close(ad(feats), expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{mode}: {m}")
    default = CoCoOp(CoCoOpConfig(class_token_position=position), bb, classnames, [TEMPLATE], generator=gen())
    with torch.no_grad():  # the authors' default init shifts the context: not zero-shot
        assert not torch.allclose(default(feats), expected, atol=1e-3)


@pytest.mark.parametrize("csc", [False, True], ids=["unified", "csc"])
@pytest.mark.parametrize("position", ["end", "middle", "front"])
@pytest.mark.parametrize("name", ["toy-clip", "hyperbolic_sq", SIGLIP_TEXT, HF])
def test_cocoop_text_paths_agree(backbones, name, position, csc):
    """Per image: the shared prefix with packed rows (several rows here), every prompt cut to the longest, and
    the authors' full-length procedure give the same logits, and the same gradients."""
    bb = backbones(name)
    classnames = classes_for(name)
    ad = CoCoOp(CoCoOpConfig(ctx_init=None, n_ctx=3, csc=csc, class_token_position=position, init_std=0.5),
                bb, classnames, generator=gen(1)).set_row_tokens(4)
    nudge(ad)
    feats = image_features(bb, n=3)
    labels = torch.arange(3) % len(classnames)
    available = modes(ad)
    causal = name in ("toy-clip", "hyperbolic_sq")
    assert ("shared" in available) == (causal and not csc and position != "front")
    results = {}
    for mode in available:
        ad.set_text_mode(mode)
        ad.zero_grad()
        logits = ad(feats)
        F.cross_entropy(logits, labels).backward()
        results[mode] = (logits.detach(), [p.grad.clone() for p in ad.trainable_parameters()])
    ref_logits, ref_grads = results["faithful"]
    for mode, (logits, grads) in results.items():
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=2e-5, msg=lambda m: f"{mode}: {m}")
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=lambda m: f"{mode} gradient: {m}")
    if "shared" in available:
        assert ad._rows_pos.shape[0] > 1  # several rows of packed suffixes


def test_cocoop_meta_net_input_and_shape():
    bb = load_backbone(BackboneConfig(name="toy-meru", device="cpu"))
    ad = CoCoOp(CoCoOpConfig(), bb, SHAPES, generator=gen())
    D, W = 64, bb.model.token_embedding.weight.shape[1]
    assert ad.meta_net.linear1.weight.shape == (D // 16, D) and ad.meta_net.linear2.weight.shape == (W, D // 16)
    assert {n for n, p in ad.named_parameters() if p.requires_grad} == {
        "ctx", "meta_net.linear1.weight", "meta_net.linear1.bias", "meta_net.linear2.weight", "meta_net.linear2.bias"}
    with pytest.raises(AdapterError, match="depend on the image"):
        ad.prototypes()
    # the same generator gives the same adapter; the global RNG is neither used nor moved
    state = torch.random.get_rng_state()
    again = CoCoOp(CoCoOpConfig(), bb, SHAPES, generator=gen())
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(ad.state_dict().values(), again.state_dict().values()))


def test_default_linear_is_pytorchs_init_law():
    layer = default_linear(256, 3000, gen())
    bound = 1 / 16
    assert layer.weight.abs().max() <= bound and layer.weight.abs().max() > 0.99 * bound
    assert abs(layer.weight.std().item() - bound / 3 ** 0.5) < 2e-3  # uniform on [-b, b]
    assert layer.bias.abs().max() <= bound and torch.equal(default_linear(256, 3000, gen()).weight, layer.weight)
    zero = default_linear(4, 5, gen(), zero=True)
    assert zero.weight.abs().sum() == 0 and zero.bias.abs().sum() == 0


# ---------------------------------------------------------------- KgCoOp and ProGrad: CoOp when the term is off


def one_step(adapter, feats, labels, **train):
    cfg = TrainConfig(**{"batch_size": len(labels), "iterations": 1, "warmup_epochs": 0, "lr": 0.05, **train})
    info = train_loop(adapter, CachedFeatures([Features(feats, labels)], Features.empty(feats.shape[1])), cfg, 1,
                      gen(5))
    return info, {n: p.detach().clone() for n, p in adapter.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name", EVERY)
def test_kgcoop_and_prograd_with_the_term_off_are_coop(backbones, name):
    bb = backbones(name)
    classnames = classes_for(name)
    feats = image_features(bb, n=4)
    labels = torch.arange(4) % len(classnames)
    coop = CoOp(CoOpConfig(ctx_init="a photo of a"), bb, classnames)
    nudge(coop)
    coop_ctx = coop.ctx.detach().clone()
    with torch.no_grad():
        coop_logits = coop(feats)
    _, coop_after = one_step(coop, feats, labels)
    for other in (KgCoOp(KgCoOpConfig(weight=0.0), bb, classnames, [TEMPLATE]),
                  ProGrad(ProGradConfig(n_ctx=4, lam=0.0), bb, classnames, [TEMPLATE])):
        nudge(other)
        assert torch.equal(other.ctx, coop_ctx)  # the same start, the same nudge
        with torch.no_grad():
            torch.testing.assert_close(other(feats), coop_logits, rtol=0, atol=1e-6)
        info, after = one_step(other, feats, labels)
        assert "loss_terms" not in info
        torch.testing.assert_close(after["ctx"], coop_after["ctx"], rtol=0, atol=1e-7,
                                   msg=lambda m: f"{other.name}: {m}")
    # with the term on, KgCoOp's step differs (ProGrad's only where the two gradients conflict: tested by hand below)
    for other in (KgCoOp(KgCoOpConfig(), bb, classnames, ["a {} in a picture."]),
                  ProGrad(ProGradConfig(n_ctx=4), bb, classnames, ["a {} in a picture."])):
        nudge(other)
        info, after = one_step(other, feats, labels)
        assert set(info["loss_terms"]) == ({"ce", "kg"} if other.name == "kgcoop" else {"kl"})
        if other.name == "kgcoop":
            assert not torch.allclose(after["ctx"], coop_after["ctx"], atol=1e-6)


@pytest.mark.parametrize("name", EVERY)
def test_kgcoop_and_prograd_start_at_zero_shot_from_the_teachers_words(backbones, name):
    """KgCoOp's and ProGrad's (4-vector) context from "a photo of a" with the template "a photo of a {}." is the
    zero-shot classifier: logits equal, KgCoOp's penalty 0, ProGrad's distillation gradient nil."""
    bb = backbones(name)
    classnames = classes_for(name)
    feats = image_features(bb, n=3)
    labels = torch.arange(3) % len(classnames)
    expected = zero_shot(bb, classnames, feats)
    for ad in (KgCoOp(KgCoOpConfig(), bb, classnames, [TEMPLATE]),
               ProGrad(ProGradConfig(n_ctx=4), bb, classnames, [TEMPLATE])):
        with torch.no_grad():
            torch.testing.assert_close(ad(feats), expected, rtol=1e-5, atol=1e-5)
        terms = ad.training_loss(feats, labels)
        if ad.name == "kgcoop":
            assert abs(terms["kg"].item()) < 1e-6
        else:  # the student is the teacher: the distillation loss is its entropy, with no gradient
            entropy = (-F.softmax(expected, 1) * F.log_softmax(expected, 1)).sum(1).mean()
            torch.testing.assert_close(terms["kl"], entropy)
            b, = torch.autograd.grad(terms["kl"], ad.ctx, retain_graph=True)
            a, = torch.autograd.grad(terms["loss"], ad.ctx)
            assert b.norm() < 1e-4 * a.norm()
    # ProGrad's own layout: more vectors than words (16 by default; 8 fit the tiny towers' 16 tokens), the words
    # in the last 4 and zeros before them; not zero-shot
    assert ProGradConfig().n_ctx == 16
    pg = ProGrad(ProGradConfig(n_ctx=8), bb, classnames, [TEMPLATE])
    words = CoOp(CoOpConfig(ctx_init="a photo of a"), bb, classnames).ctx
    assert pg.ctx.shape[0] == 8 and pg.ctx[:4].abs().sum() == 0 and torch.equal(pg.ctx[4:], words)
    assert pg.equivalent_template() is None
    with torch.no_grad():
        assert not torch.allclose(pg(feats), expected, atol=1e-3)


@pytest.mark.parametrize("name", ["toy-clip", "toy-euclip", "toy-meru", "toy-siglip"])
def test_the_teacher_distance_in_each_geometry(backbones, name):
    """On the sphere it is 1 - mean cos (the authors' term); everywhere it is 0 at the teacher, positive away."""
    bb = backbones(name)
    g = bb.geometry
    teacher = text_prototypes(bb, SHAPES, [TEMPLATE])
    other = text_prototypes(bb, SHAPES, ["a {} shape."])
    assert distance_to_teacher(g, teacher, teacher).item() == 0
    d = distance_to_teacher(g, other, teacher)
    assert d > 0
    if g.name in ("clip", "sigmoid"):
        cos = F.cosine_similarity(other, teacher, dim=1)
        torch.testing.assert_close(d, 1 - cos.mean())


def test_prograd_projection_by_hand(backbones):
    """Where the cross-entropy's gradient a conflicts with the distillation gradient b, the step uses
    a - lam (a.b/|b|^2) b: with lam 1 orthogonal to b; where they agree, a itself."""
    bb = backbones("toy-clip")
    feats = image_features(bb, n=8)
    seen = {"conflict": False, "agree": False}
    teacher_says = zero_shot(bb, SHAPES, feats, "a {} in a picture.").argmax(1)
    for seed in range(6):  # random labels (conflicting with the teacher), then the teacher's own (agreeing)
        ad = ProGrad(ProGradConfig(n_ctx=4), bb, SHAPES, ["a {} in a picture."])
        nudge(ad, seed=seed)
        labels = torch.randint(0, len(SHAPES), (8,), generator=gen(seed)) if seed < 3 else teacher_says
        terms = ad.training_loss(feats, labels)
        a, = torch.autograd.grad(terms["loss"], ad.ctx, retain_graph=True)
        b, = torch.autograd.grad(terms["kl"], ad.ctx, retain_graph=True)
        ad.ctx.grad = None
        ad.backward(terms)
        applied = ad.ctx.grad
        if (a * b).sum() < 0:
            seen["conflict"] = True
            assert abs((applied * b).sum()) < 1e-6 * a.norm() * b.norm()
            torch.testing.assert_close(applied, a - (a * b).sum() / (b * b).sum() * b)
        else:
            seen["agree"] = True
            torch.testing.assert_close(applied, a)
    assert all(seen.values()), seen


def test_prograd_context_longer_than_n_ctx_is_refused(backbones):
    with pytest.raises(AdapterError, match="raise adapter.n_ctx"):
        ProGrad(ProGradConfig(n_ctx=2), backbones("toy-clip"), SHAPES, [TEMPLATE])


# ---------------------------------------------------------------- TCP


@pytest.mark.parametrize("name", EVERY)
def test_tcp_start_and_its_injection(backbones, name):
    """TCP's start is not zero-shot: from the injection block the context positions hold the meta-network's
    class tokens. Without them (class_weight 0) and from the template's words it is zero-shot exactly; the
    class tokens change the logits, and every trainable tensor gets a gradient."""
    bb = backbones(name)
    classnames = classes_for(name)
    feats = image_features(bb, n=3)
    expected = zero_shot(bb, classnames, feats)
    plain = TCP(TCPConfig(ctx_init="a photo of a", class_weight=0.0), bb, classnames, [TEMPLATE], generator=gen())
    assert plain.equivalent_template() == TEMPLATE
    with torch.no_grad():
        torch.testing.assert_close(plain(feats), expected, rtol=1e-5, atol=1e-5)
    ad = TCP(TCPConfig(ctx_init="a photo of a"), bb, classnames, [TEMPLATE], generator=gen())
    depth = len(ad.tower.transformer.resblocks)  # 3 in the toy backbones, 2 in the cards
    assert ad.inject_layer == 2 * depth // 3  # two thirds, rounded down (8 of 12 for ViT-B/16)
    with torch.no_grad():
        reference = ad.set_text_mode("faithful")(feats)
        assert not torch.allclose(reference, expected, atol=1e-3)
        available = modes(ad)
        assert available == ["truncate", "faithful"]  # the class tokens differ per class: no shared prefix
        for mode in available:
            torch.testing.assert_close(ad.set_text_mode(mode)(feats), reference, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{mode}: {m}")
    default = TCP(TCPConfig(), bb, classnames, [TEMPLATE], generator=gen())
    terms = default.training_loss(feats, torch.arange(3) % len(classnames))
    terms["loss"].backward()
    assert terms["kg"] > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in default.trainable_parameters())


def test_tcp_keeps_the_templates_words_after_the_name():
    bb = load_backbone(BackboneConfig(name="toy-clip", device="cpu"))
    template = "a {} shape in the image."
    ad = TCP(TCPConfig(ctx_init="a", n_ctx=1, class_weight=0.0), bb, SHAPES, [template])
    assert ad.prompt_suffix() == " shape in the image."
    assert ad.equivalent_template() == template
    feats = image_features(bb)
    with torch.no_grad():
        torch.testing.assert_close(ad(feats), zero_shot(bb, SHAPES, feats, template), rtol=1e-5, atol=1e-5)
    with pytest.raises(AdapterError, match="templates"):
        TCP(TCPConfig(), bb, SHAPES, [])
    with pytest.raises(AdapterError, match="inject_layer=3"):
        TCP(TCPConfig(inject_layer=3), bb, SHAPES, [template])


# ---------------------------------------------------------------- new class names


@pytest.mark.parametrize("method", METHODS)
def test_new_class_names_reuse_what_was_learned(backbones, method):
    bb = backbones("toy-clip")
    base, new = SHAPES[:4], SHAPES[4:]
    info = ADAPTERS[method]
    assert info.adapter_cls.supports_new_classes
    ad = build_adapter(info.config_cls(), bb, base, [TEMPLATE], generator=gen())
    nudge(ad)
    assert ad.for_classnames(base, [TEMPLATE]) is ad
    moved = ad.for_classnames(new, [TEMPLATE])
    assert moved.classnames == new and not moved.training
    fresh = build_adapter(info.config_cls(), bb, new, [TEMPLATE], generator=gen(7))
    fresh.load_adapter_state_dict(ad.adapter_state_dict())
    feats = image_features(bb, n=4)
    with torch.no_grad():
        out = moved(feats)
        assert out.shape == (4, len(new))
        torch.testing.assert_close(out, fresh(feats))
        assert not torch.allclose(out, build_adapter(info.config_cls(), bb, new, [TEMPLATE], generator=gen(7))(feats))
    csc = build_adapter(info.config_cls(csc=True), bb, base, [TEMPLATE])
    with pytest.raises(AdapterError, match="adapter.csc=false"):
        csc.for_classnames(new, [TEMPLATE])


# ---------------------------------------------------------------- the command line


def test_packed_rows_by_hand():
    tokens = [[9, 1, 7, 5], [9, 1, 8, 8, 5], [9, 1, 6, 5]]  # prefix of 2; suffixes of 2, 3 and 2 tokens
    cls, *_ = packed_suffix_rows(tokens, 2, row_tokens=100)
    assert cls.tolist() == [[0, 0, 1, 1, 1, 2, 2]]  # one row: packed_suffixes' packing, no padding
    # rows of about 4: 7 tokens make 2 rows; 4 slots per row would need 3 (a suffix never straddles two rows),
    # so the two rows are 5 long
    cls, pos, mask, pool = packed_suffix_rows(tokens, 2, row_tokens=4)
    assert cls.tolist() == [[0, 0, 1, 1, 1], [2, 2, -1, -1, -1]]
    assert pos.tolist() == [[2, 3, 2, 3, 4], [2, 3, 0, 0, 0]]
    assert pool.tolist() == [1, 4, 6]  # flat index of each prompt's last token
    assert mask.shape == (2, 5, 7)
    assert mask[1, 1].tolist() == [1, 1, 1, 1, 0, 0, 0]  # prefix, then itself and its own earlier token
    assert mask[1, 3].tolist() == [0, 0, 0, 0, 0, 1, 0]  # padding sees only itself
    cls, *_ = packed_suffix_rows(tokens, 2, row_tokens=1)  # rows grow to the longest suffix
    assert cls.shape == (3, 3)


@pytest.mark.parametrize("method", METHODS)
def test_train_through_the_command_line(method, tmp_path, capsys):
    out = tmp_path / method
    args = ["train", f"adapter={method}", "data=toy-shapes", "shots=1", "seed=1", "train.epochs=2",
            "data.max_test=24", "data.templates=single", "backbone.device=cpu", f"out={out}"]
    assert main(args) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["adapter"] == method and m["epochs"] == 2 and m["n_test"] == 24
    defaults = ADAPTERS[method].adapter_cls.train_defaults
    cfg = (out / "config.yaml").read_text()
    for key, value in defaults.items():
        if key != "epochs":
            assert f"{key}: {value}" in cfg, key
    if method in ("kgcoop", "tcp"):
        assert set(m["loss_terms"]) == {"ce", "kg"}
    if method == "prograd":
        assert set(m["loss_terms"]) == {"kl"}
    capsys.readouterr()
    assert main(["adapters"]) == 0
    listed = capsys.readouterr().out
    assert f"{method}: " in listed


def test_sweep_and_report(tmp_path, capsys):
    spec = tmp_path / "textprompts.yaml"
    spec.write_text("""sweep:
  backbones: [toy-clip]
  datasets: [toy-shapes]
  methods: [zeroshot, cocoop, kgcoop, prograd, tcp]
  shots: [1]
  seeds: [1]
  args: [train.epochs=1, data.max_test=24, data.templates=single, backbone.device=cpu]
""")
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), f"out={out}"]) == 0
    assert "sweep: 5 runs, 0 already done, 5 ran" in capsys.readouterr().out
    assert main(["report", str(out)]) == 0
    report = capsys.readouterr().out
    for method in METHODS:
        assert method in report
        assert (out / "toy-clip" / "toy-shapes" / method / "1shot" / "seed1" / "metrics.json").is_file()


def test_adam_adds_weight_decay_to_the_gradient():
    """train.optimizer=adam is Adam with L2 weight decay (Dassl's, TCP's); adamw decouples it."""
    from fewclip.training.engine import make_optimizer

    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = make_optimizer([p], TrainConfig(optimizer="adam", lr=0.1, eps=1e-3, weight_decay=0.5))
    assert type(opt) is torch.optim.Adam and opt.defaults["eps"] == 1e-3
    p.grad = torch.tensor([0.2, 0.0])
    opt.step()
    g = torch.tensor([0.2, 0.0]) + 0.5 * torch.tensor([1.0, -2.0])  # the first step: lr * g / (|g| + eps)
    torch.testing.assert_close(p.detach(), torch.tensor([1.0, -2.0]) - 0.1 * g / (g.abs() + 1e-3))
    with pytest.raises(ValueError, match="train.optimizer"):
        TrainConfig(optimizer="lion")
