"""Writers of real log files for the tests: TensorBoard event files (torch's SummaryWriter)
and offline W&B runs (wandb itself, in a subprocess that cannot reach the network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path


def write_events(folder: Path, tag: str, steps, values, extra: dict | None = None) -> None:
    """One writer, one event file, like a training job's rank 0."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for step, value in zip(steps, values, strict=True):
        writer.add_scalar(tag, float(value), int(step))
        for name, scale in (extra or {}).items():
            writer.add_scalar(name, scale * float(value), int(step))
    writer.close()


OFFLINE_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_DISABLE_GIT": "true",
    "WANDB_DISABLE_CODE": "true",
    # anything that tried the network would meet a closed port
    "WANDB_BASE_URL": "http://127.0.0.1:9",
    "HTTP_PROXY": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "NO_PROXY": "",
}


def write_wandb_runs(directory: Path, runs: dict[str, dict]) -> None:
    """Offline W&B runs written by wandb itself, in a subprocess with no network.

    ``runs``: key -> {config, steps, loss, and optionally name (else the key), tag, id (a run
    id: a second entry with the same id resumes that run, in a folder of its own)}.
    """
    import wandb  # noqa: F401  a dependency of the package: missing is a failure, not a skip

    directory.mkdir(parents=True, exist_ok=True)
    payload = directory / "runs.json"
    payload.write_text(json.dumps(runs))
    script = textwrap.dedent(
        """
        import json, sys, time, wandb
        runs = json.load(open(sys.argv[1]))
        seen = set()
        for name, run in runs.items():
            if run.get("id") in seen:  # a resumed job starts later: its folder, named by the
                time.sleep(1.1)        # second it starts, is then its own, as in real use
            seen.add(run.get("id"))
            r = wandb.init(project="family", name=run.get("name", name), group="fam",
                           dir=sys.argv[2], config=run["config"], id=run.get("id"),
                           resume="allow" if run.get("id") else None,
                           settings=wandb.Settings(x_disable_stats=True))
            for step, value in zip(run["steps"], run["loss"]):
                r.log({run.get("tag", "lm loss"): value, "lr": 1e-3}, step=step)
            r.finish()
        """
    )
    env = {**os.environ, **OFFLINE_ENV, "WANDB_DIR": str(directory)}
    subprocess.run(
        [sys.executable, "-c", script, str(payload), str(directory)],
        check=True,
        env=env,
        timeout=240,
        cwd=directory,
    )
    for log in directory.glob("wandb/*/logs/debug*.log"):  # no attempt met the closed port
        assert "connection refused" not in log.read_text(errors="replace").lower(), log
