"""fewclip's checkpoint formats, one module each; importing this package registers them (``fewclip.backbones.importer``
holds the interface; the registry finds this package through the ``fewclip.formats`` entry point)."""
from fewclip.backbones.formats import euclip, meru, open_clip, openai  # noqa: F401  (registration)
