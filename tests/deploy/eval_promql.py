#!/usr/bin/env python3
"""Evaluates every PromQL expression of the Grafana dashboard and of the alert
rules through a Prometheus HTTP API: each must evaluate without error, and
each dashboard query must return data (the alerts need not fire).

Usage: eval_promql.py API DASHBOARD_JSON RULES_YAML [--no-data-needed PREFIX]...
  API: http://host:port/api/v1. A dashboard query that reads a metric whose
  name starts with PREFIX (one this Prometheus does not scrape) must still
  evaluate but may return nothing.
"""
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import yaml


def query(api, expr):
    expr = expr.replace("$__rate_interval", "1m").replace('=~"$namespace"', '=~".*"')
    u = f"{api}/query?" + urllib.parse.urlencode({"query": expr})
    try:
        r = json.load(urllib.request.urlopen(u))
    except urllib.error.HTTPError as e:
        return "error", json.load(e).get("error")
    return r["status"], r["data"]["result"]


def main(argv):
    api, dashboard, rules = argv[1:4]
    optional = [argv[i + 1] for i, a in enumerate(argv) if a == "--no-data-needed"]
    # Rates need two samples of the load in their window: on a busy machine
    # some scrapes time out, so wait (30 s at most) until the request rate has data.
    for _ in range(60):
        status, result = query(api, "sum(rate(tandem_router_requests_total[1m])) > 0")
        if status == "success" and result:
            break
        time.sleep(0.5)
    failed = 0
    for p in json.load(open(dashboard))["panels"]:
        for t in p["targets"]:
            status, result = query(api, t["expr"])
            need_data = not any(prefix in t["expr"] for prefix in optional)
            ok = status == "success" and (len(result) > 0 or not need_data)
            print(f"{'ok  ' if ok else 'FAIL'} dashboard {p['title']!r} {t['legendFormat']!r}: "
                  f"{status}, {len(result) if isinstance(result, list) else result} series"
                  f"{'' if need_data else ' (not scraped here: data not required)'}")
            failed += not ok
    for g in yaml.safe_load(open(rules))["groups"]:
        for r in g["rules"]:
            status, result = query(api, r["expr"])
            ok = status == "success"
            print(f"{'ok  ' if ok else 'FAIL'} alert {r['alert']}: {status}, "
                  f"{len(result) if isinstance(result, list) else result} series (firing now: not required)")
            failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
