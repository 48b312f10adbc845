"""The study's engines rule by rule: BytePS's keys, servers and node-local aggregation
(its server engine: tests/test_ps_server.py); ByteScheduler's slices and Horovod's fusion;
the plan viewer."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess

import pytest
import torch
import torch.distributed as dist

import methods
from harness import config
from harness.launch.rank import node_groups
from harness.measure import results
from harness.measure.verify import train
from harness.predict import plans as plan
from methods import layout
from methods.layout import PIECE_BITS, djb2
from methods.plan import Partition, Unit, fuse_pieces, slices
from tests.conftest import run_module
from tests.test_methods import BERT, _context, _free_port, _spawn

# BytePS's Hash_DJB2(key) (byteps/common/global.cc), printed by that C++ function
DJB2 = {0: 177621, 1: 177622, 65536: 210653553582, 65537: 210653553583,
        131072: 6951369072467, 1048576: 229395065828532, 25755648: 7570086361971695,
        18446744073709551615: 12896208346501881852}
DJB2_CPP = r"""
#include <cstdint>
#include <cstdio>
#include <string>
uint64_t Hash_DJB2(uint64_t key) {
  std::string s = std::to_string(key);
  const char* str = s.c_str();
  uint64_t hash = 5381;
  int c;
  while ((c = *str)) { hash = ((hash << 5) + hash) + c; str++; }
  return hash;
}
int main() {
  unsigned long long key;
  while (scanf("%llu", &key) == 1) printf("%llu\n", (unsigned long long)Hash_DJB2(key));
}
"""


def _plan(*overrides: str) -> dict:
    cfg = config.load(["run.force=true", *overrides], simulate=True)
    model = plan.tensors(cfg.model)
    return plan.describe(cfg, model, plan.plan_of(cfg, model))


def test_hash_is_bytepss_djb2_of_the_decimal_key() -> None:
    assert {k: djb2(k) for k in DJB2} == DJB2


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler to run BytePS's hash")
def test_every_key_of_resnet50_hashes_as_bytepss_cpp(tmp_path) -> None:
    (tmp_path / "djb2.cc").write_text(DJB2_CPP)
    subprocess.run(["g++", "-O1", "-o", str(tmp_path / "djb2"), str(tmp_path / "djb2.cc")],
                   check=True)
    keys = [p["key"] for u in _plan("model=resnet50", "method=wfbp_ps", "cluster.nodes=4")
            ["units"] for p in u["partitions"]]
    out = subprocess.run([str(tmp_path / "djb2")], input="\n".join(map(str, keys)),
                         capture_output=True, text=True, check=True)
    assert [int(h) for h in out.stdout.split()] == [djb2(k) for k in keys]
    assert len(set(keys)) == len(keys) > 161  # unique; tensors over 1,024,000 elements cut


@pytest.mark.parametrize("servers, hashed", [(2, 1.06), (4, 1.43), (8, 1.62)])
def test_resnet50_server_load_is_the_studys(servers: int, hashed: float) -> None:
    # conf/reference/README.md: BytePS's djb2 loads the busiest server 1.06, 1.43, 1.62 x the mean
    shape = ["model=resnet50", "method=wfbp_ps", f"cluster.nodes={servers}"]
    assert _plan(*shape)["ps"]["busiest_over_mean"] == pytest.approx(hashed, abs=0.005)
    balanced = _plan(*shape, "method.transport.assignment=balanced")
    assert balanced["ps"]["busiest_over_mean"] < 1.05


def test_the_plan_viewer_prints_and_writes_the_plan(tmp_path) -> None:
    out = run_module("harness.plan", "model=resnet50", "method=wfbp_ps", "cluster.nodes=4",
                     "--json", str(tmp_path / "plan.json"))
    assert out.returncode == 0, out.stderr
    assert "busiest/mean = 1.43" in out.stdout
    assert "net.conv1.weight" in out.stdout  # tensor names, input side last
    # the worker's pipeline: a thread per stage (nodes of one worker: the root path's)
    assert "PS pipeline (root path, 1 worker(s) a node)" in out.stdout, out.stdout
    assert [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ps-")] \
        == ["ps-reduce", "ps-copy-out", "ps-push", "ps-pull", "ps-copy-in", "ps-broadcast"]
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["cluster"]["servers"] == 4 and len(data["units"]) == 161
    assert data["units"][-1]["priority"] == 0  # the input side goes first under priority
    one_node = run_module("harness.plan", "model=resnet50_small", "method=bsp_ps")
    assert "0 parameter server(s)" in one_node.stdout, one_node.stdout
    assert "all-reduced in the node" in one_node.stdout
    assert "PS pipeline" not in one_node.stdout  # no servers: no pipeline
    scatter = run_module("harness.plan", "model=bert_tiny", "method=bytescheduler_ps",
                         "cluster.nodes=2", "cluster.workers_per_node=2")
    assert "PS pipeline (scatter path, 2 worker(s) a node)" in scatter.stdout, scatter.stdout
    assert "ps-gather     per partition, in landing order" in scatter.stdout
    assert "root's landing order" in scatter.stdout  # the node's one order, said


def test_plan_viewer_bad_input_is_one_line() -> None:
    out = run_module("harness.plan", "method=wfbp_ps", "method.transport.assignment=rand")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "assignment='rand' is unknown" in out.stderr


@pytest.mark.parametrize("shape, limit, rows", [
    ((30522, 1024), 4_000_000, [3815] * 6 + [3816] * 2),  # BERT-Large's word embeddings
    ((30522, 768), 4_000_000, [5087] * 6), ((10,), 4, [3, 3, 4]), ((7, 3), 5, [1] * 3 + [2] * 2),
    ((9, 1_000_000), 2_500_000, [2, 2, 2, 3]), ((1, 100), 30, [1]), ((5, 2), 10, [5])])
def test_bytescheduler_slices_are_its_near_equal_rows(shape, limit, rows) -> None:
    # ByteScheduler: ceil(numel / limit) slices (at most one per row), rows // k rows each,
    # the last rows % k one more
    numel, row = torch.Size(shape).numel(), torch.Size(shape[1:]).numel()
    cut = slices(numel, shape[0], limit)
    assert [(e - s) // row for s, e in cut] == rows
    assert cut[0][0] == 0 and cut[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(cut, cut[1:]))


def test_partition_planner_cuts_only_what_exceeds_the_partition() -> None:
    # BERT-Base's word embeddings: 6 slices of 5087 rows; the other tensors stay whole
    sizes, rows = [768, 30522 * 768, 2 * 768], [768, 30522, 2]
    units = Partition(partition_elements=4_000_000).plan(sizes, rows=rows)
    assert [u.numel for u in units] == [768] + [5087 * 768] * 6 + [2 * 768]
    assert [u.params for u in units] == [(0,)] + [(1,)] * 6 + [(2,)]


def test_horovod_fusion_packs_consecutive_pieces_up_to_the_threshold() -> None:
    assert fuse_pieces([4, 4, 4, 9, 1], 8) == [[0, 1], [2], [3], [4]]
    assert fuse_pieces([4, 4, 4], 0) == [[0], [1], [2]]
    assert fuse_pieces([3, 3, 3], 100) == [[0, 1, 2]]


# -- node-local aggregation with real processes ------------------------------------------

def _pushes_rank(rank: int, world: int, local: bool, port: int, out: str) -> None:
    """2 nodes x 2 workers + 2 servers train bsp_ps 3 steps; servers say who pushed."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=dt.timedelta(seconds=120))
    ctx = _context(rank, world, 4, 2)
    if rank >= 4:
        server = methods.serve(num_workers=4)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(dict(server.pushes), f)
    else:
        cfg = config.load([*BERT, "method=bsp_ps", "cluster.nodes=2",
                           "cluster.workers_per_node=2",
                           f"method.transport.local_reduce={str(local).lower()}",
                           "method.transport.partition_bytes=65536", "verify.steps=3",
                           "run.force=true"])
        _, _, described = train(cfg, ctx)
        methods.stop_servers(num_workers=4)
        if rank == 0:
            with open(f"{out}.plan", "w") as f:
                json.dump(described, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("local, pushers", [(True, ["0", "2"]), (False, ["0", "1", "2", "3"])])
def test_servers_receive_one_push_per_node_per_partition(tmp_path, local: bool,
                                                         pushers: list[str]) -> None:
    out = str(tmp_path / "pushes")
    assert _spawn(_pushes_rank, 6, local, _free_port(), out, timeout_s=300) == [0] * 6
    described = json.loads(open(f"{out}.plan").read())
    pushes: dict[str, int] = {}
    for server in (4, 5):
        for rank, n in json.loads(open(f"{out}.{server}").read()).items():
            pushes[rank] = pushes.get(rank, 0) + n
    assert sorted(pushes) == pushers  # with aggregation, only each node's first worker
    # every pusher sends every partition once per step (3 steps)
    assert set(pushes.values()) == {3 * described["partitions"]}
    assert described["partitions"] > 2 and described["nodes"] == (2 if local else 4)


def test_one_node_starts_no_server_process(tmp_path) -> None:
    out = run_module("harness.run", "model=bert_tiny", "method=wfbp_ps",
                     "cluster.workers_per_node=2", "run.repeats=1", "run.warmup_iters=1",
                     "run.timed_iters=3", f"results_dir={tmp_path}", timeout=300)
    assert out.returncode == 0, out.stderr
    row = results.load(tmp_path).iloc[0]
    assert (row.status, row.world_size, row.servers) == ("ok", 2, 0)
    described = json.loads(row.plan_json)
    assert described["servers"] == 0 and described["nodes"] == 1


def test_node_groups_are_made_only_where_nodes_share_workers() -> None:
    timeout = dt.timedelta(seconds=1)
    assert node_groups(4, 1, timeout=timeout) is None  # a worker per node
    assert node_groups(2, 2, timeout=timeout) is None  # one node: the worker group serves


def test_a_tensor_cut_into_more_pieces_than_keys_hold_is_refused() -> None:
    units = [Unit(0, (1 << PIECE_BITS) + 1, (0,))]
    with pytest.raises(ValueError, match="cut into 65537 partitions.*partition_bytes"):
        layout.keys(units, layout.cut(units, 1), ["w"])
    assert len(layout.keys(units, layout.cut(units, 2), ["w"])[0]) == (1 << 15) + 1
