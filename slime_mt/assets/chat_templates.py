"""Chat templates written for this project in the formats of Qwen2.5, Qwen2.5-VL / Qwen3-VL and Qwen3.

Each renders ``messages`` (``content`` a string or a list of ``{"type": "text"|"image", ...}`` parts;
images render as ``<|vision_start|><|image_pad|><|vision_end|>``, one pad per image, expanded later
by the processor), ``tools`` (the ``# Tools`` system block), assistant ``tool_calls`` and ``tool``
messages (``<tool_response>`` inside a user turn), and ``add_generation_prompt``.
Qwen3 additionally renders ``<think>`` blocks only for assistant turns after the last user query
(a user message that is not a ``<tool_response>`` wrapper; the last message always, earlier ones
when they have reasoning), and honours ``enable_thinking=False`` with an empty think block in the
generation prompt. On text conversations the Qwen3 template renders byte for byte what Qwen3's
official template renders (tests/unit/rollout/test_template_check.py compares them).
"""

_CONTENT = """
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part.type == 'image' or part.type == 'image_url' or 'image' in part -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type == 'video' -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in part -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"""

_TOOLS_PREAMBLE = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_SUFFIX = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call>'
)

_SYSTEM = """
{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if messages[0].role == 'system' -%}
        {{- render_content(messages[0].content) + '\\n\\n' -}}
    {%- elif DEFAULT_SYSTEM -%}
        {{- DEFAULT_SYSTEM + '\\n\\n' -}}
    {%- endif -%}
    {{- "TOOLS_PREAMBLE" -}}
    {%- for tool in tools -%}
        {{- '\\n' -}}{{- tool | tojson -}}
    {%- endfor -%}
    {{- "TOOLS_SUFFIX<|im_end|>\\n" -}}
{%- elif messages[0].role == 'system' -%}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' -}}
{%- elif DEFAULT_SYSTEM -%}
    {{- '<|im_start|>system\\n' + DEFAULT_SYSTEM + '<|im_end|>\\n' -}}
{%- endif -%}
""".replace("TOOLS_PREAMBLE", _TOOLS_PREAMBLE).replace("TOOLS_SUFFIX", _TOOLS_SUFFIX)

_TOOL_CALLS = """
{%- macro render_tool_calls(message, lead) -%}
    {%- for tool_call in message.tool_calls -%}
        {%- if (loop.first and lead) or not loop.first -%}{{- '\\n' -}}{%- endif -%}
        {%- set call = tool_call.function if tool_call.function else tool_call -%}
        {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' -}}
        {%- if call.arguments is string -%}{{- call.arguments -}}{%- else -%}{{- call.arguments | tojson -}}{%- endif -%}
        {{- '}\\n</tool_call>' -}}
    {%- endfor -%}
{%- endmacro -%}
"""

_TOOL_MESSAGE = """
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\\n' -}}
        {%- endif -%}
"""

_QWEN25_BODY = """
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'user' or message.role == 'system' or (message.role == 'assistant' and not message.tool_calls) -%}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant' -}}
        {%- if message.content -%}{{- '\\n' + render_content(message.content) -}}{%- endif -%}
        {{- render_tool_calls(message, true) -}}
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}TOOL_MESSAGE
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
""".replace("TOOL_MESSAGE", _TOOL_MESSAGE)

_QWEN3_BODY = """
{%- set ns2 = namespace(multi_step_tool=true, last_query=messages|length - 1) -%}
{%- for message in messages[::-1] -%}
    {%- set text = render_content(message.content) if message.content else '' -%}
    {%- if ns2.multi_step_tool and message.role == 'user'
          and not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}
        {%- set ns2.multi_step_tool = false -%}
        {%- set ns2.last_query = (messages|length - 1) - loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'user' or message.role == 'system' -%}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set content = render_content(message.content) if message.content else '' -%}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' -%}
        {%- if not reasoning and '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
        {%- endif -%}
        {%- if loop.index0 > ns2.last_query and (loop.last or reasoning) -%}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}
        {%- else -%}
            {{- '<|im_start|>assistant\\n' + content -}}
        {%- endif -%}
        {%- if message.tool_calls -%}{{- render_tool_calls(message, content) -}}{%- endif -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}TOOL_MESSAGE
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- endif -%}
{%- endif -%}
""".replace("TOOL_MESSAGE", _TOOL_MESSAGE)


def _template(default_system: str, body: str) -> str:
    head = "{%- set DEFAULT_SYSTEM = " + repr(default_system) + " -%}"
    return head + _CONTENT + _TOOL_CALLS + _SYSTEM + body


QWEN25 = _template("You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", _QWEN25_BODY)
QWEN25_VL = _template("You are a helpful assistant.", _QWEN25_BODY)
QWEN3 = _template("", _QWEN3_BODY)
QWEN3_VL = QWEN3

TEMPLATES = {"qwen2.5": QWEN25, "qwen2.5-vl": QWEN25_VL, "qwen3": QWEN3, "qwen3-vl": QWEN3_VL}
