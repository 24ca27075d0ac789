"""Unreadable or non-image files found before any run draws them (``fewclip datasets check``, and a sweep's
start), and left out on request (``data.skip_bad_images=true``, recorded in metrics.json as ``skipped_images``).

A file counts as bad when PIL cannot open and decode it (a truncated JPEG, a text file named ``.png``, an empty
file) or it is missing. JPEGs are decoded at reduced size (PIL's ``draft``): every byte is still read and a
truncated file still fails, at a fraction of the cost of a full decode.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from PIL import Image

from fewclip.utils.progress import progress

log = logging.getLogger(__name__)

# A sweep checks its datasets up front only up to this many images each (a larger one: `fewclip datasets check`).
SWEEP_CHECK_MAX = 50_000


@dataclass(frozen=True)
class BadImage:
    id: str
    path: str
    reason: str


def _all_items(dataset) -> list:
    seen: dict[str, object] = {}
    for items in dataset.splits.values():
        for it in items:
            seen.setdefault(it.id, it)
    return list(seen.values())


def n_images(dataset) -> int:
    return len(_all_items(dataset))


def _read(dataset, item) -> None:
    path = dataset.image_path(item)
    if path is None:  # not a file dataset's item: its own loader is the check
        dataset.load_image(item)
        return
    with Image.open(path) as im:
        if im.format == "JPEG":
            im.draft("RGB", (max(1, im.width // 8), max(1, im.height // 8)))
        im.load()


def find_bad_images(dataset, desc: Optional[str] = None) -> list[BadImage]:
    """Every item of every split whose file cannot be read as an image, each once."""
    if getattr(dataset, "root", None) is None:  # images made by code (toy datasets): nothing to read
        return []
    bad = []
    items = _all_items(dataset)
    for item in progress(items, desc=desc or f"{dataset.name}: checking images", unit="image", leave=False):
        try:
            _read(dataset, item)
        except Exception as e:  # PIL raises several types for damaged files
            path = str(dataset.image_path(item) or item.id)
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            reason = " ".join(reason.replace(f"'{path}'", "").replace(path, "").split()) or type(e).__name__
            bad.append(BadImage(item.id, path, reason))
    return bad


def describe_bad(dataset, bad: list[BadImage], checked: int) -> str:
    lines = [f"{dataset.name}: {checked} images checked, {len(bad)} cannot be read:"]
    lines += [f"  {b.path}: {b.reason}" for b in bad]
    return "\n".join(lines)


def drop_bad_images(dataset) -> list[str]:
    """Leave the bad files out of every split (``data.skip_bad_images=true``); their ids are kept on the dataset
    as ``skipped_images`` for the run's metrics.json."""
    bad = find_bad_images(dataset)
    ids = {b.id for b in bad}
    if ids:
        for split, items in dataset.splits.items():
            dataset.splits[split] = [it for it in items if it.id not in ids]
        log.warning("%s: %d unreadable image file(s) left out (data.skip_bad_images=true): %s", dataset.name,
                    len(ids), ", ".join(f"{b.path} ({b.reason})" for b in bad[:5]) + (" ..." if len(bad) > 5 else ""))
    dataset.skipped_images = sorted(ids)
    return dataset.skipped_images
