"""The fast loop's guard (tests/fastloop.py) on generated tests, run in this process by pytester."""

import os

import pytest

from tests import fastloop

LOAD_FACTOR = fastloop.load_factor  # the real one: the pytester fixture replaces it
CONFTEST = ("from tests.fastloop import pytest_addoption, pytest_configure, pytest_runtest_makereport, "
            "pytest_runtest_setup\n")

SLEEPERS = """
import time

import pytest


def test_sleeps_unmarked():
    time.sleep(0.15)


@pytest.mark.slow
def test_sleeps_marked():
    time.sleep(0.15)


class TestQuick:
    def test_quick(self):
        pass


@pytest.fixture(scope="module")
def built():
    time.sleep(0.15)  # a fixture that trains, say


def test_pays_for_the_fixture(built):
    pass


def test_fails_of_itself():
    time.sleep(0.15)
    assert False, "its own failure"
"""


@pytest.fixture
def pytester(pytester, monkeypatch):
    # the inner runs load pytest's own plugins only: hypothesis's and the rest cost seconds a run
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setattr(fastloop, "load_factor", lambda: 1.0)  # a quiet machine, whatever this one's load
    pytester.makeconftest(CONFTEST)
    return pytester


def test_an_unmarked_test_over_the_limit_fails_and_a_marked_one_passes(pytester):
    pytester.makepyfile(test_sleepers=SLEEPERS)
    # the limit scaled down with the sleeps, so this test stays quick: 0.15 s against 0.1 s as 7.5 s against 5 s
    result = pytester.runpytest("--unmarked-limit=0.1")
    result.assert_outcomes(passed=2, failed=3)
    result.stdout.fnmatch_lines([
        "*test_sleepers.py::test_sleeps_unmarked took 0.* s unmarked: mark it @pytest.mark.slow "
        "(it starts a process / trains / takes over 0.1 s; see CONTRIBUTING.md, 'The fast loop')",
        "*test_sleepers.py::test_pays_for_the_fixture took 0.* s unmarked: mark it @pytest.mark.slow*",
    ])
    # a test that fails of itself keeps its own failure
    result.stdout.fnmatch_lines(["*its own failure*"])
    assert "test_fails_of_itself took" not in result.stdout.str()
    # --unmarked-limit=0 turns the guard off
    pytester.runpytest("--unmarked-limit=0", "-k", "sleeps_unmarked").assert_outcomes(passed=1)


def test_the_bound_grows_with_the_machines_load(pytester, monkeypatch):
    # load 6 on 2 cores: 3 times the bound; 0.15 s against 0.3 s passes, as 7.5 s would against 15 s
    monkeypatch.setattr(os, "getloadavg", lambda: (6.0, 5.0, 4.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert LOAD_FACTOR() == 3.0
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 5.0, 4.0))
    assert LOAD_FACTOR() == 1.0  # never below the bound itself
    monkeypatch.setattr(fastloop, "load_factor", lambda: 3.0)
    pytester.makepyfile(test_sleepers=SLEEPERS)
    pytester.runpytest("--unmarked-limit=0.1", "-k", "sleeps_unmarked").assert_outcomes(passed=1)


@pytest.mark.slow  # starts a process: that is the point
def test_an_unmarked_test_that_starts_a_process_fails_however_quick(pytester):
    pytester.makepyfile(test_spawners="""
        import multiprocessing
        import subprocess
        import sys

        import pytest


        def test_runs_a_command():
            subprocess.run([sys.executable, "-c", "pass"], check=True)


        def test_starts_a_process():
            p = multiprocessing.get_context("spawn").Process(target=print, name="spawned-one")
            p.start()
            p.join()


        @pytest.mark.slow
        def test_runs_a_command_marked():
            subprocess.run([sys.executable, "-c", "pass"], check=True)
    """)
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([
        "*test_spawners.py::test_runs_a_command started a process (subprocess: *python* -c pass) unmarked: "
        "mark it @pytest.mark.slow*",
        "*test_spawners.py::test_starts_a_process started a process (multiprocessing: spawned-one) unmarked: "
        "mark it @pytest.mark.slow*",
    ])
