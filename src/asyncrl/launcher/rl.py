"""``asyncrl rl``: one RL run as three supervised processes.

Writes the resolved config and run metadata, starts the sidecar (unless ``inference.urls`` names
running servers), waits for ``/health``, then starts the orchestrator and the trainer, each with its
log in ``<run_dir>/logs``. It shows a progress line read from the metrics files, stops everything on
Ctrl-C/SIGTERM or as soon as one process fails (naming it and its log), and exits non-zero on failure.
On resume it first removes what the interrupted run wrote after the checkpoint.
"""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import time
from pathlib import Path

from asyncrl.checkpoint import VERIFIED_ENV
from asyncrl.config import Config
from asyncrl.config.model import ModelConfig, check_model_source
from asyncrl.launcher.progress import Progress
from asyncrl.launcher.reconcile import prepare_run_dir
from asyncrl.monitor import wandb_offline_note
from asyncrl.paths import RunDir
from asyncrl.transport.base import transport_of
from asyncrl.utils import forked
from asyncrl.utils.atomic import write_json_atomic
from asyncrl.utils.children import Proc, asyncrl_argv, spawn, stop, tail, wait_healthy
from asyncrl.utils.meta import write_run_files
from asyncrl.utils.process import ProcessFailed, exit_wrapper, free_port, setup_logging

log = logging.getLogger("asyncrl.rl")


def plan_sidecars(cfg: Config) -> list[tuple[str, int, str | None]]:
    """``(name, port, CUDA_VISIBLE_DEVICES)`` of each sidecar to start; sets ``inference.urls`` to them.

    One sidecar per ``inference.gpus`` entry (one without GPU pinning if the list is empty); none when
    ``inference.urls`` already names running servers.
    """
    if cfg.inference.urls:
        return []
    gpus: list[str | None] = list(cfg.inference.gpus) or [None]
    names = ["inference"] if len(gpus) == 1 else [f"inference{i}" for i in range(len(gpus))]
    ports = [
        cfg.inference.port + i if cfg.inference.port else free_port(cfg.inference.host)
        for i in range(len(gpus))
    ]
    cfg.inference.urls = [f"http://{cfg.inference.host}:{p}" for p in ports]
    return list(zip(names, ports, gpus, strict=True))


def plan_teacher(cfg: Config) -> tuple[str, int, str | None] | None:
    """``(name, port, CUDA_VISIBLE_DEVICES)`` of the teacher sidecar of online distillation, if one is to be
    started (``distill.teacher`` set, ``distill.url`` empty); sets ``distill.url`` to it."""
    if not cfg.distill.teacher or cfg.distill.url:
        return None
    port = free_port(cfg.inference.host)
    cfg.distill.url = f"http://{cfg.inference.host}:{port}"
    return "teacher", port, cfg.distill.gpus or None


def sidecar_argv(cfg: Config, config_file: Path, name: str, port: int) -> list[str]:
    """``asyncrl serve`` of a sidecar: the run's config on ``port``; the teacher serves its own model (own
    tokenizer directory, no LoRA)."""
    extra = [f"inference.port={port}"]
    if name == "teacher":
        extra += [f"model.name={cfg.distill.teacher}", "model.tokenizer=null", "model.lora.enabled=false"]
    return asyncrl_argv("serve", config_file, *extra, python=cfg.launcher.inference_python)


def write_run_config(cfg: Config, run: RunDir, overrides: list[str], resume: int | None) -> Path:
    run.create()
    if resume is not None and run.config_file.exists():  # keep the configs of earlier attempts
        stamp = time.strftime("%Y%m%d-%H%M%S")
        shutil.copytree(run.configs, run.root / "configs_history" / stamp, dirs_exist_ok=True)
    write_run_files(run, cfg, overrides, resume_step=resume)
    return run.config_file


def supervise(
    procs: list[Proc],
    progress: Progress,
    poll_s: float,
    finishers: set[str],
    max_restarts: dict[str, int] | None = None,
) -> None:
    """Wait until every process in ``finishers`` exits 0; raise :class:`ProcessFailed` on any failure, except
    that a process named in ``max_restarts`` is started again (on its port, its log appended) that many
    times."""
    done: set[str] = set()
    budget = max_restarts or {}
    while done != finishers:
        for p in procs:
            rc = p.poll()
            if rc is None or p.name in done:
                continue
            if p.name not in finishers and p.restarts < budget.get(p.name, 0):
                log.warning(
                    f"{p.name} died (exit code {rc}); restarting it ({p.restarts + 1} of {budget[p.name]}); "
                    f"its log: {p.log_path}"
                )
                p.restart()
                continue
            if rc != 0 or p.name not in finishers:
                raise ProcessFailed(
                    f"{p.name} died (exit code {rc}); its log: {p.log_path}\n{tail(p.log_path)}"
                )
            done.add(p.name)
        progress.update()
        time.sleep(poll_s)
    progress.update()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _shield_from_signals() -> None:
    """While the launcher stops its children, a second Ctrl-C must not abandon them half-stopped
    (stop() escalates to SIGKILL after launcher.shutdown_timeout_s anyway)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def start_sidecars(cfg: Config, sidecars: list, config_file: Path, run: RunDir, procs: list[Proc]) -> list:
    """Start each sidecar (appended to ``procs`` as it starts); returns ``(proc, url)`` of those not yet
    waited for.

    vLLM measures the GPU's free memory while it starts, and one starting beside another process on a shared
    GPU would count the other's allocations as its own: with ``inference.backend=vllm`` the policy's sidecars
    start together, then the teacher, each wave healthy before the next and before the trainer starts. The
    built-in engine measures nothing, so its sidecars start at once and load while the orchestrator and the
    trainer import (the orchestrator waits for ``/health`` itself)."""
    waves = [[s for s in sidecars if s[0] != "teacher"], [s for s in sidecars if s[0] == "teacher"]]
    if cfg.inference.backend != "vllm":
        waves = [sidecars]
    pending: list[tuple[Proc, str]] = []
    for wave in waves:
        wait_for_sidecars(cfg, pending)
        for name, port, gpus in wave:
            env = {"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else None
            argv = sidecar_argv(cfg, config_file, name, port)
            proc = spawn(name, argv, run.log(name), env, fork=forked.forks(cfg)["inference"])
            procs.append(proc)
            pending.append((proc, f"http://{cfg.inference.host}:{port}"))
            on_gpus = f", GPUs {gpus}" if gpus is not None else ""
            log.info(f"{name} starting on port {port}{on_gpus} (log: {proc.log_path})")
    if cfg.inference.backend == "vllm":
        wait_for_sidecars(cfg, pending)
    return pending


def wait_for_sidecars(cfg: Config, pending: list) -> None:
    """Wait until each sidecar in ``pending`` answers ``/health`` (one that dies first stops the run), then
    empty the list."""
    for proc, url in pending:
        wait_healthy(proc, url, cfg.inference.startup_timeout_s)
    pending.clear()


def start_workers(
    cfg: Config, config_file: Path, run: RunDir, resume: int | None, procs: list[Proc]
) -> None:
    """Start the orchestrator and the trainer (appended to ``procs``), resuming from ``resume`` if set."""
    resume_args = (f"ckpt.resume={resume}",) if resume is not None else ()
    # the children resume from the step checked above: sizes only, not every byte again
    verified = {VERIFIED_ENV: str(run.checkpoint(resume).resolve())} if resume is not None else {}
    # Inside a SLURM job (the single_node template runs this launcher under srun), Lightning takes any
    # process that sees SLURM_NTASKS for one of srun's tasks (lightning_fabric/plugins/environments/slurm.py,
    # _is_srun_used) and would not start the trainer's other ranks: here Fabric starts one per device itself.
    trainer_env: dict[str, str | None] = {"SLURM_NTASKS": None}
    if cfg.trainer.fabric.gpus:
        trainer_env["CUDA_VISIBLE_DEVICES"] = cfg.trainer.fabric.gpus
    for name, command, extra, python in (
        ("orchestrator", "orchestrate", {}, ""),
        ("trainer", "train", trainer_env, cfg.launcher.trainer_python),
    ):
        argv = asyncrl_argv(command, config_file, *resume_args, python=python)
        fork = forked.forks(cfg)[name]
        procs.append(spawn(name, argv, run.log(name), {**extra, **verified}, fork=fork))
        log.info(f"{name} started (log: {run.log(name)})")


def build_progress(cfg: Config, run: RunDir) -> Progress:
    oc = cfg.orchestrator
    # a step of the step schedule holds prompts_per_step groups; a continuous batch is cut from kept groups
    # only
    groups = oc.prompts_per_step if oc.schedule == "step" else 0
    samples = oc.prompts_per_step * oc.group_size
    return Progress(run, cfg.launcher.progress, cfg.max_steps, samples, cfg.seq_len, groups)


def summarize(cfg: Config, run: RunDir, progress: Progress, wall_s: float) -> None:
    """Write ``metrics/summary.json`` and log it (and where offline W&B runs are)."""
    if progress.tty and progress.enabled:
        print()
    summary = {
        "rl/wall_s": wall_s,
        "rl/s_per_step_median": progress.seconds_per_step(),
        "rl/final_reward": progress.last["orchestrator"].get("rollout/reward_mean"),
        "rl/steps": progress.last["trainer"].get("step", -1) + 1,
    }
    write_json_atomic(run.metrics / "summary.json", summary)
    log.info(
        f"done: {summary['rl/steps']} steps in {summary['rl/wall_s']:.1f}s, median "
        f"{summary['rl/s_per_step_median'] or float('nan'):.3f}s/step; final policy: {run.model}"
    )
    if note := wandb_offline_note(cfg.monitor, run.root):
        log.info(note)


@exit_wrapper("rl")
def main(cfg: Config, overrides: list[str] | None = None) -> None:
    setup_logging("rl")
    # Ctrl-C and `kill <launcher>` both stop the run. SIGINT is installed explicitly: a process started from
    # a non-interactive shell's background job inherits SIGINT *ignored*, and Python then never installs its
    # KeyboardInterrupt handler, so Ctrl-C would not reach a launcher started by `( make test & )`.
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    check_model_source(cfg.model)  # before anything starts: a typo in model.name fails in a second
    run = RunDir(cfg.run_dir)
    resume = prepare_run_dir(cfg, run, cfg.launcher.overwrite)
    sidecars = plan_sidecars(cfg)  # [] when inference.urls names running servers
    if (teacher := plan_teacher(cfg)) is not None:
        check_model_source(ModelConfig(name=str(cfg.distill.teacher)))
        sidecars.append(teacher)
    transport_of(cfg).prepare_launch(cfg)
    config_file = write_run_config(cfg, run, list(overrides or []), resume)
    if note := wandb_offline_note(cfg.monitor, run.root):
        log.info(note)
    procs: list[Proc] = []
    if forked.forks(cfg)["inference"] or forked.forks(cfg)["trainer"]:
        forked.preload()
    progress = build_progress(cfg, run)
    start = time.monotonic()
    try:
        pending = start_sidecars(cfg, sidecars, config_file, run, procs)
        start_workers(cfg, config_file, run, resume, procs)
        wait_for_sidecars(cfg, pending)
        # a restarted sidecar cannot catch up with a streamed transport (rejoin a broadcast group, reload a
        # version that only lived in the trainer's buffer): a dead one stops the run
        restarts = 0 if transport_of(cfg).streamed else cfg.launcher.max_restarts
        budget = {name: restarts for name, _, _ in sidecars}
        supervise(procs, progress, cfg.launcher.poll_s, {"orchestrator", "trainer"}, budget)
    except ProcessFailed as e:
        print(file=sys.stderr)
        log.error(str(e))
        _shield_from_signals()
        stop(procs, cfg.launcher.shutdown_timeout_s)
        log.error(f"stopped the other processes: {', '.join(p.name for p in procs)}")
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        _shield_from_signals()
        print(file=sys.stderr)
        log.warning("interrupted: stopping " + ", ".join(p.name for p in procs))
        stop(procs, cfg.launcher.shutdown_timeout_s)
        raise
    # a sidecar that never got healthy, or a bug here: never leave the children running
    except BaseException:
        _shield_from_signals()
        stop(procs, cfg.launcher.shutdown_timeout_s)
        raise
    stop(procs, cfg.launcher.shutdown_timeout_s)
    summarize(cfg, run, progress, time.monotonic() - start)
