.PHONY: test lint protos bench
test:
	./run.sh test
lint:
	./run.sh lint
protos:
	.venv/bin/python tools/gen_protos.py
bench:
	.venv/bin/python -m benchmarks.model_runner_decode
	.venv/bin/python -m benchmarks.scheduler_step
	.venv/bin/vmesh bench offline
	.venv/bin/vmesh bench claims
