"""What every launcher shares: the ``launcher`` config section, the optional extras, GPU shares.
(The package's docstring describes the launchers.)"""
from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from fewclip.config.sections import LauncherConfig, _positive  # noqa: F401  (re-exported)
from fewclip.utils.errors import InputError
from fewclip.utils.registry import Registry

log = logging.getLogger(__name__)

EXTRAS = {"ray": ("ray", "ray"), "slurm": ("submitit", "slurm")}  # launcher -> (module, extra)


class LauncherError(InputError):
    """A launcher that cannot start (a missing optional dependency, no SLURM here); the message says what to do."""


@dataclass(frozen=True)
class Launcher:
    """A registered launcher. ``run(cfg, specs, progress, *, out, context, poll_s)`` executes the specs
    (``worker.RunSpec``) and reports each result to ``progress``; ``describe(cfg)`` says where, in a few words;
    ``dry_run(cfg, specs, *, out)`` (optional) prints what would be submitted and returns a
    ``progress.Outcome``."""

    name: str
    config_cls: type[LauncherConfig]
    run: Callable[..., None]
    describe: Callable[[Any], str]
    dry_run: Optional[Callable[..., Any]] = None


# A package adds a launcher through the entry point group ``fewclip.launchers`` (fewclip.utils.registry).
LAUNCHERS: Registry[Launcher] = Registry("launcher", "fewclip.launchers", key="launcher.name")


def register_launcher(launcher: Launcher) -> Launcher:
    return LAUNCHERS.register(launcher.name, launcher, source=getattr(launcher.config_cls, "__module__", None))


def require_extra(launcher: str):
    """The optional module a launcher needs, or a LauncherError naming the install command."""
    module, extra = EXTRAS[launcher]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:  # the library itself is absent: how to install it
        if e.name != module.split(".")[0] and e.name != module:
            raise LauncherError(f"launcher={launcher}: {module} is installed but fails to import ({e}); reinstall "
                                f"it: pip install --force-reinstall \"fewclip[{extra}]\"") from None
        raise LauncherError(f"launcher={launcher} needs {module}, which is not installed: "
                            f"pip install \"fewclip[{extra}]\"") from None
    # Installed but broken (a dependency of the wrong version, a damaged install): the library's import can raise
    # anything. A sweep cannot run without its launcher, so it is an error naming the library, not fewclip's bug.
    except (Exception, SystemExit) as e:  # see above
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise LauncherError(f"launcher={launcher}: {module} is installed but fails to import ({why}); reinstall "
                            f"it: pip install --force-reinstall \"fewclip[{extra}]\"") from None


def check_launcher(cfg: LauncherConfig) -> None:
    """Fail early (a LauncherError) when the launcher's optional dependency is missing."""
    if cfg.name in EXTRAS:
        require_extra(cfg.name)


def gpus_for(cfg: LauncherConfig, trains_image_tower: bool) -> float:
    """The GPUs one run asks for: ``gpus_per_run``, rounded up to whole GPUs for a run that trains the image
    tower (its activations and optimiser state do not share a GPU well)."""
    share = float(getattr(cfg, "gpus_per_run", 0.0))
    if share > 0 and trains_image_tower:
        return float(max(1, math.ceil(share)))
    return share
