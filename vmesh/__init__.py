"""vmesh: LLM serving with vLLM V1's architecture, split into gRPC services.

An installed vmesh is this one package: `vmesh.services` (the mesh's services, its CLI and
`vmesh bench`), `vmesh.kernels` (attention and fused kernels) and `vmesh.v1` (the generated
gRPC stubs). A checkout keeps `services/` and `kernels/` at its top instead; there these two
folders, and only they, are made the subpackages of the same names, so that code and tests
import one way only.
"""

import importlib.util
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_CHECKOUT = _HERE.parent
if not (_HERE / "services").is_dir() and (_CHECKOUT / "services" / "cli.py").is_file():
    for _name in ("services", "kernels"):
        _spec = importlib.util.spec_from_file_location(f"{__name__}.{_name}", _CHECKOUT / _name / "__init__.py",
                                                       submodule_search_locations=[str(_CHECKOUT / _name)])
        assert _spec is not None and _spec.loader is not None
        _module = importlib.util.module_from_spec(_spec)
        sys.modules[_spec.name] = _module
        _spec.loader.exec_module(_module)
        globals()[_name] = _module
