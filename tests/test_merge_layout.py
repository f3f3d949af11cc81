"""The log-sum-exp merge and the load-balanced layout."""

import pytest
import torch

from charm_megatron.kernels.merge import merge_into, merge_pair
from charm_megatron.kernels.reference import ReferenceBackend
from charm_megatron.layout import positions, shard, unshard

REF = ReferenceBackend(torch.float64)


def _sbh(lse):  # [b, h, s] -> [s, b, h]
    return lse.permute(2, 0, 1)


def test_merge_of_two_key_sets_equals_attention_over_their_union():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 2, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(12, 2, 4, 16, generator=g, dtype=torch.float64)
    v = torch.randn(12, 2, 4, 16, generator=g, dtype=torch.float64)
    full, full_lse = REF.forward(q, k, v, False, 0.25)
    a, la = REF.forward(q, k[:5], v[:5], False, 0.25)
    b, lb = REF.forward(q, k[5:], v[5:], False, 0.25)
    out, lse = merge_pair(a, _sbh(la), b, _sbh(lb))
    torch.testing.assert_close(out.double(), full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), _sbh(full_lse), atol=1e-6, rtol=1e-5)


def test_merge_rows_that_saw_no_key_stay_empty_without_nan():
    acc = torch.zeros(4, 1, 2, 3)
    acc_lse = torch.full((4, 1, 2), float("-inf"))
    part = torch.randn(4, 1, 2, 3)
    part_lse = torch.randn(4, 1, 2)
    part_lse[0] = float("-inf")  # row 0 saw no key in this partial either
    part[0] = 0.0
    merge_into(acc, acc_lse, part, part_lse)
    assert not torch.isnan(acc).any() and not torch.isnan(acc_lse).any()
    assert torch.isneginf(acc_lse[0]).all() and (acc[0] == 0).all()
    torch.testing.assert_close(acc[1:], part[1:])
    # Merging an all-masked partial changes nothing.
    before = acc.clone(), acc_lse.clone()
    merge_into(acc, acc_lse, torch.full_like(part, 7.0), torch.full_like(part_lse, float("-inf")))
    assert torch.equal(acc, before[0]) and torch.equal(acc_lse, before[1])


def test_merge_partial_rows_only_touches_those_rows():
    acc = torch.randn(6, 1, 2, 3)
    acc_lse = torch.randn(6, 1, 2)
    first = acc[:3].clone(), acc_lse[:3].clone()
    part, part_lse = torch.randn(3, 1, 2, 3), torch.randn(3, 1, 2)
    want_o, want_l = merge_pair(acc[3:], acc_lse[3:], part, part_lse)
    merge_into(acc, acc_lse, part, part_lse, rows=slice(3, 6))
    assert torch.equal(acc[:3], first[0]) and torch.equal(acc_lse[:3], first[1])
    torch.testing.assert_close(acc[3:], want_o)
    torch.testing.assert_close(acc_lse[3:], want_l)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_shard_matches_megatron_assignment_and_round_trips(n):
    s = 4 * n
    x = torch.arange(s * 3).reshape(s, 3)
    chunk = s // (2 * n)
    parts = [shard(x, r, n) for r in range(n)]
    for r, p in enumerate(parts):
        # get_batch_on_this_cp_rank: rank r keeps chunks r and 2n-1-r, in that order.
        want = list(range(r * chunk, (r + 1) * chunk)) + list(
            range((2 * n - 1 - r) * chunk, (2 * n - r) * chunk))
        assert positions(r, n, s).tolist() == want
        assert torch.equal(p, x[want])
    assert torch.equal(unshard(parts), x)
    # Other sequence dims work too.
    y = x.T.contiguous()
    assert torch.equal(unshard([shard(y, r, n, seq_dim=1) for r in range(n)], seq_dim=1), y)


def test_shard_rejects_indivisible_length():
    with pytest.raises(ValueError, match="divisible by 2\\*cp_size"):
        shard(torch.zeros(6, 2), 0, 2)
