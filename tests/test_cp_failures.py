"""The failure model of cp_attention on real gloo ranks (docs/api.md, "what happens when a rank
fails or disagrees"): a failed call leaves the CP group usable, communicators do not depend on a
process's group history and survive destroy/re-init, every disagreement is an error on every
rank, float64 and extreme ``dout`` are exact, timeouts say what happened.

Every case is its own ``run_ranks`` job with a process-level timeout and a few-second
communication bound passed explicitly in the call's options.
"""

import re

import dist_failure_cases as cases
import pytest

from charm_megatron.local_ranks import run_ranks

JOB_S = 90  # process-level bound of one job (a case that hangs fails here)


# ------------------------------------------------------------------------- clean failure
@pytest.mark.parametrize("algo,topology,world", [("ring", None, 2), ("rmplus", None, 3),
                                                 ("charm", "2x2", 4), ("allgather", None, 3)])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_kernel_failure_mid_call_then_normal_call(algo, topology, world, where):
    bad = world - 1
    res = run_ranks(cases.failure_then_normal_call, world, algo, topology, where, bad,
                    timeout_s=JOB_S)
    cases.check_clean_failure(res, bad, algo, where)


def test_straggler_past_the_timeout_rebuilds_and_next_call_works():
    # Rank 1 stalls 5 s in a backward kernel (2 s bound) before it sends its dk, dv: its peer
    # times out, the status exchange tells both, both rebuild the stream communicators, and
    # the next calls work.
    res = run_ranks(cases.failure_then_normal_call, 2, "ring", None, "backward", 1, 5.0,
                    timeout_s=JOB_S)
    texts = [t for t, _, _ in res]
    assert any("timed out or lost its peer" in t and "stream" in t for t in texts), texts
    assert all(t != "no error" for t in texts), texts
    assert all(err < 1e-5 for _, _, err in res), res


# ----------------------------------------------------------------- deterministic groups
@pytest.mark.parametrize("case", ["subgroup_on_some_ranks", "world_after_subgroups"])
def test_different_group_histories(case):
    errs = run_ranks(cases.histories_differ, 4, case, timeout_s=JOB_S)
    assert all(e < 1e-5 for e in errs), errs


def test_destroy_and_reinit(tmp_path):
    res = run_ranks(cases.destroy_and_reinit, 4, str(tmp_path), 3, timeout_s=JOB_S)
    for rank, (err, fresh, cached) in enumerate(res):
        assert err < 1e-5, (rank, err)
        assert all(fresh), fresh  # new communicators after every re-init
        assert max(cached) <= 2, cached  # no stale entries kept
    assert len({tuple(u) for _, u, _ in res}) == 1  # the same ids on every rank


# ------------------------------------------------------------------------- agreement
MISMATCH = {  # case -> (field named in the message, or the input error's text)
    "s_local": "q shape",
    "batch": "q shape",
    "heads": "q shape",
    "head_dim": "q shape",
    "same_bytes_other_shape": "q shape",
    "dtype": "q shape/dtype",
    "causal": "causal",
    "algo": "algo",
    "topology": "topology",
    "scale": "softmax_scale",
    "pass_order": "pass_order",
    "roles": "roles",
    "partials": "partials on the wire",
    "bad_input_one_rank": "divisible by 2\\*cp_size",
    "backward_order": "call number",
}


@pytest.mark.parametrize("case", sorted(MISMATCH))
def test_mismatch_is_an_error_on_every_rank(case):
    world = 4 if case in ("topology", "pass_order") else 2
    res = run_ranks(cases.mismatch, world, case, timeout_s=JOB_S)
    if case == "backward_order":
        # Rank 0 is in call 0's backward, rank 1 in call 1's: rank 0 is behind and raises
        # at once, naming the call numbers; rank 1, ahead, waits for rank 0's next exchange
        # (the call it is in) and raises within its bound when rank 0 stops instead.
        kind, text, took = res[0]
        assert kind == "CPMismatchError" and re.search("call number", text), res[0]
        assert res[1][0] in ("CPAttentionError", "CPMismatchError"), res[1]
        assert max(took for _, _, took in res) < 20, res
        return
    for rank, (kind, text, took) in enumerate(res):
        assert kind != "no error", (rank, res)
        assert re.search(MISMATCH[case], text), (rank, text)
        assert took < 20, (rank, took)
        if case == "bad_input_one_rank":
            # The bad rank raises its own ValueError; the others name it.
            assert kind == ("ValueError" if rank == world - 1 else "CPMismatchError"), res
            if rank != world - 1:
                assert f"rank {world - 1}" in text
        else:
            assert kind == "CPMismatchError", (rank, kind, text)
            assert f"rank {world - 1}" in text or f"ranks {world - 1}" in text, text


# -------------------------------------------------------------------------- numerics
def test_float64_end_to_end():
    for res in run_ranks(cases.float64_all_algos, 4, timeout_s=JOB_S):
        for case, err in res.items():
            assert err < 1e-12, (case, err)


@pytest.mark.parametrize("dtype,tol,scales", [
    ("fp32", 1e-5, [1e30, 1e-30, 1e-36]),
    ("bf16", 2e-2, [1e30, 1e-30]),
    # Denormal dout: plain fused SDPA on one rank is itself only good to ~6e-5 here.
    ("fp32", 1e-3, [1e-40]),
])
def test_extreme_dout_is_exact(dtype, tol, scales):
    for res in run_ranks(cases.extreme_dout, 4, scales, dtype, timeout_s=JOB_S):
        for case, err in res.items():
            assert err < tol, (dtype, case, err)


# ----------------------------------------------------------------------- errors that help
@pytest.mark.parametrize("stage,expect", [
    ("first_call", "creating the communicators"),
    ("agreement", "agreement exchange"),
    ("transfer", "stream 'kv'"),
])
def test_missing_peer_error_says_what_happened(stage, expect):
    res = run_ranks(cases.missing_peer_message, 2, stage, timeout_s=JOB_S)
    kind, text, took = res[0]
    assert kind != "no error"
    assert "cp_attention" in text and expect in text and "Likely causes" in text, text
    if stage == "transfer":
        assert "peer rank(s) [1]" in text and "algo=ring" in text, text
    assert took < 3 * cases.TIMEOUT_S, took


def test_a_failed_home_stream_creation_is_shared_and_the_next_call_rebuilds():
    # The home streams' communicators are made by the first backward that posts on them: a
    # failure there is every rank's error (the injected one on rank 3, its creation's on the
    # others, within the bound), and the next call, on rebuilt communicators, is exact.
    res = run_ranks(cases.home_stream_creation_fails, 4, 3, timeout_s=JOB_S)
    for rank, (text, took, held, err) in enumerate(res):
        assert text != "no error", rank
        assert "creating the communicators of stream(s) ['home_up', 'home_down']" in text, text
        assert ("injected communicator failure" in text) == (rank == 3), text
        assert took < 30, (rank, took)
        assert "home_up" in held and "home_down" in held, held
        assert err < 1e-5, (rank, err)
