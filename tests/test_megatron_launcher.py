"""The launcher ``python -m charm_megatron.pretrain_gpt``: its pieces, and a run against a
stand-in Megatron-LM tree.

Megatron-LM (``megatron.training``, ``pretrain_gpt.py``) is not pip-installable, and tests must
not need the network, so ``_fake_megatron_lm`` writes a minimal tree with the same shape as
core_v0.16.1's: ``pretrain_gpt.py`` calls ``pretrain(..., partial(model_provider, gpt_builder),
..., extra_args_provider=...)``, ``model_provider.py`` calls the builder, and
``gpt_builders.gpt_builder`` builds a real megatron-core ``GPTModel`` from a spec (CP=1, one
gloo rank). The launcher runs that tree exactly as it would run Megatron-LM's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.attention import SelfAttention  # noqa: E402

from charm_megatron import pretrain_gpt as launcher  # noqa: E402
from charm_megatron.megatron import (  # noqa: E402
    CharmDotProductAttention,
    PerLayerCoreAttention,
)

REPO = Path(__file__).resolve().parents[1]

_FAKE_TRAINING = '''
"""Stand-in for Megatron-LM's megatron.training (test double): parse, init, build, report."""
import argparse, json, os

_ARGS = None


def get_args():
    return _ARGS


def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={},
             get_embedding_ranks=None, get_position_embedding_ranks=None,
             non_loss_data_func=None, store=None, inprocess_call_wrapper=None):
    global _ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"],
                        help="p2p, a2a, allgather or a2a+p2p")
    parser.add_argument("--num-layers", type=int, default=2)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    _ARGS = parser.parse_args()
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model = model_provider(pre_process=True, post_process=True)
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    help_text = next(a.help for a in parser._actions if "--cp-comm-type" in a.option_strings)
    report = {
        "cp_comm_type": _ARGS.cp_comm_type,
        "charm_topology": getattr(_ARGS, "charm_topology", "<unregistered>"),
        "their_flag": getattr(_ARGS, "their_flag", "<unregistered>"),
        "module_topology": [getattr(c, "topology_spec", None) for c in cores],
        "core_attention": [type(c).__name__ for c in cores],
        "algo": [getattr(c, "algo", None) for c in cores],
        "config_cp_comm_type": model.config.cp_comm_type,
        "config_type": type(model.config.cp_comm_type).__name__,
        "help": help_text,
    }
    with open(os.environ["FAKE_REPORT"], "w") as f:
        json.dump(report, f)
'''

_FAKE_PRETRAIN_GPT = '''
"""Stand-in for Megatron-LM's pretrain_gpt.py (same calls as core_v0.16.1's __main__)."""
from functools import partial

from gpt_builders import gpt_builder
from megatron.training import pretrain
from model_provider import model_provider


def add_their_args(parser):
    parser.add_argument("--their-flag", default="default")
    return parser


if __name__ == "__main__":
    pretrain(None, partial(model_provider, gpt_builder), "encoder_or_decoder", None,
             args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
             extra_args_provider=add_their_args, store=None)
'''

_FAKE_MODEL_PROVIDER = '''
from megatron.training import get_args


def model_provider(model_builder, pre_process=True, post_process=True, vp_stage=None,
                   config=None, pg_collection=None):
    return model_builder(get_args(), pre_process, post_process, vp_stage, config=config,
                         pg_collection=pg_collection)
'''

_FAKE_GPT_BUILDERS = '''
import os

import megatron.core.models.gpt as mcore_gpt
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig


def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    cp = args.cp_comm_type
    config = TransformerConfig(num_layers=args.num_layers, hidden_size=32, num_attention_heads=2,
                               use_cpu_initialization=True, attention_dropout=0.0,
                               cp_comm_type=cp[0] if len(cp) == 1 else cp)
    # FAKE_BYPASS: a builder that does not go through this module's GPTModel name.
    cls = mcore_gpt.GPTModel if os.environ.get("FAKE_BYPASS") else GPTModel
    return cls(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
               max_sequence_length=32, pre_process=pre_process, post_process=post_process)
'''


def _fake_megatron_lm(root: Path) -> Path:
    (root / "megatron" / "training").mkdir(parents=True)
    (root / "megatron" / "training" / "__init__.py").write_text(textwrap.dedent(_FAKE_TRAINING))
    (root / "pretrain_gpt.py").write_text(textwrap.dedent(_FAKE_PRETRAIN_GPT))
    (root / "model_provider.py").write_text(textwrap.dedent(_FAKE_MODEL_PROVIDER))
    (root / "gpt_builders.py").write_text(textwrap.dedent(_FAKE_GPT_BUILDERS))
    return root


@pytest.fixture
def fake_root(tmp_path: Path) -> Path:
    return _fake_megatron_lm(tmp_path / "Megatron-LM")


def _launch(root: Path, tmp_path: Path, *argv: str, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "report.json"
    full_env = dict(os.environ, MEGATRON_LM_PATH=str(root), FAKE_REPORT=str(report),
                    PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore", **env)
    proc = subprocess.run(
        [sys.executable, "-m", "charm_megatron.pretrain_gpt", *argv],
        cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=120,
    )
    data = json.loads(report.read_text()) if report.exists() else {}
    return proc, data


# --------------------------------------------------------------------------- end to end
def test_launcher_charm_run(fake_root, tmp_path):
    proc, report = _launch(fake_root, tmp_path, "--cp-comm-type", "charm", "charm",
                           "--charm-topology", "flat", "--their-flag", "kept")
    assert proc.returncode == 0, proc.stderr
    assert report["core_attention"] == ["CharmDotProductAttention"] * 2
    assert report["charm_topology"] == "flat" and report["module_topology"] == ["flat"] * 2
    assert report["their_flag"] == "kept"  # pretrain_gpt's own extra args still registered
    # A per-layer list stays one (no folding); the config's list is made safe for 0.16.1.
    assert report["cp_comm_type"] == ["charm", "charm"]
    assert report["config_type"] == "PerLayerCommTypes"
    assert "charm-megatron adds" in report["help"] and "rmplus" in report["help"]
    assert "charm-megatron: cp_comm_type=charm cp_size=1 topology=1x1 groups=[[0]]" in proc.stdout


def test_launcher_per_layer_mix(fake_root, tmp_path):
    """Three layers: ours, Megatron's, ours - each layer gets its own entry (L-1). This fake
    Megatron-LM builds the local spec, whose DotProductAttention refuses CP: its p2p layer runs
    on our ring (with TE's core attention in the spec it would keep TE's: test_megatron_spec::
    test_only_the_local_core_attention_is_replaced_for_te_comm_types)."""
    proc, report = _launch(fake_root, tmp_path, "--num-layers", "3", "--cp-comm-type", "ring",
                           "p2p", "rmplus")
    assert proc.returncode == 0, proc.stderr
    assert report["core_attention"] == ["CharmDotProductAttention"] * 3
    assert report["algo"] == ["ring", "ring", "rmplus"]
    assert "layers=1" in proc.stdout and "layers=3" in proc.stdout


def test_launcher_leaves_megatron_comm_types_alone(fake_root, tmp_path):
    proc, report = _launch(fake_root, tmp_path, "--cp-comm-type", "p2p")
    assert proc.returncode == 0, proc.stderr
    assert report["core_attention"] == ["DotProductAttention"] * 2
    assert report["charm_topology"] is None and report["module_topology"] == [None, None]
    assert "charm-megatron:" not in proc.stdout


def test_launcher_refuses_a_model_built_without_charm(fake_root, tmp_path):
    proc, report = _launch(fake_root, tmp_path, "--cp-comm-type", "charm", FAKE_BYPASS="1")
    assert proc.returncode != 0 and not report
    assert "the model was built with DotProductAttention in layer 1" in proc.stderr


def test_launcher_without_megatron_lm(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_PATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "charm_megatron.pretrain_gpt", "--cp-comm-type", "charm"],
        cwd=tmp_path, env=dict(env, PYTHONPATH=str(REPO)), capture_output=True, text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "MEGATRON_LM_PATH" in proc.stderr and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- pieces
def test_find_megatron_lm(fake_root, tmp_path):
    assert launcher.find_megatron_lm({"MEGATRON_LM_PATH": str(fake_root)}) == fake_root.resolve()
    assert launcher.find_megatron_lm({}, search_path=[str(tmp_path), str(fake_root)]) == (
        fake_root.resolve()
    )
    with pytest.raises(launcher.MegatronLMNotFound, match="MEGATRON_LM_PATH=.* is not a Megatron-LM"):
        launcher.find_megatron_lm({"MEGATRON_LM_PATH": str(tmp_path)})
    with pytest.raises(launcher.MegatronLMNotFound, match="set MEGATRON_LM_PATH="):
        launcher.find_megatron_lm({}, search_path=[str(tmp_path)])


def test_wrap_pretrain_chains_args_and_wraps_model_provider():
    seen = {}

    def pretrain(train_valid_test_dataset_provider, model_provider, model_type,
                 forward_step_func, process_non_loss_data_func=None, extra_args_provider=None,
                 args_defaults={}, get_embedding_ranks=None, store=None):  # noqa: B006
        seen.update(locals())

    def theirs(parser):
        parser.add_argument("--their-flag", default="d")
        return parser

    def provider(pre_process=True, post_process=True):
        return "model"

    wrapped = launcher.wrap_pretrain(pretrain)
    wrapped("data", provider, "encoder_or_decoder", "step", extra_args_provider=theirs, store=None)
    assert seen["train_valid_test_dataset_provider"] == "data" and seen["store"] is None
    assert seen["model_provider"].__wrapped__ is provider
    parser = seen["extra_args_provider"](argparse.ArgumentParser())
    args = parser.parse_args(["--charm-topology", "2x4", "--their-flag", "x"])
    assert (args.charm_topology, args.their_flag) == ("2x4", "x")
    # No provider of their own (ModelOpt absent): ours alone.
    wrapped("data", provider, "encoder_or_decoder", "step")
    assert seen["extra_args_provider"](argparse.ArgumentParser()).parse_args([]).charm_topology is None


class _Recorder:
    """Stands in for the ``gpt_builders`` module: records what GPTModel receives."""

    def __init__(self):
        self.calls = []
        self.GPTModel = self._gpt_model

    def _gpt_model(self, config=None, transformer_layer_spec=None, mtp_block_spec=None, **kw):
        self.calls.append((transformer_layer_spec, mtp_block_spec))
        return torch.nn.Linear(1, 1)


def _provider_via(module, spec, mtp=None):
    def model_provider(pre_process=True, post_process=True):
        return module.GPTModel(config="cfg", transformer_layer_spec=spec, mtp_block_spec=mtp)

    return model_provider


def test_wrap_model_provider_swaps_the_spec_only_for_charm():
    spec = get_gpt_layer_local_spec()
    module = _Recorder()
    original_gpt_model = module.GPTModel
    args = types.SimpleNamespace(cp_comm_type=["rmplus"], charm_topology="2x4")
    provider = launcher.wrap_model_provider(_provider_via(module, spec, mtp=[spec]),
                                            get_args=lambda: args, builder_module=module)
    provider(pre_process=True, post_process=True)
    layer_spec, mtp = module.calls[-1]
    for core in (layer_spec.submodules.self_attention.submodules.core_attention,
                 mtp[0].submodules.self_attention.submodules.core_attention):
        assert core.module is PerLayerCoreAttention
        assert core.params["topology"] == "2x4"  # --charm-topology reaches the spec
    assert module.GPTModel == original_gpt_model  # restored after the build

    args.cp_comm_type = ["p2p"]
    provider()
    assert module.calls[-1][0] is spec  # untouched

    args.cp_comm_type = ["charm", "p2p"]  # a per-layer mix goes through use_charm
    provider()
    assert module.calls[-1][0] is not spec
    legacy = types.SimpleNamespace(cp_comm_type=["charm"], use_legacy_models=True)
    with pytest.raises(RuntimeError, match="--use-legacy-models"):
        launcher.wrap_model_provider(_provider_via(module, spec), get_args=lambda: legacy,
                                     builder_module=module)()


def test_check_model_uses_charm():
    per_layer = ["p2p", "p2p", "charm", "a2a"]

    class FakeSelfAttention(SelfAttention):
        def __init__(self, core, layer_number=3):  # skip SelfAttention's build: attributes only
            torch.nn.Module.__init__(self)
            self.core_attention = core
            self.layer_number = layer_number
            self.config = types.SimpleNamespace(cp_comm_type=per_layer)

    charm = CharmDotProductAttention.__new__(CharmDotProductAttention)
    torch.nn.Module.__init__(charm)
    # Layer 3 (entry 2, charm) holds CHARM+; layers 2 and 4 (p2p, a2a) may hold anything else.
    good = torch.nn.Sequential(FakeSelfAttention(charm), torch.nn.Linear(1, 1),
                               FakeSelfAttention(torch.nn.Identity(), 2),
                               FakeSelfAttention(torch.nn.Identity(), 4))
    assert launcher.check_model_uses_charm([good, torch.nn.Linear(1, 1)]) == 1
    bad = torch.nn.Sequential(FakeSelfAttention(torch.nn.Identity()))
    with pytest.raises(RuntimeError, match="built with Identity in layer 3"):
        launcher.check_model_uses_charm(bad)


def test_main_without_megatron_lm(monkeypatch, tmp_path):
    monkeypatch.delenv("MEGATRON_LM_PATH", raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.setattr(sys, "argv", ["charm_megatron.pretrain_gpt"])
    with pytest.raises(SystemExit, match="MEGATRON_LM_PATH"):
        launcher.main(["--cp-comm-type", "charm"])


def test_args_says_where_a_cpu_config_cannot_run(capsys):
    """``charm-megatron args gpt-tiny-cpu`` prints a pretrain_gpt command; Megatron-LM's
    pretrain() asserts CUDA, so the CPU-only nature is stated next to it (stderr: stdout stays
    one command line)."""
    from charm_megatron.launch import args_cli

    def run(config: str, run_name: str, fmt: str = "shell") -> tuple[str, str]:
        parser = argparse.ArgumentParser()
        args_cli.register(parser)
        ns = parser.parse_args([config, "--run", run_name, "--cp-comm-type", "charm",
                                "--format", fmt, "--set", "DATA_PATH=/d",
                                "--set", "VOCAB_FILE=/v.json", "--set", "MERGE_FILE=/m.txt"])
        assert args_cli.run(ns) == 0
        captured = capsys.readouterr()
        return captured.out, captured.err

    out, err = run("gpt-tiny-cpu", "demo-s256-gb2")
    assert out.count("\n") == 1 and "charm_megatron.pretrain_gpt" in out
    assert "Megatron requires CUDA." in err and "charm-megatron demo" in err
    assert "Megatron requires CUDA." in json.loads(run("gpt-tiny-cpu", "demo-s256-gb2",
                                                       "json")[0])["note"]
    out, err = run("gpt-350m", "scale-s2048-gb16")
    assert err == "" and "note" not in json.loads(run("gpt-350m", "scale-s2048-gb16", "json")[0])
