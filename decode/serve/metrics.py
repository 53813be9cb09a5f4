"""The counters of ``polyspec serve`` and their Prometheus text exposition (format 0.0.4), without a client library.

Thread-safe: requests are counted on the event loop, generations are recorded from it too, and the queue gauges are
read from the engine at render time.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from typing import Any

TPS_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)  # tokens/s per request
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Why a request was refused: a full queue (429), a deadline passed before its turn (503), a prompt over
# --max-prompt-tokens (400), a body over the size limit (413), a body slower than --read-timeout (408)
REJECTIONS = ("queue_full", "deadline", "prompt_too_long", "body_too_large", "read_timeout")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class Metrics:
    """Requests by endpoint and status; generated and prompt tokens; tokens/s (last request and a histogram);
    mean accepted tokens per forward for every level over all requests (sum of tokens emitted / sum of forwards)."""

    def __init__(self, model: str, mode: str, levels: list[str], queue_limit: int = 0):
        self.model = model
        self.mode = mode
        self.queue_limit = queue_limit
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.generations = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.generation_seconds = 0.0
        self.last_tokens_per_second = 0.0
        self.tps_buckets = [0] * len(TPS_BUCKETS)
        self.tps_sum = 0.0
        self.level_emitted = {name: 0 for name in levels}
        self.level_passes = {name: 0 for name in levels}
        self.rejections: Counter[str] = Counter({reason: 0 for reason in REJECTIONS})
        self.deadline_cuts = 0

    def observe_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, int(status))] += 1

    def observe_rejection(self, reason: str) -> None:
        with self._lock:
            self.rejections[reason] += 1

    def refusals(self) -> dict[str, Any]:
        """Rejections by reason and generations the deadline cut short (for /health)."""
        with self._lock:
            return {"rejected": dict(self.rejections), "deadline_cut": self.deadline_cuts}

    def mean_generation_seconds(self) -> float:
        with self._lock:
            return self.generation_seconds / self.generations if self.generations else 0.0

    def observe_generation(self, prompt_tokens: int, stats: dict[str, Any], *, cut: bool = False) -> None:
        """Record one generation from :class:`ChainDecoder`'s stats (new_tokens, seconds, levels[...]); ``cut``: the
        deadline stopped it."""
        new = int(stats.get("new_tokens", 0))
        seconds = float(stats.get("seconds", 0.0))
        tps = new / seconds if seconds > 0 else 0.0
        with self._lock:
            self.generations += 1
            self.deadline_cuts += int(cut)
            self.generated_tokens += new
            self.prompt_tokens += int(prompt_tokens)
            self.generation_seconds += seconds
            self.last_tokens_per_second = tps
            self.tps_sum += tps
            for j, edge in enumerate(TPS_BUCKETS):
                if tps <= edge:
                    self.tps_buckets[j] += 1
            for lv in stats.get("levels", []):
                name = str(lv.get("name"))
                self.level_emitted[name] = self.level_emitted.get(name, 0) + int(lv.get("tokens_emitted", 0))
                self.level_passes[name] = self.level_passes.get(name, 0) + int(lv.get("forward_passes", 0))

    def render(self, queue_waiting: int, running: int) -> str:
        """The Prometheus text exposition of every metric."""
        with self._lock:
            lines: list[str] = []

            def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
                lines.append(f"# HELP {name} {help_}")
                lines.append(f"# TYPE {name} {kind}")
                lines.extend(f"{name}{labels} {_num(v)}" for labels, v in samples)

            info = f'{{model="{_label(self.model)}",mode="{_label(self.mode)}"}}'
            metric("polyspec_info", "gauge", "The served chain (value always 1).", [(info, 1)])
            metric("polyspec_requests_total", "counter", "HTTP requests by endpoint and status code.",
                   [(f'{{endpoint="{_label(e)}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())])
            metric("polyspec_generations_total", "counter", "Completed generations.", [("", self.generations)])
            metric("polyspec_generated_tokens_total", "counter", "Tokens generated (all requests).",
                   [("", self.generated_tokens)])
            metric("polyspec_prompt_tokens_total", "counter", "Prompt tokens processed.", [("", self.prompt_tokens)])
            metric("polyspec_generation_seconds_total", "counter", "Seconds spent generating.",
                   [("", self.generation_seconds)])
            metric("polyspec_last_tokens_per_second", "gauge", "Tokens per second of the last generation.",
                   [("", self.last_tokens_per_second)])
            buckets = [(f'{{le="{_num(edge)}"}}', n) for edge, n in zip(TPS_BUCKETS, self.tps_buckets, strict=True)]
            buckets.append(('{le="+Inf"}', self.generations))
            lines.append("# HELP polyspec_tokens_per_second Tokens per second of each generation.")
            lines.append("# TYPE polyspec_tokens_per_second histogram")
            lines.extend(f"polyspec_tokens_per_second_bucket{lb} {_num(v)}" for lb, v in buckets)
            lines.append(f"polyspec_tokens_per_second_sum {_num(self.tps_sum)}")
            lines.append(f"polyspec_tokens_per_second_count {self.generations}")
            metric("polyspec_mean_accepted_tokens", "gauge",
                   "Mean tokens emitted per forward pass of each level over all generations (the paper's L_i).",
                   [(f'{{level="{_label(n)}"}}', self.level_emitted[n] / p if p else 0.0)
                    for n, p in self.level_passes.items()])
            metric("polyspec_level_forward_passes_total", "counter", "Forward passes of each level.",
                   [(f'{{level="{_label(n)}"}}', p) for n, p in self.level_passes.items()])
            metric("polyspec_queue_depth", "gauge", "Requests waiting for the batch-1 engine.", [("", queue_waiting)])
            metric("polyspec_requests_running", "gauge", "Requests being generated now (0 or 1).", [("", running)])
            metric("polyspec_queue_limit", "gauge", "Requests that may wait (--max-queue).", [("", self.queue_limit)])
            metric("polyspec_rejections_total", "counter", "Requests refused by the server's limits, by reason.",
                   [(f'{{reason="{_label(r)}"}}', n) for r, n in sorted(self.rejections.items())])
            metric("polyspec_deadline_cut_total", "counter", "Generations stopped by the request deadline.",
                   [("", self.deadline_cuts)])
        return "\n".join(lines) + "\n"
