"""`poise-trl`: one command with subcommands: the library's `train` and `eval`, and those other packages register
(entry points `poise_trl.commands`, `poise_trl/plugins.py`): the lab's `demo`, `plot`, `probe-bench` and `bench`.

Each tool's `cli` module holds its parsers: a function `add_<name>_parser(subparsers)` registers one and stores its
handler as `func` (called with the parsed namespace, returning an exit code). Those modules import only argparse and
light defaults; the handlers import the tool (torch, TRL, the trainer) when they run, so `--help` stays fast.
A registered subcommand whose package cannot be imported (the lab without its extra) is still listed: running it
prints that package's error in one line.
A subcommand whose parser sets `forwards_arguments` (`train`, whose options are `TrlParser`'s) receives the words
after its name unparsed, as `arguments`.

Every parser here is a `CommandParser`, so the rules below hold for all subcommands without each repeating them:
- a user error (a bad option, a missing folder, an unreachable Hub, a value a handler rejects) prints one line to
  stderr, `poise-trl COMMAND: error: ...`, and exits with status 2; `--debug` shows the traceback instead;
- every option's `--help` line shows its default once: appended as `(default: X)` unless the help already says it.
"""

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import __version__, plugins
from .rlvr.cli import add_eval_parser, add_train_parser

PARSER_BUILDERS: tuple[Callable[[Any], argparse.ArgumentParser], ...] = (add_train_parser, add_eval_parser)

USAGE_ERROR = 2  # argparse's exit status for a bad command line; used for every user error
# What handlers raise for input they reject, with a message that says what to change: bad values (ValueError), missing
# files and unreachable Hubs (OSError: FileNotFoundError, ConnectionError), optional extras not installed
# (ImportError). Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError, ImportError)


def _shown(default: Any) -> str:
    return " ".join(map(str, default)) if isinstance(default, list | tuple) else str(default)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to an option's help unless the help already states its default, so it shows once.

    Flags that are off unless given, required arguments and options without a default (None) show nothing extra:
    their help says what happens when they are left out.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default:" in help_text.lower() or action.required or action.nargs == 0:
            return help_text
        if action.default is None or action.default is argparse.SUPPRESS:
            return help_text
        return f"{help_text} (default: {_shown(action.default).replace('%', '%%')})"


class RawDescriptionDefaultsHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The same, keeping a description's own line breaks (the benchmarks' tables)."""


class CommandParser(argparse.ArgumentParser):
    """The parser of `poise-trl` and of each subcommand (argparse builds subparsers with the parent's class).

    It picks the defaults-once formatter (keeping raw descriptions raw), adds `--debug`, records its `prog` so a
    handler's error names the subcommand, and reports command-line errors in one line.
    """

    def __init__(self, *args: Any, formatter_class: type = argparse.HelpFormatter, **kwargs: Any) -> None:
        raw = issubclass(formatter_class, argparse.RawDescriptionHelpFormatter)
        formatter = RawDescriptionDefaultsHelpFormatter if raw else DefaultsHelpFormatter
        super().__init__(*args, formatter_class=formatter, **kwargs)
        # SUPPRESS: a subcommand's parse must not reset a `--debug` given before the subcommand name.
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="on an error, show the full traceback instead of one line")  # fmt: skip
        self.set_defaults(command_prog=self.prog)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> CommandParser:
    parser = CommandParser(
        prog="poise-trl", description="POISE for TRL: value baselines from the policy's own internal states."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser in PARSER_BUILDERS:
        add_parser(subparsers)
    for name, entry in plugins.registered(plugins.COMMANDS).items():
        try:
            add_registered = plugins.load(entry)
        except ImportError as error:
            add_unavailable_parser(subparsers, name, error)
        else:
            add_registered(subparsers)
    return parser


def add_unavailable_parser(subparsers: Any, name: str, error: ImportError) -> argparse.ArgumentParser:
    """`poise-trl NAME` for a registered subcommand that cannot be imported: it takes any words and reports `error`."""

    def report(args: argparse.Namespace) -> int:
        raise error

    parser = subparsers.add_parser(name, help=f"unavailable: {error}".replace("%", "%%"), add_help=False)
    parser.set_defaults(func=report, forwards_arguments=True)
    return parser


def iter_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and every subcommand's parser below it, depth first."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in dict.fromkeys(action.choices.values()):
                yield from iter_parsers(subparser)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's namespace; a forwarding subcommand gets the words after its name as `arguments`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, _ = parser.parse_known_args(argv)
    if not getattr(args, "forwards_arguments", False):
        return parser.parse_args(argv)  # unknown words are an error
    args.arguments = [word for word in argv[argv.index(args.command) + 1 :] if word != "--debug"]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    try:
        return args.func(args)
    except USER_ERRORS as error:
        if getattr(args, "debug", False):
            raise
        message = str(error) or type(error).__name__
    except SystemExit as exit_request:  # `raise SystemExit("message")`: a handler's own user error
        if not isinstance(exit_request.code, str) or getattr(args, "debug", False):
            raise
        message = exit_request.code
    print(f"{args.command_prog}: error: {' '.join(message.split())}", file=sys.stderr)
    return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
