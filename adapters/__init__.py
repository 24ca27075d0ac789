"""fewclip.adapters: fewclip's own few-shot methods, one module each.

Importing this package registers every method here (fewclip's registry loads it through the
``fewclip.adapters`` entry point, as it loads a plugin's); the interface they implement is
``fewclip.adapter.base``, re-exported here for convenience.
"""
from fewclip.adapter.base import (ADAPTERS, EXPORT_FORMATS, Adapter, AdapterConfig, AdapterError, ExportFormat, adapter_info,
                             build_adapter, export_format, register_adapter)

from fewclip.adapters import cocoop, coop, kgcoop, linear_probe, lora, prograd, tcp, zeroshot, zs_probe  # noqa: F401  (registration)
from fewclip.adapters import clap, clip_adapter, lpp, taskres, tip_adapter, tip_adapter_f  # noqa: F401  (registration)
from fewclip.adapters import gda, proker, prolip  # noqa: F401  (registration)
from fewclip.adapters import ivlp, maple, promptsrc  # noqa: F401  (registration)
from fewclip.adapters import coprompt, dept, mmrl  # noqa: F401  (registration)

__all__ = ["ADAPTERS", "EXPORT_FORMATS", "Adapter", "AdapterConfig", "AdapterError", "ExportFormat", "adapter_info",
           "build_adapter", "export_format", "register_adapter"]
from fewclip.adapters import clip_svd  # noqa: F401  (registration)
from fewclip.adapters import twosfs  # noqa: F401  (registration)
from fewclip.adapters import skiptuning  # noqa: F401  (registration)
