"""fewclip.adapters: trainable modules on top of a frozen backbone.

Each adapter registers itself with ``register_adapter`` next to its class;
this file imports every adapter module explicitly.
"""
from .base import ADAPTERS, Adapter, AdapterConfig, AdapterError, adapter_info, build_adapter, register_adapter
from . import coop, linear_probe, lora  # noqa: F401  (registration)
