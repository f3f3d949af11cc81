"""The pick file of a measured ``auto`` (CPOptions.auto_tune_file / CHARM_AUTO_TUNE_FILE,
ops/auto_tune.py; issue 42 item 6): another pick is other bits, so a run is reproduced bitwise
only with its picks. A run saves them, a later launch loads them and runs them unmeasured;
ranks that loaded different files are named, a broken file is a clear ValueError."""

import json

import auto_tune_cases as cases
import pytest
import torch

from charm_megatron.local_ranks import run_ranks
from charm_megatron.ops import auto_tune
from charm_megatron.ops.options import CPOptions
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.registry import settings_values


@pytest.fixture
def clean_picks():
    auto_tune.forget()
    yield
    auto_tune.forget()


def _key(short=("ring", "a2a")):
    return (("groups", ((0, 1),)), ("problem", Problem(2, 16, 4, 2, 16, 4)),
            ("profile digest", None), ("causal", True), ("softmax_scale", 0.25),
            ("window", None), ("softmax_offset", True), ("backend", "torch"),
            ("dtype", torch.float32), ("settings", settings_values()), ("shortlist", short))


def test_option_and_variable():
    assert CPOptions().auto_tune_file is None
    assert CPOptions.from_env({"CHARM_AUTO_TUNE_FILE": "/tmp/p.json"}).auto_tune_file == \
        "/tmp/p.json"
    from pathlib import Path

    assert CPOptions(auto_tune_file=Path("/tmp/p.json")).auto_tune_file == "/tmp/p.json"
    with pytest.raises(ValueError, match="CHARM_AUTO_TUNE_FILE"):
        CPOptions(auto_tune_file=3)


def test_key_text_is_stable_and_readable():
    text = auto_tune.key_text(_key())
    assert text == auto_tune.key_text(_key())  # equal keys, equal text (no addresses)
    assert "0x" not in text and "<" not in text
    assert "problem=Problem(b=2, s=16, hq=4, hkv=2, d=16, elem=4" in text
    assert "dtype=float32" in text and "shortlist=(ring, a2a)" in text
    assert "roles: bytes" in text


def test_save_then_load_restores_the_picks_and_their_digest(tmp_path, clean_picks):
    auto_tune.record(_key(), "a2a")
    auto_tune.record(_key(("ring", "allgather")), "ring")
    digest = auto_tune.picks_digest()
    path = tmp_path / "sub" / "picks.json"
    assert auto_tune.save_picks(path) == 2
    doc = json.loads(path.read_text())
    assert doc["version"] == auto_tune.FILE_VERSION
    assert [p["algo"] for p in doc["picks"]] == ["a2a", "ring"]  # sorted by key text
    assert list(tmp_path.joinpath("sub").iterdir()) == [path]  # no temporary file left
    auto_tune.forget()
    assert auto_tune.lookup(_key()) is None and auto_tune.picks_digest() is None
    assert auto_tune.load_picks(path) == 2
    assert auto_tune.lookup(_key()) == "a2a" and auto_tune.picks_digest() == digest


@pytest.mark.parametrize("text, why", [
    ("{not json", "cannot be read"),
    ('{"picks": []}', "is not a pick file"),
    ('{"format": "charm-megatron auto-tune picks", "version": 99, "picks": []}',
     "format version 99"),
    ('{"format": "charm-megatron auto-tune picks", "version": 1, "picks": [{"key": 1}]}',
     "no list of"),
    ('{"format": "charm-megatron auto-tune picks", "version": 1, '
     '"picks": [{"key": "k", "algo": "spiral"}]}', "unregistered algorithm"),
])
def test_a_bad_file_is_a_value_error_naming_it_and_the_fix(tmp_path, clean_picks, text, why):
    path = tmp_path / "picks.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=why) as info:
        auto_tune.load_picks(path)
    assert str(path) in str(info.value) and "delete it" in str(info.value)
    assert auto_tune.picks_digest() is None  # nothing half-loaded
    with pytest.raises(ValueError, match="does not exist"):
        auto_tune.load_picks(tmp_path / "missing.json")


def test_a_saved_run_replays_bitwise_without_measuring(tmp_path):
    path = str(tmp_path / "picks.json")
    # Launch 1 measures (fake times favour a2a, the model's last) and writes the file.
    first = run_ranks(cases.picks_run, 2, path, "a2a", timeout_s=60)
    for r in first:
        assert sorted(r["measured"]) == sorted(cases.FILE_ALGOS), r
        assert list(r["held"].values()) == [r["report_pick"]] == ["a2a"], r
    doc = json.loads(open(path).read())
    assert {p["key"]: p["algo"] for p in doc["picks"]} == first[0]["held"]

    # Launch 2, new processes, the times no longer favouring a2a: without the file it would
    # measure and pick the model's first; with it, it runs a2a unmeasured, bit for bit.
    again = run_ranks(cases.picks_run, 2, path, None, timeout_s=60)
    for r1, r2 in zip(first, again):
        assert r2["measured"] == [] and r2["report_pick"] is None, r2
        assert r2["held"] == r1["held"] and r2["digest"] == r1["digest"]
        for a, b in zip(r1["bits"], r2["bits"]):  # out, dq, dk, dv, this rank's d sink
            assert torch.equal(a, b)
        # What the file buys: every other pick gives other bits somewhere.
        for algo, bits in r2["others"].items():
            assert not all(torch.equal(a, b) for a, b in zip(r2["bits"], bits)), algo
    assert json.loads(open(path).read()) == doc  # nothing measured, nothing rewritten


def test_ranks_with_different_or_broken_files_raise_on_every_rank(tmp_path):
    good = tmp_path / "good.json"
    run_ranks(cases.picks_run, 2, str(good), None, timeout_s=60)  # measures, writes
    doc = json.loads(good.read_text())
    other_doc = json.loads(good.read_text())
    ran = doc["picks"][0]["algo"]
    other_doc["picks"][0]["algo"] = next(a for a in cases.FILE_ALGOS if a != ran)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(other_doc))
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"format": "charm-megatron auto-tune picks", "version": 0}')
    res = run_ranks(cases.files_disagree, 2, str(corrupt), str(good), str(other),
                    str(tmp_path / "missing.json"), timeout_s=60)
    for outcomes, measured in res:
        broken, missing, different = outcomes
        assert broken.startswith("ValueError") and str(corrupt) in broken, broken
        assert "format version 0" in broken
        for o in (missing, different):
            assert o.startswith("CPMismatchError") and "auto-tune picks held" in o, o
        assert measured == []
    assert not (tmp_path / "missing.json").exists()


def test_the_option_reads_a_file_once_and_a_failed_write_only_warns(tmp_path, clean_picks):
    path = tmp_path / "picks.json"
    auto_tune.use_file(str(path))  # none yet: this run's measurements write it
    assert auto_tune.picks() == {}
    auto_tune.record(_key(), "a2a")
    auto_tune.save_picks(path)
    auto_tune.forget()
    auto_tune.use_file(str(path))
    assert list(auto_tune.picks().values()) == ["a2a"]
    path.write_text("{broken")
    auto_tune.use_file(str(path))  # read at its first use only
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    with pytest.warns(RuntimeWarning, match="could not write the pick file"):
        auto_tune.write_file(str(blocked / "picks.json"))
    assert list(auto_tune.picks().values()) == ["a2a"]
