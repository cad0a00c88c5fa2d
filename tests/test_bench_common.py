"""The benchmark result format (docs/architecture.md, "Benchmarks"): figures with direction and spread,
and results that say which commit, tree state, date and machine load they come from."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks.common import figure, git_state, spread_of, summarize, write_result


def test_summarize_uses_iqr_from_five_repeats_and_min_max_below():
    five = summarize([5.0, 1.0, 4.0, 2.0, 3.0], "ms", "lower")
    assert five == {"value": 3.0, "unit": "ms", "better": "lower", "spread": [2.0, 4.0], "spread_is": "iqr"}
    three = summarize([1.3, 1.1, 1.2], "ratio", "higher")
    assert three["value"] == 1.2 and three["spread"] == [1.1, 1.3] and three["spread_is"] == "min-max"
    assert spread_of([2.0]) == ([2.0, 2.0], "min-max")


@pytest.mark.parametrize("kwargs, words", [
    ({"better": 2}, ["better=2", "'lower'", "'higher'"]),
    ({"better": "up"}, ["better='up'"]),
    ({"better": "lower", "spread": [1.0, 2.0]}, ["spread_is=None", "both or neither"]),
    ({"better": "lower", "spread": [2.0, 1.0], "spread_is": "iqr"}, ["lo <= hi"]),
    ({"better": "lower", "spread": [1.0, 2.0], "spread_is": "stdev"}, ["spread_is='stdev'", "iqr"]),
])
def test_figure_refuses_bad_fields_naming_them(kwargs, words):
    with pytest.raises(ValueError) as e:
        figure(1.0, "ms", **kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(ValueError, match="spread_of"):
        spread_of([])


def test_write_result_records_where_it_comes_from(tmp_path):
    path = write_result("x", {"a": summarize([1.0, 2.0, 3.0], "ms", "lower")}, {"repeats": 3},
                        results_dir=tmp_path)
    data = json.loads(path.read_text())
    assert set(data) == {"benchmark", "figures", "config", "machine", "commit", "dirty", "date"}
    assert data["figures"]["a"]["spread_is"] == "min-max" and data["config"] == {"repeats": 3}
    assert len(data["machine"]["load_avg_1m"]) == 2 and data["machine"]["cpus"] >= 1
    assert data["date"].endswith("+00:00")
    with pytest.raises(ValueError, match="lacks"):
        write_result("y", {"a": {"value": 1.0, "unit": "ms"}}, {}, results_dir=tmp_path)


def test_dirty_ignores_what_a_benchmark_run_writes(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("a = 1\n")
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("{}\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "reproduction.md").write_text("at 0000000\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    state = git_state(tmp_path)
    assert len(state["commit"]) == 40 and state["dirty"] is False
    (tmp_path / "benchmarks" / "results" / "r.json").write_text('{"new": 1}\n')
    (tmp_path / "docs" / "reproduction.md").write_text("at 1111111\n")  # paper_setups regenerates it
    assert git_state(tmp_path)["dirty"] is False
    assert git_state(tmp_path / "benchmarks" / "results")["dirty"] is False  # from a subdirectory too
    (tmp_path / "code.py").write_text("a = 2\n")
    assert git_state(tmp_path)["dirty"] is True
    assert git_state(tmp_path / "benchmarks" / "results")["dirty"] is True
