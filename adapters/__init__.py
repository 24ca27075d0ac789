"""fewclip.adapters: fewclip's own few-shot methods, one module each.

Importing this package registers every method here (fewclip's registry loads it through the
``fewclip.adapters`` entry point, as it loads a plugin's); the interface they implement is
``fewclip.adapter.base``, re-exported here for convenience.
"""
from fewclip.adapter.base import (
                             ADAPTERS,
                             EXPORT_FORMATS,
                             Adapter,
                             AdapterConfig,
                             AdapterError,
                             ExportFormat,
                             adapter_info,
                             build_adapter,
                             export_format,
                             register_adapter,
)
from fewclip.adapters import (  # noqa: F401  (registration)  # noqa: F401  (registration)  # noqa: F401  (registration)  # noqa: F401  (registration)  # noqa: F401  (registration)
                             clap,
                             clip_adapter,
                             cocoop,
                             coop,
                             coprompt,
                             dept,
                             gda,
                             ivlp,
                             kgcoop,
                             linear_probe,
                             lora,
                             lpp,
                             maple,
                             mmrl,
                             prograd,
                             proker,
                             prolip,
                             promptsrc,
                             taskres,
                             tcp,
                             tip_adapter,
                             tip_adapter_f,
                             zeroshot,
                             zs_probe,
)

__all__ = ["ADAPTERS", "EXPORT_FORMATS", "Adapter", "AdapterConfig", "AdapterError", "ExportFormat", "adapter_info",
           "build_adapter", "export_format", "register_adapter"]
from fewclip.adapters import (
                             clip_svd,  # noqa: F401  (registration)
                             skiptuning,  # noqa: F401  (registration)
                             twosfs,  # noqa: F401  (registration)
)
