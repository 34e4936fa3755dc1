"""scripts/flake_hunt.py at its smallest size: two runs of a tiny test file under a load of one
busy process.  The counts it writes must be the tests' real outcomes (a test that always
fails counted as failing in both runs, with its message; one that fails only in the first run
counted once), and the load must be gone when it returns."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TINY = '''
import os, pytest
from pathlib import Path

def test_passes():
    assert 1 + 1 == 2

def test_fails():
    assert "expected" == "planted failure"

def test_fails_in_the_first_run_only():
    marker = Path(os.environ["FLAKE_MARKER"])
    first = not marker.exists()
    marker.touch()
    assert not first, "flaky on purpose"

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass
'''


def test_flake_hunt_counts_each_test_and_stops_its_load(tmp_path):
    (tmp_path / "test_tiny.py").write_text(TINY)
    out = tmp_path / "result" / "flakes"
    r = subprocess.run([sys.executable, "-m", "scripts.flake_hunt", str(tmp_path / "test_tiny.py"),
                        "-n", "2", "--load", "1", "--out", str(out), "--note", "a test run"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "FLAKE_MARKER": str(tmp_path / "marker")})
    assert r.returncode == 1, r.stdout + r.stderr         # failures found: non-zero
    res = json.loads(Path(f"{out}.json").read_text())
    tests = {k.rsplit("::", 1)[1]: v for k, v in res["tests"].items()}
    assert set(tests) == {"test_passes", "test_fails", "test_fails_in_the_first_run_only",
                          "test_skipped"}, tests
    assert (tests["test_passes"]["passed"], tests["test_passes"]["failed"]) == (2, 0)
    assert (tests["test_fails"]["passed"], tests["test_fails"]["failed"]) == (0, 2)
    assert "planted failure" in tests["test_fails"]["first_failure"]["message"]
    flaky = tests["test_fails_in_the_first_run_only"]
    assert (flaky["passed"], flaky["failed"], flaky["first_failure"]["run"]) == (1, 1, 1)
    assert "flaky on purpose" in flaky["first_failure"]["message"]
    assert tests["test_skipped"]["skipped"] == 2 and tests["test_skipped"]["failed"] == 0
    assert len(res["runs"]) == 2 and res["cores"] == os.cpu_count() and res["cpu"]
    assert res["commit"] and res["notes"] == ["a test run"]
    assert len(res["load_pids"]) == 1
    for pid in res["load_pids"]:          # the load ended with the script
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        assert state == "Z", f"load process {pid} still running ({state})"
    md = Path(f"{out}.md").read_text()
    assert "| 2 | 0 | 2 | 0 |" in md and "planted failure" in md and "a test run" in md


SLOW_SECOND = '''
import os, time
from pathlib import Path

def test_slow_from_the_second_run():
    marker = Path(os.environ["FLAKE_MARKER"])
    if marker.exists():
        Path(os.environ["FLAKE_STARTED"]).touch()
        time.sleep(120)
    marker.touch()
'''


def test_a_stopped_hunt_keeps_the_runs_it_finished(tmp_path):
    """SIGTERM during the second of three runs: the first run's counts are in the result
    files, which say the hunt stopped, and the load is gone."""
    (tmp_path / "test_slow.py").write_text(SLOW_SECOND)
    out, started = tmp_path / "flakes", tmp_path / "started"
    p = subprocess.Popen([sys.executable, "-m", "scripts.flake_hunt",
                          str(tmp_path / "test_slow.py"), "-n", "3", "--load", "1",
                          "--out", str(out)], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "FLAKE_MARKER": str(tmp_path / "marker"),
                              "FLAKE_STARTED": str(started)})
    try:
        deadline = time.monotonic() + 240
        while not started.exists():
            assert p.poll() is None and time.monotonic() < deadline, p.stdout.read()
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    res = json.loads(Path(f"{out}.json").read_text())
    assert res["stopped"] and res["planned"] == 3 and len(res["runs"]) == 1
    (test,) = res["tests"].values()
    assert (test["runs"], test["passed"]) == (1, 1)
    assert "stopped: 3 were planned" in Path(f"{out}.md").read_text()
    for pid in res["load_pids"]:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        assert Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", pid
