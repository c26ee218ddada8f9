"""The same run under spawn, torchrun and submitit; signals, kills and neighbours."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import QUICK, REPO, alive, descendants, output, read_rows, read_run, run_train
from ddpscale.config import ConfigError
from ddpscale.distributed import check_master_addr, cpu_threads, free_port, host_store
from ddpscale.placement import detect_launcher, launch_environment_problem, slurm_task_cpus

pytestmark = pytest.mark.slow
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SAME_RUN = [*QUICK, "train.seed=7"]


SRUN_TASK = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_STEP_ID": "0"}


@pytest.mark.parametrize("env,launcher", [
    ({}, "spawn"),
    ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "torchrun"),
    (SRUN_TASK, "slurm"),
    ({**SRUN_TASK, "SLURM_NTASKS": "1"}, "spawn"),  # one task starts its workers itself
    # the batch script: sbatch runs it once, as PROCID 0 of all the job's tasks
    ({k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_ID"}, "spawn"),
    ({"SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_NTASKS": "2"}, "slurm"),
])
def test_the_launcher_is_read_from_the_environment(env, launcher):
    assert detect_launcher(env) == launcher


TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env,problem", [
    ({}, None),
    (TORCHRUN_ENV, None),
    ({**TORCHRUN_ENV, "TORCHELASTIC_RUN_ID": "x"}, None),
    ({k: v for k, v in TORCHRUN_ENV.items() if not k.startswith("MASTER")},
     "the environment holds RANK, LOCAL_RANK, WORLD_SIZE, so this process is taken for a torchrun "
     "worker, but MASTER_ADDR, MASTER_PORT are not set; start it with torchrun"),
    ({"TORCHELASTIC_RUN_ID": "x"}, "but RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"),
    ({**TORCHRUN_ENV, "RANK": "a"}, "but RANK='a' is not a whole number"),
])
def test_a_partial_torchrun_environment_is_named_with_the_fix(env, problem):
    found = launch_environment_problem(env)
    assert (found is None) if problem is None else (problem in found)


def test_a_partial_torchrun_environment_stops_train_py_at_once(tmp_path):
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "train.py", *QUICK, f"hydra.run.dir={tmp_path}/run"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("so that train.py starts its own workers")
    assert not (tmp_path / "run").exists()


def test_a_slurm_task_bound_to_its_own_cores_keeps_them_all():
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(2, task_cpus=cores) == cores  # bound: these cores are the task's own
    assert cpu_threads(2) == max(1, cores // 2)  # one mask for the node's workers: share it
    if cores > 1:
        assert cpu_threads(2, task_cpus=cores - 1) == cores // 2  # not bound: share
    assert cpu_threads(2, requested=3) == 3  # train.threads, as given
    assert slurm_task_cpus({"SLURM_CPUS_PER_TASK": "8"}) == 8 and slurm_task_cpus({}) is None


def test_the_rendezvous_host_is_checked_before_anything_waits_for_it(caplog):
    with pytest.raises(ConfigError, match="master_addr='badhost.invalid' does not resolve on .*; set it to node 0's "
                                          "host name or IP address, the same on every node"):
        check_master_addr("badhost.invalid", hosts_store=False)
    check_master_addr("127.0.0.1", hosts_store=True)
    check_master_addr("192.0.2.7", hosts_store=False)  # a documentation address: another node's
    assert not caplog.records
    check_master_addr("192.0.2.7", hosts_store=True)  # node 0 told to be a host it is not
    assert "master_addr='192.0.2.7' (192.0.2.7) is not an address of this machine" in caplog.text
    with pytest.raises(ConfigError, match="leave distributed.master_addr unset"):
        check_master_addr("192.0.2.7", hosts_store=True, single_node=True)  # nobody else could use it
    check_master_addr("127.0.0.1", hosts_store=True, single_node=True)
    with pytest.raises(ConfigError, match="check that distributed.master_addr names this machine"):
        host_store("192.0.2.7", free_port(), 2, timeout_s=1)  # the store cannot be reached there


def run_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob("run.json"))


def test_spawn_torchrun_and_submitit_give_the_same_results(tmp_path):
    scratch_before = set(Path(tempfile.gettempdir()).glob("ddpscale-rank*"))
    spawn = run_train(*SAME_RUN, "distributed.num_gpus=2", f"hydra.run.dir={tmp_path}/spawn")
    assert spawn.returncode == 0, output(spawn)
    torchrun = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc-per-node=2", str(REPO / "train.py"), *SAME_RUN],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    assert torchrun.returncode == 0, output(torchrun)
    submitit = run_train(*SAME_RUN, "distributed.num_gpus=2", "hydra/launcher=slurm_local",
                         f"hydra.sweep.dir={tmp_path}/submitit", "-m")
    assert submitit.returncode == 0, output(submitit)

    torchrun_dirs = run_dirs(tmp_path / "outputs")
    assert len(torchrun_dirs) == 1, "torchrun's ranks agree on one output directory"
    dirs = {"spawn": tmp_path / "spawn", "torchrun": torchrun_dirs[0], "submitit": tmp_path / "submitit" / "0"}
    rows = {name: read_rows(d) for name, d in dirs.items()}
    launchers = {name: r[-1]["launcher"] for name, r in rows.items()}
    assert launchers == {"spawn": "spawn", "torchrun": "torchrun", "submitit": "slurm"}
    columns = {name: list(r[0]) for name, r in rows.items()}
    assert columns["spawn"] == columns["torchrun"] == columns["submitit"]
    for key in ("val_acc", "val_loss", "train_loss", "world_size", "global_batch_size"):
        values = {name: [row[key] for row in r] for name, r in rows.items()}
        assert values["spawn"] == values["torchrun"] == values["submitit"], key
    for d in dirs.values():
        assert read_run(d)["status"] == "completed"
    scratch_after = set(Path(tempfile.gettempdir()).glob("ddpscale-rank*"))
    assert scratch_after <= scratch_before, "non-zero ranks clean up their scratch dirs"


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One local submitit sweep of a 1-task and a 2-task job, which the next three tests read.
    Its model fails if Python's cycle collector is off while it trains, and the script exits 3
    if it is off after the sweep: train.py turns it off for start-up only."""
    sweep_dir = tmp_path_factory.mktemp("local_sweep")
    proc = run_train(*QUICK, "train.epochs=1", "distributed.num_gpus=1,2", "hydra/launcher=slurm_local",
                     "model=crashing_cnn", "model.name=collecting_cnn", f"hydra.sweep.dir={sweep_dir}", "-m",
                     script="tests/crashing_train.py")
    return proc, sweep_dir


def test_a_local_submitit_sweep_runs_one_job_at_a_time(local_sweep):
    """Jobs run together would share the cores and measure each other's load. And one task
    (num_gpus=1) is spawn mode inside the submitit job, whose __main__ is submitit's: the
    workers' body must be importable from the package, not train.py."""
    proc, sweep_dir = local_sweep
    assert proc.returncode == 0, output(proc)
    first, second = read_run(sweep_dir / "0"), read_run(sweep_dir / "1")
    assert first["status"] == "completed" and first["launcher"] == "spawn" and first["world_size"] == 1
    assert second["status"] == "completed" and second["launcher"] == "slurm"
    assert second["start_time"] >= first["end_time"], "the second job started after the first ended"


def test_a_local_submitit_sweep_leaves_only_its_jobs_folders_in_submitit(local_sweep):
    # submitit's local controller creates the folder it is given, `.submitit/%j`, before
    # substituting the job id: every sweep left an empty directory named `%j`
    proc, sweep_dir = local_sweep
    assert proc.returncode == 0, output(proc)
    folders = sorted(p.name for p in (sweep_dir / ".submitit").iterdir())
    assert len(folders) == 2 and all(f.isdigit() for f in folders), folders  # the jobs' ids


def _messages(log: Path) -> list[str]:
    """A log's lines without their time stamps (two tasks' copies of a line differ there)."""
    return [line.split(" - ", 1)[-1] for line in log.read_text().splitlines()]


def test_each_line_of_a_local_submitit_job_is_logged_once(local_sweep):
    # submitit's own lines reached Hydra's handlers too: train.log had task 1's
    # "Job completed successfully" after task 0's, and each task's log in .submitit/ had
    # every one of them twice, in submitit's format and in Hydra's
    proc, sweep_dir = local_sweep
    assert proc.returncode == 0, output(proc)
    train_log = _messages(sweep_dir / "1" / "train.log")  # the job of two tasks
    assert any(m.startswith("epoch 1/1") for m in train_log), train_log
    assert len(set(train_log)) == len(train_log), train_log
    assert "Job completed successfully" not in train_log, "submitit's lines stay in .submitit/"
    task_logs = sorted((sweep_dir / ".submitit").glob("*/*_log.out"))
    assert sorted(len(list(d.glob("*_log.out"))) for d in {log.parent for log in task_logs}) == [1, 2], task_logs
    for log in task_logs:
        messages = _messages(log)
        assert messages.count("Job completed successfully") == 1, messages
        assert len(set(messages)) == len(messages), messages


@pytest.mark.parametrize("send,name,code,recorded", [
    # Ctrl-C in the terminal: the tasks get it too, and the run records it (it recorded the
    # SIGTERM the sweep sent on at once, the tasks having inherited SIGINT ignored)
    (lambda pid: os.killpg(pid, signal.SIGINT), "SIGINT", 130, "stopped by SIGINT"),
    # the sweep process alone, which must end the job itself: it said "interrupted; no run was
    # in progress" and left the job training as an orphan, with no later job and no summary
    (lambda pid: os.kill(pid, signal.SIGHUP), "SIGHUP", 129, "stopped by SIGTERM"),
], ids=["ctrl-c", "hangup"])
def test_a_signal_stops_a_local_submitit_sweep_and_marks_its_run_interrupted(tmp_path, send, name, code, recorded):
    proc = subprocess.Popen(
        [sys.executable, "train.py", *QUICK, "train.epochs=200", "distributed.num_gpus=2,1",
         "hydra/launcher=slurm_local", f"hydra.sweep.dir={tmp_path}", "-m"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    _wait_for_epochs(proc, tmp_path / "0", 1)
    send(proc.pid)
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode == code, log
    assert f"sweep stopped by {name}: job #0 was interrupted" in log and "Traceback" not in log
    assert "no run was in progress" not in log
    run = read_run(tmp_path / "0")
    assert run["status"] == "interrupted" and recorded in run["error"], run
    assert not (tmp_path / "1").exists(), "no later job was started"


def test_a_task_hung_after_rank_0_failed_does_not_hold_the_local_submitit_sweep(tmp_path):
    # submitit's controller waits for every task: the hung one held the sweep for
    # hydra.launcher.timeout_min (30 minutes by default; 2 here).
    start = time.monotonic()
    proc = run_train(*QUICK, "train.epochs=1", "train.sync_probe_steps=0", "distributed.num_gpus=2",
                     "distributed.timeout_s=5", "model=crashing_cnn,cnn", "hydra/launcher=slurm_local",
                     "hydra.launcher.timeout_min=2", f"hydra.sweep.dir={tmp_path}", "-m",
                     script="tests/crashing_train.py", env={"CRASH_HOW": "hang"}, timeout=300)
    assert time.monotonic() - start < 90, output(proc)
    assert proc.returncode == 1, output(proc)
    assert "job #0: task 0 ended 10 s ago and other tasks are still running; ending them" in output(proc)
    first, second = read_run(tmp_path / "0"), read_run(tmp_path / "1")
    assert first["status"] == "failed" and "within distributed.timeout_s=5" in first["error"], first
    assert second["status"] == "completed"


@pytest.mark.parametrize("shape, says", [("distributed.num_gpus=1,0", "distributed.num_gpus=0 must be >= 1"),
                                         ("distributed.num_nodes=-1", "distributed.num_nodes=-1 must be >= 1")])
def test_a_job_shape_below_one_is_refused_before_submitit_sees_it(tmp_path, shape, says):
    # the launcher shapes the tasks from these keys before any job could check them
    proc = run_train(*QUICK, shape, "hydra/launcher=slurm_local", f"hydra.sweep.dir={tmp_path}", "-m")
    assert proc.returncode == 2, output(proc)
    assert says in output(proc) and "Traceback" not in output(proc)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("launcher", ["slurm", "slurm_local"])
@pytest.mark.parametrize("key, instead", [("nodes", "distributed.num_nodes"), ("tasks_per_node", "distributed.num_gpus")])
def test_a_job_shape_given_to_the_launcher_is_refused_naming_the_key_it_belongs_to(tmp_path, launcher, key, instead):
    # the launcher sets both from each job's shape: the value given would have been dropped
    proc = run_train(*QUICK, f"hydra/launcher={launcher}", f"hydra.launcher.{key}=2",
                     f"hydra.sweep.dir={tmp_path}", "-m")
    assert proc.returncode == 2, output(proc)
    assert f"hydra.launcher.{key}=2 is not read" in output(proc) and f"use {instead}=2 instead" in output(proc)
    assert "Traceback" not in output(proc) and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("explicit_dir", [True, False])
def test_several_nodes_on_the_local_submitit_launcher_are_refused_in_one_line(tmp_path, explicit_dir):
    where = [f"hydra.sweep.dir={tmp_path}"] if explicit_dir else []
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *QUICK, "distributed.num_nodes=1,2",
         "distributed.master_addr=127.0.0.1", "distributed.master_port=29555",
         "hydra/launcher=slurm_local", *where, "-m"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, output(proc)
    assert ("slurm_local runs every job on this machine, but a job asks for distributed.num_nodes=2; use "
            "distributed.num_nodes=1 here, or hydra/launcher=slurm on a cluster") in output(proc)
    assert "Traceback" not in output(proc)
    # nothing was started, not even the one-node job, and nothing was left: not Hydra's
    # multirun.yaml, nor (unless given) the sweep directory claimed for it
    assert list(tmp_path.iterdir()) == []


def test_the_slurm_launcher_off_a_cluster_says_so_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *QUICK, "distributed.num_gpus=1,2",
         "hydra/launcher=slurm", "-m"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:/bin"})  # no sbatch here
    assert proc.returncode == 2, output(proc)
    assert ("error: hydra/launcher=slurm submits each job with sbatch, which this machine does not have; run the "
            "sweep on a SLURM login node, or use hydra/launcher=slurm_local here") in output(proc)
    assert "Traceback" not in output(proc)
    assert list(tmp_path.iterdir()) == []  # no multirun/<date>/<time> that looks like a sweep


def test_a_slurm_task_whose_rank_0_never_listens_fails_after_timeout_s_in_one_line(tmp_path):
    # a TCPStore client waited out distributed.timeout_s, then once more after a random delay
    # of up to as long again, printing some 20 lines of C++ stack at each try
    task = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "9", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
            "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1"}
    started = time.monotonic()
    proc = run_train(*QUICK, "distributed.timeout_s=5", f"distributed.master_port={free_port()}",
                     f"hydra.run.dir={tmp_path}/run", env=task, timeout=120)
    assert proc.returncode == 1, output(proc)
    assert ("rank 1: rendezvous at distributed.master_addr:master_port = 127.0.0.1:" in output(proc)
            and "failed within distributed.timeout_s=5: nothing listened there: global rank 0 hosts the store"
            in output(proc)), output(proc)
    assert "frame #" not in output(proc) and "retrying" not in output(proc), output(proc)
    assert time.monotonic() - started < 5 + 30  # start-up included, on a busy machine


def test_torchrun_two_nodes_over_loopback(tmp_path):
    port = free_port()
    nodes = [
        subprocess.Popen(
            [*TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=ddpscale-test",
             str(REPO / "train.py"), *QUICK, "train.epochs=1"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        )
        for _ in range(2)
    ]
    logs = [n.communicate(timeout=240)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], logs
    dirs = run_dirs(tmp_path)
    assert len(dirs) == 1, "only global rank 0 writes, into one directory"
    row = read_rows(dirs[0])[0]
    assert (row["world_size"], row["num_nodes"], row["num_gpus"]) == ("2", "2", "1")
    # each agent's one rank took all the cores (its local world is 1), so two on one machine
    # ran twice as many threads as it has cores, without a word
    cores = len(os.sched_getaffinity(0))
    if cores > 1:
        assert (f"notice: ranks 0, 1 run on this one machine ({socket.gethostname()}): {2 * cores} CPU threads "
                f"in all on {cores} core(s), which take turns and slow every step; give every rank "
                f"train.threads={cores // 2} (the cores // the 2 workers here)") in "".join(logs), logs


@pytest.mark.parametrize("nodes", [2, 1])
def test_under_torchrun_rank_0_records_the_rank_that_failed_first(tmp_path, nodes):
    """Rank 1 raises. Rank 0 then fails too: over two nodes with gloo's "Connection closed
    by peer", on one node through torchrun's SIGTERM. Its run.json must name rank 1's
    error, with rank 1's traceback, not its own symptom."""
    port = free_port()
    shape = (["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=ddpscale-test"] if nodes == 2
             else ["--standalone", "--nproc-per-node=2"])
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [*TORCHRUN, *shape, str(REPO / "tests" / "crashing_train.py"), *QUICK,
             "model.name=crashing_cnn", "train.sync_probe_steps=0"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO / "src"), "CRASH_RANK": "1"},
        )
        for _ in range(nodes)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode != 0 for p in procs), logs
    assert time.monotonic() - start < 120
    run = read_run(run_dirs(tmp_path)[0])
    assert run["status"] == "failed", run
    assert run["error"] == "rank 1 raised RuntimeError: injected failure on rank 1", logs
    assert 'raise RuntimeError(f"injected failure on rank {rank}")' in run["traceback"]


def test_torchrun_ranks_given_different_settings_stop_naming_them(tmp_path):
    # Node 1's rank trained with its own lr, silently: replicas apart, results.csv saying rank 0's.
    port = free_port()
    nodes = [
        subprocess.Popen(
            [*TORCHRUN, "--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}",
             "--master-addr=127.0.0.1", f"--master-port={port}", str(REPO / "train.py"), *QUICK,
             f"optim.lr={0.05 if rank == 0 else 0.02}", f"hydra.run.dir={tmp_path}/run{rank}"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        )
        for rank in range(2)
    ]
    logs = [n.communicate(timeout=120)[0] for n in nodes]
    assert all(n.returncode != 0 for n in nodes), logs
    said = ("the ranks were given different settings: optim.lr (rank 0: 0.05, rank 1: 0.02); "
            "give every rank the same overrides")
    assert all(said in log for log in logs), logs
    run = read_run(tmp_path / "run0")
    assert (run["status"], run["error"]) == ("failed", said)
    assert not (tmp_path / "run0" / "results.csv").exists()


def test_ctrl_c_on_another_node_is_recorded_as_interrupted_not_failed(tmp_path):
    """Node 1's rank stops on SIGINT; rank 0 on node 0 then loses its gloo connection. Its
    run.json must say interrupted, by whom, not "failed: Connection closed by peer"."""
    port = free_port()
    nodes = [
        subprocess.Popen(
            [*TORCHRUN, "--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}",
             "--master-addr=127.0.0.1", f"--master-port={port}", str(REPO / "train.py"), *QUICK,
             "train.epochs=200", f"hydra.run.dir={tmp_path}/run"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        )
        for rank in range(2)
    ]
    _wait_for_epochs(nodes[0], tmp_path / "run", 1)
    os.killpg(nodes[1].pid, signal.SIGINT)  # Ctrl-C in node 1's terminal
    logs = [n.communicate(timeout=120)[0] for n in nodes]
    run = read_run(tmp_path / "run")
    assert (run["status"], run["error"]) == ("interrupted", "stopped by SIGINT on rank 1"), logs


def test_under_torchrun_a_run_dir_refused_by_rank_0_ends_every_rank_at_once(tmp_path):
    """Only rank 0 checks the directory; it exits 2 before the process group. Rank 1, blocked
    in the rendezvous (C++), deferred torchrun's SIGTERM to a Python handler that never ran:
    "Unable to shutdown process ... via 15, forcefully exiting via 9" 30 s later."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "results.csv").write_text("epoch\n1\n")
    start = time.monotonic()
    proc = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc-per-node=2", str(REPO / "train.py"), *QUICK,
         f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode != 0
    assert f"error: hydra.run.dir={run_dir} already holds run files" in output(proc)
    assert "Fix: give hydra.run.dir a new directory, or leave it unset" in output(proc)
    assert "forcefully exiting" not in output(proc), output(proc)
    assert time.monotonic() - start < 25
    assert (run_dir / "results.csv").read_text() == "epoch\n1\n"


def test_a_sweep_under_torchrun_is_refused_before_any_job(tmp_path):
    # each worker would run the whole sweep, and one rank's failure would hold the others
    proc = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc-per-node=2", str(REPO / "train.py"), *QUICK,
         "optim.lr=0.01,0.1", "-m"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode != 0
    assert output(proc).count("error: -m under torchrun: each process torchrun starts is one "
                              "worker of one run") == 1
    assert not list(tmp_path.iterdir())


def _alive_after(pids: set[int], seconds: float) -> set[int]:
    """Those of `pids` still alive `seconds` from now; it returns as soon as all have ended."""
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def _start_long_run(tmp_path: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "train.py", *QUICK, "train.epochs=200", "distributed.num_gpus=2",
         f"hydra.run.dir={tmp_path}", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group, like a job in a terminal
    )


def _wait_for_epochs(proc: subprocess.Popen, run_dir: Path, n: int, timeout: float = 120) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "results.csv").exists() and len(read_rows(run_dir)) >= n:
            return descendants(proc.pid)
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    raise AssertionError("the run did not reach its first epochs")


def _worker_pids(pids: set[int]) -> list[int]:
    return [p for p in pids if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]


def test_sigkill_of_one_worker_ends_the_run_marked_failed_with_nothing_left(tmp_path):
    proc = _start_long_run(tmp_path)
    family = _wait_for_epochs(proc, tmp_path, 1)
    workers = _worker_pids(family)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    start = time.monotonic()
    proc.communicate(timeout=60)
    assert time.monotonic() - start < 30
    assert proc.returncode == 1
    run = read_run(tmp_path)
    assert run["status"] == "failed" and "SIGKILL" in run["error"]
    assert len(read_rows(tmp_path)) >= 1
    assert not _alive_after(family, 1), "no orphaned worker"


def test_workers_end_with_their_job_process_when_it_is_killed_outright(tmp_path):
    # SIGKILL (or the out-of-memory killer) gives the job process no chance to stop its
    # workers: they would train on, orphaned, unless they die with their parent.
    proc = _start_long_run(tmp_path)
    workers = _worker_pids(_wait_for_epochs(proc, tmp_path, 1))
    assert len(workers) == 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert not _alive_after(set(workers), 10), "orphaned workers"


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["SIGTERM", "Ctrl-C"])
def test_dataloader_workers_end_with_the_run_quietly(tmp_path, ctrl_c):
    # They used to outlive a stopped run by up to 10 s, until their own check of the parent;
    # and, started by spawn, their queues' semaphores made the resource tracker warn of
    # "leaked semaphore objects" after every stopped run.
    proc = _start_long_run(tmp_path, "data.loader=dataloader", "data.num_workers=2")
    family = _wait_for_epochs(proc, tmp_path, 1)
    workers = _worker_pids(family)
    assert len(workers) == 2 + 2 * 2  # each trainer's DataLoader starts 2 processes
    if ctrl_c:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)  # not communicate(): lingering children hold its output pipe open
    assert not _alive_after(family, 3)
    log = proc.stdout.read()
    assert proc.returncode == (130 if ctrl_c else 143), log
    assert "leaked semaphore" not in log and "Traceback" not in log, log


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_sigterm_ctrl_c_and_hangup_stop_the_workers_and_mark_the_run_interrupted(tmp_path, sig, code):
    # SIGHUP (the terminal closed) used to end the job process at once, run.json "running".
    proc = _start_long_run(tmp_path)
    family = _wait_for_epochs(proc, tmp_path, 2)
    if sig != signal.SIGTERM:
        os.killpg(proc.pid, sig)  # Ctrl-C, and a hangup, reach the whole foreground process group
    else:
        os.kill(proc.pid, sig)
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode == code
    assert "leaked semaphore" not in log, "workers ended by SIGTERM leave nothing behind"
    run = read_run(tmp_path)
    assert run["status"] == "interrupted" and signal.Signals(sig).name in run["error"]
    assert len(read_rows(tmp_path)) >= 2, "finished epochs are kept"
    assert not _alive_after(family, 1)


def test_a_run_under_nohup_survives_the_hangup(tmp_path):
    # nohup ignores SIGHUP so that a run outlives the terminal; the job and its workers keep that.
    proc = subprocess.Popen(
        [sys.executable, "train.py", *QUICK, "train.epochs=3", "distributed.num_gpus=2",
         f"hydra.run.dir={tmp_path}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    )
    _wait_for_epochs(proc, tmp_path, 1)
    os.killpg(proc.pid, signal.SIGHUP)  # the terminal closed
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, log
    assert read_run(tmp_path)["status"] == "completed" and len(read_rows(tmp_path)) == 3


def test_a_second_signal_while_stopping_waits_until_the_run_is_recorded(tmp_path):
    # One worker ignores SIGTERM, so stopping takes the whole 10 s before SIGKILL; an
    # impatient second signal in that time must not kill the job process and leave
    # run.json saying "running" (which also locks the directory).
    pid_file = tmp_path / "stubborn.pid"
    proc = subprocess.Popen(
        [sys.executable, "tests/crashing_train.py", *QUICK, "model.name=crashing_cnn",
         "distributed.num_gpus=2", "train.sync_probe_steps=0", f"hydra.run.dir={tmp_path}/run"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "CRASH_HOW": "stubborn", "CRASH_PID_FILE": str(pid_file)},
    )
    deadline = time.monotonic() + 120
    while not pid_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.2)
    family = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(2)
    assert proc.poll() is None, "still waiting for the stubborn worker"
    os.kill(proc.pid, signal.SIGTERM)
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode == 143, log
    assert "already stopping" in log and "leaked semaphore" not in log
    run = read_run(tmp_path / "run")
    assert run["status"] == "interrupted" and "SIGTERM" in run["error"]
    assert not _alive_after(family, 1), "the stubborn worker was killed"


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_before_the_workers_start_marks_the_run_interrupted(tmp_path, sig, code):
    # A download that never answers (a proxy that accepts and stays silent) holds the
    # job before any worker starts, as a slow network or a hung file system would.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        proxy = f"http://127.0.0.1:{silent.getsockname()[1]}"
        proc = subprocess.Popen(
            [sys.executable, "train.py", *QUICK, "data=fashion_mnist", "data.noise=0", f"data.root={tmp_path}/data",
             "data.train_size=null", "data.val_size=null", f"hydra.run.dir={tmp_path}/run"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "http_proxy": proxy, "https_proxy": proxy, "no_proxy": ""},
        )
        deadline = time.monotonic() + 60
        job_log = tmp_path / "run" / "train.log"
        while not (job_log.exists() and "downloading" in job_log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        os.killpg(proc.pid, sig)
        log = proc.communicate(timeout=30)[0]
    assert proc.returncode == code, log
    assert "Traceback" not in log
    run = read_run(tmp_path / "run")
    assert run["status"] == "interrupted" and signal.Signals(sig).name in run["error"]


@pytest.mark.parametrize("when", ["job importing", "workers starting", "workers importing"])
def test_ctrl_c_while_starting_ends_without_a_traceback(tmp_path, when):
    # The first seconds of the job, and of each spawned worker, are interpreter start-up
    # and imports (torch, hydra); torch's C import once swallowed a Ctrl-C there.
    _stop_while_starting(tmp_path, when, signal.SIGINT)


def test_a_hangup_before_the_run_ends_the_job_with_one_line(tmp_path):
    # As between a sweep's runs: the process died of SIGHUP at once, saying nothing.
    _stop_while_starting(tmp_path, "job importing", signal.SIGHUP)


def _stop_while_starting(tmp_path, when, sig):
    proc = subprocess.Popen(
        [sys.executable, "train.py", *QUICK, "distributed.num_gpus=2", f"hydra.run.dir={tmp_path}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    if when == "job importing":  # Hydra's imports: torch comes only once a config passed its checks
        time.sleep(0.2)
    else:
        deadline, job_log = time.monotonic() + 60, tmp_path / "train.log"
        while not (job_log.exists() and "starting 2 worker" in job_log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.005)
        time.sleep(0.5 if when == "workers importing" else 0)
    os.killpg(proc.pid, sig)  # Ctrl-C, and a hangup, reach the whole foreground process group
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + sig, log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    if when == "job importing":
        assert log.strip() == "interrupted; no run was in progress"
    else:
        assert read_run(tmp_path)["status"] == "interrupted"


def test_two_sweeps_started_together_both_complete_in_their_own_dirs(tmp_path):
    sweeps = [
        subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), *QUICK, "train.epochs=1",
             "distributed.num_gpus=1,2", "-m"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for _ in range(2)
    ]
    logs = [s.communicate(timeout=300)[0] for s in sweeps]
    assert [s.returncode for s in sweeps] == [0, 0], logs
    dirs = run_dirs(tmp_path / "multirun")
    assert len(dirs) == 4 and len({d.parent for d in dirs}) == 2
    assert all(read_run(d)["status"] == "completed" for d in dirs)


@pytest.mark.parametrize("parent, stays", [("os.getppid()", True), ("1", False)], ids=["alive", "gone"])
def test_a_worker_whose_parent_died_before_it_started_leaves_at_once(parent, stays):
    # A job process killed while its workers import torch: the death signal asked for
    # afterwards never comes, so the worker must see the new parent and leave.
    code = ("import os, sys; sys.path.insert(0, 'src'); "
            f"from ddpscale.distributed import die_with_parent; die_with_parent({parent}); print('stayed')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, "stayed" in proc.stdout) == ((0, True) if stays else (1, False))


def _task_pid(rank: str) -> int | None:
    """A running submitit local task of global rank `rank`, from its environment."""
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SUBMITIT_LOCAL_GLOBALID={rank}".encode() in env and b"SUBMITIT_LOCAL_NTASKS=2" in env:
            return int(proc.name)
    return None


def test_a_task_killed_outright_fails_its_job_and_the_slurm_sweep_goes_on(tmp_path):
    # SIGKILL leaves submitit no result for the task; it used to raise out of the
    # launcher, ending the sweep with a traceback before job #1 ran.
    proc = subprocess.Popen(
        [sys.executable, "train.py", *QUICK, "distributed.num_gpus=2", "train.epochs=12,1",  # job #1: one epoch
         "hydra/launcher=slurm_local", f"hydra.sweep.dir={tmp_path}", "-m"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not ((tmp_path / "0" / "results.csv").exists() and _task_pid("1")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.2)
    os.kill(_task_pid("1"), signal.SIGKILL)
    log = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1, log
    assert "UncompletedJobError" not in log and "Traceback" not in log, log
    assert "job #0 failed: a task ended without a result" in log
    assert [read_run(d)["status"] for d in run_dirs(tmp_path)] == ["failed", "completed"]
    assert "2 run(s), 1 completed" in log



def test_a_sweep_counts_only_the_jobs_its_own_slurm_launcher_handed_over(tmp_path):
    # count_submitted_job's list outlives a sweep that stopped before its end (an
    # interrupted in-process sweep, a notebook): the next sweep must not count its jobs.
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from ddpscale.sweep import SweepSummary, count_submitted_job

    earlier = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(tmp_path / "earlier" / "0")}}})
    count_submitted_job(JobReturn(overrides=["optim.lr=0.1"], status=JobStatus.FAILED,
                                  _return_value=RuntimeError("an earlier sweep's job"), hydra_cfg=earlier))
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "now")}}})
    summary = SweepSummary()
    summary.on_multirun_start(config=config)
    summary.on_multirun_end(config=config)  # SystemExit(1) if it counted the earlier job as failed
