"""The progress bar's ETA: no guess until warm-up and timed requests have each been measured, then each kind's units
left at its own rate, so the slow first warm-up (JIT compilation, store writes) does not inflate the first ETA."""

import io
import pathlib

from specjax.eval import registry, runner, systems, tasks, workload
from specjax.eval.progress import Progress

from eval_fakes import FakeModel, PlainRecompute


def _bar(now, **kw):
    return Progress(kw.pop("total", 100), stream=io.StringIO(), clock=lambda: now[0], **kw)


def test_no_eta_until_a_timed_unit_is_measured_after_the_warm_up():
    now = [0.0]
    # 2 runs of 10 warm-up units (compiling: 6 s each) and 40 timed requests (0.1 s each): 2 * (60 + 4) = 128 s
    bar = _bar(now, warmup_total=20)
    assert bar.eta_s() is None and "eta --:--" in bar.line()
    bar.set_label("spec r=0.25 (warm)", warmup=True)
    for _ in range(10):
        now[0] += 6.0
        bar.update()
    assert bar.eta_s() is None and "eta --:--" in bar.line()  # timed requests' rate not known yet
    bar.set_label("spec r=0.25")
    now[0] += 0.1
    bar.update()
    # 10 warm-up units at 6 s and 79 timed at 0.1 s: the real 67.9 s left, not 89 units at (60.1 s / 11)
    assert abs(bar.eta_s() - (10 * 6.0 + 79 * 0.1)) < 1e-6
    assert "eta 01:07" in bar.line()
    for _ in range(39):
        now[0] += 0.1
        bar.update()
    bar.set_label("spec r=0.75 (warm)", warmup=True)  # the second run's warm-up: booked at the warm-up rate
    now[0] += 3.0
    bar.update(10)
    assert abs(bar.eta_s() - 40 * 0.1) < 1e-6


def test_resumed_units_are_left_out_of_both_rates():
    now = [0.0]
    bar = _bar(now, warmup_total=20)
    bar.skip(50, warmup=10)  # an earlier process's first run
    now[0] += 100.0  # loading the saved run is not a unit's time
    bar.set_label("b (warm)", warmup=True)
    bar.update(10)
    bar.set_label("b")
    now[0] += 1.0
    bar.update()
    assert abs(bar.eta_s() - 39 * 1.0) < 1e-6  # 39 timed requests left at 1 s; no warm-up left


def test_runner_marks_warm_up_units_and_the_eval_counts_them(monkeypatch):
    monkeypatch.setattr(registry, "factories", lambda: {})  # FakeModel: eval's model-API recompute
    monkeypatch.setitem(registry.PLUGINS, "recompute", PlainRecompute)
    model = FakeModel()
    wl = workload.build_workload(tasks.load_task("needle"), model.tokenizer, workload.WorkloadSpec(limit=12))
    plan = runner.plan(["recompute"], [0.25])
    kinds = []

    class Recording(Progress):
        def update(self, n=1):
            kinds.append((self.kind, n))
            super().update(n)

    bar = Recording(runner.total_steps(wl, plan), enabled=False, warmup_total=runner.warmup_steps(wl, plan))
    runner.run_all(model, wl, plan, systems.SystemSettings(), pathlib.Path("/nonexistent-store"), bar)
    warm = sum(n for kind, n in kinds if kind == "warm-up")
    assert warm == runner.warmup_steps(wl, plan) > 0
    assert sum(n for kind, n in kinds if kind == "timed") == len(wl.requests)
    order = [kind for kind, _ in kinds]
    assert order == ["warm-up"] * order.count("warm-up") + ["timed"] * len(wl.requests)
    assert bar.eta_s() == 0.0
