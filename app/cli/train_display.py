"""The live display of `casi train`: a progress bar with the latest numbers, and one line per
step (kept in the scroll-back and in logs) plus one table per held-out evaluation."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from app.cli.common import print_evaluation
from app.progress import console


def _fmt(m: dict[str, float], key: str, spec: str = "+.3f") -> str:
    return format(m[key], spec) if key in m else "—"


def step_line(m: dict[str, float], step: int, accepted: bool | None) -> str:
    """One step as a line: reward, gain over the query, KL, clipped / masked, MIPU, time. KL is
    the loss stack's KL to the reference when the preset has that term ("KL-ref"), else the
    sampler mismatch KL(μ‖π_old) ("KL-μ")."""
    kl_name = "KL-ref" if "kl/value" in m else "KL-μ"
    kl = m.get("kl/value", m.get("mismatch/kl_k3"))
    clip = next(
        (v for k, v in m.items() if k.endswith("clip_frac") and not k.startswith("shaping")), None
    )
    masked = 1.0 - m["stack/kept_frac"] if "stack/kept_frac" in m else None
    acc = m.get("count/mipu_accepted", 0.0), m.get("count/mipu_rejected", 0.0)
    rate = f"{acc[0] / sum(acc):.0%}" if sum(acc) else "—"
    return (
        f"step {step:>4}  reward {_fmt(m, 'reward_mean', '.3f')}  gain {_fmt(m, 'gain_mean')}  "
        f"{kl_name} {'—' if kl is None else f'{kl:.2e}'}  clipped {'—' if clip is None else f'{clip:.1%}'}  "
        f"masked {'—' if masked is None else f'{masked:.1%}'}  ok-format {_fmt(m, 'format_ok_fraction', '.0%')}  "
        f"accept {rate}{'' if accepted is None else (' ✓' if accepted else ' ✗ rolled back')}  "
        f"{'applied' if m.get('step_applied', 1.0) > 0 else 'SKIPPED (non-finite)'}  {m.get('time/step_s', 0.0):.1f}s"
    )


class TrainDisplay:
    """`with TrainDisplay(cfg, start) as d: run_training(..., on_step=d.step, on_eval=d.evaluation)`."""

    def __init__(self, cfg: Any, start_step: int, quiet: bool = False) -> None:
        self.cfg, self.quiet = cfg, quiet  # quiet: a non-zero torchrun rank shows nothing
        self.progress = Progress(
            TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[last]}"), console=console,
        )  # fmt: skip
        self.task = self.progress.add_task("train", total=cfg.steps, completed=start_step, last="")

    def __enter__(self) -> TrainDisplay:
        if not self.quiet:
            self.progress.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if not self.quiet:
            self.progress.stop()

    def step(self, result: Any) -> None:
        if self.quiet:
            return
        m = result.metrics
        self.progress.console.print(step_line(m, result.step, result.accepted))
        last = f"reward {_fmt(m, 'reward_mean', '.3f')} gain {_fmt(m, 'gain_mean')} {m.get('time/step_s', 0):.1f}s/step"
        self.progress.update(self.task, completed=result.step, last=last)

    def evaluation(self, step: int, result: Any) -> None:
        print_evaluation(
            result.metrics,
            f"held-out {self.cfg.eval.split} after step {step}: {result.n_queries} queries",
        )
