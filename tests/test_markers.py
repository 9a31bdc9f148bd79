"""conftest's rule for the `slow` marker cannot be missed: an unmarked test that starts a Python
subprocess (a script, a server, torchrun) or a sampler process fails and says to mark it; marked,
the same test runs. And the suite's xdist groups hold: tests that share a run make it once."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
CONFTEST = (ROOT / "tests" / "conftest.py").read_text()


@pytest.mark.slow  # (a pytest in a subprocess)
def test_an_unmarked_test_that_starts_a_python_subprocess_fails_and_a_marked_one_passes(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner='''
        import subprocess, sys
        import pytest

        def test_unmarked():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        @pytest.mark.slow
        def test_marked():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        def test_a_small_system_command_is_allowed():
            subprocess.run(["true"], check=True)
    ''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")  # (in-process, pytester would re-import torch)
    result.assert_outcomes(passed=2, failed=1, errors=1)  # the unmarked one: its call fails and its teardown says why
    result.stdout.fnmatch_lines(["*a Python subprocess in a test not marked slow*"])


@pytest.mark.slow
def test_an_unmarked_test_that_starts_a_sampler_fails(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner='''
        from fastrl import vllm_sampler

        def test_unmarked():
            vllm_sampler.Sampler(vllm_sampler.SamplerConfig(model="none", placement="cpu")).start()
    ''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")  # (in-process, pytester would re-import torch)
    result.assert_outcomes(failed=1, errors=1)
    result.stdout.fnmatch_lines(["*a sampler process in a test not marked slow*"])


@pytest.mark.slow  # (a pytest with two workers in a subprocess)
def test_tests_that_share_a_module_fixture_in_an_xdist_group_build_it_once(pytester):
    """The suite's command (.ci/run's, the README's: -n 2 --dist loadgroup) sends an xdist_group's tests to one worker,
    so a run they share is made once, not once a worker (pytest 9.2 silently undid the groups: pyproject pins below)."""
    options = (ROOT / ".ci" / "run").read_text().split(".venv/bin/python -m pytest tests")[1].split()
    built = pytester.path / "built.txt"
    pytester.makepyfile(test_inner=f'''
        import pytest

        @pytest.fixture(scope="module")
        def shared_run():
            with open({str(built)!r}, "a") as f:
                f.write("built\\n")

        @pytest.mark.xdist_group("shared")
        @pytest.mark.parametrize("i", range(3))
        def test_grouped(shared_run, i):
            pass

        @pytest.mark.parametrize("i", range(4))
        def test_alone(i):
            pass

        @pytest.mark.xdist_group("shared")
        def test_grouped_too(shared_run):
            pass
    ''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *options)
    result.assert_outcomes(passed=8)
    assert built.read_text().splitlines() == ["built"]
