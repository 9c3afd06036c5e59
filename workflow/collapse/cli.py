"""The ``collapse`` command: one subcommand per stage, each owned by its module.

A module that owns a subcommand defines ``add_cli(subparsers)``: it adds its parser and sets
``func`` (a callable taking the parsed args and returning an exit code). Modules are imported
lazily so ``collapse --help`` stays fast and ``collapse analyze`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module that defines add_cli(subparsers)
SUBCOMMANDS = {
    "plan": "collapse.plan",
    "data": "collapse.data",
    "analyze": "collapse.analysis",
    "predict": "collapse.predict",
    "compare": "collapse.compare",
    "evaluate": "collapse.evaluate",
    "report": "collapse.report",
    "stage": "collapse.stages",
}


def build_parser(modules: dict[str, str] = SUBCOMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="collapse",
        description="Plan, train and analyse LLM families whose normalized loss curves collapse "
        "(Bergsma et al. 2025, arXiv 2509.25087).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in modules.values():
        try:
            importlib.import_module(module).add_cli(sub)
        except ModuleNotFoundError as err:  # a stage not built yet must not break the others
            if err.name != module:
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
