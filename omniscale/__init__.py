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
