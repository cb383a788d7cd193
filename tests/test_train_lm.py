"""examples/train_lm.py: a tiny run writes its outputs, and a resumed run's losses are an uninterrupted run's."""

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import torchshard as ts

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_lm.py"
# one block of width 64 over 8 × 32 bytes: seconds per run, still FSDP × TP on data=4 × model=2
TINY = ["--batch", "8", "--seq", "32", "--layers", "1", "--d-model", "64", "--heads", "2", "--sample-bytes", "24"]


def _run(train_lm, capsys, *args: str) -> str:
    """``python examples/train_lm.py TINY ARGS`` as its main() in this process (a fresh process would spend most
    of its time importing torch and JAX again); returns what it printed."""
    assert train_lm.main([*TINY, *args]) == 0
    return capsys.readouterr().out


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def train_lm():
    spec = importlib.util.spec_from_file_location("train_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _usage_error(train_lm, capsys, args: list[str]) -> str:
    """The error line ``parse_args`` prints before exiting with argparse's status 2 (nothing else runs)."""
    with pytest.raises(SystemExit) as exit_info:
        train_lm.parse_args(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.slow
def test_train_lm_writes_its_outputs_and_resumes_with_the_same_losses(tmp_path, train_lm, capsys):
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    # the interrupted run is given the uninterrupted run's schedule length
    tb = tmp_path / "tb"
    out = _run(train_lm, capsys, "--steps", "3", "--decay-steps", "5", "--out", str(stopped), "--tensorboard", str(tb),
               "--profile")  # fmt: skip
    _run(train_lm, capsys, "--steps", "5", "--out", str(whole))

    rows = _metrics(stopped)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert {"step", "loss", "tokens_per_s", "lr", "grad_norm"} <= set(rows[0]) and "val_loss" in rows[-1]
    assert (stopped / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ts.checkpoint_steps(stopped / "checkpoints") == [3]
    events = EventAccumulator(str(tb))  # the Trainer's run metrics, read back with TensorBoard's own reader
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(r["step"], pytest.approx(r["loss"])) for r in rows]
    assert [e.value for e in events.Scalars("tokens_per_s")] == pytest.approx([r["tokens_per_s"] for r in rows])
    assert [e.step for e in events.Scalars("val_loss")] == [3]
    assert len(list((stopped / "profile").glob("plugins/profile/*/*.xplane.pb"))) == 1  # steps 2-3 (1 compiles)
    sample = (stopped / "sample.txt").read_bytes()
    assert sample.startswith(b"def ") and len(sample) == 4 + 24 and "--- sample" in out

    # resumed with the sequence split over 2 devices (context parallelism): the same run, exactly
    resumed = _run(train_lm, capsys, "--steps", "5", "--resume", "--context", "2", "--out", str(stopped))
    assert "resumed at step 3" in resumed
    assert ts.checkpoint_steps(stopped / "checkpoints") == [3, 5]
    got, expected = _metrics(stopped), _metrics(whole)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]  # appended to, not rewritten
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in expected], rtol=1e-5)
    np.testing.assert_allclose([r["lr"] for r in got], [r["lr"] for r in expected], rtol=1e-6)

    clash = _usage_error(train_lm, capsys, ["--out", str(stopped), "--resume", "--batch", "16", "--layers", "1"])
    assert "the run has --batch 8, not 16" in clash and "--layers" not in clash  # a repeated value is fine
    assert "already holds a run; pass --resume" in _usage_error(train_lm, capsys, ["--out", str(stopped)])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], r"argument --steps: must be > 0, got 0"),
        (["--batch", "6"], r"--batch 6 is not a multiple of the data axis \(4\)"),
        (["--d-model", "60", "--heads", "8"], r"--d-model 60 is not divisible by --heads 8"),
        (["--heads", "3", "--d-model", "48"], r"--heads 3 is not a multiple of the model axis \(2\)"),
        (["--steps", "5", "--warmup", "5"], r"--warmup 5 must be below --decay-steps 5"),
        (["--resume"], r"--resume: .*config\.json does not exist"),
        (["--prompt", ""], r"--prompt must not be empty"),
        (["--context", "2", "--seq", "30"], r"--seq 30 does not split into 2 × 2 balanced chunks for --context 2"),
        (["--context", "3"], r"argument --context: invalid choice: 3"),
    ],
)
def test_train_lm_rejects_bad_arguments(tmp_path, train_lm, capsys, args, message):
    assert re.search(message, _usage_error(train_lm, capsys, ["--out", str(tmp_path / "run"), *args]))


def test_windows_pack_whole_files_as_documents(train_lm):
    # three files of 5, 3 and 6 bytes; windows of 8 + 1 bytes from fixed starts
    text = np.arange(14, dtype=np.uint8)
    files = np.array([0, 5, 8])

    class Starts:  # an rng whose windows begin at bytes 3 and 0
        def integers(self, low, high, size):
            return np.array([3, 0])

    x, positions, y = train_lm.windows(text, files, Starts(), batch=2, seq=8)
    assert x.tolist() == [[3, 4, 5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 0, 1, 2]]
    ignore = train_lm.IGNORE  # a file's last byte predicts nothing: the next file is another document
    assert y.tolist() == [[4, ignore, 6, 7, ignore, 9, 10, 11], [1, 2, 3, 4, ignore, 6, 7, ignore]]


@pytest.mark.parametrize(("start", "steps", "profiled"), [(0, 60, (10, 11, 12)), (0, 3, (2, 3)), (0, 1, ()),
                                                         (0, 11, (9, 10, 11)), (20, 60, (22, 23, 24))])  # fmt: skip
def test_profile_takes_steps_10_to_12_or_the_last_ones_but_never_a_compiling_first(train_lm, start, steps, profiled):
    assert tuple(train_lm.profiled_steps(start, steps)) == profiled
