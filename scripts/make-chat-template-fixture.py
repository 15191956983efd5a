#!/usr/bin/env python3
"""Writes tests/models/fixtures/chat/expected.json: chat templates of the shapes published
models use (ChatML as Qwen2.5's, Llama 3's headers with bos_token and `| trim`, Zephyr's with
eos_token and Python string methods) and, for a few conversations, what transformers renders
(`transformers.utils.chat_template_utils.render_jinja_template`, the function behind
`tokenizer.apply_chat_template`): the whole conversation, and all but its last (assistant)
message with add_generation_prompt=True (the prompt of a supervised example).

    python3 scripts/make-chat-template-fixture.py     # needs transformers (5.x), jinja2
"""
import json
import os

from transformers.utils.chat_template_utils import render_jinja_template

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models", "fixtures", "chat")

CHATML = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3 = """{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"""

ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\\n' + message['content'].strip() + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\\n'  + message['content'] + eos_token }}
{% else %}
{{ raise_exception('Only user, system and assistant roles are supported, found ' + message['role']) }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""

SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "</s>"}

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "system", "content": "Answer tersely."},
        {"role": "user", "content": "  Capital of France?  "},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome, of course.\nIt is."},
    ],
    [{"role": "user", "content": "Ünïcödé ✓"}, {"role": "assistant", "content": "ok ✓"}],
]


def main():
    cases = []
    for name, template in [("chatml", CHATML), ("llama3", LLAMA3), ("zephyr", ZEPHYR)]:
        for conv in CONVERSATIONS:
            full = render_jinja_template([conv], chat_template=template, **SPECIAL)[0][0]
            prompt = render_jinja_template([conv[:-1]], chat_template=template, add_generation_prompt=True, **SPECIAL)[0][0]
            cases.append({"template": name, "messages": conv, "full": full, "prompt": prompt})
    bad = [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]
    try:
        render_jinja_template([bad], chat_template=ZEPHYR, **SPECIAL)
        raise AssertionError("expected the template to raise")
    except Exception as e:  # jinja2's TemplateError
        raised = str(e)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump({"templates": {"chatml": CHATML, "llama3": LLAMA3, "zephyr": ZEPHYR},
                   "special": SPECIAL, "cases": cases,
                   "raises": {"template": "zephyr", "messages": bad, "message": raised}},
                  f, indent=1, ensure_ascii=False)
    print("wrote", len(cases), "cases to", OUT)


if __name__ == "__main__":
    main()
