"""``AutoConfig``/``AutoModel`` know the ReDrafter head after a bare ``import redraft``.

Registering needs the head's classes, i.e. torch and transformers' modeling code (seconds to
import); ``import redraft`` must stay instant, since every command-line ``--help`` starts with it.
So :func:`install` (called by ``redraft/__init__.py``) registers at once only when transformers'
Auto classes are already loaded, and otherwise adds an import hook: when a ``transformers``
module finishes loading, and transformers' ``configuration_auto`` is loaded (AutoConfig,
AutoModel or a model class is in use), and no other ``transformers`` module is half-way through
its own import, it imports :mod:`redraft.models.redrafter` (whose last line registers) and
removes itself. Programs that never touch transformers' Auto classes never pay for it; those that
do pay what ``from transformers import PreTrainedModel`` costs (transformers' tokenizers already
load torch and the Auto classes, not the modeling code; figures in docs/train.md).

The hook only wraps ``exec_module`` of the file loaders of ``transformers.*`` modules; the
loaders, specs and modules stay transformers' own. Importing :mod:`redraft.models.redrafter`
directly registers too (and is what everything in redraft does anyway).
"""

from __future__ import annotations

import importlib.machinery
import logging
import sys

logger = logging.getLogger(__name__)

AUTO_CONFIG_MODULE = "transformers.models.auto.configuration_auto"
HEAD_MODULE = "redraft.models.redrafter"


# Loaders created per module file (the finder makes a new instance for each spec).
_FILE_LOADERS = (
    importlib.machinery.SourceFileLoader,
    importlib.machinery.SourcelessFileLoader,
    importlib.machinery.ExtensionFileLoader,
)


def _initializing(name: str) -> bool:
    module = sys.modules.get(name)
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _busy(just_loaded: str) -> bool:
    """Another ``transformers`` module is still executing its own import (the one that just ran its
    last line is still flagged until the import system returns)."""
    return any(
        name != just_loaded
        and (name == "transformers" or name.startswith("transformers."))
        and _initializing(name)
        for name in list(sys.modules)
    )


class _Finder:
    """A meta path finder that only decorates the specs other finders return for ``transformers.*``."""

    def __init__(self):
        self.done = False

    def find_spec(self, fullname, path=None, target=None):
        if self.done or not (fullname == "transformers" or fullname.startswith("transformers.")):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        # FileLoader instances belong to one module each: overriding exec_module on the instance
        # touches nothing else (a class-level loader such as BuiltinImporter is left alone).
        if isinstance(loader, _FILE_LOADERS):
            inner = loader.exec_module

            def exec_module(module, _inner=inner, _name=fullname):
                _inner(module)
                self.after(_name)

            loader.exec_module = exec_module
        return spec

    def after(self, just_loaded: str) -> None:
        if self.done:
            return
        if HEAD_MODULE in sys.modules:  # being imported or imported: it registers itself
            self.done = True
            _remove(self)
            return
        if AUTO_CONFIG_MODULE not in sys.modules or _busy(just_loaded):
            return
        self.done = True
        try:
            importlib.import_module(HEAD_MODULE)  # registers at its end
        except Exception as exc:  # never break the user's own import of transformers
            logger.debug(
                "redraft: deferred Auto registration failed (%s); `import redraft.models.redrafter` "
                "registers explicitly",
                exc,
            )
        _remove(self)


def _remove(finder) -> None:
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def install() -> None:
    """Register now if transformers' Auto classes are loaded, else hook transformers' imports."""
    if HEAD_MODULE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    finder = _Finder()
    if AUTO_CONFIG_MODULE in sys.modules and not _busy(""):
        finder.after("")
        return
    sys.meta_path.insert(0, finder)
