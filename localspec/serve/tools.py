"""Tools in the server: a chat request rendered with the model's own chat template
(its tools, tool calls and tool results included), and the plan for reading tool calls
back out of the reply.

tool_choice `none` shows the tools (as llama-server does) but reads no calls; `auto`
lets the model decide; `required` and a named function are forced by ending the prompt
inside a call: the format's opening (Qwen: `<tool_call>`), then `{"name": "` (the model
names the function) or `{"name": NAME, "arguments":`. The model can only continue it,
and the parser reads the reply as that prefix's continuation. There is no grammar behind
it: a model can still write a call that does not parse (or run out of max_tokens inside
one), which then comes back as content, prefix included, as every unparsable call does.
"""

from __future__ import annotations

from dataclasses import dataclass

from localspec.core.backend import Model
from localspec.core.chat_template import TemplateError, render_chat, template_for
from localspec.core.toolcalls import (
    ToolCallParser,
    ToolFormat,
    detect_format,
    tool_names,
)
from localspec.serve.protocol import GenRequest, bad_request


@dataclass(frozen=True)
class ToolPlan:
    """How to read one request's reply: the model's call format, the request's tool
    names, the text that ended its prompt (fed to the parser first), and whether more
    than one call may be returned (parallel_tool_calls)."""

    fmt: ToolFormat
    names: tuple[str, ...]
    prefix: str = ""
    parallel: bool = True

    def parser(self) -> ToolCallParser:
        parser = ToolCallParser(self.fmt, tool_names=self.names)
        parser.feed(self.prefix)  # opens a call: nothing comes out yet
        return parser


def uses_tools(req: GenRequest) -> bool:
    return bool(req.tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in req.messages)


def request_prompt(model: Model, req: GenRequest) -> tuple[str, ToolPlan | None]:
    """The prompt text of a chat request, and its ToolPlan (None when no calls are to
    be read). A template that cannot render the request, or does not show tools to the
    model while the request has some, is a 400."""
    try:
        if uses_tools(req) and not template_for(model, tools=True).caps.tools:
            raise TemplateError("it does not show tools, tool calls or tool results to the model; "
                                "use a model whose template has tools")
        text = render_chat(model, req.messages, tools=req.tools or None, **req.template_kwargs)
    except TemplateError as exc:
        raise bad_request(f"This model's chat template cannot render the request: {exc}",
                          "tools" if req.tools else "messages", "invalid_value") from None
    if not req.tool_choice.parses:
        return text, None
    fmt = detect_format(template_for(model, tools=True).source)
    plan = ToolPlan(fmt, tuple(tool_names(req.tools)), req.tool_choice.prefix(fmt), req.parallel_tool_calls)
    return text + plan.prefix, plan
