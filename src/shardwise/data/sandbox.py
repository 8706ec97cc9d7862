"""A bounded Jinja sandbox for chat templates: time, size and number bounds on every render.

A chat template comes with a tokenizer, often downloaded: it is untrusted input. Jinja's
sandbox (the one transformers' `apply_chat_template` uses) stops it from reaching Python, but
not from hanging (`{% for a in range(99999) %}{% for b in range(99999) %}`) or exhausting
memory (`{{ 'a' * 4000000000 }}`, a string doubled in a loop, `'x'|center(4000000000)`).
:class:`BoundedSandbox` is that sandbox with three bounds, checked while a template renders:

- time: RENDER_SECONDS per render, checked at every loop iteration, call, filter, operator
  and output piece. Pure Python between those points is bounded by the size bound.
- size: no string, list or output above the render's character budget (`budget`), checked
  *before* an operation that could build one (`*`, `+`, `~`, `%`, `join`, `replace`,
  `center`, `indent`, `translate`, `tojson`'s indent, `lipsum`, ...) and after every call.
- numbers: no integer above MAX_INT_BITS from `*` or `**`; no width or count argument above
  the budget to a method of a builtin value.

A bound crossed raises :class:`TemplateLimitError`; an escape attempt, Jinja's SecurityError.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg
from jinja2.visitor import NodeTransformer

# Seconds one render may take. A real template renders a conversation in well under a
# millisecond (the bundled one: ~20 us); the largest records shardwise reads (MAX_RECORD_BYTES,
# copied a few times by the template) take about a second. Ten seconds is ten times that,
# and all a hostile template can waste before preflight refuses it.
RENDER_SECONDS = 10.0
# Characters any string, list or output of one render may hold: the template's own markup
# (1 MiB: the largest published chat templates are ~20 KB of source) plus four copies of the
# conversation's text (a template wraps each message in markup and may repeat some of it,
# e.g. a system prompt per turn).
FIXED_CHARS = 1 << 20
CONTENT_COPIES = 4
# Bits of an integer from `*` or `**`: a template has no use for numbers past 64 bits; 2^16
# bits keeps every arithmetic step microseconds long.
MAX_INT_BITS = 1 << 16
# Characters of template source: 50 times the largest published chat templates.
MAX_TEMPLATE_CHARS = 1 << 20
# Indent tojson may pretty-print with (templates use 2 or 4).
MAX_JSON_INDENT = 16


class TemplateLimitError(jinja2.exceptions.TemplateRuntimeError):
    """A template crossed one of the sandbox's bounds; the message names the bound."""


def budget(messages: Sequence[dict[str, Any]]) -> int:
    """The character budget of one render of `messages` (see FIXED_CHARS)."""
    text = sum(len(v) for m in messages for v in m.values() if isinstance(v, str))
    return FIXED_CHARS + CONTENT_COPIES * text


def _size(obj: Any, limit: int) -> int:
    """Characters `obj` would print as, counted until past `limit` (then any larger number):
    repeated references count each time, as `str()` would expand them."""
    total, stack = 0, [obj]
    while stack and total <= limit:
        o = stack.pop()
        if isinstance(o, (str, bytes)):
            total += len(o)
        elif isinstance(o, int):
            total += o.bit_length() // 3 + 1
        elif isinstance(o, dict):
            total += 2 + 2 * len(o)
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(o)
            stack.extend(o)
        else:
            total += 16
    return total


class _Bounds(NodeTransformer):
    """Rewrites a parsed template so loops and `~` pass through the bounded helpers: a `for`
    iterates `shardwise_iter(iterable)` and `a ~ b` becomes `shardwise_concat([a, b])`."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "shardwise_iter", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), "shardwise_concat", [], [], None, None,
                            lineno=node.lineno)  # fmt: skip


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with time, size and number bounds (module docstring). Call
    :meth:`start` before each render to set its deadline and character budget."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.deadline = math.inf
        self.max_chars = FIXED_CHARS
        self.concat = self._concat  # buffers: the output, macros, {% set %} blocks

    @classmethod
    def like(cls, hf_env: jinja2.Environment) -> BoundedSandbox:
        """A bounded sandbox configured as transformers' chat-template environment `hf_env`:
        its options, extensions, filters (tojson) and globals (namespace, raise_exception)."""
        env = cls(trim_blocks=hf_env.trim_blocks, lstrip_blocks=hf_env.lstrip_blocks,
                  extensions=[type(e) for e in hf_env.extensions.values()])  # fmt: skip
        env.filters.update(hf_env.filters)
        env.globals.update(hf_env.globals)
        env.filters = {name: env._bounded_filter(name, f) for name, f in env.filters.items()}
        env.filters["shardwise_iter"] = env._iter
        env.filters["shardwise_concat"] = env._concat_filter
        env.globals["lipsum"] = env._lipsum(env.globals["lipsum"])
        return env

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        """An unsafe attribute raises at once (Jinja's sandbox returns an undefined value that
        raises only when used, so `{{ self._TemplateReference__context }}` printed nothing)."""
        raise jinja2.exceptions.SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} "
                                              "object is unsafe.")

    def start(self, max_chars: int, seconds: float | None = None) -> None:
        """Arm the bounds for one render."""
        self.max_chars = max_chars
        self.deadline = time.monotonic() + (RENDER_SECONDS if seconds is None else seconds)

    # ------------------------------------------------------------ checks

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the render took longer than the time bound ({RENDER_SECONDS:g} s per render)")

    def fits(self, chars: int, what: str) -> None:
        if chars > self.max_chars:
            raise TemplateLimitError(f"{what} would hold more than the size bound of {self.max_chars} characters "
                                     f"({FIXED_CHARS} plus {CONTENT_COPIES} times the conversation's text)")

    def _check_result(self, value: Any, what: str) -> Any:
        if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
            self.fits(_size(value, self.max_chars), what)
        return value

    def _int_bits(self, bits: float, what: str) -> None:
        if bits > MAX_INT_BITS:
            raise TemplateLimitError(f"{what} would be an integer of more than {MAX_INT_BITS} bits (the number bound)")

    # ------------------------------------------------------------ operators, calls, filters

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        if len(source) > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(f"the template is {len(source)} characters, over the bound of "
                                     f"{MAX_TEMPLATE_CHARS}")  # fmt: skip
        return _Bounds().visit(super()._parse(source, name, filename))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and type(left) is str and type(right) is str:  # the common case, exact and fast
            if len(left) + len(right) > self.max_chars:
                self.fits(len(left) + len(right), "a sum")
            return left + right
        self.tick()
        seq = (str, bytes, list, tuple)
        if operator == "*":
            if isinstance(left, int) and isinstance(right, seq):
                left, right = right, left
            if isinstance(left, seq) and isinstance(right, int):
                self.fits(_size(left, self.max_chars) * max(right, 0), f"{type(left).__name__} * {right}")
            elif isinstance(left, int) and isinstance(right, int):
                self._int_bits(left.bit_length() + right.bit_length(), "a product")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            self._int_bits(max(right, 0) * left.bit_length(), f"{left} ** {right}")
        elif operator == "+" and isinstance(left, seq) and isinstance(right, seq):
            self.fits(_size(left, self.max_chars) + _size(right, self.max_chars), "a sum")
        elif operator == "%" and isinstance(left, str):
            self._check_format(left, right if isinstance(right, tuple) else (right,))
        return self._check_result(super().call_binop(context, operator, left, right), f"the result of {operator!r}")

    def _check_format(self, fmt: str, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> None:
        """A width or precision in a format string (literal, or an argument: `%*d`, `{:{w}}`)
        is a number of characters to build: bounded like any other."""
        for digits in re.findall(r"\d+", fmt):
            self.fits(int(digits) if len(digits) < 20 else math.inf, f"a format width {digits[:20]}")  # type: ignore[arg-type]
        for v in [*args, *(kwargs or {}).values()]:
            if isinstance(v, int) and not isinstance(v, bool) and v > self.max_chars:
                self.fits(v, f"a format argument {v}")

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.tick()
        args = self._check_call(obj, args, kwargs)
        rv = super().call(context, obj, *args, **kwargs)
        self.tick()
        return self._check_result(rv, f"the result of {getattr(obj, '__name__', 'a call')}()")

    def _check_call(self, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
        recv, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
        if not isinstance(recv, (str, bytes, int, list, tuple, dict)) or isinstance(recv, bool):
            return args
        if isinstance(recv, str) and name in ("format", "format_map"):
            self._check_format(recv, args, kwargs)
        for v in [*args, *kwargs.values()]:  # widths, counts, lengths (`(1).to_bytes(n)`, `zfill(n)`)
            if isinstance(v, int) and not isinstance(v, bool):
                self.fits(v, f"{name}({v})")
        if isinstance(recv, (str, bytes)):
            if name == "join" and args:
                items = list(args[0])
                self.fits(sum(_size(i, self.max_chars) for i in items) + len(recv) * len(items), "a join")
                return (items, *args[1:])
            if name == "replace" and len(args) >= 2:
                self.fits(_replaced(recv, args[0], args[1], args[2] if len(args) > 2 else -1), "a replace")
            if name == "expandtabs":
                self.fits(len(recv) + recv.count("\t" if isinstance(recv, str) else b"\t")
                          * int((args or [kwargs.get("tabsize", 8)])[0]), "expandtabs")  # fmt: skip
            if name == "translate" and args and isinstance(args[0], dict):
                longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
                self.fits(len(recv) * max(longest, 1), "a translate")
        return args

    def _bounded_filter(self, name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        skip = 1 if _PassArg.from_obj(f) is not None else 0  # context / eval context first

        @functools.wraps(f)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self.tick()
            if name in ("join", "sum") and len(args) > skip and not isinstance(args[skip], (str, list, tuple)):
                args = (*args[:skip], list(args[skip]), *args[skip + 1 :])  # a range, a generator: sized
            self._check_filter(name, list(args[skip:]), kwargs)
            rv = f(*args, **kwargs)
            self.tick()
            return self._check_result(rv, f"the result of |{name}")

        return bounded

    def _check_filter(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> None:
        if not args:
            return
        value, rest = args[0], args[1:]

        def arg(i: int, key: str, default: Any) -> Any:
            return rest[i] if len(rest) > i else kwargs.get(key, default)

        text = value if isinstance(value, str) else None
        if name in ("center", "indent", "wordwrap", "truncate", "batch", "slice", "format"):
            for v in [*rest, *kwargs.values()]:
                if isinstance(v, int) and not isinstance(v, bool) and name != "format":
                    self.fits(v, f"|{name}({v})")
        if name == "format" and text is not None:
            self._check_format(text, rest, kwargs)
        elif name == "replace" and text is not None and len(rest) >= 2:
            count = arg(2, "count", None)
            self.fits(_replaced(text, rest[0], rest[1], -1 if count is None else count), "|replace")
        elif name == "indent" and text is not None:
            width = arg(0, "width", 4)
            per_line = len(width) if isinstance(width, str) else int(width)
            self.fits(len(text) + (text.count("\n") + 1) * per_line, "|indent")
        elif name == "wordwrap" and text is not None:
            wrap = arg(3, "wrapstring", None) or "\n"
            self.fits(len(text) + (len(text) // max(int(arg(0, "width", 79)), 1) + 1) * len(wrap), "|wordwrap")
        elif name == "join" and isinstance(value, (list, tuple)):
            sep = arg(0, "d", "")
            self.fits(sum(_size(i, self.max_chars) for i in value) + len(str(sep)) * len(value), "|join")
        elif name == "sum" and isinstance(value, (list, tuple)):
            self.fits(sum(_size(i, self.max_chars) for i in value) + _size(arg(1, "start", 0), self.max_chars),
                      "|sum")  # fmt: skip
        elif name == "tojson":
            indent = arg(1, "indent", None)
            width = len(indent) if isinstance(indent, str) else (indent or 0)
            if width > MAX_JSON_INDENT:
                raise TemplateLimitError(f"|tojson(indent={width}) is over the indent bound of {MAX_JSON_INDENT}")

    # ------------------------------------------------------------ loops, `~`, buffers, lipsum

    @property
    def _iter(self) -> Callable[..., Any]:
        @jinja2.pass_context  # never constant-folded at compile time
        def shardwise_iter(context: Any, iterable: Any) -> Any:
            for item in iterable:
                self.tick()
                yield item

        return shardwise_iter

    @property
    def _concat_filter(self) -> Callable[..., Any]:
        @jinja2.pass_context
        def shardwise_concat(context: Any, parts: list[Any]) -> str:
            self.fits(sum(_size(p, self.max_chars) for p in parts), "a '~' concatenation")
            return self._concat(str(p) for p in parts)

        return shardwise_concat

    def _concat(self, parts: Any) -> str:
        out, n, limit, deadline = [], 0, self.max_chars, self.deadline
        for p in parts:
            n += len(p)
            if n > limit:
                self.fits(n, "the output")
            if time.monotonic() > deadline:
                self.tick()
            out.append(p)
        return "".join(out)

    def _lipsum(self, lipsum: Callable[..., str]) -> Callable[..., str]:
        @functools.wraps(lipsum)
        def bounded(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
            self.fits(int(n) * int(max) * 16, f"lipsum({n}, max={max})")  # a word: 16 characters at most
            return lipsum(n, html, min, max)

        return bounded


def _replaced(text: str | bytes, old: Any, new: Any, count: Any) -> int:
    """Length of `text.replace(old, new, count)`, without building it."""
    if not isinstance(old, type(text)) or not isinstance(new, type(text)):
        return len(text)
    k = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        k = min(k, count)
    return len(text) + k * max(len(new) - len(old), 0)

