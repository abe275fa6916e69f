"""What the commands share: the config file read once, the kernel policy with its flags,
argparse types, the error console."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from rich.console import Console

from sequester.config import Config, load_config
from sequester.policy import Policy

__all__ = ["add_policy_flags", "config_of", "err", "policy_of", "positive"]

err = Console(stderr=True)


def config_of(args: argparse.Namespace) -> Config:
    """The whole config file, validated once per command (every table, whatever the command uses)."""
    if getattr(args, "_loaded", None) is None:
        args._loaded = load_config(args.config)
    return args._loaded


def policy_of(args: argparse.Namespace) -> Policy:
    policy = config_of(args).policy
    return policy.with_overrides(
        allow=getattr(args, "allow", None) or (),
        readonly=getattr(args, "readonly", None) or (),
        hide=getattr(args, "hide", None) or (),
        isolation=_isolation_flag(args.isolation) if getattr(args, "isolation", None) else None,
    )


def _isolation_flag(text: str) -> object:
    return {"true": True, "false": False}.get(text, text)


def add_policy_flags(p: argparse.ArgumentParser, *, overrides: bool) -> None:
    p.add_argument("--config", metavar="FILE", help="policy file (TOML); default: the embedded configs/default.toml")
    if overrides:
        p.add_argument("--allow", action="append", metavar="HOST:PORT", help="also allow this service (or URL)")
        p.add_argument("--readonly", action="append", metavar="PATH", help="also mount this path read-only")
        p.add_argument("--hide", action="append", metavar="PATH", help="also hide this path")
    p.add_argument("--isolation", choices=["true", "auto", "false"], help="override runtime.isolation")


def positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: a positive ``kind``; the error names the value."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
        return value

    return parse
