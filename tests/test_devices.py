"""The device extension point (charm_megatron/devices, docs/model.md "Adding a device"): a
device is one profile file, and one line (``CHARM_DEVICES``) makes the model command, the
emulated bench and ``auto`` accept its name."""

from __future__ import annotations

import csv
import os
from dataclasses import replace

import pytest

from charm_megatron.cli import main as cli_main
from charm_megatron.devices import (
    DATA_DIR,
    DEVICES_ENV,
    PROFILES,
    builtin_profiles,
    get_profile,
    profile_files,
    save_profile,
)
from charm_megatron.model import auto_cluster


def _toy(directory, name: str = "toy-gpu"):
    """A toy GPU: h100's profile renamed, with half its attention rate and a quarter of its
    cross rate (the ring then waits on the link: a run on h100's rates would be 2x faster)."""
    h100 = get_profile("h100")
    cluster = h100.cluster.with_(tflops=h100.cluster.tflops / 2,
                                 cross_gbps=h100.cluster.cross_gbps / 4)
    prof = replace(h100, name=name, cluster=cluster, topology="2x2",
                   source="a toy device for the tests", fit={})
    path = directory / f"{name}.json"
    save_profile(prof, path)
    return prof, path


def test_the_built_in_devices_are_one_file_each():
    assert list(PROFILES)[:4] == ["l20-pcie", "h20", "h100", "cpu-testbed"]
    assert set(PROFILES) == {p.stem for p in DATA_DIR.glob("*.json")}
    assert PROFILES["h100"].origin is None and dict(PROFILES) == builtin_profiles()


def test_a_toy_device_is_one_file_plus_one_line_for_the_model(tmp_path, monkeypatch, capsys):
    toy, path = _toy(tmp_path)
    monkeypatch.setenv(DEVICES_ENV, str(tmp_path))  # the one line
    assert get_profile("toy-gpu").cluster == toy.cluster
    assert list(PROFILES)[-1] == "toy-gpu" and profile_files()["toy-gpu"] == path
    assert get_profile("toy-gpu").origin == str(path)
    assert auto_cluster("toy-gpu") == toy.cluster  # CHARM_MODEL_PROFILE=toy-gpu for auto

    assert cli_main(["model", "--profile", "toy-gpu", "--seq", "16384", "--heads", "8"]) == 0
    out = capsys.readouterr().out
    assert "# cluster: profile toy-gpu; topology 2x2 (4 ranks, 2 groups" in out
    assert toy.cluster.describe() in out
    assert any(line.startswith("ring ") for line in out.splitlines())
    assert any(line.startswith("charm ") for line in out.splitlines())

    assert cli_main(["model", "--list-profiles"]) == 0
    listed = capsys.readouterr().out
    assert "toy-gpu" in listed and "a toy device for the tests" in listed and "h100" in listed

    monkeypatch.delenv(DEVICES_ENV)
    assert "toy-gpu" not in PROFILES  # read at each lookup
    with pytest.raises(ValueError, match="unknown profile 'toy-gpu'"):
        get_profile("toy-gpu")


def test_a_toy_device_runs_on_the_emulated_gpu_cluster(tmp_path, monkeypatch):
    """``bench --device-model toy-gpu --emulate 2x1``: the ranks (which re-import the package)
    find the toy device through CHARM_DEVICES and time the ring on its rates: the device time is
    the toy's prediction, not h100's. At S=32k (about 15 s of wall at dilation 50; S=64k took 45 s)
    h100's model times the ring 2.4-3.2x faster than the toy's, so the 20 % check tells them
    apart."""
    devices = tmp_path / "devices"
    devices.mkdir()
    _toy(devices)
    monkeypatch.setenv(DEVICES_ENV, str(devices))
    out = tmp_path / "run"
    assert cli_main(["bench", "--emulate", "2x1", "--device-model", "toy-gpu", "--batch", "1",
                     "--seq", "32768", "--heads", "16x128", "--algos", "ring", "--dtype", "bf16",
                     "--warmup", "1", "--iters", "2", "--timeout-s", "240",
                     "--comm-timeout-s", "120", "--out", str(out), "--no-plot",
                     "--quiet"]) == 0
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert {r["pass"] for r in rows} >= {"fwd", "bwd"}
    for r in rows:
        assert r["device_model"] == "toy-gpu" and r["status"] == "ok", r
        assert float(r["median_ms"]) > 0 and float(r["model_ms"]) > 0
        # Within 20 % of the toy's own model (h100's rates: 2.4-3.2x faster).
        assert abs(float(r["vs_model"]) - 1) < 0.2, (r["pass"], r["vs_model"])


def test_a_device_may_not_reuse_a_known_name(tmp_path, monkeypatch):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c):
        d.mkdir()
    _, path = _toy(c, name="h100")
    _, first = _toy(a)
    _, second = _toy(b)
    monkeypatch.setenv(DEVICES_ENV, str(c))
    with pytest.raises(ValueError, match="'h100' is defined twice") as exc:
        get_profile("h20")
    assert str(DATA_DIR / "h100.json") in str(exc.value) and str(path) in str(exc.value)
    with pytest.raises(SystemExit, match="defined twice"):
        cli_main(["model", "--list-profiles"])

    monkeypatch.setenv(DEVICES_ENV, os.pathsep.join([str(a), "", str(b)]))
    with pytest.raises(ValueError, match="'toy-gpu' is defined twice") as exc:
        get_profile("toy-gpu")
    assert str(first) in str(exc.value) and str(second) in str(exc.value)


def test_an_unknown_name_lists_the_known_ones(tmp_path, monkeypatch):
    _toy(tmp_path)
    monkeypatch.setenv(DEVICES_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="unknown profile 'nope'") as exc:
        get_profile("nope")
    for name in ("l20-pcie", "h20", "h100", "cpu-testbed", "h200", "toy-gpu"):
        assert name in str(exc.value)
    assert DEVICES_ENV in str(exc.value)
    with pytest.raises(SystemExit, match="unknown profile 'nope'"):
        cli_main(["model", "--profile", "nope", "--seq", "8192"])


def test_a_missing_device_directory_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(DEVICES_ENV, str(tmp_path / "gone"))
    with pytest.raises(ValueError, match=f"{DEVICES_ENV}: .*gone.* is not a directory"):
        get_profile("h100")
    (tmp_path / "bad.json").write_text("[1, 2]")
    monkeypatch.setenv(DEVICES_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="bad.json: not a charm-megatron profile"):
        get_profile("h100")


# The GPU each shipped GPU profile describes (a profile added to devices/data must be named here
# or in CPU_PROFILES, so its merge rate is checked against its memory).
PROFILE_GPU = {"h100": "H100", "h100-paper": "H100", "h100-paper-measured": "H100",
               "h100-paper-appendix": "H100",
               "h200": "H200", "h20": "H20", "h20-table4": "H20", "l20-pcie": "L20"}
CPU_PROFILES = {"cpu-testbed"}


def test_every_shipped_gpu_profile_merges_within_its_memory_bandwidth():
    """A merge reads an fp32 accumulator and a 16-bit partial and writes the accumulator: no
    profile may merge faster than its GPU's memory bandwidth allows (paper.merge_bound_gbps;
    the h100 profile once assumed 800 GB/s, above an H100's 670)."""
    from charm_megatron.lab.calibration.paper import merge_bound_gbps

    assert set(builtin_profiles()) == set(PROFILE_GPU) | CPU_PROFILES
    assert merge_bound_gbps("H100") == pytest.approx(670.0)
    for name, gpu in PROFILE_GPU.items():
        merge = get_profile(name).cluster.merge_gbps
        assert merge is not None and merge <= merge_bound_gbps(gpu), (name, merge)
