"""conftest's rule for the `slow` marker cannot be missed: an unmarked test that starts a Python
subprocess (a script, a server, torchrun) or a sampler process fails and says to mark it; marked,
the same test runs."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


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
