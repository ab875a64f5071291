"""The progress line of `asyncrl rl`: read from the processes' metrics files as they grow, with what a
step dropped or truncated, and the seconds a step takes."""

from __future__ import annotations

import json
import logging
import statistics
import sys

from asyncrl.paths import RunDir

log = logging.getLogger("asyncrl.rl")


class Progress:
    """A one-line view of the run, read incrementally from the metrics JSONL files.

    A view only: it must never stop the run it shows. A file replaced or cut shorter (a process that
    resumes rewrites its file) is read again from the start, a line it cannot parse is skipped, and any
    other error is logged once and the display goes on without it.
    """

    def __init__(
        self,
        run: RunDir,
        enabled: bool,
        max_steps: int,
        samples_per_step: int = 0,
        seq_len: int = 0,
        groups_per_step: int = 0,
    ):
        self.run, self.enabled, self.max_steps = run, enabled, max_steps
        self.samples_per_step, self.seq_len, self.warned = samples_per_step, seq_len, False
        self.groups_per_step, self.warned_dropped = groups_per_step, False  # 0: the step count is not fixed
        self.tty = sys.stdout.isatty()
        self.offsets: dict[str, tuple[int, int]] = {}  # process -> (inode, byte offset)
        self.last: dict[str, dict] = {"orchestrator": {}, "trainer": {}}
        self.train_times: dict[int, float] = {}  # trainer step -> time its row was written
        self.shown_step = -1
        self.failed = False

    def _read(self, process: str) -> None:
        path = self.run.metrics_file(process)
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        inode, offset = self.offsets.get(process, (st.st_ino, 0))
        if inode != st.st_ino or st.st_size < offset:
            offset = 0  # rewritten since the last read
        with path.open("rb") as f:
            f.seek(offset)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # being written; read it next time
                offset += len(line)
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    self.last[process] = row
                    if process == "trainer" and isinstance(row.get("step"), int):
                        self.train_times[row["step"]] = row.get("time", 0.0)
        self.offsets[process] = (st.st_ino, offset)

    def update(self) -> None:
        try:
            self._update()
        except Exception as e:  # noqa: BLE001 -- a display error must never stop a run
            if not self.failed:
                log.warning(f"progress display stopped: {type(e).__name__}: {e}")
            self.failed = True

    def _update(self) -> None:
        if self.failed:
            return
        self._read("orchestrator")
        self._read("trainer")
        o, t = self.last["orchestrator"], self.last["trainer"]
        self._warn_truncated(o)
        dropped = self.all_dropped(o)
        if dropped and not self.warned_dropped:
            self.warned_dropped = True  # once: the progress line says it at every such step
            log.warning(
                f"rollout step {o.get('step')}: {dropped}; check orchestrator.group_size and the rewards"
            )
        step = t.get("step", -1)
        if not self.enabled or (step == self.shown_step and not self.tty):
            return
        self.shown_step = step
        print(self.line(o, t, dropped), end="" if self.tty else "\n", flush=True)

    def line(self, o: dict, t: dict, dropped: str | None) -> str:
        """The progress line: the trainer's step as its metrics number it (from 0), and how many are done."""
        step = t.get("step", -1)
        line = (
            f"step {step if step >= 0 else '-'} ({step + 1}/{self.max_steps} done) | reward "
            f"{o.get('rollout/reward_mean', float('nan')):.3f} (rollout step {o.get('step', -1)}) | loss "
            f"{t.get('train/loss', float('nan')):+.4f} | {t.get('train/tokens_per_s', 0):.0f} train tok/s | "
            f"{o.get('rollout/throughput_tok_s', 0):.0f} gen tok/s"
        )
        if dropped:
            line += f" | rollout step {o.get('step')}: {dropped}"
        return ("\r" + line.ljust(110)) if self.tty else line

    def all_dropped(self, o: dict) -> str | None:
        """Why the orchestrator's last step trains nothing, when every group of it was dropped, else
        ``None``."""
        dropped = o.get("rollout/dropped_groups", 0)
        if not self.groups_per_step or not isinstance(dropped, int) or dropped < self.groups_per_step:
            return None
        filtered = {
            k.removeprefix("rollout/filtered_"): v for k, v in o.items() if k.startswith("rollout/filtered_")
        }
        reasons = ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in filtered.items() if n)
        zero = dropped - sum(v for v in filtered.values() if isinstance(v, int))
        if zero > 0:
            reasons = ", ".join(
                filter(None, [f"{zero} with zero advantage (equal rewards in the group)", reasons])
            )
        return f"all {dropped} groups dropped ({reasons}), nothing to train on"

    def _warn_truncated(self, o: dict) -> None:
        cut = o.get("rollout/truncated", 0)
        if (
            not self.warned
            and self.samples_per_step
            and isinstance(cut, int)
            and 2 * cut > self.samples_per_step
        ):
            self.warned = True  # once: the orchestrator's log has it every time
            log.warning(
                f"step {o.get('step')}: {cut} of {self.samples_per_step} samples were cut at seq_len="
                f"{self.seq_len}: the run learns from truncated completions; raise seq_len or lower "
                "orchestrator.max_tokens"
            )

    def seconds_per_step(self) -> float | None:
        times = [self.train_times[s] for s in sorted(self.train_times)]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        return statistics.median(gaps) if gaps else None
