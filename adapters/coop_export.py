"""CoOp's export: the learned prompts as one self-describing ``.safetensors`` file (format ``fewclip.prompts``).

``fewclip export RUN_DIR -o prompts.safetensors [nearest=3]`` on a CoOp run
(``fewclip.runs.export.export_run``) writes it; ``fewclip.load_prompts`` and
``fewclip predict`` load it as a ``PromptClassifier``.

The file
--------
Tensors (float32):

* ``ctx``            learned context vectors, ``[n_ctx, W]`` (unified) or ``[C, n_ctx, W]`` (class-specific)
* ``prototypes``     one point per class in the geometry's space, ``[C, D]``: what the logits compare against
* ``text_features``  raw text-tower outputs of the learned prompts, ``[C, D]``

One metadata entry, ``"fewclip"``, holds a JSON object with what every fewclip
export carries (``format`` = ``"fewclip.prompts"``, ``format_version``,
``fewclip_version``, ``backbone``, ``geometry``, ``preprocess``,
``tokenizer``, ``classnames``, ``run``: see ``fewclip.adapter.exports``) and
``prompt`` (``class_token_position``, ``n_ctx``, ``csc``, ``ctx_init``), ``tensors_sha256`` (a sha256
of each tensor, ``fewclip.utils.tensor_checks``: loading refuses changed bytes),
``nearest_words`` (CoOp's reading of the context: the ``k`` vocabulary tokens
nearest to each vector, ``[n_ctx][k]`` for a unified context, ``[C][n_ctx][k]``
in class order for a class-specific one) and ``nearest_k``.

Without fewclip
---------------
The prototypes are all a classifier needs, so plain ``open_clip`` and
``safetensors`` can use the file (for the backbone it names, with weights
whose sha256 is ``meta["backbone"]["weights_sha256"]``)::

    import json, torch, torch.nn.functional as F, open_clip
    from safetensors import safe_open

    with safe_open("prompts.safetensors", "pt") as f:
        meta = json.loads(f.metadata()["fewclip"])
        protos = f.get_tensor("prototypes")                              # [C, D]
    model, _, _ = open_clip.create_model_and_transforms("ViT-B-32", pretrained="openai")
    pre = meta["preprocess"]
    tf = open_clip.image_transform(pre["image_size"], is_train=False, mean=pre["mean"], std=pre["std"])
    with torch.no_grad():
        x = model.eval().encode_image(tf(image).unsqueeze(0)).float()   # [1, D] raw image features
    g, p = meta["geometry"]["name"], meta["geometry"]["params"]
    if g in ("clip", "sigmoid"):       # scale * cosine (+ bias for sigmoid)
        logits = p["logit_scale"] * F.normalize(x, dim=-1) @ protos.T + p.get("logit_bias", 0.0)
    elif g == "euclidean":             # features / sqrt(D), minus scaled distance
        logits = -p["logit_scale"] * torch.cdist(x / x.shape[-1] ** 0.5, protos)
    probs = logits.softmax(-1)         # classes in meta["classnames"] order

``euclidean_sq`` uses the squared distance, ``elliptic`` ``-scale *
arccos(cosine)``; the hyperbolic geometries scale the features by
``alpha_image``, lift them with the exponential map at the origin and use the
Lorentz distance: ``fewclip.backbones.geometry`` (``exp_map0``, ``lorentz_distance``)
holds each formula as a small tensor function.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fewclip.adapter.base import ExportFormat, adapter_info
from fewclip.adapter.exports import METADATA_KEY, ExportError, PrototypeClassifier, check_metadata, export_metadata, read_metadata
from fewclip.adapters._text import TextTower
from fewclip.data.base import check_classnames
from fewclip.utils.io import atomic_write
from fewclip.utils.tensor_checks import check_digests, check_tensors, tensor_digests, tensor_problem

FORMAT = "fewclip.prompts"
FORMAT_VERSION = 1
TENSORS = ("ctx", "prototypes", "text_features")


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------


@torch.no_grad()
def prompt_tensors(adapter) -> dict[str, torch.Tensor]:
    """The tensors of a prompt file for a CoOp adapter: ctx, prototypes [C, D], text_features [C, D]."""
    return {
        "ctx": adapter.ctx.detach().float().cpu().contiguous(),
        "prototypes": adapter.prototypes().float().cpu().contiguous(),
        "text_features": adapter.text_features().float().cpu().contiguous(),
    }


def write_prompts(adapter, path: Union[str, Path], meta: dict[str, Any], *, nearest: int = 3) -> dict[str, Any]:
    """Write a CoOp adapter's prompts to ``path`` (atomically); ``meta`` is the metadata every export carries,
    to which the prompt layout and the ``nearest`` vocabulary tokens of each context vector are added."""

    if isinstance(nearest, bool) or not isinstance(nearest, int) or nearest < 1:
        raise ExportError(f"nearest must be an integer >= 1, got {nearest!r}")
    cfg = adapter.cfg
    words = adapter.nearest_words(nearest)  # [groups][n_ctx][k]
    meta = {
        **meta,
        "prompt": {"class_token_position": cfg.class_token_position, "n_ctx": int(adapter.n_ctx),
                   "csc": bool(cfg.csc), "ctx_init": cfg.ctx_init},
        "nearest_k": int(nearest),
        "nearest_words": words if cfg.csc else words[0],
    }
    tensors = prompt_tensors(adapter)
    check_tensors(tensors, "the prompts to export", ExportError, "; the run is not exported")
    meta["tensors_sha256"] = tensor_digests(tensors)
    text = json.dumps(meta, sort_keys=False)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={METADATA_KEY: text}))
    return meta


def export_prompts(adapter, path: Union[str, Path], *, backbone_cfg=None, run: Optional[dict[str, Any]] = None,
                   nearest: int = 3) -> dict[str, Any]:
    """Write a CoOp adapter (not from a run directory) to ``path``; returns the metadata written."""

    return write_prompts(adapter, path, export_metadata(adapter, PROMPTS, backbone_cfg=backbone_cfg, run=run),
                         nearest=nearest)


def summary(path: Union[str, Path], meta: dict[str, Any]) -> str:
    """A readable account of a prompt file: classes, context and the nearest words of each vector."""
    p, bb, run = meta["prompt"], meta["backbone"], meta.get("run") or {}
    names = meta["classnames"]
    checksum = bb.get("weights_sha256") or bb.get("state_sha256") or ""
    init = f"init {p['ctx_init']!r}" if p["ctx_init"] else "random init"
    lines = [
        f"prompts: {path}",
        f"  backbone  {bb['name']} [{meta['geometry']['name']}], checksum {checksum[:16]}...",
        f"  classes   {len(names)}: {', '.join(names)}",
        f"  context   n_ctx={p['n_ctx']}, {'class-specific (csc)' if p['csc'] else 'unified'}, "
        f"class token at {p['class_token_position']}, {init}",
    ]
    if run.get("top1") is not None:
        lines.append(f"  run       top-1 {run['top1']:.2f}% on {run.get('dataset')} ({run.get('shots')}-shot, "
                     f"seed {run.get('seed')})")
    lines.append(f"  nearest {meta.get('nearest_k', '')} vocabulary tokens of each context vector:")
    groups = meta.get("nearest_words") or []
    if not p["csc"]:
        lines += [f"    ctx {i + 1}: {', '.join(w)}" for i, w in enumerate(groups)]
    else:
        for name, group in zip(names, groups):
            lines.append(f"    {name}: " + "  ".join(f"[{', '.join(w)}]" for w in group))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------


def read_prompts(path: Union[str, Path]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read and validate a prompt file: (tensors on CPU, metadata). Any problem is an ExportError naming it."""
    path = Path(path)
    meta = read_metadata(path)
    if meta.get("format") != FORMAT:
        raise ExportError(f"prompt file {path} is not a fewclip prompt file (format {meta.get('format')!r}, "
                          f"expected {FORMAT!r})")
    check_metadata(meta, path, PROMPTS)
    tensors = _read_tensors(path, meta)
    _check_digests(path, tensors, meta)
    return tensors, meta


def _check_digests(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """The tensors against the checksums written with them (after the checks that say more: shapes, widths)."""
    check_digests(tensors, meta.get("tensors_sha256"), f"prompt file {path}", ExportError, "; export the run again")


def _read_tensors(path: Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:

    if not isinstance(meta.get("prompt"), dict):
        raise ExportError(f"prompt file {path}: metadata key 'prompt' is missing or not a dict")
    for key in ("class_token_position", "n_ctx", "csc", "ctx_init"):
        if key not in meta["prompt"]:
            raise ExportError(f"prompt file {path}: metadata prompt.{key} is missing")
    try:
        with safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors' own error types for a damaged file
        raise ExportError(f"prompt file {path} is damaged or not a safetensors file ({e})") from None
    _check_tensors(path, tensors, meta)
    return tensors


def _check_tensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    missing = [k for k in TENSORS if k not in tensors]
    if missing:
        raise ExportError(f"prompt file {path} lacks the tensor(s) {missing}; expected {list(TENSORS)}")
    C, n_ctx, csc = len(meta["classnames"]), meta["prompt"]["n_ctx"], meta["prompt"]["csc"]
    protos, feats, ctx = tensors["prototypes"], tensors["text_features"], tensors["ctx"]
    problems = []
    if protos.dim() != 2 or protos.shape[0] != C:
        problems.append(f"prototypes has shape {tuple(protos.shape)}, expected [{C}, D] for {C} classes")
    if feats.shape != protos.shape:
        problems.append(f"text_features has shape {tuple(feats.shape)}, expected that of prototypes "
                        f"{tuple(protos.shape)}")
    want_ctx = f"[{C}, {n_ctx}, W]" if csc else f"[{n_ctx}, W]"
    if ctx.shape[: ctx.dim() - 1] != ((C, n_ctx) if csc else (n_ctx,)):
        problems.append(f"ctx has shape {tuple(ctx.shape)}, expected {want_ctx} "
                        f"(n_ctx={n_ctx}, {'csc' if csc else 'unified'})")
    problems += [p for p in (tensor_problem(tensors[k], k) for k in TENSORS) if p]
    if problems:
        raise ExportError(f"prompt file {path} is damaged: " + "; ".join(problems))


class PromptClassifier(PrototypeClassifier):
    """Images -> class logits with exported CoOp prompts on a frozen backbone: ``prototypes`` [C, D], with the
    learned ``ctx`` and the prompts' ``text_features`` [C, D] kept for ``with_classnames``."""

    def __init__(self, backbone, tensors: dict[str, torch.Tensor], meta: dict[str, Any], path: Optional[Path] = None):
        super().__init__(backbone, meta, tensors["prototypes"], path)
        device = backbone.device
        self.ctx = tensors["ctx"].to(device)
        self.text_features = tensors["text_features"].to(device)  # C, D

    def __repr__(self) -> str:
        p = self.meta["prompt"]
        return (f"PromptClassifier({len(self.classnames)} classes, {self.backbone.name} [{self.geometry.name}], "
                f"n_ctx={p['n_ctx']}, {'csc' if p['csc'] else 'unified'})")

    def with_classnames(self, classnames: Sequence[str]) -> PromptClassifier:
        """A classifier for other class names with the learned context.

        A unified context is put in front of (or around) each new name, as in
        training, and the text tower turns the prompts into new prototypes. A
        class-specific context has a vector only for the trained classes: it
        serves a subset or reordering of them, and refuses unseen names.
        """

        names = check_classnames(classnames, "with_classnames", warn=True)
        p = self.meta["prompt"]
        if p["csc"]:
            unseen = [n for n in names if n not in self.classnames]
            if unseen:
                raise ExportError(
                    f"cannot classify unseen class(es) {unseen}: this prompt file has a class-specific context "
                    f"(csc=true), one learned context per trained class and none for a new name. Export a "
                    f"unified-context run (adapter.csc=false) to use the prompts with new class names")
            # The k-th time a name is asked for, the k-th trained class of that name (names may repeat, as
            # ImageNet's 'missile'): the trained list itself maps to itself, row for row.
            where: dict[str, list[int]] = {}
            for y, n in enumerate(self.classnames):
                where.setdefault(n, []).append(y)
            used: dict[str, int] = {}
            rows = []
            for n in names:
                k = used[n] = used.get(n, -1) + 1
                rows.append(where[n][min(k, len(where[n]) - 1)])
            idx = torch.tensor(rows, device=self.ctx.device)
            tensors = {"ctx": self.ctx[idx], "prototypes": self.prototypes[idx],
                       "text_features": self.text_features[idx]}
            words = [self.meta["nearest_words"][i] for i in rows]
            return PromptClassifier(self.backbone, tensors, {**self.meta, "classnames": names, "nearest_words": words},
                                    self.path)
        spec = json.dumps(self.meta.get("tokenizer"), sort_keys=True)
        if spec != json.dumps(json.loads(json.dumps(self.backbone.tokenizer_spec)), sort_keys=True):
            raise ExportError(f"prompt file {self.path} was exported with another tokenizer than backbone "
                              f"{self.backbone.name!r} has; new class names would be tokenised differently")
        tensors = {"ctx": self.ctx, **self._prompt_features(names)}
        return PromptClassifier(self.backbone, tensors, {**self.meta, "classnames": names}, self.path)

    @torch.no_grad()
    def _prompt_features(self, names: list[str]) -> dict[str, torch.Tensor]:
        info = adapter_info("coop")  # the registry, not an import: coop.py imports this module for its format
        CoOp, CoOpConfig = info.adapter_cls, info.config_cls
        p = self.meta["prompt"]
        cfg = CoOpConfig(n_ctx=p["n_ctx"], ctx_init=p["ctx_init"], csc=False,
                         class_token_position=p["class_token_position"])
        adapter = CoOp(cfg, self.backbone, names).to(self.backbone.device)  # its own init is overwritten
        if tuple(adapter.ctx.shape) != tuple(self.ctx.shape):
            raise ExportError(f"prompt file {self.path}: ctx has shape {tuple(self.ctx.shape)} but CoOp on "
                              f"{self.backbone.name!r} expects {tuple(adapter.ctx.shape)}")
        adapter.ctx.copy_(self.ctx.to(adapter.ctx.dtype))
        g = self.geometry
        feats = adapter.text_features().float()  # C, D
        return {"text_features": feats, "prototypes": g.prototype(g.embed_text(feats).unsqueeze(1))}


def load(path: Path, meta: dict[str, Any], backbone) -> PromptClassifier:
    """The loader ``fewclip.load_prompts`` calls for a prompt file (metadata and backbone already checked)."""
    tensors = _read_tensors(path, meta)
    check_widths(tensors, backbone, path)
    _check_digests(path, tensors, meta)
    return PromptClassifier(backbone, tensors, meta, path)


@torch.no_grad()
def check_widths(tensors: dict[str, torch.Tensor], backbone, path) -> None:
    """Refuse tensors whose widths do not fit the backbone: ``ctx`` [..., W] against its token embeddings,
    ``prototypes`` [C, D] against its embedded text features."""

    width = TextTower(backbone.model, backbone.tokenizer).width
    raw = backbone.encode_text(["a"])  # 1, D
    want = {"ctx": width, "text_features": raw.shape[-1], "prototypes": backbone.geometry.embed_text(raw).shape[-1]}
    problems = [f"{k} has width {tensors[k].shape[-1]} but {backbone.name!r} needs {w}" for k, w in want.items()
                if tensors[k].shape[-1] != w]
    if problems:
        raise ExportError(f"prompt file {path} does not fit its backbone: " + "; ".join(problems) +
                          ". The file is damaged or was edited; export the run again")


PROMPTS = ExportFormat(name=FORMAT, version=FORMAT_VERSION, default_path="prompts.safetensors", write=write_prompts,
                       load=load, summary=summary, options={"nearest": 3})
