"""vmesh: LLM serving with vLLM V1's architecture, split into gRPC services.

One package: `vmesh.services` (the mesh's services, its CLI and `vmesh bench`), `vmesh.kernels`
(attention and fused kernels) and `vmesh.v1` (the generated gRPC stubs). A checkout keeps
`services/` at its top and `vmesh/services` is a committed symlink to it, so the checkout is an
ordinary package to Python, setuptools and type checkers. The kernels lie in `vmesh/kernels`
itself: a top-level `kernels/` would shadow the `kernels` distribution that transformers imports.
"""
