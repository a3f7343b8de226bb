"""``rlprof prometheus rules|dashboard|scrape RUN_LOG_DIR ...``: what a Prometheus server (and Grafana over it) needs
to watch runs that log with the ``prometheus`` tracking backend: rlprof's alert rules (a stalled or missing rank,
rollout-bound steps, non-finite values, memory near its limit), its Grafana dashboard, and a scrape configuration that
finds every rank of the given runs through their targets files."""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

from rich.console import Console

from rlprof.cli.common import UsageError
from rlprof.tracking.prometheus import scrape_config

HELP = "print rlprof's Prometheus alert rules, its Grafana dashboard, or a scrape configuration for runs' ranks"
EXAMPLE = "rlprof prometheus scrape outputs/logs/rlprof/ppo-demo > prometheus.yml; rlprof prometheus rules > rlprof.yml"
RULES = "prometheus_rules.yml"
DASHBOARD = "grafana_dashboard.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_subparsers(dest="what", required=True)
    what.add_parser("rules", help="the alert rules file (for rule_files:)")
    what.add_parser("dashboard", help="the Grafana dashboard (JSON, to import; its data source: a Prometheus server)")
    scrape = what.add_parser("scrape", help="a prometheus.yml scraping every rank of these runs every 15 s")
    scrape.add_argument("log_dirs", type=Path, nargs="+", metavar="RUN_LOG_DIR", help="a run's trainer.log_dir")
    scrape.add_argument("--interval", default="15s", help="scrape and rule evaluation interval (default 15s)")
    scrape.add_argument("--rules", type=Path, help="a rules file to load (the output of `rlprof prometheus rules`)")


def shipped(name: str) -> str:
    """A file shipped beside the prometheus backend: the rules or the dashboard."""
    return resources.files("rlprof.tracking").joinpath(name).read_text(encoding="utf-8")


def command(args: argparse.Namespace, console: Console) -> int:
    if args.what in ("rules", "dashboard"):
        print(shipped(RULES if args.what == "rules" else DASHBOARD), end="")
        return 0
    missing = [str(folder) for folder in args.log_dirs if not folder.is_dir()]
    if missing:
        raise UsageError(
            f"rlprof prometheus scrape: not a folder: {', '.join(missing)} (give each run's trainer.log_dir)"
        )
    print(json.dumps(scrape_config(args.log_dirs, args.interval, args.rules), indent=2))
    return 0
