"""Benchmark: the mutation score of the pure modules against their fast tests (cosmic-ray).

    nice -n 19 python benchmarks/bench_mutation.py                      # all modules and mutants
    nice -n 19 python benchmarks/bench_mutation.py --modules gates,flops --sample 12 --seed 0

For each module of workflow/collapse/ named in MODULE_TESTS, cosmic-ray's `init` writes every
mutant of the module (its core operators: binary, comparison, unary and boolean operators,
numbers +-1, True/False, break/continue, exception types, decorators, zero-iteration loops) into
a cosmic-ray database; mutants inside type annotations are left out (every module has
`from __future__ import annotations`, so they cannot change behaviour). With --sample N a seeded
random sample of N mutants per module is run, else all of them (hours on 2 cores). Each mutant
is applied to the file in place by cosmic-ray, the module's fast tests run against it
(`pytest -x -q -p no:cacheprovider -m "not slow" FILES`), and the file is restored. A failing
test run kills the mutant, a run past the timeout counts as killed too (column "timeout");
score = (killed + timeout) / run. The unmutated tests run first and must pass; the default
timeout is 3 x that baseline + 10 s.

Printed: a table per module (mutants generated, run, killed, survived, timeout, score %, minutes)
and every surviving mutant (file:line, the enclosing function, operator, the line before ->
after). --db-dir keeps the mutant databases (`cr-report DIR/gates.sqlite` reads one).
A benchmark: nothing is asserted.

Mutating in place is guarded three ways: the script refuses to start when a module file has
uncommitted changes, restores every module file from memory on exit (Ctrl-C and SIGTERM too),
and checks at the end that `git diff --quiet -- workflow/collapse` holds. Run it niced on a
shared machine; every test run is a child of this process and inherits the niceness.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cosmic_ray.commands.init import init as cr_init
from cosmic_ray.mutating import use_mutation
from cosmic_ray.plugins import get_operator
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path("workflow/collapse")

# module -> the fast test files that exercise it (those that import it, not marked slow)
MODULE_TESTS = {
    "analysis": [
        "tests/test_pinned_statistics.py",
        "tests/test_gates.py",
        "tests/test_bad_curves.py",
        "tests/test_analyze_cli.py",
    ],
    "gates": ["tests/test_gates.py", "tests/test_pinned_statistics.py"],
    "reference": [
        "tests/test_reference.py",
        "tests/test_gates.py",
        "tests/test_pinned_statistics.py",
    ],
    "surrogate": ["tests/test_surrogate.py", "tests/test_reference.py", "tests/test_predict.py"],
    "predict": ["tests/test_predict.py", "tests/test_predict_drift.py"],
    "scaling": ["tests/test_scaling.py", "tests/test_flops.py"],
    "flops": ["tests/test_flops.py"],
    "curves": ["tests/test_curves.py", "tests/test_reference.py", "tests/test_predict_drift.py"],
}
PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider", "-m", "not slow"]


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) (line, column) of every annotation in `source`: parameters, returns, fields."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        notes = []
        if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
            notes.append(node.annotation)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            notes.append(node.returns)
        spans += [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)) for n in notes]
    return spans


def test_command(module: str) -> list[str]:
    return [sys.executable, "-m", "pytest", *PYTEST_ARGS, *MODULE_TESTS[module]]


def run_tests(cmd: list[str], timeout: float) -> tuple[str, str]:
    """('passed' | 'failed' | 'timeout', output tail); the whole process group dies on any exit."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", ""
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    text = out.decode(errors="replace")[-2000:]
    return ("passed" if proc.returncode == 0 else "failed"), text


def drop_bytecode(path: Path) -> None:
    """Remove the module's cached bytecode so no test run can import a stale copy."""
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def changed_line(before: str, after: str) -> str:
    old = [line.strip() for line in before.splitlines()]
    new = [line.strip() for line in after.splitlines()]
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new).get_opcodes():
        if tag != "equal":
            return f"{' / '.join(old[i1:i2])}  ->  {' / '.join(new[j1:j2])}"
    return "(no change)"


def mutants(module: str, db_path: Path, sample: int, seed: int):
    """Every mutant of the module outside annotations (a seeded sample of `sample` if > 0)."""
    path = PACKAGE / f"{module}.py"
    with use_db(str(db_path), WorkDB.Mode.create) as db:
        cr_init([path], db, {})
        items = list(db.work_items)
    spans = annotation_spans((ROOT / path).read_text())

    def in_annotation(pos):
        return any(start <= tuple(pos) < end for start, end in spans)

    items = [i for i in items if not in_annotation(i.mutations[0].start_pos)]
    items.sort(key=lambda i: (tuple(i.mutations[0].start_pos), i.mutations[0].operator_name))
    generated = len(items)
    if 0 < sample < len(items):
        items = random.Random(f"{seed}:{module}").sample(items, sample)
        items.sort(key=lambda i: (tuple(i.mutations[0].start_pos), i.mutations[0].operator_name))
    return generated, items


def run_module(module: str, args, db_dir: Path) -> dict:
    path = ROOT / PACKAGE / f"{module}.py"
    cmd = test_command(module)
    t0 = time.monotonic()
    outcome, out = run_tests(cmd, timeout=args.baseline_timeout)
    baseline = time.monotonic() - t0
    if outcome != "passed":
        sys.exit(f"{module}: the unmutated tests do not pass ({outcome}):\n{out}")
    timeout = args.timeout or 3 * baseline + 10
    db_path = db_dir / f"{module}.sqlite"
    generated, items = mutants(module, db_path, args.sample, args.seed)
    print(
        f"[{module}] {generated} mutants, running {len(items)}; baseline {baseline:.1f} s, "
        f"timeout {timeout:.0f} s: {shlex.join(cmd[1:])}",
        file=sys.stderr,
        flush=True,
    )
    row = dict(module=module, generated=generated, run=0, killed=0, survived=0, timeout=0)
    survivors = []
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        for n, item in enumerate(items, 1):
            spec = item.mutations[0]
            operator = get_operator(spec.operator_name)(**(spec.operator_args or {}))
            start = time.monotonic()
            with use_mutation(spec.module_path, operator, spec.occurrence) as (before, after):
                if after is None:
                    continue
                drop_bytecode(path)
                outcome, out = run_tests(cmd, timeout)
            drop_bytecode(path)
            line = spec.start_pos[0]
            op = spec.operator_name.removeprefix("core/")
            status = {"passed": "survived", "failed": "killed", "timeout": "timeout"}[outcome]
            row["run"] += 1
            row[status] += 1
            if status == "survived":
                where = f"{PACKAGE / module}.py:{line} in {spec.definition_name or 'the module'}"
                survivors.append((where, op, changed_line(before, after)))
            db.set_result(
                item.job_id,
                WorkResult(
                    worker_outcome=WorkerOutcome.NORMAL,
                    test_outcome=TestOutcome.SURVIVED
                    if status == "survived"
                    else TestOutcome.KILLED,
                    output=out or "timeout",
                    diff="".join(
                        difflib.unified_diff(before.splitlines(True), after.splitlines(True))
                    ),
                ),
            )
            took = time.monotonic() - start
            eta = (time.monotonic() - t0) / n * (len(items) - n)
            print(
                f"  [{module} {n}/{len(items)}] {status:8s} {took:5.1f} s  line {line:4d} {op}"
                f"  (module ETA {eta / 60:.1f} min)",
                file=sys.stderr,
                flush=True,
            )
    row["seconds"] = time.monotonic() - t0
    row["survivors"] = survivors
    return row


TABLE = "{:10s} {:>8} {:>5} {:>7} {:>9} {:>8} {:>8} {:>6}"


def table_row(r: dict, seconds: float) -> str:
    score = 100 * (r["killed"] + r["timeout"]) / r["run"] if r["run"] else float("nan")
    return TABLE.format(
        r["module"],
        r["generated"],
        r["run"],
        r["killed"],
        r["survived"],
        r["timeout"],
        f"{score:.1f}",
        f"{seconds / 60:.1f}",
    )


def restore(originals: dict[Path, bytes]) -> list[Path]:
    restored = []
    for path, content in originals.items():
        if path.read_bytes() != content:
            path.write_bytes(content)
            restored.append(path)
    return restored


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modules", default=",".join(MODULE_TESTS), help="comma-separated")
    p.add_argument("--sample", type=int, default=0, help="mutants per module (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=0, help="s per test run (0: 3 x baseline + 10)")
    p.add_argument("--baseline-timeout", type=float, default=600, help=argparse.SUPPRESS)
    p.add_argument("--db-dir", type=Path, help="keep the cosmic-ray mutant databases here")
    args = p.parse_args(argv)
    modules = [m for m in args.modules.split(",") if m]
    unknown = sorted(set(modules) - set(MODULE_TESTS))
    if unknown:
        p.error(f"unknown modules {unknown}; known: {', '.join(MODULE_TESTS)}")

    files = [PACKAGE / f"{m}.py" for m in modules]
    dirty = git("status", "--porcelain", "--", *map(str, files)).stdout.strip()
    if dirty:
        sys.exit(
            f"refusing to mutate files with uncommitted changes; commit or stash them:\n{dirty}"
        )
    os.chdir(ROOT)
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "workflow"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    commit = git("rev-parse", "--short", "HEAD").stdout.strip()
    originals = {ROOT / f: (ROOT / f).read_bytes() for f in files}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)

    rows = []
    started = time.monotonic()
    tmp = None
    interrupted = False
    if args.db_dir:
        args.db_dir.mkdir(parents=True, exist_ok=True)
        db_dir = args.db_dir.resolve()
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_mutation-")
        db_dir = Path(tmp.name)
    try:
        for module in modules:
            rows.append(run_module(module, args, db_dir))
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted; restoring the module files", file=sys.stderr)
    finally:
        restored = restore(originals)
        for path in files:
            drop_bytecode(ROOT / path)
        if tmp is not None:
            tmp.cleanup()
    if restored:
        print(f"restored from memory: {', '.join(map(str, restored))}", file=sys.stderr)
    clean = git("diff", "--quiet", "--", str(PACKAGE)).returncode == 0

    sampled = "all mutants" if args.sample <= 0 else f"a sample of {args.sample}"
    print(f"\nmutation score, {sampled} per module, seed {args.seed}, commit {commit}")
    print(
        TABLE.format("module", "mutants", "run", "killed", "survived", "timeout", "score %", "min")
    )
    total = dict(module="all", generated=0, run=0, killed=0, survived=0, timeout=0)
    for r in rows:
        for k in list(total)[1:]:
            total[k] += r[k]
        print(table_row(r, r["seconds"]))
    if rows:
        print(table_row(total, time.monotonic() - started))
    survivors = [s for r in rows for s in r["survivors"]]
    if survivors:
        print("\nsurviving mutants:")
        for where, op, change in survivors:
            print(f"  {where}  {op}\n      {change}")
    if not clean:
        print("ERROR: workflow/collapse differs from git after the run", file=sys.stderr)
        return 1
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
