"""IVLP, MaPLe and PromptSRC against their authors' code on the same tiny CLIP (tests/fixtures/deep_ref,
README there): logits, the loss and one step's gradients, PromptSRC's teacher, loss terms and a 4-epoch run
with Gaussian prompt aggregation. The largest differences are printed by
``python -m pytest -q tests/parity/test_deep_parity.py -s``."""

import open_clip
import pytest
import torch
import torch.nn.functional as F
from open_clip.model import build_model_from_openai_state_dict

from fewclip.adapters.ivlp import IVLP, IVLPConfig
from fewclip.adapters.maple import MaPLe, MaPLeConfig
from fewclip.adapters.promptsrc import PromptSRC, PromptSRCConfig
from fewclip.backbones.backbone import OPENAI_EXTRA_KEYS, Backbone
from fewclip.backbones.geometry import make_geometry
from helpers.parity import FIXTURE_ROOT, Parity, fixture_loader
from helpers.tiny_clip import state_sha256, tiny_images, tiny_openai_state_dict

FIXTURES = FIXTURE_ROOT / "deep_ref"
TOL = 2e-5  # observed on the 2-core CPU: at most 4.4e-6 (the aggregated logits); the issue asks for 1e-4
CLASSNAMES = ["dog", "cat", "sports car", "golden retriever", "airplane"]
LABELS = torch.tensor([0, 1, 2, 3, 4, 1])
PARITY = Parity(TOL)
check = PARITY.check


fixture = fixture_loader(FIXTURES)



@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    PARITY.print_worst()


@pytest.fixture(scope="module")
def tiny():
    """The tiny OpenAI-layout CLIP as a fewclip backbone, in exact float32 (open_clip's builder rounds the
    weights to fp16 before loading them: build, cast to fp32, load again)."""
    sd = tiny_openai_state_dict(0)
    model = build_model_from_openai_state_dict(dict(sd)).float().eval()
    model.load_state_dict({k: v for k, v in sd.items() if k not in OPENAI_EXTRA_KEYS})
    scale = float(model.logit_scale.detach().exp())
    bb = Backbone(model, open_clip.get_tokenizer("ViT-B-32"), make_geometry("clip", logit_scale=scale),
                  name="tiny-openai", image_size=32, mean=(0, 0, 0), std=(1, 1, 1))
    return bb, state_sha256(sd)


@pytest.fixture(scope="module")
def images():
    return tiny_images(n=6, seed=1)


def set_values(param, values):
    with torch.no_grad():
        for i, v in enumerate(values):
            param[i] = v


def ivlp_params(adapter, ref, prefix):
    """Fixture names (the authors' parameter names) of each of our prompt layers."""
    text = ["prompt_learner.ctx"] + [f"text_encoder.transformer.resblocks.{i}.VPT_shallow"
                                     for i in range(1, adapter.depth_text)]
    vision = (["image_encoder.VPT"] + [f"image_encoder.transformer.resblocks.{i}.VPT_shallow"
                                       for i in range(1, adapter.depth_vision)]) if adapter.depth_vision else []
    set_values(adapter.text_prompts, [ref[f"{prefix}/value/{n}"] for n in text])
    if vision:
        set_values(adapter.vision_prompts, [ref[f"{prefix}/value/{n}"] for n in vision])
    return text, vision


# ---------------------------------------------------------------- IVLP


IVLP_CASES = {  # case: (n vision, n text, depth vision, depth text)
    "v4t4_d2": (4, 4, 2, 2), "v4t4_d1": (4, 4, 1, 1), "v4t4_dv2_dt1": (4, 4, 2, 1), "v2t2_d2": (2, 2, 2, 2),
    "v0t4_dv0_dt1": (0, 4, 0, 1),
}


def test_weights_and_plain_towers(tiny, images):
    bb, sha = tiny
    ref, meta = fixture("ivlp")
    assert sha == meta["state_sha256"], "tests/helpers/tiny_clip.py no longer gives the fixtures' weights"
    with torch.no_grad():
        check("plain image features", bb.encode_images(images), ref["plain/image_features"])
        check("plain text features", bb.encode_text([f"a photo of a {c}." for c in CLASSNAMES]),
              ref["plain/text_features"])


@pytest.mark.parametrize("mode", ["shared", "truncate", "faithful"])
@pytest.mark.parametrize("case", list(IVLP_CASES))
def test_ivlp(case, mode, tiny, images):
    bb, _ = tiny
    ref, meta = fixture("ivlp")
    nv, nt, dv, dt = IVLP_CASES[case]
    a = IVLP(IVLPConfig(n_ctx_text=nt, n_ctx_vision=max(nv, 1), depth_text=dt, depth_vision=dv), bb, CLASSNAMES)
    assert (a.depth_text, a.depth_vision) == (dt, dv)
    want_ids = [p["ids_head"] for p in meta["cases"][case]["tokenized_prompts"]]
    assert [row[: len(ids)] for row, ids in zip(a.tokens.tolist(), want_ids)] == want_ids
    text, vision = ivlp_params(a, ref, case)
    a.set_text_mode(mode)
    logits = a(a.encode_images(images))
    check(f"ivlp {case} {mode} logits", logits, ref[f"{case}/logits_eval"])
    loss = F.cross_entropy(logits, LABELS)
    assert float(loss.detach()) == pytest.approx(meta["cases"][case]["loss_ce"], abs=TOL)
    loss.backward()
    for i, n in enumerate(text):
        check(f"ivlp {case} {mode} grad {n}", a.text_prompts.grad[i], ref[f"{case}/grad/{n}"])
    for i, n in enumerate(vision):
        check(f"ivlp {case} {mode} grad {n}", a.vision_prompts.grad[i], ref[f"{case}/grad/{n}"])


def test_ivlp_init_is_the_words(tiny):
    bb, _ = tiny
    a = IVLP(IVLPConfig(), bb, CLASSNAMES)
    ids = open_clip.get_tokenizer("ViT-B-32")(["a photo of a"])[0, 1:5]
    assert torch.equal(a.text_prompts[0].detach(), bb.model.token_embedding.weight[ids])


# ---------------------------------------------------------------- MaPLe


@pytest.mark.parametrize("mode", ["shared", "truncate"])
@pytest.mark.parametrize("case, depth", [("d2", 2), ("d1", 1)])
def test_maple(case, depth, mode, tiny, images):
    bb, _ = tiny
    ref, meta = fixture("maple")
    a = MaPLe(MaPLeConfig(depth=depth), bb, CLASSNAMES)
    want_ids = [p["ids_head"] for p in meta["cases"][case]["tokenized_prompts"]]
    assert [row[: len(ids)] for row, ids in zip(a.tokens.tolist(), want_ids)] == want_ids  # "of a" stays fixed
    text = ["prompt_learner.ctx"] + [f"prompt_learner.compound_prompts_text.{k}" for k in range(depth - 1)]
    proj = ["prompt_learner.proj"] + [f"prompt_learner.compound_prompt_projections.{k}" for k in range(depth - 1)]
    set_values(a.text_prompts, [ref[f"value/{n}"] for n in text])
    set_values(a.coupling_weight, [ref[f"value/{n}.weight"] for n in proj])
    set_values(a.coupling_bias, [ref[f"value/{n}.bias"] for n in proj])
    with torch.no_grad():
        check(f"maple {case} vision prompt 0", a.vision_prompt_layers()[0], ref[f"{case}/visual_shallow_prompt"])
        if depth == 2:
            check(f"maple {case} vision prompt 1", a.vision_prompt_layers()[1], ref["d2/visual_deep_prompt.0"])
    a.set_text_mode(mode)
    logits = a(a.encode_images(images))
    check(f"maple {case} {mode} logits", logits, ref[f"{case}/logits_eval"])
    loss = F.cross_entropy(logits, LABELS)
    assert float(loss.detach()) == pytest.approx(meta["cases"][case]["loss_ce"], abs=TOL)
    loss.backward()
    for i, n in enumerate(text):
        check(f"maple {case} {mode} grad {n}", a.text_prompts.grad[i], ref[f"{case}/grad/{n}"])
    for i, n in enumerate(proj):
        check(f"maple {case} {mode} grad {n}.weight", a.coupling_weight.grad[i], ref[f"{case}/grad/{n}.weight"])
        check(f"maple {case} {mode} grad {n}.bias", a.coupling_bias.grad[i], ref[f"{case}/grad/{n}.bias"])


def test_maple_init_matches_theirs(tiny):
    """Their depth-3 build on the 2-layer model: layer 0's coupling has its own init, the deep ones are
    identical copies (tests/test_deep.py checks that on a 4-layer tower), ctx = "a photo". They create 2
    compound prompts of which the 2 layers use 1; fewclip creates the one that is used."""
    bb, _ = tiny
    _, meta = fixture("maple")
    init = meta["init_depth3"]
    a = MaPLe(MaPLeConfig(depth=3), bb, CLASSNAMES)
    w = a.coupling_weight.detach()
    assert init["compound_projections_identical_at_init"] and init["n_compound_prompts_text"] == 2
    assert a.text_prompts.shape[0] == w.shape[0] == 2 == len(bb.model.transformer.resblocks)
    assert not init["shallow_proj_equals_compound_proj0_at_init"] and not torch.equal(w[0], w[1])
    assert float(w.abs().max()) <= init["proj_weight_absmax_vs_kaiming_bound_1/sqrt(128)"][1]
    ids = open_clip.get_tokenizer("ViT-B-32")(["a photo"])[0, 1:3]
    assert torch.equal(a.text_prompts[0].detach(), bb.model.token_embedding.weight[ids])


# ---------------------------------------------------------------- PromptSRC


@pytest.mark.parametrize("case, depth", [("d2", 2), ("d1", 1)])
def test_promptsrc(case, depth, tiny, images):
    bb, _ = tiny
    ref, meta = fixture("promptsrc")
    assert meta["n_templates"] == 60
    a = PromptSRC(PromptSRCConfig(depth_text=depth, depth_vision=depth), bb, CLASSNAMES)
    assert len(a.teacher_template_list) == 60
    text, vision = ivlp_params(a, ref, case)
    with torch.no_grad():
        check(f"promptsrc {case} text teacher", a.teacher_text_points(),
              F.normalize(ref[f"{case}/teacher_text_features_unnormalised_mean"], dim=-1))
        frozen = bb.encode_images(images)
        check(f"promptsrc {case} frozen image", F.normalize(frozen, dim=-1),
              ref[f"{case}/zero_shot_image_features_normalised"])
        zs = bb.geometry.logits(F.normalize(frozen, dim=-1), a.teacher_text_points())
        check(f"promptsrc {case} zero-shot logits", zs, ref[f"{case}/zero_shot_logits"])
    feats = a.encode_images(images)
    check(f"promptsrc {case} image features", F.normalize(feats, dim=-1), ref[f"{case}/image_features_normalised"])
    check(f"promptsrc {case} text features", a.prototypes(), ref[f"{case}/text_features_normalised"])
    check(f"promptsrc {case} logits", a(feats), ref[f"{case}/logits_eval"])
    terms = a.training_loss(feats, LABELS, frozen=frozen)
    losses = meta["cases"][case]["losses"]
    want = {"ce": losses["ce"], "l1_text": losses["l1_text_raw"], "l1_image": losses["l1_image_raw"],
            "kl": losses["kl_per_element (kl_sum / (batch*n_cls))"],
            "loss": losses["total_from_their_forward_backward"]}
    for k, v in want.items():
        assert float(terms[k].detach()) == pytest.approx(v, abs=TOL), k
    terms["loss"].backward()
    for i, n in enumerate(text):
        check(f"promptsrc {case} grad {n}", a.text_prompts.grad[i], ref[f"{case}/grad/total/{n}"])
    for i, n in enumerate(vision):
        check(f"promptsrc {case} grad {n}", a.vision_prompts.grad[i], ref[f"{case}/grad/total/{n}"])


def test_promptsrc_training_with_aggregation(tiny, images):
    """Their trainer for 4 epochs of 2 batches (SGD momentum 0.9, weight decay 5e-4, the per-epoch learning
    rates their scheduler gave), GPA mean 3 std 1: the prompts after every epoch, the aggregate and its
    logits."""
    bb, _ = tiny
    ref, meta = fixture("promptsrc")
    sim = meta["gpa_simulation"]
    a = PromptSRC(PromptSRCConfig(depth_text=2, depth_vision=2, gpa_mean=sim["cfg"]["GPA_MEAN"],
                                  gpa_std=sim["cfg"]["GPA_STD"]), bb, CLASSNAMES)
    text, vision = ivlp_params(a, ref, "d2")
    opt = torch.optim.SGD(a.trainable_parameters(), lr=1.0, momentum=0.9, weight_decay=5e-4)
    epochs = sim["cfg"]["MAX_EPOCH"]
    losses = []
    a.train()
    for epoch, lr in enumerate(sim["lr_per_epoch_observed"]):
        for g in opt.param_groups:
            g["lr"] = lr
        for batch in (slice(0, 3), slice(3, 6)):
            x, y = images[batch], LABELS[batch]
            terms = a.training_loss(a.encode_images(x), y, frozen=bb.encode_images(x))
            opt.zero_grad()
            a.backward(terms)
            opt.step()
            losses.append(float(terms["loss"].detach()))
        for i, n in enumerate(text):
            check(f"promptsrc epoch {epoch + 1} {n}", a.text_prompts[i], ref[f"gpa/epoch{epoch + 1}/{n}"])
        for i, n in enumerate(vision):
            check(f"promptsrc epoch {epoch + 1} {n}", a.vision_prompts[i], ref[f"gpa/epoch{epoch + 1}/{n}"])
        a.on_epoch_end(epoch, epochs)
    assert losses == pytest.approx(sim["loss_per_step"], abs=TOL)
    a.eval()
    for i, n in enumerate(text):
        check(f"promptsrc aggregated {n}", a.text_prompts[i], ref[f"gpa/aggregated/{n}"])
    for i, n in enumerate(vision):
        check(f"promptsrc aggregated {n}", a.vision_prompts[i], ref[f"gpa/aggregated/{n}"])
    with torch.no_grad():
        check("promptsrc aggregated logits", a(a.encode_images(images)), ref["gpa/logits_eval_aggregated"])
