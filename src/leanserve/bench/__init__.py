"""`leanserve bench ...`: benchmarks that compare side by side in one run, one module per subcommand.

throughput   `bench throughput`: offline tokens/s of leanserve vs transformers' `generate`
serve        `bench serve`: a bounded loopback load generator against a real server process
spec         `bench spec`: speculative methods vs none on held-out code
spec_cost    `bench spec-cost`: what a one-token MTP step costs in plain decode steps, and its ceiling
hidden_copy  `bench copy`: latency of the target-hidden copy per step
step         `bench step`: one decode step with the target-hidden buffer on vs off
structured   `bench structured`: plain requests' tokens/s beside constrained ones vs beside none
common       what they share: the table / JSON printer, timers, the MTP runner, held-out code prompts
"""
