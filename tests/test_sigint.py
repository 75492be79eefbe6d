"""The suite's SIGINT guard (tests/conftest.py): a test that leaves SIGINT changed fails, and
the tests after it find SIGINT as the run did."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent

CONFTEST = f"""
import importlib.util

spec = importlib.util.spec_from_file_location("suite_conftest", {str(TESTS / "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_runtest_teardown = suite.pytest_runtest_teardown
"""

TESTS_OF_IT = """
import signal

AT_START = signal.getsignal(signal.SIGINT)


def test_leaves_a_handler():
    signal.signal(signal.SIGINT, lambda signum, frame: None)


def test_after_it():
    assert signal.getsignal(signal.SIGINT) is AT_START


def test_blocks_it():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])


def test_restores_what_it_changed():
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGINT, old)
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
"""


def test_a_test_that_leaves_sigint_changed_fails_and_the_next_finds_it_back(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_it.py").write_text(TESTS_OF_IT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    res = subprocess.run(
        [*argv, "--rootdir", str(tmp_path), "test_it.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert "test_leaves_a_handler left SIGINT changed (was, now): {'handler'" in out
    assert "test_blocks_it left SIGINT changed (was, now): {'blocked': (False, True)}" in out
    assert "4 passed, 2 errors" in out  # every test passed; two fail at their teardown
