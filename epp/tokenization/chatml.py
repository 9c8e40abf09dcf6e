"""The ChatML special tokens and chat template of the shipped tokenizer.

Every message is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; the generation prompt is
``<|im_start|>assistant\\n``. With tools, a system message lists them as JSON lines inside
``<tools>``; an assistant's tool calls are ``<tool_call>`` JSON blocks; a tool result is a ``tool``
message.
"""

from __future__ import annotations

START = "<|im_start|>"
END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"

CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}{%- continue %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set function = call['function'] if call['function'] is defined else call %}"
    "{{- '\\n<tool_call>\\n' }}"
    "{{- {'name': function['name'], 'arguments': function['arguments']} | tojson }}"
    "{{- '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
