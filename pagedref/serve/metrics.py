"""`GET /metrics`: the engine and its requests in Prometheus' text format (vLLM's metric names, `pagedref:`).

One idea: two kinds of figures. The engine's state (KV pool usage, requests running / waiting /
swapped, the token and preemption counters) is read from `LLMEngine.get_stats()` and
`get_num_requests_by_state()` by the engine's process between two steps when /metrics is scraped, and
exposed through a collector; latencies (time to first token, inter-token latency, end to end) are
observed by the server as each step's outputs arrive from the engine, into histograms.

Invariant: `pagedref:kv_cache_usage_perc` is the share of the pool's blocks held by requests (vLLM's
`vllm:kv_cache_usage_perc`, a fraction in [0, 1]): 0 when no request is in flight, since a finished or
aborted request frees its blocks at once (blocks kept only for the prefix cache are free).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no `_created` series beside every counter and histogram (vLLM does the same)

# vLLM's buckets (seconds), so dashboards made for vLLM read these the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The server's registry (its own, so that several servers can live in one process, as in tests)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.snapshot: dict[str, Any] = {}  # the engine's stats at the last scrape (set by the server)
        r = self.registry
        self.time_to_first_token = Histogram("pagedref:time_to_first_token_seconds",
                                             "Time from the request's arrival to its first output token.",
                                             buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("pagedref:inter_token_latency_seconds",
                                             "Time between two consecutive outputs of a request (one per step).",
                                             buckets=ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram("pagedref:e2e_request_latency_seconds",
                                             "Time from the request's arrival to its last output.",
                                             buckets=E2E_BUCKETS, registry=r)
        self.request_success = Counter("pagedref:request_success", "Requests finished, by finish reason.",
                                       ["finished_reason"], registry=r)
        self.num_aborted_requests = Counter("pagedref:num_aborted_requests",
                                            "Requests aborted (client gone, or shut down) before they finished.", registry=r)
        r.register(_EngineCollector(self))

    def render(self, snapshot: dict[str, Any]) -> bytes:
        """The text exposition, with the engine figures of `snapshot` (taken by the engine's process)."""
        self.snapshot = snapshot
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and counters read from the engine's own statistics at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []  # the families depend on the snapshot only by value: nothing to check at registration

    def collect(self):
        s = self.metrics.snapshot
        if not s:
            return
        used, total = s["num_used_blocks"], s["num_blocks"]
        yield _gauge("pagedref:kv_cache_usage_perc", "KV cache usage: the share of the pool's blocks held by requests "
                     "(1 = 100%).", used / total if total else 0.0)
        yield _gauge("pagedref:num_kv_blocks", "Blocks in the KV pool.", total)
        yield _gauge("pagedref:num_requests_running", "Requests whose sequences hold KV blocks (prefilling or decoding).",
                     s["running"])
        yield _gauge("pagedref:num_requests_waiting", "Requests waiting to be scheduled (new, or preempted by recompute).",
                     s["waiting"])
        yield _gauge("pagedref:num_requests_swapped", "Requests preempted by swapping, their blocks in the CPU pool.",
                     s["swapped"])
        yield _gauge("pagedref:prefix_cache_hit_rate", "Share of looked-up prompt blocks found in the prefix cache.",
                     s.get("prefix_cache_hit_rate", 0.0))
        yield _counter("pagedref:num_preemptions", "Preemptions since the engine started.", s["num_preemptions"])
        yield _counter("pagedref:prompt_tokens", "Prompt tokens of the requests added.", s["num_prompt_tokens"])
        yield _counter("pagedref:generation_tokens", "Tokens generated.", s["num_generated_tokens"])
        yield _counter("pagedref:num_engine_steps", "Engine steps since the engine started (pagedref's own: bench online "
                       "compares the step rate served with the offline one).", s["num_steps"])


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)  # exposed as name_total
