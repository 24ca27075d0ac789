"""The feature store: frozen image-tower features on disk, shared by runs, worker processes and sweeps.

A *request* for features is an ordered list of images of one dataset through one frozen tower, as the
backbone's evaluation transform or as an augmented view (``fewclip.features.encode.View``). The store keeps the
features of each request under a content address:

* the *group* (a folder): the backbone's weights checksum (``records.weights_checksum``), its tower
  variant (a local-attention window: ``Backbone.variant``), precision and device type, the dataset's name
  and root folder, the transform (the evaluation transform's description and the backbone's preprocessing
  configuration, ``fewclip.backbones.preprocess``, or the augmentation with the
  run seed and view index of the view), the encoding batch size and torchvision's version;
* the *shard* (a file in the group): the sha256 of the ordered image ids.

Where the image tower ends in a linear projection (open_clip's ViT ``visual.proj``, every reference backbone's),
the store keeps the features *before* it (the ``preproj`` tower variant, ``Backbone.stored_variant``) and the
projected features every other method takes are derived from them (``Backbone.project_features``: the tower's
own product, the same bits): ProLIP, which trains the projection, and the other methods share one encoding of
each image and view.

A request is encoded as a whole, in batches of ``batch_size`` in its order, so its features are a function
of the address alone: whichever process, worker or sweep encoded it, and whatever ran before, the same
request gives the same bits (an image's features differ in the last bits with the batch it is encoded
in, so a cache filled image by image would not). The methods of a sweep that share a few-shot split ask
for the same requests, and every run asks for the same test images.

Layout under the root (``FEWCLIP_CACHE``, default ``~/.cache/fewclip/features``)::

    v3/<group digest>/address.json            what the group's features are a function of
    v3/<group digest>/<ids digest>.safetensors  x [N, D] float32 ([N, W] before a projection); metadata: the N
                                              image ids, the images' fingerprint and a checksum of the entry
    v3/<group digest>/.fewclip.encode.<ids digest>.lock   while one process encodes the request

An entry is served only if it is what it says and was made from the images there are now:

* its checksum (sha256 of the features' bytes, the ids and the fingerprint) matches, so a truncated file or a
  flipped byte is found, reported in one line, removed and encoded again;
* its images are the same (``fewclip.data.image_fingerprint``): a toy-world task's generator (the code and
  settings that render it), or each image file's size, modification time and content hash; a changed file is
  reported (how many, and one of them) and the request encoded again and stored in place of the old entry.
  An added or removed image changes the request's ids, and so its entry. ``FEWCLIP_CACHE_VERIFY=hash``
  hashes every file on every check instead of trusting an unchanged size and modification time.

Files are written atomically (``fewclip.utils.io``): a reader sees a complete shard or none. While one process
encodes a request, others that need it wait on its lock (``records.RunLock``: a lock of a process that is
gone is taken over) and then read the shard, so a request is encoded once however many workers ask.
A store that cannot be written (a full disk, a read-only folder) is not an error: the runs go on with
features in memory and the log says why once.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fewclip.data.image_fingerprint import changed, fingerprint, verify_mode
from fewclip.features.address import FORMAT, VERSION, VIEW_CODE_VERSION, address, describe_transform  # noqa: F401
from fewclip.utils import env
from fewclip.utils.errors import RunFailure
from fewclip.utils.io import atomic_write, atomic_write_text
from fewclip.utils.locks import RunLock
from fewclip.utils.tensor_checks import tensor_problem

log = logging.getLogger(__name__)

STORE_ENV = env.CACHE
ADDRESS_FILE = "address.json"
OFF = ("off", "none", "false", "no", "0")


def default_root() -> Path:
    """``$FEWCLIP_CACHE``, else ``$XDG_CACHE_HOME/fewclip/features`` (``~/.cache/fewclip/features``)."""
    env = os.environ.get(STORE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fewclip" / "features"


def store_setting(value: Optional[str] = None) -> Optional[str]:
    """The store location a setting names, as an absolute path, or None for no store: ``value`` (a path,
    or off/none), else ``$FEWCLIP_CACHE`` (which may say off too), else the default."""
    if value is None:
        env = os.environ.get(STORE_ENV)
        if env is not None and env.strip().lower() in OFF:
            return None
        return str(default_root().resolve())
    if value.strip().lower() in OFF:
        return None
    return str(Path(value).expanduser().resolve())


def open_store(value: Optional[str] = None) -> Optional[FeatureStore]:
    """The store a setting names (``store_setting``), or None."""
    root = store_setting(value)
    return FeatureStore(root) if root else None


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def ids_digest(ids: Sequence[str]) -> str:
    """The shard name of an ordered list of image ids."""
    h = hashlib.sha256()
    for i in ids:
        h.update(str(i).encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:40]


def entry_checksum(x: torch.Tensor, ids_json: str, source_json: str) -> str:
    """The checksum of a stored entry: sha256 of its features' bytes, its ids and its images' fingerprint."""
    h = hashlib.sha256()
    h.update(x.contiguous().float().cpu().numpy().tobytes())
    for part in (ids_json, source_json):
        h.update(b"\0")
        h.update(part.encode("utf-8"))
    return h.hexdigest()





class StoreGroup:
    """One group folder of the store (features of one dataset through one tower and one transform)."""

    def __init__(self, store: FeatureStore, addr: dict[str, Any]):
        self.store = store
        self.address = addr
        self.digest = _digest(addr)[:40]
        self.dir = store.root / f"v{VERSION}" / self.digest
        self._told_changed: set[Path] = set()  # entries already reported as made from other images

    def shard_path(self, ids: Sequence[str]) -> Path:
        return self.dir / f"{ids_digest(ids)}.safetensors"

    def read(self, ids: Sequence[str], dataset=None, items: Optional[Sequence] = None,
             verify: str = "stat") -> Optional[torch.Tensor]:
        """The stored features [N, D] of exactly these ids in this order, or None. A damaged entry is reported
        and removed; with ``dataset`` and its ``items``, an entry made from other images than those there are
        now is reported and not served (``fewclip.data.image_fingerprint``)."""

        path = self.shard_path(ids)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                x = f.get_tensor("x")
            source = json.loads(meta["source"])
            ok = meta.get("checksum") == entry_checksum(x, meta.get("ids", ""), meta["source"])
        except FileNotFoundError:
            return None
        except OSError:
            raise  # the store cannot be read: the caller goes on without it
        except Exception as e:  # not a complete safetensors file, or not one of ours
            return self._drop(path, f"{type(e).__name__}: {str(e)[:80]}")
        if not ok:
            return self._drop(path, "its checksum does not match its contents")
        if json.loads(meta.get("ids", "[]")) != list(ids) or x.dim() != 2 or x.shape[0] != len(ids):
            return self._drop(path, "it does not hold the images its name says")
        problem = tensor_problem(x, "its features")  # float and finite, whatever its checksum says
        if problem:
            return self._drop(path, problem)
        if dataset is not None:
            bad, stale = changed(dataset, items, source, verify)
            if bad:
                if path not in self._told_changed:  # read again under the encode lock: one message, not two
                    self._told_changed.add(path)
                    log.warning("feature store: %d of %d image(s) of %s changed since their features were "
                                "stored (e.g. %s); encoding them again", len(bad), len(ids), dataset.name, bad[0])
                return None
            if stale:  # the same images with new times (a copy): store their current records
                try:
                    fp = fingerprint(dataset, items)
                    if fp is not None:
                        self.write(ids, x, fp)
                except OSError:
                    pass
        try:
            os.utime(path)  # "last used", for `fewclip cache`
        except OSError:
            pass
        return x

    def _drop(self, path: Path, why: str) -> None:
        log.warning("feature store: removing the damaged entry %s (%s); its images are encoded again", path, why)
        try:
            path.unlink()
        except OSError:
            pass
        return None

    def write(self, ids: Sequence[str], x: torch.Tensor, fp) -> None:
        """Store the features ``x`` of ``ids``, made from the images that ``fp`` fingerprints
        (``fewclip.data.image_fingerprint.Fingerprint``)."""


        self.dir.mkdir(parents=True, exist_ok=True)
        if not (self.dir / ADDRESS_FILE).exists():
            atomic_write_text(self.dir / ADDRESS_FILE, json.dumps(self.address, indent=2, sort_keys=True) + "\n")
        x = x.contiguous().float().cpu()
        ids_json, source = json.dumps(list(ids)), json.dumps(fp.to_json(), separators=(",", ":"))
        meta = {"format": FORMAT, "version": str(VERSION), "ids": ids_json, "source": source,
                "checksum": entry_checksum(x, ids_json, source)}
        atomic_write(self.shard_path(ids), lambda tmp: save_file({"x": x}, tmp, metadata=meta))

    def acquire(self, ids: Sequence[str]):
        """The held lock of one request, for encoding it (waiting while another live process holds it); the
        caller releases it."""

        self.dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(self.dir, name=f".fewclip.encode.{ids_digest(ids)}.lock")
        said = False
        while not lock.try_acquire():
            if not said:
                who = lock.blocked_by.describe() if lock.blocked_by else "another process"
                log.info("feature store: waiting for %s, which is encoding the same images", who)
                said = True
            time.sleep(0.2)
        return lock


@dataclass
class GroupInfo:
    """What ``fewclip cache`` lists about one group."""

    digest: str
    path: Path
    address: dict[str, Any]
    requests: int
    images: int
    bytes: int
    last_used: float

    @property
    def transform(self) -> str:
        t = self.address.get("transform") or {}
        if t.get("kind") == "view":
            return f"view {t.get('index')} seed {t.get('seed')}"
        return "eval" if t.get("kind") == "eval" else "?"


class FeatureStore:
    """The on-disk feature store under ``root`` (module docstring)."""

    def __init__(self, root: str | os.PathLike, verify: Optional[str] = None):
        self.root = Path(root)
        self.verify = verify_mode(verify)  # "stat" or "hash" (FEWCLIP_CACHE_VERIFY)

    def group(self, addr: dict[str, Any]) -> StoreGroup:
        return StoreGroup(self, addr)

    def groups(self) -> list[GroupInfo]:
        """Every group with its size, newest use first."""

        out = []
        base = self.root / f"v{VERSION}"
        if not base.is_dir():
            return out
        for d in sorted(p for p in base.iterdir() if p.is_dir()):
            try:
                addr = json.loads((d / ADDRESS_FILE).read_text())
            except (OSError, ValueError):
                addr = {}
            requests = images = size = 0
            last = 0.0
            for f in d.glob("*.safetensors"):
                try:
                    st = f.stat()
                    with safe_open(str(f), framework="pt") as sf:
                        images += int(sf.get_slice("x").get_shape()[0])
                except Exception:  # safetensors' errors for a damaged entry, or OSError: not counted
                    continue
                requests += 1
                size += st.st_size
                last = max(last, st.st_mtime)
            out.append(GroupInfo(d.name, d, addr, requests, images, size, last))
        return sorted(out, key=lambda g: -g.last_used)

    def old_formats(self) -> list[Path]:
        """Folders of older store formats under the root (never read; ``clear`` with no filter removes them)."""
        if not self.root.is_dir():
            return []
        return sorted(d for d in self.root.glob("v*") if d.is_dir() and d.name[1:].isdigit()
                      and d.name != f"v{VERSION}")

    def clear(self, backbone: Optional[str] = None, dataset: Optional[str] = None,
              root: Optional[str] = None) -> Cleared:
        """Remove every group (or those of ``backbone``, ``dataset`` and/or the data ``root``); returns what was
        removed and what could not be (a read-only store). ``dataset`` matches a dataset's name and its class
        views (``toy-objects`` also clears ``toy-objects[base]``); ``root`` matches a dataset root and every
        root under it. Clearing everything also removes the folders of older store formats."""
        out = Cleared()
        for g in self.groups():
            if backbone is not None and g.address.get("backbone") != backbone:
                continue
            if dataset is not None and not matches_dataset(g.address.get("dataset"), dataset):
                continue
            if root is not None and not under_root(g.address.get("data_root"), root):
                continue
            error = _remove_tree(g.path)
            left = _shard_bytes(g.path)
            if not left:  # no entry left (its folder may stay, emptied: a folder above that cannot be written)
                out.removed.append(g)
            else:
                out.kept.append(g)
                out.freed += g.bytes - left
            out.error = out.error or error
        if backbone is None and dataset is None and root is None:
            for old in self.old_formats():
                error = _remove_tree(old)
                if old.exists():
                    out.kept_old.append(old)
                    out.error = out.error or error
        return out


class StoreNotCleared(RunFailure):
    """``fewclip cache clear`` could not remove what it was asked to (a read-only store)."""


@dataclass
class Cleared:
    """What ``FeatureStore.clear`` removed: whole groups, and those it could not remove (``kept``, with the bytes
    of their entries it did remove in ``freed`` and the first error in ``error``)."""

    removed: list[GroupInfo] = field(default_factory=list)
    kept: list[GroupInfo] = field(default_factory=list)
    kept_old: list[Path] = field(default_factory=list)
    freed: int = 0
    error: Optional[tuple[str, OSError]] = None  # (the path that could not be removed, why)

    @property
    def removed_bytes(self) -> int:
        return sum(g.bytes for g in self.removed) + self.freed

    def summary(self, root: str | os.PathLike) -> str:
        """What was removed, in one line (``fewclip cache clear``)."""
        partly = f" (and {self.freed / 2**20:.1f} MiB of {len(self.kept)} other(s))" if self.freed else ""
        return (f"removed {len(self.removed)} feature group(s), {self.removed_bytes / 2**20:.1f} MiB{partly}, "
                f"from {root}")

    def check(self, root: str | os.PathLike) -> None:
        """Raise ``StoreNotCleared`` (one line: the folder, the cause, the fix) if anything asked for is left."""
        if not (self.kept or self.kept_old or self.error):
            return
        path, e = self.error if self.error else (str(root), OSError(errno.EIO, "unknown error"))
        if self.kept or self.kept_old:
            kept_mib = (sum(g.bytes for g in self.kept) - self.freed) / 2**20
            left = f"{len(self.kept)} feature group(s), {kept_mib:.1f} MiB, " if self.kept else ""
            old = f"{len(self.kept_old)} folder(s) of an older store format " if self.kept_old else ""
            what = f"could not remove {left}{'and ' if left and old else ''}{old}from {root}"
        else:
            what = f"removed the features but could not remove their emptied folder(s) from {root}"
        if e.errno == errno.EROFS:
            fix = "the store is on a read-only file system: clear it where it is mounted read-write"
        else:
            fix = "make the folder writable (chmod u+w) or clear it as its owner"
        raise StoreNotCleared(f"{what}: {e.strerror or e} ({path}); {fix}, or point dir= (FEWCLIP_CACHE) at the "
                              f"store you meant to clear")


def _remove_tree(path: Path) -> Optional[tuple[str, OSError]]:
    """Remove what can be removed under ``path``; the first failure (the path, and a read-only file system or a
    folder without write permission), or None."""
    errors: list[tuple[str, OSError]] = []
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda func, p, e: errors.append((p, e)))
    else:
        shutil.rmtree(path, onerror=lambda func, p, info: errors.append((p, info[1])))
    return next((e for e in errors if not isinstance(e[1], FileNotFoundError)), None)  # gone meanwhile: fine


def _shard_bytes(folder: Path) -> Optional[int]:
    """The bytes of the entries still in a group ``folder``; None when the folder is gone."""
    if not folder.exists():
        return None
    total = 0
    for f in folder.glob("*.safetensors"):
        try:
            total += f.stat().st_size
        except OSError:
            continue
    return total


def matches_dataset(name: Optional[str], wanted: str) -> bool:
    """Whether a group's dataset ``name`` is ``wanted`` or one of its class views (``wanted[base]``)."""
    return bool(name) and (name == wanted or name.startswith(wanted + "["))


def under_root(data_root: Optional[str], root: str) -> bool:
    """Whether a group's ``data_root`` is ``root`` or a folder under it."""
    if not data_root:
        return False
    want = Path(root).expanduser().resolve()
    have = Path(data_root)
    return have == want or want in have.parents
