.PHONY: test lint bench
test:
	./run.sh test
lint:
	.venv/bin/ruff check .
bench:
	PYTHONPATH=. .venv/bin/python benchmarks/model_runner_decode.py
