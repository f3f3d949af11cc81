"""Opt-in: the real Megatron-LM checkout at ``$MEGATRON_LM_PATH`` (tag core_v0.16.1), driven
through our launcher's ``main()`` on 4 gloo CPU ranks, as far as a CPU allows.

Skipped (with the reason) unless ``MEGATRON_LM_PATH`` points at a checkout. Run it with::

    MEGATRON_LM_PATH=/path/to/Megatron-LM .venv/bin/python -m pytest -q tests/test_megatron_lm_real.py

Megatron-LM's ``pretrain_gpt.py`` imports ``six`` and ``regex`` (pip-installable; Megatron-LM's
own requirements, not ours) and ``triton`` (CUDA-only, through
``megatron.core.transformer.custom_layers.batch_invariant_kernels``, imported by
``megatron.training.initialize`` for ``--batch-invariant-mode``): without triton that one
module is replaced by a stand-in whose function raises.

In each rank: ``charm_megatron.pretrain_gpt.main(argv)`` runs the checkout's real
``pretrain_gpt.py`` as ``__main__`` (its imports, ``inprocess_restart`` wrapping and
``pretrain(...)`` call, with our wrapper around ``pretrain``). ``megatron.training.pretrain``
itself is first swapped for :func:`_pretrain_until_cuda_gate`, which

1. calls Megatron's real ``pretrain`` and records that it stops at its CUDA gate
   (``initialize_megatron``: ``assert torch.cuda.is_available(), "Megatron requires CUDA."``);
2. runs Megatron's real ``initialize_megatron(..., allow_no_cuda=True,
   skip_mpu_initialization=True)``: argument parsing (with our ``extra_args_provider``),
   ``validate_args``, global variables, the tokenizer;
3. replaces only ``_initialize_distributed`` (CUDA): ``parallel_state.initialize_model_parallel``
   on the gloo group that already exists;

(``validate_args`` asks the GPU's architecture for its ``CUDA_DEVICE_MAX_CONNECTIONS`` rule:
the test answers 9, Hopper, so that rule is checked as on an H100; and megatron-core's CUDA-only
spots on the model path are redirected as in the other model tests,
``charm_megatron.train_demo.cpu_megatron.patch_for_cpu``.)
4. calls the (wrapped) ``model_provider`` as Megatron's ``get_model`` does - the real
   ``model_provider`` / ``gpt_builders.gpt_builder`` build the model;
5. one forward / backward on a random batch split by ``get_batch_on_this_cp_rank``, with
   ``pretrain_gpt.py``'s own ``loss_func`` (inside the rerun state machine's
   ``should_run_forward_backward``, as ``train_step`` does).

The command lines are those ``charm-megatron args gpt-tiny-cpu`` prints.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from charm_megatron.local_ranks import run_ranks

ROOT = os.environ.get("MEGATRON_LM_PATH", "").strip()
if not ROOT:
    pytest.skip("MEGATRON_LM_PATH is not set (opt-in test: point it at a Megatron-LM "
                "core_v0.16.1 checkout)", allow_module_level=True)
if not (Path(ROOT) / "pretrain_gpt.py").is_file():
    pytest.skip(f"MEGATRON_LM_PATH={ROOT} has no pretrain_gpt.py", allow_module_level=True)
for _name in ("six", "regex"):
    try:
        __import__(_name)
    except ImportError:
        pytest.skip(f"Megatron-LM's pretrain_gpt.py needs the package {_name!r} "
                    f"(pip install {_name})", allow_module_level=True)
# No megatron import at module level: the ranks import this module, and must import the
# checkout's megatron package, not the pip one.

SEQ = 256  # the run demo-s256-gb2 of gpt-tiny-cpu


def _argv(comm_types: list[str]) -> list[str]:
    """``charm-megatron args gpt-tiny-cpu --run demo-s256-gb2 --format lines`` with
    ``--cp-comm-type`` replaced by ``comm_types``."""
    import subprocess

    lines = subprocess.run(
        [sys.executable, "-m", "charm_megatron", "args", "gpt-tiny-cpu", "--run", "demo-s256-gb2",
         "--cp-comm-type", "charm", "--format", "lines"],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout.split("\n")
    argv = [a for a in lines if a]
    i = argv.index("--cp-comm-type")
    return argv[:i + 1] + comm_types + argv[i + 2:]


def _stand_in_batch_invariant_kernels() -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
        module = types.ModuleType(name)

        def enable_batch_invariant_mode(*args, **kwargs):
            raise RuntimeError("--batch-invariant-mode needs triton (CUDA)")

        module.enable_batch_invariant_mode = enable_batch_invariant_mode
        sys.modules[name] = module


def _pretrain_until_cuda_gate(real_pretrain, report: dict):
    def pretrain(train_valid_test_dataset_provider, model_provider, model_type,
                 forward_step_func, process_non_loss_data_func=None, extra_args_provider=None,
                 args_defaults={}, get_embedding_ranks=None,  # noqa: B006 - Megatron's signature
                 get_position_embedding_ranks=None, non_loss_data_func=None, store=None,
                 inprocess_call_wrapper=None):
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        from megatron.core.tensor_parallel import random as mrandom
        from megatron.core.utils import get_batch_on_this_cp_rank
        from megatron.training import get_args
        from megatron.training.initialize import initialize_megatron

        # 1. The real pretrain stops at the CUDA gate, before parsing anything.
        try:
            real_pretrain(train_valid_test_dataset_provider, model_provider, model_type,
                          forward_step_func, extra_args_provider=extra_args_provider,
                          args_defaults=args_defaults, store=store)
            report["gate"] = "passed"
        except AssertionError as exc:
            report["gate"] = str(exc)
        # 2. What it does next, with CUDA allowed to be absent.
        initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults,
                            allow_no_cuda=True, skip_mpu_initialization=True)
        args = get_args()
        report["args_cp_comm_type"] = list(args.cp_comm_type)
        report["charm_topology"] = getattr(args, "charm_topology", "<unregistered>")
        # 3. _initialize_distributed without CUDA: the gloo group exists already.
        ps.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
        )
        mrandom.model_parallel_cuda_manual_seed(args.seed, force_reset_rng=True)
        # 4. Megatron's get_model calls the provider with the stage flags.
        model = model_provider(pre_process=ps.is_pipeline_first_stage(),
                               post_process=ps.is_pipeline_last_stage())
        cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
        report["core_attention"] = [type(c).__name__ for c in cores]
        report["algos"] = [getattr(c, "algo", None) for c in cores]
        report["topologies"] = [str(getattr(c, "topology", None)) for c in cores]
        report["config_cp_comm_type"] = [model.config.cp_comm_type] if isinstance(
            model.config.cp_comm_type, str) else list(model.config.cp_comm_type)
        # 5. One forward / backward with pretrain_gpt.py's own loss_func.
        g = torch.Generator().manual_seed(7)
        data = torch.randint(0, args.padded_vocab_size, (args.micro_batch_size, SEQ + 1),
                             generator=g)
        batch = get_batch_on_this_cp_rank({
            "tokens": data[:, :-1].contiguous(), "labels": data[:, 1:].contiguous(),
            "loss_mask": torch.ones(args.micro_batch_size, SEQ),
            "position_ids": torch.arange(SEQ).expand(args.micro_batch_size, SEQ),
        })
        # train_step's loop: the rerun state machine must know a forward-backward is on.
        assert get_rerun_state_machine().should_run_forward_backward(None)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss_func = forward_step_func.__globals__["loss_func"]
        loss, num_tokens, _ = loss_func(batch["loss_mask"], output)
        (loss / SEQ).backward()
        total = torch.stack([loss.detach(), num_tokens.to(loss.dtype)])
        dist.all_reduce(total, group=ps.get_context_parallel_group())
        report["loss"] = (total[0] / total[1]).item()
        report["tokens"] = int(total[1].item())
        report["grads_finite"] = all(
            bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None
        )
        report["n_grads"] = sum(p.grad is not None for p in model.parameters())
        ps.destroy_model_parallel()

    return pretrain


def _prepare_rank(rank: int, world: int, root: str) -> tuple[dict, object]:
    """Environment, import path and CPU redirections; returns the report and the checkout's
    ``megatron.training`` (its ``pretrain`` swapped for the stand-in)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      CUDA_DEVICE_MAX_CONNECTIONS="1", MEGATRON_LM_PATH=root)
    sys.path.insert(0, root)  # the checkout's megatron package, before anything imports one
    _stand_in_batch_invariant_kernels()
    from charm_megatron.train_demo.cpu_megatron import patch_for_cpu, quiet_megatron

    quiet_megatron()
    patch_for_cpu()
    import megatron.core
    import megatron.training
    import megatron.training.arguments

    # validate_args asks the GPU's architecture (CUDA) for the CUDA_DEVICE_MAX_CONNECTIONS rule:
    # answer Hopper's (9), so that rule is checked as on an H100.
    megatron.training.arguments.get_device_arch_version = lambda: 9
    # megatron is a namespace package: both of its parts must come from the checkout.
    report: dict = {"megatron": [megatron.training.__file__, megatron.core.__file__]}
    megatron.training.pretrain = _pretrain_until_cuda_gate(megatron.training.pretrain, report)
    return report, megatron.training


def _rank_real(rank: int, world: int, root: str, argv: list[str]) -> dict:
    """Through our launcher's ``main()``."""
    report, _ = _prepare_rank(rank, world, root)
    from charm_megatron import pretrain_gpt as launcher

    launcher.main(argv)
    return report


def _rank_patched(rank: int, world: int, root: str, patched: str, argv: list[str],
                  hide_charm: bool) -> dict:
    """``patched/pretrain_gpt.py`` run directly (no launcher; ``patched`` may be the checkout
    itself, unpatched); ``hide_charm``: as if charm-megatron were not installed."""
    import runpy

    report, _ = _prepare_rank(rank, world, root)
    if hide_charm:
        for name in ("charm_megatron.megatron.args", "charm_megatron.megatron.build"):
            sys.modules[name] = None  # import raises ImportError
    sys.path.insert(0, patched)
    sys.argv = [os.path.join(patched, "pretrain_gpt.py"), *argv]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except ImportError as exc:
        report["error"] = str(exc)
    return report


def _check_report(rep: dict, comm_types: list[str], topology: str = "2x2") -> float:
    expected = comm_types * 2 if len(comm_types) == 1 else comm_types
    for path in rep["megatron"]:
        assert path.startswith(str(Path(ROOT).resolve())), rep["megatron"]
    assert rep["gate"] == "Megatron requires CUDA.", rep
    assert rep["args_cp_comm_type"] == comm_types and rep["charm_topology"] == topology, rep
    assert rep["core_attention"] == ["CharmDotProductAttention"] * 2, rep
    assert rep["algos"] == expected, rep
    assert all(t == "2x2" for a, t in zip(expected, rep["topologies"]) if a == "charm"), rep
    assert rep["config_cp_comm_type"] == comm_types, rep
    assert rep["tokens"] == SEQ and rep["grads_finite"] and rep["n_grads"] > 0, rep
    return round(rep["loss"], 6)


@pytest.mark.parametrize("comm_types", [["charm"], ["ring", "charm"]], ids=["charm", "per-layer"])
def test_real_megatron_lm_until_cuda_gate(comm_types):
    argv = _argv(comm_types)
    results = run_ranks(_rank_real, 4, ROOT, argv, timeout_s=600, pg_timeout_s=120)
    losses = {_check_report(rep, comm_types) for rep in results}
    # Random tokens over a 1024-word vocabulary: the loss of a fresh model is near ln(1024).
    assert len(losses) == 1 and 6.0 < next(iter(losses)) < 7.9, losses


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory) -> str:
    """pretrain_gpt.py, gpt_builders.py and model_provider.py of the checkout, with our patch
    applied (``git apply``, as patches/README.md says)."""
    import shutil
    import subprocess

    tree = tmp_path_factory.mktemp("patched")
    for name in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py"):
        shutil.copy(Path(ROOT) / name, tree / name)
    patch = Path(__file__).resolve().parents[1] / "patches" / "megatron-lm-core_v0.16.1-charm.patch"
    subprocess.run(["git", "apply", "--unsafe-paths", f"--directory={tree}", str(patch)],
                   cwd=tree, check=True, capture_output=True, timeout=60)
    assert "charm_gpt_specs" in (tree / "gpt_builders.py").read_text()
    return str(tree)


def test_real_megatron_lm_patched(patched_tree):
    comm_types = ["ring", "charm"]
    results = run_ranks(_rank_patched, 4, ROOT, patched_tree, _argv(comm_types), False,
                        timeout_s=600, pg_timeout_s=120)
    losses = {_check_report(rep, comm_types) for rep in results}
    assert len(losses) == 1 and "error" not in results[0]


def test_real_megatron_lm_patched_without_charm_megatron(patched_tree):
    """The patch's promise: without charm-megatron, --charm-topology is still accepted and the
    build fails with an ImportError saying what to install (on every rank)."""
    results = run_ranks(_rank_patched, 4, ROOT, patched_tree, _argv(["charm"]), True,
                        timeout_s=600, pg_timeout_s=120)
    for rep in results:
        assert rep["charm_topology"] == "2x2" and rep["gate"] == "Megatron requires CUDA."
        assert "need charm-megatron: pip install 'charm-megatron[megatron]'" in rep["error"]
        assert "core_attention" not in rep


def test_real_megatron_lm_spec_route_without_patch_or_launcher():
    """Stock pretrain_gpt.py, unpatched, with ``--spec charm_megatron.megatron.layer_specs
    charm_local_layer_spec`` and the topology from CHARM_TOPOLOGY (no --charm-topology)."""
    argv = _argv(["charm"])
    i = argv.index("--charm-topology")
    argv = argv[:i] + argv[i + 2:] + ["--spec", "charm_megatron.megatron.layer_specs",
                                      "charm_local_layer_spec"]
    results = run_ranks(_rank_patched, 4, ROOT, ROOT, argv, False, timeout_s=600,
                        pg_timeout_s=120, env={"CHARM_TOPOLOGY": "2x2"})
    losses = {_check_report(rep, ["charm"], topology="<unregistered>") for rep in results}
    assert len(losses) == 1 and "error" not in results[0]
