"""`tiercache serve` (the daemon) and `tiercache stats` (its state as a table)."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from tiercache_service import stats_cli
from tiercache import __version__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tiercache", description="Tiered KV and SSM state cache daemon")
    parser.add_argument("--version", action="version", version=f"tiercache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser(
        "serve", help="run the daemon until SIGTERM or Ctrl-C",
        description="Each setting comes from the --config TOML file (by its name), its TIERCACHE_* "
                    "variable or its flag, later ones winning.")
    stats_cli.add_parser(commands)
    if _command(argv) == "stats":  # the daemon's modules (torch, the engine) stay unloaded
        return stats_cli.run(parser.parse_args(argv))
    from tiercache_service import config as service_config, logs
    from tiercache_service.server import serve
    from tiercache.errors import TiercacheError
    service_config.add_flags(serve_parser)
    args = parser.parse_args(argv)
    flags = {f.name: getattr(args, f.name) for f in fields(service_config.ServiceConfig)}
    try:
        config = service_config.load(args.config, flags=flags)
        logs.setup(config.log_format, config.log_level)
        ignored = service_config.environment_warning()
        if ignored:  # e.g. Kubernetes' TIERCACHE_PORT=tcp://...: never a reason not to start
            logging.getLogger("tiercache.service").warning(ignored)
        return serve(config)
    except (TiercacheError, RuntimeError, OSError) as error:
        print(f"tiercache: {error}", file=sys.stderr)
        return 2


def _command(argv: list[str]) -> str | None:
    """The subcommand named: the first argument that is no option."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


if __name__ == "__main__":
    sys.exit(main())
