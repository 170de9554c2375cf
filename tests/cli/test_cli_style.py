"""One command-line style: ``key=value`` and ``--key value`` mean the same to every subcommand."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from bigbatch.cli.main import _Prefixed, _set_up_logging, _subparser, build_parser, main, one_style


def parse(*words: str):  # type: ignore[no-untyped-def]
    parser = build_parser(load=[words[0]])
    options = _subparser(parser, words[0])._option_string_actions
    args, extra = parser.parse_known_args(
        [words[0], *one_style(list(words[1:]), words[0], options)]
    )
    return args, extra


def test_flag_commands_take_key_value_in_any_order() -> None:
    flags, _ = parse("plan", "--arch", "resnet18", "--batch", "64", "--budget", "1GB")
    keys, _ = parse("plan", "batch=64", "arch=resnet18", "--budget", "1GB")
    assert (keys.arch, keys.batch, keys.budget) == (flags.arch, flags.batch, flags.budget)
    switch, _ = parse("plan", "arch=resnet18", "batch=64", "budget=1GB", "fastest=true")
    assert switch.fastest is True
    off, _ = parse("plan", "arch=resnet18", "batch=64", "budget=1GB", "fastest=false")
    assert off.fastest is False


def test_key_commands_take_flags_and_keys_after_out() -> None:
    _, extra = parse("train", "data=x", "--out", "runs/y", "--epochs", "1", "--batch=8", "epochs=2")
    assert extra == ["epochs=1", "batch=8", "epochs=2"]  # main() appends these to the overrides


def test_a_switch_with_a_value_that_is_not_a_truth_value_names_the_fix(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        main(["plan", "arch=resnet18", "batch=8", "budget=1GB", "fastest=maybe"])
    assert "fastest=true or fastest=false" in capsys.readouterr().err


def test_a_value_starting_with_a_dash_reaches_its_own_check(capsys) -> None:  # type: ignore[no-untyped-def]
    """argparse takes ``-5GB`` after ``--budget`` for a flag and says only "expected one
    argument": the value goes to the budget's own check, which says what is wrong with it."""
    args, _ = parse("plan", "--arch", "resnet18", "--margin", "-0.5", "--budget", "-5GB")
    assert (args.budget, args.margin) == ("-5GB", -0.5)
    assert main(["plan", "--arch", "resnet18", "--batch", "8", "--budget", "-5GB"]) == 2
    assert "a memory size must be positive, got '-5GB'" in capsys.readouterr().err
    switch, _ = parse("plan", "--arch", "resnet18", "--fastest", "--budget", "1GB")
    assert switch.fastest is True and switch.budget == "1GB"  # a flag is still a flag


def test_quiet_and_verbose_set_bigbatchs_log_level() -> None:
    log = logging.getLogger("bigbatch")
    level, handlers, propagate = log.level, list(log.handlers), log.propagate
    try:
        for flag, want in (("-q", logging.ERROR), ("-v", logging.INFO), (None, logging.WARNING)):
            args, _ = build_parser(load=[]).parse_known_args([*([flag] if flag else []), "verify"])
            _set_up_logging(args.verbose, args.quiet)
            assert log.level == want
        assert sum(isinstance(h.formatter, _Prefixed) for h in log.handlers) == 1
    finally:
        log.setLevel(level)
        log.handlers[:] = handlers
        log.propagate = propagate


def test_log_lines_say_bigbatch_once() -> None:
    def line(message: str) -> str:
        record = logging.LogRecord("bigbatch", logging.WARNING, "", 0, message, None, None)
        return _Prefixed("%(message)s").format(record)

    assert line("bigbatch: micro-batch 8 -> 4") == "bigbatch: micro-batch 8 -> 4"
    assert line("a note") == "bigbatch: a note"


@pytest.mark.slow
def test_the_command_exits_like_the_interpreter_without_its_teardown(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`bigbatch` skips tearing down torch's modules (0.8-0.9 s of a plan) but keeps what an
    exit owes: other threads finish (a thread pool left open too: joining its threads without
    shutting it down would wait forever), atexit handlers run, buffered output is written, the
    code is the command's."""
    import subprocess
    import sys

    script = (
        "import atexit, pathlib, sys, threading, time, torch\n"
        "from bigbatch.cli.main import _exit_without_teardown\n"
        f"out = pathlib.Path({str(tmp_path)!r})\n"
        "atexit.register(lambda: (out / 'atexit').write_text('ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), (out / 'thread').write_text('done'))).start()\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "pool = ThreadPoolExecutor(1)  # never shut down: the exit does it, as Python's would\n"
        "pool.submit(lambda: (time.sleep(0.2), (out / 'pool').write_text('done')))\n"
        "print('buffered', end='')\n"
        "_exit_without_teardown(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3, proc.stderr[-1000:]
    assert proc.stdout == "buffered"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "pool").read_text() == "done"


@pytest.mark.slow
def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    """`bigbatch plan --list-cards | head -1`: the pipe closes under the command."""
    import subprocess
    import sys

    done = subprocess.run(
        f"{sys.executable} -m bigbatch plan --list-cards | head -1",
        shell=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.stdout.startswith("card") and "Traceback" not in done.stderr, done.stderr


def test_prediction_runs_where_training_does_by_default() -> None:
    """predict and ensemble pick the GPU where there is one, as train's device=auto does: a
    Kaggle notebook's `bigbatch predict RUN IMAGES` does not run its TTA on the CPU."""
    import inspect

    from bigbatch.cli import ensemble as ensemble_cli
    from bigbatch.train.config import TrainConfig
    from bigbatch.train.tasks import PredictRequest
    from bigbatch.train.tasks.classification.predict import predict_files
    from bigbatch.train.tasks.regression.predict import predict_files as predict_values
    from bigbatch.train.tasks.segmentation.predict import predict_masks
    from bigbatch.train.tasks.segmentation.submit import write_submission

    assert parse("predict", "runs/a", "images")[0].device == TrainConfig.device == "auto"
    # ensemble's --device is filled in once an experiments TOML has refused it typed.
    assert parse("ensemble", "runs/a", "runs/b")[0].device is None
    assert ensemble_cli._FOLDER_FLAGS["device"] == "auto"
    assert PredictRequest(run_dir=Path("runs/a"), inputs=Path("images")).device == "auto"
    for f in (predict_files, predict_values, predict_masks, write_submission):
        assert inspect.signature(f).parameters["device"].default == "auto", f.__module__


def test_every_option_of_every_command_says_what_it_does() -> None:
    """`bigbatch COMMAND --help` is the reference users read first: no flag without a line."""
    import argparse

    from bigbatch.cli.main import COMMANDS

    def bare(name: str, parser: argparse.ArgumentParser) -> list[str]:
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):  # nnunet's own commands
                for sub, sub_parser in action.choices.items():
                    found += bare(f"{name} {sub}", sub_parser)
            elif action.dest != "help" and not action.help:
                found.append(f"{name} {(action.option_strings or [action.dest])[-1]}")
        return found

    parser = build_parser()
    assert [b for name in COMMANDS for b in bare(name, _subparser(parser, name))] == []
