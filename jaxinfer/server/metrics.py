"""Prometheus metrics of the server (prometheus-client), in a registry of its own."""

from __future__ import annotations

import time

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)


class Metrics:
    def __init__(self, runner):
        """runner: the EngineClient; the engine's figures are those its process last sent."""
        self.registry = r = CollectorRegistry()
        self.requests = Counter("jaxinfer_requests", "requests finished (choices)", registry=r)
        self.tokens = Counter("jaxinfer_generated_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("jaxinfer_time_to_first_token_seconds", "time to first token",
                              registry=r, buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10,
                                                   30, 60))
        self.tpot = Histogram("jaxinfer_time_per_output_token_seconds",
                              "request time / its output tokens", registry=r,
                              buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1))
        total_pages = runner.info["total_pages"]
        gauges = {
            "jaxinfer_requests_running": ("requests holding a row",
                                          lambda: runner.stats.running),
            "jaxinfer_requests_waiting": ("requests queued for a row",
                                          lambda: runner.stats.waiting),
            "jaxinfer_pages_in_use": ("KV pages held by requests",
                                      lambda: runner.stats.pages_in_use),
            "jaxinfer_pages_total": ("KV pages in the pool", lambda: total_pages),
            "jaxinfer_prefix_cache_hit_rate": ("prompt tokens served from the prefix cache",
                                               lambda: runner.stats.prefix_cache_hit_rate),
            "jaxinfer_engine_generated_tokens": ("tokens the engine generated (aborted "
                                                 "requests' included)",
                                                 lambda: runner.stats.generated_tokens),
            # speculative decoding (serve --speculative; zero without)
            "jaxinfer_spec_draft_tokens": ("drafts verified", lambda: runner.stats.draft_tokens),
            "jaxinfer_spec_accepted_tokens": ("drafts accepted",
                                              lambda: runner.stats.accepted_tokens),
            "jaxinfer_spec_plain_rounds": ("decode rounds without drafts (drafts mostly "
                                           "rejected)", lambda: runner.stats.plain_rounds),
            "jaxinfer_engine_thread_cpu_seconds": ("CPU time of the engine process's thread "
                                                   "that steps the engine (its host work)",
                                                   lambda: runner.stats.thread_cpu_s),
            "jaxinfer_engine_process_cpu_seconds": ("CPU time of the engine process (JAX's "
                                                    "threads included)",
                                                    lambda: runner.stats.process_cpu_s),
            # /metrics is served on the event loop, so this is the loop's own thread.
            "jaxinfer_event_loop_cpu_seconds": ("CPU time of the API process's event loop "
                                                "(HTTP, SSE, detokenization)",
                                                time.thread_time),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(name, doc, registry=r).set_function(fn)

    def first_token(self, t0: float) -> None:
        self.ttft.observe(time.perf_counter() - t0)

    def finished(self, choices: int, t0: float, tokens: int) -> None:
        self.requests.inc(choices)
        self.tokens.inc(tokens)
        if tokens:
            self.tpot.observe((time.perf_counter() - t0) / tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
