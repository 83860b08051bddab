"""tools/pytest_isolated.py, what bench/gpu_check.sh runs the cuda tests with: a test that
kills the process must not hide the tests after it (the first H200 run lost every cuda test
after a segfaulting one)."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "pytest_isolated.py"

SUITE = textwrap.dedent(
    """
    import os
    import signal

    import pytest

    pytestmark = pytest.mark.gpu_like


    def test_a_first():
        assert 1 + 1 == 2


    def test_b_segfaults():
        if os.environ.get("ISOLATED_CRASH", "1") == "1":
            os.kill(os.getpid(), signal.SIGSEGV)


    @pytest.mark.parametrize("n", [1, 2])
    def test_c_after(n):
        assert n > 0


    def test_d_fails():
        assert os.environ.get("ISOLATED_FAIL", "0") != "1"


    @pytest.mark.skip(reason="a skipped test in the suite: the tool counts it as an outcome")
    def test_e_skipped():
        pass
    """
)


def run(tmp_path, *args, crash="1", fail="0"):
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu_like: marked\n")
    env = {"ISOLATED_CRASH": crash, "ISOLATED_FAIL": fail, "PATH": "/usr/bin:/bin",
           "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, str(TOOL), *args, "test_suite.py"], cwd=tmp_path,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)


def test_a_crash_is_isolated_and_the_later_tests_still_run(tmp_path):
    proc = run(tmp_path, "-m", "gpu_like", "--per-test-timeout", "60")
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "the run died (killed by signal 11)" in out, out
    # test_a ran before the crash; the crashing test and the three after it are rerun alone.
    assert "rerunning the 5 other tests one process each" in out, out
    assert "isolated reruns 4 passed, 1 not" in out, out
    assert "CRASHED (killed by signal 11): test_suite.py::test_b_segfaults" in out, out
    # A failure after the crash is reported as a failure, not hidden.
    proc = run(tmp_path, "-m", "gpu_like", fail="1")
    assert proc.returncode == 1
    assert "FAILED (exit status 1): test_suite.py::test_d_fails" in proc.stdout, proc.stdout
    assert "isolated reruns 3 passed, 2 not" in proc.stdout, proc.stdout


def test_without_a_crash_it_is_plain_pytest(tmp_path):
    proc = run(tmp_path, "-m", "gpu_like", f"--junitxml={tmp_path / 'junit.xml'}", crash="0")
    assert proc.returncode == 0, proc.stdout
    assert "pytest_isolated" not in proc.stdout
    assert "5 passed, 1 skipped" in proc.stdout, proc.stdout
    assert (tmp_path / "junit.xml").exists()  # unknown options reach the first run
    proc = run(tmp_path, "-m", "gpu_like", crash="0", fail="1")
    assert proc.returncode == 1 and "1 failed, 4 passed, 1 skipped" in proc.stdout, proc.stdout
    # The mark expression selects, as in pytest.
    proc = run(tmp_path, "-m", "not gpu_like", crash="0")
    assert proc.returncode == 5, proc.stdout


def test_bad_timeout_is_named(tmp_path):
    proc = run(tmp_path, "--per-test-timeout", "0", crash="0")
    assert proc.returncode == 2
    assert "--per-test-timeout must be > 0, got 0.0" in proc.stdout
