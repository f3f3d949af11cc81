"""Megatron-LM's ``pretrain_gpt.py`` with ``--cp-comm-type charm`` selecting CHARM+ attention.

Usage (any ``pretrain_gpt.py`` command line, plus our options)::

    MEGATRON_LM_PATH=/path/to/Megatron-LM torchrun ... -m charm_megatron.pretrain_gpt \\
        <the usual pretrain_gpt.py arguments> --context-parallel-size 8 \\
        --cp-comm-type charm [--charm-topology auto|flat|node|numa|2x4|0-3,4-7]

How: this runs Megatron-LM's own ``pretrain_gpt.py`` (found through ``MEGATRON_LM_PATH`` or the
Python path) as ``__main__``, after wrapping ``megatron.training.pretrain`` so that

* the ``extra_args_provider`` also registers ``--charm-topology`` (chained with the one
  ``pretrain_gpt.py`` passes, ``add_modelopt_args`` when ModelOpt is installed);
* the ``model_provider``, when any ``--cp-comm-type`` value (one, or one per layer) is ours
  (``charm``/``rmplus``/``ring``/``auto``), builds the model with the layer spec passed through
  :func:`charm_megatron.megatron.use_charm`: ``gpt_builders.gpt_builder`` chooses the spec
  (local, Transformer Engine, MoE block, ``--spec``, MTP) exactly as usual, and its call to
  ``GPTModel`` is intercepted (:func:`charm_megatron.megatron.build.charm_gpt_specs`, the same
  call the patch makes). Layers with our values get CHARM+, the others keep the spec's core
  attention. The built model is then checked layer by layer, or start-up fails.

Everything else (arguments, validation, data, optimizer, training loop, checkpoints) is
Megatron-LM's. Megatron's argument validation accepts the new values as they are (verified for
core_v0.16.1: ``--cp-comm-type`` has no ``choices``; see ``docs/megatron.md``).

This file imports no Megatron module at import time, so the Megatron-LM checkout's ``megatron``
package (not only a pip ``megatron-core``) is the one that gets used.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import runpy
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from charm_megatron.megatron.args import add_charm_args, chain_extra_args_providers, uses_charm

__all__ = [
    "MegatronLMNotFound",
    "find_megatron_lm",
    "main",
    "wrap_model_provider",
    "wrap_pretrain",
]

ENV_VAR = "MEGATRON_LM_PATH"


class MegatronLMNotFound(RuntimeError):
    """No Megatron-LM checkout (with ``pretrain_gpt.py`` and ``megatron/training``) was found."""


def _is_megatron_lm(root: Path) -> bool:
    return (root / "pretrain_gpt.py").is_file() and (root / "megatron" / "training").is_dir()


def find_megatron_lm(
    environ: Mapping[str, str] | None = None, search_path: list[str] | None = None
) -> Path:
    """The Megatron-LM checkout to run: ``$MEGATRON_LM_PATH``, else the first ``sys.path`` entry
    (``''`` = the current directory) holding ``pretrain_gpt.py`` and ``megatron/training``.

    Raises :class:`MegatronLMNotFound` naming ``MEGATRON_LM_PATH`` otherwise.
    """
    environ = os.environ if environ is None else environ
    explicit = environ.get(ENV_VAR, "").strip()
    if explicit:
        root = Path(explicit).expanduser().resolve()
        if _is_megatron_lm(root):
            return root
        raise MegatronLMNotFound(
            f"{ENV_VAR}={explicit} is not a Megatron-LM checkout: it needs pretrain_gpt.py and "
            "megatron/training/ (git clone https://github.com/NVIDIA/Megatron-LM && git -C "
            "Megatron-LM checkout core_v0.16.1)"
        )
    for entry in sys.path if search_path is None else search_path:
        root = Path(entry or os.getcwd())
        if _is_megatron_lm(root):
            return root.resolve()
    raise MegatronLMNotFound(
        "charm_megatron.pretrain_gpt runs Megatron-LM's pretrain_gpt.py, which was not found: "
        f"set {ENV_VAR}=/path/to/Megatron-LM (a checkout of core_v0.16.1; the pip package "
        "megatron-core does not contain megatron.training or pretrain_gpt.py), or run from the "
        "Megatron-LM directory"
    )


# --------------------------------------------------------------------------- model provider
def check_model_uses_charm(model: Any) -> int:
    """Raise ``RuntimeError`` unless every layer whose comm type is ours holds CHARM+
    (:func:`charm_megatron.megatron.build.check_model`); returns how many do."""
    from charm_megatron.megatron.build import check_model

    return check_model(model)


@contextlib.contextmanager
def _charm_gpt_model(module: Any, margs: Any) -> Iterator[list[int]]:
    """Temporarily replace ``module.GPTModel`` with a function that passes the layer spec and
    MTP block spec through :func:`charm_megatron.megatron.build.charm_gpt_specs`; yields a list
    that counts the intercepted calls.

    ``gpt_builders.gpt_builder`` (core_v0.16.1, ``gpt_builders.py:95``) picks the spec and
    calls ``GPTModel(config=..., transformer_layer_spec=..., mtp_block_spec=...)``; patching the
    name in that module's namespace touches nothing else.
    """
    from charm_megatron.megatron.build import charm_gpt_specs

    original = module.GPTModel
    calls: list[int] = []

    @functools.wraps(original)
    def gpt_model(*args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(original).bind(*args, **kwargs)
        spec, mtp = charm_gpt_specs(
            margs,
            bound.arguments.get("config"),
            bound.arguments.get("transformer_layer_spec"),
            bound.arguments.get("mtp_block_spec"),
        )
        if spec is not None:
            bound.arguments["transformer_layer_spec"] = spec
        if mtp is not None:
            bound.arguments["mtp_block_spec"] = mtp
        calls.append(1)
        return original(*bound.args, **bound.kwargs)

    module.GPTModel = gpt_model
    try:
        yield calls
    finally:
        module.GPTModel = original


def wrap_model_provider(
    model_provider: Callable[..., Any],
    get_args: Callable[[], Any] | None = None,
    builder_module: Any = None,
) -> Callable[..., Any]:
    """A model provider that builds the model with CHARM+ in the layers ``--cp-comm-type``
    selects it for.

    ``get_args`` defaults to ``megatron.training.get_args``; ``builder_module`` (the module whose
    ``GPTModel`` name the builder calls) defaults to ``sys.modules['gpt_builders']``. Otherwise
    calls ``model_provider`` unchanged.
    """

    @functools.wraps(model_provider)
    def provider(*args: Any, **kwargs: Any) -> Any:
        if get_args is None:
            from megatron.training import get_args as megatron_get_args

            margs = megatron_get_args()
        else:
            margs = get_args()
        if not uses_charm(margs):
            return model_provider(*args, **kwargs)
        if getattr(margs, "use_legacy_models", False):
            raise RuntimeError(
                f"charm-megatron: --cp-comm-type {' '.join(margs.cp_comm_type)} needs "
                "megatron-core models; drop --use-legacy-models"
            )
        module = builder_module if builder_module is not None else sys.modules.get("gpt_builders")
        if module is not None and hasattr(module, "GPTModel"):
            with _charm_gpt_model(module, margs):
                model = model_provider(*args, **kwargs)
        else:
            model = model_provider(*args, **kwargs)
        check_model_uses_charm(model)
        from charm_megatron.megatron.build import print_model_description

        print_model_description(model)
        return model

    return provider


def wrap_pretrain(pretrain: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron-LM's ``pretrain`` with our ``extra_args_provider`` chained in and the
    ``model_provider`` wrapped by :func:`wrap_model_provider`."""
    signature = inspect.signature(pretrain)

    @functools.wraps(pretrain)
    def charm_pretrain(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["extra_args_provider"] = chain_extra_args_providers(
            add_charm_args, bound.arguments.get("extra_args_provider")
        )
        bound.arguments["model_provider"] = wrap_model_provider(bound.arguments["model_provider"])
        return pretrain(*bound.args, **bound.kwargs)

    charm_pretrain.__charm_wrapped__ = True  # type: ignore[attr-defined]
    return charm_pretrain


def main(argv: list[str] | None = None) -> None:
    """Run Megatron-LM's ``pretrain_gpt.py`` with CHARM+ support (see the module docstring)."""
    try:
        root = find_megatron_lm()
    except MegatronLMNotFound as exc:
        raise SystemExit(f"error: {exc}") from None
    script = root / "pretrain_gpt.py"
    sys.argv = [str(script), *(sys.argv[1:] if argv is None else argv)]
    # pretrain_gpt.py imports gpt_builders / model_provider from its own directory.
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import megatron.training

    if not getattr(megatron.training.pretrain, "__charm_wrapped__", False):
        megatron.training.pretrain = wrap_pretrain(megatron.training.pretrain)
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
