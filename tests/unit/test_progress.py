"""The run's progress: one plain line per phase without a terminal; a live rich display on one."""

import io
import threading

from megamarl.runtime.progress import RunProgress, format_duration


def test_plain_mode_prints_one_line_per_phase_with_counts_tokens_and_eta():
    out = io.StringIO()
    progress = RunProgress(total_steps=20, stream=out)  # StringIO is not a TTY: plain lines
    assert not progress.live
    progress.start_at(2)
    progress.step_done(3, 12.0)
    with progress.phase("rollout", total=64) as phase:
        threads = [
            threading.Thread(target=lambda: [phase.advance(tokens=10) for _ in range(16)]) for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    with progress.phase("model preparation", total=1, unit="policies", in_step=False) as phase:
        phase.advance()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[megamarl] step 4/20 rollout: 64/64 episodes, 640 tokens in ")
    assert "tokens/s)" in lines[0] and lines[0].endswith("| ETA 3m24s")  # 17 steps left x 12 s
    assert lines[1].startswith("[megamarl] model preparation: 1/1 policies in ")


def test_progress_off_keeps_messages_but_drops_phase_lines():
    out = io.StringIO()
    progress = RunProgress(total_steps=5, enabled=False, stream=out)
    with progress.phase("rollout", total=4):
        pass
    progress.line("eval step 0: team_accuracy=0.500")
    assert out.getvalue() == "[megamarl] eval step 0: team_accuracy=0.500\n"


def test_live_mode_draws_steps_eta_and_the_phase_bar():
    out = io.StringIO()
    progress = RunProgress(total_steps=10, stream=out, live=True)
    progress.start_at(0)
    progress.step_done(1, 30.0)
    with progress.phase("rollout", total=8) as phase:
        for _ in range(8):
            phase.advance(tokens=5)
        progress._bars.refresh()
        drawn = out.getvalue()
    progress.close()
    assert "steps" in drawn and "1/10" in drawn and "ETA 4m30s" in drawn
    assert "step 2/10 rollout" in drawn and "8/8" in drawn and "tok/s" in drawn


def test_format_duration():
    assert [format_duration(s) for s in (5, 65, 3725)] == ["5s", "1m05s", "1h02m"]


def test_the_eta_prices_the_evaluations_still_due():
    """A step's clock stops before its evaluation, so the ETA adds each evaluation still due at the last
    one's duration: README command 1 evaluates only after its last step, which the ETA left out."""
    from megamarl.config import EvalConfig
    from megamarl.driver.evaluator import eval_steps

    steps = eval_steps(EvalConfig(every=2, num_tasks=8), total_steps=4)
    assert steps == {2, 4} and eval_steps(EvalConfig(every=0, num_tasks=8), total_steps=4) == {4}
    assert eval_steps(EvalConfig(every=2, num_tasks=0), total_steps=4) == frozenset()
    progress = RunProgress(total_steps=4, enabled=False, eval_steps=steps)
    progress.evaluated(0, 20.0)  # the start-up evaluation: 20 s
    progress.step_done(1, 10.0)
    assert progress.eta_seconds() == 3 * 10.0 + 2 * 20.0  # steps 2-4, evaluations at 2 and 4
    progress.step_done(2, 10.0)
    assert progress.eta_seconds() == 2 * 10.0 + 2 * 20.0  # step 2's evaluation has not run yet
    progress.evaluated(2, 30.0)
    assert progress.eta_seconds() == 2 * 10.0 + 1 * 30.0
    progress.step_done(4, 10.0)
    assert progress.eta_seconds() == 30.0  # only the final evaluation is left
    progress.evaluated(4, 30.0)
    assert progress.eta_seconds() == 0.0


def test_an_evaluations_line_carries_no_eta():
    """Its line is printed as it ends, before its duration reaches the ETA: it would count itself."""
    out = io.StringIO()
    progress = RunProgress(total_steps=1, stream=out, eval_steps={1})
    progress.evaluated(0, 20.0)
    progress.step_done(1, 10.0)
    with progress.phase("eval at step 1", total=1, in_step=False) as phase:
        phase.advance()
    assert "ETA" not in out.getvalue() and out.getvalue().startswith(
        "[megamarl] eval at step 1: 1/1 episodes"
    )
