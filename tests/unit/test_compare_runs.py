"""scripts/compare_runs.py's record comparison: bit-identical by default, relative tolerance on request."""

from script_loader import load_script  # tests/ helper

compare_runs = load_script("scripts/compare_runs.py")


def test_exact_by_default_and_wall_clock_keys_ignored():
    base = [{"step": 1, "policy/p/loss": 0.5, "timing/step_s": 1.0}]
    head = [{"step": 1, "policy/p/loss": 0.5, "timing/step_s": 9.0}]
    assert compare_runs.compare(base, head) == ([], 2)
    diffs, _ = compare_runs.compare(base, [{"step": 1, "policy/p/loss": 0.5 + 1e-12}])
    assert diffs == ["record 0 (step 1): policy/p/loss base=0.5 head=0.500000000001"]


def test_rtol_accepts_rounding_and_one_sided_keys_but_not_larger_changes():
    base = [{"step": 1, "policy/p/loss": 0.5, "reward": 3}]
    head = [{"step": 1, "policy/p/loss": 0.5000004, "reward": 3, "policy/p/optimizer_steps": 2}]
    assert compare_runs.compare(base, head)[0]  # exact: two differences
    assert compare_runs.compare(base, head, rtol=1e-6) == ([], 3)
    diffs, _ = compare_runs.compare(base, [{"step": 1, "policy/p/loss": 0.51, "reward": 3}], rtol=1e-6)
    assert len(diffs) == 1 and "policy/p/loss" in diffs[0]


def test_metrics_compares_two_finished_runs_with_ignored_keys(tmp_path, capsys):
    base, head = tmp_path / "base.jsonl", tmp_path / "head.jsonl"
    base.write_text('{"step": 1, "policy/p/loss": 0.5, "engine/url_count": 2}\n')
    head.write_text('{"step": 1, "policy/p/loss": 0.5, "engine/url_count": 3}\n')
    assert compare_runs.main(["--metrics", str(base), str(head)]) == 1
    assert "engine/url_count base=2 head=3" in capsys.readouterr().out
    assert compare_runs.main(["--metrics", str(base), str(head), "--ignore", "^engine/"]) == 0
    assert "IDENTICAL" in capsys.readouterr().out
