"""lm-evaluation-harness on one CPU: torchshard's "torchshard" model against lm_eval's HFLM, same weights and tasks.

A transformers Llama and a word-level tokenizer are saved to a temporary folder; two local tasks
(multiple choice, and rolling log-likelihood over longer documents) run through
``lm_eval.simple_evaluate``. Ours loads the folder sharded with ``hf_rules`` on data=4 × model=2
simulated CPU devices; HFLM loads it as eager torch in its own process (timing eager torch in a
process where JAX runs is meaningless). Each backend evaluates twice: the first run includes
compilation (ours) and warm-up, the second is the steady state. The time inside the model's
``loglikelihood``/``loglikelihood_rolling`` calls is reported apart from the whole run (lm_eval's
task building, dataset loading and metrics are the same for both). The accuracies must agree.

    python benchmarks/lm_eval_speed.py           # the README numbers
    python benchmarks/lm_eval_speed.py --tiny    # seconds; what the smoke test runs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--docs", type=int, default=64, help="documents per task")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per call, both backends")
    parser.add_argument("--runs", type=int, default=2, help="evaluations per backend; the first compiles (ours)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, 8 documents, one run (smoke test)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--hf", help=argparse.SUPPRESS)  # internal: run HFLM on this folder and print its timings
    return parser.parse_args(argv)


def build(folder: Path, *, tiny: bool) -> None:
    """A Llama and a word-level tokenizer (every id a word) saved to ``folder``; tasks beside them."""
    import tokenizers
    import torch
    import transformers

    vocab_size = 512
    words = [f"w{i}" for i in range(vocab_size - 4)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(folder / "model")
    sizes = (64, 2, 4) if tiny else (256, 4, 8)
    config = transformers.LlamaConfig(hidden_size=sizes[0], num_hidden_layers=sizes[1], num_attention_heads=sizes[2],
                                      num_key_value_heads=sizes[2] // 2, intermediate_size=4 * sizes[0],
                                      vocab_size=vocab_size, max_position_embeddings=256, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "model")


def write_tasks(folder: Path, docs: int) -> None:
    rng = random.Random(0)
    text = lambda n: " ".join(f"w{rng.randrange(508)}" for _ in range(n))  # noqa: E731
    rows = [{"question": text(rng.randrange(8, 40)), "choices": [text(rng.randrange(1, 6)) for _ in range(4)],
             "label": rng.randrange(4), "document": text(rng.randrange(100, 400))} for _ in range(docs)]  # fmt: skip
    (folder / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n"
              f"  cache_dir: {folder / 'cache'}\ntest_split: test\n")  # fmt: skip
    (folder / "bench_mc.yaml").write_text(
        f"task: bench_mc\n{common}output_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\n"
        "doc_to_target: '{{label}}'\ndoc_to_choice: '{{choices}}'\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "bench_ppl.yaml").write_text(
        f"task: bench_ppl\n{common}output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{document}}'\nmetric_list:\n  - metric: word_perplexity\n"
    )


def timed(model, folder: Path, runs: int) -> dict:
    """``runs`` ``simple_evaluate`` runs of both tasks: seconds in the model's calls and in all, and the metrics."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    calls = [0.0]

    def clocked(method):
        def run(requests, *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(requests, *args, **kwargs)
            finally:
                calls[0] += time.perf_counter() - start

        return run

    for name in ("loglikelihood", "loglikelihood_rolling"):  # what simple_evaluate calls, timed alone
        setattr(model, name, clocked(getattr(model, name)))
    seconds, in_model, results = [], [], None
    for _ in range(runs):
        calls[0], start = 0.0, time.perf_counter()
        manager = TaskManager(include_path=str(folder), include_defaults=False)  # not lm_eval's ~5 s task index
        results = lm_eval.simple_evaluate(model=model, tasks=["bench_mc", "bench_ppl"], task_manager=manager)
        seconds.append(time.perf_counter() - start)
        in_model.append(calls[0])
    assert results is not None
    return {
        "first_s": seconds[0], "warm_s": seconds[-1], "first_model_s": in_model[0], "warm_model_s": in_model[-1],
        "acc": results["results"]["bench_mc"]["acc,none"],
        "word_perplexity": results["results"]["bench_ppl"]["word_perplexity,none"],
    }  # fmt: skip


def run_hf(folder: Path, batch_size: int, runs: int) -> dict:
    from lm_eval.models.huggingface import HFLM

    model = HFLM(pretrained=str(folder / "model"), device="cpu", dtype="float32", batch_size=batch_size)
    return timed(model, folder, runs)


def run_ours(folder: Path, batch_size: int, runs: int) -> dict:
    import torchshard as ts

    ts.use_cpu_devices(8)
    from torchshard.lm_eval import TorchshardLM

    model = TorchshardLM(pretrained=str(folder / "model"), mesh="data=4,model=2", batch_size=batch_size)
    return timed(model, folder, runs)


def main() -> None:
    args = parse_args()
    if args.hf:
        print(json.dumps(run_hf(Path(args.hf), args.batch_size, args.runs)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(folder, tiny=args.tiny)
        write_tasks(folder, 8 if args.tiny else args.docs)
        args.runs = 1 if args.tiny else args.runs
        hf_cmd = [sys.executable, __file__, "--hf", tmp, "--batch-size", str(args.batch_size), "--runs", str(args.runs)]
        done = subprocess.run(hf_cmd, capture_output=True, text=True, check=True, env=os.environ.copy())
        hf = json.loads(done.stdout.strip().splitlines()[-1])
        ours = run_ours(folder, args.batch_size, args.runs)
    report(args, ours, hf)


def report(args: argparse.Namespace, ours: dict, hf: dict) -> None:
    model = "tiny Llama" if args.tiny else "Llama 256 wide, 4 layers"
    print(f"{model}, {8 if args.tiny else args.docs} documents per task, batch size {args.batch_size}; "
          f"ours on data=4 x model=2 simulated CPU devices, HFLM eager torch")  # fmt: skip
    print("| backend | model calls, first run (s) | model calls, last run (s) | last × HFLM | whole run, last (s) |")
    print("|---|---|---|---|---|")
    for name, r in (("torchshard", ours), ("HFLM (own process)", hf)):
        ratio = hf["warm_model_s"] / r["warm_model_s"]
        print(f"| {name} | {r['first_model_s']:.2f} | {r['warm_model_s']:.2f} | {ratio:.2f}× | {r['warm_s']:.2f} |")
    print(f"acc {ours['acc']:.4f} (HFLM {hf['acc']:.4f}), word perplexity {ours['word_perplexity']:.4f} "
          f"(HFLM {hf['word_perplexity']:.4f})")  # fmt: skip
    same = ours["acc"] == hf["acc"] and abs(ours["word_perplexity"] / hf["word_perplexity"] - 1) < 1e-4
    print(f"same accuracy and perplexity: {'yes' if same else 'NO'}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"torchshard": ours, "hflm": hf, "speedup": hf["warm_model_s"] / ours["warm_model_s"]})
        )
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
