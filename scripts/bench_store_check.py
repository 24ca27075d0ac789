"""What the feature store's image check costs (``fewclip.data.image_fingerprint``): for a folder dataset of N image
files, the fingerprint taken when a request is stored (a stat and a sha256 per file), the check before a stored
request is served with FEWCLIP_CACHE_VERIFY=stat (a stat per file) and with =hash (a stat and a sha256 per file),
and, beside them, what encoding the same images costs on toy-clip (decode, preprocess, tower).

    python scripts/bench_store_check.py [n=5000] [size=224] [encode=1000]

The files are JPEGs of ``size`` x ``size`` random pixels (about the size of a dataset's images) in a temporary
folder; each check is timed on a warm page cache (the second of two passes), as a sweep's later runs see it.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from fewclip.backbones.backbone import BackboneConfig, load_backbone
from fewclip.data.image_fingerprint import changed, fingerprint
from fewclip.datasets import DataConfig, build_dataset
from fewclip.features.encode import extract_features


def main(argv):
    opts = {"n": 5000, "size": 224, "encode": 1000}
    for a in argv:
        k, v = a.split("=", 1)
        opts[k] = int(v)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "images"
        for c in range(10):
            (root / f"class{c}").mkdir(parents=True)
        for i in range(opts["n"]):
            a = rng.integers(0, 256, (opts["size"], opts["size"], 3), dtype=np.uint8)
            Image.fromarray(a).save(root / f"class{i % 10}" / f"{i}.jpg", quality=90)
        ds = build_dataset(DataConfig(name="folder", root=str(root)))
        items = [it for split in ("train", "val", "test") for it in ds.items(split)]
        mib = sum((root / it.id).stat().st_size for it in items) / 2**20
        rows = []
        for what, fn in (("fingerprint when stored (stat + sha256)", lambda: fingerprint(ds, items)),
                         ("check before serving, verify=stat", lambda: changed(ds, items, stored, "stat")),
                         ("check before serving, verify=hash", lambda: changed(ds, items, stored, "hash"))):
            for _ in range(2):
                t0 = time.perf_counter()
                out = fn()
                dt = time.perf_counter() - t0
            if what.startswith("fingerprint"):
                stored = out.to_json()
            else:
                assert out == ([], False)
            rows.append((what, dt))
        bb = load_backbone(BackboneConfig(name="toy-clip", device="cpu"))
        few = items[: opts["encode"]]
        t0 = time.perf_counter()
        extract_features(bb, ds, few, batch_size=256)
        enc = (time.perf_counter() - t0) / len(few) * len(items)
        rows.append((f"encoding them on toy-clip (from {len(few)} images)", enc))
    print(f"{len(items)} JPEG files of {opts['size']}x{opts['size']} ({mib:.0f} MiB), warm page cache:\n")
    print("| step | s | ms per 1000 images |\n|---|---:|---:|")
    for what, dt in rows:
        print(f"| {what} | {dt:.3f} | {dt / len(items) * 1000 * 1000:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
