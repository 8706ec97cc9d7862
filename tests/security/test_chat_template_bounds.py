"""A chat template cannot hang, exhaust memory or leave Jinja's sandbox (shardwise.data.sandbox).

Jinja's sandbox stopped code from running, but nested loops hung preflight with no time limit
and `{{ 'a' * 4000000000 }}` was OOM-killed. Every render is now bounded (time, size,
numbers); a template crossing a bound, or reaching for Python internals, is refused with a
ShardwiseError naming the tokenizer file that holds it. Escape payloads here would write a
marker file if they ever ran.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise.data.sandbox as sandbox
from shardwise.data import default_tokenizer_path, load_tokenizer
from shardwise.data.template import make_renderer
from shardwise.errors import ShardwiseError

CONVERSATION = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]
SECONDS = 0.5  # the time bound in these in-process tests (RENDER_SECONDS is 10 s)

# name -> (template, the bound the error names)
EXHAUSTING = {
    "nested loops": ("{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}", "time bound"),
    "string times 4e9": ("{{ 'a' * 4000000000 }}", "size bound"),
    "4e9 times string": ("{{ 4000000000 * 'a' }}", "size bound"),
    "list times 1e6": ("{{ ['a' * 100000] * 1000000 }}", "size bound"),
    "power": ("{{ 2 ** 100000000 }}", "number bound"),
    "doubling with ~": ("{% set ns = namespace(x='ab') %}{% for i in range(64) %}{% set ns.x = ns.x ~ ns.x %}"
                        "{% endfor %}{{ ns.x }}", "size bound"),
    "doubling with +": ("{% set ns = namespace(x='ab') %}{% for i in range(64) %}{% set ns.x = ns.x + ns.x %}"
                        "{% endfor %}", "size bound"),
    "center filter": ("{{ 'x'|center(4000000000) }}", "size bound"),
    "center method": ("{{ 'x'.center(4000000000) }}", "size bound"),
    "format width": ("{{ '{:>4000000000}'.format(1) }}", "size bound"),
    "percent width": ("{{ '%4000000000d' % 1 }}", "size bound"),
    "to_bytes": ("{{ (1).to_bytes(4000000000, 'big') }}", "size bound"),
    "join of a range": ("{{ range(99999)|join('a' * 1000000) }}", "size bound"),
    "replace": ("{{ ('a' * 1000000)|replace('a', 'a' * 1000000) }}", "size bound"),
    "indent": ("{{ ('\n' * 1000000)|indent(1000000) }}", "size bound"),
    "translate": ("{{ ('a' * 1000000).translate({97: 'b' * 1000000}) }}", "size bound"),
    "lipsum": ("{{ lipsum(100000, max=100000) }}", "size bound"),
    "tojson indent": ("{{ messages|tojson(indent=1000000000) }}", "indent bound"),
    "exponential macro": ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                          "time bound"),
    "macro buffer": ("{% macro m() %}{% for i in range(99999) %}{{ 'a' * 1000000 }}{% endfor %}{% endmacro %}"
                     "{{ m() }}", "bound"),  # time or size: whichever comes first
    "endless recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed"),
}  # fmt: skip


def escapes(marker: Path) -> dict[str, str]:
    """Known ways out of Jinja's sandbox, each trying to create `marker`."""
    cmd = f"touch {marker}"
    return {
        "mro subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "subclasses popen": "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'Popen' %}"
                            f"{{{{ c('{cmd}', shell=True) }}}}{{% endif %}}{{% endfor %}}",
        "cycler globals": f"{{{{ cycler.__init__.__globals__.os.system('{cmd}') }}}}",
        "joiner globals": f"{{{{ joiner.__init__.__globals__.os.system('{cmd}') }}}}",
        "lipsum globals": f"{{{{ lipsum.__globals__['os'].system('{cmd}') }}}}",
        "namespace globals": f"{{{{ namespace.__init__.__globals__['os'].system('{cmd}') }}}}",
        "template reference": "{{ self._TemplateReference__context }}",
        "context via self": f"{{{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('{cmd}') }}}}",
        "namespace dunder": "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
        "format attribute": "{{ '{0.__class__.__mro__}'.format('') }}",
        "getattr filter": "{{ ''|attr('__class__')|attr('__mro__') }}",
        "raise_exception globals": f"{{{{ raise_exception.__globals__['os'].system('{cmd}') }}}}",
        "dict globals": "{{ dict.__call__.__globals__ }}",
        "request-style config": "{{ config.__class__.__init__.__globals__ }}",
    }  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(autouse=True)
def short_time_bound(monkeypatch):
    monkeypatch.setattr(sandbox, "RENDER_SECONDS", SECONDS)


def tokenizer_with(tmp_path: Path, template: str, where: str) -> Path:
    """The bundled tokenizer with `template` in tokenizer_config.json or chat_template.jinja."""
    d = tmp_path / f"tok-{where.replace('.', '-')}"
    shutil.copytree(default_tokenizer_path(), d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    if where == "tokenizer_config.json":
        cfg["chat_template"] = template
    else:
        cfg.pop("chat_template", None)
        (d / "chat_template.jinja").write_text(template)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("name", sorted(EXHAUSTING))
def test_an_exhausting_template_is_refused_naming_its_file_and_bound(tmp_path, tok, name):
    template, bound = EXHAUSTING[name]
    for where in ("tokenizer_config.json", "chat_template.jinja"):
        d = tokenizer_with(tmp_path, template, where)
        start = time.monotonic()
        with pytest.raises(ShardwiseError) as info:
            make_renderer(load_tokenizer(d))  # the probe render, before any record is read
        assert time.monotonic() - start < SECONDS * 4 + 2
        msg = str(info.value)
        assert str(d / where) in msg and "chat_template" in msg and bound in msg, msg


def test_escapes_raise_security_errors_naming_the_file(tmp_path, tok):
    marker = tmp_path / "MARKER"
    for name, template in escapes(marker).items():
        with pytest.raises(ShardwiseError) as info:
            make_renderer(tok, template)
        msg = str(info.value)
        assert "data.chat_template" in msg and ("sandbox" in msg or "unsafe" in msg), (name, msg)
        assert not marker.exists(), name


def test_a_data_dependent_hang_is_refused_at_the_record(tok):
    """The probe conversation passes; a record's content makes the template loop: refused at
    the record's render, within the bound, naming the template."""
    from shardwise.data.template import split_segments

    template = ("{% for m in messages %}{% if m.content == 'spin' %}{% for a in range(99999) %}"
                "{% for b in range(99999) %}{% endfor %}{% endfor %}{% endif %}{{ m.content }}{% endfor %}")  # fmt: skip
    render = make_renderer(tok, template)
    assert split_segments(CONVERSATION, render, where="d.jsonl:1")  # fine on ordinary data
    start = time.monotonic()
    with pytest.raises(ShardwiseError, match=r"data\.chat_template.*time bound"):
        split_segments([{"role": "user", "content": "spin"}, *CONVERSATION[1:]], render, where="d.jsonl:2")
    assert time.monotonic() - start < SECONDS * 4 + 2


def test_real_templates_render_as_transformers_renders_them(tok):
    """The bounds change nothing for a real template: same text as transformers' own sandbox."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    llama3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
              "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
    chatml = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
              "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
              "{% endif %}")
    loop_vars = ("{% for m in messages %}{{ loop.index ~ '/' ~ loop.length ~ (' last' if loop.last else '') ~ ':' "
                 "~ m.content|tojson(indent=2) }}{% endfor %}{% set ns = namespace(n=0) %}"
                 "{% for m in messages if m.role == 'user' %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}")
    for template in (llama3, chatml, loop_vars):
        ours = make_renderer(tok, template)
        theirs = _compile_jinja_template(template)
        for gen in (True, False):
            expected = theirs.render(messages=CONVERSATION, add_generation_prompt=gen, bos_token="<s>",
                                     eos_token="</s>", **{k: v for k, v in tok.special_tokens_map.items()
                                                          if k not in ("bos_token", "eos_token")})  # fmt: skip
            special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
            if "<s>" in expected:  # the same special tokens for both
                expected = theirs.render(messages=CONVERSATION, add_generation_prompt=gen, **special)
            assert ours(CONVERSATION, gen) == expected


# ------------------------------------------------------------------ fuzz

FRAGMENTS = [
    "{{ m.content }}", "{% for x in range({n}) %}{OPEN}{% endfor %}", "{{ 'ab' * {n} }}", "{{ {n} * [1] }}",
    "{{ {n} ** {n} }}", "{{ 'x'|center({n}) }}", "{{ 'x'|indent({n}) }}", "{{ range({n})|join(',') }}",
    "{{ 'a' ~ m.content ~ 'b' }}", "{% set ns.s = ns.s ~ ns.s %}", "{% set ns.s = ns.s + ns.s %}",
    "{{ ('%' ~ {n} ~ 'd') % 1 }}", "{{ '{:>' ~ {n} ~ '}' }}", "{{ ns.s|length }}", "{{ ns.s|replace('a', ns.s) }}",
    "{{ (ns.s * 2)|wordwrap(3) }}", "{{ messages|tojson }}", "{{ loop }}", "{{ m.role|upper }}",
    "{% if m.role == 'user' %}{OPEN}{% endif %}", "{{ raise_exception('no') }}", "{{ ''.__class__ }}",
    "{{ cycler.__init__ }}", "{{ lipsum({n}) }}", "{{ (1).to_bytes({n}, 'big')|length }}", "{{ undefined_name.x }}",
    "{% macro f(k) %}{% if k %}{{ f(k - 1) }}{{ f(k - 1) }}{% endif %}{% endmacro %}{{ f({n}) }}",
    "{{ ns.s.translate({'97': 'xy'}) }}", "{{ namespace.__init__ }}", "{{ self._TemplateReference__context }}",
]  # fmt: skip
NUMBERS = [0, 1, 3, 64, 4096, 99999, 10**6, 4 * 10**9, 10**18]


@st.composite
def templates(draw):
    """A template of nested fragments: loops, multiplications, filters, escapes, numbers."""
    def one(depth: int) -> str:
        frag = draw(st.sampled_from(FRAGMENTS)).replace("{n}", str(draw(st.sampled_from(NUMBERS))))
        inner = one(depth + 1) if depth < 3 and "{OPEN}" in frag else "x"
        return frag.replace("{OPEN}", inner)

    body = "".join(one(0) for _ in range(draw(st.integers(1, 4))))
    return "{% set ns = namespace(s='ab') %}{% for m in messages %}" + body + "{% endfor %}"


@settings(derandomize=True, max_examples=120, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(template=templates(), content=st.text(max_size=40))
def test_fuzz_a_template_renders_or_is_refused_naming_it(tmp_path, tok, template, content):
    """120 generated templates (fixed seed: derandomize): each renders, or fails with a
    ShardwiseError naming the template, within the time bound; no escape ever runs."""
    from shardwise.data.template import split_segments

    marker = tmp_path / "MARKER"
    conversation = [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]
    start = time.monotonic()
    try:
        render = make_renderer(tok, template)
        split_segments(conversation, render, where="d.jsonl:1")
    except ShardwiseError as exc:
        assert "data.chat_template" in str(exc) or "d.jsonl:1" in str(exc), str(exc)
    # the probe's two renders and the record's: each within the bound
    assert time.monotonic() - start < 4 * (SECONDS + 0.5) + 2
    assert not marker.exists()


# ------------------------------------------------------------------ as the user runs it


def test_train_refuses_an_exhausting_template_before_any_rank_starts(tmp_path):
    """`python -m shardwise.train.cli CONFIG` with a tokenizer whose tokenizer_config.json
    template multiplies a string by 4e9 (OOM-killed before): exit 2, the file and the bound
    named, no traceback, no output directory (no rank started), the real 10 s bound untouched."""
    d = tokenizer_with(tmp_path, "{{ 'a' * 4000000000 }}", "tokenizer_config.json")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": CONVERSATION}) + "\n" for _ in range(8)))
    raw = {"model": {"name": "tiny-llama"}, "precision": "fp32",
           "data": {"kind": "sft", "tokenizer": str(d), "sft": {"train_files": [str(data)], "max_length": 32}},
           "run": {"micro_batch": 1, "grad_accum": 1, "device": "cpu", "steps": 1, "nproc": 1},
           "checkpointing": {"output_dir": str(tmp_path / "out")}}  # fmt: skip
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "shardwise.train.cli", str(cfg)], capture_output=True, text=True,
                       timeout=300, check=False, env=env, stdin=subprocess.DEVNULL)  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    message = " ".join(r.stderr.split())
    assert str(d / "tokenizer_config.json") in message and "size bound" in message, message
    assert not (tmp_path / "out" / "checkpoints").exists() and not list((tmp_path / "out").rglob("heartbeat*"))


CONSTRUCTS = [
    "{% for m in messages recursive %}[{{ m.role }}{% if m.kids %}{{ loop(m.kids) }}{% endif %}]{% endfor %}",
    "{% filter upper %}{% for m in messages %}{{ m.content }}{% endfor %}{% endfilter %}",
    "{% macro w(x) %}<{{ caller() }}{{ x }}>{% endmacro %}{% call w('!') %}{{ messages|length }}{% endcall %}",
    "{% for m in messages %}{% if loop.first %}F{% endif %}{{ loop.cycle('a', 'b') }}{{ loop.revindex }}"
    "{% if not loop.last %},{% endif %}{% else %}empty{% endfor %}",
    "{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}{% set x = [1, 2, 3] %}{{ x|sum }}"
    "{{ x|join('-') }}{{ '%s-%d'|format('a', 3) }}{{ '{}!'.format(5) }}{{ 'ab' * 3 }}{{ 2 ** 10 }}{{ '%05d' % 42 }}",
    "{% generation %}{{ messages[0].content }}{% endgeneration %}{{ messages|tojson(indent=2) }}{{ dict(a=1) }}"
    "{% set ns = namespace(a=1) %}{% set ns.a = ns.a + 1 %}{{ ns.a }}{{ messages[0].content|center(9)|indent(2) }}",
    "{% for m in [] %}x{% else %}empty{% endfor %}{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}",
]  # fmt: skip


@pytest.mark.parametrize("template", CONSTRUCTS)
def test_the_bounded_sandbox_renders_every_construct_as_transformers_does(template):
    """Loops (recursive, filtered, with else and loop variables), macros with caller, filter
    blocks, the generation tag, namespace, and the bounded operators and filters within their
    bounds: the same text as transformers' own sandbox."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from shardwise.data.template import _compile

    messages = [{"role": "user", "content": "hi", "kids": [{"role": "k1", "kids": []}]},
                {"role": "assistant", "content": "yo", "kids": []}]  # fmt: skip
    ours = _compile(template, "test")
    ours.environment.start(sandbox.budget(messages))
    assert ours.render(messages=messages) == _compile_jinja_template(template).render(messages=messages)
