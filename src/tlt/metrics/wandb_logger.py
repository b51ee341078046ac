"""Weights & Biases logging of the step metrics (`run.logger=wandb`, the wandb extra).

wandb is imported only when asked for. `WANDB_MODE=offline` (read by wandb itself) writes the run under
RUN_DIR/wandb without a network; `wandb sync` uploads it later. The wandb run id is kept in RUN_DIR/wandb_id, so
`--resume` continues the same wandb run instead of starting a second one.
"""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

from tlt.errors import TltError

ID_FILE = "wandb_id"
INSTALL_HINT = 'run.logger=wandb needs the wandb package: pip install "tlt-rl[wandb]"'


class WandbError(TltError):
    """wandb asked for but unusable."""


def check_wandb_installed() -> None:
    """Before any worker starts (preflight): a missing package fails in a second, without importing it."""
    if importlib.util.find_spec("wandb") is None:
        raise WandbError(INSTALL_HINT)


class WandbLogger:
    def __init__(self, run):
        self.run = run

    @classmethod
    def start(cls, run_dir: Path, config, *, resuming: bool = False) -> "WandbLogger":
        try:
            import wandb
        except ImportError:
            raise WandbError(INSTALL_HINT) from None
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        run = wandb.init(project=config.run.wandb_project, name=config.run.wandb_run_name or run_dir.resolve().name,
                         id=_run_id(run_dir, resuming), resume="allow", dir=str(run_dir), config=config.to_dict())
        return cls(run)

    def log(self, step: int, scalars: dict) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def _run_id(run_dir: Path, resuming: bool) -> str:
    """A resumed run reuses its wandb id; a new run gets a new one."""
    path = run_dir / ID_FILE
    if resuming and path.exists() and path.read_text().strip():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:12]
    path.write_text(run_id + "\n")
    return run_id
