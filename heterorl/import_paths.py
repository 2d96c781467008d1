"""Objects named by an import path, ``"package.module:name"``: a reward function, a verifiers env, a cookbook
source. `split_import_path` checks the shape (a config's check, before anything is imported) and `import_object`
imports the object; both raise `TaskError`, naming the option, the path and the fix, as every path is a task's
(a leaf: it imports nothing of heterorl but its errors)."""

from __future__ import annotations

import importlib
from typing import Callable

from heterorl.errors import TaskError


def split_import_path(spec: object, what: str, names: str) -> tuple[str, str]:
    """(module, name) of ``spec``, ``"package.module:name"``; TaskError naming ``what`` (the option it came from),
    ``spec`` and ``names`` (what it must name) when it is not a string of that shape."""
    module, sep, name = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not (sep and module and name):
        raise TaskError(f"{what} {spec!r} must look like 'package.module:name', naming {names}")
    return module, name


def import_object(spec: str, what: str, names: str) -> Callable:
    """The callable ``spec`` (``"package.module:name"``) names, imported. TaskError naming ``what``, ``spec`` and
    the fix when it has another shape, its module cannot be imported (or raises as it is), the module has no such
    name, or the object is not callable; ``names`` says what it must name."""
    module_name, name = split_import_path(spec, what, names)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise TaskError(f"{what} {spec!r}: cannot import module {module_name!r} ({err}); check the name and that "
                        "it is installed or on PYTHONPATH") from err
    except Exception as err:
        raise TaskError(f"{what} {spec!r}: importing module {module_name!r} raised {type(err).__name__}: "
                        f"{err}") from err
    if not hasattr(module, name):
        raise TaskError(f"{what} {spec!r}: module {module_name!r} has no attribute {name!r}; name {names}")
    found = getattr(module, name)
    if not callable(found):
        raise TaskError(f"{what} {spec!r}: {name!r} is a {type(found).__name__}, not callable; name {names}")
    return found


__all__ = ["import_object", "split_import_path"]
