"""One small registry for every kind of thing fewclip can be told to use, open to other packages.

Each kind (adapters, datasets, geometries, checkpoint formats, launchers, export formats) is one
``Registry``. A name is registered once, beside the object it names::

    ADAPTERS.register("coop", AdapterInfo(...))

and looked up by the core with ``get`` (an unknown name is an error that lists the close matches and the
command that lists them all). The core never imports a method's or a dataset's module by name: a
registry loads its Python entry points (``importlib.metadata``, group ``fewclip.adapters`` and so on) the
first time it is asked, and importing an entry point's module registers what it holds. fewclip's own
methods, datasets and formats come in through the same door: its ``pyproject.toml`` declares
``fewclip.adapters = "fewclip.adapters"`` and so on. A pip-installed package adds a method with::

    [project.entry-points."fewclip.adapters"]
    my_method = "my_package.my_method"     # a module whose import calls register_adapter(...)

An entry point may also name a callable (``"my_package:register"``), which is called with no argument.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import logging
from collections.abc import Callable, Iterator
from typing import Generic, Optional, TypeVar

from fewclip.utils.errors import InputError

log = logging.getLogger(__name__)
T = TypeVar("T")


class UnknownNameError(InputError):
    """A name that no registry entry has; the message lists the close ones."""


class PluginError(InputError):
    """An entry point that could not be loaded; the message names the package to fix or remove."""


class DuplicateNameError(InputError):
    """A name registered twice; the message names the plugin to change."""


def is_builtin(module: str) -> bool:
    """Whether ``module`` is part of fewclip itself (not a plugin)."""
    return module == "fewclip" or module.startswith("fewclip.")


class Registry(Generic[T]):
    """Names -> objects of one kind, filled by ``register`` and by the entry points of ``group``.

    ``kind`` is the singular noun used in messages ("adapter"); ``key`` is the config key that selects one
    ("adapter.name"), and ``listing`` the command that lists them ("fewclip adapters").
    """

    def __init__(self, kind: str, group: str, *, key: str = "", listing: str = "", lowercase: bool = True):
        self.kind, self.group, self.key, self.listing = kind, group, key, listing
        self.lowercase = lowercase
        self._items: dict[str, T] = {}
        self._sources: dict[str, str] = {}
        self._loaded = False
        self._loading = False

    # -- filling ---------------------------------------------------------------------------------
    def register(self, name: str, obj: T, source: Optional[str] = None) -> T:
        """Add ``obj`` under ``name``; a name registered twice is an error (two packages claiming it).
        ``source``: the module that provides it (shown by ``source()``; default: ``obj``'s module)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        if self.lowercase and name != name.lower():
            raise ValueError(f"{self.kind} names are lowercase, got {name!r}")
        source = source or getattr(obj, "__module__", None) or type(obj).__module__
        if name in self._items and self._items[name] is not obj:
            raise DuplicateNameError(self._duplicate(name, self._sources[name], source))
        self._items[name] = obj
        self._sources[name] = source
        return obj

    def _duplicate(self, name: str, first: str, second: str) -> str:
        """The message for ``name`` registered by ``first`` and then by ``second``: where one of them is fewclip's
        own, the other (a plugin) is the one to rename, whichever was imported first."""
        plugin = [s for s in (first, second) if not is_builtin(s)]
        if len(plugin) == 1:
            return (f"the {self.kind} name {name!r} is fewclip's own; the plugin module {plugin[0]} registers it "
                    f"again: rename it in that plugin (or uninstall the package that provides it)")
        return f"{self.kind} {name!r} is registered twice (first by {first}, then by {second}); rename one of them"

    def pop(self, name: str, *default):
        """Remove ``name`` and return its object (tests that register throwaway entries)."""
        self._sources.pop(name, None)
        return self._items.pop(name, *default)

    def load(self) -> None:
        """Load the entry points of ``group`` once (each plugin's import registers its entries)."""
        if self._loaded or self._loading:
            return
        self._loading = True
        try:
            # fewclip's own entries first, so a plugin claiming one of their names fails in its own import.
            for ep in sorted(entry_points_of(self.group), key=lambda ep: not is_builtin(ep.value)):
                # Another package's code runs here (its module's import, then its register callable): anything it
                # raises, SystemExit included (a plugin that calls sys.exit() on import would otherwise end every
                # command with its exit code and no message), is that plugin failing, named as such. Ctrl-C is not.
                try:
                    obj = ep.load()
                    if callable(obj) and not isinstance(obj, type) and not hasattr(obj, "__path__"):
                        obj()
                except DuplicateNameError as e:  # its message already names the plugin at fault
                    raise PluginError(f"{e} (entry point {ep.name!r} = {ep.value}, group {self.group!r})") from e
                except (Exception, SystemExit) as e:  # another package's code: see above
                    raise PluginError(self._failed(ep, e)) from e
            self._loaded = True
        finally:
            self._loading = False

    def _failed(self, ep, e: BaseException) -> str:
        what = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
        return (f"the {self.kind} plugin {ep.name!r} ({ep.value}, entry point group {self.group!r}) failed to load: "
                f"{what}. Fix or uninstall the package that provides it")

    def refresh(self) -> None:
        """Look at the entry points again (a package installed since this process first asked): new plugins
        are loaded; those already imported are not imported twice."""
        importlib.invalidate_caches()
        self._loaded = False
        self.load()

    # -- looking up ------------------------------------------------------------------------------
    def get(self, name: str) -> T:
        self.load()
        if name in self._items:
            return self._items[name]
        raise UnknownNameError(self.unknown(name))

    def unknown(self, name: str) -> str:
        """The message for an unknown ``name``: close matches first, then where to see them all."""
        self.load()
        where = f" ({self.key})" if self.key else ""
        close = difflib.get_close_matches(str(name), list(self._items), n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        see = f" (`{self.listing}` describes them)" if self.listing else ""
        return f"unknown {self.kind} {name!r}{where}; {hint}registered: {', '.join(sorted(self._items))}{see}"

    __getitem__ = get

    def __delitem__(self, name: str) -> None:
        self.pop(name)

    def __contains__(self, name: object) -> bool:
        self.load()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        self.load()
        return iter(sorted(self._items))

    def __len__(self) -> int:
        self.load()
        return len(self._items)

    def names(self, where: Optional[Callable[[T], bool]] = None) -> list[str]:
        """Sorted names, those whose object satisfies ``where`` if given."""
        self.load()
        return sorted(n for n, o in self._items.items() if where is None or where(o))

    def items(self) -> list[tuple[str, T]]:
        self.load()
        return sorted(self._items.items())

    def source(self, name: str) -> str:
        """The module that registered ``name``."""
        self.get(name)
        return self._sources[name]

    def values(self) -> list[T]:
        return [o for _, o in self.items()]


def plugin_entry_points(group: str) -> list:
    """The entry points of ``group`` that another package than fewclip provides."""
    return [ep for ep in entry_points_of(group) if not is_builtin(ep.value.split(":")[0])]


def entry_points_of(group: str):
    """The entry points of ``group``, each name once (an editable install and a wheel of the same package can
    both be on the path; the first wins, as Python's own import would)."""
    seen, out = set(), []
    for ep in importlib.metadata.entry_points(group=group):
        if (ep.name, ep.value) in seen:
            continue
        seen.add((ep.name, ep.value))
        out.append(ep)
    return out
