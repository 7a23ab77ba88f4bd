"""Benchmarks, each run as `python -m benchmarks.<name>`: they measure the model in the process
that runs them, so that process prefers huge pages as a service's does (set before torch loads)."""

from vmesh.services.common.huge_pages import prefer_huge_pages

prefer_huge_pages()
