"""`fp8route bench figures`: prints the table, --check fails on a README that drifted, --write mends it."""

from pathlib import Path

from fp8route.bench import figures
from fp8route.cli import main

RESULTS = str(Path(__file__).resolve().parents[2] / "benchmarks" / "results")


def test_check_fails_on_a_drifted_readme_and_write_mends_it(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{figures.BEGIN}\n| stale |\n{figures.END}\nrest\n")
    args = ["bench", "figures", "--results", RESULTS, "--readme", str(readme)]
    assert main([*args, "--check"]) == 1
    assert "differs" in capsys.readouterr().out
    assert main([*args, "--write"]) == 0
    assert main([*args, "--check"]) == 0
    assert readme.read_text().endswith(f"{figures.END}\nrest\n") and "| stale |" not in readme.read_text()


def test_prints_the_table_and_names_a_missing_results_folder(tmp_path, capsys):
    assert main(["bench", "figures", "--results", RESULTS]) == 0
    assert capsys.readouterr().out.startswith("| figure (one H200")
    assert main(["bench", "figures", "--results", str(tmp_path / "none")]) == 2
    assert "run from the repository root" in capsys.readouterr().err
