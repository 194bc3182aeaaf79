"""The training progress bar counts against what ends the run: the time budget, or the step total
when it comes first; never a step total a time-bounded run will not reach."""

import re

import pytest

from redraft.train.logger import TrainBar, clock
from redraft.train.trainer import train


def test_clock_writes_minutes_and_seconds_as_tqdm_does():
    assert clock(0) == "0:00" and clock(59.6) == "1:00" and clock(480) == "8:00"
    assert clock(3725) == "1:02:05"


def test_a_budget_the_steps_cannot_reach_is_what_the_bar_counts_to():
    # an 8-minute budget and 20,220 steps at 8 steps/s (42 minutes): the budget ends the run
    bar = TrainBar(20_220, budget_s=480)
    bar.update(step=1_648, elapsed=206.0)
    assert bar.expected_end_s() == 480
    assert bar.bar.total == 480 and bar.bar.n == pytest.approx(206.0)
    text = bar.text()
    assert text.startswith("3:26 of 8:00 (budget), 4:34 left; step 1,648, 8.0 steps/s"), text
    assert "20,220" not in text


def test_a_step_total_reached_before_the_budget_ends_the_bar_there():
    # 1,000 steps at 10 steps/s: done after 100 s of an 8-minute budget
    bar = TrainBar(1_000, budget_s=480)
    bar.update(step=400, elapsed=40.0)
    assert bar.expected_end_s() == pytest.approx(100.0)
    assert bar.text().startswith("0:40 of 1:40 (1,000 steps), 1:00 left; step 400, 10.0 steps/s")


def test_a_resumed_run_measures_its_rate_from_where_it_resumed():
    # resumed at step 500 after 100 s; 300 more steps in the next 60 s: 5 steps/s, not 800/160
    bar = TrainBar(10_000, budget_s=300, step0=500, elapsed0=100.0)
    assert bar.bar.n == pytest.approx(100.0)
    bar.update(step=800, elapsed=160.0)
    assert "step 800, 5.0 steps/s" in bar.text()
    assert bar.expected_end_s() == 300


def test_logged_figures_follow_the_steps_and_the_closed_bar_says_what_it_took():
    bar = TrainBar(20_220, budget_s=480)
    bar.update(step=3_970, elapsed=480.4)
    bar.set_figures(loss="2.786", tok_s="6123")
    assert bar.text().endswith("step 3,970, 8.3 steps/s, loss 2.786, tok_s 6123")
    bar.close()
    assert bar.bar.n == bar.bar.total == pytest.approx(480.4)
    assert bar.text(final=True).startswith("8:00 (budget 8:00); step 3,970")


def test_without_a_budget_the_bar_counts_steps():
    bar = TrainBar(40, budget_s=None)
    bar.update(step=7, elapsed=3.0)
    assert bar.bar.total == 40 and bar.bar.n == 7


def test_a_time_bounded_run_shows_its_budget_not_its_step_total(
    tmp_path, tiny_target, tiny_data, capsys
):
    from redraft.train.config import make_config

    cfg = make_config(
        "tiny",
        {
            "output_dir": str(tmp_path / "run"),
            "report_to": "none",
            "max_steps": "987654",
            "max_time_minutes": "0.05",  # 3 s
            "log_every": "1",
        },
    )
    m = train(cfg, target=tiny_target, train_dataset=tiny_data[0], eval_dataset=tiny_data[1])
    assert m["status"] == "time_budget" and m["global_step"] < 987_654
    err = capsys.readouterr().err
    bar = [line for line in re.split(r"[\r\n]", err) if line.startswith("train:")]
    assert bar, err
    # the unreachable step total never shows (as 987654 or 987,654; other figures may hold "987")
    assert not any(re.search(r"987,?654", line) for line in bar), bar
    assert re.search(r"of 0:03 \(budget\), 0:0\d left; step [\d,]+", err), bar
    assert re.search(r"100%\|.*\| 0:0\d \(budget 0:03\); step [\d,]+", bar[-1]), bar[-1]
