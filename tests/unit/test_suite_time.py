"""benchmarks/suite_time.py: the row it appends to benchmarks/results/suite_times.csv per timed suite."""

from __future__ import annotations

import csv
import subprocess

import pytest

from helpers.scripts import load_script

suite_time = load_script("benchmarks/suite_time.py")


def test_counts_read_pytests_last_summary_line():
    out = "....\n12.3s call tests/x.py::t\n"
    out += "= 3 failed, 598 passed, 40 skipped, 1 error in 1432.10s (0:23:52) =\n"
    assert suite_time.counts(out) == {"passed": 598, "failed": 4, "skipped": 40}
    assert suite_time.counts("600 passed in 3.0s") == {"passed": 600, "failed": 0, "skipped": 0}


def test_a_row_from_a_log_is_appended_with_a_header_once(tmp_path, monkeypatch):
    monkeypatch.setattr(suite_time, "CSV", tmp_path / "suite_times.csv")
    log = tmp_path / "tests.log"
    log.write_text("600 passed, 41 skipped in 1453.00s\n")
    for seconds in ("1453", "700"):
        monkeypatch.setattr(
            "sys.argv", ["suite_time.py", "--from-log", str(log), "--seconds", seconds, "--commit", "c"]
        )
        assert suite_time.main() == 0
    rows = list(csv.DictReader((tmp_path / "suite_times.csv").open()))
    assert [(r["commit"], r["seconds"], r["passed"], r["skipped"]) for r in rows] == [
        ("c", "1453", "600", "41"),
        ("c", "700", "600", "41"),
    ]
    assert list(rows[0]) == suite_time.FIELDS
    assert b"\r" not in (tmp_path / "suite_times.csv").read_bytes()  # the committed file's LF line ends


def test_the_committed_rows_parse_into_the_fields():
    """Each row of benchmarks/results/suite_times.csv has the eight fields (a note with commas: quoted)."""
    with suite_time.CSV.open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == suite_time.FIELDS and all(len(r) == len(suite_time.FIELDS) for r in rows), [
        r[0] for r in rows if len(r) != len(suite_time.FIELDS)
    ]
    assert b"\r" not in suite_time.CSV.read_bytes()


def test_the_gauge_times_fresh_interpreters_and_the_loop():
    """A statement that fails raises (a light one here: the gauge's own, torch's import, costs seconds); the
    loop's time grows with its size."""
    small, large = suite_time.gauge(1, 10_000, "import json"), suite_time.gauge(1, 200_000, "import json")
    assert small["import_s"] > 0 and large["sha256_s"] > small["sha256_s"] > 0
    with pytest.raises(subprocess.CalledProcessError):
        suite_time.gauge(1, 1, "import no_such_module_here")
