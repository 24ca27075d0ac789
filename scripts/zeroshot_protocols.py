"""Zero-shot of the reference backbones under the toy world's generalisation protocols.

    python scripts/zeroshot_protocols.py                       # all four reference backbones
    python scripts/zeroshot_protocols.py backbones=toy-clip templates=single

Prints, for each backbone and template mode (``single``: "a photo of a {}.";
``ensemble``: all the task's templates), on the full test splits:

* base-to-novel on toy-objects (CoCoOp's split: 32 base, 32 new classes): base
  accuracy among base classes, new among new classes, their harmonic mean;
* domain shift from toy-shapes to toy-sketch, toy-shapes-outline (4 of its 8
  classes, evaluated among those 4) and toy-shapes-faded;
* cross-dataset transfer from toy-objects to the five other toy tasks, each
  among its own classes.

Zero-shot trains nothing, so these are the rows every method of the protocols
is compared against. The plans come from ``fewclip.datasets.protocols``.
"""
import sys

from fewclip.backbones import BackboneConfig, load_backbone
from fewclip.cli import setup_logging
from fewclip.datasets import DataConfig, build_dataset
from fewclip.datasets.protocols import default_targets, harmonic_mean, make_plan
from fewclip.features import extract_features
from fewclip.zeroshot import evaluate_zeroshot

BACKBONES = ("toy-clip", "toy-euclip", "toy-meru", "toy-siglip")
TEMPLATES = ("single", "ensemble")


def parse(argv):
    opts = {"backbones": ",".join(BACKBONES), "templates": ",".join(TEMPLATES)}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in opts:
            raise SystemExit(f"unknown argument {arg!r}; use backbones=A,B templates=single,ensemble")
        opts[key] = value
    templates = opts["templates"].split(",")
    if not set(templates) <= set(TEMPLATES):
        raise SystemExit(f"templates must be a list of {', '.join(TEMPLATES)}, got {opts['templates']!r}")
    return opts["backbones"].split(","), templates


def plans():
    data = lambda name: build_dataset(DataConfig(name=name))  # noqa: E731
    yield make_plan("base2new", data("toy-objects"))
    for protocol, source in (("domain_shift", "toy-shapes"), ("cross_dataset", "toy-objects")):
        yield make_plan(protocol, data(source), [data(t) for t in default_targets(protocol, source)])


def main(argv) -> int:
    backbones, templates = parse(argv)
    setup_logging("warning")
    all_plans = list(plans())
    for name in backbones:
        bb = load_backbone(BackboneConfig(name=name, device="cpu"))
        features = {}  # test features per dataset (or class view), shared by template modes and plans

        def zeroshot(ds, mode):
            if ds.name not in features:
                features[ds.name] = extract_features(bb, ds, ds.items("test"), desc=f"{ds.name} test")
            return evaluate_zeroshot(bb, ds, templates=mode, features=features[ds.name])["top1"]

        for mode in templates:
            for plan in all_plans:
                top1 = {e.name: zeroshot(e.dataset, mode) for e in plan.evals}
                if plan.protocol == "base2new":
                    top1["HM"] = harmonic_mean(top1["base"], top1["new"])
                cells = "  ".join(f"{k} {v:5.1f}" for k, v in top1.items())
                print(f"{name:11s} {mode:8s} {plan.protocol:13s} {plan.source.name:11s} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
