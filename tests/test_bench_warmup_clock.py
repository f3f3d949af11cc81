"""The bench's warm-up calls are not timed on the virtual clock (lab/bench/measure.py): the first
call of a contender resolves its plans (the model times every variant of every head-parallel
degree, tens of seconds of host work on a loaded machine), which a begun virtual clock would
count as its host trailing the devices (the links refuse a lag over 30 s); the timed rounds
are."""

from types import SimpleNamespace

from charm_megatron.lab.bench import measure


def test_warm_up_rounds_run_on_the_wall_clock_and_timed_rounds_on_the_given_one(monkeypatch):
    seen = []

    def fake_run_once(c, mode, inputs, backward, device, clock=measure.WALL_CLOCK):
        seen.append(clock)
        return measure.Timing(0.0, 0.0, 0.0, 0.0)

    monkeypatch.setattr(measure, "_run_once", fake_run_once)
    monkeypatch.setattr(measure, "_inputs", lambda *a: (None,) * 4)
    cfg = SimpleNamespace(variants=lambda: [("ring", "full")], warmup=2, iters=3,
                          device=None, backward=True, memory=False)
    lineup = SimpleNamespace(contenders={"ring": object()}, skipped=[], notes={}, picks={})
    virtual = measure._CallClock(virtual=object())
    progress = SimpleNamespace(update=lambda *a: None)
    measure._measure_point(SimpleNamespace(cfg=cfg), SimpleNamespace(index=0, label="p"),
                           lineup, 0, 1, None, progress, virtual)
    assert seen == [measure.WALL_CLOCK] * 2 + [virtual] * 3
