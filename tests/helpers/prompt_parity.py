"""fewclip's text-prompt methods against the numbers their authors' code computed (tests/fixtures/prompt_ref).

Each ``check_<method>`` rebuilds one fixture with fewclip on the same tiny CLIP (``tiny_clip.py``, loaded in
float32 exactly), the same images, class names and parameters, and returns ``(what, fewclip, authors)``
pairs: logits, text features, losses, gradients after one step, and parameters after the optimiser's first
step. The step goes through the engine's own loop (``train_loop`` for one iteration: the adapter's
``training_loss`` and ``backward``, its ``train_defaults`` optimiser, the warm-up lr 1e-5 of the first
step), so the training path is pinned, not a re-derivation of it. Used by ``tests/parity/test_prompt_parity.py``
(every pair to 1e-4) and ``scripts/prompt_parity.py`` (the largest difference per fixture).
"""
from __future__ import annotations

import json
import math

import open_clip
import torch
from open_clip.model import build_model_from_openai_state_dict
from safetensors.torch import load_file

from fewclip.adapters.cocoop import CoCoOp, CoCoOpConfig
from fewclip.adapters.coop import CoOp, CoOpConfig
from fewclip.adapters.kgcoop import KgCoOp, KgCoOpConfig
from fewclip.adapters.prograd import ProGrad, ProGradConfig
from fewclip.adapters.tcp import TCP, TCPConfig
from fewclip.adapters.zeroshot import ZeroShot, ZeroShotConfig
from fewclip.backbones.backbone import Backbone
from fewclip.backbones.geometry import make_geometry
from fewclip.features.encode import Features
from fewclip.training.engine import CachedFeatures, TrainConfig, train_loop
from helpers.parity import FIXTURE_ROOT
from helpers.tiny_clip import state_sha256, tiny_images, tiny_openai_state_dict

FIXTURES = FIXTURE_ROOT / "prompt_ref"
TOLERANCE = 1e-4
Check = tuple[str, torch.Tensor, torch.Tensor]
COOP_FIXTURES = ["coop_unified", "coop_csc", "coop_middle", "coop_front", "coop_word"]
ALL_FIXTURES = ["zeroshot", *COOP_FIXTURES, "cocoop", "kgcoop", "kgcoop_pets", "prograd", "prograd_nctx4", "tcp",
                "tcp_pets"]


def load(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    meta = json.loads((FIXTURES / f"{name}.json").read_text())
    return load_file(str(FIXTURES / f"{name}.safetensors")), meta


def tiny_backbone() -> Backbone:
    """The fixtures' tiny CLIP in open_clip, with its float32 weights exactly (open_clip's builder rounds
    them to fp16 first: load them again after ``.float()``)."""
    sd = tiny_openai_state_dict(0)
    want = load("zeroshot")[1]["state_sha256"]
    assert state_sha256(sd) == want, "the tiny CLIP's generator changed: the fixtures no longer describe it"
    model = build_model_from_openai_state_dict({k: v.clone() for k, v in sd.items()}, cast_dtype=None)
    model.float()
    model.load_state_dict(sd)
    model.eval()
    geometry = make_geometry("clip", logit_scale=float(model.logit_scale.detach().exp()))
    return Backbone(model, open_clip.get_tokenizer("ViT-B-32"), geometry, name="tiny-openai", image_size=32,
                    mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))


def features(bb: Backbone) -> torch.Tensor:
    return bb.encode_images(tiny_images(n=4, seed=1))  # raw [4, 64]


def one_step(adapter, feats: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """One iteration of the engine's loop at the warm-up lr (the authors' first step); returns each trainable
    parameter's gradient (after the adapter's ``backward``) and value after the step, by name."""
    cfg = TrainConfig(**{**adapter.train_defaults, "batch_size": len(labels), "iterations": 1})
    train_loop(adapter, CachedFeatures([Features(feats, labels)], Features.empty(feats.shape[1])), cfg, 16,
               torch.Generator().manual_seed(0))
    out = {}
    for name, p in adapter.named_parameters():
        if p.requires_grad:
            out[f"grad.{name}"] = p.grad.detach().clone()
            out[f"after_step.{name}"] = p.detach().clone()
    return out


def set_params(adapter, tensors: dict[str, torch.Tensor], prefix: str = "init.") -> None:
    with torch.no_grad():
        for name, p in adapter.named_parameters():
            if prefix + name in tensors:
                p.copy_(tensors[prefix + name])


def token_checks(adapter, t: dict[str, torch.Tensor]) -> list[Check]:
    """The prompt token ids outside the context slots (whose embeddings are replaced) equal the authors', in
    order (their ids keep the "end" order for every layout; the context is placed in the embeddings), and the
    pooled end-of-text token sits where theirs does."""
    C, L = adapter.tokens.shape
    n = adapter.ctx_pos.shape[1]
    theirs = t["tokenized_prompts"]
    ours_kept = torch.ones(C, L, dtype=torch.bool).scatter_(1, adapter.ctx_pos.cpu(), False)
    start = len(adapter.tower.prompt_ends().start)
    their_kept = torch.ones_like(theirs, dtype=torch.bool)
    their_kept[:, start : start + n] = False
    ours = adapter.tokens.cpu()[ours_kept].reshape(C, -1)
    theirs_rest = theirs[their_kept].reshape(C, -1)
    return [("tokens outside the context", ours.float(), theirs_rest[:, : ours.shape[1]].float()),
            ("padding after the cut", theirs_rest[:, ours.shape[1]:].float(),
             torch.zeros_like(theirs_rest[:, ours.shape[1]:]).float()),
            ("end-of-text position", adapter.tokens.cpu().argmax(-1).float(), theirs.argmax(-1).float())]


def logits_in_every_mode(adapter, feats, want, modes=("shared", "truncate", "faithful")) -> list[Check]:
    out = []
    for mode in modes:
        try:
            adapter.set_text_mode(mode)
        except ValueError:  # no prefix shared by all classes (class-specific, front, TCP)
            continue
        with torch.no_grad():
            out.append((f"logits ({mode})", adapter(feats), want))
    adapter.set_text_mode("truncate")
    return out


def check_zeroshot(bb) -> list[Check]:
    t, m = load("zeroshot")
    feats, out = features(bb), []
    for ds, template in m["templates"].items():
        zs = ZeroShot(ZeroShotConfig(), bb, m["classnames"], [template])
        out.append((f"{ds} text features", zs.prototypes, t[f"{ds}.text_features_normalized"]))
        out.append((f"{ds} logits", zs(feats), t[f"{ds}.logits"]))
    return out


def check_coop(bb, name: str) -> list[Check]:
    t, m = load(name)
    feats, labels = features(bb), torch.tensor(m["labels"])
    ad = CoOp(CoOpConfig(n_ctx=m["n_ctx"], ctx_init=m["ctx_init_words"], csc=m["csc"],
                         class_token_position=m["class_token_position"]), bb, m["classnames"])
    out = token_checks(ad, t)
    if m["ctx_init_words"]:
        out.append(("ctx init", ad.ctx.detach().clone(), t["ctx_init"]))
        with torch.no_grad():
            out.append(("logits at init", ad(feats), t["logits_at_init"]))
    set_params(ad, {"ctx": t["ctx"]}, prefix="")
    out += logits_in_every_mode(ad, feats, t["logits_eval"])
    with torch.no_grad():
        out.append(("text features", ad.text_features(), t["text_features"]))
        out.append(("loss", ad.training_loss(feats, labels)["loss"].reshape(1), t["loss"]))
    step = one_step(ad, feats, labels)
    out.append(("grad ctx", step["grad.ctx"], t["grad.ctx"]))
    out.append(("ctx after step", step["after_step.ctx"], t["ctx_after_step"]))
    return out


def check_cocoop(bb) -> list[Check]:
    t, m = load("cocoop")
    feats, labels = features(bb), torch.tensor(m["labels"])
    g = bb.geometry
    ad = CoCoOp(CoCoOpConfig(), bb, m["classnames"])
    out = token_checks(ad, t) + [("ctx init", ad.ctx.detach().clone(), t["ctx_init"])]
    set_params(ad, t)
    with torch.no_grad():
        out.append(("logits at init", ad(feats), t["logits_at_init"]))
    zero = CoCoOp(CoCoOpConfig(meta_init="zero"), bb, m["classnames"])
    set_params(zero, {k: v for k, v in t.items() if "linear1" in k})
    with torch.no_grad():
        out.append(("logits at init, meta-net output 0", zero(feats), t["logits_at_init_zero_metanet"]))
    set_params(ad, {"ctx": t["ctx"]}, prefix="")
    with torch.no_grad():
        img = g.to_linear(g.embed_image(feats))
        bias = ad.meta_net(img)
        out += [("image features (meta-net input)", img, t["image_features"]),
                ("meta-net output", bias, t["meta_net_bias"])]
        for mode in ("shared", "truncate", "faithful"):
            ad.set_text_mode(mode)
            out.append((f"text features per image ({mode})", ad.image_text_features(bias), t["text_features"]))
    out += logits_in_every_mode(ad, feats, t["logits_eval"])
    with torch.no_grad():
        out.append(("loss", ad.training_loss(feats, labels)["loss"].reshape(1), t["loss"]))
    ad.set_text_mode("shared")  # the CPU default
    step = one_step(ad, feats, labels)
    for key in [k for k in t if k.startswith(("grad.", "after_step."))]:
        out.append((key, step[key], t[key]))
    return out


def check_kgcoop(bb, name: str) -> list[Check]:
    t, m = load(name)
    feats, labels = features(bb), torch.tensor(m["labels"])
    ad = KgCoOp(KgCoOpConfig(weight=m["W"]), bb, m["classnames"], [m["teacher_template"]])
    out = token_checks(ad, t) + [("ctx init", ad.ctx.detach().clone(), t["ctx_init"]),
                                 ("teacher text features", ad.teacher, t["teacher_text_features"])]
    with torch.no_grad():
        out.append(("logits at init", ad(feats), t["logits_at_init"]))
        out.append(("penalty at init", ad.training_loss(feats, labels)["kg"].reshape(1), t["score_at_init"]))
    set_params(ad, {"ctx": t["ctx"]}, prefix="")
    out += logits_in_every_mode(ad, feats, t["logits_eval"])
    with torch.no_grad():
        out.append(("text features", ad.text_features(), t["text_features"]))
        terms = ad.training_loss(feats, labels)
        out += [("ce", terms["ce"].reshape(1), t["ce"]), ("penalty (1 - mean cos)", terms["kg"].reshape(1), t["score"]),
                ("loss", terms["loss"].reshape(1), t["loss"])]
    step = one_step(ad, feats, labels)
    out.append(("grad ctx", step["grad.ctx"], t["grad.ctx"]))
    out.append(("ctx after step", step["after_step.ctx"], t["ctx_after_step"]))
    return out


def check_prograd(bb, name: str) -> list[Check]:
    t, m = load(name)
    feats = features(bb)
    g = bb.geometry

    def build(lam: float) -> ProGrad:
        ad = ProGrad(ProGradConfig(n_ctx=m["n_ctx"], lam=lam, temperature=m["T"]), bb, m["classnames"],
                     [m["teacher_template"]])
        return ad

    ad = build(m["lambda_"])
    out = token_checks(ad, t) + [("ctx init", ad.ctx.detach().clone(), t["ctx_init"])]
    with torch.no_grad():
        out.append(("zero-shot logits (teacher)", g.image_logits(feats, ad.teacher), t["zs_logits"]))
        out.append(("logits at init", ad(feats), t["logits_at_init"]))
    set_params(ad, {"ctx": t["ctx"]}, prefix="")
    out += logits_in_every_mode(ad, feats, t["logits_eval"])
    for case in m["cases"]:
        labels = t[f"{case}.labels"]
        terms = ad.training_loss(feats, labels)
        g_xe, = torch.autograd.grad(terms["loss"], ad.ctx, retain_graph=True)
        g_kl, = torch.autograd.grad(terms["kl"], ad.ctx)
        out += [(f"{case}: xe", terms["loss"].detach().reshape(1), t[f"{case}.xe"]),
                (f"{case}: kl", terms["kl"].detach().reshape(1), t[f"{case}.kl"]),
                (f"{case}: grad xe", g_xe, t[f"{case}.grad_xe"]), (f"{case}: grad kl", g_kl, t[f"{case}.grad_kl"])]
        for lam, key in [(1.0, "grad_applied"), (0.8, "grad_applied_lambda0.8")]:
            other = build(lam)
            set_params(other, {"ctx": t["ctx"]}, prefix="")
            step = one_step(other, feats, labels)
            out.append((f"{case}: applied gradient, lambda {lam}", step["grad.ctx"], t[f"{case}.{key}"]))
            if lam == 1.0:
                out.append((f"{case}: ctx after step", step["after_step.ctx"], t[f"{case}.ctx_after_step"]))
    return out


def check_tcp(bb, name: str) -> list[Check]:
    t, m = load(name)
    feats, labels = features(bb), torch.tensor(m["labels"])
    ad = TCP(TCPConfig(), bb, m["classnames"], [m["teacher_template"]])
    assert ad.inject_layer == m["inject_before_text_block"]
    set_params(ad, t)
    set_params(ad, {"ctx": t["ctx"]}, prefix="")
    out = token_checks(ad, t) + [("teacher text features", ad.teacher, t["teacher_text_features"])]
    seen = {}

    def capture(i, h):
        if i == ad.inject_layer:
            seen["h"] = h[:, :8].clone()
        return h

    with torch.no_grad():
        out.append(("class-aware tokens", ad.class_tokens(), t["class_feature"]))
        x = ad.prompt_embeddings()
        out.append(("prompt embeddings, positions 0-7", x[:, :8], t["prompts_first8"]))
        ad.tower.forward(x, ad.tokens, before_block=capture)
        out.append(("hidden state entering the injection block", seen["h"], t["block_input_before_injection_first8"]))
        out.append(("text features", ad.text_features(), t["text_features"]))
    out += logits_in_every_mode(ad, feats, t["logits_eval"])
    with torch.no_grad():
        terms = ad.training_loss(feats, labels)
        out += [("ce", terms["ce"].reshape(1), t["ce"]), ("penalty (1 - mean cos)", terms["kg"].reshape(1), t["score"]),
                ("loss", terms["loss"].reshape(1), t["loss"])]
    step = one_step(ad, feats, labels)
    for key in [k for k in t if k.startswith(("grad.", "after_step."))]:
        out.append((key, step[key], t[key]))
    return out


def checks(bb, name: str) -> list[Check]:
    if name == "zeroshot":
        return check_zeroshot(bb)
    if name.startswith("coop_"):
        return check_coop(bb, name)
    if name == "cocoop":
        return check_cocoop(bb)
    if name.startswith("kgcoop"):
        return check_kgcoop(bb, name)
    if name.startswith("prograd"):
        return check_prograd(bb, name)
    if name.startswith("tcp"):
        return check_tcp(bb, name)
    raise KeyError(name)


def max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} against the authors' {tuple(want.shape)}"
    d = (got - want).abs().max().item() if got.numel() else 0.0
    return d if math.isfinite(d) else float("inf")
