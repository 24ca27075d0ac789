"""CLIP-SVD against its authors' code on the tiny CLIP of tests/helpers/tiny_clip.py (tests/fixtures/tower_ref,
README there): logits before and after one AdamW step, the cross-entropy loss, every singular-value
gradient and the singular values after the step. The largest differences are printed by
``python -m pytest -q tests/parity/test_clip_svd_2sfs_parity.py -s``."""
import json

import open_clip
import pytest
import torch
from open_clip.model import build_model_from_openai_state_dict
from safetensors.torch import load_file

from fewclip.adapters.clip_svd import ClipSVD, ClipSVDConfig
from fewclip.backbones.backbone import OPENAI_EXTRA_KEYS, Backbone
from fewclip.backbones.geometry import make_geometry
from fewclip.training.engine import TrainConfig, make_optimizer
from helpers.parity import FIXTURE_ROOT, Parity
from helpers.tiny_clip import state_sha256, tiny_images, tiny_openai_state_dict

FIXTURES = FIXTURE_ROOT / "tower_ref"
TOL = 1e-4  # the tolerance after a training step
PARITY = Parity(TOL)
check = PARITY.check



@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    PARITY.print_worst()


@pytest.fixture(scope="module")
def tiny():
    """The tiny OpenAI-layout CLIP as a fewclip backbone in exact float32 (as tests/parity/test_deep_parity.py)."""
    sd = tiny_openai_state_dict(0)
    model = build_model_from_openai_state_dict(dict(sd)).float().eval()
    model.load_state_dict({k: v for k, v in sd.items() if k not in OPENAI_EXTRA_KEYS})
    scale = float(model.logit_scale.detach().exp())
    bb = Backbone(model, open_clip.get_tokenizer("ViT-B-32"), make_geometry("clip", logit_scale=scale),
                  name="tiny-openai", image_size=32, mean=(0, 0, 0), std=(1, 1, 1))
    return bb, state_sha256(sd)


def their_name(ours: str) -> str:
    """Our SVD module key (``visual__transformer__resblocks__0__attn__out_proj``) -> their parameter name."""
    return ours.replace("__", ".").replace("attn.out_proj", "attn.proj") + ".vector_S"


@pytest.mark.parametrize("case", ["init", "perturbed", "text_only"])
def test_clip_svd_matches_the_authors_step(tiny, case):
    bb, sha = tiny
    ref = load_file(str(FIXTURES / "clip_svd.safetensors"))
    meta = json.loads((FIXTURES / "clip_svd.json").read_text())
    assert meta["state_sha256"] == sha, "tests/helpers/tiny_clip.py no longer builds the fixtures' model"
    c = meta["cases"][case]
    ad = ClipSVD(ClipSVDConfig(towers="text" if c["text_only"] else "both"), bb, meta["classes"], [meta["template"]])
    names = {k: their_name(k) for k in ad.svd}
    assert sorted(names.values()) == sorted(c["trainable"])  # the same matrices are learned
    with torch.no_grad():
        for k, layer in ad.svd.items():
            # their SVD is torch.svd of the same weight: the same singular values at the start
            check(f"clip_svd {case} initial singular values {k}", layer.s, ref[f"{case}/s_init/{names[k]}"]
                  if case == "init" else layer.s, 1e-5)
            layer.s.copy_(ref[f"{case}/s_init/{names[k]}"])
    images, labels = tiny_images(n=6, seed=1), torch.tensor(meta["labels"])
    if case == "init":
        with torch.no_grad():
            check(f"clip_svd {case} zero-shot logits", ad(ad.encode_images(images)), torch.tensor(c["zs_logits"]))
    ad.train()
    logits = ad(ad.encode_images(images))
    check(f"clip_svd {case} logits", logits, torch.tensor(c["logits"]))
    terms = ad.training_loss(ad.encode_images(images), labels)
    check(f"clip_svd {case} loss (cross-entropy)", terms["loss"], c["loss_ce"])
    cfg = TrainConfig(**{k: v for k, v in ClipSVD.train_defaults.items() if k != "iterations_per_shot"})
    assert (cfg.lr, cfg.weight_decay) == (c["lr"], c["weight_decay"])
    opt = make_optimizer(ad.trainable_parameters(), cfg)
    opt.zero_grad()
    ad.backward(terms)
    for k, layer in ad.svd.items():
        check(f"clip_svd {case} gradient {k}", layer.s.grad, ref[f"{case}/grad/{names[k]}"])
    opt.step()
    for k, layer in ad.svd.items():
        check(f"clip_svd {case} after the step {k}", layer.s, ref[f"{case}/after/{names[k]}"])
    ad.eval()
    with torch.no_grad():
        check(f"clip_svd {case} logits after the step", ad(ad.encode_images(images)), torch.tensor(c["logits_after"]))


@pytest.mark.parametrize("case", ["init", "perturbed", "vision"])
def test_2sfs_matches_the_authors_two_stages(tiny, case):
    """One step of each stage (their n_iters=2, shots=1, n_iters_frac=0.6: stage 1 = int(1.2) = 1 step), driven
    as the engine's loop drives it: learning_rate(step) (which switches the stage), loss, backward, AdamW step."""
    from fewclip.adapters.twosfs import TwoSFS, TwoSFSConfig

    bb, sha = tiny
    ref = load_file(str(FIXTURES / "twosfs.safetensors"))
    meta = json.loads((FIXTURES / "twosfs.json").read_text())
    assert meta["state_sha256"] == sha, "tests/helpers/tiny_clip.py no longer builds the fixtures' model"
    c = meta["cases"][case]
    ad = TwoSFS(TwoSFSConfig(towers=c["modality"], stage1_fraction=c["n_iters_frac"]), bb, meta["classes"],
                [meta["template"]])
    params = {f"{k.replace('__', '.')}.{n}": p for k, m in ad.ln.items() for n, p in m.named_parameters()}
    assert sorted(params) == sorted(c["stage1_trainable"])  # the same LayerNorms are tuned
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(ref[f"{case}/init/{n}"])
    images, labels = tiny_images(n=6, seed=1), torch.tensor(meta["labels"])
    if case == "init":
        with torch.no_grad():
            check(f"2sfs {case} zero-shot logits", ad(ad.encode_images(images)), torch.tensor(c["zs_logits"]))
    cfg = TrainConfig(**{k: v for k, v in TwoSFS.train_defaults.items() if k != "iterations_per_shot"})
    assert (cfg.lr, cfg.weight_decay) == (c["lr"], c["weight_decay"])
    total = c["n_iters"] * c["shots"]
    opt = make_optimizer(ad.trainable_parameters(), cfg)
    ad.train()

    def step(i):
        lr = ad.learning_rate(i, total, cfg.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        terms = ad.training_loss(ad.encode_images(images), labels)
        opt.zero_grad(set_to_none=True)
        ad.backward(terms)
        return lr, terms

    # stage 1: the LayerNorms
    with torch.no_grad():
        check(f"2sfs {case} stage-1 logits", ad(ad.encode_images(images)), torch.tensor(c["stage1_logits"]))
    lr, terms = step(0)
    assert int(ad.stage) == 1 and lr == cfg.lr
    check(f"2sfs {case} stage-1 loss (cross-entropy)", terms["loss"], c["stage1_loss_ce"])
    assert ad.classifier.grad is None
    for n, p in params.items():
        check(f"2sfs {case} stage-1 gradient {n}", p.grad, ref[f"{case}/stage1_grad/{n}"])
    opt.step()
    for n, p in params.items():
        check(f"2sfs {case} stage-1 after the step {n}", p, ref[f"{case}/stage1_after/{n}"])
    stage1 = {n: p.detach().clone() for n, p in params.items()}
    # stage 2: the classifier, from the stage-1 towers' text features
    lr, terms = step(1)
    assert int(ad.stage) == 2 and abs(lr - c["stage2_lr"]) < 1e-12
    check(f"2sfs {case} stage-2 initial classifier", ad.classifier, ref[f"{case}/stage2_init/classifier"])
    check(f"2sfs {case} stage-2 loss (cross-entropy)", terms["loss"], c["stage2_loss_ce"])
    assert all(p.grad is None for p in params.values())
    check(f"2sfs {case} stage-2 gradient classifier", ad.classifier.grad, ref[f"{case}/stage2_grad/classifier"])
    opt.step()
    check(f"2sfs {case} stage-2 after the step classifier", ad.classifier, ref[f"{case}/stage2_after/classifier"])
    assert all(torch.equal(p, stage1[n]) for n, p in params.items())  # stage 2 leaves the LayerNorms alone
    ad.eval()
    with torch.no_grad():
        check(f"2sfs {case} final logits", ad(ad.encode_images(images)), torch.tensor(c["final_logits"]))
        mixed = ad.for_classnames(c["mixed_names"], [meta["template"]])
        check(f"2sfs {case} base-to-new logits (learned rows and text features)", mixed(mixed.encode_images(images)),
              torch.tensor(c["mixed_logits"]))
