"""`leanserve bench ...`: benchmarks that compare side by side in one run, one module per subcommand.

Each benchmark module declares its one-line `HELP`, its options (`add_arguments(parser)`) and `run(args)`, which
prints its rows; cli.py's BENCHMARKS table maps each subcommand name to its module.

throughput   `bench throughput`: offline tokens/s of leanserve vs transformers' `generate`
serve        `bench serve`: a bounded loopback load generator against a real server process
spec         `bench spec`: speculative methods vs none on held-out code
spec_cost    `bench spec-cost`: what a one-token MTP step costs in plain decode steps, and its ceiling
hidden_copy  `bench copy`: latency of the target-hidden copy per step
step         `bench step`: one decode step with the target-hidden buffer on vs off
structured   `bench structured`: plain requests' tokens/s beside constrained ones vs beside none
pp           `bench pp`: tokens/s of one stage vs N stages one step at a time vs N with overlap
formats      `bench formats`: decode at DeepSeek-V4-Flash's per-layer scale, the published format vs bf16
long         `bench long`: prefill by part, peak memory and decode at 4K-128K context on Flash's attention shapes
options      the options they share (--output, --threads, integer lists) and the checks made before any runs
common       what they share: the table / JSON printer, timers, the MTP runner, random prompts
prompts      prompts from held-out code, and the held-out split of the code corpus (training reads it too)
"""
