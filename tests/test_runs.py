"""Whole runs as a user starts them: a multirun, two nodes over loopback, a crashing worker."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import QUICK, REPO, output, read_rows, read_run, run_train
from ddpscale.config import CNNConfig, Config, DataConfig, DistributedConfig, SGDConfig, TrainConfig
from ddpscale.distributed import check_nodes_agree, free_port, usable_cores
from ddpscale.placement import SPAWN
from ddpscale.workers import _notices

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """A sweep of a 1-worker and a 2-worker job, which the next two tests read. Its model fails
    if Python's cycle collector is off while it trains, and the script exits 3 if it is still
    off in the sweep process after the jobs: train.py turns it off for the imports; left off,
    a long run or sweep keeps every cycle."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    proc = run_train(*QUICK, "train.epochs=1", "model.name=collecting_cnn", "distributed.num_gpus=1,2",
                     f"hydra.sweep.dir={sweep_dir}", "-m", script="tests/crashing_train.py")
    return proc, sweep_dir


def test_multirun_gives_one_complete_run_per_job(sweep, tmp_path):
    proc, sweep_dir = sweep
    assert proc.returncode == 0, output(proc)
    runs = sorted(p.parent for p in sweep_dir.rglob("results.csv"))
    assert [p.name for p in runs] == ["0", "1"]
    assert [read_rows(p)[0]["world_size"] for p in runs] == ["1", "2"]
    assert all(read_run(p)["status"] == "completed" for p in runs)
    assert all(read_run(p)["usable_cores"] == len(os.sched_getaffinity(0)) for p in runs)  # for the analysis
    assert "2 run(s), 2 completed" in output(proc)
    # The sweep lists its jobs first, so that an analysis names one a stopped sweep never ran
    # (it left no directory and, before, no trace: the report showed the jobs that ran as the sweep)
    from multirun_analysis.report import write_report
    from multirun_analysis.sweep import analyse

    jobs = json.loads((sweep_dir / "sweep_jobs.json").read_text())["jobs"]
    assert jobs == [read_run(p)["overrides"] for p in runs]
    assert analyse([sweep_dir]).missing.empty
    tmp_path = shutil.copytree(sweep_dir, tmp_path / sweep_dir.name)  # the next test reads the sweep too
    shutil.rmtree(tmp_path / runs[1].name)
    analysis = analyse([tmp_path])
    assert analysis.missing.to_dict("records") == [
        {"sweep": str(tmp_path), "job": 1, "overrides": " ".join(jobs[1])}]
    write_report(analysis, tmp_path / "analysis")
    report = (tmp_path / "analysis" / "report.md").read_text()
    assert f"**1 job of a sweep never ran** (job 1 of {tmp_path}: {' '.join(jobs[1])})" in report
    assert f"| {tmp_path.name} job 1 | never ran | no run directory holds this job" in report


def test_the_cycle_collector_runs_in_every_worker_and_in_the_sweep_process(sweep):
    proc, sweep_dir = sweep
    assert proc.returncode == 0, output(proc)  # 3: still off in the sweep process after it
    assert [read_run(sweep_dir / job)["status"] for job in ("0", "1")] == ["completed", "completed"]
    assert {read_rows(sweep_dir / job)[0]["model"] for job in ("0", "1")} == {"collecting_cnn"}


def test_two_nodes_over_loopback_form_one_world_of_four(tmp_path):
    port = free_port()
    common = [*QUICK, "train.epochs=1", "distributed.num_gpus=2", "distributed.num_nodes=2",
              "distributed.master_addr=127.0.0.1", f"distributed.master_port={port}"]
    nodes = [
        subprocess.Popen(
            [sys.executable, "train.py", *common, f"distributed.node_id={k}",
             f"hydra.run.dir={tmp_path}/node{k}"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for k in (1, 0)  # node 1 first: it waits for node 0's store
    ]
    logs = [n.communicate(timeout=240)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], logs
    rows = read_rows(tmp_path / "node0")
    assert (rows[0]["world_size"], rows[0]["num_nodes"], rows[0]["num_gpus"]) == ("4", "2", "2")
    assert rows[0]["global_batch_size"] == str(32 * 4)
    assert int(rows[0]["val_count"]) == 256
    assert read_run(tmp_path / "node0")["replicas_identical"]
    # Only global rank 0 writes results.
    assert not (tmp_path / "node1" / "results.csv").exists()
    assert not (tmp_path / "node1" / "run.json").exists()
    # The node that holds rank 0 says where the run's files are; the other has none to name.
    assert f"run completed: results.csv and run.json are in {tmp_path}/node0" in logs[1]
    assert "run completed" not in logs[0]
    # one thread per worker already: no train.threads could share the cores better (there were
    # 4 threads on 2 cores, and a notice to give every node train.threads=1, as they had)
    assert "notice: nodes" not in logs[1], logs[1]


def test_a_worker_failing_on_node_1_is_what_node_0_records(tmp_path):
    """Rank 1, node 1's only worker, raises; rank 0 then fails with gloo's "Connection closed
    by peer". run.json (node 0's) recorded that symptom, so the cause was only on node 1's
    console; as under torchrun, it must name rank 1's error, with rank 1's traceback."""
    common = [*QUICK, "train.epochs=1", "train.sync_probe_steps=0", "model.name=crashing_cnn",
              "distributed.num_gpus=1", "distributed.num_nodes=2", "distributed.master_addr=127.0.0.1",
              f"distributed.master_port={free_port()}"]
    start = time.monotonic()
    nodes = [
        subprocess.Popen(
            [sys.executable, "tests/crashing_train.py", *common, f"distributed.node_id={k}",
             f"hydra.run.dir={tmp_path}/node{k}"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "CRASH_RANK": "1"},
        )
        for k in (1, 0)
    ]
    logs = [n.communicate(timeout=120)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [1, 1], logs
    assert time.monotonic() - start < 60
    run = read_run(tmp_path / "node0")
    assert run["status"] == "failed", run
    assert run["error"] == "rank 1 raised RuntimeError: injected failure on rank 1", logs
    assert 'raise RuntimeError(f"injected failure on rank {rank}")' in run["traceback"]
    assert "run failed: rank 1 raised RuntimeError: injected failure on rank 1" in logs[1]


def test_nodes_given_different_num_gpus_both_stop_at_once_naming_the_key(tmp_path):
    # The workers' rendezvous used to wait out distributed.timeout_s (60 s here) and blame master_addr.
    common = [*QUICK, "distributed.num_nodes=2", "distributed.master_addr=127.0.0.1",
              f"distributed.master_port={free_port()}"]
    start = time.monotonic()
    nodes = [
        subprocess.Popen(
            [sys.executable, "train.py", *common, f"distributed.node_id={k}", f"distributed.num_gpus={2 - k}",
             f"hydra.run.dir={tmp_path}/node{k}"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for k in (1, 0)
    ]
    logs = [n.communicate(timeout=120)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [2, 2], logs
    assert time.monotonic() - start < 30
    said = "the nodes were given different distributed.num_gpus (node 0: 2, node 1: 1)"
    assert all(said in log for log in logs) and not any("starting" in log for log in logs), logs
    assert said in read_run(tmp_path / "node0")["error"]


def test_nodes_given_different_settings_stop_before_training_naming_them(tmp_path):
    # Another optim.lr trained on silently; other epochs left node 0 waiting out timeout_s.
    common = [*QUICK, "distributed.num_nodes=2", "distributed.num_gpus=1", "distributed.master_addr=127.0.0.1",
              f"distributed.master_port={free_port()}"]
    nodes = [
        subprocess.Popen(
            [sys.executable, "train.py", *common, f"distributed.node_id={k}", f"optim.lr={(0.05, 0.02)[k]}",
             f"train.epochs={2 - k}", f"data.root={tmp_path}/data{k}", f"hydra.run.dir={tmp_path}/node{k}"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for k in (1, 0)
    ]
    logs = [n.communicate(timeout=120)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [2, 2], logs
    said = ("the nodes were given different settings: optim.lr (node 0: 0.05, node 1: 0.02), train.epochs "
            "(node 0: 2, node 1: 1); give every node the same overrides (only distributed.node_id differs)")
    assert all(said in log for log in logs) and not any("starting" in log for log in logs), logs
    assert read_run(tmp_path / "node0")["error"] == said  # data.root is each node's own: not named


def test_nodes_on_one_machine_whose_threads_exceed_its_cores_get_a_notice(tmp_path):
    # each node gave its workers the whole machine's cores: two 1-worker nodes on 2 cores
    # ran 4 threads and trained several times slower, without a word
    port, cores = free_port(), len(os.sched_getaffinity(0))
    common = [*QUICK, "train.epochs=1", "data.train_size=64", "data.val_size=64", "distributed.num_gpus=1",
              "distributed.num_nodes=2", "distributed.master_addr=127.0.0.1", f"distributed.master_port={port}"]
    nodes = [subprocess.Popen([sys.executable, "train.py", *common, f"distributed.node_id={k}",
                               f"train.threads={threads}", f"hydra.run.dir={tmp_path}/node{k}"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k, threads in ((0, cores), (1, 1))]
    logs = [n.communicate(timeout=240)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], logs
    assert (f"notice: nodes 0, 1 run on this one machine ({socket.gethostname()}): {cores + 1} CPU threads "
            f"in all on {cores} core(s), which take turns and slow every step; give every node "
            f"train.threads={max(1, cores // 2)} (the cores // the 2 workers here)") in logs[0], logs[0]
    assert "notice: nodes" not in logs[1]  # node 0 says it, as every notice comes from global rank 0


def test_a_joining_node_waits_for_this_jobs_store_not_the_previous_one():
    # In a sweep with a fixed master_port, node 0 may still be closing the last job's store
    # (every node has read it) when node 1 starts the next job's check.
    port = free_port()
    node1 = DistributedConfig(num_gpus=1, num_nodes=2, node_id=1, master_addr="127.0.0.1",
                              master_port=port, timeout_s=2)
    previous = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    settings = '{"distributed.num_gpus": 1}'
    previous.set("ddpscale/settings/node0", settings)
    previous.set("ddpscale/settings/node1", settings)
    previous.add("ddpscale/settings/read", 2)
    with pytest.raises(RuntimeError, match="node 1: no rendezvous at distributed.master_addr:master_port"):
        check_nodes_agree(None, "127.0.0.1", port, node1, {"distributed.num_gpus": 1})
    del previous
    this_job = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    this_job.set("ddpscale/settings/node0", settings)
    check_nodes_agree(None, "127.0.0.1", port, node1, {"distributed.num_gpus": 1})  # joins, agrees
    assert this_job.get("ddpscale/settings/node1") == settings.encode()


def test_a_node_started_before_node_0_says_it_waits_in_one_line(tmp_path):
    proc = run_train(*QUICK, "distributed.num_gpus=1", "distributed.num_nodes=2", "distributed.node_id=1",
                     "distributed.master_addr=127.0.0.1", f"distributed.master_port={free_port()}",
                     "distributed.timeout_s=3", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 1
    assert output(proc).count("node 1: waiting for node 0 at 127.0.0.1:") == 1
    assert "frame #" not in output(proc), "each failed TCPStore connection printed a C++ stack"
    assert "node 1: no rendezvous at distributed.master_addr:master_port" in output(proc)


def test_missing_node_fails_after_timeout_naming_the_rendezvous(tmp_path):
    port = free_port()
    start = time.monotonic()
    proc = run_train(*QUICK, "distributed.num_gpus=1", "distributed.num_nodes=2",
                     "distributed.master_addr=127.0.0.1", f"distributed.master_port={port}",
                     "distributed.timeout_s=3", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    assert f"node 0: waiting for the other node(s) at 127.0.0.1:{port}" in output(proc)
    run = read_run(tmp_path)
    assert run["status"] == "failed" and "node(s) [1] did not reach the rendezvous" in run["error"]
    assert f"127.0.0.1:{port}" in run["error"] and "master_addr" in run["error"]


def test_a_sweep_on_a_node_other_than_0_reports_its_failed_jobs(tmp_path):
    """Node 1 writes no run.json (rank 0's node does): its jobs count by what they returned."""
    proc = run_train(*QUICK, "distributed.num_gpus=1", "distributed.num_nodes=2", "distributed.node_id=1",
                     "distributed.master_addr=127.0.0.1", f"distributed.master_port={free_port()}",
                     "distributed.timeout_s=3", f"hydra.sweep.dir={tmp_path}", "-m")
    assert proc.returncode == 1, output(proc)
    assert "1 of 1 run(s) did not complete" in output(proc)
    assert not list(tmp_path.rglob("run.json"))


def test_a_crashing_worker_ends_the_run_marked_failed(tmp_path):
    temp = tmp_path / "tmp"  # the job's temp directory, to see what the failure leaves there
    temp.mkdir()
    start = time.monotonic()
    proc = run_train(*QUICK, "model.name=crashing_cnn", "distributed.num_gpus=2", "train.sync_probe_steps=0",
                     "train.epochs=3", f"hydra.run.dir={tmp_path}/run", script="tests/crashing_train.py",
                     env={"CRASH_EPOCH": "2", "CRASH_STEPS_PER_EPOCH": "8", "TMPDIR": str(temp)})
    assert proc.returncode == 1, output(proc)
    assert time.monotonic() - start < 60
    run = read_run(tmp_path / "run")
    assert run["status"] == "failed"
    assert "injected failure on rank 1" in run["error"]
    assert [r["epoch"] for r in read_rows(tmp_path / "run")] == ["1"], "the finished epoch is kept"
    assert not list(temp.glob("pytorch-errorfile-*")), "torch's traceback pickles are deleted"


@pytest.mark.parametrize("workers", [1, 2])
def test_a_config_error_in_a_spawned_worker_exits_2_naming_it(tmp_path, workers):
    # as ddpscale's checks do in the job process and under torchrun; it was exit 1, "run failed:
    # worker 0 raised ddpscale.config.ConfigError: ..."
    proc = run_train(*QUICK, "data.name=tuple_in_workers", f"distributed.num_gpus={workers}", "train.epochs=1",
                     f"hydra.run.dir={tmp_path}/run", script="tests/crashing_train.py")
    assert proc.returncode == 2, output(proc)
    said = ("error: data=tuple_in_workers's loader returned a tuple for the training split; it must "
            "return ddpscale.data.Split(images, labels)")
    assert said in output(proc) and "Traceback" not in output(proc)
    run = read_run(tmp_path / "run")
    assert run["status"] == "failed" and run["error"].startswith("data=tuple_in_workers's loader returned")


def test_a_worker_error_of_several_lines_is_recorded_by_its_first(tmp_path):
    # run.json kept the last line: "worker 0 raised see the lines above"
    proc = run_train(*QUICK, "model.name=crashing_cnn", "distributed.num_gpus=1", "train.epochs=1",
                     f"hydra.run.dir={tmp_path}/run", script="tests/crashing_train.py",
                     env={"CRASH_RANK": "0", "CRASH_HOW": "multiline"})
    assert proc.returncode == 1, output(proc)
    assert read_run(tmp_path / "run")["error"] == "worker 0 raised RuntimeError: injected failure on rank 0"


@pytest.mark.parametrize("workers, rank", [(1, 0), (2, 0), (2, 1)])
def test_a_worker_calling_sys_exit_0_fails_the_run_saying_so(tmp_path, workers, rank):
    # It was recorded as completed, with no results.csv, and the sweep counted it so; with 2
    # workers the other rank blamed the out-of-memory killer.
    proc = run_train(*QUICK, "model.name=crashing_cnn", f"distributed.num_gpus={workers}", "train.epochs=1",
                     "train.sync_probe_steps=0", f"hydra.run.dir={tmp_path}/run", script="tests/crashing_train.py",
                     env={"CRASH_RANK": str(rank), "CRASH_HOW": "exit0"})
    assert proc.returncode == 1, output(proc)
    run = read_run(tmp_path / "run")
    assert run["status"] == "failed"
    assert f"rank {rank}: the training code called sys.exit(0) before the run finished" in run["error"]
    assert "out-of-memory" not in output(proc)


def test_a_worker_leaving_with_exit_code_0_unasked_fails_the_run(tmp_path):
    # os._exit(0) raises nothing to catch: the job process sees rank 0 gone without its summary.
    proc = run_train(*QUICK, "model.name=crashing_cnn", "distributed.num_gpus=1", "train.epochs=1",
                     f"hydra.run.dir={tmp_path}/run", script="tests/crashing_train.py",
                     env={"CRASH_RANK": "0", "CRASH_HOW": "os_exit0"})
    assert proc.returncode == 1, output(proc)
    run = read_run(tmp_path / "run")
    assert run["status"] == "failed" and "worker 0 exited with code 0 before its run finished" in run["error"]


def test_training_that_diverges_stops_after_that_epoch_marked_failed(tmp_path):
    # A nan loss was a completed run, exit 0, which trained on in nan to its last epoch.
    # The hint named only optim.lr, though the model or half precision can make the nan too.
    proc = run_train(*QUICK, "distributed.num_gpus=2", "train.epochs=3", "optim.lr=1e10", "train.precision=bf16",
                     f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 1, output(proc)
    run = read_run(tmp_path / "run")
    assert run["status"] == "failed"
    assert ("training diverged in epoch 1: the weights are no longer finite (train_loss nan); usually the "
            "steps are too large: try a smaller optim.lr (it is 1e+10); if that diverges too, look for a nan "
            "or inf made in model=cnn's forward (a log or a division by 0), or train.precision=fp32 (it is "
            "bf16)") in run["error"]
    assert [(r["epoch"], r["train_loss"]) for r in read_rows(tmp_path / "run")] == [("1", "nan")]


def test_a_model_with_fewer_outputs_than_classes_fails_naming_data_num_classes(tmp_path):
    # It failed in every worker with torch's "IndexError: Target 9 is out of bounds."
    proc = run_train(*QUICK, "model.name=short_cnn", "distributed.num_gpus=2", "train.epochs=1",
                     f"hydra.run.dir={tmp_path}/run", script="tests/crashing_train.py")
    assert proc.returncode == 1, output(proc)
    run = read_run(tmp_path / "run")
    assert run["status"] == "failed"
    assert ("the model returned logits of shape (32, 9) for a batch of 32; the loss needs logits of shape "
            "(32, 10), one score per class; model=short_cnn must return one tensor with data.num_classes=10 "
            "outputs per example (data=synthetic): size its last layer") in run["error"]
    assert "out of bounds" not in output(proc)


def test_a_model_with_a_parameter_its_forward_never_uses_fails_naming_it(tmp_path):
    # DDP failed at the second step, and run.json kept the last line of its message:
    # "worker 0 raised In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG ..."
    proc = run_train(*QUICK, "model.name=unused_layer_cnn", "distributed.num_gpus=2", "train.epochs=1",
                     f"hydra.run.dir={tmp_path}/run", script="tests/crashing_train.py")
    assert proc.returncode == 1, output(proc)
    assert ("the model's parameters spare.weight, spare.bias got no gradient in the first step, and DDP "
            "needs one for every parameter that requires it; use them in forward, or freeze them") \
        in read_run(tmp_path / "run")["error"]


def test_a_failed_job_does_not_stop_the_sweep(tmp_path):
    proc = run_train(*QUICK, "train.epochs=1", "model.name=crashing_cnn,cnn",
                     "distributed.num_gpus=2", f"hydra.sweep.dir={tmp_path}", "-m",
                     script="tests/crashing_train.py")
    assert proc.returncode == 1
    text = output(proc)
    assert "1 of 2 run(s) did not complete" in text and "model.name=crashing_cnn" in text
    failed, done = read_run(tmp_path / "0"), read_run(tmp_path / "1")
    assert failed["status"] == "failed" and done["status"] == "completed"
    assert len(read_rows(tmp_path / "1")) == 1


def test_a_sweep_into_a_directory_of_failed_runs_counts_only_its_own_jobs(tmp_path):
    """A sweep directory whose runs all failed may be reused; its old runs are not the new sweep's."""
    typos = run_train(*QUICK, "optim.lr=-1,-2", f"hydra.sweep.dir={tmp_path}", "-m")
    assert typos.returncode == 1 and "2 of 2 run(s) did not complete" in output(typos)
    fixed = run_train(*QUICK, "train.epochs=1", "optim.lr=0.1", f"hydra.sweep.dir={tmp_path}", "-m")
    assert fixed.returncode == 0, output(fixed)
    assert "1 run(s), 1 completed (1 older run(s) in this directory not counted)" in output(fixed)
    assert read_run(tmp_path / "1")["status"] == "failed"  # left where it was


def test_a_job_leaves_no_file_descriptor_open_in_the_sweep_process(tmp_path):
    """A sweep runs its jobs in one process; one descriptor kept per job failed every job
    after about a thousand (ulimit -n) with 'Too many open files'."""
    from hydra import compose, initialize_config_dir

    from ddpscale.launch import run_job
    from ddpscale.worker import train

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=[*QUICK, "train.epochs=1", "data.train_size=64"])

    def job(name: str) -> bool:
        (tmp_path / name).mkdir()  # as Hydra makes it
        return run_job(cfg, train, tmp_path / name, []).ok

    open_now = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    assert job("0")  # the first loads what later jobs reuse
    before = open_now()
    assert job("1") and job("2") and job("3")
    assert open_now() == before


def _replicas_apart(ctx, cfg, out_dir) -> dict:
    """A worker whose ranks end with different weights (a spawned worker imports it by name)."""
    return {"replica_checksums": [f"rank{r}" for r in range(ctx.world_size)], "replicas_identical": False}


def test_replicas_that_end_apart_are_warned_about(tmp_path, caplog):
    # run.json said replicas_identical: false, and nothing else did.
    from hydra import compose, initialize_config_dir

    from ddpscale.launch import run_job

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=[*QUICK, "distributed.num_gpus=2"])
    with caplog.at_level("WARNING", logger="ddpscale"):
        assert run_job(cfg, _replicas_apart, tmp_path, []).ok
    assert ("warning: the replicas ended with different weights (run.json's replica_checksums): the ranks "
            "did not train one model, and results.csv describes rank 0's") in caplog.text


def test_a_run_whose_end_cannot_be_written_counts_as_failed_and_says_why(tmp_path):
    from ddpscale.launch import Outcome, _finish
    from ddpscale.results import RunRecord

    outcome = _finish(RunRecord(tmp_path / "gone"), Outcome("completed"))  # no such directory
    assert (outcome.status, outcome.exit_code, outcome.recorded) == ("failed", 1, False)
    assert f"its end could not be written to {tmp_path / 'gone' / 'run.json'}" in outcome.error
    full = RunRecord(tmp_path)
    full.path.with_suffix(f".tmp{os.getpid()}").symlink_to("/dev/full")
    outcome = _finish(full, Outcome("completed"))
    assert outcome.error == (f"its end could not be written to {full.path} (No space left on device), "
                             "which still says running"), "the path once"


def test_a_full_disk_is_named_and_leaves_no_temporary_file(tmp_path):
    # /dev/full answers every write with ENOSPC: the error said only "[Errno 28] No space
    # left on device", and run.json's write left an empty run.tmpNNNN behind.
    from ddpscale.results import ResultsWriter, RunRecord

    with pytest.raises(OSError, match=r"No space left on device: '/dev/full'"):
        ResultsWriter(Path("/dev/full")).append({"epoch": 1})
    record = RunRecord(tmp_path)
    tmp = record.path.with_suffix(f".tmp{os.getpid()}")
    tmp.symlink_to("/dev/full")  # where run.json's next write goes first
    with pytest.raises(OSError, match=f"No space left on device: '{record.path}'") as raised:
        record.start()
    assert raised.value.strerror == "No space left on device", "the name is not repeated"
    assert not list(tmp_path.iterdir())


def test_run_json_says_whether_the_checkout_had_uncommitted_edits(tmp_path):
    # run.json named the commit only: a run of edited code recorded the same git_commit as one
    # of the commit itself, with nothing to tell them apart
    from ddpscale.results import RunRecord, git_commit, git_dirty

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                       check=True, capture_output=True)

    assert git_dirty(tmp_path) is None  # not a checkout
    git("init", "-q")
    (tmp_path / "model.py").write_text("width = 1\n")
    git("add", "model.py")
    git("commit", "-q", "-m", "one")
    (tmp_path / "outputs").mkdir()  # untracked files are not edits
    assert git_commit(tmp_path) and git_dirty(tmp_path) is False
    (tmp_path / "model.py").write_text("width = 2\n")
    assert git_dirty(tmp_path) is True
    record = RunRecord(tmp_path / "outputs")
    record.start()
    assert record.read()["git_dirty"] is git_dirty(REPO / "src" / "ddpscale")


def _snapshot(directory) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_an_explicit_output_dir_that_holds_a_run_is_refused_and_left_as_it_was(tmp_path, mode):
    """Used twice, hydra.run.dir (or hydra.sweep.dir) would get a second run's rows appended
    to the first's results.csv; the second start is refused before anything is written."""
    sweep = ["optim.lr=0.01,0.1", "-m"] if mode == "sweep" else []
    first = run_train(*QUICK, "train.epochs=1", f"hydra.{mode}.dir={tmp_path}/out", *sweep)
    assert first.returncode == 0, output(first)
    before = _snapshot(tmp_path / "out")
    start = time.monotonic()
    again = run_train(*QUICK, "train.epochs=1", "optim.lr=0.5", f"hydra.{mode}.dir={tmp_path}/out",
                      *sweep[1:])
    assert again.returncode == 2, output(again)
    assert f"hydra.{mode}.dir={tmp_path}/out already holds run files" in output(again)
    assert f"give hydra.{mode}.dir a new directory" in output(again)
    assert "starting" not in output(again) and time.monotonic() - start < 30
    assert _snapshot(tmp_path / "out") == before  # run.json, results.csv, .hydra/, train.log


@pytest.mark.parametrize("mode", ["run", "sweep"])
@pytest.mark.parametrize("where", ["explicit", "default"])
def test_an_output_dir_that_cannot_be_created_is_named_in_one_line(tmp_path, mode, where):
    """A file where the directory should go: Hydra's own mkdir raised FileExistsError."""
    sweep = ["-m"] if mode == "sweep" else []
    default = "outputs" if mode == "run" else "multirun"
    (tmp_path / default).write_text("not a directory")
    given = [f"hydra.{mode}.dir={tmp_path / default}"] if where == "explicit" else []
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *QUICK, *given, *sweep],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, output(proc)
    assert output(proc).startswith(f"error: hydra.{mode}.dir cannot be created: [Errno"), output(proc)
    assert "Traceback" not in output(proc) and "starting" not in output(proc)


def test_a_run_that_failed_before_any_epoch_leaves_its_directory_free(tmp_path):
    """Fixing a typo and running again into the same hydra.run.dir just works."""
    typo = run_train(*QUICK, "optim.lr=0", f"hydra.run.dir={tmp_path}")
    assert typo.returncode == 2 and read_run(tmp_path)["status"] == "failed"
    fixed = run_train(*QUICK, "train.epochs=1", "optim.lr=0.1", f"hydra.run.dir={tmp_path}")
    assert fixed.returncode == 0, output(fixed)
    assert read_run(tmp_path)["status"] == "completed" and len(read_rows(tmp_path)) == 1
    log = (tmp_path / "train.log").read_text()  # Hydra appends: the typo's error stays above
    assert log.index("optim.lr=0.0 must be > 0") < log.index(
        "this directory held a run that failed before any epoch ended (optim.lr=0.0 must be > 0)")


def test_a_fixed_sweep_subdir_is_refused_before_any_job(tmp_path):
    proc = run_train(*QUICK, "train.epochs=1", "optim.lr=0.01,0.1", f"hydra.sweep.dir={tmp_path}/sweep",
                     "hydra.sweep.subdir=same", "-m", timeout=60)
    assert proc.returncode == 2, output(proc)
    assert ("error: hydra.sweep.subdir=same names one directory for every job of this sweep "
            "(optim.lr=0.01,0.1)") in output(proc)
    assert not (tmp_path / "sweep").exists()
    one_job = run_train(*QUICK, "train.epochs=1", "optim.lr=choice(0.1)", f"hydra.sweep.dir={tmp_path}/one",
                        "hydra.sweep.subdir=same", "-m")
    assert one_job.returncode == 0, output(one_job)
    assert read_run(tmp_path / "one" / "same")["status"] == "completed"


@pytest.mark.parametrize("launcher", [[], ["hydra/launcher=slurm_local"],
                                      ["hydra/launcher=slurm_local", "distributed.num_gpus=2"]])
def test_two_jobs_of_a_sweep_given_one_directory_keep_the_first_and_count_the_second(tmp_path, launcher):
    # a subdir that varies, but not with what the sweep varies. Under slurm_local the second
    # job's refusal was counted in its task's process only: "1 run(s), 1 completed", exit 0
    proc = run_train(*QUICK, "train.epochs=1", "optim.lr=0.01,0.1", f"hydra.sweep.dir={tmp_path}",
                     "hydra.sweep.subdir=seed${train.seed}", *launcher, "-m")
    assert proc.returncode == 1, output(proc)
    text = output(proc)
    assert f"{tmp_path}/seed0 already holds run files (results.csv, run.json)" in text
    assert "2 run(s), 1 completed" in text and "optim.lr=0.1 " in text
    rows, run = read_rows(tmp_path / "seed0"), read_run(tmp_path / "seed0")
    assert [r["lr"] for r in rows] == ["0.01"] and run["status"] == "completed"
    assert run["config"]["optim"]["lr"] == 0.01


def test_more_cpu_workers_than_cores_get_a_notice_and_still_train(tmp_path):
    """On a 2-core laptop num_gpus=4 works, but its figures say nothing about scaling."""
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *QUICK, "train.epochs=1",
                           "distributed.num_gpus=2", f"hydra.run.dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    assert proc.returncode == 0, output(proc)
    assert ("notice: 2 CPU workers share 1 core(s) here; past 1 worker(s) more cannot raise "
            "throughput") in output(proc)
    assert read_run(tmp_path)["status"] == "completed"
    assert "train.threads" not in output(proc) and "data.num_workers" not in output(proc)
    assert "data.download" not in output(proc)  # data=synthetic's own download: false


@pytest.mark.parametrize("threads,noticed", [(None, True), ("cores - 1", False)])
def test_dataloader_processes_count_towards_the_cores_the_workers_use(caplog, threads, noticed):
    """train.threads=null gives a worker every core, and its DataLoader processes take CPU beside it:
    the notice counted only train.threads x workers, and said nothing."""
    cores = usable_cores()
    if cores < 2:
        pytest.skip("needs 2 cores: one for the training thread, one for the DataLoader process")
    cfg = Config(model=CNNConfig(), data=DataConfig(name="synthetic", download=False, loader="dataloader", num_workers=1),
                 optim=SGDConfig(), distributed=DistributedConfig(),
                 train=TrainConfig(threads=None if threads is None else cores - 1))
    with caplog.at_level("INFO", logger="ddpscale"):
        _notices(cfg, "cpu", SPAWN)
    said = (f"notice: 1 worker(s) x ({cores} thread(s) + data.num_workers=1 DataLoader process(es)) is "
            f"{cores + 1} on {cores} core(s): they take turns, which slows every step; train.threads={cores - 1} "
            "leaves a core to each DataLoader process")
    assert (said in caplog.text) == noticed, caplog.text
    assert noticed or "notice" not in caplog.text


def test_dataloader_processes_beyond_the_cores_get_a_notice_and_still_train(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *QUICK, "train.epochs=1",
                           "data.loader=dataloader", "data.num_workers=1", f"hydra.run.dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    assert proc.returncode == 0, output(proc)
    assert ("notice: 1 worker(s) x (1 thread(s) + data.num_workers=1 DataLoader process(es)) is 2 on 1 core(s): "
            "they take turns, which slows every step; data.num_workers=0 loads the batches in the workers "
            "themselves, with 1 thread(s) each") in output(proc)
    assert read_run(tmp_path)["status"] == "completed"


def test_settings_that_cannot_work_as_they_seem_get_a_notice_and_still_train(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *QUICK, "train.epochs=1",
                           "train.threads=2", "data.num_workers=2", "distributed.comm_hook=shm",
                           "data.batch_size=600", "data.download=true", f"hydra.run.dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    assert proc.returncode == 0, output(proc)
    assert ("notice: train.threads=2 x 1 worker(s) is 2 threads on 1 core(s): they take turns"
            in output(proc))
    assert "notice: data.num_workers=2 is unused with data.loader=memory" in output(proc)
    assert "notice: distributed.comm_hook=shm has no other worker to all-reduce with" in output(proc)
    assert ("notice: data.download=true does nothing with data=synthetic (generated in memory, nothing to "
            "download)") in output(proc)
    assert ("notice: data.batch_size=600 is more than each of the 1 worker(s) gets (512 of 512 training "
            "examples): every step trains on a batch of 512, but results.csv will say batch_size=600"
            in output(proc))
    assert read_run(tmp_path)["status"] == "completed"
    assert read_run(tmp_path)["grad_allreduce"] == "none"
