"""Counts split by link (issue 19 item 2): a count table row may name the link of a family
("all_reduce@inter-node"), and a spawned pool emulates nodes (XTRAIN_RANKS_PER_NODE), so HSDP's "defer only
the cross-node reduction" is checked on one host. The row itself: tests/harness/test_boundary_rule.py; the
planted HSDP that reduces across nodes every micro-step: hsdp_eager_inter_node (planted/registry.py)."""
import pytest

from planted import hsdp_adapters
from verify._internal.cases.case import Case
from verify._internal.gates import check_distributed
from verify._internal.gates.worlds import max_world

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(max_world() < 4, reason="needs world ≥ 4 (XTRAIN_DIST_MAX_WORLD / GPUs)")]
CASE = Case(accum_steps=3, micro_batch=1, steps=2, world=4)  # 2 nodes × 2 ranks


def test_hsdp_passes_its_per_link_row_and_its_boundary_bytes_split_by_link(settings_with):
    settings_with(ranks_per_node=2)
    r = check_distributed(hsdp_adapters.hsdp, CASE)  # boundary-only by its row, then data-parallel equivalence
    P = r.extra["comm"].grad_elements
    # at the boundary: one all-reduce within the node and one across nodes, each the gradient + the loss, fp32
    assert r.extra["boundary_bytes_by_link"] == [{"intra-node": 4 * (P + 1), "inter-node": 4 * (P + 1)}] * 2
