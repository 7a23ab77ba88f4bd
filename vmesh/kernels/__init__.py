"""Triton kernels and their torch references (`vmesh.kernels.reference`). Import the Triton
modules only where Triton can run: on CUDA, or on CPU with TRITON_INTERPRET=1."""
