"""Chat templates: render a conversation and split it into prompt / target text segments.

Masking per turn works with *any* Jinja chat template by prefix rendering: for every
assistant turn ``i`` we render ``messages[:i]`` with the generation prompt (the prompt) and
``messages[:i+1]`` (prompt + reply); the difference is the reply, which is the target. The
segments are tokenised one by one, so a target boundary can never fall inside a token, and
the split matches inference, where generation starts right after the generation prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def _compile(template: str) -> Any:
    # The same sandboxed compiler as `apply_chat_template`, so renders are identical to HF's.
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template)


def make_renderer(tokenizer: Any, chat_template: str | None = None) -> Renderer:
    """A fast ``render(messages, add_generation_prompt) -> str`` for ``tokenizer``.

    Calls the compiled Jinja template directly: ``apply_chat_template`` re-validates its
    arguments on every call, which costs more than the render itself.
    """
    source = chat_template or getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
    if isinstance(source, dict):  # several named templates: HF uses "default"
        source = source.get("default") or next(iter(source.values()))
    compiled = _compile(source)
    special = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    special.setdefault("bos_token", "")
    special.setdefault("eos_token", tokenizer.eos_token or "")

    def render(messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **special)

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
