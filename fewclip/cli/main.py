"""The ``fewclip`` command line: ``fewclip COMMAND [file.yaml ...] [key=value ...]``.

The CLI turns arguments into config objects and calls plain library functions.
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Sequence

from fewclip.cli.table import BY_NAME, COMMANDS
from fewclip.utils.env import describe_environment
from fewclip.utils.errors import describe, take_debug_flag
from fewclip.utils.logs import setup_logging  # light: logging only
from fewclip.version import __version__

COMMAND_NAMES = tuple(c.name for c in COMMANDS)
COMMAND_HELP = {c.name: c.usage for c in COMMANDS if c.usage}  # --help of the commands without a run config


def _usage() -> str:
    lines = []
    for c in COMMANDS:
        lines.append(f"  {c.name:<13}{c.summary[0]}")
        lines += [f"  {'':<13}{more}" for more in c.summary[1:]]
    return "\n".join(lines)


USAGE = f"""usage: fewclip COMMAND [file.yaml ...] [key=value ...]

commands:
{_usage()}

Overrides use omegaconf dotlist syntax (data.templates=single); backbone=NAME,
data=NAME and adapter=NAME set that section's name. `fewclip COMMAND --help`
prints the command's full config with its defaults. An error prints one line
(exit code 2: bad input, 1: the run failed); --debug or FEWCLIP_DEBUG=1 adds the trace.

environment:
{describe_environment()}
"""


def main(argv: Sequence[str] | None = None) -> int:
    """``fewclip ARGS``; a reader that leaves early (``fewclip adapters | head -1``) ends it quietly with 0."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at the interpreter's exit, where a closed pipe would be reported
        return code
    except BrokenPipeError:
        return _pipe_closed()


def _pipe_closed() -> int:
    """The output's reader is gone: what is still buffered goes nowhere, and the command ends with 0."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor (stdout replaced in a test)
        pass
    return 0


def _main(argv: Sequence[str] | None = None) -> int:
    debug, argv = take_debug_flag(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"fewclip {__version__}")
        return 0
    command, args = argv[0], argv[1:]
    if command not in COMMAND_NAMES:
        print(f"fewclip: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    spec = BY_NAME[command]
    wants_help = "--help" in args or "-h" in args
    if wants_help and not spec.run_config:  # no model needed: answered here
        print(spec.usage or f"fewclip {command}: no options")
        if spec.options:  # the options, with their help, from their dataclass (no torch)
            lines = importlib.import_module("fewclip.config.help").describe_config(spec.options_class()())
            print("\noptions (key=value; defaults shown):\n" + "\n".join("  " + line for line in lines))
        return 0
    try:
        if wants_help:  # a run config's options, torch-free where fewclip.cli.quickhelp can compose them
            lines = importlib.import_module("fewclip.cli.quickhelp").help_lines(command, args)
            if lines is not None:
                print("\n".join(lines))
                return 0
            # a plugin's method or launcher: the full help composes the config with the registries (loads torch)
            return importlib.import_module("fewclip.cli.commands").config_help(command, args)
        if spec.run_config:  # a typo in the config or a backbone name, answered before torch is imported
            importlib.import_module("fewclip.cli.early_check").check(command, args)
        setup_logging("info")  # fewclip's lines at INFO until the command's config says otherwise
        # The command's module is imported here (torch and open_clip: seconds), so `fewclip --help` does not pay it.
        return spec.function()(args)
    except BrokenPipeError:
        raise  # main() ends the command quietly
    except KeyboardInterrupt:
        print(f"fewclip {command}: interrupted; finished results are kept", file=sys.stderr)
        return 130
    except Exception as e:  # every error ends in one message (fewclip.utils.errors); --debug shows the trace
        if debug:
            traceback.print_exc()
        message, code = describe(e)
        print(f"fewclip {command}: error: {message}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
