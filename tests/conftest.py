"""Shared fixtures: a private FT_HOME (presets written once per run) and a live `ft serve`
app on a loopback port (the real app, engine and store; see gateway/embedded.py)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

import pytest

from gateway.embedded import EmbeddedServer, serve_in_thread
from gateway.ports import free_port

__all__ = ["free_port", "serve_args", "start_server"]


@pytest.fixture(scope="session", autouse=True)
def ft_home(tmp_path_factory) -> str:
    home = os.environ.get("FT_TEST_HOME") or str(tmp_path_factory.mktemp("ft_home"))
    os.environ["FT_HOME"] = home
    return home


def start_server(**config) -> EmbeddedServer:
    """The real server for ServeConfig(**config), with an httpx client helper."""
    from gateway.service import ServeConfig

    return serve_in_thread(ServeConfig(**config))


def serve_args(*argv: str) -> argparse.Namespace:
    """`ft serve`'s flags parsed as its CLI parses them (argparse errors raise SystemExit)."""
    from gateway.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def live_server() -> Iterator[EmbeddedServer]:
    server = start_server(preset="tiny", policy="anchor", default_max_tokens=16)
    yield server
    server.stop()
