"""What a request's images are a function of, so that stored features are never served for other pixels.

The feature store (``fewclip.features.store``) keeps the features of an ordered list of images; before it serves them
it checks that the images are still the ones they were made from:

* a procedural dataset (the toy world: no files) names its generator (``Dataset.generator``: a digest of the
  code and settings that render it); a request's fingerprint is that name;
* a file dataset's request is fingerprinted file by file: ``[size, mtime_ns, sha256]`` of each image
  (``Dataset.image_path``). The content hash is taken when the features are made (one more read of files the
  encoder reads anyway, from the page cache).

Checking a stored request (:func:`changed`) costs one ``stat`` per image: a file whose size and modification
time are the stored ones is trusted; one whose size or time differ is hashed, and counts as changed only if
its content differs (so a copy that did not keep modification times, e.g. data staged to a node's disk, is
served after a read instead of being encoded again). ``verify="hash"`` (``FEWCLIP_CACHE_VERIFY=hash``) hashes
every file, which catches an edit that kept both size and time (a tool that restores them) at the cost of
reading every image. A dataset whose images are neither files nor generated (a Python subclass that loads
them elsewhere) has no fingerprint: its features are not stored.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from fewclip.data.base import DatasetError
from fewclip.utils import env

VERIFY_ENV = env.CACHE_VERIFY
VERIFY_MODES = ("stat", "hash")
HASH_CHARS = 32  # of a file's sha256, hex


def verify_mode(value: Optional[str] = None) -> str:
    """``value``, else ``$FEWCLIP_CACHE_VERIFY``, else ``stat``; anything else is a DatasetError naming both."""
    mode = (value or os.environ.get(VERIFY_ENV) or "stat").strip().lower()
    if mode not in VERIFY_MODES:
        raise DatasetError(f"{VERIFY_ENV}={mode!r} is not a way to check the feature store's images; use one of "
                           f"{', '.join(VERIFY_MODES)} (stat: trust an unchanged size and modification time; hash: "
                           f"compare every file's content)")
    return mode


def file_hash(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:HASH_CHARS]


def file_record(path: str | os.PathLike) -> list:
    """``[size, mtime_ns, sha256]`` of one file (the hash read after the stat: a file that changes between
    the two is recorded with its older time, which the next check sees as a change)."""
    st = os.stat(path)
    return [int(st.st_size), int(st.st_mtime_ns), file_hash(path)]


@dataclass(frozen=True)
class Fingerprint:
    """What a request's images are a function of: a generator's name, or one ``file_record`` per image."""

    generator: Optional[str] = None
    files: Optional[tuple[tuple, ...]] = None

    def to_json(self):
        return {"generator": self.generator} if self.generator is not None else {"files": [list(f) for f in self.files]}


def fingerprint(dataset, items: Sequence) -> Optional[Fingerprint]:
    """The fingerprint of ``items`` of ``dataset`` as they are now, or None where it has none (module docstring).
    A missing file is an OSError (the encoder would fail on it too)."""
    generator = getattr(dataset, "generator", None)
    if generator:
        return Fingerprint(generator=str(generator))
    paths = [dataset.image_path(it) for it in items]
    if any(p is None for p in paths):
        return None
    return Fingerprint(files=tuple(tuple(file_record(p)) for p in paths))


def changed(dataset, items: Sequence, stored, verify: str = "stat") -> tuple[list[str], bool]:
    """The ids of ``items`` whose images differ from the ``stored`` fingerprint (its JSON form), and whether
    any file record is out of date although its content is the same (a copy with new times; the caller may
    store the fresh records). A generator mismatch lists every id."""
    stored = stored or {}
    generator = getattr(dataset, "generator", None)
    if generator or "generator" in stored:
        same = generator is not None and stored.get("generator") == str(generator)
        return ([] if same else [it.id for it in items]), False
    files = stored.get("files")
    if not isinstance(files, list) or len(files) != len(items):
        return [it.id for it in items], False
    bad, stale = [], False
    for it, rec in zip(items, files):
        path = dataset.image_path(it)
        try:
            st = os.stat(path)
            size, mtime, digest = rec
            if verify == "stat" and (st.st_size, st.st_mtime_ns) == (size, mtime):
                continue
            if st.st_size != size or file_hash(path) != digest:
                bad.append(it.id)
            elif st.st_mtime_ns != mtime:
                stale = True
        except (OSError, TypeError, ValueError):  # a file gone, or a record that is not [size, mtime, hash]
            bad.append(it.id)
    return bad, stale
