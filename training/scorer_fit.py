"""The fits of ``kvpress-phase train-scorer`` (:mod:`.scorer`): a ridge map and a small MLP per layer from the
sampled attention inputs to the log KVzip+ targets, their evaluation (R^2, Spearman against KVzip+) and saving.

Both give kvpress's ``KVzapModel`` (one module per layer): ``linear`` by ridge regression solved in closed form
(:func:`fit_ridge`, the penalty chosen per layer on the validation passages), ``mlp`` by Adam on the MSE with early
stopping (:func:`fit_mlp`). R^2 of a layer pools its KV heads: ``1 - sum((y - y_hat)^2) / sum((y - mean_head(y))^2)``,
means taken per head on the data being scored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch
from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

from .scorer_config import TARGET_EPSILON

RIDGE_ALPHAS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
"""Ridge penalties tried, relative to the mean diagonal of a layer's ``X^T X`` (``n`` times the mean square)."""


@dataclass
class Samples:
    """Sampled training pairs of one split: ``x (N, layers, hidden)`` float16, ``y (N, layers, KV heads)``."""

    x: torch.Tensor
    y: torch.Tensor
    names: list = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0


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
    ranks them). ``records``: whole-prefill records of :func:`.scorer.extract`."""
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


__all__ = ["RIDGE_ALPHAS", "Samples", "fit_mlp", "fit_ridge", "linear_scorer", "mse_per_layer", "predict",
           "r2_per_layer", "save_scorer", "scorer_config", "spearman"]
