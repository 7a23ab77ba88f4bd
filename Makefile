.PHONY: test lint protos bench
test:
	./run.sh test
lint:
	.venv/bin/ruff check .
protos:
	.venv/bin/python tools/gen_protos.py
bench:
	PYTHONPATH=. .venv/bin/python benchmarks/model_runner_decode.py
	PYTHONPATH=. .venv/bin/python benchmarks/scheduler_step.py
	PYTHONPATH=. .venv/bin/python benchmarks/engine_throughput.py
	PYTHONPATH=. .venv/bin/python benchmarks/mesh_throughput.py
