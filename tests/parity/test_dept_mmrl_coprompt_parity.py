"""DePT, MMRL and CoPrompt against their authors' code on the tiny CLIP of tests/helpers/tiny_clip.py
(tests/fixtures/tower2_ref, README there): logits, each loss term, one step's gradients of every learnable
tensor and the parameters after it. The largest differences are printed by
``python -m pytest -q tests/parity/test_dept_mmrl_coprompt_parity.py -s``."""
import json

import pytest
import torch

from fewclip.adapters.coprompt import CoPrompt, CoPromptConfig
from fewclip.adapters.dept import DePT, DePTConfig
from fewclip.adapters.mmrl import MMRL, MMRLConfig
from fewclip.backbones.backbone import Backbone
from fewclip.backbones.geometry import make_geometry
from helpers.parity import FIXTURE_ROOT, Parity, fixture_loader
from helpers.tiny_clip import tiny_images
from helpers.towers import one_step, tiny  # noqa: F401

F = torch.nn.functional

FIXTURES = FIXTURE_ROOT / "tower2_ref"
TOL = 1e-4  # the tolerance after a training step; the largest differences seen are printed
PARITY = Parity(TOL)
check = PARITY.check
ILL_CONDITIONED = 1e-6  # |gradient| below which Adam's first step (eps 1e-8) amplifies rounding (test_mmrl)


fixture = fixture_loader(FIXTURES)



@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    PARITY.print_worst()




@pytest.fixture(scope="module")
def images():
    return tiny_images(n=6, seed=1)




# ---------------------------------------------------------------- DePT

DEPT_NAMES = {"learner.ctx": "prompt_learner.ctx", "head.weight": "linear_probe_proj.weight",
              "head.bias": "linear_probe_proj.bias", "cwt_image.scale": "film_lp_img.scale",
              "cwt_image.shift": "film_lp_img.bias", "cwt_text.scale": "film_lp_text.scale",
              "cwt_text.shift": "film_lp_text.bias"}


def test_dept(tiny, images):
    bb, sha = tiny
    ref, meta = fixture("dept")
    assert sha == meta["state_sha256"], "tests/helpers/tiny_clip.py no longer gives the fixtures' weights"
    a = DePT(DePTConfig(n_ctx=meta["n_ctx"]), bb, meta["classnames"])
    params = dict(a.named_parameters())
    assert sorted(DEPT_NAMES[n] for n in params) == meta["learnable"]
    with torch.no_grad():
        for n, theirs in DEPT_NAMES.items():
            params[n].copy_(ref[f"value/{theirs}"])
    labels = torch.tensor(meta["labels"])
    feats = a.encode_images(images)
    with torch.no_grad():
        check("dept image features", feats, ref["image_features"])
        check("dept text features", a.learner.text_features(), ref["text_features"])
        check("dept similarity logits", a.similarity_logits(feats, a.learner.text_features()),
              ref["logits_similarity"])
        check("dept logits (fused, base classes)", a(feats), ref["logits_eval"])
        new = a.for_classnames(meta["new_classnames"], [])
        assert not new.has_head and not any(n.startswith(("head", "cwt")) for n in new.state_dict())
        check("dept logits (new classes)", new(feats), ref["new/logits_eval"])
    a.train()
    terms, grads = one_step(a, feats, labels, meta["lr"])
    assert float(terms["ce"]) == pytest.approx(meta["loss_terms"]["ce"], abs=TOL)
    assert float(terms["ce_head"]) == pytest.approx(meta["loss_terms"]["ce_head"], abs=TOL)
    assert float(terms["loss"].detach()) == pytest.approx(meta["loss"], abs=TOL)
    for n, theirs in DEPT_NAMES.items():
        check(f"dept grad {n}", grads[n], ref[f"grad/{theirs}"])
        check(f"dept after step {n}", params[n], ref[f"after/{theirs}"])



def test_dept_on_maple(tiny, images):
    """Their ExtrasLinearProbeMaPLe at PROMPT_DEPTH 2 (MaPLe's widths 768/512 replaced by the tiny model's 128):
    the same head on MaPLe's prompts, both towers prompted."""
    bb, sha = tiny
    ref, meta = fixture("dept_maple")
    assert sha == meta["state_sha256"]
    a = DePT(DePTConfig(learner="maple", n_ctx=2, ctx_init="a photo of a", depth=meta["depth"]), bb, meta["classnames"])
    names = {(n, None): t for n, t in DEPT_NAMES.items() if n != "learner.ctx"}
    names.update({("learner.text_prompts", 0): "prompt_learner.ctx",
                  ("learner.text_prompts", 1): "prompt_learner.compound_prompts_text.0",
                  ("learner.coupling_weight", 0): "prompt_learner.proj.weight",
                  ("learner.coupling_bias", 0): "prompt_learner.proj.bias",
                  ("learner.coupling_weight", 1): "prompt_learner.compound_prompt_projections.0.weight",
                  ("learner.coupling_bias", 1): "prompt_learner.compound_prompt_projections.0.bias"})
    assert sorted(names.values()) == meta["learnable"]
    params = dict(a.named_parameters())

    def ours(key, table=params):
        name, k = key
        return table[name] if k is None else table[name][k]

    with torch.no_grad():
        for key, theirs in names.items():
            ours(key).copy_(ref[f"value/{theirs}"])
        f = a.encode_images(images)
        check("dept maple logits (fused, base classes)", a(f), ref["logits_eval"])
        new = a.for_classnames(meta["new_classnames"], [])
        check("dept maple logits (new classes)", new(new.encode_images(images)), ref["new/logits_eval"])
    a.train()
    f = a.encode_images(images)
    terms, grads = one_step(a, f, torch.tensor(meta["labels"]), meta["lr"])
    assert float(terms["ce"]) == pytest.approx(meta["loss_terms"]["ce"], abs=TOL)
    assert float(terms["ce_head"]) == pytest.approx(meta["loss_terms"]["ce_head"], abs=TOL)
    assert float(terms["loss"].detach()) == pytest.approx(meta["loss"], abs=TOL)
    for key, theirs in names.items():
        check(f"dept maple grad {theirs}", ours(key, grads), ref[f"grad/{theirs}"])
        check(f"dept maple after step {theirs}", ours(key), ref[f"after/{theirs}"])


# ---------------------------------------------------------------- MMRL


def mmrl_names(case_layers):
    learner = "representation_learner."
    names = {"rep_tokens": [learner + "compound_rep_tokens"], "proj_rep": ["image_encoder.proj_rep"]}
    for ours, theirs in (("to_vision", "r2vproj"), ("to_text", "r2tproj")):
        for part in ("weight", "bias"):
            names[f"{ours}_{part}"] = [f"{learner}compound_rep_tokens_{theirs}.{k}.{part}" for k in range(case_layers)]
    return names


@pytest.mark.parametrize("case, depth", [("l2", 1), ("l12", 2)])
def test_mmrl(case, depth, tiny, images):
    """Their REP_LAYERS [2] and [1, 2] of the 2-layer towers are fewclip's rep_depth 1 and 2; their logits use
    a hard-coded scale of 100, so the backbone here does too."""
    bb0, sha = tiny
    ref, meta = fixture("mmrl")
    assert sha == meta["state_sha256"]
    bb = Backbone(bb0.model, bb0.tokenizer, make_geometry("clip", logit_scale=meta["logit_scale"]),
                  name="tiny-openai", image_size=32, mean=(0, 0, 0), std=(1, 1, 1))
    c = meta["cases"][case]
    rep_dim = ref[f"{case}/value/representation_learner.compound_rep_tokens"].shape[1]  # their 512 -> 32 here
    a = MMRL(MMRLConfig(rep_depth=depth, rep_dim=rep_dim), bb, meta["classnames"], [meta["template"]])
    names = mmrl_names(depth)
    params = dict(a.named_parameters())
    assert sorted(n for ns in names.values() for n in ns) == c["learnable"]
    with torch.no_grad():
        for ours, theirs in names.items():
            for k, n in enumerate(theirs):
                if params[ours].dim() > 2 or ours.endswith("bias"):
                    params[ours][k] = ref[f"{case}/value/{n}"]
                else:
                    params[ours].copy_(ref[f"{case}/value/{n}"])
    labels = torch.tensor(meta["labels"])
    with torch.no_grad():
        frozen = bb.encode_images(images)
        check(f"mmrl {case} frozen image", torch.nn.functional.normalize(frozen, dim=-1),
              ref[f"{case}/image_features_clip"])
        check(f"mmrl {case} text teacher", a.teacher_text_points(), ref[f"{case}/text_features_clip"])
        a.eval()
        f = a.encode_images(images)
        D = f.shape[1] // 2
        check(f"mmrl {case} image features", torch.nn.functional.normalize(f[:, :D], dim=-1),
              ref[f"{case}/image_features"])
        check(f"mmrl {case} text features", a.prototypes(), ref[f"{case}/text_features"])
        logits, logits_rep, _ = a._logits(f)
        check(f"mmrl {case} logits", logits, ref[f"{case}/logits_eval"])
        check(f"mmrl {case} representation logits", logits_rep, ref[f"{case}/logits_rep_eval"])
        check(f"mmrl {case} fused logits (trained classes)", a(f), ref[f"{case}/logits_fusion_eval"])
        new = a.for_classnames(meta["new_classnames"], [meta["template"]])
        assert not new.fused
        check(f"mmrl {case} logits (new classes)", new(new.encode_images(images)), ref[f"{case}/new/logits_eval"])
    a.train()
    f = a.encode_images(images)
    terms, grads = one_step(a, f, labels, meta["lr"], optimizer="adamw", frozen=frozen)
    for k, v in c["loss_terms"].items():
        assert float(terms[k]) == pytest.approx(v, abs=TOL), k
    assert float(terms["loss"].detach()) == pytest.approx(c["loss"], abs=TOL)
    for ours, theirs in names.items():
        for k, n in enumerate(theirs):
            got_g = grads[ours][k] if len(theirs) > 1 or ours.startswith("to_") else grads[ours]
            got_p = params[ours][k] if len(theirs) > 1 or ours.startswith("to_") else params[ours]
            check(f"mmrl {case} grad {n}", got_g, ref[f"{case}/grad/{n}"])
            # AdamW's first step moves each element by lr * g / (|g| + 1e-8): where |g| is near eps (1 element of
            # 65,536 here, |g| = 1e-10) the step is ill-conditioned in g, so those are held to a move of at most lr
            well = ref[f"{case}/grad/{n}"].abs() > ILL_CONDITIONED
            check(f"mmrl {case} after step {n}", got_p[well], ref[f"{case}/after/{n}"][well])
            moved = (got_p.detach() - ref[f"{case}/value/{n}"]).abs()
            assert float(torch.cat([moved[~well], torch.zeros(1)]).max()) <= meta["lr"] * 1.01


# ---------------------------------------------------------------- CoPrompt


def coprompt_names(depth):
    names = {("text_prompts", 0): "prompt_learner.ctx", ("coupling_weight", 0): "prompt_learner.proj.weight",
             ("coupling_bias", 0): "prompt_learner.proj.bias", ("adapter_image.down", None): "adapter_image.fc.0.weight",
             ("adapter_image.up", None): "adapter_image.fc.2.weight", ("adapter_text.down", None): "adapter_text.fc.0.weight",
             ("adapter_text.up", None): "adapter_text.fc.2.weight"}
    for k in range(depth - 1):
        names[("text_prompts", k + 1)] = f"prompt_learner.compound_prompts_text.{k}"
        names[("coupling_weight", k + 1)] = f"prompt_learner.compound_prompt_projections.{k}.weight"
        names[("coupling_bias", k + 1)] = f"prompt_learner.compound_prompt_projections.{k}.bias"
    return names


@pytest.mark.parametrize("case, depth", [("d2", 2), ("d1", 1)])
def test_coprompt(case, depth, tiny, images, tmp_path):
    """Their trainer with PROMPT_DEPTH 2 and 1 on the tiny towers (widths 768/512 replaced by 128/64 when their
    module was loaded), a descriptions file of three sentences per class, the second view of their step given
    to fewclip as the frozen features, and the description their random.randint drew."""
    bb, sha = tiny
    ref, meta = fixture("coprompt")
    assert sha == meta["state_sha256"]
    c = meta["cases"][case]
    path = tmp_path / "descriptions.json"
    path.write_text(json.dumps(meta["descriptions"]))
    a = CoPrompt(CoPromptConfig(depth=depth, descriptions=str(path)), bb, meta["classnames"], [])
    names = coprompt_names(depth)
    assert sorted(names.values()) == c["learnable"]
    params = dict(a.named_parameters())

    def ours(key):
        name, k = key
        return params[name] if k is None else params[name][k]

    with torch.no_grad():
        for key, theirs in names.items():
            ours(key).copy_(ref[f"{case}/value/{theirs}"])
    labels = torch.tensor(meta["labels"])
    with torch.no_grad():
        check(f"coprompt {case} description features", a.description_points(),
              F.normalize(ref[f"{case}/description_features"], dim=-1))
        f = a.encode_images(images)
        check(f"coprompt {case} logits", a(f), ref[f"{case}/logits_eval"])
        new = a.for_classnames(meta["new_classnames"], [])
        check(f"coprompt {case} logits (new classes)", new(new.encode_images(images)), ref[f"{case}/new/logits_eval"])
        frozen = bb.encode_images(tiny_images(n=6, seed=2))  # their second view
        check(f"coprompt {case} frozen image", F.normalize(frozen, dim=-1), ref[f"{case}/frozen_image2_normalised"])
    a.train()
    f = a.encode_images(images)
    terms, grads = one_step(a, f, labels, meta["lr"], frozen=frozen, description=c["description_index"])
    for k, v in c["loss_terms"].items():
        assert float(terms[k]) == pytest.approx(v, abs=TOL), k
    assert float(terms["loss"].detach()) == pytest.approx(c["loss"], abs=TOL)
    for key, theirs in names.items():
        name, k = key
        g = grads[name] if k is None else grads[name][k]
        check(f"coprompt {case} grad {theirs}", g, ref[f"{case}/grad/{theirs}"])
        check(f"coprompt {case} after step {theirs}", ours(key), ref[f"{case}/after/{theirs}"])
