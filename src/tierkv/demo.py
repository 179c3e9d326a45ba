"""Placeholder replaced by the demo engine (in progress)."""

from __future__ import annotations

import argparse


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--with-server", action="store_true")


def run_demo_command(args: argparse.Namespace) -> int:
    raise SystemExit("demo not written yet")
