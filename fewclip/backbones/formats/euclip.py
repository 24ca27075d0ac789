"""EuCLIP checkpoints: the open_clip fork of Chou et al., "Embedding Geometries of Contrastive
Language-Image Pre-Training" (2024), branch ``euclip`` of github.com/EIFY/open_clip.

The fork trains with open_clip_train and saves its checkpoints (``{"epoch", "name",
"state_dict", ...}``, ``module.`` prefixes). What the file does not carry:

- the geometry: the training flag ``--geometry`` (``clip``, ``elliptic``, ``euclidean``,
  ``euclidean-squared``, ``hyperbolic``, ``hyperbolic-squared``, and the ``-inner`` variants,
  which fewclip has no geometry for). ``geometry=`` is required; the fork's names and
  fewclip's are both accepted.
- the architecture (``--model``): ``model=``, where the fork's ``ARCH-no-final-ln`` configs
  (``"final_layernorm": false`` in both towers) become open_clip's ARCH with ``final_ln: false``,
  or ``model_config=`` with the fork's JSON.

What it reads (``src/open_clip/model.py`` and ``loss.py`` of the fork): the logit scale
(``logit_scale``, a log, kept within ``[0, ln 100]`` by the training loop), and for the
hyperbolic geometries ``alpha_img``, ``alpha_txt`` and ``curvature``, all logs, the
curvature clamped to ``[0.1, 10]`` after ``exp`` as ``CLIP.forward`` does. The fork scales
Euclidean embeddings by ``sqrt(1 / embed_dim)``, fewclip's ``euclidean`` geometries divide
by ``sqrt(D)``: the same; its hyperbolic metric lifts ``alpha * feature`` with the
exponential map at the origin, as fewclip's (MERU's) does, but without MERU's cap on the
input of ``sinh`` (``exp_map_clamp: false`` in the card: with the cap, a tangent vector of
norm above ``asinh(2^15) / sqrt(c)`` would land elsewhere).
"""
from __future__ import annotations

import math
from pathlib import Path

from fewclip.backbones.backbone import EUCLIP_GEOMETRY_KEYS
from fewclip.backbones.formats.open_clip import (
    check_final_ln,
    check_open_clip_keys,
    open_clip_state_dict,
    preprocess,
    read_tokenizer,
    resolve_model,
)
from fewclip.backbones.geometry import canonical_geometry
from fewclip.backbones.importer import CheckpointImportError, Format, Imported, register_format
from fewclip.backbones.preprocess import PREPROCESS_OPTIONS

CURVATURE_RANGE = (0.1, 10.0)  # the fork's CLIP.forward: torch.clamp(self.curvature.exp(), min=0.1, max=10.)
GEOMETRIES = ("clip", "elliptic", "euclidean", "euclidean_sq", "hyperbolic", "hyperbolic_sq")


def read_euclip(path: Path, options: dict[str, str]) -> Imported:
    try:
        geometry = canonical_geometry(options["geometry"])
    except ValueError as e:
        raise CheckpointImportError(f"geometry={options['geometry']}: {e}") from None
    if geometry not in GEOMETRIES:
        raise CheckpointImportError(f"geometry={options['geometry']} is not one the EuCLIP fork trains with; one of "
                                    f"clip, elliptic, euclidean, euclidean-squared, hyperbolic, hyperbolic-squared")
    arch_entry, model_cfg, final_ln, notes = resolve_model(options)
    arch = arch_entry.get("architecture")
    tok_card, hf_tok, tok_note = read_tokenizer(model_cfg, arch, options, f"model {arch or options.get('model_config')}")
    sd = check_open_clip_keys(open_clip_state_dict(path), model_cfg, path, "euclip", options.get("model"))
    check_final_ln(sd, final_ln, options.get("model"), path, "euclip")
    pre, pre_note = preprocess(model_cfg, options, arch, tags=False)

    hyperbolic = geometry.startswith("hyperbolic")
    held = [k for k in EUCLIP_GEOMETRY_KEYS if k in sd]
    if hyperbolic and len(held) != len(EUCLIP_GEOMETRY_KEYS):
        raise CheckpointImportError(
            f"geometry={options['geometry']}: the fork's hyperbolic models store {', '.join(EUCLIP_GEOMETRY_KEYS)}, "
            f"and {path} holds {held or 'none of them'}: was it trained with --geometry {options['geometry']}?")
    if not hyperbolic and held:
        raise CheckpointImportError(
            f"{path} holds {', '.join(held)}, which only the fork's hyperbolic models have, but geometry="
            f"{options['geometry']}: check the --geometry it was trained with")
    scale = math.exp(float(sd["logit_scale"].float().reshape(-1)[0]))
    params: dict[str, float] = {"logit_scale": scale}
    if "logit_bias" in sd:
        if geometry != "clip":
            raise CheckpointImportError(
                f"{path} holds a logit_bias (the fork's --siglip loss) with geometry {geometry}; fewclip's sigmoid "
                f"geometry is cosine with a bias, and has no sigmoid variant of {geometry}")
        geometry, params["logit_bias"] = "sigmoid", float(sd["logit_bias"].float().reshape(-1)[0])
    if hyperbolic:
        log_c = float(sd.pop("curvature").float())
        curvature = min(max(math.exp(log_c), CURVATURE_RANGE[0]), CURVATURE_RANGE[1])
        if curvature != math.exp(log_c):
            notes.append(f"curvature: stored exp(log) {math.exp(log_c):.6g} clamped to {curvature} as the fork's "
                         f"CLIP.forward does")
        params.update(curvature=curvature, alpha_image=math.exp(float(sd.pop("alpha_img").float())),
                      alpha_text=math.exp(float(sd.pop("alpha_txt").float())), exp_map_clamp=False)
        notes.append("exponential map without MERU's cap on sinh's input, as the fork's _exponential_map")
    notes += [f"geometry: {geometry} (given: {options['geometry']}), parameters from the stored logs",
              f"final LayerNorms: {'kept' if final_ln else 'removed (final_ln: false)'}", tok_note, pre_note]
    card = {"description": f"imported from {path.name} (EuCLIP, --geometry {options['geometry']})", **arch_entry,
            "final_ln": final_ln, "tokenizer": tok_card, "geometry": {"name": geometry, **params}, "preprocess": pre.card_section()}
    return Imported(weights=sd, card=card, notes=notes, hf_tokenizer=hf_tok)


register_format(Format(
    name="euclip",
    read=read_euclip,
    options={
        "geometry": "the --geometry it was trained with: clip, elliptic, euclidean, euclidean-squared, hyperbolic or "
                    "hyperbolic-squared (not stored in the checkpoint)",
        "model": "the --model it was trained with: an open_clip name or the fork's ARCH-no-final-ln",
        "model_config": "instead of model=: the fork's model-config JSON",
        "tokenizer": "a folder holding the Hugging Face tokenizer the model names, if not in the cache",
        **PREPROCESS_OPTIONS,
    },
    required=("geometry",),
    summary="EuCLIP (the paper's open_clip fork, branch euclip): open_clip_train checkpoints of any geometry",
))
