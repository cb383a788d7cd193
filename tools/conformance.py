"""The conformance matrix: every causal-LM family of the installed transformers × every torchshard capability.

    python3 dev.py conformance                   # every family, 2 worker processes; writes docs/conformance.md
    python3 dev.py conformance --families llama,mixtral   # those rows, printed (add --out to write them)
    python3 dev.py conformance --check           # exit 1 if any cell is ✗ (CI)

`tools` and `testsupport` are folders of the clone, not installed packages: dev.py puts the clone on PYTHONPATH
(``python -m tools.conformance`` from the clone's root does too).

Each family runs in a worker process (tools/capabilities.py does one row), so an XLA abort takes down
one family, whose remaining cells say so, and a fresh worker carries on with the next.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import difflib
import json
import os
import queue
import re
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

DOC, DATA = ROOT / "docs" / "conformance.md", ROOT / "docs" / "conformance.json"
BEGIN, END = "<!-- conformance:begin (written by tools/conformance.py) -->", "<!-- conformance:end -->"
VERSIONS = ("torch", "jax", "torchax", "transformers", "peft")
# what ends a process: XLA's and glog's fatal checks (F1126 12:00:00.1 ... file.cc:123] ...), Python's fatal errors
FATAL = re.compile(r"F\d{4} |Fatal Python error|.*Check failed")
XLA_FLAGS: set[str] = set()  # what the workers ran with (conftest.py picks them)


# ---------------------------------------------------------------- the worker: one family at a time, cells as JSON


def _setup_worker() -> None:
    """The test suite's process setup (root conftest.py): its XLA flags, 8 CPU devices, one OpenMP thread."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_torchshard_test_setup", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def worker(keys: list[str] | None) -> None:
    """Reads family names on stdin; writes one JSON line per cell, then {"done": ...}, on the original stdout."""
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed (tqdm, transformers, XLA) goes to stderr
    sys.stdout = sys.stderr
    _setup_worker()
    from tools.capabilities import run_family

    print(json.dumps({"xla_flags": os.environ.get("XLA_FLAGS", "")}), file=protocol, flush=True)

    for line in sys.stdin:
        name, begun, cpu = line.strip(), time.perf_counter(), _cpu_seconds()

        def starting(key: str, name: str = name) -> None:
            print(json.dumps({"family": name, "start": key}), file=protocol, flush=True)

        for key, cell in run_family(name, keys, starting=starting):
            print(json.dumps({"family": name, "key": key, "cell": dataclasses.asdict(cell)}), file=protocol, flush=True)
        done = {"done": round(time.perf_counter() - begun, 1), "cpu": round(_cpu_seconds() - cpu, 1)}
        print(json.dumps({"family": name, **done}), file=protocol, flush=True)


def _cpu_seconds() -> float:
    """CPU time of this process, all threads (XLA compiles on several): a family's cost on an idle machine."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------- the pool


@dataclasses.dataclass
class Result:
    kind: str = ""
    skipped: str = ""
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    cells: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


class Worker:
    """A worker process, its stdout lines on a queue, its stderr in a file (read back after a crash)."""

    def __init__(self, keys: list[str] | None, command: list[str] | None = None, *, xla_defaults: bool = False) -> None:
        only = ["--only", ",".join(keys)] if keys else []
        cmd = command or [sys.executable, str(Path(__file__).resolve()), "--worker", *only]
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by stop(), after the process)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        if xla_defaults:
            env = worker_env_with_xla_defaults(env)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     cwd=ROOT, env=env, start_new_session=True)  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, name: str) -> int:
        """Starts a family; returns where its stderr begins."""
        self.stderr.seek(0, os.SEEK_END)
        start = self.stderr.tell()
        assert self.proc.stdin is not None
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return start

    def tail(self, start: int) -> str:
        """The last lines the worker wrote to stderr since ``start`` (an XLA check's message, a traceback's end)."""
        self.stderr.seek(start)
        lines = [x.strip() for x in self.stderr.read().splitlines() if x.strip()]
        fatal = [x for x in lines if FATAL.match(x)]  # a check's message comes before its stack trace
        return " / ".join(fatal[-1:] or lines[-3:])[-400:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: XLA's threads and anything it started
        self.proc.wait()

    def stop(self) -> None:
        self.kill()
        self.reader.join()  # the pipe ends once the process is gone
        for pipe in (self.proc.stdin, self.proc.stdout, self.stderr):
            with contextlib.suppress(OSError):  # stdin: a dead reader's pipe
                if pipe is not None:
                    pipe.close()


def worker_env_with_xla_defaults(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a worker that compiles with XLA's default CPU flags (a family in `tools.families.XLA_DEFAULTS`):
    the flags a parent pytest process chose are dropped, and conftest.py, told so, leaves out its fast ones.

    Examples:
        >>> worker_env_with_xla_defaults({"_TORCHSHARD_TEST_XLA_FLAGS": "--xla_backend_optimization_level=0"})
        {'TORCHSHARD_TEST_XLA_DEFAULTS': '1'}
    """
    rest = {k: v for k, v in env.items() if k != "_TORCHSHARD_TEST_XLA_FLAGS"}
    return {**rest, "TORCHSHARD_TEST_XLA_DEFAULTS": "1"}


def _death(proc: subprocess.Popen[str]) -> str:
    code = proc.wait()
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited {code}"


def _run_one(worker: Worker, name: str, keys: list[str], timeout: float) -> tuple[Result, bool]:
    """One family on ``worker``: its result, and whether the worker is still usable."""
    result, start, begun = Result(), worker.send(name), time.perf_counter()
    current = None  # the capability running now
    while True:
        try:
            line = worker.lines.get(timeout=max(1.0, timeout - (time.perf_counter() - begun)))
        except queue.Empty:
            line, why, tail = None, f"timed out after {timeout:.0f} s", ""
            worker.kill()
        else:
            why = "" if line is not None else f"crashed ({_death(worker.proc)})"
            tail = "" if line is not None else f": {worker.tail(start)}"
        if line is None:
            for key in keys:
                text = (
                    f"{why}{tail}" if key == current or current is None else f"not run: the worker {why} in {current}"
                )
                result.cells.setdefault(key, {"status": "fail", "text": text, "seconds": 0.0})
            result.seconds = round(time.perf_counter() - begun, 1)
            return result, False
        message = json.loads(line)
        if "xla_flags" in message:
            XLA_FLAGS.add(message["xla_flags"])
            continue
        if "start" in message:
            current = message["start"]
            continue
        if "done" in message:
            result.seconds, result.cpu_seconds = message["done"], message["cpu"]
            return result, True
        cell = message["cell"]
        if message["key"] == "kind":
            result.kind = cell["text"]
        elif message["key"] == "skipped":
            result.skipped = cell["text"]
        else:
            result.cells[message["key"]] = cell


def _summary(result: Result) -> str:
    if result.skipped:
        return f"skipped: {result.skipped}"
    counts = {s: sum(c["status"] == s for c in result.cells.values()) for s in ("ok", "refused", "fail")}
    return f"{counts['ok']} ✓, {counts['refused']} refused, {counts['fail']} ✗"


def run_pool(
    names: list[str],
    keys: list[str],
    *,
    jobs: int,
    timeout: float,
    done: Callable[[dict[str, Result]], None],
    budget: float = float("inf"),
) -> dict[str, Result]:
    """Every family on ``jobs`` workers; a worker that dies or hangs is replaced. Prints a line per family
    and calls ``done`` with the results so far. No family starts after ``budget`` seconds: those left out
    are missing from the results (the report counts them)."""
    from tools.families import XLA_DEFAULTS

    todo: queue.Queue[str] = queue.Queue()
    for name in names:
        todo.put(name)
    results: dict[str, Result] = {}
    lock, begun = threading.Lock(), time.perf_counter()

    def slot() -> None:
        workers: dict[bool, Worker] = {}  # by whether it compiles with XLA's defaults (XLA_DEFAULTS)
        while time.perf_counter() - begun < budget:
            try:
                name = todo.get_nowait()
            except queue.Empty:
                break
            defaults = name in XLA_DEFAULTS
            worker = workers.get(defaults) or Worker(keys, xla_defaults=defaults)
            workers[defaults] = worker
            result, usable = _run_one(worker, name, keys, timeout)
            if not usable:
                workers.pop(defaults).stop()
            with lock:
                results[name] = result
                elapsed = time.perf_counter() - begun
                print(f"[{len(results)}/{len(names)} {elapsed:5.0f} s] {name}: {result.seconds:.0f} s "
                      f"(CPU {result.cpu_seconds:.0f} s), {_summary(result)}", flush=True)  # fmt: skip
                done({n: results[n] for n in names if n in results})
        for worker in workers.values():
            worker.stop()

    threads = [threading.Thread(target=slot) for _ in range(max(1, min(jobs, len(names))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {name: results[name] for name in names if name in results}


# ---------------------------------------------------------------- the table


def _versions() -> dict[str, str]:
    import importlib.metadata

    return {name: importlib.metadata.version(name) for name in VERSIONS}


def _cell_text(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return ""
    prefix = {"ok": "✓ ", "refused": "refused: ", "fail": "✗ ", "n/a": "— "}[cell["status"]]
    return (prefix + cell["text"]).strip().replace("|", "\\|").replace("\n", " ")


def render(report: dict[str, Any]) -> str:
    """The markdown between the markers: how to read it, the tolerances, versions and command, then the table."""
    from tools.capabilities import COLUMNS

    families = report["families"]
    counted = [c for r in families.values() for c in r["cells"].values()]
    totals = {s: sum(c["status"] == s for c in counted) for s in ("ok", "refused", "fail")}
    versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items())
    cpu = sum(r["cpu_seconds"] for r in families.values())
    lines = [
        BEGIN,
        "",
        f"Generated by `{report['command']}` on {report['date']} in {report['seconds'] / 60:.1f} min with "
        f"{report['jobs']} worker processes (the families' CPU time: {cpu / 60:.1f} min); {versions}; "
        f"XLA_FLAGS `{report['xla_flags']}`. Column s: a family's wall-clock seconds."
        + "".join(
            f" Rows of {', '.join(m['families'])} from `{m['command']}` on {m['date']}."
            for m in report.get("merged", [])
        )
        + (f" **Partial: {report['partial']} so far.**" if report.get("partial") else ""),
        "",
        "How to read a cell: **✓ d**: the capability ran and agrees with eager, unsharded torch on CPU; d is the "
        "largest difference found (relative, for losses; scaled by max(1, max|eager|), for logits) — for generate, "
        "every token is equal; for plan --compile, the compiled step's peak bytes per device. **refused: reason**: "
        "torchshard raised a typed error (ShardingError, ArgumentError, CheckpointError) before producing any "
        "result. **✗ reason**: anything else — a difference over the tolerance, an untyped exception, a typed "
        "error after work began, a crash or a timeout of the worker process (with the end of its stderr). "
        "**—**: does not apply (MoE columns on dense families; LoRA where the tp_plan names no Linear layer), or "
        "no truth: eager torch itself fails on that capability's reference (its error is quoted). "
        "`(warned: ...)` quotes a torchshard warning the capability raised; `(FSDP: no tp_plan)` marks a cell run "
        "on FSDP alone because hf_rules refuses a family without a tensor-parallel plan. Every family is a tiny "
        "config derived from its default one by tools/tiny.py (2 layers, vocab 128, windows of 8 tokens, up to 8 "
        "experts, width shrunk), keeping the relations between its fields (head dims, GQA ratio, ...: see above).",
        "",
        f"Cells: {totals['ok']} ✓, {totals['refused']} refused, {totals['fail']} ✗; "
        f"{sum(bool(r['skipped']) for r in families.values())} of {len(families)} families skipped.",
        "",
        "| column | what runs, and its truth and tolerance |",
        "|---|---|",
        *(f"| {c.title} | {c.truth} |" for c in COLUMNS),
        "",
        "| family | kind | s | " + " | ".join(c.title for c in COLUMNS) + " |",
        "|---|---|---|" + "---|" * len(COLUMNS),
    ]
    for name, r in sorted(families.items()):
        if r["skipped"]:
            cells = [f"skipped: {r['skipped']}"] + [""] * (len(COLUMNS) - 1)
        else:
            cells = [_cell_text(r["cells"].get(c.key)) for c in COLUMNS]
        lines.append(f"| {name} | {r['kind']} | {r['seconds']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", END])


def write_markdown(path: Path, block: str) -> None:
    """Puts ``block`` between the markers of ``path`` (created with a title when missing); the rest stays."""
    text = path.read_text() if path.exists() else f"# Conformance matrix\n\n{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + block + tail)


def failures(families: dict[str, Any]) -> list[str]:
    """``family/column`` of every ✗ cell of a report's families."""
    return [f"{n}/{k}" for n, r in families.items() for k, c in r["cells"].items() if c["status"] == "fail"]


def regressions(failed: list[str], baseline: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(``failed`` cells the baseline report had as ✓, refused or not applying; those it has no cell for).

    Examples:
        >>> base = {"llama": {"cells": {"train": {"status": "ok"}, "generate": {"status": "fail"}}}}
        >>> regressions(["llama/train", "llama/generate", "gemma/train"], base)
        (['llama/train'], ['gemma/train'])
    """
    known = {f"{n}/{k}": c["status"] for n, r in baseline.items() for k, c in r["cells"].items()}
    return [f for f in failed if known.get(f, "fail") != "fail"], [f for f in failed if f not in known]


# ---------------------------------------------------------------- the command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 dev.py conformance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--families", help="comma-separated model types (default: every causal LM of transformers)")
    parser.add_argument("--only", help="comma-separated capability columns (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (>= 1; default: 2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one family may take (> 0; default: 900)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if any cell is ✗ (with --baseline: any new ✗), or if no cell ran")  # fmt: skip
    parser.add_argument("--baseline", type=Path, help="a results JSON: --check fails only on cells it had as ✓/refused")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="start no family after this many seconds (> 0; default: no limit)")  # fmt: skip
    parser.add_argument("--skip-slower", type=float, default=float("inf"), metavar="SECONDS",
                        help="with --baseline: leave out rows that took more CPU seconds there (> 0)")  # fmt: skip
    full = "for a full run without --baseline"
    parser.add_argument("--out", type=Path, help=f"markdown to write (default: {DOC.relative_to(ROOT)} {full})")
    parser.add_argument("--json", type=Path, help=f"results JSON (default: {DATA.relative_to(ROOT)} {full})")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="run nothing: write --out/--json from these results, later files' rows replacing earlier",
    )
    parser.add_argument(
        "--slice",
        metavar="K/N",
        help="only every N-th family from the K-th (sorted), and the "
        "representative ones (CI: K from the commit; see tools/rotation.py)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def _suite_first(names: list[str]) -> list[str]:
    """The families the test suite trains first (a run cut short has them), then the others."""
    from tools.families import DENSE, MOE

    suite = {f.model_type for f in DENSE + MOE}
    return sorted(names, key=lambda n: n not in suite)


def _report(argv: list[str], args: argparse.Namespace, results: dict[str, Result], seconds: float, of: int) -> dict:
    return {
        "command": " ".join(["python3 dev.py conformance", *map(shlex.quote, argv)]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _head(),  # what a later --slice run diffs against to find the families a change names
        "seconds": round(seconds, 1),
        "jobs": args.jobs,
        "versions": _versions(),
        "xla_flags": " | ".join(sorted(XLA_FLAGS)) or "(none)",
        "partial": f"{len(results)} of {of} families" if len(results) < of else "",
        "families": {name: dataclasses.asdict(r) for name, r in results.items()},
    }


def _head() -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip() if done.returncode == 0 else ""


def wholly_failed(names: list[str], baseline: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(``names`` to run, those whose every baseline cell is ✗: a crash or hang before any capability finished).

    Examples:
        >>> base = {"a": {"cells": {"train": {"status": "fail"}}}, "b": {"cells": {"train": {"status": "ok"}}}}
        >>> wholly_failed(["a", "b", "c"], base)
        (['b', 'c'], ['a'])
    """
    dead = [n for n in names if (cells := baseline.get(n, {}).get("cells")) and
            all(c["status"] == "fail" for c in cells.values())]  # fmt: skip
    return [n for n in names if n not in dead], dead


def slower(names: list[str], baseline: dict[str, Any], limit: float) -> tuple[list[str], list[str]]:
    """(``names`` to run, those whose baseline row took over ``limit`` CPU seconds, with their time).

    Examples:
        >>> base = {"a": {"cpu_seconds": 400.0, "seconds": 420.0}, "b": {"cpu_seconds": 20.0, "seconds": 25.0}}
        >>> slower(["a", "b", "c"], base, 300)
        (['b', 'c'], ['a (400 s)'])
    """
    cost = {n: r.get("cpu_seconds") or r.get("seconds", 0.0) for n, r in baseline.items()}
    slow = [n for n in names if cost.get(n, 0.0) > limit]
    return [n for n in names if n not in slow], [f"{n} ({cost[n]:.0f} s)" for n in slow]


def merge(base: dict[str, Any], *later: dict[str, Any]) -> dict[str, Any]:
    """``base`` with the cells of ``later`` reports (reruns of some families or columns) in place of its own.

    Examples:
        >>> row = lambda **cells: {"skipped": "", "cells": cells}
        >>> a = {"command": "a", "date": "d1", "families": {"x": row(train=1, lora=2), "y": row(train=3)}}
        >>> b = {"command": "b --only lora", "date": "d2", "families": {"x": row(lora=5)}}
        >>> m = merge(a, b)
        >>> m["families"]["x"]["cells"], m["merged"]
        ({'train': 1, 'lora': 5}, [{'command': 'b --only lora', 'date': 'd2', 'families': ['x']}])
    """
    families = {name: {**row, "cells": dict(row["cells"])} for name, row in base["families"].items()}
    report = {**base, "families": families, "merged": list(base.get("merged", []))}
    for rerun in later:
        for name, row in rerun["families"].items():
            kept = families.get(name)
            if kept and not set(row["cells"]) >= set(kept["cells"]):  # some columns rerun: the row's time stays
                row = {**kept, "cells": {**kept["cells"], **row["cells"]}}
            families[name] = row
        report["merged"].append({"command": rerun["command"], "date": rerun["date"],
                                 "families": sorted(rerun["families"])})  # fmt: skip
    return report


def _write(report: dict[str, Any], out: Path | None, data: Path | None) -> None:
    if out:
        write_markdown(out, render(report))
    if data:
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")


def destinations(args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """Where a run writes its table and JSON: ``--out``/``--json``, else the committed ones for a full run.

    A run against ``--baseline`` checks the committed table and writes nothing of its own accord: written over
    it, the rows it leaves out (``--skip-slower``, ``--budget``, rows wholly ✗) would be lost.

    Examples:
        >>> [destinations(_parser().parse_args(a)) for a in ([], ["--check", "--baseline", "b.json"])] == [
        ...     (DOC, DATA), (None, None)]
        True
    """
    full = not args.families and not args.only and not args.baseline and not args.slice
    return args.out or (DOC if full else None), args.json or (DATA if full else None)


def _numbers(args: argparse.Namespace) -> list[str]:
    """What is wrong with the numeric flags: each must be positive (a budget of 0 starts no family); ``--slice``."""
    problems = [] if args.jobs >= 1 else [f"--jobs {args.jobs}: give a number of worker processes >= 1, e.g. 2"]
    limits = {
        "--timeout": (args.timeout, "seconds one family may take, e.g. 900"),
        "--budget": (args.budget, "seconds after which no family starts, e.g. 900 (0 would start none)"),
        "--skip-slower": (args.skip_slower, "CPU seconds over which a baseline row is left out, e.g. 240"),
    }
    problems += [f"{flag} {value:g}: give {what}" for flag, (value, what) in limits.items() if not value > 0]
    if args.timeout == float("inf"):
        problems.append("--timeout inf: give a number of seconds, e.g. 900 (a hung worker must be stopped)")
    if args.skip_slower != float("inf") and not args.baseline:
        problems.append("--skip-slower reads each row's time from --baseline: add --baseline docs/conformance.json")
    k, _, n = (args.slice or "").partition("/")
    if args.slice and not (n.isdecimal() and int(n) >= 1 and (k == "commit" or (k.isdecimal() and int(k) < int(n)))):
        problems.append(f"--slice {args.slice!r}: give K/N with 0 <= K < N, or commit/N, e.g. 0/4 or commit/4")
    return problems


def _problems(args: argparse.Namespace, names: list[str], keys: list[str] | None) -> list[str]:
    """Every bad argument of a run, before anything runs or is written: unknown families and columns, the numbers."""
    from tools.capabilities import COLUMNS
    from tools.families import causal_lm_types

    known, columns = causal_lm_types(), [c.key for c in COLUMNS]
    problems = [f"--families: {n!r} is no causal LM of the installed transformers; closest: "
                f"{difflib.get_close_matches(n, known, n=3, cutoff=0.5)}" for n in names if n not in known]  # fmt: skip
    problems += [f"--only: {k!r} is no column; choose from {','.join(columns)}" for k in keys or [] if k not in columns]
    if args.baseline and not args.baseline.is_file():
        problems.append(
            f"--baseline {str(args.baseline)!r}: no such file; give a results JSON, e.g. docs/conformance.json"
        )
    return problems + _numbers(args)


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    keys = args.only.split(",") if args.only else None
    if args.worker:
        worker(keys)
        return 0
    if args.merge:
        _write(merge(*(json.loads(p.read_text()) for p in args.merge)), args.out or DOC, args.json or DATA)
        return 0
    from tools.capabilities import COLUMNS
    from tools.families import causal_lm_types

    names = args.families.split(",") if args.families else _suite_first(causal_lm_types())
    if problems := _problems(args, names, keys):
        parser.error(
            f"{len(problems)} bad argument(s), nothing run or written:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    out, data = destinations(args)
    table = json.loads(args.baseline.read_text()) if args.baseline else {}  # before any rewrite
    baseline = table.get("families") if args.baseline else None
    names = _chosen(args, names, table, baseline)
    if not names:  # a table of no rows would replace the committed one, and a check of none would pass
        print("conformance: no family left to run (see above why each was left out); nothing written", file=sys.stderr)
        return 1
    begun = time.perf_counter()

    def save(partial: dict[str, Result]) -> None:  # after each family: a run cut short keeps what it did
        _write(_report(argv, args, partial, time.perf_counter() - begun, len(names)), out, data)

    columns = keys or [c.key for c in COLUMNS]
    results = run_pool(names, columns, jobs=args.jobs, timeout=args.timeout, done=save, budget=args.budget)
    if len(results) < len(names):
        left = [n for n in names if n not in results]
        print(f"conformance: {len(left)} families not started within --budget {args.budget:.0f} s: {', '.join(left)}")
    if not results:
        print("conformance: no family ran (see above); nothing written or checked", file=sys.stderr)
        return 1
    report = _report(argv, args, results, time.perf_counter() - begun, len(names))
    _write(report, out, data)
    if not out and (args.families or args.only):  # the whole matrix checked against a baseline: its verdict only
        print(render(report))
    cpu = sum(r.cpu_seconds for r in results.values())
    print(f"conformance: {len(names)} families in {report['seconds'] / 60:.1f} min (CPU {cpu / 60:.1f} min)")
    return verdict(report, baseline) if args.check else 0


def _chosen(args: argparse.Namespace, names: list[str], table: dict[str, Any], baseline: Any) -> list[str]:
    """The families to run, in order: ``--slice``'s, less the rows ``--baseline`` says not to rerun (each named)."""
    if args.slice:
        from tools.families import REPRESENTATIVE
        from tools.rotation import parse_slice, sliced, touched

        part, parts = parse_slice(args.slice)
        # first, so that --budget never cuts them: the rows the change since the baseline's commit names, then
        # the representative rows (a budget-cut gate had run neither mixtral nor deepseek_v3)
        named = touched(names, table["commit"]) if table.get("commit") else []
        first = [*named, *(n for n in REPRESENTATIVE if n in names and n not in named)]
        names = [*first, *(n for n in sliced(names, part, parts) if n not in first)]
        said = ", ".join(named) or "none"
        print(f"conformance: families the change since the baseline names ({said}), the representative ones, then")
        print(f"  slice {part}/{parts} of the others: {len(names)} rows")
    if baseline is not None and not args.families:
        names, dead = wholly_failed(names, baseline)
        if dead:  # a crash or hang in their first cell: nothing of theirs can regress, and a hang costs --timeout
            print(f"conformance: not rerun, every cell ✗ in the baseline (see its table): {', '.join(dead)}")
        names, slow = slower(names, baseline, args.skip_slower)
        if slow:  # CI's time limit: their cells stay as the committed table has them
            print(f"conformance: not rerun, over --skip-slower {args.skip_slower:.0f} CPU s in the baseline: "
                  f"{', '.join(slow)}")  # fmt: skip
    return names


def verdict(report: dict[str, Any], baseline: dict[str, Any] | None) -> int:
    """``--check``'s exit code: 1 for any ✗ cell (with a baseline: any it had as ✓ or refused) or for no cell at all.

    Examples:
        >>> verdict({"families": {"bert": {"skipped": "not causal", "cells": {}}}}, None)
        1
    """
    ran = sum(len(r["cells"]) for r in report["families"].values() if not r["skipped"])
    if not ran:
        skipped = ", ".join(f"{n} ({r['skipped']})" for n, r in report["families"].items())
        print(f"conformance --check: no cell was compared, so nothing is checked; every family was skipped: {skipped}",
              file=sys.stderr)  # fmt: skip
        return 1
    failed = failures(report["families"])
    if baseline is not None:
        failed, unseen = regressions(failed, baseline)
        if unseen:
            print(f"conformance --check: ✗ cells the baseline has no row for (not failing): {', '.join(unseen)}")
    if failed:
        print(f"conformance --check: {len(failed)} ✗ cell(s): {', '.join(failed)}", file=sys.stderr)
        for name in failed:
            family, key = name.split("/", 1)
            print(f"  {name}: {report['families'][family]['cells'][key]['text']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
