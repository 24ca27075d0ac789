"""fewclip.adapters: trainable modules on top of a frozen backbone.

Each adapter registers itself with ``register_adapter`` next to its class;
this file imports every adapter module explicitly.
"""
