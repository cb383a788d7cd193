"""lm-evaluation-harness on the mesh: importing this module registers the lm_eval model ``"torchshard"``;
``python -m torchshard.lm_eval`` is lm_eval's own command line with it registered."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

try:
    from lm_eval import utils as _utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (
        Collator,
        handle_stop_sequences,
        has_bos_prefix,
        normalize_gen_kwargs,
        postprocess_generated_text,
        resolve_max_length,
    )
except ImportError as err:  # an optional extra: the rest of torchshard does not need it
    raise ImportError(
        f"torchshard.lm_eval needs lm-evaluation-harness ({err}); install it with pip install 'torchshard[lm_eval]'"
    ) from err

from torchshard._base.errors import ArgumentError, ShardingError, raise_if_any
from torchshard._generate import scoring
from torchshard._generate.generate import generate
from torchshard._generate.generate_checks import vocab_problems
from torchshard._interop.hf_folder import cpu_devices_from_environment, load_causal_lm
from torchshard._trainer.trainer import Trainer

__all__ = ["TorchshardLM", "main"]

MIN_BUCKET = 16  # the shortest padded length: shorter rows share one compiled program
_SAMPLING = ("temperature", "top_k", "top_p")
Request = tuple[Any, list[int], list[int]]  # (cache key, context ids, continuation ids)


def bucket(length: int, cap: int) -> int:
    """The padded length for ``length`` tokens: the next power of two (≥ `MIN_BUCKET`), at most ``cap``.

    Examples:
        >>> bucket(5, 2048), bucket(100, 2048), bucket(100, 120), bucket(130, 120)
        (16, 128, 120, 130)
    """
    return max(length, min(cap, 1 << max(length - 1, MIN_BUCKET - 1).bit_length()))


class TorchshardLM(TemplateLM):
    """An lm_eval model: a `Trainer` or a sharded module plus its tokenizer, scored and decoded on the mesh.

    ``loglikelihood`` and ``loglikelihood_rolling`` run one compiled forward per padded length
    (powers of two, see `bucket`) and batch of ``batch_size`` rows; ``generate_until`` runs
    `torchshard.generate` on left-padded prompts. Requests are split, truncated and encoded as
    lm_eval's ``HFLM`` does, so the same weights give the same log-likelihoods and greedy text.
    Evaluate it with ``lm_eval.simple_evaluate(model=TorchshardLM(trainer, tokenizer), tasks=[...])``, or
    by name, ``model="torchshard", model_args={"pretrained": DIR, "mesh": "data=8"}``: importing this
    module registers it (lm_eval discovers no plugins); on the command line, `main`.

    Args:
        target: a `Trainer` (its latest weights; without ``scan_layers``/``pipeline``) or a module
            placed by `torchshard.shard`, mapping ids [batch, seq] to logits (or an output with ``.logits``).
        tokenizer: a transformers tokenizer with a ``pad_token`` (it fills the padding).
        batch_size: rows per compiled call (rounded up to a multiple of the mesh's batch axes).
        max_length: the longest window in tokens; default the model config's
            ``max_position_embeddings`` (as ``HFLM``), else 2048.
        max_gen_toks: new tokens per ``generate_until`` request unless the task says otherwise.
        pretrained: instead of ``target`` and ``tokenizer`` (the CLI's way): a folder written by
            ``save_pretrained``, loaded sharded with ``presets.hf_rules`` on ``mesh``.
        mesh: with ``pretrained``: mesh axes, ``"data=8"``, ``"data=4,model=2"`` or a dict; default
            every device on "data".
        pad_token: with ``pretrained``: the pad token to give a tokenizer that has none.
        device: lm_eval's CLI passes it; ignored (the mesh decides where it runs).
        max_batch_size: lm_eval's CLI passes it; ignored.

    Raises:
        ArgumentError: every bad argument at once, before anything runs: a target that is not a
            Trainer or a module on the mesh, layers stacked by ``scan_layers``/``pipeline``, a
            tokenizer without a pad token, a batch size or length that is not a positive int.

    Examples:
        >>> import lm_eval
        >>> lm_eval.api.registry.get_model("torchshard") is TorchshardLM
        True
    """

    def __init__(
        self,
        target: Trainer | torch.nn.Module | None = None,
        tokenizer: Any = None,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        pretrained: str | None = None,
        mesh: str | dict[str, int] | None = None,
        pad_token: str | None = None,
        device: str | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        del device, max_batch_size
        batch_size, max_length, max_gen_toks = (_number(v) for v in (batch_size, max_length, max_gen_toks))
        if pretrained is not None:
            if target is not None or tokenizer is not None:
                raise ArgumentError("pass pretrained= alone, or a target and a tokenizer, not both")
            target, tokenizer = load_causal_lm(pretrained, mesh, pad_token)
        problems = _target_problems(target) + _tokenizer_problems(tokenizer)
        if pretrained is None and (mesh is not None or pad_token is not None):
            problems.append("mesh= and pad_token= go with pretrained=; shard a target yourself, set its pad token")
        problems += _positive("batch_size", batch_size) + _positive("max_gen_toks", max_gen_toks)
        problems += [] if max_length is None else _positive("max_length", max_length)
        raise_if_any(problems, header=f"TorchshardLM: {len(problems)} bad argument(s)", error=ArgumentError)
        self.target, self.tokenizer = target, tokenizer
        self.model: torch.nn.Module = target.model if isinstance(target, Trainer) else target  # type: ignore[assignment]
        self.rows = -(-batch_size // scoring.row_multiple(target)) * scoring.row_multiple(target)  # type: ignore[arg-type]
        self._max_length, self._max_gen_toks, self.batch_size = max_length, max_gen_toks, batch_size

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id  # as HFLM: an empty context is the BOS token, else EOS
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        return resolve_max_length(getattr(self.model, "config", None), self.tokenizer)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__)).replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs: Any
    ) -> list[int]:
        """``string``'s ids as ``HFLM.tok_encode`` gives them (no second BOS when the string starts with one)."""
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False, **kwargs: Any) -> list:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per request."""
        windows = [(context + continuation)[-(self.max_length + 1) :] for _, context, continuation in requests]
        counts = [len(continuation) for _, _, continuation in requests]
        too_long = [i for i, c in enumerate(counts) if c > self.max_length]
        raise_if_any(
            [
                f"request {i}'s continuation has {counts[i]} tokens, more than max_length={self.max_length}"
                for i in too_long
            ],
            header="loglikelihood",
            error=ArgumentError,
        )
        order = sorted(range(len(requests)), key=lambda i: -len(windows[i]))  # longest first, as HFLM
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for start in range(0, len(order), self.rows):
            chunk = order[start : start + self.rows]
            logp, greedy = self._score([windows[i] for i in chunk])
            for row, i in enumerate(chunk):
                end = len(windows[i]) - 1
                span = slice(end - counts[i], end)
                results[i] = (float(logp[row, span].sum(dtype=np.float64)), bool(greedy[row, span].all()))
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
        return results

    def _score(self, windows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """`scoring.score` on ``windows`` right-padded to one `bucket` and `rows` rows."""
        width = bucket(max(len(w) for w in windows) - 1, self.max_length) + 1
        ids = np.full((self.rows, width), self.tokenizer.pad_token_id, np.int32)
        for row, window in enumerate(windows):
            ids[row, : len(window)] = window
        name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
        fix = f"the tokenizer {name!r} gives ids the model has no embedding for: pass the model's own tokenizer"
        raise_if_any(
            [f"{p}; {fix}" for p in vocab_problems(self.model, torch.from_numpy(ids))],
            header="loglikelihood",
            error=ArgumentError,
        )
        return scoring.score(self.target, ids)  # type: ignore[arg-type]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each string's log-likelihood over disjoint windows of at most ``max_length`` tokens, as ``HFLM``."""
        windows: list[Request] = []
        counts = []
        for (string,) in [req.args for req in requests]:
            rolling = _utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            made = [(None, *_utils.make_disjoint_window(w)) for w in rolling]
            windows += made
            counts.append(len(made))
        scores = iter(self._loglikelihood_tokens(windows))
        totals = [sum(next(scores)[0] for _ in range(count)) for count in counts]
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Each context continued by `torchshard.generate`, cut at the first stop sequence, as ``HFLM``."""
        collator = Collator(
            [req.args for req in requests],
            sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
            group_by="gen_kwargs",
            group_fn=lambda r: r[1],
        )
        out = []
        for chunk in collator.get_batched(n=self.rows):
            contexts, settings = zip(*chunk, strict=True)
            texts = self._generate(list(contexts), settings[0])
            for context, setting, text in zip(contexts, settings, texts, strict=True):
                self.cache_hook.add_partial("generate_until", (context, setting), text)
            out += texts
        return collator.get_original(out)

    def _generate(self, contexts: list[str], setting: dict[str, Any]) -> list[str]:
        kwargs = dict(normalize_gen_kwargs(setting, self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id], False))
        new, sampled = int(kwargs.pop("max_gen_toks")), bool(kwargs.pop("do_sample", False))
        sampling = {k: kwargs.pop(k) for k in _SAMPLING if k in kwargs}
        problems = [
            f"generation setting {k}={v!r} is not supported: only until, max_gen_toks, do_sample, "
            f"temperature, top_k and top_p"
            for k, v in kwargs.items()
        ]
        if new >= self.max_length:
            problems.append(f"max_gen_toks={new} leaves no room for a prompt in max_length={self.max_length}")
        raise_if_any(problems, header="generate_until", error=ArgumentError)
        ids, mask = self._prompts(contexts, self.max_length - new)
        settings = sampling if sampled else {}
        tokens = generate(
            self.target,  # type: ignore[arg-type]
            ids,
            max_new_tokens=new,
            attention_mask=mask,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self._eos(),
            **settings,
        )
        made = tokens[: len(contexts), ids.shape[1] :].tolist()
        return [postprocess_generated_text(self.tok_decode(row), until, None) for row in made]

    def _eos(self) -> list[int] | None:
        """A transformers model stops at its generation config's EOS (as ``HFLM``); another at the tokenizer's."""
        return None if getattr(self.model, "generation_config", None) is not None else [self.eot_token_id]

    def _prompts(self, contexts: list[str], longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids and mask, left-padded to one `bucket` and `rows` rows; each prompt keeps its last ``longest`` ids."""
        bos = getattr(self.tokenizer, "bos_token", None)  # as HFLM.tok_batch_encode: no second BOS
        special = {"add_special_tokens": False} if has_bos_prefix(contexts[0], bos) else {}
        encoded = [ids[-longest:] for ids in self.tokenizer(contexts, **special)["input_ids"]]
        width = bucket(max(len(e) for e in encoded), longest)
        ids = torch.full((self.rows, width), self.tokenizer.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((self.rows, width), dtype=torch.int64)
        for row in range(self.rows):
            prompt = encoded[min(row, len(encoded) - 1)]  # extra rows repeat the last prompt: one shape per bucket
            ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
        return ids, mask


if __name__ != "__main__":  # under python -m, main() imports this module by its name, which registers it once
    register_model("torchshard")(TorchshardLM)


def _number(value: Any) -> Any:
    """An int the command line gave as digits (lm_eval passes ``--batch_size 8`` as ``"8"``)."""
    return int(value) if isinstance(value, str) and value.isdigit() else value


def _positive(name: str, value: Any) -> list[str]:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return [] if ok else [f"{name}={value!r}: a positive int"]


def _target_problems(target: Any) -> list[str]:
    try:
        stacked = scoring.stacked(target)
    except ArgumentError as err:
        return [str(err)]
    if stacked:
        return [
            f"target: a Trainer built with scan_layers= or pipeline= keeps its layers stacked ({stacked[0]}, "
            f"...); evaluate a Trainer without them, or a module placed by ts.shard with its weights"
        ]
    return []


def _tokenizer_problems(tokenizer: Any) -> list[str]:
    if not all(hasattr(tokenizer, a) for a in ("encode", "decode", "pad_token_id", "eos_token_id")):
        return [f"tokenizer is a {type(tokenizer).__name__}; pass a transformers tokenizer"]
    if tokenizer.pad_token_id is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        return [
            f"tokenizer {name!r} has no pad token, and TorchshardLM pads every batch: set one first, e.g. "
            f"tokenizer.pad_token = tokenizer.eos_token (HFLM picks the unk or eos token silently), or "
            f"pad_token=... in --model_args"
        ]
    return []


def main(argv: Sequence[str] | None = None) -> int:
    """lm_eval's own command line, with the model ``"torchshard"`` registered: ``python -m torchshard.lm_eval``.

    lm_eval discovers no plugins, so a bare ``lm_eval --model torchshard`` does not know the model; this
    takes the same arguments, ``--model torchshard --model_args pretrained=DIR,mesh=data=8 --tasks ...``.
    ``TORCHSHARD_CPU_DEVICES=n`` simulates ``n`` CPU devices.

    Args:
        argv: lm_eval's arguments, unchanged; default ``sys.argv[1:]``.

    Returns:
        0 once lm_eval's command has run; 1 when a `ShardingError` (an `ArgumentError` included) ended it,
        its message on stderr without a traceback. lm_eval's own usage errors exit as lm_eval exits (2).

    Examples:
        >>> main([])  # no command: lm_eval's help
        usage: lm-eval ...
        0
    """
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = [saved[0], *(saved[1:] if argv is None else argv)]  # lm_eval's CLI reads sys.argv itself
    try:
        cpu_devices_from_environment()
        cli_evaluate()
    except ShardingError as err:  # a bad setting: the message names it, a traceback would bury it
        print(f"torchshard.lm_eval: error: {err}", file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    from torchshard.lm_eval import main as _main

    sys.exit(_main())
