"""A Qwen3.5-style chat template (Jinja), written for the shaped model folders from the format.

The conversation is ``<|im_start|>ROLE\\n...<|im_end|>\\n`` turns. ``tools`` go into the system
turn with the XML calling convention; assistant ``tool_calls`` are written back as
``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>``
(arguments given as an object, or as a JSON string holding one); ``tool`` results are user
turns of ``<tool_response>`` blocks (consecutive ones share a turn). Reasoning
(``reasoning_content``, or a ``<think>`` block inside the content) is kept for the assistant
turns after the last user message and dropped from earlier ones. The generation prompt opens
``<think>\\n`` (the model writes only ``</think>``); with ``enable_thinking=false`` it writes an
empty ``<think>\\n\\n</think>\\n\\n`` instead. ``deltaserve serve`` reads the template and picks
the ``qwen3_xml`` tool parser and the ``qwen3`` reasoning parser from it.
"""

from __future__ import annotations

QWEN35_CHAT_TEMPLATE = r"""
{%- macro render_value(value) -%}
{%- if value is string -%}{{ value }}{%- else -%}{{ value | tojson }}{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}
<|im_start|>system
{% if messages and messages[0].role == 'system' and messages[0].content %}{{ messages[0].content }}

{% endif -%}
# Tools

These functions are available. Each is described by a JSON schema:

<tools>
{% for tool in tools %}{{ (tool.function if tool.function is defined else tool) | tojson }}
{% endfor -%}
</tools>

To call a function, write a block like this one, and nothing after it:

<tool_call>
<function=the_function_name>
<parameter=first_parameter>
its value
</parameter>
<parameter=second_parameter>
a value may run
over several lines
</parameter>
</function>
</tool_call>

Give every required parameter. You may explain your reasoning before a call, never after it. Several blocks call several functions. When no function fits, answer in plain text.<|im_end|>
{% elif messages and messages[0].role == 'system' -%}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' and loop.first -%}
{%- elif message.role == 'assistant' -%}
{%- set content = message.content if message.content is string else '' -%}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' -%}
{%- if '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
{%- set content = content.split('</think>')[-1] -%}
{%- endif -%}
<|im_start|>assistant
{% if loop.index0 > ns.last_user and reasoning | trim -%}
<think>
{{ reasoning | trim }}
</think>

{% endif -%}
{{ content | trim }}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if not loop.first or content | trim -%}{{ '\n\n' if loop.first else '\n' }}{%- endif -%}
<tool_call>
<function={{ fn.name }}>
{% if fn.arguments is mapping -%}
{%- for key, value in fn.arguments | items -%}
<parameter={{ key }}>
{{ render_value(value) }}
</parameter>
{% endfor -%}
{%- elif fn.arguments is string and fn.arguments | trim not in ('', '{}') -%}
<parameter=arguments>
{{ fn.arguments }}
</parameter>
{% endif -%}
</function>
</tool_call>
{%- endfor -%}
<|im_end|>
{% elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
<|im_start|>user
{% endif -%}
<tool_response>
{{ message.content }}
</tool_response>
{% if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
<|im_end|>
{% endif -%}
{%- else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false -%}
<think>

</think>

{% else -%}
<think>
{% endif -%}
{%- endif -%}
"""
