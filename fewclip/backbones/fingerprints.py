"""Known-weight fingerprints: recognise published checkpoints whose architecture no tensor shape shows.

Some published weights load into a wrong architecture without a missing key: OpenAI's CLIP
(and the open_clip tags trained like it) use QuickGELU, and a state dict saved from
``clip.load(..., jit=False)`` loads into open_clip's GELU ``ViT-B-32`` as well as into
``ViT-B-32-quickgelu``; MERU's ViT-S has 12 heads of 32 where timm's ViT-S has 6 of 64. The
logits are then a few percent off, silently. A *fingerprint* names the weights themselves,
so a file that is known to be one of them can be held to the architecture it was trained in.

The fingerprint of a state dict is the sha256 of the *sign bits* of the first ``N_SIGNS``
entries of two named tensors (the text token embedding and the image tower's input
embedding, whichever layout names them) with their shapes:

- robust to the file format (safetensors, a torch pickle, a TorchScript archive: the same
  values), to the dtype (rounding between float32, float16 and bfloat16 never changes a sign,
  and ``torch.signbit`` keeps the sign of a zero that a rounding produced), and to key
  prefixes (``module.``, open_clip_train's wrapper, ``visual.trunk.`` after a fewclip import;
  ``canonical_key``);
- 2 x 4096 independent signs: two different trainings share one with probability 2^-8192.

``KNOWN_WEIGHTS`` lists the published checkpoints this applies to, each with what the
architecture must be. No published weights can be downloaded where fewclip is developed, so
their fingerprints are not filled in yet (``fingerprint`` is empty, and an empty entry
matches nothing): run ``python scripts/fingerprint_weights.py FILE ...`` on the published
files and paste the printed values. The mechanism is tested with a table made from tiny
files (``tests/test_import_weights.py``).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import open_clip
import torch
from open_clip.factory import get_model_config

N_SIGNS = 4096
# Wrappers that training code puts in front of every key (DistributedDataParallel, torch.compile, ...).
PREFIXES = ("module.", "_orig_mod.", "model.", "state_dict.")
# role -> the names that tensor has in the layouts fewclip reads (after canonical_key).
ROLES: dict[str, tuple[str, ...]] = {
    "text_token_embedding": ("token_embedding.weight", "text.token_embedding.weight", "textual.token_embed.weight"),
    "image_input_embedding": ("visual.conv1.weight", "visual.patch_embed.proj.weight",
                              "visual.trunk.patch_embed.proj.weight", "visual.trunk.conv1.weight"),
}


def canonical_key(key: str) -> str:
    """``key`` without the wrappers of ``PREFIXES`` (any number of them, in any order)."""
    changed = True
    while changed:
        changed = False
        for p in PREFIXES:
            if key.startswith(p):
                key, changed = key[len(p):], True
    return key


def _role_tensors(sd: Mapping[str, torch.Tensor]) -> Optional[dict[str, torch.Tensor]]:
    by_name = {canonical_key(k): v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    out = {}
    for role, names in ROLES.items():
        found = [by_name[n] for n in names if n in by_name]
        if len(found) != 1:
            return None
        out[role] = found[0]
    return out


def fingerprint(sd: Mapping[str, torch.Tensor]) -> Optional[str]:
    """The weights' fingerprint (32 hex digits), or None where the state dict lacks a named tensor."""
    tensors = _role_tensors(sd)
    if tensors is None:
        return None
    h = hashlib.sha256()
    for role, t in tensors.items():
        if not t.is_floating_point():
            return None
        signs = torch.signbit(t.detach().reshape(-1)[:N_SIGNS]).cpu().numpy()
        h.update(f"{role}:{tuple(t.shape)}:".encode())
        h.update(np.packbits(signs).tobytes())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class KnownWeights:
    """A published checkpoint and the architecture facts it was trained with."""

    name: str  # who published what, e.g. "OpenAI CLIP ViT-B/32"
    # The open_clip architecture and pretrained tag that hold these weights in open_clip ("" for none),
    # or for MERU/HyCoCLIP the timm arch of the authors' config.
    architecture: str
    tag: str = ""
    quick_gelu: Optional[bool] = None  # open_clip weights: the activation they were trained with
    num_heads: Optional[int] = None  # MERU/HyCoCLIP: the image tower's heads
    fingerprint: str = ""  # empty until computed from the published file (scripts/fingerprint_weights.py)


def _open_clip_entries() -> tuple[KnownWeights, ...]:
    """The open_clip tags published under a GELU architecture name but trained with QuickGELU (open_clip's
    pretrained configuration says ``quick_gelu``): a local file of them is the trap. OpenAI's nine among them."""

    out = []
    for arch, tag in open_clip.list_pretrained():
        if open_clip.get_pretrained_cfg(arch, tag).get("quick_gelu") and not (get_model_config(arch) or {}).get(
                "quick_gelu", False):
            out.append(KnownWeights(f"open_clip {arch}/{tag}", f"{arch}-quickgelu", tag, quick_gelu=True))
    return tuple(out)


# MERU and HyCoCLIP's ViT-S (configs meru_vit_s.py / hycoclip_vit_s.py: vit_small_mocov3_patch16_224, 12 heads).
MERU_ENTRIES = (
    KnownWeights("MERU ViT-S (facebookresearch/meru, meru_vit_s.pth)", "vit_small_mocov3_patch16_224", num_heads=12),
    KnownWeights("MERU CLIP baseline ViT-S (clip_vit_s.pth)", "vit_small_mocov3_patch16_224", num_heads=12),
    KnownWeights("HyCoCLIP ViT-S (PalAvik/hycoclip, hycoclip_vit_s.pth)", "vit_small_mocov3_patch16_224",
                 num_heads=12),
)
# KnownWeights.name -> fingerprint, for the published files fingerprinted so far (none yet: no published file
# could be downloaded where this was written; see the module's docstring).
FINGERPRINTS: dict[str, str] = {}


def known_weights() -> tuple[KnownWeights, ...]:
    """Every known published checkpoint, with its fingerprint where it has been computed."""
    return tuple(replace(e, fingerprint=FINGERPRINTS.get(e.name, "")) for e in (*_open_clip_entries(), *MERU_ENTRIES))


def identify(sd: Mapping[str, torch.Tensor], table: Optional[Iterable[KnownWeights]] = None
             ) -> Optional[KnownWeights]:
    """The known published checkpoint ``sd`` is (by fingerprint), or None."""
    fp = fingerprint(sd)
    if fp is None:
        return None
    for entry in (known_weights() if table is None else table):
        if entry.fingerprint and entry.fingerprint == fp:
            return entry
    return None
