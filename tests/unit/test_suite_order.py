"""The order `make test` hands files to its workers (tests/conftest.py): the longest first, one per worker;
then files that skip at once, to wait in each worker's second slot; then the rest, longest first."""

from types import SimpleNamespace

import conftest


def test_long_files_start_first_and_no_long_file_waits_behind_another():
    longest = conftest.LONGEST_FIRST
    files = ["tests/unit/test_b.py", *reversed(longest[:6]), "tests/gpu/test_x.py", "tests/gpu/test_y.py"]
    items = [SimpleNamespace(nodeid=f"{f}::test_{i}") for f in files for i in range(2)]
    place = conftest.file_order(items, {"tests/gpu/test_x.py", "tests/gpu/test_y.py"}, workers=2)
    order = sorted(place, key=place.get)
    assert order[:2] == longest[:2]  # each worker's first file
    # behind them: files that end at once
    assert order[2:4] == ["tests/gpu/test_x.py", "tests/gpu/test_y.py"]
    assert order[4:8] == longest[2:6] and order[-1] == "tests/unit/test_b.py"
    # one worker, no xdist: nothing is queued behind anything, the longest file still first
    alone = conftest.file_order(items, set(), workers=1)
    assert min(alone, key=alone.get) == longest[0]
