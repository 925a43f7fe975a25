"""Host-side help for stage modules that compose another stage's kernels (the `forward` stage launches the
variant's `prepare` and `recurrence`; `bwd_prepare` launches `prepare` with the backward's extra output)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["sibling"]


def sibling(name: str, file: str, stem: str) -> ModuleType:
    """The stage module `stem` of the variant whose stage file is `file` (module `name`), imported from the
    file beside it and registered in sys.modules: the DSL re-reads a kernel's source through its module
    while compiling."""
    full = f"{name}__{stem}"
    spec = importlib.util.spec_from_file_location(full, Path(file).with_name(f"{stem}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    spec.loader.exec_module(module)
    return module
