"""Chat templates (Jinja, as ``tokenizer.chat_template`` holds them) that redraft gives the
tokenizers it makes itself: the dummy targets' (:mod:`redraft.models.dummy`) and the tiny test
targets' (:mod:`redraft.models.tiny`). Real targets bring their own template.
"""

# ChatML (SmolLM2, Qwen): <|im_start|>role\ncontent<|im_end|>\n
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# FastChat's vicuna_v1.1 conversation template (what Vicuna v1.3 and the ReDrafter paper use).
VICUNA_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}"
    "{% set system = 'A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user\\'s questions.' %}"
    "{% set loop_messages = messages %}{% endif %}"
    "{{ bos_token + system }}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}{{ ' USER: ' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ASSISTANT: ' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ ' ASSISTANT:' }}{% endif %}"
)
