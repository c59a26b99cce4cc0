"""`poise-trl` with the lab's commands, as a user of `make install` meets it: every `--help` line of every
subcommand explains its option and shows the default once, parsing loads no heavy library, and a user error of a lab
command is one line on stderr with exit status 2 (the traceback only with `--debug`)."""

import argparse
import os
import subprocess
import sys

import pytest

from poise_lab.bench.value.resolve import load_reward_fn
from poise_trl import cli

from ..test_cli import RECIPE, ROOT, _one_error_line

NOT_OPTIONS = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def _options() -> list[tuple[argparse.ArgumentParser, argparse.Action]]:
    return [
        (parser, action)
        for parser in cli.iter_parsers(cli.build_parser())
        for action in parser._actions
        if not isinstance(action, NOT_OPTIONS)
    ]


def test_the_walk_reaches_every_subcommand():
    progs = {parser.prog for parser in cli.iter_parsers(cli.build_parser())}
    expected = {
        "train",
        "demo",
        "plot",
        "eval",
        "probe-bench",
        "bench",
        "bench efficiency",
        "bench gradient",
        "bench overhead",
        "bench pool-tokens",
        "bench scalars",
        "bench summarize",
    }
    assert progs == {"poise-trl"} | {f"poise-trl {name}" for name in expected}
    assert len(_options()) > 100


@pytest.mark.parametrize("parser,action", _options(), ids=[f"{p.prog}:{a.dest}" for p, a in _options()])
def test_every_option_has_help_and_shows_its_default_once(parser, action):
    assert action.help, f"{parser.prog} {action.option_strings or action.dest}: no help text"
    shown = parser._get_formatter()._expand_help(action)
    mentions = shown.lower().count("default:")
    name = f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"
    assert mentions <= 1, f"{name} shows its default {mentions} times: {shown!r}"
    takes_value = action.nargs != 0 and not action.required
    if takes_value and action.default is not None:
        assert mentions == 1, f"{name} hides its default {action.default!r}: {shown!r}"
        assert f"(default: {cli._shown(action.default)})" in shown or "(default:" in action.help, shown


@pytest.mark.parametrize("parser", list(cli.iter_parsers(cli.build_parser())), ids=lambda p: p.prog)
def test_help_pages_have_no_placeholder_defaults_or_internal_wording(parser):
    text = parser.format_help()
    assert "(default: None)" not in text
    for internal in ("issue-", "issue ", "README: "):
        assert internal not in text, f"{parser.prog} --help says {internal!r}"


def test_parsing_every_subcommand_imports_no_heavy_library():
    """`--help` stays fast: the parsers, the lab's registered ones included, load neither torch nor TRL nor the
    lab's plotting; the handlers import them when they run."""
    code = (
        "import sys\nfrom poise_trl import cli\nparser = cli.build_parser()\n"
        "assert {'bench', 'demo', 'eval', 'train'} <= set(parser._subparsers._group_actions[0].choices)\n"
        "print(sorted({name.split('.')[0] for name in sys.modules} & {'torch', 'trl', 'transformers', 'matplotlib'}))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_plot_on_a_missing_folder(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path / "missing")]) == cli.USAGE_ERROR == 2
    assert "No trainer_state.json in" in _one_error_line(capsys, "poise-trl plot")


def test_probe_bench_k_1_fails_before_any_model_loads(tmp_path, capsys, monkeypatch):
    from poise_lab.bench.value import report  # the handler, which holds its own reference to the collection step

    monkeypatch.setattr(report, "collect_from_args", lambda *a: pytest.fail("loaded the model before checking --k"))
    assert cli.main(["probe-bench", "--k", "1", "--output-dir", str(tmp_path)]) == 2
    assert "--k 1: leave-one-out targets need at least 2 rollouts" in _one_error_line(capsys, "poise-trl probe-bench")


def test_bad_values_are_one_line_too(tmp_path, capsys):
    """Errors found by the handlers (ValueError, FileNotFoundError, a `SystemExit("...")`) and by argparse."""
    assert cli.main(["demo", "--max-digits", "12", "--cache-dir", str(tmp_path), "--output-dir", str(tmp_path)]) == 2
    assert "must lie within [1, 9] digits" in _one_error_line(capsys, "poise-trl demo")
    missing = tmp_path / "none.safetensors"
    assert cli.main(["probe-bench", "--from-collection", str(missing), "--output-dir", str(tmp_path)]) == 2
    assert str(missing) in _one_error_line(capsys, "poise-trl probe-bench")
    with pytest.raises(ValueError, match="--reward-fn 'no_such_module:f': No module named"):
        load_reward_fn("no_such_module:f")
    assert cli.main(["bench", "efficiency", "--model", "m", "--output-dir", str(tmp_path)]) == 2
    assert "--model needs --train-dataset" in _one_error_line(capsys, "poise-trl bench efficiency")
    fixture = str(ROOT / "tests" / "fixtures" / "amc23.jsonl")
    assert cli.main(["eval", str(tmp_path / "no_model"), "--benchmarks", fixture]) == 2
    assert "no model directory at" in _one_error_line(capsys, "poise-trl eval")
    for argv in (["probe-bench", "--k", "x"], ["bench"], []):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
        _one_error_line(capsys, " ".join(["poise-trl", *argv[:1]]))


@pytest.mark.parametrize("position", ["before", "after"])
def test_debug_shows_the_traceback(tmp_path, position):
    argv = ["plot", str(tmp_path / "missing")]
    argv = ["--debug", *argv] if position == "before" else [*argv, "--debug"]
    with pytest.raises(FileNotFoundError, match="No trainer_state.json"):
        cli.main(argv)


def test_train_gets_the_words_after_its_name_and_the_recipe_with_overrides():
    from poise_trl.rlvr.train import parse_args

    args = cli.parse(["--debug", "train", "--config", RECIPE, "--learning_rate", "2e-6", "--probe_layer", "-1"])
    assert args.debug and args.arguments == ["--config", RECIPE, "--learning_rate", "2e-6", "--probe_layer", "-1"]
    _, training_args, model_args = parse_args([*args.arguments, "--use_cpu", "true"])
    assert (training_args.learning_rate, training_args.probe_layer) == (2e-6, -1)  # the command line wins
    assert (training_args.num_generations, model_args.model_name_or_path) == (2, "Qwen/Qwen3-4B")  # the recipe's
    # Other subcommands still refuse words they do not know.
    with pytest.raises(SystemExit) as exit_info:
        cli.parse(["demo", "--learning_rate", "2e-6"])
    assert exit_info.value.code == 2
