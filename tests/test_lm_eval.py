"""torchshard.lm_eval: lm-eval's "torchshard" model scores and decodes as its HFLM does on the same weights.

It is reached three ways, each tested here: ``simple_evaluate(model=TorchshardLM(...))``,
``simple_evaluate(model="torchshard", ...)`` after ``import torchshard.lm_eval``, and
``python -m torchshard.lm_eval`` with lm_eval's own arguments. No start-up hook: lm_eval alone does not know it.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import lm_eval
import optax
import pytest
import tokenizers
import torch
import transformers
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

import torchshard as ts
from torchshard.__main__ import EXIT_USAGE, main
from torchshard.lm_eval import TorchshardLM, bucket
from torchshard.lm_eval import main as lm_eval_main

ATOL = 1e-4  # float32 log-likelihoods, summed over a continuation: ours against HFLM's eager torch
TEXT = "the a cat dog sat on mat ran to park red blue green is was and of in it big small what color answer yes no "
WORDS = (TEXT + "one two three four five sky sun tree bird . ? :").split()
WORDS += [f"w{i}" for i in range(60 - len(WORDS))]  # with 4 special tokens, the model's 64 ids are all words
ROOT = Path(__file__).resolve().parents[1]


def _tokenizer(*, pad: bool = True) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer built here (no download) that adds a BOS token, as Llama's does."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"} | ({"pad_token": "<pad>"} if pad else {})
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def _llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=64,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _sharded(model: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(model)
    return ts.shard(model, ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), ts.presets.hf_rules(model)))


@pytest.fixture(scope="module")
def llama():
    return _llama()


@pytest.fixture(scope="module")
def hflm(llama):
    return HFLM(pretrained=llama, tokenizer=_tokenizer(), batch_size=4)


@pytest.fixture(scope="module")
def ours(llama):
    return TorchshardLM(_sharded(llama), _tokenizer(), batch_size=4)


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def _assert_scores_equal(got, expected):
    assert len(got) == len(expected)
    for (value, greedy), (value_hf, greedy_hf) in zip(got, expected, strict=True):
        assert abs(value - value_hf) <= ATOL, (value, value_hf)
        assert greedy == greedy_hf


@torch.no_grad()
def _greedy(model: torch.nn.Module, context: str, new: int) -> str:
    """The ``new`` words eager greedy decoding adds to ``context``."""
    ids = torch.tensor([_tokenizer()(context)["input_ids"]])
    for _ in range(new):
        ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return " " + _tokenizer().decode(ids[0, -new:])


def test_loglikelihood_equals_hflm(llama, hflm, ours):
    long_context = " ".join(WORDS * 3)  # 108 tokens: cut from the left to max_length=64, as HFLM cuts it
    args = [("the cat sat on the", " mat"), ("what color is the sky ?", " blue"), ("", "the dog ran"),
            ("a big red ", "tree and a small bird"), ("one two three", " four five"), (long_context, " sky"),
            ("the cat", _greedy(llama, "the cat", 3))]  # fmt: skip
    expected = hflm.loglikelihood(_requests("loglikelihood", args))
    _assert_scores_equal(ours.loglikelihood(_requests("loglikelihood", args)), expected)
    assert expected[-1][1] and not expected[0][1]  # both kinds of greedy flag are compared


def test_loglikelihood_rolling_equals_hflm(hflm, ours):
    args = [(" ".join((WORDS * 5)[:150]),), ("the cat sat .",), (" ".join(WORDS[:63]),)]  # 3, 1 and 1 windows
    expected = hflm.loglikelihood_rolling(_requests("loglikelihood_rolling", args))
    got = ours.loglikelihood_rolling(_requests("loglikelihood_rolling", args))
    assert got == pytest.approx(expected, abs=ATOL)


@pytest.mark.slow
def test_greedy_generate_until_equals_hflm(hflm, ours):
    contexts = ["the cat", "what color is the sky ?", "one two three four", "a", "the dog ran to the park ."]
    settings = [{"until": ["."], "max_gen_toks": 8}, {"until": ["sky", "w5"], "max_gen_toks": 5, "do_sample": False}]
    args = [(c, s) for s in settings for c in contexts]
    expected = hflm.generate_until(_requests("generate_until", args))
    assert ours.generate_until(_requests("generate_until", args)) == expected
    assert "" in expected[5:] and any(len(e.split()) == 8 for e in expected[:5])  # stops cut some, not all


@pytest.mark.parametrize(("length", "cap", "expected"), [(1, 64, 16), (16, 64, 16), (17, 64, 32), (63, 64, 64),
                                                          (64, 64, 64), (65, 64, 65), (40, 48, 48)])  # fmt: skip
def test_padded_lengths_are_powers_of_two_up_to_max_length(length, cap, expected):
    assert bucket(length, cap) == expected


def _write_tasks(root: Path) -> Path:
    docs = [("what color is the sky ?", ["blue", "green", "red"]), ("the cat sat on the", ["mat", "sky", "sun"]),
            ("one two three", ["four", "five", "dog"]), ("the dog ran to the", ["park", "sun", "tree"]),
            ("is the sun big ?", ["yes", "no"]), ("a small bird sat in the", ["tree", "mat", "sky"])]  # fmt: skip
    lines = [{"question": q, "choices": c, "label": 0, "answer": c[0], "text": f"{q} {c[0]} ."} for q, c in docs]
    (root / "docs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'docs.jsonl'}\n"
              f"  cache_dir: {root / 'cache'}\ntest_split: test\n")  # fmt: skip
    tasks = {
        "ts_mc": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{label}}'\n"
        "doc_to_choice: '{{choices}}'\nmetric_list:\n  - metric: acc\n",
        "ts_ppl": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n",
        "ts_gen": "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: ' {{answer}}'\n"
        "generation_kwargs:\n  until: ['?']\n  max_gen_toks: 4\nmetric_list:\n  - metric: exact_match\n",
    }
    for name, body in tasks.items():
        (root / f"{name}.yaml").write_text(f"task: {name}\n{common}{body}")
    return root


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return _write_tasks(tmp_path_factory.mktemp("tasks"))


def _evaluate(model, tasks: Path, names: list[str], **kwargs) -> dict:
    # only the tasks written here: indexing lm_eval's thousands of built-in task files took ~5 s per call
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, tasks=names, task_manager=manager, log_samples=True, **kwargs)


def _saved(llama: torch.nn.Module, folder: Path) -> Path:
    """``llama`` and the test tokenizer in one ``save_pretrained`` folder, as ``pretrained=`` takes it."""
    llama.save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return folder


def _command(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m torchshard.lm_eval ARGS`` on 4 simulated CPU devices."""
    env = {**os.environ, "TORCHSHARD_CPU_DEVICES": "4", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torchshard.lm_eval", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


def _assert_same_results(got: dict, expected: dict) -> None:
    """Accuracies (and every other metric but perplexities) identical; perplexities and each response close."""
    for task, metrics in expected["results"].items():
        for key, value in metrics.items():
            close = "perplexity" in key and isinstance(value, float)
            assert got["results"][task][key] == (pytest.approx(value, rel=ATOL) if close else value), (task, key)
    for task, samples in expected["samples"].items():
        for mine, theirs in zip(got["samples"][task], samples, strict=True):
            assert _close(mine["resps"], theirs["resps"]), (task, mine["resps"], theirs["resps"])


def _close(a, b) -> bool:
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return abs(a - b) <= ATOL if isinstance(a, float) else a == b


@pytest.mark.slow
def test_a_task_scores_the_same_as_hflm(hflm, ours, tasks):
    names = ["ts_mc", "ts_ppl", "ts_gen"]
    expected = _evaluate(hflm, tasks, names)
    got = _evaluate(ours, tasks, names)
    _assert_same_results(got, expected)
    assert 0 < expected["results"]["ts_mc"]["acc,none"] < 1  # a random model: the accuracy can differ


@pytest.mark.slow
def test_a_trainer_is_evaluated_with_its_latest_weights(llama, tasks):
    model = copy.deepcopy(llama)
    plan = ts.plan(model, ts.make_mesh({"data": 8}), ts.presets.hf_rules(model, axis=None))
    trainer = ts.Trainer(model, lambda m, ids: m(input_ids=ids, labels=ids).loss, optax.adamw(1e-2), plan)
    trainer.step(torch.randint(4, 40, (8, 16), generator=torch.Generator().manual_seed(0)))
    trained = _llama()
    trained.load_state_dict(ts.to_torch_state_dict(trainer.model))
    expected = _evaluate(HFLM(pretrained=trained, tokenizer=_tokenizer(), batch_size=4), tasks, ["ts_mc"])
    _assert_same_results(_evaluate(TorchshardLM(trainer, _tokenizer(), batch_size=3), tasks, ["ts_mc"]), expected)


@pytest.mark.slow
def test_simple_evaluate_takes_the_model_by_name_after_import(llama, tasks, tmp_path):
    folder = _saved(llama, tmp_path / "model")
    args = {"pretrained": str(folder), "mesh": "data=4,model=2"}
    got = _evaluate("torchshard", tasks, ["ts_mc"], model_args=args, batch_size=2)
    _assert_same_results(got, _evaluate(HFLM(pretrained=llama, tokenizer=_tokenizer(), batch_size=4), tasks, ["ts_mc"]))


@pytest.mark.slow
def test_python_m_torchshard_lm_eval_evaluates_a_saved_model_as_hflm(llama, tasks, tmp_path):
    folder = _saved(llama, tmp_path / "model")
    done = _command(["--model", "torchshard", "--model_args", f"pretrained={folder},mesh=data=4", "--batch_size", "2",
                     "--tasks", "ts_mc", "--include_path", str(tasks), "--output_path", str(tmp_path / "out")],
                    tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    expected = _evaluate(HFLM(pretrained=llama, tokenizer=_tokenizer(), batch_size=4), tasks, ["ts_mc"])
    assert json.loads(results.read_text())["results"]["ts_mc"]["acc,none"] == expected["results"]["ts_mc"]["acc,none"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "code", "message"),
    [(["--model", "torchshard", "--no_such_flag"], 2, "lm-eval: error: unrecognized arguments: --no_such_flag"),
     (["--model", "torchshard", "--model_args", "pretrained=/no/such/folder", "--tasks", "ts_mc"], 1,
      "torchshard.lm_eval: error: pretrained='/no/such/folder' is not a folder: pass the folder save_pretrained")],
    ids=["unknown_flag", "pretrained_missing"],
)  # fmt: skip
def test_python_m_torchshard_lm_eval_exits_non_zero_with_the_message(args, code, message, tasks, tmp_path):
    done = _command([*args, "--include_path", str(tasks)] if "--tasks" in args else args, tmp_path)
    assert done.returncode == code, done.stderr[-3000:]
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_an_unknown_flag_exits_as_lm_evals_own_command_line_does(capsys):
    argv = list(sys.argv)
    with pytest.raises(SystemExit) as exited:
        lm_eval_main(["--model", "torchshard", "--no_such_flag"])
    assert exited.value.code == 2
    assert "lm-eval: error: unrecognized arguments: --no_such_flag" in capsys.readouterr().err
    assert sys.argv == argv  # lm_eval's CLI reads sys.argv: main() puts the caller's back


@pytest.mark.slow
def test_lm_eval_alone_neither_imports_torchshard_nor_knows_its_model():
    script = textwrap.dedent("""
        import site, sys
        from pathlib import Path
        from lm_eval.api.registry import get_model, model_registry
        try:
            get_model("torchshard")
        except ValueError:
            print("unknown")
        ours = [m for m in sys.modules if m.split(".")[0] in ("torchshard", "_torchshard_lm_eval")]
        print("hf" in model_registry, ours)
        print([p.name for d in site.getsitepackages() for p in Path(d).glob("*.pth") if "lm_eval" in p.read_text()])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # no start-up hook: lm_eval's own models load, torchshard's only through torchshard.lm_eval, and no .pth
    # in site-packages reaches into lm_eval
    assert done.stdout.splitlines() == ["unknown", "True []", "[]"]


def test_a_tokenizer_without_a_pad_token_is_refused_and_left_as_it_was(llama):
    tokenizer = _tokenizer(pad=False)
    with pytest.raises(ts.ArgumentError, match=r"tokenizer .* has no pad token.*tokenizer.pad_token = "):
        TorchshardLM(_sharded(llama), tokenizer)
    assert tokenizer.pad_token is None


def test_every_bad_argument_is_named_at_once(llama):
    pattern = r"(?s)3 bad argument.*target: 23 tensor.*not on the mesh.*has no pad token.*batch_size=0: a positive int"
    with pytest.raises(ts.ArgumentError, match=pattern):
        TorchshardLM(copy.deepcopy(llama), _tokenizer(pad=False), batch_size=0)
    with pytest.raises(ts.ArgumentError, match=r"batch_size='auto': a positive int"):
        TorchshardLM(_sharded(llama), _tokenizer(), batch_size="auto")  # type: ignore[arg-type]
    with pytest.raises(ts.ArgumentError, match="mesh= and pad_token= go with pretrained="):
        TorchshardLM(_sharded(llama), _tokenizer(), mesh="data=8")
    with pytest.raises(ts.ArgumentError, match="pretrained= alone"):
        TorchshardLM(_sharded(llama), pretrained="somewhere")
    with pytest.raises(ts.ArgumentError, match=r"mesh='data:8': write axis=size pairs"):
        TorchshardLM(pretrained="somewhere", mesh="data:8")


@pytest.mark.parametrize(
    "text",
    ["data=4,,model=2", "data=8,", "", "data=x", "data=0", "data=-2", "data=+8", "data=1_0", "=8", "data=2,data=4"],
)
def test_mesh_strings_the_plan_cli_refuses_are_refused(text, capsys):
    assert main(["plan", "models:MLP", "--mesh", text]) == EXIT_USAGE
    assert f"--mesh {text!r}: write axis=size pairs" in capsys.readouterr().err
    with pytest.raises(ts.ArgumentError, match=rf"mesh={re.escape(repr(text))}: write axis=size pairs"):
        TorchshardLM(pretrained="somewhere", mesh=text)


def test_a_stacked_trainer_is_refused(llama):
    model = copy.deepcopy(llama)
    plan = ts.plan(model, ts.make_mesh({"data": 8}), ts.presets.hf_rules(model, axis=None))
    trainer = ts.Trainer(model, lambda m, ids: m(input_ids=ids).logits.mean(), optax.sgd(0.1), plan, scan_layers=True)
    with pytest.raises(ts.ArgumentError, match="scan_layers= or pipeline= keeps its layers stacked"):
        TorchshardLM(trainer, _tokenizer())


def test_unsupported_generation_settings_are_named(ours):
    request = _requests("generate_until", [("the cat", {"until": ["."], "repetition_penalty": 1.2})])
    with pytest.raises(ts.ArgumentError, match=r"repetition_penalty=1.2 is not supported"):
        ours.generate_until(request)


@pytest.mark.slow
def test_torchshard_alone_does_not_import_lm_eval_and_a_missing_one_names_the_extra():
    script = ("import sys, torchshard; assert 'lm_eval' not in sys.modules; sys.modules['lm_eval'] = None\n"
              "try:\n    import torchshard.lm_eval\nexcept ImportError as err:\n    print(err)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "pip install 'torchshard[lm_eval]'" in done.stdout


def test_requests_it_cannot_serve_are_named(llama, ours):
    too_long = _requests("loglikelihood", [("the", " " + " ".join(["cat"] * 70))])
    with pytest.raises(ts.ArgumentError, match=r"request 0's continuation has 70 tokens, more than max_length=64"):
        ours.loglikelihood(too_long)
    no_room = _requests("generate_until", [("the cat", {"until": ["."], "max_gen_toks": 64})])
    with pytest.raises(ts.ArgumentError, match=r"max_gen_toks=64 leaves no room for a prompt in max_length=64"):
        ours.generate_until(no_room)
    with pytest.raises(ts.ArgumentError, match=r"tokenizer is a str; pass a transformers tokenizer"):
        TorchshardLM(_sharded(llama), "gpt2")


class _NotLogits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 8)

    def forward(self, ids):
        return self.embed(ids).sum(-1)  # [batch, seq]: no vocabulary dim


def test_a_model_whose_output_is_not_logits_is_named():
    model = _NotLogits()
    model = ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))
    with pytest.raises(ts.ArgumentError, match=r"could not score with _NotLogits.*logits \[batch, seq, vocab\]"):
        TorchshardLM(model, _tokenizer()).loglikelihood(_requests("loglikelihood", [("the", " cat")]))


def test_any_module_mapping_ids_to_logits_is_scored_as_eager_torch():
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))
    model = copy.deepcopy(eager)
    model = ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8}), ts.presets.fsdp(min_size=64)))
    (got,) = TorchshardLM(model, _tokenizer(), batch_size=2).loglikelihood(
        _requests("loglikelihood", [("the cat", " sat on")])
    )
    ids = torch.tensor(_tokenizer()("the cat sat on")["input_ids"])  # <s> the cat | sat on
    with torch.no_grad():
        logp = torch.log_softmax(eager(ids[:-1]), dim=-1)[torch.arange(2, 4), ids[3:]]
    assert abs(got[0] - float(logp.sum())) <= 1e-5 * max(1.0, abs(float(logp.sum())))
    assert got[1] == bool((eager(ids[:-1])[2:].argmax(-1) == ids[3:]).all())


# --- bad input: the table ------------------------------------------------------------------------------------


def _small_vocab(rows: int) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Embedding(rows, 16), torch.nn.Linear(16, rows))
    return ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))


def test_a_tokenizer_whose_ids_pass_the_models_vocabulary_is_refused_not_scored_nan():
    model = TorchshardLM(_small_vocab(16), _tokenizer(), batch_size=8)  # the tokenizer's ids reach 63
    with pytest.raises(ts.ArgumentError, match=r"input_ids holds \d+ id\(s\) outside the vocabulary \[0, 16\): "
                                               r"\[\d+.*; the tokenizer .* gives ids the model has no embedding "
                                               r"for: pass the model's own tokenizer"):  # fmt: skip
        model.loglikelihood(_requests("loglikelihood", [("the sky", " is blue")]))  # "sky" is id 35


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"batch_size": 0}, r"batch_size=0: a positive int"),
     ({"batch_size": 2.5}, r"batch_size=2.5: a positive int"),
     ({"max_length": -1}, r"max_length=-1: a positive int"),
     ({"max_gen_toks": "many"}, r"max_gen_toks='many': a positive int"),
     ({"tokenizer": None}, r"tokenizer is a NoneType; pass a transformers tokenizer"),
     ({"target": object()}, r"target"),
     ({"target": None, "tokenizer": None, "pretrained": "/no/such/folder"},
      r"pretrained='/no/such/folder' is not a folder: pass the folder save_pretrained wrote"),
     ({"target": None, "tokenizer": None, "pretrained": "meta-llama/Llama-3.2-1B"},
      r"is not a folder: .*a Hub model: download it first"),
     ({"target": None, "tokenizer": None, "pretrained": "x", "mesh": "data=two"}, r"mesh='data=two': write axis=size")],
    ids=["batch_size_0", "batch_size_float", "max_length", "max_gen_toks", "tokenizer_none", "target_object",
         "pretrained_missing", "pretrained_hub_id", "mesh"],
)  # fmt: skip
def test_bad_model_arguments_are_argument_errors(kwargs, match):
    args = {"target": _small_vocab(64), "tokenizer": _tokenizer()} | kwargs
    with pytest.raises(ts.ArgumentError, match=match):
        TorchshardLM(**args)


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "²"])
def test_the_command_line_names_a_bad_cpu_device_count_without_a_traceback(value, monkeypatch, capsys):
    monkeypatch.setenv("TORCHSHARD_CPU_DEVICES", value)
    assert lm_eval_main(["--model", "torchshard", "--tasks", "none"]) == 1
    expected = f"torchshard.lm_eval: error: $TORCHSHARD_CPU_DEVICES={value!r} must be an int ≥ 1, e.g. 8, or unset"
    assert capsys.readouterr().err.strip() == expected
