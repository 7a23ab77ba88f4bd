"""`vmesh bench`: the standard workload, baselines side by side, and the seed's claims.

    vmesh bench offline  [--baselines transformers,engine,mesh] [--requests 64] [--max-tokens 128] [--repeats 1]
    vmesh bench serving  [--address A] [--request-rate 4] [--max-concurrency 64] [--num-requests 64]
                         [--backend grpc|openai|grpc,openai] [--base-url http://HOST:PORT/v1] [--model NAME]
    vmesh bench claims   [--models embedded,tiny]
    vmesh bench detokenizer [--replicas 1 2]

Every mode prints a table and writes JSON to <out>/<mode>.json (benchmarks/results in a
checkout). Baselines run in
the same invocation, on the same prompts (token ids from the workload file).
"""
