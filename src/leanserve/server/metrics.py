"""Prometheus metrics for the server, in a registry of its own (two servers in one process do not mix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class ServerMetrics:
    def __init__(self, llm) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "leanserve_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt = Counter("leanserve_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation = Counter("leanserve_generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("leanserve_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("leanserve_num_requests_waiting", "Sequences waiting for a slot", registry=r)
        self.ttft = Histogram(
            "leanserve_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "leanserve_inter_token_latency_seconds", "Time between tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.step = Histogram("leanserve_engine_step_seconds", "Engine step time", buckets=_LATENCY_BUCKETS, registry=r)
        memory = Gauge(
            "leanserve_memory_bytes",
            "Memory by pipeline stage and feature (weights included)",
            ["stage", "feature"],
            registry=r,
        )
        for stage in llm.memory_ledger():
            memory.labels(str(stage.stage), "weights").set(stage.weights_bytes)
            for feature, nbytes in stage.by_feature().items():
                memory.labels(str(stage.stage), feature).set(nbytes)
        self.spec = None
        if llm.engine.config.speculative_config is not None:
            self.spec = {
                key: Gauge(f"leanserve_spec_decode_{key}", f"Speculative decoding: {key.replace('_', ' ')}", registry=r)
                for key in (
                    "num_drafts",
                    "num_draft_tokens",
                    "num_accepted_tokens",
                    "acceptance_rate",
                    "mean_acceptance_length",
                )
            }
            self.spec_position = Gauge(
                "leanserve_spec_decode_accepted_per_position", "Accepted drafts by position", ["position"], registry=r
            )
        self._engine = engine = llm.engine
        # Read at scrape time, so they are right while the engine is idle too.
        self.running.set_function(lambda: engine.scheduler.num_running)
        self.waiting.set_function(lambda: engine.scheduler.num_waiting)
        blocks = Gauge("leanserve_kv_cache_blocks", "Paged cache blocks by state (used or free)", ["state"], registry=r)
        pool = engine.scheduler.blocks
        blocks.labels("used").set_function(lambda: pool.num_used)
        blocks.labels("free").set_function(lambda: pool.num_free)
        # Counters that follow counts the engine keeps: (counter, the count now, the count already added).
        sched = engine.scheduler
        counts = [("leanserve_num_preemptions", "Sequences preempted (blocks ran out; recomputed later)",
                   lambda: sched.num_preemptions)]  # fmt: skip
        if sched.prefix is not None:
            counts += [
                ("leanserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                 lambda: sched.prefix.queries),
                ("leanserve_prefix_cache_hits", "Prompt tokens the prefix cache gave", lambda: sched.prefix.hits),
            ]  # fmt: skip
        self._followed = [[Counter(name, text, registry=r), count, 0] for name, text, count in counts]

    # Called on the engine-loop thread after each step.
    def on_step(self, seconds: float) -> None:
        self.step.observe(seconds)
        for followed in self._followed:
            counter, count, added = followed
            now = count()
            if now > added:
                counter.inc(now - added)
                followed[2] = now
        if self.spec is not None:
            m = self._engine.spec_decode_metrics()
            for key, gauge in self.spec.items():
                gauge.set(m[key])
            for i, n in enumerate(m["accepted_per_position"]):
                self.spec_position.labels(str(i)).set(n)

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def prompt_tokens(self, n: int) -> None:
        self.prompt.inc(n)

    def generation_tokens(self, n: int) -> None:
        self.generation.inc(n)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float, tokens: int) -> None:
        for _ in range(tokens):  # several tokens in one step (speculation) share the wait
            self.itl.observe(seconds / tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
