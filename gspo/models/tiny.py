"""The built-in models' tokenizers and architectures: character-level tokenizers (plain, and
a chat one with Qwen2.5-style turn markers and tool calls) and the 4-layer Qwen3 / Qwen3-MoE
configs that scripts/make_*_model.py train into gspo/assets/. gspo.models.loading re-exports them.
"""

from __future__ import annotations

# one token per character; the vocabulary covers every built-in task
CHARS = "0123456789+-*=() "
SPECIAL = ("<pad>", "<eos>", "<unk>")


# the chat model's tokenizer (`build_chat_tokenizer`): characters, plus the chat markers of
# Qwen2.5-style templates (the turn markers are special tokens, the tool-call ones are not: a
# tool call must survive decoding with special tokens skipped, as in Qwen's own tokenizer)
CHAT_CHARS = CHARS + "/abcdefghijklmnopqrstuvwxyz{}\":,_.\n"
CHAT_SPECIAL = ("<pad>", "<|im_end|>", "<unk>", "<|im_start|>")
CHAT_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Hermes-style tool calls (Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
# tools are listed in a system turn by name and parameters (the tiny model has no room for schemas)
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}("
    "{{ t.function.parameters.properties | list | join(', ') }}){% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for call in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>tool\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_char_tokenizer():
    """A character-level tokenizer made locally with the `tokenizers` library."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for c in CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_chat_tokenizer():
    """The chat model's tokenizer (`tiny-tool`): one token per character of CHAT_CHARS, the chat
    markers as single tokens, `<|im_end|>` as EOS, and CHAT_TEMPLATE as its chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(CHAT_SPECIAL + CHAT_MARKERS)}
    for c in CHAT_CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in CHAT_SPECIAL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in CHAT_MARKERS])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>",
                                  additional_special_tokens=["<|im_start|>"])
    out.chat_template = CHAT_TEMPLATE
    return out


# the trunk both built-in models share (the MoE model replaces each MLP with experts)
_TINY_TRUNK = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=64,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
)


def tiny_config(vocab_size: int, **overrides):
    """The built-in dense model's architecture: a 4-layer Qwen3 of about 0.8M parameters."""
    from transformers import Qwen3Config

    return Qwen3Config(**{"vocab_size": vocab_size, **_TINY_TRUNK, **overrides})


def tiny_moe_config(vocab_size: int, **overrides):
    """The built-in MoE model: a 4-layer Qwen3-MoE, 8 experts, top-2 (about 2.6M parameters,
    0.8M active per token, like the dense tiny model)."""
    from transformers import Qwen3MoeConfig

    experts = dict(moe_intermediate_size=192, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.01)
    return Qwen3MoeConfig(**{"vocab_size": vocab_size, **_TINY_TRUNK, **experts, **overrides})
