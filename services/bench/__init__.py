"""`vmesh bench`: the standard and long workloads, baselines and peers side by side, and the seed's claims.

    vmesh bench offline  [--workload standard|long|FILE] [--baselines transformers,engine,mesh]
                         [--peers-dir DIR] [--requests 64] [--max-tokens 128] [--repeats 1]
    vmesh bench serving  [--address A] [--request-rate 4] [--max-concurrency 64] [--num-requests 64]
                         [--backend grpc|openai|grpc,openai] [--base-url http://HOST:PORT/v1] [--model NAME]
                         [--workload structured [--arms constrained,unconstrained]]
    vmesh bench claims   [--models embedded,tiny]
    vmesh bench detokenizer [--replicas 1 2]

Every mode prints a table and writes JSON to <out>/<mode>.json (<mode>-<workload>.json for a
workload other than the standard one; benchmarks/results in a checkout). Baselines, and the
peers `vllm`, `vllm-bf16` and `llama.cpp` from benchmarks/peers/setup.sh's environments, run in
the same invocation, in turn, on the same prompts (token ids from the workload file).
"""
