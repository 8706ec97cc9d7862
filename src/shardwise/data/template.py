"""Chat templates: render a conversation and split it into prompt / target text segments.

Masking per turn works with *any* Jinja chat template by prefix rendering: for every
assistant turn ``i`` we render ``messages[:i]`` with the generation prompt (the prompt) and
``messages[:i+1]`` (prompt + reply); the difference is the reply, which is the target. The
segments are tokenised one by one, so a target boundary can never fall inside a token, and
the split matches inference, where generation starts right after the generation prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError

# Used when the tokenizer has no template, and shipped with the bundled tokenizer. Every turn
# ends with the EOS token (the bundled tokenizer's EOS is the end-of-turn marker `<|end|>`),
# so the model learns to stop after each reply.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

ROLES = ("system", "user", "assistant")

Segment = tuple[str, bool]  # (text, is_target)
Renderer = Callable[[Sequence[dict[str, str]], bool], str]


def template_origin(tokenizer: Any, chat_template: str | None) -> str:
    """Where the template a renderer uses comes from, for errors: the config field, the
    tokenizer file transformers read it from, or shardwise's default."""
    if chat_template:
        return "data.chat_template (data.sft.chat_template in a train config)"
    if not getattr(tokenizer, "chat_template", None):
        return "shardwise's default chat template"
    d = Path(getattr(tokenizer, "name_or_path", "") or ".")
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
        if (d / name).is_file():
            return str(d / name)
    return f"the chat template of tokenizer {str(d)!r}"


# A conversation every template is rendered on once, with and without the generation prompt,
# before any record: a template that crosses a bound on it is refused before the data is read.
PROBE: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi?"},
    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"},
    {"role": "assistant", "content": "Bye."})  # fmt: skip


def _compile(template: str, origin: str) -> Any:
    """The template compiled by a bounded copy of transformers' sandbox (`apply_chat_template`'s
    options, filters and globals, so renders are identical to HF's) with time, size and number
    bounds (shardwise.data.sandbox)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from shardwise.data.sandbox import BoundedSandbox, TemplateLimitError

    try:
        hf_env = _compile_jinja_template("").environment
        return BoundedSandbox.like(hf_env).from_string(template)
    except TemplateLimitError as exc:
        raise ShardwiseError(f"{origin}: field 'chat_template': {exc}.") from None
    except (jinja2.TemplateError, RecursionError, MemoryError, SyntaxError, ValueError) as exc:
        raise ShardwiseError(f"{origin}: field 'chat_template': not a valid Jinja template: {exc}.") from None


def make_renderer(tokenizer: Any, chat_template: str | None = None) -> Renderer:
    """A fast ``render(messages, add_generation_prompt) -> str`` for ``tokenizer``.

    Calls the compiled Jinja template directly: ``apply_chat_template`` re-validates its
    arguments on every call, which costs more than the render itself. Every render is bounded
    (shardwise.data.sandbox); a template that crosses a bound or tries to leave the sandbox
    raises a ShardwiseError naming the template's file, on PROBE already where it does there.
    """
    from jinja2.exceptions import SecurityError

    from shardwise.data.sandbox import TemplateLimitError, budget

    source = chat_template or getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
    if isinstance(source, dict):  # several named templates: HF uses "default"
        source = source.get("default") or next(iter(source.values()))
    origin = template_origin(tokenizer, chat_template)
    if not isinstance(source, str):
        raise ShardwiseError(f"{origin}: field 'chat_template': expected a string, got {type(source).__name__}.")
    compiled = _compile(source, origin)
    env = compiled.environment
    special = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    special.setdefault("bos_token", "")
    special.setdefault("eos_token", tokenizer.eos_token or "")

    def render(messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        env.start(budget(messages))
        try:
            return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **special)
        except TemplateLimitError as exc:
            raise ShardwiseError(f"{origin}: field 'chat_template': {exc}; shardwise refuses the template.") from None
        except SecurityError as exc:
            raise ShardwiseError(f"{origin}: field 'chat_template': the template tried to leave Jinja's sandbox "
                                 f"({exc}); shardwise refuses it.") from None  # fmt: skip
        except RecursionError:
            raise ShardwiseError(f"{origin}: field 'chat_template': the template recursed deeper than Python "
                                 "allows; shardwise refuses it.") from None
        except MemoryError:
            raise ShardwiseError(f"{origin}: field 'chat_template': the render ran out of memory.") from None

    for generation_prompt in (True, False):
        try:
            render(PROBE, generation_prompt)
        except ShardwiseError:
            raise
        except Exception:  # ordinary template errors (e.g. "no system role") are the data's to raise
            continue
    return render


def split_segments(messages: Sequence[dict[str, str]], render: Renderer, *, where: str) -> list[Segment]:
    """Split the rendered conversation into (text, is_target) segments; replies are targets.

    ``where`` ("file:line") goes into errors: a template that raises on this conversation,
    or one that renders earlier turns differently once later turns exist (not prefix-stable,
    so turns cannot be masked separately).
    """
    segments: list[Segment] = []
    done = ""  # text already assigned to segments
    try:
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = render(messages[:i], True)
            full = render(messages[: i + 1], False)
            if not prompt.startswith(done) or not full.startswith(prompt):
                raise ShardwiseError(
                    f"{where}: field 'messages[{i}]': the chat template is not prefix-stable (rendering "
                    "more turns changes earlier text), so assistant turns cannot be masked one by one. "
                    "Use a template whose output only grows with each message, or set data.chat_template."
                )
            if len(prompt) > len(done):
                segments.append((prompt[len(done) :], False))
            segments.append((full[len(prompt) :], True))
            done = full
        # The last full render is the whole conversation when it ends with a reply: reuse it.
        final = done if messages and messages[-1]["role"] == "assistant" else render(messages, False)
    except ShardwiseError:
        raise
    except Exception as exc:  # jinja TemplateError, raise_exception(...) in templates, KeyError
        raise ShardwiseError(f"{where}: field 'messages': the chat template failed: {exc}") from exc
    if not final.startswith(done):
        raise ShardwiseError(f"{where}: field 'messages': the chat template is not prefix-stable.")
    if len(final) > len(done):
        segments.append((final[len(done) :], False))
    return segments
