"""`localspec bench`: measure what speculation earns on this machine.

workloads.py  built-in prompts and edit tasks, or the user's JSONL (--prompts)
runner.py     every variant of one workload in one process, interleaved, greedy;
              each speculative output checked against plain decoding
vcurve.py     the verify cost curve V(n) and the draft cost ratio c
calibrate.py  the measurements a calibration profile holds (`localspec tune`)
serve_bench.py  serving throughput by concurrency, speculation off / on / by rule
report.py     rich tables, JSON and the optional plot
peer.py       llama-cpp-python's own speculative loop, for `bench --peer`
soak.py       the serve soak's load and checks (scripts/soak_serve.py; needs httpx)
replay.py     recorded generations replayed through the policies under a cost curve
              (scripts/replay_policy.py)

The click command is localspec/commands/bench.py.
"""
