"""lorafleet's kernels, installed as `lorafleet.kernels` (pyproject's package-dir: the directory
stays at the top of the tree, where the layout puts it).

Python puts the current directory first on sys.path for `python -m` and `python -c`, and pytest
puts the checkout's root there too, so from a checkout `import kernels` finds this directory as a
top-level package. That name is also the Hugging Face `kernels` package, which transformers
imports wherever it is installed, and transformers 5.25 requires it: every test and bench system
that built a model with transformers then failed with "cannot import name 'CUDAProperties' from
'kernels'". So, imported under that name, this package loads the installed one in its place (found
on sys.path without this checkout's root); where none is installed, it stays this empty package,
which nothing imports by that name.
"""

import sys
from importlib.machinery import PathFinder
from importlib.util import module_from_spec
from pathlib import Path

if __name__ == "kernels":
    _root = Path(__file__).resolve().parent.parent
    _path = [p for p in sys.path if isinstance(p, str) and Path(p or ".").resolve() != _root]
    _spec = PathFinder.find_spec("kernels", _path)
    if _spec is not None:
        _installed = module_from_spec(_spec)
        sys.modules["kernels"] = _installed  # the import statement returns what sys.modules holds
        try:
            _spec.loader.exec_module(_installed)
        except BaseException:
            sys.modules.pop("kernels", None)
            raise
