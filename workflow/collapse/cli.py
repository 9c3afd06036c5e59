"""The ``collapse`` command: one subcommand per stage, each owned by its module.

A module that owns a subcommand defines ``add_cli(subparsers)``: it adds its parser and sets
``func`` (a callable taking the parsed args and returning an exit code). Modules are imported
lazily so ``collapse --help`` stays fast and ``collapse analyze`` never imports torch.

Exit status, the same for every subcommand: 0 done; 2 bad usage or input (argparse's message,
or one ``error: ...`` line for an ``InputError`` or a missing file, no traceback); 1 a failure
inside the run (its traceback, then an ``error: ...`` line); others as a subcommand documents
(3: a gate or check it was asked to enforce failed).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

EXIT_INPUT = 2  # bad usage or input: the user can fix it
EXIT_FAILURE = 1  # a failure inside the run: a bug or the environment

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
    "watch": "collapse.watch",
}


def build_parser(modules: dict[str, str] = SUBCOMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="collapse",
        description="Plan, train and analyse LLM families whose normalized loss curves collapse "
        "(Bergsma et al. 2025, arXiv 2509.25087).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in modules.values():
        importlib.import_module(module).add_cli(sub)
    return parser


def _show_notes() -> None:
    """Notes about the input (``collapse.logreaders.LogNote``) print as one ``note:`` line."""
    import warnings

    from collapse.logreaders import LogNote

    default = warnings.showwarning
    if getattr(default, "shows_notes", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, LogNote):
            print(f"note: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    show.shows_notes = True
    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    from collapse.validate import InputError

    args = build_parser().parse_args(argv)
    _show_notes()
    try:
        return int(args.func(args) or 0)
    except (InputError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INPUT
    except Exception as err:  # noqa: BLE001 - any other failure: say so, keep the traceback
        traceback.print_exc()
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
