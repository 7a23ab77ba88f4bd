"""vmesh: LLM serving with vLLM V1's architecture, split into gRPC services.

An installed vmesh is this one package: `vmesh.services` (the mesh's services, its CLI and
`vmesh bench`), `vmesh.kernels` (attention and fused kernels) and `vmesh.v1` (the generated
gRPC stubs). A checkout keeps `services/` and `kernels/` at its top instead; there the two are
found beside this folder, under the same names, so that code and tests import one way only.
"""

from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent
if not (Path(__file__).resolve().parent / "services").is_dir() and (_CHECKOUT / "services" / "cli.py").is_file():
    __path__.append(str(_CHECKOUT))  # noqa: F821 - a package's __path__ is set before its __init__ runs
