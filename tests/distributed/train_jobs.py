"""Several trainer jobs in one launch: `python -m tests.distributed.train_jobs JOBS.json`,
alone or under torchrun, runs each job of JOBS.json (a list of {"dump": folder, "log": path
prefix, "args": CLI arguments, "before": null or ["module:function", *arguments], a call rank 0
makes first, such as copying an earlier job's checkpoint to resume from}) as `python -m
titan_moe.train ARGS --job.dump_folder DUMP` would, one after the other, on the same processes
and the same default process group (torchtitan's `init_distributed` keeps one that is already
up; every job builds its own device meshes on it).

A launch pays for starting torchrun and for importing torch, torchtitan and titan_moe on every
rank (about 10 s of CPU a process on the CPU host), which dwarfs a tiny job's few steps. So the
test modules `register` their trainer runs when imported, and the first test that needs one
(`shared_runs`) launches every run registered and not yet run: one launch for each process
count, the counts in increasing order (one-process seeds first), the jobs of a count in the
order registered.

A job may instead be tests/distributed/harness.py's `train_layouts` ({"harness": {"layouts":
[Layout fields], "island_dtypes": bool}}, `register_harness`), the training loop its
`spawn_layouts` runs on spawned ranks; rank 0 saves the results at DUMP/results.pt.

Per trainer job: $QB_BIAS_FOLDER is DUMP/qb_biases (tests/distributed/pipeline_spec.py), and
each rank's log records go to LOG.rank<r>.log, which `job_log` joins in rank order (the lines a
test searches, as the job's own launch would print them); the train spec's model args are
reset to those registered (`fresh_model_args`). Rank 0's 2 s sleep at the end of
torchtitan's train loop ("for other ranks to complete") is left out: a barrier ends every job.
"""

import copy
import dataclasses
import importlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


ROOT = "{root}"  # in a registered job's arguments: the shared runs' folder


@dataclasses.dataclass
class Job:
    processes: int
    args: list[str] | None  # a trainer job's; None for a harness job
    dump: str  # under the shared runs' folder
    before: list[str] | None
    harness: dict | None = None  # {"layouts": [Layout fields], "island_dtypes": bool}


_registered: dict[str, Job] = {}
_runs: dict[str, tuple[Path, str]] = {}
_root: list[Path] = []


def register(name: str, processes: int, args: list[str], dump: str | None = None,
             before: list[str] | None = None) -> None:
    """A trainer run on `processes` ranks for `shared_runs` to launch; in `args` and `before`,
    ROOT stands for the shared runs' folder. Its dump folder is ROOT/`dump` (default: `name`)."""
    _registered[name] = Job(processes, args, dump or name, before)


def register_harness(name: str, processes: int, layouts: list, island_dtypes: bool = False
                     ) -> None:
    """tests/distributed/harness.py's `train_layouts(layouts, island_dtypes)` on `processes`
    ranks for `shared_runs` to launch, as its `spawn_layouts` would run them; rank 0 saves the
    results at ROOT/name/results.pt."""
    _registered[name] = Job(processes, None, name, None, {
        "layouts": [dataclasses.asdict(layout) for layout in layouts],
        "island_dtypes": island_dtypes})


def shared_runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Every registered run: name -> (dump folder, log); those not yet run are launched now."""
    if not _root:
        _root.append(tmp_path_factory.mktemp("shared_runs"))
    root = _root[0]
    pending = {name: job for name, job in _registered.items() if name not in _runs}
    for processes in sorted({job.processes for job in pending.values()}):
        batch = {name: job for name, job in pending.items() if job.processes == processes}
        spec = [{"dump": str(root / job.dump), "log": str(root / "logs" / name),
                 "args": job.args and [a.replace(ROOT, str(root)) for a in job.args],
                 "harness": job.harness,
                 "before": job.before and [a.replace(ROOT, str(root)) for a in job.before]}
                for name, job in batch.items()]
        # Marked run before the launch: a failed launch fails its tests once, not again each.
        _runs.update({name: (root / job.dump, "") for name, job in batch.items()})
        launch(processes, spec, root / f"jobs{processes}.json")
        _runs.update({name: (root / job.dump, job_log(root / "logs" / name))
                      for name, job in batch.items()})
    return _runs


def launch(processes: int, jobs: list[dict], spec: Path) -> None:
    spec.write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, 2 // processes))}
    env.pop("LOCAL_RANK", None)
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    result = subprocess.run(
        [sys.executable, *(launcher if processes > 1 else []), "-m",
         "tests.distributed.train_jobs", str(spec)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200,
    )
    output = result.stdout + result.stderr
    # Each rank's first error is above the launcher's own traceback: keep the start too, and
    # every line in between that names a fatal error (a rank's native abort sits mid-output).
    fatal = [line for line in output.splitlines()
             if any(k in line for k in ("Fatal", "terminate", "what()", "Error", "File \""))]
    assert result.returncode == 0, (output[:3000] + "\n...\n" + "\n".join(fatal[-80:])
                                    + "\n...\n" + output[-3000:])


def job_log(log: Path) -> str:
    return "".join(f.read_text() for f in sorted(log.parent.glob(f"{log.name}.rank*.log")))


_registered_model_args: dict[str, dict] = {}


def fresh_model_args(spec_name: str) -> None:
    """Give the train spec back its model args as registered. torchtitan's Trainer updates the
    flavor's args in place with the job's [titan_moe] overrides (update_from_config), and a field
    a job leaves unset keeps the value an earlier job of the process set: a job must not train
    an earlier one's vision tower or widths."""
    from torchtitan.protocols.train_spec import get_train_spec

    from titan_moe.train.trainer import register_titan_moe

    register_titan_moe()  # as the trainer does (once), here before its args are kept
    model_args = get_train_spec(spec_name).model_args
    if spec_name not in _registered_model_args:  # before any job of this spec built a trainer
        _registered_model_args[spec_name] = copy.deepcopy(model_args)
    model_args.clear()
    model_args.update(copy.deepcopy(_registered_model_args[spec_name]))


def run_job(dump: Path, log: Path, args: list[str], before: list[str] | None) -> None:
    import torch.distributed as dist
    from torchtitan.tools.logging import logger

    from titan_moe.train.config import parse_job_config_or_exit
    from titan_moe.train.platform import resolve_device_type, use_platform
    from titan_moe.train.trainer import TitanMoETrainer

    if before is not None:  # after an earlier job, which brought the process group up
        if dist.get_rank() == 0:
            module, function = before[0].split(":")
            getattr(importlib.import_module(module), function)(*before[1:])
        dist.barrier()
    os.environ["QB_BIAS_FOLDER"] = str(dump / "qb_biases")
    log.parent.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    handler = logging.FileHandler(f"{log}.rank{rank}.log")
    handler.setFormatter(logger.handlers[0].formatter)
    logger.addHandler(handler)
    try:
        job_config = parse_job_config_or_exit([*args, "--job.dump_folder", str(dump)])
        fresh_model_args(job_config.model.name)
        use_platform(resolve_device_type(job_config.training.device))
        trainer = TitanMoETrainer(job_config)
        try:
            if job_config.checkpoint.create_seed_checkpoint:
                trainer.checkpointer.save(curr_step=0, last_step=True)
                logger.info("Created seed checkpoint")
            else:
                trainer.train()
        finally:
            trainer.close()
        dist.barrier()
    finally:
        logger.removeHandler(handler)
        handler.close()


def run_harness(dump: Path, layouts: list[dict], island_dtypes: bool) -> None:
    import torch
    import torch.distributed as dist
    from torchtitan.distributed import utils as tt_dist_utils

    from tests.distributed import harness
    from titan_moe.train.platform import use_platform

    if not dist.is_initialized():  # the launch's first job: bring the group up, as the trainer
        dist.init_process_group("gloo")
    # torchtitan's own clip, which an earlier trainer job's step guard took over process-wide.
    tt_dist_utils.clip_grad_norm_ = harness._torchtitan_clip_grad_norm_
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as harness.spawn_entry
    use_platform("cpu")
    try:
        results = harness.train_layouts([harness.Layout(**layout) for layout in layouts],
                                        island_dtypes)
    finally:
        torch.set_num_threads(threads)
    if dist.get_rank() == 0:
        dump.mkdir(parents=True, exist_ok=True)
        torch.save(results, dump / "results.pt")
    dist.barrier()


def main(jobs_file: str) -> None:
    """The launched ranks' work (the test process imports this module only to register and
    launch, without the trainer's imports)."""
    import torch.distributed as dist
    import torchtitan.train
    from torchtitan.tools.logging import init_logger

    # Imported before any job: it keeps torchtitan's clip_grad_norm_ as imported, before a
    # trainer job's step guard takes it over.
    import tests.distributed.harness  # noqa: F401
    from tests.faults.trainer_process import NoSleep
    from titan_moe.train.trainer import _single_process_env, exit_past_gloo_threads

    init_logger()
    _single_process_env()
    torchtitan.train.time = NoSleep()
    for job in json.loads(Path(jobs_file).read_text()):
        if job["harness"] is not None:
            run_harness(Path(job["dump"]), **job["harness"])
        else:
            run_job(Path(job["dump"]), Path(job["log"]), job["args"], job["before"])
    gloo_peers = dist.get_world_size() > 1
    dist.barrier()
    dist.destroy_process_group()
    if gloo_peers:
        exit_past_gloo_threads()


if __name__ == "__main__":
    main(sys.argv[1])
