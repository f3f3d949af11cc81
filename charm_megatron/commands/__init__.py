"""Command-line front ends that are not lab tools: ``charm-megatron plan`` (:mod:`.plan`) and
the problem / setting flags the plan, model and bench commands share (:mod:`.flags`)."""
