"""Load a repository script (``tools/...``) as a module, for the tests that drive it.

The repository's scripts are not installed packages, and the tests run with pytest's
``--import-mode=importlib`` (no test directory on ``sys.path``), so a test reaches a script by
its path. The module is registered in ``sys.modules`` under ``name`` before it runs (dataclasses
and pickling look their module up there), and a second load under the same name returns the
module already loaded, so two test files of one worker share it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: str | Path, name: str) -> ModuleType:
    """The module of the Python file at ``path``, loaded once per process under ``name``."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_script: no script at {path} (for module {name!r})")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


__all__ = ["load_script"]
