"""`loom bench`: lists the repository's benchmarks, refuses unknown names with the list, and
says so when run outside a checkout (nothing here runs a benchmark)."""

from pathlib import Path

from loom.cli import main
from loom.cli.bench import benchmark_names, find_checkout

ROOT = Path(__file__).resolve().parent.parent


def test_lists_the_benchmarks_not_their_helpers(monkeypatch, capsys):
    names = benchmark_names(ROOT)
    assert "balance_speed" in names and "common" not in names and "__init__" not in names
    monkeypatch.chdir(ROOT / "benchmarks")  # found from a subdirectory too
    assert main(["bench"]) == 0 and main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(out.count(f"  {n}\n") == 2 for n in names)


def test_unknown_names_and_no_checkout_are_refused(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(ROOT)
    assert main(["bench", "balance_speed", "nope"]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "balance_speed" in err and len(err.strip().splitlines()) == 1
    monkeypatch.chdir(tmp_path)
    assert find_checkout(tmp_path) is None
    assert main(["bench", "--list"]) == 2
    assert "no loom checkout" in capsys.readouterr().err
