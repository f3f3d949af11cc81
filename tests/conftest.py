"""Shared test settings: bounded communication waits and hypothesis profiles."""

import os

from hypothesis import settings

from charm_megatron import local_ranks

# A broken collective must fail a test in seconds, not hang CI.
os.environ.setdefault("CHARM_COMM_TIMEOUT_S", "60")

# megatron-core once in the rank forkserver (~2-3 s of CPU), not in each of the ~70 ranks of
# the megatron tests. Not with a Megatron-LM checkout: test_megatron_lm_real's ranks must
# import the checkout's megatron, not the installed one.
if not os.environ.get("MEGATRON_LM_PATH", "").strip():
    local_ranks.preload("pytest", "megatron.core", "megatron.core.models.gpt.gpt_layer_specs",
                        "charm_megatron.megatron", "charm_megatron.train_demo.cpu_megatron")

settings.register_profile("ci", deadline=None, max_examples=60, derandomize=True)
settings.load_profile("ci")
