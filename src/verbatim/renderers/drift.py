"""Template drift: where re-rendering a chat template changes tokens a harness already holds.

For one conversation, ``analyze`` renders prefixes with the template
(``apply_chat_template``) and checks
- *history stability*: ``render(messages[:c])`` is a token prefix of
  ``render(messages[:c'])`` for consecutive cut points (after each assistant
  message and at the end), hence for every later cut point;
- *generation-prompt stability*: ``render(messages[:k], add_generation_prompt=True)``
  is a token prefix of ``render(messages[:k+1])`` for each assistant message ``k``;
- *tool calls kept*: for each assistant message ``k`` with tool calls, the render of
  ``messages[:k+1]`` differs from the render of the same messages with those calls
  taken away. Where it does not, the template drops the calls the model sampled
  (DeepSeek-V3 with ``content: ""``): a violation of kind ``tool_calls``, cause
  ``tool_calls_dropped``, that is not a prefix-stability one.

Each violation names the first divergent token, a cause from :data:`CAUSES`,
and ``miss_tokens``: the tokens of the earlier render from the divergence on,
which a harness that re-renders history holds in its prefix cache but must
prefill again.

Template variables can be pinned (``TemplateRenderer(..., date_string="...")``);
:data:`DEFAULT_PINS` are pinned for every template that names them, as the
renderers do. The clock is not a variable: the renders of cut ``c`` run with it
set ``c`` days after a fixed start. Where a template reads it, two renders are
first compared on the same day, so the cause names the first divergence that
is not the date; only when nothing else differs is the violation ``date_injected``.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from verbatim.errors import InputError
from verbatim.renderers.conversations import Conversation
from verbatim.renderers.drift_causes import Evidence, classify

CAUSES = (
    "reasoning_stripped", "date_injected", "system_moved", "tool_call_reserialized", "eos_in_history",
    "generation_prompt_dropped", "whitespace_trimmed", "default_system_injected", "bpe_boundary_merge", "other",
    "tool_calls_dropped",
)
CLOCK_START = dt.datetime(2025, 1, 1, 9, 0, 0)
CONTEXT_TOKENS = 4
DEFAULT_PINS: Mapping[str, Any] = {"date_string": "26 Jul 2024"}
"""Variables pinned for a template that names them (Llama 3.x reads the clock unless ``date_string`` is given)."""


def default_pins(template: str) -> dict[str, Any]:
    """The :data:`DEFAULT_PINS` that ``template`` names."""
    return {name: value for name, value in DEFAULT_PINS.items() if re.search(rf"\b{name}\b", template)}


class Violation(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["history", "generation_prompt", "tool_calls"]
    cut: tuple[int, int]
    first_divergence: int
    cause: str
    miss_tokens: int
    before: tuple[str, ...] = ()
    earlier: tuple[str, ...] = ()
    later: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "cut": list(self.cut), "first_divergence": self.first_divergence,
                "cause": self.cause, "miss_tokens": self.miss_tokens,
                "context": {"before": list(self.before), "earlier": list(self.earlier), "later": list(self.later)}}


class Verdict(BaseModel):
    """The drift verdict for one conversation.

    ``prefix_stable`` is the conjunction of ``history_stable`` and
    ``generation_prompt_stable``; ``tool_calls_kept`` says no tool call was
    dropped. All four are None when the template refuses the conversation
    (``unsupported``) or raised on it (``problem``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    conversation: int
    prefix_stable: bool | None
    violations: tuple[Violation, ...] = ()
    unsupported: str | None = None
    problem: str | None = None

    @property
    def history_stable(self) -> bool | None:
        return self._stable("history")

    @property
    def generation_prompt_stable(self) -> bool | None:
        return self._stable("generation_prompt")

    @property
    def tool_calls_kept(self) -> bool | None:
        return self._stable("tool_calls")

    def _stable(self, kind: str) -> bool | None:
        return None if self.prefix_stable is None else not any(v.kind == kind for v in self.violations)

    def as_json(self) -> dict[str, Any]:
        data = {"conversation": self.conversation, "prefix_stable": self.prefix_stable,
                "history_stable": self.history_stable, "generation_prompt_stable": self.generation_prompt_stable,
                "tool_calls_kept": self.tool_calls_kept, "violations": [v.as_json() for v in self.violations]}
        if self.unsupported is not None:
            data["unsupported"] = self.unsupported
        if self.problem is not None:
            data["problem"] = self.problem
        return data


class TemplateRefused(Exception):
    """The template called ``raise_exception``: it does not support this conversation's shape."""


@dataclass
class Rendered:
    text: str
    ids: list[int]
    starts: list[int]
    dates: list[str] = field(default_factory=list)


@contextmanager
def _clock(day: int, record: list[str]):
    """Make transformers' ``strftime_now`` read a fixed clock ``day`` days after :data:`CLOCK_START`."""
    import transformers.utils.chat_template_utils as chat_utils

    moment = CLOCK_START + dt.timedelta(days=day)

    class FixedClock(dt.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> dt.datetime:
            return _Recording(moment, record)

    original = chat_utils.datetime
    chat_utils.datetime = FixedClock
    try:
        yield
    finally:
        chat_utils.datetime = original


class _Recording:
    """A datetime stand-in that records every string the template formats from it."""

    def __init__(self, moment: dt.datetime, record: list[str]) -> None:
        self.moment, self.record = moment, record

    def strftime(self, fmt: str) -> str:
        text = self.moment.strftime(fmt)
        self.record.append(text)
        return text


class TemplateRenderer:
    """Renders conversations with one Jinja chat template and one tokenizer, as ``apply_chat_template`` does.

    ``variables`` go to the template as pinned values, over :func:`default_pins`
    unless ``pin_defaults`` is False.
    """

    def __init__(self, template: str, tokenizer: Any, *, pin_defaults: bool = True, **variables: Any) -> None:
        self.template, self.tokenizer = template, tokenizer
        self.variables = {**(default_pins(template) if pin_defaults else {}), **variables}
        self._backend = tokenizer.backend_tokenizer

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None, *,
               add_generation_prompt: bool, day: int = 0) -> Rendered:
        import jinja2

        dates: list[str] = []
        try:
            with _clock(day, dates):
                text = self._render_text(messages, tools, add_generation_prompt)
        except jinja2.TemplateSyntaxError as exc:
            raise InputError(f"the template does not parse: line {exc.lineno}: {exc.message}") from None
        except jinja2.TemplateError as exc:
            if type(exc) is jinja2.TemplateError:  # raised by the template's own raise_exception()
                raise TemplateRefused(" ".join(str(exc).split())) from None
            raise
        encoding = self._backend.encode(text, add_special_tokens=False)
        return Rendered(text, list(encoding.ids), [start for start, _ in encoding.offsets], dates)

    def _render_text(self, messages: Sequence[dict], tools: Sequence[dict] | None,
                     add_generation_prompt: bool) -> str:
        conversation = [dict(m) for m in messages]
        tools = list(tools) if tools else None
        if conversation:
            return self.tokenizer.apply_chat_template(
                conversation, tools=tools, chat_template=self.template, add_generation_prompt=add_generation_prompt,
                tokenize=False, **self.variables)
        # apply_chat_template refuses an empty conversation; the prompt before an opening
        # assistant message is still a real prompt, so render it the same way underneath.
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[conversation], tools=tools, chat_template=self.template,
                                            add_generation_prompt=add_generation_prompt,
                                            **{**self.tokenizer.special_tokens_map, **self.variables})
        return rendered[0]

    def pieces(self, ids: Sequence[int]) -> tuple[str, ...]:
        """Each token decoded on its own (a byte-fallback piece of a longer character may show as U+FFFD)."""
        return tuple(self._backend.decode([i], skip_special_tokens=False) for i in ids)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` stops being a prefix of ``b``; None when it is one."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) <= len(b) else len(b)


def analyze(renderer: TemplateRenderer, conversation: Conversation, index: int) -> Verdict:
    """The drift verdict of ``conversation`` (number ``index`` in its set) under ``renderer``'s template."""
    messages, tools = list(conversation.messages), conversation.tools
    cache: dict[tuple[int, bool, int], Rendered] = {}

    def render(cut: int, generation: bool, day: int | None = None) -> Rendered:
        day = cut if day is None else day
        if (cut, generation, day) not in cache:
            cache[cut, generation, day] = renderer.render(messages[:cut], tools, add_generation_prompt=generation,
                                                          day=day)
        return cache[cut, generation, day]

    def compare(kind: str, cut: tuple[int, int], generation: bool) -> Violation | None:
        earlier, later, dated = _pair(render, cut, generation)
        return _compare(renderer, conversation, kind, cut, earlier, later, render, dated)

    replies = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
    cuts = sorted({k + 1 for k in replies} | {len(messages)})
    try:
        violations = [v for c, c2 in zip(cuts, cuts[1:]) if (v := compare("history", (c, c2), False)) is not None]
        for k in replies:
            if _prompt_or_none(render, k) is not None:
                found = compare("generation_prompt", (k, k + 1), True)
                violations += [found] if found is not None else []
        stable = not violations
        violations += [v for k in replies if (v := _dropped_calls(renderer, messages, tools, render, k)) is not None]
    except TemplateRefused as exc:
        return Verdict(conversation=index, prefix_stable=None, unsupported=str(exc))
    return Verdict(conversation=index, prefix_stable=stable, violations=tuple(violations))


def _dropped_calls(renderer: TemplateRenderer, messages: list[dict], tools: Any, render: Any,
                   k: int) -> Violation | None:
    """A ``tool_calls`` violation when the template writes assistant message ``k`` the same without its calls.

    ``first_divergence`` is where the template's turn starts in the render of
    ``messages[:k+1]``; ``later`` shows that turn. Nothing cached is prefilled
    again (``miss_tokens`` 0): what a re-rendering harness loses is the calls.
    """
    if not messages[k].get("tool_calls"):
        return None
    later = render(k + 1, False)
    bare = {key: value for key, value in messages[k].items() if key != "tool_calls"}
    try:
        without = renderer.render(messages[:k] + [bare], tools, add_generation_prompt=False, day=k + 1)
    except Exception:  # the template needs the calls to render the turn: it reads them
        return None
    if without.text != later.text:
        return None
    try:
        earlier = render(k, False).ids
    except Exception:  # an empty conversation some templates cannot render
        earlier = []
    start = first_divergence(earlier, later.ids)
    start = len(earlier) if start is None else start
    return Violation(kind="tool_calls", cut=(k, k + 1), first_divergence=start, cause="tool_calls_dropped",
                     miss_tokens=0, before=renderer.pieces(later.ids[max(0, start - CONTEXT_TOKENS):start]),
                     later=renderer.pieces(later.ids[start:start + CONTEXT_TOKENS]))


def _pair(render: Any, cut: tuple[int, int], generation: bool) -> tuple[Rendered, Rendered, bool]:
    """The earlier and later render to compare, and whether only the clock's date tells them apart.

    Where the template reads the clock, the later render first runs on the earlier
    one's day, so a divergence found there is real; the later day is used only
    when that comparison is clean.
    """
    earlier, later = render(cut[0], generation), render(cut[1], False)
    if not (earlier.dates or later.dates):
        return earlier, later, False
    same_day = render(cut[1], False, day=cut[0])
    if first_divergence(earlier.ids, same_day.ids) is not None:
        return earlier, same_day, False
    return earlier, later, True


def _prompt_or_none(render: Any, k: int) -> Rendered | None:
    """The generation prompt after ``k`` messages; None when a template cannot render zero messages."""
    if k > 0:
        return render(k, True)
    try:
        return render(0, True)
    except Exception:  # many templates index messages[0]; an empty conversation is not a real prompt
        return None


def _compare(renderer: TemplateRenderer, conversation: Conversation, kind: str, cut: tuple[int, int],
             earlier: Rendered, later: Rendered, render: Any, dated: bool = False) -> Violation | None:
    d = first_divergence(earlier.ids, later.ids)
    if d is None:
        return None
    evidence = Evidence(kind=kind, cut=cut, earlier=earlier.text, later=later.text,
                        position=earlier.starts[d] if d < len(earlier.starts) else len(earlier.text),
                        earlier_dates=tuple(earlier.dates), messages=conversation.messages,
                        tools=conversation.tools or (), eos_token=str(renderer.tokenizer.eos_token or ""),
                        prompt_start=_text_length(render, cut[0]) if kind == "generation_prompt" else None)
    return Violation(kind=kind, cut=cut, first_divergence=d, cause="date_injected" if dated else classify(evidence),
                     miss_tokens=len(earlier.ids) - d,
                     before=renderer.pieces(earlier.ids[max(0, d - CONTEXT_TOKENS):d]),
                     earlier=renderer.pieces(earlier.ids[d:d + CONTEXT_TOKENS]),
                     later=renderer.pieces(later.ids[d:d + CONTEXT_TOKENS]))


def _text_length(render: Any, cut: int) -> int:
    try:
        return len(render(cut, False).text)
    except Exception:  # an empty conversation some templates cannot render: the prompt is all there is
        return 0


def lint(renderer: TemplateRenderer, conversations: Sequence[Conversation]) -> list[Verdict]:
    """Verdicts for every conversation.

    A conversation the template raises on (not a deliberate refusal) gets a
    verdict with a ``problem`` and the rest are still linted; a template that
    raises on every conversation is bad input.
    """
    verdicts, failures = [], []
    for index, conversation in enumerate(conversations):
        try:
            verdicts.append(_analyze_either_argument_form(renderer, conversation, index))
        except InputError:
            raise
        except Exception as exc:
            problem = f"the template raised on conversation {index}: {type(exc).__name__}: " \
                      f"{' '.join(str(exc).split())[:200]}"
            failures.append(problem)
            verdicts.append(Verdict(conversation=index, prefix_stable=None, problem=problem))
    if failures and len(failures) == len(verdicts):
        raise InputError(failures[0], hint="the template fails on every conversation" if len(failures) > 1 else None)
    return verdicts


def _analyze_either_argument_form(renderer: TemplateRenderer, conversation: Conversation, index: int) -> Verdict:
    """Tool-call arguments go in as given; a template that crashes on them gets the other form.

    Some templates iterate over argument objects (``|items``), others concatenate
    argument strings (DeepSeek); both forms are valid chat-template input.
    """
    try:
        return analyze(renderer, conversation, index)
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as first:
        other = with_arguments_flipped(conversation)
        if other == conversation:
            raise
        try:
            return analyze(renderer, other, index)
        except Exception:
            raise first from None


def with_arguments_flipped(conversation: Conversation) -> Conversation:
    """The conversation with tool-call arguments as JSON text where they were objects, and back."""
    def flip(arguments: Any) -> Any:
        return json.loads(arguments) if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)

    messages = []
    for message in conversation.messages:
        calls = message.get("tool_calls")
        if calls:
            calls = [{**c, "function": {**c["function"], "arguments": flip(c["function"].get("arguments", {}))}}
                     if isinstance(c.get("function"), dict) else c for c in calls]
            message = {**message, "tool_calls": calls}
        messages.append(message)
    return conversation.model_copy(update={"messages": tuple(messages)})


def exit_code(verdicts: Sequence[Verdict]) -> int:
    """1 when any conversation drifts or loses a tool call, else 2 when the template raised on one or
    refused every one (nothing was linted), else 0."""
    if any(v.violations for v in verdicts):
        return 1
    if any(v.problem is not None for v in verdicts) or nothing_linted(verdicts):
        return 2
    return 0


def nothing_linted(verdicts: Sequence[Verdict]) -> str | None:
    """Why no conversation was linted (the template refused them all), or None if some were."""
    if not verdicts or not all(v.unsupported for v in verdicts):
        return None
    reasons = sorted({str(v.unsupported) for v in verdicts})
    return (f"the template refused all {len(verdicts)} conversations (it raised: {reasons[0]!r}"
            f"{f' and {len(reasons) - 1} other reasons' if len(reasons) > 1 else ''}): nothing was linted")
