"""fewclip.adapters: fewclip's own few-shot methods, one module each.

Importing this package registers every method here (fewclip's registry loads it through the
``fewclip.adapters`` entry point, as it loads a plugin's); the interface they implement is
``fewclip.adapter``, re-exported here for convenience.
"""
from fewclip.adapter import (ADAPTERS, EXPORT_FORMATS, Adapter, AdapterConfig, AdapterError, ExportFormat, adapter_info,
                             build_adapter, export_format, register_adapter)

from . import cocoop, coop, kgcoop, linear_probe, lora, prograd, tcp, zeroshot  # noqa: F401  (registration)
from . import clap, clip_adapter, lpp, taskres, tip_adapter, tip_adapter_f  # noqa: F401  (registration)
from . import gda, proker, prolip  # noqa: F401  (registration)
from . import ivlp, maple, promptsrc  # noqa: F401  (registration)
from . import coprompt, dept, mmrl  # noqa: F401  (registration)

__all__ = ["ADAPTERS", "EXPORT_FORMATS", "Adapter", "AdapterConfig", "AdapterError", "ExportFormat", "adapter_info",
           "build_adapter", "export_format", "register_adapter"]
from . import clip_svd  # noqa: F401  (registration)
from . import twosfs  # noqa: F401  (registration)
from . import skiptuning  # noqa: F401  (registration)
