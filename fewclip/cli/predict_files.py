"""``fewclip predict`` over folders, with its predictions written as CSV or JSON (``out=FILE``).

A folder argument stands for every image file under it (recursively, sorted; the extensions PIL can open,
hidden files left out). ``out=predictions.csv`` writes one row per image: ``image, class_1, probability_1, ...,
class_K, probability_K``; ``out=predictions.json`` a list of ``{"image": ..., "top": [{"class": ...,
"probability": ...}, ...]}``. Both are written atomically.
"""
from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path

from PIL import Image

from fewclip.utils.errors import InputError
from fewclip.utils.io import atomic_write_text

FORMATS = (".csv", ".json")


def image_suffixes() -> set:
    return {ext.lower() for ext in Image.registered_extensions()}


def expand_images(paths: Sequence[str]) -> list[str]:
    """The image files the arguments name: a file as given, a folder as the image files under it."""
    suffixes, out = image_suffixes(), []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(str(f) for f in path.rglob("*") if f.is_file() and f.suffix.lower() in suffixes
                           and not any(part.startswith(".") for part in f.relative_to(path).parts))
            if not found:
                raise InputError(f"{p}: a folder without image files ({', '.join(sorted(suffixes)[:6])} ...)")
            out.extend(found)
        else:
            out.append(p)
    return out


def check_out(out: str) -> Path:
    path = Path(out)
    if path.suffix.lower() not in FORMATS:
        raise InputError(f"out={out}: predictions are written as CSV or JSON; name a file ending in .csv or .json")
    if path.is_dir():
        raise InputError(f"out={out} is a folder; name a file ending in .csv or .json")
    return path


def write_predictions(out: str | Path, images: Sequence[str], preds: Sequence[Sequence[tuple[str, float]]]) -> Path:
    path = check_out(str(out))
    if path.suffix.lower() == ".json":
        rows = [{"image": img, "top": [{"class": c, "probability": round(p, 6)} for c, p in top]}
                for img, top in zip(images, preds)]
        return atomic_write_text(path, json.dumps(rows, indent=1) + "\n")
    k = max((len(t) for t in preds), default=0)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["image", *[f"{what}_{i + 1}" for i in range(k) for what in ("class", "probability")]])
    for img, top in zip(images, preds):
        w.writerow([img, *[v for c, p in top for v in (c, f"{p:.6f}")]])
    return atomic_write_text(path, buf.getvalue())
