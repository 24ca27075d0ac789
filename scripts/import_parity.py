"""Largest zero-shot logit difference between fewclip and the authors' own code, per checkpoint format.

    python scripts/import_parity.py

Builds the tiny checkpoints of ``tests/checkpoint_layouts.py`` in each author's file layout
(MERU/HyCoCLIP, the EuCLIP fork, OpenAI's TorchScript archive and state dict, open_clip_train),
imports each with ``fewclip import``'s library function, computes fewclip's zero-shot logits on
the fixture images and prompts, and prints the largest absolute difference from the logits the
authors' code computed on the same files (``tests/fixtures/import_*.json``, which name the
repository and commit), with the logit range and whether the rankings are identical. The
open_clip format is compared with open_clip itself, run here.

Then, per image preprocessing (each resize mode, bilinear, a padding colour), an open_clip
checkpoint imported with that preprocessing against open_clip's own ``image_transform`` and
model on the same images (pixels and logits), and what fewclip computed before it read the
preprocessing (always the shorter side, bicubic). Runs on the CPU in about a minute.
"""
from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

from fewclip.backbones.importer import import_checkpoint  # noqa: E402
from fewclip.features.encode import text_prototypes  # noqa: E402
from helpers.checkpoints import (  # noqa: E402
    CLASSNAMES,
    MERU_IMPORT_OPTIONS,
    TEMPLATES,
    euclip_model_config,
    meru_checkpoint,
    open_clip_train_checkpoint,
    openai_archive,
    tiny_euclip_state_dict,
    tiny_images,
    tiny_meru_state_dict,
    tiny_openai_fp16,
)


def zeroshot(bb) -> torch.Tensor:
    pre = bb.preprocess()
    pixels = torch.stack([pre(im) for im in tiny_images()])
    return bb.geometry.image_logits(bb.encode_images(pixels), text_prototypes(bb, CLASSNAMES, TEMPLATES))


def fixture(name: str) -> dict:
    return json.loads((TESTS / "fixtures" / f"import_{name}.json").read_text())


def main() -> None:
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="fewclip-parity-"))
    rows = []

    def compare(fmt, what, bb, reference, authors):
        ref = torch.tensor(reference, dtype=torch.float32)
        logits = zeroshot(bb)
        rows.append((fmt, what, float((logits - ref).abs().max()), float(ref.min()), float(ref.max()),
                     bool(torch.equal(logits.argsort(1), ref.argsort(1))), authors))

    for authors in ("meru", "hycoclip"):
        fx = fixture(authors)
        for variant, hyperbolic in (("hyperbolic", True), ("clip_baseline", False)):
            path = work / f"{authors}-{variant}.pth"
            torch.save(meru_checkpoint(tiny_meru_state_dict(0, hyperbolic=hyperbolic)), path)
            _, bb = import_checkpoint(authors, path, work / f"{authors}-{variant}", MERU_IMPORT_OPTIONS)
            compare(authors, variant, bb, fx["variants"][variant]["logits"], f"{fx['repository']}@{fx['commit'][:7]}")
    fx = fixture("euclip")
    (work / "euclip.json").write_text(json.dumps(euclip_model_config()))
    for geometry, ref in fx["geometries"].items():
        path = work / f"euclip-{geometry}.pt"
        torch.save(open_clip_train_checkpoint(tiny_euclip_state_dict(geometry)), path)
        _, bb = import_checkpoint("euclip", path, work / f"euclip-{geometry}",
                                  {"geometry": ref["fork_name"], "model_config": str(work / "euclip.json")})
        compare("euclip", ref["fork_name"], bb, ref["logits"], f"{fx['repository']}@{fx['commit'][:7]}")
    fx = fixture("openai")
    openai_archive(work / "openai.pt")
    torch.save(dict(tiny_openai_fp16(0)), work / "openai-sd.pt")
    for what, path in (("TorchScript archive", work / "openai.pt"), ("state dict", work / "openai-sd.pt")):
        _, bb = import_checkpoint("openai", path, work / f"openai-{path.stem}")
        compare("openai", what, bb, fx["logits"], f"{fx['repository']}@{fx['commit'][:7]}")
    rows.append(open_clip_row(work))
    rows += resize_rows(work)

    print(f"{'format':10s} {'checkpoint':22s} {'max |diff|':>10s} {'logit range':>18s} {'rankings':>9s}  reference")
    for fmt, what, diff, lo, hi, same, authors in rows:
        print(f"{fmt:10s} {what:22s} {diff:10.2e} {f'[{lo:.1f}, {hi:.1f}]':>18s} {'same' if same else 'DIFFER':>9s}  "
              f"{authors}")


PREPROCESSINGS = {  # name -> (fewclip import options, open_clip image_transform arguments)
    "shortest bicubic": ({}, {}),
    "squash bicubic 0.5": ({"resize_mode": "squash", "mean": "0.5,0.5,0.5", "std": "0.5,0.5,0.5"},
                           {"resize_mode": "squash", "mean": (0.5,) * 3, "std": (0.5,) * 3}),
    "squash bilinear": ({"resize_mode": "squash", "interpolation": "bilinear"},
                        {"resize_mode": "squash", "interpolation": "bilinear"}),
    "shortest bilinear": ({"interpolation": "bilinear"}, {"interpolation": "bilinear"}),
    "longest fill 0": ({"resize_mode": "longest"}, {"resize_mode": "longest"}),
    "longest fill 128": ({"resize_mode": "longest", "fill_color": "128"}, {"resize_mode": "longest", "fill_color": 128}),
}


def resize_rows(work: Path):
    """Each preprocessing imported with fewclip against open_clip's image_transform and model on the same images,
    and how far the logits were before fewclip read the preprocessing (shorter side, bicubic; same mean/std)."""
    import open_clip

    model, tok = _parity_model(work)
    rows = []
    images = tiny_images() + [im.resize((20, 45)) for im in tiny_images()[:2]]  # and tall images
    with torch.no_grad():
        cls = open_clip.build_zero_shot_classifier(model, tok, CLASSNAMES, TEMPLATES, device="cpu", use_tqdm=False)
    for name, (options, kwargs) in PREPROCESSINGS.items():
        _, bb = import_checkpoint("open_clip", work / "oc.pt", work / f"oc-{name.replace(' ', '-')}",
                                  {"model": "fewclip-parity-oc", **options})
        pre = open_clip.image_transform(32, is_train=False, **kwargs)
        old = open_clip.image_transform(32, is_train=False, mean=kwargs.get("mean"), std=kwargs.get("std"))
        ref_pixels = torch.stack([pre(im) for im in images])
        pixels = torch.stack([bb.preprocess()(im) for im in images])
        with torch.no_grad():
            ref = model.logit_scale.exp() * model.encode_image(ref_pixels, normalize=True) @ cls
            before = model.logit_scale.exp() * model.encode_image(torch.stack([old(im) for im in images]),
                                                                  normalize=True) @ cls
        logits = bb.geometry.image_logits(bb.encode_images(pixels), text_prototypes(bb, CLASSNAMES, TEMPLATES))
        rows.append(("resize", name, float((logits - ref).abs().max()), float(ref.min()), float(ref.max()),
                     bool(torch.equal(logits.argsort(1), ref.argsort(1))),
                     f"open_clip image_transform; pixels {float((pixels - ref_pixels).abs().max()):.1e}; before: "
                     f"{float((before - ref).abs().max()):.2e}, rankings "
                     f"{'same' if torch.equal(before.argsort(1), ref.argsort(1)) else 'DIFFER'}"))
    return rows


def _parity_model(work: Path):
    """open_clip's tiny model of the open_clip rows, its tokenizer, and its open_clip_train checkpoint (work/oc.pt)."""
    import open_clip
    import open_clip.factory as factory

    factory._MODEL_CONFIGS["fewclip-parity-oc"] = {
        "embed_dim": 32, "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2, "head_width": 16},
        "text_cfg": {"context_length": 20, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 2}}
    torch.manual_seed(5)
    model = open_clip.create_model("fewclip-parity-oc", pretrained=None).eval()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(42.0))
    torch.save(open_clip_train_checkpoint(model.state_dict()), work / "oc.pt")
    return model, open_clip.get_tokenizer("fewclip-parity-oc")


def open_clip_row(work: Path):
    """open_clip_train's checkpoint of a tiny GELU model against open_clip's own zero-shot logits."""
    import open_clip

    model, tok = _parity_model(work)
    _, bb = import_checkpoint("open_clip", work / "oc.pt", work / "oc", {"model": "fewclip-parity-oc"})
    pre = open_clip.image_transform(32, is_train=False)
    with torch.no_grad():
        cls = open_clip.build_zero_shot_classifier(model, tok, CLASSNAMES, TEMPLATES, device="cpu", use_tqdm=False)
        img = model.encode_image(torch.stack([pre(im) for im in tiny_images()]), normalize=True)
        ref = model.logit_scale.exp() * img @ cls
    logits = zeroshot(bb)
    return ("open_clip", "open_clip_train", float((logits - ref).abs().max()), float(ref.min()), float(ref.max()),
            bool(torch.equal(logits.argsort(1), ref.argsort(1))), f"open_clip {open_clip.__version__}, run here")


if __name__ == "__main__":
    main()
