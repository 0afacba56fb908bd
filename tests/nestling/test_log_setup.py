"""The command lines' log handler follows sys.stderr: a stream swapped and closed since logging was configured
is never written to (the embedded broker's thread used to print 'Logging error' tracebacks at exit)."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from nestling.log_setup import CurrentStderrHandler, configure_logging


@pytest.fixture
def root_restored():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def test_records_go_to_the_stderr_of_the_moment_even_after_the_first_one_closed(
    root_restored: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging(logging.INFO, "%(levelname)s %(message)s", force=True)
    logging.getLogger("nestling.test").info("to the first")
    assert first.getvalue() == "INFO to the first\n"
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    monkeypatch.setattr(
        logging, "raiseExceptions", True
    )  # a handler error would print its traceback to stderr
    logging.getLogger("nestling.test").warning("to the second")
    assert second.getvalue() == "WARNING to the second\n"  # the line, and no '--- Logging error ---'
    assert [type(h) for h in root_restored.handlers] == [CurrentStderrHandler]


def test_without_force_an_existing_configuration_is_kept(root_restored: logging.Logger) -> None:
    configure_logging(logging.INFO, "%(message)s", force=True)
    configure_logging(
        logging.ERROR, "%(message)s"
    )  # what `nestling` does before a subcommand's own --log-level
    assert root_restored.level == logging.INFO and len(root_restored.handlers) == 1
