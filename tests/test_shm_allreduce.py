"""The shared-memory gradient all-reduce: real worker processes, real shared segments."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch

from conftest import QUICK, output, read_rows, read_run, run_train, spawn
from ddpscale.config import ConfigError
from ddpscale.distributed import host_store, process_group, resolve_comm_hook
from ddpscale.placement import Placement, Rendezvous
from ddpscale.shm_allreduce import SharedMemoryAllreduce, supported

pytestmark = pytest.mark.skipif(not supported(), reason="needs Linux on x86-64 with a writable /dev/shm")

# (numel, dtype): one element, exactly one chunk, several chunks with a ragged tail
CASES = [(1, torch.float32), (1024, torch.float32), (5000, torch.float32),
         (3001, torch.float64), (2500, torch.bfloat16)]


def _average(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    placement = Placement(rank, rank, world, world, 0)
    with process_group(placement, "gloo", Rendezvous("127.0.0.1", port, 30)):
        shm = SharedMemoryAllreduce(rank, world, timeout_s=30, chunk_bytes=4096)  # tiny chunks
        dist.barrier()  # rank 0 has unlinked the name by now
        name_left = Path(shm.path).exists()
        results = []
        for numel, dtype in CASES:
            for round_ in range(3):  # reuse both slot sets, more than once
                g = torch.Generator().manual_seed(1000 * rank + round_)
                mine = torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
                expected = mine.clone().div_(world)
                dist.all_reduce(expected)  # the process group's answer
                got = shm.average_(mine.clone())
                results.append({
                    "case": f"{numel} {dtype} round {round_}",
                    "max_error": (got.double() - expected.double()).abs().max().item(),
                    "scale": expected.double().abs().max().item(),
                    "bits": hashlib.sha1(got.view(torch.uint8).numpy().tobytes()).hexdigest(),
                })
        gathered = [None] * world
        dist.all_gather_object(gathered, {"results": results, "name_left": name_left})
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)


@pytest.mark.parametrize("world", [2, 3])
def test_average_matches_the_process_group_and_is_identical_on_every_rank(tmp_path, world):
    out = tmp_path / "avg.json"
    store = host_store("127.0.0.1", None, world, 30)
    spawn(_average, (world, store.port, str(out)), world)
    ranks = json.loads(out.read_text())
    for r in ranks:
        assert not r["name_left"], "the segment's name is gone once all ranks mapped it"
        for res in r["results"]:
            tol = 1e-2 if "bfloat16" in res["case"] else 1e-6
            assert res["max_error"] <= tol * max(res["scale"], 1), res["case"]
    for res in zip(*(r["results"] for r in ranks)):
        assert len({x["bits"] for x in res}) == 1, f"ranks differ: {res[0]['case']}"


def _late_peer(rank: int, port: int, out: str) -> None:
    placement = Placement(rank, rank, 2, 2, 0)
    with process_group(placement, "gloo", Rendezvous("127.0.0.1", port, 30)):
        shm = SharedMemoryAllreduce(rank, 2, timeout_s=1.5)
        if rank == 0:
            start = time.monotonic()
            try:
                shm.average_(torch.ones(10))
                message = "returned"
            except TimeoutError as err:
                message = str(err)
            with open(out, "w") as f:
                json.dump({"message": message, "seconds": time.monotonic() - start}, f)
        # rank 1 never contributes; both then leave through the group's barrier


def test_a_missing_peer_times_out_naming_it(tmp_path):
    out = tmp_path / "late.json"
    store = host_store("127.0.0.1", None, 2, 30)
    spawn(_late_peer, (store.port, str(out)), 2)
    result = json.loads(out.read_text())
    assert "no gradients from rank(s) [1]" in result["message"]
    assert "distributed.timeout_s=1.5" in result["message"]
    assert 1.5 <= result["seconds"] < 10


def _dead_peer(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    placement = Placement(rank, rank, 2, 2, 0)
    with process_group(placement, "gloo", Rendezvous("127.0.0.1", port, 30)):
        shm = SharedMemoryAllreduce(rank, 2, timeout_s=30)
        dist.barrier()
        if rank == 1:
            os._exit(0)  # gone without a word, as after SIGKILL
        start = time.monotonic()
        try:
            shm.average_(torch.ones(10))
            message = "returned"
        except RuntimeError as err:
            message = str(err)
        with open(out, "w") as f:
            json.dump({"message": message, "seconds": time.monotonic() - start}, f)
        os._exit(0)  # the group's closing barrier cannot meet rank 1 any more


def test_a_peer_that_died_ends_the_wait_at_once_instead_of_the_timeout(tmp_path):
    out = tmp_path / "dead.json"
    store = host_store("127.0.0.1", None, 2, 30)
    spawn(_dead_peer, (store.port, str(out)), 2)
    result = json.loads(out.read_text())
    assert "rank(s) [1] exited during the shared-memory all-reduce" in result["message"]
    assert result["seconds"] < 5  # not distributed.timeout_s=30


def _slow_peer(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    placement = Placement(rank, rank, 2, 2, 0)
    with process_group(placement, "gloo", Rendezvous("127.0.0.1", port, 30)):
        shm = SharedMemoryAllreduce(rank, 2, timeout_s=30)
        dist.barrier()
        if rank == 1:
            time.sleep(0.3)  # rank 0 arrives first and waits for this one
        shm.average_(torch.ones(10))
        waited = [None, None]
        dist.all_gather_object(waited, shm.waited_s)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(waited, f)


def test_waiting_for_a_slower_rank_is_counted_on_the_rank_that_waits(tmp_path):
    out = tmp_path / "waited.json"
    store = host_store("127.0.0.1", None, 2, 30)
    spawn(_slow_peer, (store.port, str(out)), 2)
    first, late = json.loads(out.read_text())
    assert first >= 0.25 and late < 0.1


def _no_segment(rank: int, port: int, comm_hook: str, failure: str, shm_dir: str, out: str) -> None:
    """Workers whose rank 0 cannot make the segment: /dev/shm is full (posix_fallocate
    fails after the file exists) or refuses new files (mkstemp fails)."""
    import errno
    import os
    import tempfile

    from ddpscale import shm_allreduce
    from ddpscale.config import DistributedConfig
    from ddpscale.distributed import wrap_ddp
    from ddpscale.placement import WorkerContext

    shm_allreduce.SHM_DIR = Path(shm_dir)
    if failure == "full":
        def fallocate(*_args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.posix_fallocate = fallocate
    else:
        def mkstemp(*_args, **_kwargs):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        tempfile.mkstemp = mkstemp
    placement = Placement(rank, rank, 2, 2, 0)
    ctx = WorkerContext(placement, torch.device("cpu"), "gloo", "spawn")
    with process_group(placement, "gloo", Rendezvous("127.0.0.1", port, 30)):
        try:
            model = wrap_ddp(torch.nn.Linear(4, 2), ctx, DistributedConfig(num_gpus=2, comm_hook=comm_hook))
        except shm_allreduce.SegmentUnavailable as err:
            result = f"raised: {err}"
        else:
            model(torch.full((3, 4), float(rank))).sum().backward()  # through gloo
            result = model.grad_allreduce
        results = [None, None]
        torch.distributed.all_gather_object(results, result)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)


@pytest.mark.parametrize("failure,says", [("full", "[Errno 28] no 0.02 MiB segment in {}: No space left on device"),
                                          ("refused", "[Errno 13] no 0.02 MiB segment in {}: Permission denied")])
@pytest.mark.parametrize("comm_hook", ["auto", "shm"])
def test_no_segment_falls_back_or_fails_on_every_rank_alike(tmp_path, comm_hook, failure, says):
    """auto falls back to the process group (run.json says none); an explicit shm fails
    on every rank with rank 0's reason; either way no half-made segment is left."""
    out, shm_dir = tmp_path / "results.json", tmp_path / "shm"
    shm_dir.mkdir()
    store = host_store("127.0.0.1", None, 2, 30)
    spawn(_no_segment, (store.port, comm_hook, failure, str(shm_dir), str(out)), 2)
    expected = "none" if comm_hook == "auto" else f"raised: {says.format(shm_dir)}"
    assert json.loads(out.read_text()) == [expected, expected]
    assert list(shm_dir.iterdir()) == []


@pytest.mark.parametrize("name,device,world,nodes,expected", [
    ("auto", "cpu", 2, 1, "shm"),
    ("auto", "cpu", 1, 1, "none"),  # nothing to reduce
    ("auto", "cpu", 4, 2, "none"),  # shared memory does not cross machines
    ("auto", "cuda", 2, 1, "none"),  # NCCL's own intra-node transport
    ("shm", "cpu", 2, 1, "shm"),
    ("none", "cpu", 2, 1, "none"),
    ("bf16", "cuda", 2, 1, "bf16"),
])
def test_auto_picks_shared_memory_only_for_cpu_workers_on_one_node(name, device, world, nodes, expected):
    assert resolve_comm_hook(name, device, world, nodes) == expected


@pytest.mark.parametrize("device,nodes,says", [("cuda", 1, "CUDA workers"), ("cpu", 2, "2 nodes")])
def test_explicit_shm_where_it_cannot_work_is_refused(device, nodes, says):
    with pytest.raises(ConfigError, match=f"comm_hook=shm needs CPU workers on one node.*{says}"):
        resolve_comm_hook("shm", device, 4, nodes)


@pytest.mark.slow
def test_training_through_shared_memory_is_bit_identical_to_gloo(tmp_path):
    """At 2 workers both paths add the same two halves: same weights to the last bit."""
    runs = {}
    for hook in ("shm", "none"):
        proc = run_train(*QUICK, "distributed.num_gpus=2", f"distributed.comm_hook={hook}",
                         f"hydra.run.dir={tmp_path}/{hook}")
        assert proc.returncode == 0, output(proc)
        runs[hook] = read_run(tmp_path / hook)
        assert runs[hook]["grad_allreduce"] == hook
        assert runs[hook]["replicas_identical"]
        assert read_rows(tmp_path / hook)[-1]["comm_hook"] == hook
    assert runs["shm"]["replica_checksums"] == runs["none"]["replica_checksums"]
