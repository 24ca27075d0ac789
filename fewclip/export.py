"""Exported prompts: a CoOp run as one self-describing ``.safetensors`` file.

``fewclip export RUN_DIR -o prompts.safetensors`` turns a finished CoOp run
into a classifier that needs only the frozen backbone::

    fewclip export runs/coop -o prompts.safetensors
    fewclip predict prompts=prompts.safetensors cat.jpg dog.png top_k=3

and from Python::

    import fewclip
    clf = fewclip.load_prompts("prompts.safetensors")      # loads and checks the backbone
    clf.predict([Image.open("cat.jpg")], top_k=3)          # [[("tabby", 0.91), ...]]
    clf.with_classnames(["lynx", "ocelot"])                # unified context only

The file
--------
Tensors (float32):

* ``ctx``            learned context vectors, ``[n_ctx, W]`` (unified) or ``[C, n_ctx, W]`` (class-specific)
* ``prototypes``     one point per class in the geometry's space, ``[C, D]``: what the logits compare against
* ``text_features``  raw text-tower outputs of the learned prompts, ``[C, D]``

One metadata entry, ``"fewclip"``, holds a JSON object with: ``format``
(``"fewclip.prompts"``), ``format_version``, ``fewclip_version``,
``backbone`` (``name``, ``source``, ``weights_sha256`` of its weights file,
``state_sha256`` (a checksum of the loaded state dict, only where no weights
file checksum exists, e.g. open_clip pretrained tags), and ``config``, the
``backbone`` section to load it again), ``geometry`` (``name``, ``params``),
``preprocess`` (``image_size``, ``mean``, ``std``), ``tokenizer``,
``classnames``, ``prompt`` (``class_token_position``, ``n_ctx``, ``csc``,
``ctx_init``), ``nearest_words`` (CoOp's reading of the context: the ``k``
vocabulary tokens nearest to each vector, ``[n_ctx][k]`` for a unified
context, ``[C][n_ctx][k]`` in class order for a class-specific one),
``nearest_k``, and ``run`` (``dir``, ``dataset``, ``shots``, ``seed``,
``top1``).

Probabilities
-------------
``predict`` reports a softmax over the file's classes for every geometry,
the closed-set class posterior that CoOp is trained for (cross-entropy over
the classes). For the ``sigmoid`` geometry (SigLIP) the logit bias is a
constant that cancels in the softmax; SigLIP's per-pair sigmoid match
probabilities are ``torch.sigmoid(clf.logits(images))`` if you want them.

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
Lorentz distance: ``fewclip.geometry`` (``exp_map0``, ``lorentz_distance``)
holds each formula as a small tensor function.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

log = logging.getLogger(__name__)

FORMAT = "fewclip.prompts"
FORMAT_VERSION = 1
METADATA_KEY = "fewclip"
TENSORS = ("ctx", "prototypes", "text_features")
# Keys every file's metadata must have (and what each must be).
_REQUIRED = {"format": str, "format_version": int, "backbone": dict, "geometry": dict, "classnames": list,
             "prompt": dict, "preprocess": dict}


class ExportError(ValueError):
    """A run that cannot be exported, or a prompt file or image that cannot be used; the message says which."""


# ---------------------------------------------------------------------------
# backbone identity
# ---------------------------------------------------------------------------


def state_sha256(model: torch.nn.Module) -> str:
    """A checksum of a model's state dict (names, shapes, float32 values), for weights without a file checksum."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu()
        t = (t.float() if t.is_floating_point() else t).contiguous()
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def backbone_identity(backbone, cfg=None) -> Dict[str, Any]:
    """What names a backbone in a prompt file: name, source, checksum, and the config section to load it."""
    ident = {
        "name": backbone.name,
        "source": backbone.source,
        "weights_sha256": backbone.weights_sha256,
        "state_sha256": None if backbone.weights_sha256 else state_sha256(backbone.model),
    }
    if cfg is not None:
        ident["config"] = {"name": cfg.name, "pretrained": cfg.pretrained, "geometry": cfg.geometry,
                           "precision": cfg.precision}
        if cfg.local_attention.active:
            from omegaconf import OmegaConf

            ident["config"]["local_attention"] = OmegaConf.to_container(OmegaConf.structured(cfg.local_attention))
    return ident


def check_backbone(meta: Dict[str, Any], backbone, path: Union[str, Path]) -> None:
    """Refuse a backbone whose weights are not the ones the prompt file was exported from."""
    want = meta["backbone"]
    if want.get("weights_sha256"):
        have, kind = backbone.weights_sha256, "weights sha256"
        want_sum = want["weights_sha256"]
    else:
        have, kind = state_sha256(backbone.model), "state-dict sha256"
        want_sum = want.get("state_sha256")
    if not want_sum or have != want_sum:
        raise ExportError(
            f"prompt file {path} was exported from another backbone: it names {want.get('name')!r} with {kind} "
            f"{str(want_sum)[:16]}..., but the loaded backbone {backbone.name!r} ({backbone.source}) has "
            f"{str(have)[:16]}.... Prompts only work with the exact weights they were learned on."
        )
    g = meta["geometry"]
    if g["name"] != backbone.geometry.name:
        raise ExportError(f"prompt file {path} uses the {g['name']!r} geometry but backbone {backbone.name!r} "
                          f"has {backbone.geometry.name!r}")


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------


@torch.no_grad()
def prompt_tensors(adapter) -> Dict[str, torch.Tensor]:
    """The tensors of a prompt file for a CoOp adapter: ctx, prototypes [C, D], text_features [C, D]."""
    return {
        "ctx": adapter.ctx.detach().float().cpu().contiguous(),
        "prototypes": adapter.prototypes().float().cpu().contiguous(),
        "text_features": adapter.text_features().float().cpu().contiguous(),
    }


def backbone_metadata(bb, backbone_cfg=None) -> Dict[str, Any]:
    """The metadata every export carries about its backbone: identity, geometry, preprocessing, tokenizer."""
    return {
        "backbone": backbone_identity(bb, backbone_cfg),
        "geometry": {"name": bb.geometry.name, "params": bb.geometry.params()},
        "preprocess": {"image_size": bb.image_size, "mean": list(bb.mean), "std": list(bb.std)},
        "tokenizer": bb.tokenizer_spec,
    }


def backbone_from_metadata(meta: Dict[str, Any], path, device: str,
                           backbone_overrides: Optional[Dict[str, Any]] = None):
    """Load the backbone an export names (its stored config section, with overrides)."""
    from .backbones import backbone_config_from_dict, load_backbone

    stored = dict(meta["backbone"].get("config") or {"name": meta["backbone"]["name"]})
    stored.update(backbone_overrides or {})
    stored["device"] = device
    try:
        cfg = backbone_config_from_dict(stored)
    except (TypeError, ValueError) as e:
        raise ExportError(f"{path}: cannot make a backbone config from {stored}: {e}") from None
    return load_backbone(cfg)


def prompt_metadata(adapter, *, backbone_cfg=None, run: Optional[Dict[str, Any]] = None,
                    nearest_k: int = 3) -> Dict[str, Any]:
    """The JSON metadata of a prompt file for a CoOp adapter (see the module docstring for the keys)."""
    from . import __version__

    bb = adapter.backbone
    cfg = adapter.cfg
    words = adapter.nearest_words(nearest_k)  # [groups][n_ctx][k]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "fewclip_version": __version__,
        **backbone_metadata(bb, backbone_cfg),
        "classnames": list(adapter.classnames),
        "prompt": {"class_token_position": cfg.class_token_position, "n_ctx": int(adapter.n_ctx),
                   "csc": bool(cfg.csc), "ctx_init": cfg.ctx_init},
        "nearest_k": int(nearest_k),
        "nearest_words": words if cfg.csc else words[0],
        "run": dict(run or {}),
    }


def write_prompts(path: Union[str, Path], tensors: Dict[str, torch.Tensor], meta: Dict[str, Any]) -> Path:
    """Write a prompt file atomically."""
    from safetensors.torch import save_file

    from .io import atomic_write

    text = json.dumps(meta, sort_keys=False)
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={METADATA_KEY: text}))


def export_prompts(adapter, path: Union[str, Path], *, backbone_cfg=None, run: Optional[Dict[str, Any]] = None,
                   nearest_k: int = 3) -> Dict[str, Any]:
    """Write a CoOp adapter's prompts to ``path``; returns the metadata written."""
    from fewclip.adapters.coop import CoOp

    if not isinstance(adapter, CoOp):
        raise ExportError(f"cannot export adapter {getattr(adapter, 'name', type(adapter).__name__)!r}: "
                          f"fewclip export writes CoOp prompts (learned context vectors) and supports "
                          f"adapter=coop only")
    meta = prompt_metadata(adapter, backbone_cfg=backbone_cfg, run=run, nearest_k=nearest_k)
    write_prompts(path, prompt_tensors(adapter), meta)
    return meta


@dataclass
class Exported:
    path: Path
    meta: Dict[str, Any]


def export_run(run_dir: Union[str, Path], out: Union[str, Path, None] = None, *, nearest_k: int = 3,
               merge: bool = False, device: Optional[str] = None, backbone=None) -> Exported:
    """Export a finished run directory: a CoOp run as a prompt file (default ``RUN_DIR/prompts.safetensors``),
    a LoRA run as a folder (default ``RUN_DIR/export``, see ``fewclip.lora_export``; ``merge`` adds the
    merged open_clip weights).

    The adapter is rebuilt from ``config.yaml``, the class names of ``split.json``, the templates in
    ``metrics.json`` and ``adapter.safetensors``; no dataset files are read.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    from fewclip.adapters import build_adapter
    from fewclip.datasets import DatasetError, read_split

    from .backbones import load_backbone
    from .config import ConfigError
    from .io import read_json
    from .runs import load_train_config

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ExportError(f"{run_dir} is not a run directory (no config.yaml); pass the folder `fewclip train` wrote")
    try:
        cfg = load_train_config([str(run_dir / "config.yaml")])
    except ConfigError as e:
        raise ExportError(f"cannot read the config of run {run_dir}: {e}") from None
    name = cfg.adapter.name
    if name not in ("coop", "lora"):
        raise ExportError(f"run {run_dir} was trained with adapter {name!r}; fewclip export writes CoOp prompts "
                          f"(learned context vectors) or LoRA weights, and supports adapter=coop and adapter=lora "
                          f"runs only")
    if merge and name != "lora":
        raise ExportError("merge=true applies to LoRA runs (it folds the low-rank updates into the weights)")
    for f in ("adapter.safetensors", "split.json", "metrics.json"):
        if not (run_dir / f).is_file():
            raise ExportError(f"run {run_dir} is not finished: it has no {f}")
    try:
        split = read_split(run_dir / "split.json")
    except DatasetError as e:
        raise ExportError(str(e)) from None
    metrics = read_json(run_dir / "metrics.json")
    templates = metrics.get("templates") or []
    if name == "lora" and not templates:
        raise ExportError(f"run {run_dir}: metrics.json does not list the prompt templates the run used; "
                          f"re-run it with this version of fewclip")
    if device is not None:
        cfg.backbone.device = device
    backbone = backbone or load_backbone(cfg.backbone)

    weights = run_dir / "adapter.safetensors"
    try:
        with safe_open(str(weights), "pt") as f:
            trained_on = (f.metadata() or {}).get("weights_sha256")
        sd = load_file(str(weights))
    except Exception as e:
        raise ExportError(f"cannot read {weights}: {e}") from None
    if trained_on and backbone.weights_sha256 and trained_on != backbone.weights_sha256:
        raise ExportError(f"run {run_dir} was trained on backbone weights with sha256 {trained_on[:16]}... but "
                          f"{backbone.name!r} now loads {backbone.weights_sha256[:16]}...; what it learned fits the "
                          f"old weights only")
    with torch.random.fork_rng(devices=[]):  # a random init must not move the caller's RNG
        adapter = build_adapter(cfg.adapter, backbone, split.classnames, templates)
    try:
        adapter.load_adapter_state_dict(sd)
    except RuntimeError as e:
        raise ExportError(f"{weights} does not match the run's {name} config: {e}") from None

    run = {"dir": str(run_dir), "dataset": split.dataset or cfg.data.name, "shots": cfg.shots, "seed": cfg.seed,
           "top1": metrics.get("top1")}
    if name == "lora":
        from .lora_export import export_lora

        return export_lora(adapter, out if out is not None else run_dir / "export", merge=merge,
                           backbone_cfg=cfg.backbone, run=run)
    out = Path(out) if out is not None else run_dir / "prompts.safetensors"
    meta = export_prompts(adapter, out, backbone_cfg=cfg.backbone, run=run, nearest_k=nearest_k)
    return Exported(out, meta)


def summary(path: Union[str, Path], meta: Dict[str, Any]) -> str:
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


def read_prompts(path: Union[str, Path]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Read and validate a prompt file: (tensors on CPU, metadata). Any problem is an ExportError naming it."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ExportError(f"prompt file not found: {path}")
    try:
        with safe_open(str(path), "pt") as f:
            raw_meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # truncated or not safetensors at all
        raise ExportError(f"prompt file {path} is damaged or not a safetensors file ({e})") from None
    if METADATA_KEY not in raw_meta:
        raise ExportError(f"prompt file {path} has no {METADATA_KEY!r} metadata: not a file written by fewclip export")
    try:
        meta = json.loads(raw_meta[METADATA_KEY])
    except ValueError as e:
        raise ExportError(f"prompt file {path}: its {METADATA_KEY!r} metadata is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ExportError(f"prompt file {path}: its {METADATA_KEY!r} metadata must be a JSON object")
    if meta.get("format") != FORMAT:
        raise ExportError(f"prompt file {path} is not a fewclip prompt file (format {meta.get('format')!r}, "
                          f"expected {FORMAT!r})")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise ExportError(f"prompt file {path} has format version {version!r}; this fewclip reads version "
                          f"{FORMAT_VERSION}" + (" (written by a newer fewclip: upgrade)" if newer else ""))
    for key, typ in _REQUIRED.items():
        if not isinstance(meta.get(key), typ):
            raise ExportError(f"prompt file {path}: metadata key {key!r} is missing or not a {typ.__name__}")
    for key, typ in (("name", str), ("params", dict)):
        if not isinstance(meta["geometry"].get(key), typ):
            raise ExportError(f"prompt file {path}: metadata geometry.{key} is missing or not a {typ.__name__}")
    for key in ("class_token_position", "n_ctx", "csc", "ctx_init"):
        if key not in meta["prompt"]:
            raise ExportError(f"prompt file {path}: metadata prompt.{key} is missing")
    if not meta["backbone"].get("name") or not (meta["backbone"].get("weights_sha256")
                                                or meta["backbone"].get("state_sha256")):
        raise ExportError(f"prompt file {path}: metadata backbone needs a name and a weights checksum")
    _check_tensors(path, tensors, meta)
    return tensors, meta


def _check_tensors(path: Path, tensors: Dict[str, torch.Tensor], meta: Dict[str, Any]) -> None:
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
    for k in TENSORS:
        t = tensors[k]
        if not t.is_floating_point() or not torch.isfinite(t).all():
            problems.append(f"{k} holds non-finite or non-float values")
    if problems:
        raise ExportError(f"prompt file {path} is damaged: " + "; ".join(problems))


# ---------------------------------------------------------------------------
# the classifier
# ---------------------------------------------------------------------------

ImageInput = Union["PIL.Image.Image", str, Path, torch.Tensor, Sequence[Any]]  # noqa: F821


def load_image(path: Union[str, Path]):
    """An RGB PIL image; an unreadable file is an ExportError naming it."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise ExportError(f"image not found: {path}")
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise ExportError(f"cannot read image {path}: {e}") from None


class PromptClassifier:
    """Images -> class logits with exported prompts on a frozen backbone.

    ``prototypes`` [C, D] are compared with the embedded image features by the
    file's geometry (built from its stored parameters).
    """

    def __init__(self, backbone, tensors: Dict[str, torch.Tensor], meta: Dict[str, Any], path: Optional[Path] = None):
        from .geometry import make_geometry

        self.backbone = backbone
        self.meta = meta
        self.path = path
        self.classnames: List[str] = list(meta["classnames"])
        device = backbone.device
        g = meta["geometry"]
        try:
            self.geometry = make_geometry(g["name"], **g["params"]).to(device)
        except (ValueError, TypeError) as e:
            raise ExportError(f"prompt file {path}: bad geometry {g}: {e}") from None
        self.ctx = tensors["ctx"].to(device)
        self.prototypes = tensors["prototypes"].to(device)  # C, D
        self.text_features = tensors["text_features"].to(device)  # C, D

    def __repr__(self) -> str:
        p = self.meta["prompt"]
        return (f"PromptClassifier({len(self.classnames)} classes, {self.backbone.name} [{self.geometry.name}], "
                f"n_ctx={p['n_ctx']}, {'csc' if p['csc'] else 'unified'})")

    # -- images -> logits --------------------------------------------------
    def pixels(self, images: ImageInput) -> torch.Tensor:
        """Preprocessed pixels [B, 3, H, W] from PIL images, image paths, or a pixel tensor (passed through)."""
        if isinstance(images, torch.Tensor):
            return images.unsqueeze(0) if images.dim() == 3 else images
        if not isinstance(images, (list, tuple)):
            images = [images]
        tf = self.backbone.preprocess()
        out = [tf(load_image(im) if isinstance(im, (str, Path)) else im.convert("RGB")) for im in images]
        return torch.stack(out) if out else torch.empty(0, 3, self.backbone.image_size, self.backbone.image_size)

    @torch.no_grad()
    def logits_from_features(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw image-tower features [B, D] -> logits [B, C]."""
        return self.geometry.image_logits(raw, self.prototypes)

    @torch.no_grad()
    def logits(self, images: ImageInput, batch_size: int = 256) -> torch.Tensor:
        """Logits [B, C] for PIL images, image paths, or preprocessed pixels [B, 3, H, W]."""
        px = self.pixels(images)
        outs = [self.logits_from_features(self.backbone.encode_images(px[i : i + batch_size]))
                for i in range(0, len(px), batch_size)]
        return torch.cat(outs) if outs else torch.empty(0, len(self.classnames), device=self.prototypes.device)

    def probabilities(self, images: ImageInput) -> torch.Tensor:
        """Softmax over the classes [B, C], for every geometry (see the module docstring)."""
        return self.logits(images).softmax(-1)

    def predict(self, images: ImageInput, top_k: int = 5) -> List[List[Tuple[str, float]]]:
        """The ``top_k`` (class name, probability) pairs of each image, most probable first."""
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        probs = self.probabilities(images).cpu()
        top = probs.topk(min(top_k, len(self.classnames)), dim=-1)
        return [[(self.classnames[int(i)], float(v)) for v, i in zip(vals, idx)]
                for vals, idx in zip(top.values, top.indices)]

    # -- new class names ---------------------------------------------------
    def with_classnames(self, classnames: Sequence[str]) -> "PromptClassifier":
        """A classifier for other class names with the learned context.

        A unified context is put in front of (or around) each new name, as in
        training, and the text tower turns the prompts into new prototypes. A
        class-specific context has a vector only for the trained classes: it
        serves a subset or reordering of them, and refuses unseen names.
        """
        names = list(classnames)
        if not names:
            raise ValueError("with_classnames needs at least one class name")
        p = self.meta["prompt"]
        if p["csc"]:
            unseen = [n for n in names if n not in self.classnames]
            if unseen:
                raise ExportError(
                    f"cannot classify unseen class(es) {unseen}: this prompt file has a class-specific context "
                    f"(csc=true), one learned context per trained class and none for a new name. Export a "
                    f"unified-context run (adapter.csc=false) to use the prompts with new class names")
            rows = [self.classnames.index(n) for n in names]
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
    def _prompt_features(self, names: List[str]) -> Dict[str, torch.Tensor]:
        from fewclip.adapters.coop import CoOp, CoOpConfig

        p = self.meta["prompt"]
        cfg = CoOpConfig(n_ctx=p["n_ctx"], ctx_init=p["ctx_init"], csc=False,
                         class_token_position=p["class_token_position"])
        with torch.random.fork_rng(devices=[]):
            adapter = CoOp(cfg, self.backbone, names).to(self.backbone.device)
        if tuple(adapter.ctx.shape) != tuple(self.ctx.shape):
            raise ExportError(f"prompt file {self.path}: ctx has shape {tuple(self.ctx.shape)} but CoOp on "
                              f"{self.backbone.name!r} expects {tuple(adapter.ctx.shape)}")
        adapter.ctx.copy_(self.ctx.to(adapter.ctx.dtype))
        g = self.geometry
        feats = adapter.text_features().float()  # C, D
        return {"text_features": feats, "prototypes": g.prototype(g.embed_text(feats).unsqueeze(1))}


def load_prompts(path: Union[str, Path], device: str = "auto", *, backbone=None,
                 backbone_overrides: Optional[Dict[str, Any]] = None) -> PromptClassifier:
    """Load a prompt file and the backbone it names; refuse a backbone with other weights.

    ``backbone`` reuses an already loaded backbone (still checked);
    ``backbone_overrides`` changes fields of the stored backbone config, e.g.
    ``{"name": "path/to/card.yaml"}`` when the card has moved.
    """
    from .lora_export import is_lora_export, load_lora_export

    path = Path(path)
    if is_lora_export(path):
        return load_lora_export(path, device, backbone=backbone, backbone_overrides=backbone_overrides)
    tensors, meta = read_prompts(path)
    if backbone is None:
        backbone = backbone_from_metadata(meta, f"prompt file {path}", device, backbone_overrides)
    check_backbone(meta, backbone, path)
    return PromptClassifier(backbone, tensors, meta, path)
