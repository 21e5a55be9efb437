"""Headless entry point shared by the three roles (``python -m trainer_space`` etc.).

Builds the role's config from its environment variables, lets command-line flags
(one per config field, ``--field-name``) override them, runs the role in the
foreground and stops cleanly on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading
import typing
from typing import Any, Callable, Sequence

from ..roles import Role

logger = logging.getLogger(__name__)


def config_parser(prog: str, config_cls: type) -> argparse.ArgumentParser:
    """An argparse parser with one optional flag per config field."""
    parser = argparse.ArgumentParser(prog=prog, description=config_cls.__doc__)
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        kind = hints[field.name]
        flag = "--" + field.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=None, help=field.metadata.get("help"))
        else:
            parser.add_argument(flag, type=kind if kind in (int, float, str) else str, default=None, help=field.metadata.get("help"))
    parser.add_argument("--log-level", default="INFO")
    return parser


def run_role(name: Role, config_cls: Any, role_cls: Callable[..., Any], argv: Sequence[str] | None = None) -> None:
    """Parse flags, build the role and run it until it finishes or a signal stops it.

    Args:
        name: The role (its module is ``<name>_space``).
        config_cls: The role's settings dataclass (with ``from_env``).
        role_cls: Builds the role object from its settings.
        argv: The command line (default: ``sys.argv[1:]``).
    """
    args = vars(config_parser(f"python -m {name}_space", config_cls).parse_args(argv))
    logging.basicConfig(level=args.pop("log_level").upper(), format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    config = config_cls.from_env(**args)
    role = role_cls(config)
    done = threading.Event()

    def stop(signum, _frame):
        logger.info("signal %d: stopping", signum)
        done.set()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    role.start()
    while role.running and not done.is_set():
        done.wait(0.5)
    getattr(role, "close", role.stop)()
    logger.info("%s stopped", name)
