"""OmniScale: a training system for omni-modal mixture-of-experts models with a centralized
data plane.

Everything installs under this one name (``from omniscale.dataplane import PlaneClient``). The
subpackages stay at the repository's top level (``dataplane/``, ``loaders/``, ...); in a wheel
setuptools' ``package-dir`` maps them under ``omniscale/``. In a source checkout (an editable
install, or the repository root on ``sys.path``) they are found beside this folder: the
repository root joins this package's search path, so ``omniscale.dataplane`` is ``dataplane/``.
"""

from __future__ import annotations

from pathlib import Path

SUBPACKAGES = ("dataplane", "loaders", "balancer", "encoders", "backbone", "parallel", "kernels",
               "tools")

_checkout = Path(__file__).resolve().parent.parent
# pyproject.toml beside the folders tells a checkout from a site-packages that happens to hold
# an older install's top-level `dataplane` etc.
if (_checkout / "pyproject.toml").is_file() and (_checkout / "dataplane" / "__init__.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 (a package's __path__)


def hand_over_top_level(name: str) -> None:
    """Give a top-level import ``name`` to the installed package of that name, if there is one.

    With the checkout's root on ``sys.path`` (``python -m`` run from it, pytest) a folder here
    is also importable under its bare name, and hides an installed package that has it:
    Hugging Face's ``kernels``, which ``transformers`` imports, is ``kernels/`` here. The
    folder's ``__init__`` calls this when imported under its bare name; the installed package
    replaces it in ``sys.modules``, which is what the import statement returns. With no such
    package the folder stays, as before (``transformers`` then finds no version and skips it).
    """
    import importlib.machinery
    import importlib.util
    import sys

    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != _checkout]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)  # the failed import may have taken it out already
        raise
