"""vmesh: LLM serving with vLLM V1's architecture, split into gRPC services.

One package: `vmesh.services` (the mesh's services, its CLI and `vmesh bench`), `vmesh.kernels`
(attention and fused kernels) and `vmesh.v1` (the generated gRPC stubs). A checkout keeps
`services/` and `kernels/` at its top; `vmesh/services` and `vmesh/kernels` are committed
symlinks to them, so the checkout is an ordinary package to Python, setuptools and type checkers.
"""
