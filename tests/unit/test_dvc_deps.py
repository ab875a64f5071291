"""Every DVC stage depends on the asyncrl source it runs, and on no other.

A stage's source is the import closure (grimp's graph of src/asyncrl) of the modules its commands start:
`asyncrl X` runs asyncrl.cli and the module that cli.COMMANDS names for X, `python -m asyncrl.x` runs
asyncrl.x, and a command that starts others as subprocesses (`asyncrl rl` starts serve, orchestrate and
train; `asyncrl eval` starts serve) runs theirs too. Importing a module runs its parent packages'
__init__.py, so those count. Imports inside functions count, except those of a GPU-only module (the vLLM
backend, the flash-attn-4 ops, the NCCL and IPC weight transports): every stage here runs on the CPU and
never takes those paths, and a GPU-only module imported at module top is in the closure like any other.

The dep paths of a stage (a directory covers what lies under it) must cover every file of its closure, and
no file outside it except in a directory that stands for its files: one where the stage imports at least
half of them and no GPU-only one goes unimported (a list one can read, at
the price of a rerun when an unimported CPU module beside the imported ones changes). On failure the message
gives each stage's src/ deps as they should read; `python tests/unit/test_dvc_deps.py --fix` writes them
into the dvc.yaml files.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import grimp
import yaml

from asyncrl.cli import COMMANDS
from asyncrl.config.variants import LOSSES, TRANSPORTS
from asyncrl.envs.registry import BUILTIN

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PIPELINES = [ROOT / "dvc.yaml", *sorted((ROOT / "experiments").glob("*/dvc.yaml"))]
# GPU-only modules, by a part of their dotted name: the vLLM backend (inference.vllm_*, inference.vllm.*),
# the flash-attn-4 ops, the NCCL and IPC weight transports
GPU_ONLY = re.compile(r"\.(vllm|fa4|nccl|ipc)(\.|$)")
# modules that start other asyncrl commands as subprocesses, with a command name that is not a literal at the
# call (utils/children.asyncrl_argv(command, ...) in a loop); literal ones are found in the source
# modules imported by a name the code holds as data, which the import graph cannot see: the built-in
# environments, weight transports and losses, which their registries import on first use
BY_NAME = {
    "asyncrl.envs.registry": frozenset(path.partition(":")[0] for path in BUILTIN.values()),
    "asyncrl.config.variants": frozenset(
        module
        for registry in (TRANSPORTS, LOSSES)
        for module in (path.partition(":")[0] for path in registry.builtin.values())
        if not GPU_ONLY.search(module)  # a CPU stage's config never names a GPU-only transport
    ),
}
SPAWNS_IN_A_LOOP = {"asyncrl.launcher.rl": ("orchestrate", "train")}
SPAWN_CALL = "asyncrl_argv"


@cache
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("asyncrl", exclude_type_checking_imports=True, cache_dir=None)


def module_file(module: str) -> Path:
    base = SRC / Path(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


@cache
def function_level_lines(module: str) -> frozenset[int]:
    """Line numbers of the import statements inside a function of ``module``."""
    tree = ast.parse(module_file(module).read_text())
    lines = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            lines |= {n.lineno for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)}
    return frozenset(lines)


@cache
def imports(module: str) -> frozenset[str]:
    """What importing ``module`` may import: every module it imports, bar GPU-only ones imported in a
    function."""
    out = set()
    for imported in graph().find_modules_directly_imported_by(module):
        details = graph().get_import_details(importer=module, imported=imported)
        lazy = details and all(d["line_number"] in function_level_lines(module) for d in details)
        if not (lazy and GPU_ONLY.search(imported)):
            out.add(imported)
    return frozenset(out | BY_NAME.get(module, frozenset()))


@cache
def spawned(module: str) -> tuple[str, ...]:
    """Commands that ``module`` starts as `python -m asyncrl <command>` subprocesses."""
    found = list(SPAWNS_IN_A_LOOP.get(module, ()))
    for node in ast.walk(ast.parse(module_file(module).read_text())):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == SPAWN_CALL
        ):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and first.value in COMMANDS:
                found.append(first.value)
            elif module not in SPAWNS_IN_A_LOOP:
                raise AssertionError(
                    f"{module} starts a command it names at run time: list it in SPAWNS_IN_A_LOOP"
                )
    return tuple(found)


def ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@cache
def closure(entries: frozenset[str]) -> frozenset[str]:
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += ancestors(module)
        todo += imports(module)
        for command in spawned(module):
            todo += ["asyncrl.__main__", "asyncrl.cli", COMMANDS[command][0]]
    return frozenset(seen)


def entry_modules(cmd: str) -> frozenset[str]:
    """The asyncrl modules that a stage's shell command starts."""
    words = shlex.split(cmd.replace("${", "{"))
    entries = set()
    for i, word in enumerate(words):
        if word == "asyncrl" and i + 1 < len(words):
            assert words[i + 1] in COMMANDS, f"`asyncrl {words[i + 1]}` is no command of asyncrl.cli"
            entries |= {"asyncrl.cli", COMMANDS[words[i + 1]][0]}
        elif word == "-m" and i + 1 < len(words) and words[i + 1].split(".")[0] == "asyncrl":
            module = words[i + 1]
            entries.add(module + ".__main__" if (SRC / Path(*module.split("."))).is_dir() else module)
    return frozenset(entries)


@dataclass
class Stage:
    pipeline: Path
    name: str
    cmds: list[str]
    deps: list[str]
    wdir: Path
    prefix: str  # the path from the stage's working directory to the repository root

    def source_deps(self) -> list[str]:
        return [d for d in self.deps if d.startswith(f"{self.prefix}src/")]

    def covered(self) -> set[Path]:
        roots = self.roots()
        return {f for f in source_files() if any(f == r or r in f.parents for r in roots)}

    def roots(self) -> list[Path]:
        return [(self.wdir / d).resolve() for d in self.source_deps()]


def stages() -> list[Stage]:
    out = []
    for pipeline in PIPELINES:
        for name, stage in (yaml.safe_load(pipeline.read_text()).get("stages") or {}).items():
            body = stage.get("do", stage)
            wdir = (pipeline.parent / body.get("wdir", ".")).resolve()
            prefix = "" if wdir == ROOT else "../" * len(wdir.relative_to(ROOT).parts)
            cmds = body["cmd"] if isinstance(body["cmd"], list) else [body["cmd"]]
            out.append(Stage(pipeline, name, cmds, [str(d) for d in body.get("deps", [])], wdir, prefix))
    return out


@cache
def source_files() -> frozenset[Path]:
    return frozenset(p.resolve() for p in (SRC / "asyncrl").rglob("*.py"))


def needed_files(stage: Stage) -> set[Path]:
    entries = frozenset().union(*(entry_modules(c) for c in stage.cmds))
    return {module_file(m).resolve() for m in closure(entries)} if entries else set()


def gpu_only(file: Path) -> bool:
    module = ".".join(file.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
    return bool(GPU_ONLY.search(module))


def whole(folder: Path, files: set[Path]) -> bool:
    """Whether a dep on ``folder`` reads better than its files: half of them needed, no GPU-only one
    spare."""
    below = {f for f in source_files() if folder in f.parents}
    spare = below - files
    return bool(below) and 2 * len(spare) <= len(below) and not any(gpu_only(f) for f in spare)


def readable_cover(files: set[Path]) -> list[str]:
    """Paths that cover ``files``: a directory where ``whole``, else the files."""
    out = []

    def walk(folder: Path) -> None:
        if folder != SRC / "asyncrl" and whole(folder, files):
            out.append(folder)
            return
        for f in sorted(folder.glob("*.py")):
            if f.resolve() in files:
                out.append(f)
        for sub in sorted(p for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__"):
            walk(sub)

    walk(SRC / "asyncrl")
    return [str(p.relative_to(ROOT)) for p in out]


def problems(stage: Stage) -> list[str]:
    need, have = needed_files(stage), stage.covered()
    missing = sorted(need - have)
    # a file the stage never imports may ride along only in a directory that reads better whole
    wholes = [r for r in stage.roots() if r.is_dir() and whole(r, need)]
    extra = sorted(f for f in have - need if not any(r in f.parents for r in wholes))
    if not missing and not extra:
        return []
    rel = lambda files: ", ".join(str(f.relative_to(ROOT)) for f in files)  # noqa: E731
    want = "\n".join(f"      - {stage.prefix}{p}" for p in readable_cover(need))
    return [
        f"{stage.pipeline.relative_to(ROOT)} stage {stage.name}: "
        + (f"imports {rel(missing)}, in no dep; " if missing else "")
        + (f"depends on {rel(extra)}, which it never imports; " if extra else "")
        + f"its src deps should read:\n{want}"
    ]


def test_every_stage_depends_on_exactly_the_source_it_imports():
    found = [p for stage in stages() for p in problems(stage)]
    assert not found, "\n".join(found) + "\n(python tests/unit/test_dvc_deps.py --fix writes these)"


def test_the_closure_follows_the_cli_the_subprocesses_and_the_parent_packages():
    rl = closure(entry_modules("asyncrl rl --config-file params.yaml"))
    for command in ("serve", "orchestrate", "train"):
        assert COMMANDS[command][0] in rl, command
    assert {"asyncrl", "asyncrl.cli", "asyncrl.__main__"} <= rl
    curves = closure(entry_modules("python -m asyncrl.monitor.curves a b"))
    assert {"asyncrl", "asyncrl.monitor", "asyncrl.monitor.curves"} <= curves and "asyncrl.cli" not in curves
    # the vLLM backend is imported only in a function, on the GPU path: no dep of a CPU stage
    assert not any(GPU_ONLY.search(m) and ".vllm" in m for m in rl)


def test_a_missing_or_extra_dep_is_reported_with_the_lines_to_write():
    stage = next(s for s in stages() if s.pipeline == ROOT / "dvc.yaml" and s.name == "prepare")
    need = readable_cover(needed_files(stage))
    stage.deps = [d for d in stage.deps if not d.startswith("src/")] + need[1:] + ["src/asyncrl/trainer"]
    (why,) = problems(stage)
    assert "in no dep" in why and "never imports" in why and f"      - {need[0]}" in why


def fix() -> None:
    """Rewrite each stage's src/ deps in its dvc.yaml (in place, the rest of the file as it is)."""
    for pipeline in PIPELINES:
        text = pipeline.read_text().splitlines(keepends=True)
        with_deps = [s for s in stages() if s.pipeline == pipeline and s.deps]
        blocks = [i for i, line in enumerate(text) if line.strip() == "deps:"]
        assert len(blocks) == len(with_deps), f"{pipeline}: cannot match the deps: blocks to the stages"
        for start, stage in reversed(list(zip(blocks, with_deps, strict=True))):
            end = start + 1
            while end < len(text) and text[end].lstrip().startswith("- "):
                end += 1
            items = text[start + 1 : end]
            indent = items[0][: len(items[0]) - len(items[0].lstrip())]
            src = [i for i, line in enumerate(items) if line.strip()[2:].startswith(f"{stage.prefix}src/")]
            keep = [line for i, line in enumerate(items) if i not in src]
            at = src[0] if src else len(keep)
            new = [f"{indent}- {stage.prefix}{p}\n" for p in readable_cover(needed_files(stage))]
            text[start + 1 : end] = keep[:at] + new + keep[at:]
        pipeline.write_text("".join(text))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fix", action="store_true", help="write each stage's src/ deps into its dvc.yaml")
    if parser.parse_args().fix:
        fix()
