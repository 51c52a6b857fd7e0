"""Plot an app's key series from a Prometheus server: the dashboard, as one PNG.

    python -m bench.metrics_plot --prometheus http://127.0.0.1:9090 --app clicks \
        --minutes 5 --out docs/metrics.png

Panels: throughput (records/s read and published), source lag, event-time watermark lag,
epoch duration p50/p99, and Kafka transactions per second: the panels of the Grafana
dashboard in deploy/grafana, with shorter rate windows for short runs.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.parse
import urllib.request
from datetime import datetime

PANELS = [
    (
        "Throughput (records/s)",
        {
            "read": 'sum(rate(onceflow_input_records_total{app="$app"}[15s]))',
            "published": 'sum(rate(onceflow_output_records_total{app="$app"}[15s]))',
        },
    ),
    ("Source lag (records)", {"lag": 'sum(onceflow_source_lag_records{app="$app"})'}),
    ("Watermark lag (s)", {"watermark lag": 'onceflow_watermark_lag_seconds{app="$app"}'}),
    (
        "Epoch duration (s)",
        {
            f"p{q}": f"histogram_quantile(0.{q}, sum by (le) "
            f'(rate(onceflow_epoch_duration_seconds_bucket{{app="$app"}}[30s])))'
            for q in (50, 99)
        },
    ),
    (
        "Kafka transactions/s",
        {
            o: f'sum(rate(onceflow_transactions_total{{app="$app",outcome="{o}"}}[15s]))'
            for o in ("committed", "aborted")
        },
    ),
]


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=30) as r:
        body = json.load(r)
    if body["status"] != "success":
        raise SystemExit(f"Prometheus refused {expr!r}: {body.get('error')}")
    result = body["data"]["result"]
    return [(float(t), float(v)) for t, v in result[0]["values"]] if result else []


def plot(prometheus: str, app: str, start: float, end: float, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = max(1.0, (end - start) / 600)
    figure, axes = plt.subplots(len(PANELS), 1, figsize=(10, 2.2 * len(PANELS)), sharex=True)
    empty = True
    for axis, (title, series) in zip(axes, PANELS, strict=True):
        for label, expr in series.items():
            points = query_range(prometheus, expr.replace("$app", app), start, end, step)
            empty = empty and not points
            axis.plot(
                [datetime.fromtimestamp(t) for t, _ in points], [v for _, v in points], label=label
            )
        axis.set_title(title, fontsize=10, loc="left")
        axis.grid(alpha=0.3)
        axis.legend(loc="upper right", fontsize=8)
    if empty:
        raise SystemExit(
            f"Prometheus at {prometheus} has no onceflow series for app {app!r} in that time; "
            "check the app id and that Prometheus scrapes the metrics port"
        )
    figure.suptitle(f"onceflow app {app!r}, scraped by Prometheus", fontsize=11)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--app", required=True, help="the pipeline's app_id")
    parser.add_argument("--minutes", type=float, default=10.0, help="how far back to plot")
    parser.add_argument("--out", default="metrics.png")
    args = parser.parse_args()
    end = time.time()
    plot(args.prometheus, args.app, end - args.minutes * 60, end, args.out)


if __name__ == "__main__":
    main()
