"""The model's super-tile grid (docs/performance.md, *Super-tiles*): CHARM+, RM+ and
all-gather with ``super_tiles`` off and on, CHARM+ with its settings tuned on the profile
(``head_parallel`` and ``super_tiles`` auto), and CHARM+'s peak memory with super-tiles over
without, on the ``h200`` profile. Each cell is what ``charm-megatron model --profile h200
--topology T --seq S --heads H --kv-heads K [--causal] --super-tiles off|on`` prints
(``--tune --super-tiles auto`` for the tuned column).

    PYTHONPATH=$PWD python scripts/model_super_tiles.py
"""

from __future__ import annotations

from charm_megatron.devices import get_profile
from charm_megatron.model.predict import predict, role_shape, variants
from charm_megatron.plan import registry
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.memory import max_peak

CLUSTER = get_profile("h200").cluster


def rows():
    for topo in ("2x8", "4x8"):
        for seq in (16384, 32768, 131072):
            yield topo, f"8B 32/8 {seq // 1024}k", Problem(1, seq, 32, 8, 128, 2), True
        yield topo, "paper 12x192 B=16 26,880 full", Problem(16, 26880, 12, 12, 192, 2), False
        yield topo, "Qwen 28/4 32k", Problem(1, 32768, 28, 4, 128, 2), True


def peak_ratio(groups, problem: Problem, causal: bool) -> float:
    """CHARM+'s peak memory with super-tiles over without (the larger direction)."""
    shape = role_shape(problem)
    out = []
    for st in ("off", "on"):
        fwd, bwd = registry.plans("charm", groups, causal, shape=shape, super_tiles=st)
        out.append((max_peak(fwd, problem), max_peak(bwd, problem)))
    return max(out[1][i] / out[0][i] for i in range(2))


def main() -> None:
    print("| GPUs | shape | charm off | charm on | on/off fwd | on/off bwd | peak mem on/off "
          "| rmplus off | rmplus on | allgather off | allgather on | charm tuned, off "
          "| tuned, auto (d, fwd/bwd) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for topo, name, problem, causal in rows():
        g, m = map(int, topo.split("x"))
        groups = [list(range(i * m, (i + 1) * m)) for i in range(g)]
        res = {(a, st): predict(a, groups, problem, CLUSTER, causal, super_tiles=st)
               for a in ("charm", "rmplus", "allgather") for st in ("off", "on")}
        tuned_off = predict("charm", groups, problem, CLUSTER, causal, tune=True,
                            super_tiles="off")
        tuned = predict("charm", groups, problem, CLUSTER, causal, tune=True,
                        super_tiles="auto")
        fv, bv = variants("charm", groups, problem, CLUSTER, causal=causal, super_tiles="auto")
        off, on = res["charm", "off"], res["charm", "on"]

        def ms(p) -> str:
            return f"{p.total_s * 1e3:.1f}"

        picked = "/".join("on" if v.super_tiles else "off" for v in (fv, bv))
        print(f"| {topo} | {name} | {ms(off)} | {ms(on)} "
              f"| {off.forward.time_s / on.forward.time_s:.2f}x "
              f"| {off.backward.time_s / on.backward.time_s:.2f}x "
              f"| {peak_ratio(groups, problem, causal):.2f}x "
              f"| {ms(res['rmplus', 'off'])} | {ms(res['rmplus', 'on'])} "
              f"| {ms(res['allgather', 'off'])} | {ms(res['allgather', 'on'])} "
              f"| {ms(tuned_off)} | {ms(tuned)} ({fv.head_parallel}, {picked}) |", flush=True)


if __name__ == "__main__":
    main()
