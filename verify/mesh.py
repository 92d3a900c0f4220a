"""The old path of the mesh helpers (the guide before 2026-12-05): `verify.mesh.device_mesh(spec)`. A mesh adapter
now takes `verify.device_mesh` and `verify.Mesh`; the module's other names were the harness's own. Kept so an
adapter written from the earlier guide still runs: importing it warns once, naming the new path."""
import warnings

from verify._internal.ranks.mesh import *  # noqa: F401,F403 (the old module's names, unchanged)
from verify._internal.ranks.mesh import __all__  # noqa: F401

warnings.warn("verify.mesh is deprecated: use verify.device_mesh(spec) and verify.Mesh (from verify import device_mesh, "
              "Mesh); the old path will be removed", FutureWarning, stacklevel=2)
