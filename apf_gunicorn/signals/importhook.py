"""Installing the pool discovery: in the libraries already imported, and in each of them as
soon as the app imports it (a post-import hook on ``sys.meta_path``), so that no library is
imported for an app that does not use it.

    importhook.install()   # a worker, before it loads the app; the master, when gunicorn loads
                           # the worker class, before preload_app loads the app there
                           # (admission/boot.py: FrontEnd.init_process, FrontEnd.setup)

Installed in the master, the hook and the patches are inherited by every worker it forks, and
so are the pools registered there.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable

from apf_gunicorn.signals import asyncpg_pools, psycopg_pools, sqlalchemy_pools

#: top-level package -> what installs its discovery once the package is imported
WATCHED: dict[str, Callable[[], bool]] = {
    "sqlalchemy": sqlalchemy_pools.install,
    "psycopg_pool": psycopg_pools.install,
    "asyncpg": asyncpg_pools.install,
}

_lock = threading.Lock()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched package, asks the other finders and wraps the
    loader so the package's discovery is installed once it is executed."""

    def find_spec(self, fullname, path=None, target=None):
        install = WATCHED.get(fullname)
        if install is None:
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
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        class Loader(importlib.abc.Loader):
            def create_module(self, spec_):
                return loader.create_module(spec_)

            def exec_module(self, module):
                exec_module(module)
                install()

            def __getattr__(self, name):  # get_resource_reader, is_package...
                return getattr(loader, name)

        spec.loader = Loader()
        return spec


_HOOK = _AfterImport()


def uninstall() -> None:
    """Take the post-import hook off ``sys.meta_path`` (a worker with the signals off that
    inherited it from its master); libraries already patched stay so."""
    with _lock:
        while _HOOK in sys.meta_path:
            sys.meta_path.remove(_HOOK)


def install() -> list[str]:
    """Install the discovery of every watched library: now for those imported, on import for
    the others. Idempotent. Returns the libraries watched now."""
    with _lock:
        if _HOOK not in sys.meta_path:
            sys.meta_path.insert(0, _HOOK)
    return [name for name, install_ in WATCHED.items()
            if name in sys.modules and install_()]
