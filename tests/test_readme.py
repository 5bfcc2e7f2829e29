"""README.md's "Use" snippets run as written, each alone from top to bottom in a fresh namespace (a reader copies one
of them), and print what their comments say: the first on the built-in model, the second (the recommended press,
learned KVzip+ scores) on a model a scorer ships for."""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _use_snippets() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    section = text.split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _use_snippet() -> str:
    return _use_snippets()[0]


def expected_prints(snippet: str) -> list[str]:
    """What the snippet's ``print`` lines say they print: each one's comment, up to two spaces and a bracket (the
    explanation that may follow)."""
    out = []
    for line in snippet.splitlines():
        if line.startswith("print("):
            assert "  # " in line, f"README.md: a print line without a comment saying what it prints: {line!r}"
            out.append(re.split(r"\s{2,}\(", line.split("  # ", 1)[1], maxsplit=1)[0].strip())
    return out


def _run(index: int) -> tuple[dict, list[str]]:
    """The namespace after running the snippet ``index`` (0: the first) alone, in a fresh namespace, and the lines
    it printed."""
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_use_snippets()[index], f"README.md (Use, snippet {index + 1})", "exec"), namespace)  # noqa: S102
    return namespace, [line.strip() for line in printed.getvalue().splitlines()]


def undefined_names(snippet: str) -> list[str]:
    """The names ``snippet`` reads that it neither imports nor assigns (nor are Python's builtins), in order: each
    a NameError when the snippet runs alone. Read from its syntax tree, so no model is loaded."""
    tree = ast.parse(snippet)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    read = [node for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)]
    return list(dict.fromkeys(node.id for node in sorted(read, key=lambda n: (n.lineno, n.col_offset))
                              if node.id not in bound))


def test_every_use_snippet_defines_every_name_it_reads():
    snippets = _use_snippets()
    assert len(snippets) >= 2
    for i, snippet in enumerate(snippets, 1):
        assert undefined_names(snippet) == [], f"README.md's snippet {i} does not run alone"


def test_undefined_names_finds_what_a_snippet_takes_from_another():
    assert undefined_names("from a import b\nx = b(1)\nprint(x, y, len(z))\n") == ["y", "z"]
    assert undefined_names("import os.path\nfor i in range(2):\n    print(os.sep, i)\n") == []
    assert undefined_names("model, tokenizer = load_builtin_model()\n") == ["load_builtin_model"]


def test_expected_prints_reads_the_comments():
    snippet = 'x = 1\nprint(x)  # 1  (one)\nprint("a  b")  # a  b\ny = 2  # not a print\n'
    assert expected_prints(snippet) == ["1", "a  b"]


def test_the_use_snippet_loads_its_model_and_data_first():
    snippet = _use_snippet()
    first = snippet.index("pipeline(")
    assert snippet.index("model, tokenizer = load_builtin_model()") < first
    assert 'load_builtin_model(name="smollm2")' in snippet[:first]  # the real model, one line away
    assert 'name="qwen2.5-coder-0.5b"' in snippet[:first]
    assert re.search(r"^context, question = ", snippet[:first], re.M)


def test_the_use_snippet_says_what_the_built_in_model_is_for():
    comments = " ".join(line.split("#", 1)[1] for line in _use_snippet().splitlines() if "#" in line)
    comments = " ".join(comments.split())
    assert "1.1M-parameter toy" in comments and "not for judging presses" in comments
    assert len(expected_prints(_use_snippet())) >= 2  # the answers it prints, each with what it should print


@pytest.mark.slow
def test_the_use_snippet_runs_on_the_built_in_model_and_prints_what_it_says():
    from kvpress_phase import ChunkedStridePress, PhaseAwarePress
    from kvpress_phase.core.phase import compressed_length

    namespace, printed = _run(0)
    assert printed == expected_prints(_use_snippet())
    example = namespace["example"]
    assert printed[0] == f"{example['answer'][0]} | {example['answer'][0]}"  # the answer is the reference
    assert isinstance(namespace["answer"], str)
    press = namespace["press"]
    n = namespace["tokenizer"](namespace["context"], return_tensors="pt").input_ids.shape[1]
    # the press recorded the prefill it compressed: the context (and its BOS or chat template), as many entries as
    # compressed_length says for that many tokens
    stats = press.stats[0]
    assert stats.seq_len >= n and stats.compressed_length == compressed_length(stats.seq_len, 8, 0.5)
    assert namespace["pooled"].mode == "pool" and namespace["zipped"].compression_ratio == 0.5
    # the defaults compress nothing (README: a ratio must be given)
    assert ChunkedStridePress().compression_ratio == 0.0 and PhaseAwarePress().compression_ratio == 0.0


def _code(snippet: str) -> str:
    """The snippet without its comments."""
    return "\n".join(line.split("#", 1)[0] for line in snippet.splitlines())


def _loaded_models(snippet: str) -> list[str]:
    """The model names the snippet's code (not its comments) loads, in order."""
    return re.findall(r'load_builtin_model\(name="([^"]+)"\)', _code(snippet))


def test_the_recommended_press_snippet_loads_a_model_a_scorer_ships_for():
    from kvpress_phase.presses.learned_scorer import shipped_scorers

    snippet = _use_snippets()[1]
    loaded = _loaded_models(snippet)
    code = _code(snippet)
    assert loaded and code.index("load_builtin_model(") < code.index('scorer="kvzap"')
    shipped = {model for model, _ in shipped_scorers().values()}
    assert loaded[0] in shipped, f"the snippet loads {loaded[0]!r}; scorers ship for {sorted(shipped)}"
    for model in shipped:  # the comments name every model a scorer ships for
        assert model in snippet


def test_the_built_in_model_refuses_kvzap_naming_the_models_the_snippet_names():
    """The snippet says the built-in model refuses ``scorer="kvzap"`` and names the models that have a scorer."""
    from kvpress_phase import PhaseAwarePress, load_builtin_model
    from kvpress_phase.presses.learned_scorer import shipped_scorers

    model, _ = load_builtin_model()
    with pytest.raises(ValueError, match="no shipped KVzap scorer fits") as refused:
        PhaseAwarePress(0.5, scorer="kvzap").post_init_from_model(model)
    for name, _ in shipped_scorers().values():
        assert f"--model {name}" in str(refused.value)


@pytest.mark.slow
@pytest.mark.real_model
def test_the_recommended_press_snippet_runs_alone_on_its_model_and_prints_what_it_says():
    from kvpress_phase import GlobalBudgetPress, cache_summary

    namespace, printed = _run(1)
    assert printed == expected_prints(_use_snippets()[1])
    press = namespace["press"]
    assert isinstance(press, GlobalBudgetPress)
    assert namespace["example"]["answer"][0] in namespace["answer"]
    summary = cache_summary(press)  # one budget over the model: every layer recorded, about half the cache kept
    assert summary.layers == namespace["model"].config.num_hidden_layers and 0.45 < summary.achieved_ratio < 0.5
